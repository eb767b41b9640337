// SPDX-License-Identifier: Apache-2.0
// Test main: Kokkos first, then doctest. Returns non-zero on any failure.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <Kokkos_Core.hpp>

#include "device_gate.hpp"

int main(int argc, char** argv) {
  if (blockattn::test::device_missing()) return blockattn::test::skip_return_code;
  Kokkos::initialize(argc, argv);
  int result = 0;
  {
    doctest::Context context(argc, argv);
    result = context.run();
  }
  Kokkos::finalize();
  return result;
}
