include(CMakeFindDependencyMacro)
find_dependency(Threads)
find_dependency(simdjson)
find_dependency(OpenSSL COMPONENTS Crypto)
include("${CMAKE_CURRENT_LIST_DIR}/tensorferryTargets.cmake")
# tensorferry::convert (torch.save checkpoints to safetensors), when it was built and installed:
# it needs libzip, which consumers of the core library alone do not.
if(EXISTS "${CMAKE_CURRENT_LIST_DIR}/tensorferryConvertTargets.cmake")
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(LIBZIP QUIET IMPORTED_TARGET libzip)
  endif()
  if(TARGET PkgConfig::LIBZIP)
    include("${CMAKE_CURRENT_LIST_DIR}/tensorferryConvertTargets.cmake")
  endif()
endif()
# tensorferry::mpi (the cooperative loader's collective over MPI), when it was built and
# installed: it needs an MPI, which consumers of the core library alone do not.
if(EXISTS "${CMAKE_CURRENT_LIST_DIR}/tensorferryMpiTargets.cmake")
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    include("${CMAKE_CURRENT_LIST_DIR}/tensorferryMpiTargets.cmake")
  endif()
endif()
