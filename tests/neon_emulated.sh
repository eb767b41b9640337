#!/usr/bin/env bash
# Cross-compiles the micro-kernel test for AArch64 (NEON kernels) and runs it
# under qemu user-mode emulation: correctness only, no timing. Registered by
# tests/CMakeLists.txt only when aarch64-linux-gnu-g++ and qemu-aarch64(-static)
# are installed (Debian: g++-aarch64-linux-gnu, qemu-user or qemu-user-static).
#   neon_emulated.sh <source dir> <Kokkos include dir> <doctest include dir> <work dir> [qemu]
set -euo pipefail
src=$1 kokkos_inc=$2 doctest_inc=$3 work=$4 qemu=${5:-qemu-aarch64-static}
mkdir -p "$work"
cat >"$work/doctest_main.cpp" <<'MAIN'
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
MAIN
flags=(-std=c++17 -O2 -fopenmp -Wall -Wextra -Wpedantic -Werror -I"$src/include"
       -isystem "$kokkos_inc" -isystem "$doctest_inc")
aarch64-linux-gnu-g++ "${flags[@]}" -c "$src/tests/test_micro_gemm.cpp" -o "$work/micro.o"
aarch64-linux-gnu-g++ "${flags[@]}" -c "$work/doctest_main.cpp" -o "$work/main.o"
aarch64-linux-gnu-g++ -static -fopenmp "$work/main.o" "$work/micro.o" -o "$work/micro_neon"
"$qemu" "$work/micro_neon"
