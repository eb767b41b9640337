#!/usr/bin/env bash
# Planner prediction vs measurement at P = 2 (one rank per core of this
# machine), causal mask, forward and backward, for two local block sizes (the second with 2 heads, so
# that Ulysses runs) and a causal window; then the steps and bytes of a window
# at P = 4, and P = 4 with 4 heads: Ulysses and the 2 x 2 hybrid next to the
# rings (4 ranks on 2 cores: every row shares the cores alike).
#   bench/run_plan.sh <path to blockattn_bench_plan> [--reps R]
set -euo pipefail
bin=$1
shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_PROC_BIND=false OMP_NUM_THREADS=1
mpiexec -n 2 --oversubscribe "$bin" --n-local 2048 "$@"
echo
# The backward (calibrated on the backward kernel as well; the Q ring joins).
mpiexec -n 2 --oversubscribe "$bin" --n-local 2048 --pass backward "$@"
echo
mpiexec -n 2 --oversubscribe "$bin" --n-local 4096 --heads 2 "$@"
echo
mpiexec -n 2 --oversubscribe "$bin" --n-local 4096 --mask window:3000 "$@"
echo
# P = 4 on 2 cores: the times mean nothing, the steps and bytes do (a causal
# window of 4096 over 8192 tokens per rank: the ring stops after 2 steps).
mpiexec -n 4 --oversubscribe "$bin" --n-local 8192 --mask window:4096 --reps 1
echo
mpiexec -n 4 --oversubscribe "$bin" --n-local 1024 --heads 4 "$@"
