// SPDX-License-Identifier: Apache-2.0
// Device test binaries (BLOCKATTN_TEST_DEVICE) exit with this code, before
// initializing Kokkos, when the machine has no GPU: ctest's SKIP_RETURN_CODE
// reports them as skipped, not passed.
#pragma once

#include <Kokkos_Core.hpp>

#include <cstdio>

namespace blockattn::test {

inline constexpr int skip_return_code = 77;

/// True when this binary tests a GPU backend and no GPU can be used here.
inline bool device_missing() {
#if defined(BLOCKATTN_TEST_DEVICE) && defined(KOKKOS_ENABLE_CUDA)
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    std::printf("[blockattn] no CUDA device (%s): skipped\n",
                rc != cudaSuccess ? cudaGetErrorString(rc) : "0 devices");
    return true;
  }
#elif defined(BLOCKATTN_TEST_DEVICE) && defined(KOKKOS_ENABLE_HIP)
  int count = 0;
  const hipError_t rc = hipGetDeviceCount(&count);
  if (rc != hipSuccess || count == 0) {
    std::printf("[blockattn] no HIP device (%s): skipped\n",
                rc != hipSuccess ? hipGetErrorString(rc) : "0 devices");
    return true;
  }
#endif
  return false;
}

}  // namespace blockattn::test
