#!/usr/bin/env bash
# Packed documents: the work and busy time of every layout, run, at P = 2 (one
# rank per core of this machine: the busy seconds mean something) and P = 4
# (ranks share the cores: count the work), N = 65536, D = 64.
#   bench/run_balance.sh <path to blockattn_bench_balance> [bench args]
set -euo pipefail
bin=$1
shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_PROC_BIND=false OMP_NUM_THREADS=1
mpiexec -n 2 --oversubscribe "$bin" --n 65536 "$@"
echo
mpiexec -n 4 --oversubscribe "$bin" --n 65536 --reps 1 "$@"
