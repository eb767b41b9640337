#!/usr/bin/env bash
# Serving benchmarks: single-device split-KV decode against a plain read of
# the same K/V bytes (all threads), chunked prefill on the decode kernel and on
# the forward's kernels next to one attention_forward call, then one
# distributed decode step at
# P = 1 and 2 (one rank per core of this machine) with the tree and the ring
# merge, next to the planner's prediction from rates measured in the same run.
#   bench/run_serve.sh <blockattn_bench_decode> [<blockattn_bench_serve>] [--keys N] [--reps R]
set -euo pipefail
decode=$1
shift
serve=""
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then
  serve=$1
  shift
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_PROC_BIND=spread
cores=$(nproc)
OMP_NUM_THREADS=$cores "$decode" "$@"
echo
OMP_NUM_THREADS=$cores "$decode" --prefill "$@"
[ -n "$serve" ] || exit 0
echo
for p in 1 2; do
  [ "$p" -le "$cores" ] || break
  OMP_NUM_THREADS=$((cores / p)) OMP_PROC_BIND=false \
    mpiexec -n "$p" --oversubscribe --bind-to none "$serve" "$@"
  echo
done
