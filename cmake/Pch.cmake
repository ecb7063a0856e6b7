# Precompiled headers for the targets that include libtorch, built once each in
# an object library and reused (targets call meshtrain_use_pch(<target>)).
#
# Note [Two precompiled headers]
# A precompiled header is loaded whole by every unit that uses it, and loading
# costs in proportion to its size. torch/torch.h makes a 570 MB one: loading it
# took ~5 s, more than a light unit costs to compile without it (mesh.cpp:
# 6.5 s with it, 1.9 s without; ddp.cpp 7.2-9.0 s with it, 8.4-9.9 s without),
# and only one file of the library includes torch/torch.h. The library, the
# app, the tools and the examples use ATen and torch::nn::Module (383 MB:
# mesh.cpp 2.9 s, ddp.cpp 3.1 s); the tests and benchmarks, which include
# torch/torch.h, keep the whole one (WHOLE_TORCH; test_zero.cpp 13.8 s with
# it, 19.2 s without). Measured on a quiet 2-core AMD EPYC, 2026-12-07.
add_library(meshtrain_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch_anchor.cpp)
target_link_libraries(meshtrain_pch PUBLIC torch)
add_library(meshtrain_torch_pch OBJECT EXCLUDE_FROM_ALL ${CMAKE_CURRENT_LIST_DIR}/pch_anchor.cpp)
target_link_libraries(meshtrain_torch_pch PUBLIC torch)
if(MESHTRAIN_PCH)
  target_precompile_headers(meshtrain_pch PRIVATE <ATen/ATen.h> <torch/nn/module.h> <vector> <string> <memory>)
  target_precompile_headers(meshtrain_torch_pch PRIVATE <torch/torch.h> <vector> <string> <memory>)
endif()

# meshtrain_use_pch(target [WHOLE_TORCH])
function(meshtrain_use_pch target)
  if(MESHTRAIN_PCH)
    if("WHOLE_TORCH" IN_LIST ARGN)
      target_precompile_headers(${target} REUSE_FROM meshtrain_torch_pch)
    else()
      target_precompile_headers(${target} REUSE_FROM meshtrain_pch)
    endif()
  endif()
endfunction()
