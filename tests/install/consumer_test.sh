#!/usr/bin/env bash
# The installed package works for a consumer as docs/architecture.md promises: `cmake --install`
# of this build into a scratch prefix, then a separate project that does
# find_package(tensorferry 0.1 REQUIRED), links tensorferry::tensorferry (and tensorferry::mpi
# when this build made it), builds, and runs a program that writes, opens and loads a checkpoint.
# A version that does not match (find_package(tensorferry 9)) must be refused.
# Usage: consumer_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/tensorferry-install-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" > "$scratch/install.log" ||
  { cat "$scratch/install.log"; echo "FAIL: cmake --install"; exit 1; }
with_mpi=0  # lib/ or lib64/ (CMAKE_INSTALL_LIBDIR), wherever the package's config went
[ -n "$(find "$scratch/prefix" -name tensorferryMpiTargets.cmake -print -quit)" ] && with_mpi=1
mkdir -p "$scratch/consumer"
cat > "$scratch/consumer/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.25)
project(consumer LANGUAGES CXX)
find_package(tensorferry 0.1 REQUIRED)
add_executable(consumer main.cc)
target_compile_features(consumer PRIVATE cxx_std_20)
target_link_libraries(consumer PRIVATE tensorferry::tensorferry)
if($with_mpi)
  if(NOT TARGET tensorferry::mpi)
    message(FATAL_ERROR "tensorferry::mpi was installed but is not a target")
  endif()
  add_executable(consumer_mpi mpi.cc)
  target_compile_features(consumer_mpi PRIVATE cxx_std_20)
  target_link_libraries(consumer_mpi PRIVATE tensorferry::mpi)
endif()
CMAKE
cat > "$scratch/consumer/main.cc" <<'CC'
#include <cstdio>
#include <string>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/loader.h"
#include "tensorferry/writer.h"

int main(int argc, char** argv) {
  using namespace tensorferry;
  const std::string path = std::string(argv[1]) + "/m.safetensors";
  std::vector<std::byte> bytes(1000, std::byte{7});
  const std::vector<TensorToWrite> tensors = {{"w", DType::kU8, {1000}, bytes, nullptr}};
  if (Status s = WriteFile(path, tensors, {}); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  auto loader = Loader::Open(path);
  if (!loader.ok()) return std::fprintf(stderr, "%s\n", loader.status().ToString().c_str()), 1;
  auto loaded = (*loader)->Load(Selection::All());
  if (!loaded.ok()) return std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str()), 1;
  const std::byte* p = (*loaded)[0].data();
  if (loaded->size() != 1 || (*loaded)[0].size() != 1000) return 1;
  if (p[0] != std::byte{7} || p[999] != std::byte{7}) return 1;
  std::printf("ok\n");
  return 0;
}
CC
cat > "$scratch/consumer/mpi.cc" <<'CC'
#include "tensorferry/mpi.h"
int main() { return 0; }
CC
cmake -S "$scratch/consumer" -B "$scratch/consumer/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$scratch/prefix" > "$scratch/configure.log" 2>&1 ||
  { cat "$scratch/configure.log"; echo "FAIL: the consumer does not configure"; exit 1; }
cmake --build "$scratch/consumer/build" > "$scratch/build.log" 2>&1 ||
  { cat "$scratch/build.log"; echo "FAIL: the consumer does not build"; exit 1; }
out=$("$scratch/consumer/build/consumer" "$scratch")
[ "$out" = ok ] || { echo "FAIL: the consumer printed: $out"; exit 1; }
# A version this package is not compatible with is refused.
sed -i 's/find_package(tensorferry 0.1 REQUIRED)/find_package(tensorferry 9 REQUIRED)/' \
  "$scratch/consumer/CMakeLists.txt"
if cmake -S "$scratch/consumer" -B "$scratch/consumer/build9" \
  -DCMAKE_PREFIX_PATH="$scratch/prefix" > "$scratch/configure9.log" 2>&1; then
  echo "FAIL: find_package(tensorferry 9) accepted version 0.1"
  exit 1
fi
echo "install consumer: ok (tensorferry::mpi: $([ $with_mpi = 1 ] && echo yes || echo 'not built'))"
