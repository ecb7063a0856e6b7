# One precompiled header for every target that includes libtorch.
# torch/torch.h costs ~30 s per translation unit on these machines; with a shared
# PCH a unit costs a few seconds. Targets call meshtrain_use_pch(<target>).
# The PCH is built once, in the object library meshtrain_pch, and reused.
add_library(meshtrain_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch_anchor.cpp)
target_link_libraries(meshtrain_pch PUBLIC torch)
if(MESHTRAIN_PCH)
  target_precompile_headers(meshtrain_pch PRIVATE <torch/torch.h> <vector> <string> <memory>)
endif()

function(meshtrain_use_pch target)
  if(MESHTRAIN_PCH)
    target_precompile_headers(${target} REUSE_FROM meshtrain_pch)
  endif()
endfunction()
