#!/usr/bin/env bash
# Serving benchmarks: single-device split-KV decode against a plain read of
# the same K/V bytes and next to PyTorch's scaled_dot_product_attention of the
# same shapes when torch imports (bench/torch_decode.py, just before, same
# threads; 1 thread, then all; then paged caches next to the contiguous one
# and 8-bit caches next to bf16), chunked prefill on the decode kernel and on
# the forward's kernels next to one attention_forward call, then one
# distributed decode step at
# P = 1 and 2 (one rank per core of this machine) with the tree and the ring
# merge, next to the planner's prediction from rates measured in the same run,
# and a mixed step (batch_attention) next to the same work in separate calls.
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
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${BLOCKATTN_PYTHON:-python3}
[ -z "${BLOCKATTN_PYTHON:-}" ] && [ -x "$repo/.deps/torch-venv/bin/python" ] && py=$repo/.deps/torch-venv/bin/python
have_torch=0
if "$py" -c 'import torch' 2>/dev/null; then have_torch=1; else
  echo "PyTorch: not importable by $py; no PyTorch columns (cmake/blockattn.sh torch installs it into .deps/torch-venv)"
fi
# The decode table's --keys / --batch for PyTorch's cases.
torch_args=()
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  case ${args[i]} in
    --keys | --batch) torch_args+=("${args[i]}" "${args[i + 1]:-}") ;;
  esac
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for t in $(printf '%s\n' 1 "$cores" | sort -un); do
  torch_flag=()
  if [ $have_torch = 1 ]; then
    OMP_NUM_THREADS=$t "$py" "$repo/bench/torch_decode.py" --threads "$t" \
      --out "$tmp/torch_$t.txt" "${torch_args[@]}"
    torch_flag=(--torch="$tmp/torch_$t.txt")
  fi
  OMP_NUM_THREADS=$t "$decode" "$@" "${torch_flag[@]}"
  echo
  # Paged caches next to the contiguous one, 8-bit caches next to bf16.
  OMP_NUM_THREADS=$t "$decode" --paged "$@"
  echo
  OMP_NUM_THREADS=$t "$decode" --quant "$@"
  echo
done
OMP_NUM_THREADS=$cores "$decode" --prefill "$@"
[ -n "$serve" ] || exit 0
echo
for p in 1 2; do
  [ "$p" -le "$cores" ] || break
  OMP_NUM_THREADS=$((cores / p)) OMP_PROC_BIND=false \
    mpiexec -n "$p" --oversubscribe --bind-to none "$serve" "$@"
  echo
done
# A mixed step (16 sequences decoding, one prefilling 64 rows): one
# batch_attention next to separate calls and the three calls of before.
for p in 1 2; do
  [ "$p" -le "$cores" ] || break
  OMP_NUM_THREADS=$((cores / p)) OMP_PROC_BIND=false \
    mpiexec -n "$p" --oversubscribe --bind-to none "$serve" --mixed 64 --batch 16 --keys 4096
  echo
done
