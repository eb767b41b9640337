#!/bin/sh
# Runs a device (CUDA/HIP) test binary: reports "skipped" (exit 77, ctest's
# SKIP_RETURN_CODE) when the GPU driver library it links cannot be loaded on
# this machine; otherwise runs it (it skips with 77 itself when the driver
# loads but finds no GPU).
#   run_device_test.sh <test binary> <command...>   (command may be mpiexec ... binary)
exe=$1
shift
missing=$(ldd "$exe" 2>/dev/null | grep 'not found' | awk '{print $1}' | tr '\n' ' ')
if [ -n "$missing" ]; then
  echo "[blockattn] $(basename "$exe"): cannot load ${missing}(no GPU driver here): skipped"
  exit 77
fi
exec "$@"
