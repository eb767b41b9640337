#!/usr/bin/env bash
# Runs the forward benchmark with 1 and with 2 threads (Kokkos OpenMP threads =
# OpenBLAS threads), each run printing its own ratios.
#   bench/run_forward.sh <path to blockattn_bench_forward> [--quick] [google-benchmark flags]
set -euo pipefail
bin=$1
shift
# OpenBLAS 0.3.21 (Debian 12) does not know recent Xeons and falls back to its
# SSE3 "Prescott" kernels (5x slower); name the AVX-512 kernels it does have.
if grep -qw avx512f /proc/cpuinfo && [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  export OPENBLAS_CORETYPE=SkylakeX
fi
for t in 1 2; do
  echo "=== ${t} thread(s) ==="
  OMP_NUM_THREADS=$t OMP_PROC_BIND=false OPENBLAS_NUM_THREADS=$t "$bin" "$@"
done
