#!/bin/sh
# Checks, without a GPU, that a HIP binary (or object) launches only kernels
# whose device code it carries.
#   check_hip_kernels.sh <binary or object>
#
# hipcc (clang) compiles a translation unit twice, as nvcc does: a host pass
# (x86-64, with the host's ISA macros) and a device pass (amdgcn). The host
# pass's launch goes through a kernel handle named after the host pass's
# instantiation; the HIP runtime looks that name up in the embedded code
# object, whose kernels are the device pass's instantiations. A kernel type
# that depends on something only one pass sees (the host ISA macros) makes a
# launch the runtime cannot find (hipErrorInvalidDeviceFunction on a GPU);
# tests/check_cuda_kernels.sh says how the CUDA build once did exactly that.
#
# Two checks on Kokkos' launch kernels (Kokkos::Impl::hip_parallel_launch_*):
#  1. every kernel handle the host code defines (nm) is a kernel (its `.kd`
#     descriptor) in the device code objects of the .hip_fatbin section;
#  2. no kernel name holds a host ISA other than `generic`
#     ((blockattn::HostIsa)N with N != 0).
set -eu
exe=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export LC_ALL=C

nm "$exe" | awk '{print $NF}' |
  grep -E '^_ZN6Kokkos4ImplL?[0-9]+hip_parallel_launch_[a-z_]+_memory' | sort -u >"$tmp/host"
objcopy -O binary --only-section=.hip_fatbin "$exe" "$tmp/fatbin" 2>/dev/null || : >"$tmp/fatbin"
strings -n 30 "$tmp/fatbin" |
  grep -oE '_ZN6Kokkos4ImplL?[0-9]+hip_parallel_launch_[A-Za-z0-9_]+\.kd' |
  sed 's/\.kd$//' | sort -u >"$tmp/device"

host=$(wc -l <"$tmp/host")
device=$(wc -l <"$tmp/device")
echo "$(basename "$exe"): $host Kokkos launch kernels in the host code, $device in the device code"
if [ "$host" -eq 0 ] || [ "$device" -eq 0 ]; then
  echo "FAIL: found no Kokkos HIP launch kernels (hip_parallel_launch_*) in the host code or" \
    "none in the .hip_fatbin device code: not a HIP build, a compressed code object, or" \
    "Kokkos renamed its launch kernels (update this check)"
  exit 1
fi

status=0
comm -23 "$tmp/host" "$tmp/device" >"$tmp/missing"
n=$(wc -l <"$tmp/missing")
if [ "$n" -ne 0 ]; then
  echo "FAIL: $n kernels the host code launches have no device code (their type differs" \
    "between the host and the device pass); the first ones:"
  c++filt <"$tmp/missing" | cut -c1-400 | head -5
  status=1
fi
c++filt <"$tmp/host" | grep -E '\(blockattn::HostIsa\)[1-9]' >"$tmp/isa" || true
n=$(wc -l <"$tmp/isa")
if [ "$n" -ne 0 ]; then
  echo "FAIL: $n kernels name a host ISA (only the host pass sees one); the first ones:"
  cut -c1-400 "$tmp/isa" | head -5
  status=1
fi
[ "$status" -eq 0 ] && echo "OK: every host-launched kernel has device code, no host ISA in a kernel name"
exit "$status"
