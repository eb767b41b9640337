// SPDX-License-Identifier: Apache-2.0
// A user-defined score policy as tests use it (examples/score_policy.cpp shows
// users the same pattern): a per-head temperature, s' = s (1 + step * head),
// whose derivative depends on the head (a wrong head or a missing chain-rule
// factor shows in the gradients).
#pragma once

#include <blockattn/policy/score.hpp>

#include <array>

namespace blockattn::test {

struct HeadTemperature {
  double step = 0.25;
  template <class T>
  KOKKOS_INLINE_FUNCTION T score(T s, index_type, index_type, int head) const {
    return s * (T(1) + T(step) * T(head));
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION T score_grad(T, index_type, index_type, int head) const {
    return T(1) + T(step) * T(head);
  }
  std::array<double, 1> parameters() const { return {{step}}; }
};

}  // namespace blockattn::test
