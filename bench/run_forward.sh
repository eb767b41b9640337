#!/usr/bin/env bash
# Runs the forward/backward benchmark with 1 and with all threads (Kokkos
# OpenMP threads = OpenBLAS threads = PyTorch threads), each run printing its
# own ratios: vs OpenBLAS sgemm and, when torch imports, vs PyTorch's CPU
# scaled_dot_product_attention measured just before with the same threads.
#   bench/run_forward.sh <path to blockattn_bench_forward> [--quick] [--dtype=fp32,bf16,fp16]
#                        [google-benchmark flags]
# (--dtype: the value types to run, ours and PyTorch's; default fp32,bf16.)
# Environment: BLOCKATTN_PYTHON  a python with torch (default: .deps/torch-venv's
#              python if present, else python3); THREADS  thread counts (default "1 nproc");
#              LENGTHS  sequence lengths, comma-separated, a subset of the bench's
#              512,1024,2048,4096,16384 (default: all of them; --quick: up to 4096);
#              DIMS  head dims, a subset of 64,128 (default: both);
#              HEADS  head counts, one run each (default "1"; e.g. "1 4 16": B = 1, H
#              query = K/V heads, ours and PyTorch's);
#              LAYOUT  memory order of q, k, v, o, ours and PyTorch's alike: bnhd
#              ([seq][heads][dim], default) or bhnd ([heads][seq][dim]); at H = 16
#              both libraries run a few per cent slower on bnhd (a head's rows are
#              heads x dim apart), so a ratio is only fair in one layout.
#              RUNS  repeat everything this many times (default 1), each run its own
#              ratio tables; FORWARD_ONLY=1  the forward alone (ours and PyTorch's:
#              no backward, no sgemm), for several quick runs.
# A case moves by 5-10 % between runs on a shared machine (on a 2-core cloud
# guest, single cells by up to 30 %): take a few runs and summarise them per
# case with bench/summarize_runs.py LOG... (it reads the runs of one log too).
set -euo pipefail
bin=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
# OpenBLAS 0.3.21 (Debian 12) does not know recent Xeons and falls back to its
# SSE3 "Prescott" kernels (5x slower); name the kernels it does have. Zen 3 is
# detected as Zen (AVX2) correctly.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  if grep -qw avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX
  elif grep -qw avx2 /proc/cpuinfo && ! grep -q AuthenticAMD /proc/cpuinfo; then export OPENBLAS_CORETYPE=Haswell
  fi
fi
echo "CPU: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n1)," \
     "vector flags: $(grep -m1 -ow -E 'avx512f|avx512_bf16|amx_tile|avx2|fma|sse2|asimd|sve' /proc/cpuinfo | sort -u | tr '\n' ' ')"

py=${BLOCKATTN_PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$repo/.deps/torch-venv/bin/python" ]; then py=$repo/.deps/torch-venv/bin/python; else py=python3; fi
fi
have_torch=0
if "$py" -c 'import torch' 2>/dev/null; then have_torch=1; else
  echo "PyTorch: not importable by $py; no PyTorch column (cmake/blockattn.sh torch installs it into .deps/torch-venv)"
fi
quick=0
dtypes=fp32,bf16
for a in "$@"; do
  [ "$a" = --quick ] && quick=1
  case $a in --dtype=*) dtypes=${a#--dtype=} ;; esac
done
lengths=512,1024,2048,4096,16384
[ $quick = 1 ] && lengths=512,1024,2048,4096
filter=()
dims=64,128
[ -n "${DIMS:-}" ] && dims=$DIMS
fwd_only=${FORWARD_ONLY:-0}
if [ -n "${LENGTHS:-}" ] || [ -n "${DIMS:-}" ] || [ "$fwd_only" = 1 ]; then
  [ -n "${LENGTHS:-}" ] && lengths=$LENGTHS
  # Ours at those lengths and head dims (attention, backward, same-size
  # sgemm) and sgemm 4096^3; or the forward alone.
  alt=${lengths//,/|}
  dalt=${dims//,/|}
  if [ "$fwd_only" = 1 ]; then
    filter=("--benchmark_filter=attention/register/[a-z0-9]+/N:($alt)/D:($dalt)/")
  else
    filter=("--benchmark_filter=(/N:($alt)/D:($dalt)/|/M:($alt)/N:[0-9]+/K:($dalt)/|4096\\^3)")
  fi
fi
torch_flags=()
[ "$fwd_only" = 1 ] && torch_flags=(--no-backward)

if [ $have_torch = 1 ]; then
  # Which PyTorch CPU path runs: its vector ISA, and whether it sees AMX tiles
  # (its bf16 flash attention packs blocks for oneDNN's AMX brgemm there).
  "$py" -c 'import torch
amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: "unknown")()
print("PyTorch", torch.__version__, "CPU capability", torch.backends.cpu.get_cpu_capability(),
      "AMX tiles", amx, "oneDNN", torch.backends.mkldnn.is_available())'
fi

for run in $(seq "${RUNS:-1}"); do
for h in ${HEADS:-1}; do
for t in ${THREADS:-1 $(nproc)}; do
  echo "=== run ${run}: ${t} thread(s), H = ${h} ==="
  torch_arg=()
  if [ $have_torch = 1 ]; then
    out=$(mktemp)
    OMP_NUM_THREADS=$t "$py" "$here/torch_sdpa.py" --threads "$t" --lengths "$lengths" \
      --dtypes "$dtypes" --dims "$dims" --heads "$h" --layout "${LAYOUT:-bnhd}" --out "$out" \
      "${torch_flags[@]}"
    torch_arg=(--torch="$out")
  fi
  OMP_NUM_THREADS=$t OMP_PROC_BIND=false OPENBLAS_NUM_THREADS=$t "$bin" "${filter[@]}" --heads="$h" --layout="${LAYOUT:-bnhd}" "$@" "${torch_arg[@]}"
done
done
done
