// SPDX-License-Identifier: Apache-2.0
// What the serving suites (test_serve, test_paged, test_batch) share: their
// View types, a bitwise comparison of two Views, and rows of one sequence
// cut from a global (sequences, tokens, heads, D) tensor.
#pragma once

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cstring>

#include "backend.hpp"
#include "reference.hpp"

namespace blockattn::test {

using ServeComm = MpiCommunicator<>;
template <class T>
using V4 = Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>;
template <class T>
using V3 = Kokkos::View<compute_t<T>***, Kokkos::LayoutRight, MemSpace>;

/// Whether two Views hold the same bits (their spans' bytes).
template <class A, class B>
bool same_bits(const A& a, const B& b) {
  const auto ha = to_host(a);
  const auto hb = to_host(b);
  return ha.span() == hb.span() &&
         std::memcmp(ha.data(), hb.data(), ha.span() * sizeof(typename A::value_type)) == 0;
}

/// Rows [r0, r0 + n) of sequence s of a global (sequences, tokens, heads, D) tensor.
inline HostTensor rows_of(const HostTensor& t, int s, int r0, int n) {
  HostTensor out(1, n, t.h, t.d);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < t.h; ++h)
      for (int d = 0; d < t.d; ++d) out(0, i, h, d) = t(s, r0 + i, h, d);
  return out;
}

}  // namespace blockattn::test
