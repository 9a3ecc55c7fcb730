include(CMakeFindDependencyMacro)
find_dependency(Threads)
find_dependency(simdjson)
include("${CMAKE_CURRENT_LIST_DIR}/tensorferryTargets.cmake")
