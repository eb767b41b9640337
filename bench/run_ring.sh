#!/usr/bin/env bash
# KV-ring benchmarks: overlap efficiency with P = 2 (one rank per core), the
# backward rings' bytes per step and times for a few head shapes (P = 2), then
# per-rank memory at a fixed block of 4096 tokens for P = 1, 2, 4, 8 (memory
# only: with P > 2 on this 2-core machine the timings would mean nothing).
# Bytes and memory for fp32 and bf16 (K/V and Q travel in 16 bits).
#   bench/run_ring.sh <path to blockattn_bench_ring> [--reps R]
set -euo pipefail
bin=$1
shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_PROC_BIND=false
OMP_NUM_THREADS=1 mpiexec -n 2 --oversubscribe "$bin" "$@"
for t in fp32 bf16; do
  OMP_NUM_THREADS=1 mpiexec -n 2 --oversubscribe "$bin" --bytes --reps 3 --dtype $t
done
for t in fp32 bf16; do
  for p in 1 2 4 8; do
    OMP_NUM_THREADS=1 mpiexec -n $p --oversubscribe "$bin" --memory --c 4096 --dtype $t 2>/dev/null
  done
done
