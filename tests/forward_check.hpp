// SPDX-License-Identifier: Apache-2.0
// Runs attention_forward on device Views built from host tensors and compares
// with the fp64 reference.
#pragma once

#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "backend.hpp"
#include "reference.hpp"

namespace blockattn::test {

/// A LayoutRight View of `view`'s shape in its memory space. Copies between a
/// host mirror and a strided (non-contiguous) device View have no common
/// execution space; they go through this contiguous twin on the device.
template <class View>
auto contiguous_like(const View& v) {
  using Out = Kokkos::View<typename View::non_const_data_type, Kokkos::LayoutRight,
                           typename View::memory_space>;
  if constexpr (unsigned(View::rank) == 4)
    return Out("contiguous", v.extent(0), v.extent(1), v.extent(2), v.extent(3));
  else if constexpr (unsigned(View::rank) == 3)
    return Out("contiguous", v.extent(0), v.extent(1), v.extent(2));
  else
    return Out("contiguous", v.extent(0));
}

/// A host copy of any View (any layout, any memory space).
template <class View>
auto to_host(const View& v) {
  auto c = contiguous_like(v);
  Kokkos::deep_copy(c, v);
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), c);
}

/// A host tensor of a rank-4 View's values (any layout, any memory space).
template <class View>
HostTensor download(const View& v) {
  auto h = to_host(v);
  HostTensor t(int(v.extent(0)), int(v.extent(1)), int(v.extent(2)), int(v.extent(3)));
  for (int a = 0; a < t.b; ++a)
    for (int n = 0; n < t.n; ++n)
      for (int x = 0; x < t.h; ++x)
        for (int d = 0; d < t.d; ++d) t(a, n, x, d) = static_cast<double>(h(a, n, x, d));
  return t;
}

/// The largest error of rounding a value to S beyond u16 * |x|: half of the
/// smallest subnormal (fp16: 2^-25; bf16's subnormals are fp32's: 2^-134).
template <class S>
constexpr double subnormal_error() {
  return std::is_same<S, fp16>::value ? 2.9802322387695312e-08 : 2.2958874039497803e-41;
}

/// Bound on |fl16(x~) - x| when x~ (fp32) is within e32 of x: e32 + u16 (|x| + e32) + tiny.
template <class S>
double rounded_bound(double e32, double x) {
  return e32 + S::unit_roundoff * (std::abs(x) + e32) + subnormal_error<S>();
}

/// Copies a host tensor into a device View of T (any layout), rounding to T;
/// the host tensor is overwritten with the rounded values so that the
/// reference sees exactly the kernel's inputs.
template <class View>
void upload(HostTensor& t, const View& view) {
  using T = typename View::non_const_value_type;
  auto c = contiguous_like(view);
  auto h = Kokkos::create_mirror_view(c);
  for (int a = 0; a < t.b; ++a)
    for (int n = 0; n < t.n; ++n)
      for (int x = 0; x < t.h; ++x)
        for (int d = 0; d < t.d; ++d) {
          h(a, n, x, d) = static_cast<T>(t(a, n, x, d));
          t(a, n, x, d) = static_cast<double>(h(a, n, x, d));
        }
  Kokkos::deep_copy(c, h);
  Kokkos::deep_copy(view, c);
}

struct ErrorReport {
  double o_err = 0.0;    // max |O - O_ref|  (V entries are in [-1, 1])
  double lse_err = 0.0;  // max |LSE - LSE_ref| over rows with an allowed key
  bool finite = true;    // no NaN anywhere, no inf in O, LSE = -inf exactly where expected
  int masked_rows = 0;   // rows with no allowed key (O must be exactly 0 there)
  bool masked_rows_exact = true;
};

template <class OView, class LView>
ErrorReport compare(const ReferenceResult& ref, const OView& o, const LView& lse) {
  auto oh = to_host(o);
  auto lh = to_host(lse);
  ErrorReport r;
  const auto& t = ref.o;
  for (int a = 0; a < t.b; ++a)
    for (int h = 0; h < t.h; ++h)
      for (int n = 0; n < t.n; ++n) {
        const double want = ref.lse[(std::size_t(a) * t.h + h) * t.n + n];
        const double got = static_cast<double>(lh(a, h, n));
        const bool row_masked = std::isinf(want);
        if (std::isnan(got)) r.finite = false;
        if (row_masked) {
          ++r.masked_rows;
          if (!(std::isinf(got) && got < 0)) r.masked_rows_exact = false;
        } else {
          if (std::isinf(got)) r.finite = false;
          r.lse_err = std::max(r.lse_err, std::abs(got - want));
        }
        for (int d = 0; d < t.d; ++d) {
          const double og = static_cast<double>(oh(a, n, h, d));
          if (!std::isfinite(og)) r.finite = false;
          if (row_masked && og != 0.0) r.masked_rows_exact = false;
          r.o_err = std::max(r.o_err, std::abs(og - t(a, n, h, d)));
        }
      }
  return r;
}

/// Error budget of one forward call, in absolute units of O (V in [-1, 1]) and
/// of LSE. Rounding errors add up like a random walk: each logit carries about
/// sqrt(D) * eps * A (A = scale * max sum_d |q_d k_d|, the logit's condition),
/// which moves a softmax weight by the same relative amount; the row sums and
/// P*V add about sqrt(Nk) * eps. A factor 8 covers the constants of exp2 (2 ulp),
/// the pre-scaling of Q and the order of the partial sums.
template <class T>
double tolerance(const ReferenceResult& ref, int dim, int keys) {
  const double eps = std::numeric_limits<T>::epsilon();
  return 8.0 * eps *
         (std::sqrt(double(dim)) * ref.max_dot_condition + std::sqrt(double(keys)) + 1.0);
}

struct Shape {
  int b, nq, nk, h, hkv, d;
};

inline std::string describe(const Shape& s) {
  return "B=" + std::to_string(s.b) + " Nq=" + std::to_string(s.nq) +
         " Nk=" + std::to_string(s.nk) + " H=" + std::to_string(s.h) +
         " Hkv=" + std::to_string(s.hkv) + " D=" + std::to_string(s.d);
}

}  // namespace blockattn::test
