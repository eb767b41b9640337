#!/usr/bin/env bash
# Packs what bench/gpu_session.sh runs into one compressed bundle under the
# device tool's 64 MiB carry limit. Configure the CUDA build with
# -DBLOCKATTN_CUDA_NO_PTX=ON: sm_90 machine code without PTX xz-compresses to
# about a third of Kokkos' default (PTX and machine code in nvcc's compressed
# fatbinary), which is what makes every binary fit (docs/gpu.md).
#
#   bench/pack_gpu_bundle.sh <cuda build dir> [<host build dir>] [<Open MPI dpkg -x dir>]
#
# Writes .gpu/bundle.tar.xz (git-ignored through .git/info/exclude): the CUDA
# build's blockattn_test_cuda, blockattn_test_distributed_cuda, blockattn_flash_check,
# blockattn_test_fused_distributed_cuda (cuDNN builds), blockattn_test_random_cuda and
# blockattn_bench_gpu, blockattn_bench_decode, blockattn_bench_score and
# blockattn_bench_steps (the last two not in `all`:
# make it by name), the host build's
# blockattn_bench_plan, blockattn_bench_serve and blockattn_bench_decode (prefill
# on 16 cores), and Open MPI (bench/unpack_mpi.sh makes its folder); and
# BUILT_FROM: the commit checked out when packed, uncommitted changes, and
# any binary older than a source (STALE); gpu_session.sh prints it.
# Then: run(carry [".gpu"], command "bash bench/gpu_session.sh").
# SKIP="name ...": leave those binaries out (if the bundle would pass the carry
# limit: it says so).
set -euo pipefail
cuda=${1:?usage: pack_gpu_bundle.sh <cuda build dir> [<host build dir>] [<mpi dir>]}
if ! grep -qs '^BLOCKATTN_CUDA_NO_PTX:BOOL=ON' "$cuda/CMakeCache.txt"; then
  echo "note: $cuda is not configured with -DBLOCKATTN_CUDA_NO_PTX=ON: its PTX makes the" \
    "bundle about three times larger than it needs to be" >&2
fi
host=${2:-}
mpi=${3:-}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
grep -qs '^/.gpu/$' "$repo/.git/info/exclude" || echo /.gpu/ >>"$repo/.git/info/exclude"
stage=$(mktemp -d)
mkdir -p "$stage/build-cuda/tests" "$stage/build-cuda/bench" "$stage/build-host/bench"
for f in tests/blockattn_test_cuda tests/blockattn_test_distributed_cuda tests/blockattn_flash_check \
  tests/blockattn_test_fused_distributed_cuda tests/blockattn_test_random_cuda \
  bench/blockattn_bench_gpu \
  bench/blockattn_bench_decode bench/blockattn_bench_score bench/blockattn_bench_steps; do
  if [[ " ${SKIP:-} " == *" $(basename "$f") "* ]]; then echo "left out $f (SKIP)"; continue; fi
  if [ -x "$cuda/$f" ]; then strip -o "$stage/build-cuda/$f" "$cuda/$f"; else echo "missing $cuda/$f"; fi
done
# Which code the binaries are: the commit, uncommitted changes, and binaries
# older than the newest header or test source (built before a change).
newest=$(cd "$repo" && git ls-files -z include 'tests/*.[ch]pp' 'bench/*.[ch]pp' |
  xargs -0 stat -c '%Y %n' | sort -n | tail -1)
{
  echo "packed at commit $(cd "$repo" && git rev-parse HEAD) ($(cd "$repo" && git log -1 --format=%cd --date=iso))"
  (cd "$repo" && git status --porcelain --untracked-files=no | sed 's/^/uncommitted: /')
  echo "packed $(date -u '+%Y-%m-%d %H:%M UTC'); newest source: ${newest#* }"
  for f in "$stage"/build-cuda/*/*; do
    b=$cuda/${f#"$stage"/build-cuda/}
    [ "$(stat -c %Y "$b")" -lt "${newest%% *}" ] && echo "STALE: $b is older than ${newest#* }"
  done
  command -v nvcc >/dev/null && nvcc --version | tail -2
} >"$stage/BUILT_FROM" 2>/dev/null || true
cat "$stage/BUILT_FROM"
for f in bench/blockattn_bench_plan bench/blockattn_bench_serve bench/blockattn_bench_decode; do
  if [ -n "$host" ] && [ -x "$host/$f" ]; then strip -o "$stage/build-host/$f" "$host/$f"; fi
done
# The host build's shared Kokkos (Debian's Kokkos 3.4 build is shared).
if [ -n "$host" ] && [ -x "$host/bench/blockattn_bench_plan" ]; then
  mkdir -p "$stage/build-host/lib"
  ldd "$host/bench/blockattn_bench_plan" | awk '/libkokkos/ {print $3}' |
    while read -r lib; do cp -L "$lib" "$stage/build-host/lib/"; done
fi
if [ -n "$mpi" ]; then
  cp -a "$mpi" "$stage/.mpi"
  rm -rf "$stage/.mpi/usr/share/doc" "$stage/.mpi/usr/share/man"  # not needed to run
fi
mkdir -p "$repo/.gpu"
# xz: device code compresses to about two thirds of gzip's size.
rm -f "$repo/.gpu/bundle.tar.gz" "$repo/.gpu/bundle.tar.xz"
XZ_OPT="-6 -T0" tar -C "$stage" -cJf "$repo/.gpu/bundle.tar.xz" .
rm -rf "$stage"
ls -la "$repo/.gpu/bundle.tar.xz"
# The device tool carries at most 64 MiB: the bundle and the working tree.
size=$(stat -c %s "$repo/.gpu/bundle.tar.xz")
tree=$(cd "$repo" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
if [ $((size + tree)) -gt $((64 * 1024 * 1024)) ]; then
  echo "the bundle ($size bytes) and the working tree ($tree bytes) pass the 64 MiB carry limit: SKIP some binaries" >&2
  exit 1
fi
