#!/usr/bin/env bash
# Debian's Open MPI for the GPU machine, which has none: the packages of
# openmpi-bin, openmpi-common and libopenmpi3, and of every shared library
# that their programs, libraries and plug-ins load on this machine (ldd here;
# each library's package from dpkg -S; the C and C++ runtimes left out: the
# device has its own, and a second libc in LD_LIBRARY_PATH breaks every
# program). Fetched with `apt-get download` from this machine's own apt
# sources, unpacked with dpkg -x into <dir>: bench/pack_gpu_bundle.sh's third
# argument, which bench/gpu_session.sh runs with OPAL_PREFIX=<dir>/usr.
#
#   bench/unpack_mpi.sh <dir>
#
# Needs Open MPI installed here (cmake/blockattn.sh deps installs it).
set -euo pipefail
dir=${1:?usage: unpack_mpi.sh <dir>}
for p in openmpi-bin openmpi-common libopenmpi3; do
  dpkg -s "$p" >/dev/null 2>&1 || { echo "$p is not installed here (cmake/blockattn.sh deps)" >&2; exit 1; }
done
# Every ELF file of the three packages and of PMIx (the launcher's plug-ins).
elves=()
while read -r f; do
  [ -f "$f" ] && head -c 4 "$f" 2>/dev/null | grep -q ELF && elves+=("$f")
done < <(dpkg -L openmpi-bin libopenmpi3 libpmix2 2>/dev/null | grep -E '/bin/|\.so')
# Their libraries' packages, as this machine resolves them.
runtime='^(libc6|libgcc-s1|libstdc\+\+6|libcrypt1|zlib1g)$'
pkgs=$(for f in "${elves[@]}"; do ldd "$f" 2>/dev/null; done |
  awk '/=> \// {print $3}' | sort -u |
  while read -r lib; do dpkg -S "$(readlink -f "$lib")" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || true; done |
  cut -d: -f1 | sort -u | grep -vE "$runtime" || true)
pkgs=$(printf '%s\n' openmpi-bin openmpi-common libopenmpi3 libpmix2 $pkgs | sort -u)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# (As root, apt warns that its sandbox user cannot write here: root downloads.)
(cd "$work" && apt-get -o APT::Sandbox::User=root download $pkgs >/dev/null)
mkdir -p "$dir"
for deb in "$work"/*.deb; do dpkg -x "$deb" "$dir"; done
# Debian links mpiexec and mpirun through /etc/alternatives, which dpkg -x
# does not make: link them to the launcher directly.
ln -sfn orterun "$dir/usr/bin/mpiexec"
ln -sfn orterun "$dir/usr/bin/mpirun"
echo "unpacked $(ls "$work"/*.deb | wc -l) packages into $dir ($(du -sh "$dir" | cut -f1)):" $pkgs
# What the launcher would still miss there (nothing, where the list is whole).
missing=$(LD_LIBRARY_PATH="$dir/usr/lib/x86_64-linux-gnu:$dir/usr/lib/x86_64-linux-gnu/openmpi/lib" \
  ldd "$dir/usr/bin/orterun" 2>&1 | grep 'not found' || true)
[ -z "$missing" ] || { echo "orterun would miss: $missing" >&2; exit 1; }
