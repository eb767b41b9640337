// SPDX-License-Identifier: Apache-2.0
// The execution space a test binary runs on: each backend test binary is the
// same sources compiled with BLOCKATTN_TEST_BACKEND set to one Kokkos backend.
#pragma once

#include <Kokkos_Core.hpp>

#ifndef BLOCKATTN_TEST_BACKEND
#error "compile the backend tests with -DBLOCKATTN_TEST_BACKEND=<Kokkos execution space>"
#endif

// The value types the kernel tests instantiate: fp32 and fp64. The per-ISA
// binaries (tests/CMakeLists.txt, BLOCKATTN_TEST_FP32_ONLY) test fp32 only:
// fp64 runs the portable kernel and tiles on every ISA (tile_shape.hpp), and
// the serial / openmp binaries test it.
#if defined(BLOCKATTN_TEST_FP32_ONLY) && BLOCKATTN_TEST_FP32_ONLY
#define BLOCKATTN_TEST_TYPES float
#else
#define BLOCKATTN_TEST_TYPES float, double
#endif

namespace blockattn::test {
using ExecSpace = BLOCKATTN_TEST_BACKEND;
using MemSpace = ExecSpace::memory_space;
}  // namespace blockattn::test
