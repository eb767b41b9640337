// SPDX-License-Identifier: Apache-2.0
// What the distributed step loops know of a call, and the workspace buffers
// they allocate (blocks that travel live in buffers of the longest rank's
// length).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/validate.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace blockattn::impl {

/// What every rank knows of a call once the consensus passed: this rank's
/// extents, the global length N (the sum of the local lengths) and every
/// rank's local length.
struct CallExtents {
  BlockExtents e;
  index_type N = 0;
  std::vector<index_type> lengths;
  int most = 0;  // the longest local length: the size of every buffer that travels
  /// The extents of the block pair (queries of q_rank, keys of k_rank).
  BlockExtents task(int q_rank, int k_rank) const {
    BlockExtents t = e;
    t.queries = int(lengths[std::size_t(q_rank)]);
    t.keys = int(lengths[std::size_t(k_rank)]);
    return t;
  }
};

template <class T, class ExecSpace>
using Buffer4 = Kokkos::View<T****, Kokkos::LayoutRight, typename ExecSpace::memory_space>;
template <class T, class ExecSpace>
using LseBuffer = Kokkos::View<T***, Kokkos::LayoutRight, typename ExecSpace::memory_space>;

template <class V>
std::int64_t bytes_of(const V& v) {
  return std::int64_t(v.span()) * std::int64_t(sizeof(typename V::value_type));
}

template <class A, class B>
bool same_memory(const A& a, const B& b) {
  return static_cast<const void*>(a.data()) == static_cast<const void*>(b.data());
}

/// A buffer of x's shape, with `rows` rows (sequence extent) when >= 0.
template <class T, class ExecSpace, class X>
Buffer4<T, ExecSpace> buffer_like(const X& x, const char* label, int rows = -1) {
  return Buffer4<T, ExecSpace>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
                               x.extent(0), rows < 0 ? x.extent(1) : std::size_t(rows), x.extent(2),
                               x.extent(3));
}

/// The first n rows (sequence positions) of a buffer: a block of another
/// length lives in a buffer sized for the longest rank.
template <class B>
auto rows_of(const B& b, index_type n) {
  return Kokkos::subview(b, Kokkos::ALL, Kokkos::make_pair(std::size_t(0), std::size_t(n)),
                         Kokkos::ALL, Kokkos::ALL);
}

/// A rank's own gradient as a LayoutRight View of the memory space: the
/// caller's View itself when it is one (LayoutRight, contiguous, of the
/// compute type), else a workspace buffer copied out after the loop (for
/// bf16 / fp16 gradients: an fp32 sum over the steps, rounded once). One View
/// type for every gradient target keeps one instantiation of the kernels.
template <class T, class ExecSpace, class G>
Buffer4<T, ExecSpace> own_gradient(const G& g, const char* label) {
  if constexpr (std::is_same<typename G::array_layout, Kokkos::LayoutRight>::value &&
                std::is_same<typename G::non_const_value_type, T>::value) {
    if (g.span_is_contiguous())
      return Buffer4<T, ExecSpace>(g.data(), g.extent(0), g.extent(1), g.extent(2), g.extent(3));
  }
  return buffer_like<T, ExecSpace>(g, label);
}

}  // namespace blockattn::impl
