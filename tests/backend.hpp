// SPDX-License-Identifier: Apache-2.0
// The execution space a test binary runs on: each backend test binary is the
// same sources compiled with BLOCKATTN_TEST_BACKEND set to one Kokkos backend.
#pragma once

#include <Kokkos_Core.hpp>

#ifndef BLOCKATTN_TEST_BACKEND
#error "compile the backend tests with -DBLOCKATTN_TEST_BACKEND=<Kokkos execution space>"
#endif

namespace blockattn::test {
using ExecSpace = BLOCKATTN_TEST_BACKEND;
using MemSpace = ExecSpace::memory_space;
}  // namespace blockattn::test
