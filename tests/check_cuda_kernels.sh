#!/bin/sh
# Checks, without a GPU, that a CUDA test binary launches only kernels nvcc
# registered with the CUDA runtime.
#   check_cuda_kernels.sh <binary>
#
# nvcc compiles a translation unit twice: a device pass and a host pass. The
# host pass's kernel launch goes through the host stub of the kernel's
# template instantiation, and the runtime finds the device code by the name
# the stub registered, which is the name of the device pass's instantiation.
# If a kernel's type depends on something only the host pass sees (the host
# ISA macros: __AVX512F__, __SSE2__, ...), the host pass launches a kernel
# nobody registered, and every launch fails on the GPU with
# cudaErrorInvalidResourceHandle (what the cuda suite did at be45614).
#
# Two checks on Kokkos' launch kernels (Kokkos::Impl::cuda_parallel_launch_*):
#  1. every one the host code defines, other than extended lambdas (whose
#     host and device names differ by construction), has its name among the
#     registered names (the kernel names in the binary's embedded device code);
#  2. no one names a host ISA other than `generic` (blockattn::HostIsa)N with
#     N != 0), which is the way a host-only type reaches a kernel's name.
set -eu
exe=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export LC_ALL=C

nm "$exe" | awk '{print $NF}' | sed 's/\.cold$//' |
  grep -E '^_ZN6Kokkos4ImplL?[0-9]+cuda_parallel_launch_[a-z_]+_memory' |
  sed -E 's/^_ZN6Kokkos4ImplL/_ZN6Kokkos4Impl/' | sort -u >"$tmp/all"
grep -v 'nv_hdl_wrapper\|EUl' "$tmp/all" >"$tmp/named" || true
strings -n 30 "$exe" | grep -oE '_ZN6Kokkos4Impl[0-9]+cuda_parallel_launch_[A-Za-z0-9_]+' |
  sort -u >"$tmp/registered"

kernels=$(wc -l <"$tmp/all")
named=$(wc -l <"$tmp/named")
registered=$(wc -l <"$tmp/registered")
echo "$(basename "$exe"): $kernels Kokkos launch kernels in the host code ($named named functors)," \
  "$registered registered kernel names"
if [ "$kernels" -eq 0 ] || [ "$registered" -eq 0 ]; then
  echo "FAIL: found no Kokkos CUDA launch kernels (cuda_parallel_launch_*) or no registered" \
    "names: not a CUDA build, or Kokkos renamed its launch kernels (update this check)"
  exit 1
fi

status=0
comm -23 "$tmp/named" "$tmp/registered" >"$tmp/unregistered"
n=$(wc -l <"$tmp/unregistered")
if [ "$n" -ne 0 ]; then
  echo "FAIL: $n kernels the host code launches were not registered by nvcc (their type" \
    "differs between the host and the device pass); the first ones:"
  c++filt <"$tmp/unregistered" | cut -c1-400 | head -5
  status=1
fi
c++filt <"$tmp/all" | grep -E '\(blockattn::HostIsa\)[1-9]' >"$tmp/isa" || true
n=$(wc -l <"$tmp/isa")
if [ "$n" -ne 0 ]; then
  echo "FAIL: $n kernels name a host ISA (only the host pass sees one); the first ones:"
  cut -c1-400 "$tmp/isa" | head -5
  status=1
fi
[ "$status" -eq 0 ] && echo "OK: every named kernel registered, no host ISA in a kernel name"
exit "$status"
