# Strict warnings, only in developer mode: never imposed on consumers of the library. Errors unless
# TENSORFERRY_WERROR is off (a compiler newer than the project's may warn about new things).
function(tensorferry_strict_warnings target)
  if(TENSORFERRY_DEVELOPER_MODE)
    target_compile_options(${target} PRIVATE
      -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Woverloaded-virtual
      -Wimplicit-fallthrough -Wcast-align -Wformat=2)
    if(TENSORFERRY_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
  endif()
endfunction()

# The one helper that registers tests: builds one GoogleTest binary from the given sources and
# registers every TEST in it with CTest (labels come from the test names: *Gpu* tests get "gpu").
function(tensorferry_add_test_binary name)
  add_executable(${name} ${ARGN})
  target_link_libraries(${name} PRIVATE tensorferry::tensorferry GTest::gtest GTest::gtest_main
                        simdjson::simdjson Threads::Threads)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src)
  if(TARGET tensorferry_cli)
    add_dependencies(${name} tensorferry_cli)
    target_compile_definitions(${name} PRIVATE
      TENSORFERRY_CLI_PATH="$<TARGET_FILE:tensorferry_cli>")
  endif()
  target_compile_definitions(${name} PRIVATE
    TENSORFERRY_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  tensorferry_strict_warnings(${name})
  include(GoogleTest)
  # Suites named *Gpu* need a real device (they skip without one): label "gpu", so
  # `ctest -L gpu` runs them on a GPU machine (docs/gpu.md). The suite's name only ("*Gpu*.*": a
  # dot after it): a fake-CUDA test with "Gpu" in its own name (...OnGpu0) is a CPU test.
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 TEST_FILTER "-*Gpu*.*" PROPERTIES LABELS "cpu")
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 TEST_FILTER "*Gpu*.*" PROPERTIES LABELS "gpu")
endfunction()
