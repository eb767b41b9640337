#!/usr/bin/env bash
# BlockAttn's one entry point for newcomers and CI.
#
#   cmake/blockattn.sh demo  [demo args]   build and run the demo (the library's main job):
#                                          distributed causal attention over P MPI ranks
#                                          (P=2 by default; set P=4 to change)
#   cmake/blockattn.sh demo-single [args]  the single-device demo (4 masks, one process)
#   cmake/blockattn.sh test                build and run the whole test suite (ctest),
#                                          then the sanitizer set (test-sanitize)
#   cmake/blockattn.sh test-sanitize       ASan + UBSan over a focused set (build-sanitize/)
#   cmake/blockattn.sh test-aarch64        the single-device and P = 1, 2 suites cross-compiled
#                                          for aarch64, run under qemu-user (build-aarch64/)
#   cmake/blockattn.sh bench [bench args]  build and run the forward/backward benchmark
#                                          (vs sgemm, and vs PyTorch when torch imports),
#                                          then the decode rows (vs a plain read)
#   cmake/blockattn.sh bench-isa [args]    the same for -march=native and -march=x86-64-v3
#                                          (its AVX2 kernels next to PyTorch's, MKL's, oneDNN's
#                                          and OpenBLAS's AVX2 kernels; ISAS="..." for others)
#   cmake/blockattn.sh torch               install PyTorch (CPU peer of the bench) into
#                                          .deps/torch-venv; never needed to build or test
#   cmake/blockattn.sh bench-ring          KV-ring overlap, bytes and memory benchmarks
#   cmake/blockattn.sh bench-plan          planner prediction vs measurement (P = 2)
#   cmake/blockattn.sh bench-balance       packed documents: every layout run (P = 2, 4)
#   cmake/blockattn.sh bench-serve [args]  decode: one device vs a plain read, then over
#                                          P = 1, 2 ranks (tree, ring) next to the planner
#   cmake/blockattn.sh bench-score [args]  score policies and sinks: their cost next to no
#                                          policy, forward and backward, in one run
#   cmake/blockattn.sh plan [plan args]    the planner CLI (tools/plan.cpp)
#   cmake/blockattn.sh plot [out.png]      per-rank per-step work at P = 8, four schedules
#                                          (gnuplot; default docs/schedules_p8.png)
#   cmake/blockattn.sh deps                only install / build the dependencies
#   cmake/blockattn.sh configure [-D...]   only configure the build tree (BUILD_DIR), as the
#                                          other commands do
#   cmake/blockattn.sh cudnn-frontend      install cuDNN's C++ frontend headers (PyPI
#                                          nvidia-cudnn-frontend) into .deps/cudnn-frontend,
#                                          for a CUDA build (BLOCKATTN_ENABLE_CUDNN);
#                                          done by every command when KOKKOS_ROOT has CUDA
#                                          (with cuobjdump, nvdisasm from PyPI into .deps/cuobjdump
#                                          where the toolkit has none: the `cuda` label's
#                                          machine-code check)
#
# Every command first makes sure the dependencies are there (idempotent: when
# nothing is missing this takes a second): Debian packages through apt-get, and
# Kokkos + Kokkos Kernels 3.4.1 with the OpenMP and Serial backends, built from
# Debian's own `trilinos` source package into .deps/ (git-ignored).
#
# Environment:
#   KOKKOS_ROOT   use this Kokkos (any version >= 3.4, any backend) instead of .deps/
#                 (`test` then runs its whole suite on it, in one leg)
#   KOKKOS4_SOURCE  where `test` finds kokkos-4.6.01.tar.xz and
#                 kokkos-kernels-4.6.02.tar.xz for its Kokkos 4.6 leg (default:
#                 ../shared/deps; without them that leg is skipped, said so, and
#                 the Kokkos 3.4.1 leg runs everything)
#   KOKKOS4_BUILD_DIR  that leg's build tree (default: <repo>/build-kokkos4)
#   BLOCKATTN_DEPS  where to build Kokkos (default: <repo>/.deps)
#   BUILD_DIR     build tree (default: <repo>/build; build-<ARCH> when ARCH is set)
#   ARCH          -march= value for our targets (default: native), e.g. x86-64-v3
#   JOBS          parallel build jobs (default: nproc)
#   BENCH_SERVE   0: `bench` runs the forward/backward rows only, not the decode rows
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps=${BLOCKATTN_DEPS:-$repo/.deps}
arch=${ARCH:-}
if [ -n "$arch" ] && [ "$arch" != native ]; then build=${BUILD_DIR:-$repo/build-$arch}
else build=${BUILD_DIR:-$repo/build}; fi
jobs=${JOBS:-$(nproc)}
kokkos_prefix=$deps/kokkos-3.4.1-openmp
# The second leg of `test`: Kokkos 4.6.01 + Kokkos Kernels 4.6.02 (OpenMP +
# Serial) from release tarballs in KOKKOS4_SOURCE (default: ../shared/deps
# beside the repository), never downloaded.
kokkos4_prefix=$deps/kokkos-4.6.01-openmp
kokkos4_source=${KOKKOS4_SOURCE:-$repo/../shared/deps}
kokkos4_build=${KOKKOS4_BUILD_DIR:-$repo/build-kokkos4}
log() { printf '[blockattn] %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# Debian packages the build, the tests and the bench use.
packages=(cmake g++ make dpkg-dev libopenmpi-dev openmpi-bin doctest-dev libbenchmark-dev
          libopenblas-dev libtrilinos-kokkos-dev libtrilinos-kokkos-kernels-dev)

# install_packages [package...]: those missing of the given (default: packages).
install_packages() {
  local missing=() p
  [ $# -gt 0 ] || set -- "${packages[@]}"
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

# Adds deb-src entries mirroring the machine's own enabled `deb` entries (same
# URIs, suites, components and keys), so `apt-get source` works; no host name
# is written here.
add_deb_src() {
  local out=/etc/apt/sources.list.d/blockattn-deb-src.sources entries=""
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && [ "$f" != "$out" ] || continue
    # deb822 stanzas: copy those whose Types include `deb`, as Types: deb-src.
    entries+=$(awk 'BEGIN { RS = ""; ORS = "\n\n" }
      { n = split($0, L, "\n"); deb = 0; body = ""
        for (i = 1; i <= n; i++) {
          if (L[i] ~ /^#/) continue
          if (L[i] ~ /^Types:/) { if (L[i] ~ /[ \t]deb([ \t]|$)/) deb = 1; continue }
          if (L[i] ~ /^Enabled:[ \t]*no/) { deb = 0; break }
          body = body L[i] "\n"
        }
        if (deb) printf "Types: deb-src\n%s\n", body }' "$f")$'\n\n'
  done
  entries=${entries%%$'\n\n'}
  # One-line sources (sources.list and *.list): `deb [opts] URI suite comps`.
  local lines
  lines=$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } |
          sed -n 's/^[[:space:]]*deb[[:space:]]/deb-src /p')
  if [ -z "$entries" ] && [ -z "$lines" ]; then
    log "no apt 'deb' entry found to derive a deb-src entry from"; exit 1
  fi
  log "adding deb-src entries derived from the machine's apt sources ($out)"
  [ -z "$entries" ] || printf '%s\n' "$entries" | as_root tee "$out" >/dev/null
  if [ -n "$lines" ]; then
    printf '%s\n' "$lines" | as_root tee /etc/apt/sources.list.d/blockattn-deb-src.list >/dev/null
  fi
}

# The configure, build and install of one CMake project: cmake_install <source>
# <build dir> <log> <cmake -D...>.
cmake_install() {
  local s=$1 b=$2 l=$3
  shift 3
  cmake -S "$s" -B "$b" -DCMAKE_BUILD_TYPE=Release "$@" >"$l" 2>&1
  cmake --build "$b" -j "$jobs" >>"$l" 2>&1
  cmake --install "$b" >>"$l" 2>&1
}
# Kokkos (both versions, and the aarch64 cross build): OpenMP + Serial, shared.
kokkos_opts=(-DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DKokkos_ENABLE_OPENMP=ON
             -DKokkos_ENABLE_SERIAL=ON)
# Kokkos Kernels: no BLAS, no explicit instantiations (header-only use).
kernels_opts=(-DBUILD_SHARED_LIBS=ON -DKokkosKernels_ENABLE_TPL_BLAS=OFF
              -DKokkosKernels_INST_DOUBLE=OFF -DKokkosKernels_INST_FLOAT=OFF
              -DKokkosKernels_INST_ORDINAL_INT=OFF -DKokkosKernels_INST_OFFSET_INT=OFF
              -DKokkosKernels_INST_OFFSET_SIZE_T=OFF -DKokkosKernels_INST_LAYOUTLEFT=OFF)

# Debian's trilinos source package (its orig tarball) into $deps/src; prints its path.
trilinos_tarball() {
  local src=$deps/src
  mkdir -p "$src"
  if ! ls "$src"/trilinos_*.orig.tar.* >/dev/null 2>&1; then
    if ! apt-get source --print-uris trilinos >/dev/null 2>&1; then
      add_deb_src >&2
      as_root apt-get update -qq >&2
    fi
    log "downloading Debian's trilinos source package"
    (cd "$src" && apt-get source --download-only -qq trilinos >&2 2>/dev/null)
  fi
  ls "$src"/trilinos_*.orig.tar.* | head -n 1
}
# Kokkos 3.4.1 (OpenMP + Serial) and Kokkos Kernels 3.4.1 from Debian's trilinos source.
build_kokkos() {
  [ -f "$kokkos_prefix/.complete" ] && return 0
  local src=$deps/src tarball
  tarball=$(trilinos_tarball)
  log "extracting packages/kokkos and packages/kokkos-kernels from $(basename "$tarball")"
  rm -rf "$src/tree" && mkdir -p "$src/tree"
  tar -xf "$tarball" -C "$src/tree" --strip-components=1 --wildcards \
    '*/packages/kokkos/*' '*/packages/kokkos-kernels/*'
  grep -q 'set(Kokkos_VERSION_MINOR 4)' "$src/tree/packages/kokkos/CMakeLists.txt" ||
    { log "unexpected Kokkos version in $tarball (want 3.4.x)"; exit 1; }
  log "building Kokkos 3.4.1 (OpenMP + Serial) into $kokkos_prefix"
  cmake_install "$src/tree/packages/kokkos" "$deps/build-kokkos" "$deps/kokkos.log" \
    "${kokkos_opts[@]}" -DCMAKE_INSTALL_PREFIX="$kokkos_prefix"
  log "building Kokkos Kernels 3.4.1 (ETI off)"
  cmake_install "$src/tree/packages/kokkos-kernels" "$deps/build-kokkos-kernels" \
    "$deps/kokkos-kernels.log" "${kernels_opts[@]}" -DCMAKE_INSTALL_PREFIX="$kokkos_prefix" \
    -DKokkos_ROOT="$kokkos_prefix"
  rm -rf "$deps/build-kokkos" "$deps/build-kokkos-kernels" "$src/tree"
  touch "$kokkos_prefix/.complete"
}

# Kokkos 4.6.01 and Kokkos Kernels 4.6.02 (OpenMP + Serial; Kernels' ETI off)
# into $kokkos4_prefix from the release tarballs in $kokkos4_source, checked
# against its SHA256SUMS when there is one (kokkos4_available says whether
# the tarballs are there).
kokkos4_available() {
  [ -f "$kokkos4_prefix/.complete" ] ||
    { [ -f "$kokkos4_source/kokkos-4.6.01.tar.xz" ] &&
      [ -f "$kokkos4_source/kokkos-kernels-4.6.02.tar.xz" ]; }
}
build_kokkos4() {
  [ -f "$kokkos4_prefix/.complete" ] && return 0
  local k=$kokkos4_source/kokkos-4.6.01.tar.xz kk=$kokkos4_source/kokkos-kernels-4.6.02.tar.xz
  if [ -f "$kokkos4_source/SHA256SUMS" ]; then
    (cd "$kokkos4_source" && sha256sum --quiet -c SHA256SUMS) ||
      { log "the Kokkos 4.6 tarballs in $kokkos4_source do not match its SHA256SUMS"; exit 1; }
  fi
  local src=$deps/src4
  rm -rf "$src" && mkdir -p "$src"
  tar -xf "$k" -C "$src" && tar -xf "$kk" -C "$src"
  log "building Kokkos 4.6.01 (OpenMP + Serial) and Kokkos Kernels 4.6.02 into $kokkos4_prefix"
  cmake_install "$src/kokkos-4.6.01" "$src/build-kokkos" "$deps/kokkos4.log" "${kokkos_opts[@]}" \
    -DCMAKE_INSTALL_PREFIX="$kokkos4_prefix"
  cmake_install "$src/kokkos-kernels-4.6.02" "$src/build-kokkos-kernels" \
    "$deps/kokkos-kernels4.log" "${kernels_opts[@]}" -DCMAKE_INSTALL_PREFIX="$kokkos4_prefix" \
    -DKokkos_ROOT="$kokkos4_prefix" -DKokkosKernels_ENABLE_ALL_COMPONENTS=OFF \
    -DKokkosKernels_ENABLE_COMPONENT_BLAS=ON -DKokkosKernels_INST_LAYOUTRIGHT=OFF \
    -DKokkosKernels_INST_EXECSPACE_OPENMP=OFF -DKokkosKernels_INST_EXECSPACE_SERIAL=OFF
  rm -rf "$src"
  touch "$kokkos4_prefix/.complete"
}

# ---- aarch64: the tests cross-compiled, run under qemu-user (test-aarch64) ----
# Debian's cross compiler and qemu-user; Open MPI's arm64 runtime unpacked
# (dpkg -x) from Debian's arm64 packages into $aarch64_dir/sysroot, never
# installed: installing libopenmpi-dev:arm64 removes the amd64 one (libevent-dev
# and libpmix-dev are not co-installable), and a libc6:arm64 in
# /lib/aarch64-linux-gnu next to the cross toolchain's libc makes every
# dynamically linked arm64 program that starts a thread hang under qemu
# (pthread_create walks a list the other libc's loader set up).
aarch64_dir=$deps/aarch64
aarch64_build=${AARCH64_BUILD_DIR:-$repo/build-aarch64}
aarch64_packages=(g++-aarch64-linux-gnu qemu-user)
aarch64_mpi_debs=(libopenmpi3 libopenmpi-dev libpmix2 libhwloc15 libevent-2.1-7
                  libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libucx0 libibverbs1
                  librdmacm1 libnl-3-200 libnl-route-3-200 libnuma1 libmunge2 libltdl7 libudev1
                  libgfortran5 zlib1g libxml2 libicu72 liblzma5)
aarch64_sysroot() {
  local root=$aarch64_dir/sysroot
  [ -f "$root/.complete" ] && return 0
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    log "adding arm64 to dpkg's architectures (its package lists; nothing arm64 is installed)"
    as_root dpkg --add-architecture arm64
    as_root apt-get update -qq
  fi
  log "unpacking Open MPI's arm64 runtime from Debian's packages into $root"
  rm -rf "$aarch64_dir/debs" "$root" && mkdir -p "$aarch64_dir/debs" "$root"
  (cd "$aarch64_dir/debs" &&
    apt-get download -qq "${aarch64_mpi_debs[@]/%/:arm64}" 2>"$aarch64_dir/download.log") ||
    { log "apt-get download of the arm64 packages failed ($aarch64_dir/download.log)"; exit 1; }
  local d lib path todo=(libmpi.so.40) seen=" "
  for d in "$aarch64_dir"/debs/*.deb; do dpkg -x "$d" "$root"; done
  ln -sfn /usr/share/openmpi "$root/usr/share/openmpi"  # help files (openmpi-common: all)
  # libmpi and every library it links, transitively, are there or the cross
  # toolchain's (Open MPI's plugins, dlopen'ed, are skipped where theirs are not).
  while [ ${#todo[@]} -gt 0 ]; do
    lib=${todo[0]} todo=("${todo[@]:1}")
    case $seen in *" $lib "*) continue ;; esac
    seen+="$lib "
    [ -e "/usr/aarch64-linux-gnu/lib/$lib" ] && continue
    path=$(find "$root" -name "$lib" -print -quit)
    [ -n "$path" ] || { log "the arm64 Open MPI runtime needs $lib: not in $root"; exit 1; }
    todo+=($(LC_ALL=C aarch64-linux-gnu-readelf -d "$path" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p'))
  done
  touch "$root/.complete"
}
# Kokkos for aarch64 (OpenMP + Serial): 4.6.01 where its tarballs are, else
# 3.4.1 from Debian's trilinos source; sets aarch64_kokkos to its prefix.
aarch64_toolchain() {
  local root=$aarch64_dir/sysroot lib=$aarch64_dir/sysroot/usr/lib/aarch64-linux-gnu
  cat >"$aarch64_dir/toolchain.cmake" <<TOOLCHAIN
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;/usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu $root $aarch64_dir)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
set(CMAKE_EXE_LINKER_FLAGS_INIT "-Wl,-rpath-link,$lib -Wl,-rpath-link,$root/lib/aarch64-linux-gnu")
TOOLCHAIN
}
aarch64_kokkos_build() {
  local src=$aarch64_dir/src
  if kokkos4_available && [ -f "$kokkos4_source/kokkos-4.6.01.tar.xz" ]; then
    aarch64_kokkos=$aarch64_dir/kokkos-4.6.01
  else
    aarch64_kokkos=$aarch64_dir/kokkos-3.4.1
  fi
  [ -f "$aarch64_kokkos/.complete" ] && return 0
  rm -rf "$src" && mkdir -p "$src"
  if [ "$aarch64_kokkos" = "$aarch64_dir/kokkos-4.6.01" ]; then
    tar -xf "$kokkos4_source/kokkos-4.6.01.tar.xz" -C "$src"
    mv "$src/kokkos-4.6.01" "$src/kokkos"
  else
    tar -xf "$(trilinos_tarball)" -C "$src" --strip-components=2 --wildcards '*/packages/kokkos/*'
  fi
  log "cross-building $(basename "$aarch64_kokkos") (OpenMP + Serial) for aarch64"
  cmake_install "$src/kokkos" "$src/build" "$aarch64_dir/kokkos.log" "${kokkos_opts[@]}" \
    -DCMAKE_TOOLCHAIN_FILE="$aarch64_dir/toolchain.cmake" -DCMAKE_INSTALL_PREFIX="$aarch64_kokkos"
  rm -rf "$src"
  touch "$aarch64_kokkos/.complete"
}

# pypi_extract <requirement> <dest> <regex>: PyPI's wheel of <requirement>
# (no dependencies), each member whose name matches the Python regex written
# to <dest>/<the name from the match on>; fails if pip finds no such wheel.
pypi_extract() {
  local tmp rc=0
  tmp=$(mktemp -d)
  if python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "$1"; then
    mkdir -p "$2"
    python3 -c 'import os, re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for n in z.namelist():
    m = re.search(sys.argv[3], n)
    if m and not n.endswith("/"):
        out = os.path.join(sys.argv[2], n[m.start():])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        open(out, "wb").write(z.read(n))' "$tmp"/*.whl "$2" "$3"
  else
    rc=1
  fi
  rm -rf "$tmp"
  return $rc
}

# cuDNN's frontend (header-only) from PyPI's wheel, for BlockAttn::cudnn.
install_cudnn_frontend() {
  local dest=$deps/cudnn-frontend
  [ -f "$dest/include/cudnn_frontend.h" ] && return 0
  log "installing cuDNN's frontend headers (PyPI nvidia-cudnn-frontend) into $dest"
  pypi_extract nvidia-cudnn-frontend "$dest" '^include/'
}

# cuobjdump and nvdisasm (which its -sass runs) for the `cuda` label's
# machine-code check (tests/check_flash_sass.sh), from PyPI's
# nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm of nvcc's major version when
# the toolkit has none (a minimal toolkit); without them that check says
# skipped.
install_cuobjdump() {
  local dest=$deps/cuobjdump
  [ -x "$dest/bin/cuobjdump" ] && [ -x "$dest/bin/nvdisasm" ] && return 0
  local nvcc major tool
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  [ -x "$nvcc" ] || return 0
  [ -x "$(dirname "$nvcc")/cuobjdump" ] && [ -x "$(dirname "$nvcc")/nvdisasm" ] && return 0
  major=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  [ -n "$major" ] || return 0
  log "installing cuobjdump and nvdisasm (PyPI, CUDA $major) into $dest"
  for tool in cuobjdump nvdisasm; do
    if pypi_extract "nvidia-cuda-$tool>=$major,<$((major + 1))" "$dest" "bin/$tool\$"; then
      chmod +x "$dest/bin/$tool"
    else
      log "no nvidia-cuda-$tool for CUDA $major on PyPI: the machine-code check will skip"
    fi
  done
}

# Whether the Kokkos in use has the CUDA backend.
kokkos_has_cuda() {
  local k=${KOKKOS_ROOT:-$kokkos_prefix}
  grep -qs '^#define KOKKOS_ENABLE_CUDA' "$k"/include/KokkosCore_config.h
}

ensure_deps() {
  install_packages
  if [ -z "${KOKKOS_ROOT:-}" ]; then build_kokkos; fi
  if kokkos_has_cuda; then
    install_cudnn_frontend
    install_cuobjdump
  fi
}

configure() {
  local kokkos=${KOKKOS_ROOT:-$kokkos_prefix}
  local extra=""
  [ -f /usr/lib/x86_64-linux-gnu/cmake/Kokkos/KokkosConfig.cmake ] &&
    extra=-DBLOCKATTN_CONSUMER_EXTRA_KOKKOS_DIR=/usr/lib/x86_64-linux-gnu/cmake/Kokkos
  # Tests, examples and tools ON whatever the tree's cache says (a tree
  # configured by hand without them, e.g. for an install, still runs the
  # demo); examples, tools and benchmarks at -O3 (BLOCKATTN_APPS_OPT empty:
  # `test` asks for -O1); BlockAttn::kernels whole (`test` precompiles what
  # the suite calls); warnings not as errors (`test` asks for them); the
  # caller's -D... come last and win.
  cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKokkos_ROOT="$kokkos" \
    -DKokkosKernels_ROOT="$kokkos" -DBLOCKATTN_BUILD_TESTS=ON -DBLOCKATTN_BUILD_EXAMPLES=ON \
    -DBLOCKATTN_BUILD_TOOLS=ON -DBLOCKATTN_BUILD_KERNELS=ON \
    -DBLOCKATTN_BUILD_BENCH=ON -DBLOCKATTN_ARCH="$arch" -DBLOCKATTN_APPS_OPT= -DBLOCKATTN_BENCH_OPT= -DBLOCKATTN_EXAMPLES_OPT= \
    -DBLOCKATTN_WERROR=OFF -DBLOCKATTN_LEG_SKIP_TARGETS= -DBLOCKATTN_LEG_ONLY_TARGETS= \
    '-DBLOCKATTN_KERNELS_SET=*:*:*:*:*' $extra "$@" >/dev/null
}

# Open MPI: allow running as root (CI containers) and avoid the single-copy
# (CMA) transport that container ptrace rules often forbid.
mpi_env() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_btl_vader_single_copy_mechanism=none
}

# Kokkos' OpenMP backend asks for these; 2 threads = this machine's 2 cores.
export OMP_PROC_BIND=${OMP_PROC_BIND:-false}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  cudnn-frontend)
    install_cudnn_frontend
    ;;
  deps)
    ensure_deps
    log "dependencies ready (Kokkos: ${KOKKOS_ROOT:-$kokkos_prefix})"
    ;;
  configure)
    ensure_deps
    configure "$@"
    log "configured $build"
    ;;
  demo)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_demo
    ranks=${P:-2}
    threads=$(( $(nproc) / ranks )); [ "$threads" -ge 1 ] || threads=1
    mpi_env
    OMP_NUM_THREADS=$threads mpiexec -n "$ranks" --oversubscribe "$build/examples/blockattn_demo" "$@"
    ;;
  demo-single)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_demo_single
    "$build/examples/blockattn_demo_single" "$@"
    ;;
  test)
    ensure_deps
    # The tools at -O1, the examples and benchmarks at -O0: ctest runs their
    # command lines and small examples, not their speed (CMakeLists.txt,
    # BLOCKATTN_APPS_OPT, BLOCKATTN_EXAMPLES_OPT, BLOCKATTN_BENCH_OPT); the test
    # files at -O0 (tests/CMakeLists.txt, BLOCKATTN_TEST_OPT), the precompiled
    # kernels and the test targets with kernels of their own at -O1
    # (BLOCKATTN_TEST_KERNEL_OPT); warnings as errors (BLOCKATTN_WERROR);
    # of BlockAttn::kernels only the block products
    # the suite calls (tests/kernels_used.txt; ctest kernels_serial and
    # kernels_openmp compile and run the rest); <Kokkos_Core.hpp>, and for the
    # test files doctest and the library's headers, precompiled (BLOCKATTN_PCH,
    # cmake/BlockAttnPch.cmake).
    test_opts=(-DBLOCKATTN_APPS_OPT=-O1 -DBLOCKATTN_EXAMPLES_OPT=-O0 -DBLOCKATTN_BENCH_OPT=-O0
      -DBLOCKATTN_PCH=ON -DBLOCKATTN_TEST_OPT=-O0 -DBLOCKATTN_TEST_KERNEL_OPT=-O1
      -DBLOCKATTN_WERROR=ON -DBLOCKATTN_KERNELS_SET=@tests/kernels_used.txt)
    # Two legs: Kokkos 3.4.1 (Debian's) and 4.6.01 (the current release
    # line). The suite is split between them, not run twice (CI's time): on
    # 4.6.01 the single-device forward, backward, 16-bit, decode and score
    # suites, BlockAttn::kernels and its precompiled-set checks, the
    # distributed suite at P = 1-8, the examples, the tools' and benchmarks'
    # command lines and the installed package; on 3.4.1 the rest (the
    # other MPI suites, the emulated GPU paths, the ISA builds, the compile
    # tests) and the sanitizer set. Without the 4.6 sources (or with
    # KOKKOS_ROOT) one leg runs everything.
    k4_targets='^blockattn_(test_(serial|openmp|decode|score|kernels_(serial|openmp)|distributed_serial)|precompiled_use|plan|custom_mask|custom_partition|demo|demo_single|train_step|serve|score_policy|bench_[a-z]+)$'
    k4_tests='^(forward_(serial|openmp)|kernels_(serial|openmp|precompiled)|decode|quant|score|distributed_serial_.*|example_.*|tool_.*|blockattn_bench_.*|consumer_project|readme_install_and_demo)$'
    kokkos4_skip=""
    if [ -n "${KOKKOS_ROOT:-}" ]; then
      kokkos4_skip="KOKKOS_ROOT is set: the whole suite runs on it"
    elif ! kokkos4_available; then
      kokkos4_skip="no kokkos-4.6.01.tar.xz and kokkos-kernels-4.6.02.tar.xz in $kokkos4_source"
      kokkos4_skip+=" (KOKKOS4_SOURCE); the Kokkos 3.4.1 leg runs the whole suite"
    else
      build_kokkos4
    fi
    if [ -n "$kokkos4_skip" ]; then
      log "Kokkos 4.6 leg skipped: $kokkos4_skip"
      configure "${test_opts[@]}" -DBLOCKATTN_LEG_SKIP_TARGETS= -DBLOCKATTN_LEG_ONLY_TARGETS=
      cmake --build "$build" -j "$jobs"
      (cd "$build" && ctest --output-on-failure -j "$jobs" "$@")
    else
      log "Kokkos 3.4.1 leg ($build)"
      configure "${test_opts[@]}" "-DBLOCKATTN_LEG_SKIP_TARGETS=$k4_targets" \
        -DBLOCKATTN_LEG_ONLY_TARGETS=
      cmake --build "$build" -j "$jobs"
      (cd "$build" && ctest --output-on-failure -j "$jobs" -E "$k4_tests|^kernels_set_matches_tests\$" "$@")
      log "Kokkos 4.6.01 leg ($kokkos4_build)"
      (build=$kokkos4_build KOKKOS_ROOT=$kokkos4_prefix
        configure "${test_opts[@]}" -DBLOCKATTN_LEG_SKIP_TARGETS= \
          "-DBLOCKATTN_LEG_ONLY_TARGETS=$k4_targets"
        cmake --build "$build" -j "$jobs"
        cd "$build" && ctest --output-on-failure -j "$jobs" -R "$k4_tests" "$@")
      # kernels_set_matches_tests over both legs' objects (each tree lists
      # every target's; each built its own half).
      objects=$(mktemp)
      while IFS= read -r obj; do
        [ -z "$obj" ] && continue
        if [ -f "$obj" ]; then echo "$obj"; else echo "$kokkos4_build${obj#"$build"}"; fi
      done <"$build/kernels/objects_linking_kernels.txt" >"$objects"
      sh "$repo/tests/kernels_used.sh" check "$objects" "$repo/tests/kernels_used.txt"
      rm -f "$objects"
      log "kernels_set_matches_tests (both legs' objects): passed"
    fi
    "${BASH_SOURCE[0]}" test-sanitize
    ;;
  test-aarch64)
    # The single-device suites (forward and backward, 16-bit, decode, quant,
    # score policies) and the distributed suite at P = 1, 2, cross-compiled
    # for aarch64 (the host ISA layer's NEON build) and run under qemu-user:
    # ctest label aarch64 in $aarch64_build. Correctness only: no timing
    # means anything under emulation. Not part of `test`: with it a fresh
    # clone's CI would pass 30 minutes on 2 cores (it takes 13 of its own).
    install_packages
    install_packages "${aarch64_packages[@]}"
    aarch64_sysroot
    aarch64_toolchain
    aarch64_kokkos_build
    a64_root=$aarch64_dir/sysroot
    a64_lib=$a64_root/usr/lib/aarch64-linux-gnu
    log "aarch64 cross build ($aarch64_build, $(basename "$aarch64_kokkos"))"
    # MPI: the arm64 Open MPI's headers and library, no wrapper compiler; the
    # host's mpiexec starts each rank as qemu-aarch64 <test> (MPIEXEC_PREFLAGS)
    # with the arm64 libraries and Open MPI's prefix exported.
    cmake -S "$repo" -B "$aarch64_build" -DCMAKE_TOOLCHAIN_FILE="$aarch64_dir/toolchain.cmake" \
      -DCMAKE_BUILD_TYPE=Release -DKokkos_ROOT="$aarch64_kokkos" -DBLOCKATTN_BUILD_TESTS=ON \
      -DBLOCKATTN_BUILD_EXAMPLES=OFF -DBLOCKATTN_BUILD_TOOLS=OFF -DBLOCKATTN_BUILD_BENCH=OFF \
      -DBLOCKATTN_BUILD_KERNELS=OFF -DBLOCKATTN_NATIVE=OFF -DBLOCKATTN_ARCH= \
      -DBLOCKATTN_WERROR=ON -DBLOCKATTN_PCH=ON -DBLOCKATTN_TEST_OPT=-O1 \
      -DBLOCKATTN_TEST_KERNEL_OPT=-O1 -DBLOCKATTN_LEG_SKIP_TARGETS= \
      '-DBLOCKATTN_LEG_ONLY_TARGETS=^blockattn_test_(serial|openmp|decode|score|distributed_serial)$' \
      -DMPI_CXX_SKIP_MPICXX=ON -DMPI_ASSUME_NO_BUILTIN_MPI=ON \
      -DMPI_CXX_ADDITIONAL_INCLUDE_DIRS="$a64_lib/openmpi/include" -DMPI_CXX_LIB_NAMES=mpi \
      -DMPI_mpi_LIBRARY="$a64_lib/libmpi.so.40" -DMPIEXEC_EXECUTABLE="$(command -v mpiexec)" \
      "-DMPIEXEC_PREFLAGS=-x;LD_LIBRARY_PATH=$a64_lib:$a64_lib/openmpi/lib:$a64_root/lib/aarch64-linux-gnu;-x;OPAL_PREFIX=$a64_root/usr;qemu-aarch64;-L;/usr/aarch64-linux-gnu" \
      >/dev/null
    cmake --build "$aarch64_build" -j "$jobs"
    mpi_env
    (cd "$aarch64_build" && ctest --output-on-failure -j "$jobs" -L aarch64 "$@")
    ;;
  test-sanitize)
    # The focused set under AddressSanitizer + UndefinedBehaviorSanitizer, in
    # its own build tree (-O1 -g1: line tables, enough for the sanitizers'
    # stack traces at a third less compile time than -g; tests/CMakeLists.txt,
    # BLOCKATTN_SANITIZE, takes two targets down to -O0).
    ensure_deps
    build=${SANITIZE_BUILD_DIR:-$repo/build-sanitize}
    configure -DBLOCKATTN_SANITIZE=ON -DBLOCKATTN_BUILD_EXAMPLES=OFF -DBLOCKATTN_BUILD_BENCH=OFF \
      -DBLOCKATTN_WERROR=ON \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1"
    cmake --build "$build" -j "$jobs"
    (cd "$build" && ctest --output-on-failure -j "$jobs" -L sanitize "$@")
    ;;
  bench)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_bench_forward blockattn_bench_decode
    "$repo/bench/run_forward.sh" "$build/bench/blockattn_bench_forward" "$@"
    if [ "${BENCH_SERVE:-1}" != 0 ]; then  # (bench/make_performance.sh runs bench-serve once itself)
      echo
      "$repo/bench/run_serve.sh" "$build/bench/blockattn_bench_decode" --reps 3
    fi
    ;;
  bench-isa)
    # The x86-64-v3 build runs its AVX2 kernels (BLOCKATTN_HOST_ISA=avx2: it
    # would dispatch to AVX-512 where the CPU has it) next to PyTorch's and
    # OpenBLAS's AVX2 kernels, so that an AVX-512 machine also measures what
    # an AVX2-only CPU gets from all three (each variable only where it is
    # not set already). PyTorch needs three: ATEN_CPU_CAPABILITY for its own
    # kernels, and MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA for the
    # matrix products its CPU SDPA calls, which otherwise stay AVX-512 (on a
    # Sapphire Rapids, ATEN_CPU_CAPABILITY=avx2 alone left its fp32 forward
    # at 60-100 GFLOP/s on 1 thread; all three: 31-62). ISAS="native x86-64"
    # etc. picks other builds; x86-64 alone measures the run-time dispatch.
    for a in ${ISAS:-native x86-64-v3}; do
      caps=()  # (an empty ATEN_CPU_CAPABILITY makes PyTorch warn: set only what applies)
      if [ "$a" = x86-64-v3 ]; then
        caps=("BLOCKATTN_HOST_ISA=${BLOCKATTN_HOST_ISA:-avx2}"
              "ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-avx2}"
              "MKL_ENABLE_INSTRUCTIONS=${MKL_ENABLE_INSTRUCTIONS:-AVX2}"
              "ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX2}"
              "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}")
      fi
      echo "##### -march=$a${caps[*]:+ (${caps[*]})}"
      env "${caps[@]}" ARCH="$a" BUILD_DIR= "${BASH_SOURCE[0]}" bench "$@"
    done
    ;;
  torch)
    if [ ! -x "$deps/torch-venv/bin/python" ]; then
      python3 -m venv "$deps/torch-venv"
    fi
    log "installing torch and numpy from PyPI into $deps/torch-venv (a few minutes, ~5 GB)"
    "$deps/torch-venv/bin/pip" install -q torch numpy
    "$deps/torch-venv/bin/python" -c 'import torch; print("torch", torch.__version__)'
    ;;
  bench-score)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_bench_score
    OMP_PROC_BIND=${OMP_PROC_BIND:-false} "$build/bench/blockattn_bench_score" "$@" 2>&1 |
      grep -v -e '^Kokkos::' -e OMP_PROC_BIND -e 'In general' -e 'For best' -e 'For unit'
    ;;
  bench-serve)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_bench_decode blockattn_bench_serve
    "$repo/bench/run_serve.sh" "$build/bench/blockattn_bench_decode" \
      "$build/bench/blockattn_bench_serve" "$@"
    ;;
  bench-ring)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_bench_ring
    "$repo/bench/run_ring.sh" "$build/bench/blockattn_bench_ring" "$@"
    ;;
  bench-plan)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_bench_plan
    "$repo/bench/run_plan.sh" "$build/bench/blockattn_bench_plan" "$@"
    ;;
  bench-balance)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_bench_balance
    "$repo/bench/run_balance.sh" "$build/bench/blockattn_bench_balance" "$@"
    ;;
  plan)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_plan
    OMP_PROC_BIND=false "$build/tools/blockattn_plan" "$@"
    ;;
  plot)
    ensure_deps
    configure
    cmake --build "$build" -j "$jobs" --target blockattn_plan
    if ! command -v gnuplot >/dev/null; then
      log "installing gnuplot-nox"
      as_root apt-get update -qq
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        gnuplot-nox >/dev/null
    fi
    "$repo/bench/plot_schedules.sh" "$build/tools/blockattn_plan" "${1:-$repo/docs/schedules_p8.png}"
    ;;
  *)
    sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
