#!/bin/sh
# Checks, without a GPU, that the tensor-core forward and backward are on the
# tensor cores: the embedded sm_90 machine code of every kernel of
# kernel/cuda/flash_forward.hpp (every variant) and of the dK/dV and dQ kernels
# of cuda/flash_backward.hpp, and of the fp32 forward of cuda/flash_forward_f32.hpp
# (HMMA.1688.F32.TF32), in a binary holds HMMA (mma.sync) and LDSM
# (ldmatrix) instructions, and every forward kernel (all variants, 16-bit
# and fp32) and the dQ kernel no local-memory traffic (LDL/STL: a register
# array spilled or indexed at run time); the dK/dV kernel at D = 128 (255
# registers) spills a few bytes with some masks, never among its products:
# LDL/STL between its first and its last HMMA (the four products of a pair
# and the masking between them) fail, those outside are printed.
# A refactor that loses the tensor cores fails here, not only in a timing.
#   check_flash_sass.sh <cuobjdump> <binary>
# Exit 77 (skipped) without cuobjdump, or without the nvdisasm its -sass runs
# (looked for next to cuobjdump, then on PATH).
set -eu
cuobjdump=$1
exe=$2
if [ ! -x "$cuobjdump" ]; then
  echo "no cuobjdump ($cuobjdump): skipped"
  exit 77
fi
PATH="$(dirname "$cuobjdump"):$PATH"
if ! command -v nvdisasm >/dev/null; then
  echo "no nvdisasm (next to $cuobjdump or on PATH; cuobjdump -sass runs it): skipped"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$cuobjdump" -sass "$exe" >"$tmp/sass"
# One block per function: "Function : <mangled name>" then its instructions.
awk -v dir="$tmp" '
  /Function :/ {
    f = ($0 ~ /flash14forward_kernelILi[0-9]+ELb[01]ELi[0-9]+ELb[01]E/); n++
    t = ($0 ~ /flash18forward_f32_kernelILi[0-9]+ELi[13]E/)
    if (t) { f = 1; print "fp32" > (dir "/t" n) }
    b = ($0 ~ /flash(11dkdv|9dq)_kernelILi[0-9]+ELb[01]E/)
    if (b) { f = 1; d = ($0 ~ /11dkdv/); print (d ? "dkdv" : "dq") > (dir "/b" n); print d > (dir "/w" n) }
    next
  }
  f { print > (dir "/k" n) }' "$tmp/sass"
kernels=$(ls "$tmp" | grep -c '^k' || true)
backward=$(ls "$tmp" | grep -c '^b' || true)
fp32=$(ls "$tmp" | grep -c '^t' || true)
dkdv=$(cat "$tmp"/b* 2>/dev/null | grep -c dkdv || true)
forward=$((kernels - backward - fp32))
if [ "$forward" -le 0 ] || [ "$dkdv" -eq 0 ] || [ "$dkdv" -eq "$backward" ] || [ "$fp32" -eq 0 ]; then
  echo "FAILED: $exe lacks a tensor-core kernel: $forward forward" \
       "(flash::forward_kernel), $dkdv dK/dV, $((backward - dkdv)) dQ, $fp32 fp32 forward"
  exit 1
fi
status=0
for k in "$tmp"/k*; do
  if [ -f "$tmp/t${k##*/k}" ]; then
    hmma=$(grep -c 'HMMA\.1688\.F32\.TF32' "$k" || true)
  else
    hmma=$(grep -c 'HMMA' "$k" || true)
  fi
  ldsm=$(grep -c 'LDSM' "$k" || true)
  local_mem=$(grep -cE '\b(LDL|STL)\b' "$k" || true)
  # Local memory among the products: between the first and the last HMMA.
  among=$(awk '/HMMA/ { if (!first) first = NR; last = NR }
               /[^A-Z](LDL|STL)[ .]/ { at[++n] = NR }
               END { c = 0; for (i = 1; i <= n; i++) if (at[i] > first && at[i] < last) c++; print c }' "$k")
  spills_allowed=$(cat "$tmp/w${k##*/k}" 2>/dev/null || echo 0)
  if [ "$hmma" -eq 0 ] || [ "$ldsm" -eq 0 ] || [ "$among" -ne 0 ] ||
     { [ "$spills_allowed" -eq 0 ] && [ "$local_mem" -ne 0 ]; }; then
    echo "FAILED: $(basename "$k"): HMMA $hmma, LDSM $ldsm, LDL/STL $local_mem ($among among the products)"
    status=1
  elif [ "$local_mem" -ne 0 ]; then
    echo "dK/dV kernel $(basename "$k"): LDL/STL $local_mem, none among its products (spills, allowed)"
  fi
done
echo "$forward tensor-core forward, $backward backward and $fp32 fp32 (TF32) forward kernels:" \
     "HMMA and LDSM in each, no local memory in the forward kernels and the dQ kernel," \
     "none among the dK/dV kernel's products"
exit $status
