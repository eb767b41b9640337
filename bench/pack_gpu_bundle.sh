#!/usr/bin/env bash
# Packs what bench/gpu_session.sh runs into one compressed bundle under the
# device tool's 64 MiB carry limit (device code makes the CUDA test binaries
# ~40 MB each; stripped and gzipped ~17 MB).
#
#   bench/pack_gpu_bundle.sh <cuda build dir> [<host build dir>] [<Open MPI dpkg -x dir>]
#
# Writes .gpu/bundle.tar.gz (git-ignored through .git/info/exclude): the CUDA
# build's blockattn_test_cuda, blockattn_test_distributed_cuda and
# blockattn_bench_gpu, blockattn_bench_decode and blockattn_bench_score (not in `all`:
# make it by name), the host build's
# blockattn_bench_plan and blockattn_bench_serve, and Open MPI.
# Then: run(carry [".gpu"], command "bash bench/gpu_session.sh").
set -euo pipefail
cuda=${1:?usage: pack_gpu_bundle.sh <cuda build dir> [<host build dir>] [<mpi dir>]}
host=${2:-}
mpi=${3:-}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
grep -qs '^/.gpu/$' "$repo/.git/info/exclude" || echo /.gpu/ >>"$repo/.git/info/exclude"
stage=$(mktemp -d)
mkdir -p "$stage/build-cuda/tests" "$stage/build-cuda/bench" "$stage/build-host/bench"
for f in tests/blockattn_test_cuda tests/blockattn_test_distributed_cuda bench/blockattn_bench_gpu \
  bench/blockattn_bench_decode bench/blockattn_bench_score; do
  if [ -x "$cuda/$f" ]; then strip -o "$stage/build-cuda/$f" "$cuda/$f"; else echo "missing $cuda/$f"; fi
done
for f in bench/blockattn_bench_plan bench/blockattn_bench_serve; do
  if [ -n "$host" ] && [ -x "$host/$f" ]; then strip -o "$stage/build-host/$f" "$host/$f"; fi
done
if [ -n "$mpi" ]; then cp -a "$mpi" "$stage/.mpi"; fi
mkdir -p "$repo/.gpu"
tar -C "$stage" -czf "$repo/.gpu/bundle.tar.gz" .
rm -rf "$stage"
ls -la "$repo/.gpu/bundle.tar.gz"
