#!/bin/sh
# Checks, without a GPU, that the tensor-core forward is on the tensor cores:
# the embedded sm_90 machine code of every kernel of kernel/impl/cuda_flash.hpp
# (the library's variant, Q in registers)
# in a binary holds HMMA (mma.sync) and LDSM (ldmatrix) instructions and no
# local-memory traffic (LDL/STL: a register array spilled or indexed at run
# time). A refactor that loses either fails here, not only in a timing.
#   check_flash_sass.sh <cuobjdump> <binary>
# Exit 77 (skipped) without cuobjdump.
set -eu
cuobjdump=$1
exe=$2
if [ ! -x "$cuobjdump" ]; then
  echo "no cuobjdump ($cuobjdump): skipped"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$cuobjdump" -sass "$exe" >"$tmp/sass"
# One block per function: "Function : <mangled name>" then its instructions.
awk -v dir="$tmp" '
  /Function :/ { f = ($0 ~ /flash14forward_kernelILi[0-9]+ELb[01]ELb1E/); n++; next }
  f { print > (dir "/k" n) }' "$tmp/sass"
kernels=$(ls "$tmp" | grep -c '^k' || true)
if [ "$kernels" -eq 0 ]; then
  echo "FAILED: no tensor-core forward kernel (flash::forward_kernel) in $exe"
  exit 1
fi
status=0
for k in "$tmp"/k*; do
  hmma=$(grep -c 'HMMA' "$k" || true)
  ldsm=$(grep -c 'LDSM' "$k" || true)
  local_mem=$(grep -cE '\b(LDL|STL)\b' "$k" || true)
  if [ "$hmma" -eq 0 ] || [ "$ldsm" -eq 0 ] || [ "$local_mem" -ne 0 ]; then
    echo "FAILED: $(basename "$k"): HMMA $hmma, LDSM $ldsm, LDL/STL $local_mem"
    status=1
  fi
done
echo "$kernels tensor-core forward kernels: HMMA and LDSM in each, no local memory"
exit $status
