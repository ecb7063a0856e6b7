# Installing meshtrain for other CMake projects (find_package(meshtrain)),
# pkg-config users and Debian (cpack -G DEB):
#   cmake --install build --prefix P      cd build && cpack -G DEB
# Installs the library, the public headers, meshrun and meshtrain, the package
# config (meshtrain::meshtrain carries Torch) and meshtrain.pc.
include(CMakePackageConfigHelpers)

set(MESHTRAIN_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/meshtrain)

install(TARGETS meshtrain EXPORT meshtrainTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# libmeshtrain finds its SentencePiece plugin beside itself.
install(TARGETS meshtrain_sentencepiece LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
# The tools find the library next to them, wherever the prefix is.
set_target_properties(meshrun meshtrain_cli PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
install(TARGETS meshrun meshtrain_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/meshtrain DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/meshtrain/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/meshtrain)

install(EXPORT meshtrainTargets NAMESPACE meshtrain:: DESTINATION ${MESHTRAIN_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/meshtrainConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/meshtrainConfig.cmake INSTALL_DESTINATION ${MESHTRAIN_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/meshtrainConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/meshtrainConfig.cmake ${PROJECT_BINARY_DIR}/meshtrainConfigVersion.cmake
        DESTINATION ${MESHTRAIN_CMAKE_DIR})

# pkg-config: relocatable (paths relative to the .pc file); Torch's include
# directories and ABI flag, which every unit including meshtrain's headers needs.
list(JOIN TORCH_INCLUDE_DIRS " -I" MESHTRAIN_PC_TORCH_INCLUDES)
file(RELATIVE_PATH MESHTRAIN_PC_TO_PREFIX /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
configure_file(${CMAKE_CURRENT_LIST_DIR}/meshtrain.pc.in ${PROJECT_BINARY_DIR}/meshtrain.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/meshtrain.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# The Debian package: dependencies from the binaries' shared libraries
# (dpkg-shlibdeps), plus libtorch-dev (the headers include libtorch's and the
# package config finds Torch) and OpenBLAS (libtorch's BLAS is otherwise the
# ~25x slower reference one).
set(CPACK_PACKAGE_NAME meshtrain)
set(CPACK_PACKAGE_VENDOR "meshtrain")
set(CPACK_PACKAGE_CONTACT "meshtrain developers <meshtrain@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Distributed training for libtorch models from C++: DDP, ZeRO 1-3, pipeline and tensor parallel")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${PROJECT_BINARY_DIR}/lib)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "libtorch-dev, libopenblas0-pthread")
set(CPACK_DEBIAN_COMPRESSION_TYPE gzip)
set(CPACK_GENERATOR DEB)
include(CPack)
