#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ctest readme_install_and_demo: in a fresh clone, the README's install command
# (read from README.md, paths filled in) and `cmake/blockattn.sh`'s demo build
# tree coexist. The install configures its own folder; a build/ that a user
# configured by hand without examples (the old install command) still gets the
# demo targets when the script configures it. The install configure compiles
# BlockAttn::kernels and the planner with optimisation and without -Werror,
# says which -march the kernels get, and installs bin/blockattn_plan.
# Configure steps only: the builds themselves are the rest of CI (the test
# command builds and runs the demos and examples; consumer_project installs
# the package, runs the installed planner and builds against the package with
# find_package). Last, a configure with every default.
#   new_user.sh SOURCE_DIR KOKKOS_ROOT WORK_DIR
set -euo pipefail
src=$1 kokkos=$2 work=$3
if ! git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  echo "not a git checkout: nothing to clone (skipped)"
  exit 77
fi
rm -rf "$work"
mkdir -p "$work"
git clone -q "$src" "$work/clone"
cd "$work/clone"

# The README's install block: the first ```sh block after its heading.
block=$(awk '/^## Install and use from CMake/ {h = 1} h && /^```sh/ {b = 1; next} b && /^```/ {exit} b' README.md)
[ -n "$block" ] || { echo "README.md: no install block under '## Install and use from CMake'"; exit 1; }
echo "README's install command:"
echo "$block"
configure_line=$(printf '%s\n' "$block" | grep -m1 '^cmake -S')
install_dir=$(printf '%s\n' "$configure_line" | sed -n 's/.* -B \([^ ]*\).*/\1/p')
[ -n "$install_dir" ] || { echo "no -B <dir> in: $configure_line"; exit 1; }
default_build=build  # cmake/blockattn.sh's build tree (BUILD_DIR unset)
if [ "$install_dir" = "$default_build" ]; then
  echo "the install command configures $default_build/, the tree cmake/blockattn.sh demo reuses"
  exit 1
fi
configure_out=$(eval "${configure_line//\/path\/to\/kokkos/$kokkos}")
grep -q '^BLOCKATTN_BUILD_EXAMPLES:BOOL=OFF' "$install_dir/CMakeCache.txt"

# What that configure compiles, as the build system will compile it: the
# precompiled kernels and the planner optimised, warnings not as errors; the
# kernels' instruction set said; the planner installed into bin/.
fail() { echo "README's install: $*"; exit 1; }
for t in CMakeFiles/blockattn_kernels.dir tools/CMakeFiles/blockattn_plan.dir; do
  flags_file=$install_dir/$t/flags.make
  [ -f "$flags_file" ] || fail "no $flags_file (is the target configured?)"
  flags=$(sed -n 's/^CXX_FLAGS = //p' "$flags_file")
  echo "${t%%.dir}: $flags"
  grep -Eq '(^| )-O([1-3s]|fast)( |$)' <<<"$flags" || fail "$t compiles without optimisation: $flags"
  ! grep -q -- '-Werror' <<<"$flags" || fail "$t compiles with -Werror: $flags"
done
grep -q 'BlockAttn::kernels: .*instruction set' <<<"$configure_out" ||
  fail "configure does not say which instruction set BlockAttn::kernels is compiled for"
grep -F 'BlockAttn::kernels:' <<<"$configure_out"
rules=$install_dir/tools/cmake_install.cmake
grep -q 'blockattn_plan' "$rules" 2>/dev/null && grep -q 'CMAKE_INSTALL_PREFIX}/bin"' "$rules" ||
  fail "cmake --install does not install blockattn_plan into bin/ ($rules)"
echo "install: kernels and planner optimised, no -Werror, bin/blockattn_plan installed"

# A build/ configured by hand without tests or examples, then the script.
cmake -S . -B "$default_build" -DKokkos_ROOT="$kokkos" -DBLOCKATTN_BUILD_TESTS=OFF \
  -DBLOCKATTN_BUILD_EXAMPLES=OFF >/dev/null
KOKKOS_ROOT="$kokkos" cmake/blockattn.sh configure
targets=$(cmake --build "$default_build" --target help)
for t in blockattn_demo_single blockattn_demo blockattn_plan; do
  grep -q "$t" <<<"$targets" || { echo "$default_build/ has no target $t after cmake/blockattn.sh configure"; exit 1; }
done
# The install tree is untouched.
grep -q '^BLOCKATTN_BUILD_EXAMPLES:BOOL=OFF' "$install_dir/CMakeCache.txt"
echo "install ($install_dir/) and demo ($default_build/) coexist"

# The plainest configure a user types: every default (tests, examples and
# tools on, benchmarks off). It once failed: a helper looked into bench/,
# which the defaults do not add.
cmake -S . -B plain -DKokkos_ROOT="$kokkos" >/dev/null ||
  { echo "cmake -S . -B plain -DKokkos_ROOT=... (every default) failed"; exit 1; }
echo "a configure with every default succeeds"
