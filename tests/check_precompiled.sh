#!/bin/sh
# Checks that an object compiled with BlockAttn::kernels linked instantiates no
# kernel of the block product itself: it must reference (nm: U) the
# precompiled forward_block_kernel and backward_block_kernel and define
# (T or W) none of them. Needs nm and c++filt.
#   check_precompiled.sh <object file>
set -eu
obj=$1
syms=$(nm -C "$obj" | grep -E 'blockattn::impl::(forward|backward)_block_kernel<' || true)
defined=$(printf '%s\n' "$syms" | grep -E '^[0-9a-f]+ [TtWw] ' || true)
used=$(printf '%s\n' "$syms" | grep -cE '^ +U ' || true)
if [ -n "$defined" ]; then
  echo "$obj compiles block-product kernels that BlockAttn::kernels provides:"
  printf '%s\n' "$defined" | cut -c1-300
  exit 1
fi
if [ "$used" -lt 3 ]; then
  echo "$obj references $used precompiled block-product kernels, expected at least 3"
  exit 1
fi
echo "$obj: $used precompiled block-product kernels referenced, none compiled"
