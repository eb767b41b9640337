#!/bin/sh
# The precompiled block products that objects call, as BLOCKATTN_KERNELS_SET
# selectors (Backend:Mask:Positions:direction:types, cmake/BlockAttnKernelsSet.cmake).
#
#   kernels_used.sh list  <objects>         print them, sorted
#   kernels_used.sh check <objects> <file>  fail unless <file> lists exactly them
#
# <objects>: a file naming object files, one per line (the build writes
# <build>/kernels/objects_linking_kernels.txt: the objects of every target that
# links BlockAttn::kernels). An object calls a built-in block product either
# through the library (nm: U, the set's extern declaration) or, when the set
# leaves it out, by compiling it itself (W). `list` on a build with the whole
# set (-DBLOCKATTN_KERNELS_SET='*:*:*:*:*', the default) is exact: the extern
# declarations keep every call visible. On a narrowed build, a kernel a file
# compiles itself and inlines entirely leaves no symbol, so `check` can miss
# a new call there (it then only costs compile time), never a selector no
# object calls.
#
# Regenerate the test suite's set (tests/kernels_used.txt) after a change to
# which kernels the tests, examples, tools or benchmarks call:
#   cmake/blockattn.sh configure -DBLOCKATTN_KERNELS_SET='*:*:*:*:*' && cmake --build build
#   sh tests/kernels_used.sh list build/kernels/objects_linking_kernels.txt > used
# then keep the file's comment lines and replace its selectors with `used`.
set -eu
mode=$1
objects=$2

while IFS= read -r obj; do
  [ -z "$obj" ] || [ -f "$obj" ] || { echo "kernels_used.sh: no object $obj (build first)" >&2; exit 2; }
done < "$objects"

used() {
  # Demangled: void blockattn::impl::forward_block_kernel<Kokkos::Serial,
  # float, blockattn::bf16, float, blockattn::CausalMask,
  # blockattn::AffinePositions>(...). Built-in masks and position maps only.
  while IFS= read -r obj; do
    [ -z "$obj" ] || nm -C "$obj"
  done < "$objects" |
    sed -n 's/^.* [UWT] void blockattn::impl::\(forward\|backward\)_block_kernel<\([^<>]*\)>(.*$/\1, \2/p' |
    awk -F', ' '
      function ty(s) { sub(/^blockattn::/, "", s); return s == "double" ? "fp64" : s == "float" ? "fp32" : s }
      NF == 7 {
        exec = $2; sub(/^Kokkos::/, "", exec)
        mask = $6; sub(/^blockattn::/, "", mask)
        pos = $7; sub(/^blockattn::/, "", pos); sub(/Positions$/, "", pos)
        t = ty($3); a = ty($4); b = ty($5)
        if (t == "fp64" && a == "fp64" && b == "fp64") types = "fp64"
        else if (t == "fp32" && a == "fp32" && b == "fp32") types = "fp32"
        else if (t == "fp32" && (a == "bf16" || a == "fp16") && b == a) types = a
        else if (t == "fp32" && (a == "bf16" || a == "fp16") && b == "fp32") types = a "-fp32"
        else next
        if (exec !~ /^(Serial|OpenMP)$/) next
        if (mask !~ /^(FullMask|CausalMask|SlidingWindowMask|PrefixLMMask|DocumentMask)$/) next
        if (pos !~ /^(Affine|Table)$/) next
        print exec ":" mask ":" pos ":" $1 ":" types
      }' | sort -u
}

case "$mode" in
  list)
    used
    ;;
  check)
    file=$3
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    used > "$tmp/used"
    sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$file" | sort -u > "$tmp/listed"
    if [ ! -s "$tmp/used" ]; then
      echo "kernels_used.sh: the objects call no precompiled block product" >&2
      exit 1
    fi
    missing=$(comm -23 "$tmp/used" "$tmp/listed")
    unused=$(comm -13 "$tmp/used" "$tmp/listed")
    status=0
    if [ -n "$missing" ]; then
      echo "called but not in $file (each calling file compiles them itself):"
      printf '  %s\n' $missing
      status=1
    fi
    if [ -n "$unused" ]; then
      echo "in $file but called by no object (precompiled for nothing):"
      printf '  %s\n' $unused
      status=1
    fi
    [ $status -eq 0 ] && echo "$file: the $(wc -l < "$tmp/used") block products the objects call"
    [ $status -eq 0 ] || echo "(regenerate: the comment at the top of tests/kernels_used.sh)"
    exit $status
    ;;
  *)
    echo "usage: kernels_used.sh list <objects> | check <objects> <file>" >&2
    exit 2
    ;;
esac
