// SPDX-License-Identifier: Apache-2.0
// Host-only: accuracy of the fp32 exp2 used for softmax numerators.
#include <doctest/doctest.h>

#include <blockattn/kernel/impl/exp2.hpp>

#include <cmath>
#include <limits>

using blockattn::impl::exp2_nonpositive;

TEST_CASE("fp32 exp2 on [-126, 0] is within 2.5e-7 relative of the fp64 value") {
  // Tolerance: the polynomial's 1.2e-7 plus rounding of the reduced argument
  // and of the final product, about 2 ulp of fp32 (ulp/2 = 6e-8).
  double worst = 0.0;
  for (int i = 0; i <= 2000000; ++i) {
    const float x = -126.0f * static_cast<float>(i) / 2000000.0f;
    const double want = std::exp2(static_cast<double>(x));
    const double got = exp2_nonpositive(x);
    worst = std::max(worst, std::abs(got - want) / want);
  }
  CHECK(worst < 2.5e-7);
  CHECK(exp2_nonpositive(0.0f) == 1.0f);
  CHECK(exp2_nonpositive(-0.0f) == 1.0f);
  CHECK(exp2_nonpositive(-1.0f) == 0.5f);
}

TEST_CASE("fp32 exp2 gives exactly 0 below the normal range and for -inf") {
  CHECK(exp2_nonpositive(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(exp2_nonpositive(-126.5f) == 0.0f);
  CHECK(exp2_nonpositive(-1.0e30f) == 0.0f);
  CHECK(exp2_nonpositive(-std::numeric_limits<double>::infinity()) == 0.0);
}
