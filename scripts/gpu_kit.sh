#!/usr/bin/env bash
# Gathers, on this (networked Debian 12) machine, everything scripts/gpu_check.sh needs on an offline
# GPU machine into one git-ignored folder, the kit (docs/gpu.md, "GPU kit"):
#   <kit>/prefix/   the Debian packages the build needs (headers, CMake/pkg-config files, shared
#                   libraries), downloaded with apt-get download and unpacked with dpkg -x;
#                   pkg-config files rewritten to be relocatable (${pcfiledir}), docs dropped
#   <kit>/wheels/   cp312 manylinux wheels of the peers bench/gpu_bench.py compares against that the
#                   GPU machine lacks, and transformers at our pin for bench/model_bench.py
#                   (versions from requirements.txt)
#   <kit>/bin/pkg-config   pkgconf from the kit (the GPU machine may have none)
#   <kit>/env.sh    sourced by gpu_check.sh: CMAKE_PREFIX_PATH, PKG_CONFIG, PKG_CONFIG_PATH,
#                   LD_LIBRARY_PATH, PIP_NO_INDEX/PIP_FIND_LINKS; the one place the kit is configured
#   <kit>/MANIFEST.txt     what is inside (packages with versions, wheels, sizes)
# The .deb files themselves stay in a cache beside the build trees (build/gpu_kit_debs), not in
# the kit. Idempotent: a package or wheel already downloaded is not fetched again; the prefix is
# unpacked again only when the package list changed.
#
# Not in the kit: the compiler, CMake, ninja, Python, torch, numpy, safetensors, pytest, nanobind
# and scikit-build-core (the GPU machine has them), libc/libstdc++/zlib/libbz2/libssl (every
# Debian or Ubuntu system has them; libc must be the system's own), and Open MPI (optional in the
# build; its runtime closure is tens of MiB and libopenmpi-dev pulls in gfortran: nothing in the
# GPU check uses MPI).
#
#   scripts/gpu_kit.sh           build or refresh the kit in .gpukit (GPU_KIT=<dir> for another)
#   scripts/gpu_kit.sh --list    print the packages and wheels it would gather; fetches nothing
#   scripts/gpu_kit.sh --help
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: what CMakeLists.txt finds (simdjson, libzip, liburing, CLI11, GoogleTest, curl.h:
# the header only; libcurl is loaded at run time when the machine has it) and
# the shared libraries they link (the -dev packages depend on them), plus pkgconf for
# pkg_check_modules. libxxhash-dev without its libxxhash0: only its headers are used (XXH3 is
# compiled in; a libxxhash.so.0 on the kit's LD_LIBRARY_PATH would also be the copy every other
# library of the GPU machine's processes gets).
KIT_DEBS=(libsimdjson-dev libsimdjson14
          libzip-dev libzip4
          liburing-dev liburing2
          libxxhash-dev
          libssl-dev
          libcli11-dev
          libcurl4-openssl-dev
          libgtest-dev
          libfuse3-dev libfuse3-3
          pkgconf-bin libpkgconf3)
# Peers that the GPU machine does not have (its Python packages: /work/.library/device/KINDS.md),
# and transformers at our pin (the machine has 5.17; bench/model_bench.py and
# tensorferry.transformers are tested with requirements.txt's); their other requirements (torch,
# numpy, typer, humanize, huggingface-hub, tokenizers, regex, accelerate 1.15) are there.
KIT_WHEELS=(fastsafetensors runai-model-streamer transformers)
KIT_PYTHON_VERSION=3.12

kit=${GPU_KIT:-.gpukit}
cache=${GPU_KIT_CACHE:-build/gpu_kit_debs}

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

# name==version of each wheel, from requirements.txt (the versions the project measures).
wheel_pins() {
  local name pin
  for name in "${KIT_WHEELS[@]}"; do
    pin=$(grep -iE "^${name}==" requirements.txt || true)
    if [ -z "$pin" ]; then
      echo "gpu_kit: $name has no '==' pin in requirements.txt" >&2
      return 1
    fi
    echo "$pin"
  done
}

case "${1:-}" in
  -h | --help) usage; exit 0 ;;
  --list | --dry-run)
    echo "kit: $kit (debs cached in $cache)"
    echo "debian packages (apt-get download + dpkg -x into $kit/prefix):"
    printf '  %s\n' "${KIT_DEBS[@]}"
    echo "wheels (cp${KIT_PYTHON_VERSION/./} manylinux x86_64, into $kit/wheels):"
    wheel_pins | sed 's/^/  /'
    exit 0 ;;
  "") ;;
  *) echo "gpu_kit: unknown argument $1 (--list, --help)" >&2; exit 2 ;;
esac

[ "$(dpkg --print-architecture)" = amd64 ] || {
  echo "gpu_kit: the GPU machine is x86-64; run this on an amd64 Debian machine" >&2
  exit 1
}
mkdir -p "$kit" "$cache"
kit=$(cd "$kit" && pwd)
cache=$(cd "$cache" && pwd)

# --- Debian packages -----------------------------------------------------------------------------
if ! apt-cache show "${KIT_DEBS[0]}" >/dev/null 2>&1; then
  echo "[kit] apt-get update (package lists missing)"
  apt-get update -qq
fi
debs=()
for p in "${KIT_DEBS[@]}"; do
  version=$(apt-cache policy "$p" | awk '/Candidate:/ {print $2}')
  if [ -z "$version" ] || [ "$version" = "(none)" ]; then
    echo "gpu_kit: no candidate version of $p (apt-get update?)" >&2
    exit 1
  fi
  # apt-get download names files <name>_<version with ':' as %3a>_<arch>.deb
  file=$(ls "$cache/${p}_${version//:/%3a}_"*.deb 2>/dev/null | head -n 1 || true)
  if [ -z "$file" ]; then
    echo "[kit] downloading $p $version"
    (cd "$cache" && apt-get download -qq -o APT::Sandbox::User=root "$p=$version")
    file=$(ls "$cache/${p}_${version//:/%3a}_"*.deb | head -n 1)
  fi
  debs+=("$file")
done

stamp="$kit/prefix/.debs"
want=$(printf '%s\n' "${debs[@]##*/}")
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[kit] prefix up to date (${#debs[@]} packages)"
else
  echo "[kit] unpacking ${#debs[@]} packages into $kit/prefix"
  rm -rf "$kit/prefix"
  mkdir -p "$kit/prefix"
  for d in "${debs[@]}"; do dpkg -x "$d" "$kit/prefix"; done
  rm -rf "$kit/prefix/usr/share/doc" "$kit/prefix/usr/share/man" "$kit/prefix/usr/share/lintian" \
         "$kit/prefix/usr/share/bug"
  # pkg-config files name /usr: make every path relative to the file's own folder.
  while IFS= read -r pc; do
    rel=$(realpath --relative-to="$(dirname "$pc")" "$kit/prefix/usr")
    sed -i -E "s#^([A-Za-z_]+)=/usr(/|\$)#\\1=\${pcfiledir}/$rel\\2#" "$pc"
  done < <(find "$kit/prefix" -name '*.pc')
  # Absolute symbolic links would point into the host's /usr: make them relative.
  while IFS= read -r link; do
    target=$(readlink "$link")
    ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$kit/prefix$target")" "$link"
  done < <(find "$kit/prefix" -type l -lname '/*')
  echo "$want" > "$stamp"
fi

# pkgconf from the kit, with its own library; a wrapper so the library path stays its own.
mkdir -p "$kit/bin"
cat > "$kit/bin/pkg-config" <<'EOF'
#!/bin/sh
# pkgconf unpacked from Debian's pkgconf-bin into the kit (scripts/gpu_kit.sh).
kit=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$kit/prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  exec "$kit/prefix/usr/bin/pkgconf" "$@"
EOF
chmod +x "$kit/bin/pkg-config"

# --- wheels --------------------------------------------------------------------------------------
mkdir -p "$kit/wheels"
platforms=()
for n in $(seq 39 -1 17); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mapfile -t pins < <(wheel_pins)
for pin in "${pins[@]}"; do
  name=${pin%%==*}
  version=${pin#*==}
  stem=$(echo "$name" | tr '-' '_')
  if ls "$kit/wheels/${stem}-${version}-"*.whl >/dev/null 2>&1; then
    echo "[kit] wheel $pin present"
    continue
  fi
  rm -f "$kit/wheels/${stem}-"*.whl  # one version of each: two would stop the install
  echo "[kit] downloading wheel $pin (cp${KIT_PYTHON_VERSION/./})"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$KIT_PYTHON_VERSION" \
    --implementation cp "${platforms[@]}" -d "$kit/wheels" "$pin"
done

# --- env.sh: the one place the kit configures a build --------------------------------------------
cat > "$kit/env.sh" <<'EOF'
# Sourced by scripts/gpu_check.sh (GPU_KIT=<this folder>); written by scripts/gpu_kit.sh.
# Points CMake, pkg-config, the dynamic linker and pip at this kit, wherever the kit now lies.
TENSORFERRY_KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export TENSORFERRY_KIT
_kit_prefix=$TENSORFERRY_KIT/prefix/usr
_kit_lib=$_kit_prefix/lib/x86_64-linux-gnu
export CMAKE_PREFIX_PATH="$_kit_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
export PKG_CONFIG="$TENSORFERRY_KIT/bin/pkg-config"
export PKG_CONFIG_PATH="$_kit_lib/pkgconfig:$_kit_prefix/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$_kit_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Nothing is fetched: pip finds packages in the kit's wheels or not at all.
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$TENSORFERRY_KIT/wheels" PIP_DISABLE_PIP_VERSION_CHECK=1
unset _kit_prefix _kit_lib
EOF

# --- manifest ------------------------------------------------------------------------------------
{
  echo "tensorferry GPU kit, made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "debian packages:"
  for d in "${debs[@]}"; do dpkg-deb --show --showformat='  ${Package} ${Version}\n' "$d"; done
  echo "wheels:"
  (cd "$kit/wheels" && ls -1 *.whl | sed 's/^/  /')
  echo "size: $(du -sb "$kit" | cut -f1) bytes ($(du -sh "$kit" | cut -f1))"
} > "$kit/MANIFEST.txt"
cat "$kit/MANIFEST.txt"
