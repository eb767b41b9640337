// SPDX-License-Identifier: Apache-2.0
// impl::SoftmaxState, the online-softmax state (O, m, l) of the kernels and
// schedules: merging normalised partials and open states over splits of the
// keys gives the attention over all keys; finalize is bitwise the kernel's own
// finish; fully masked rows stay O = 0, LSE = -inf; NaN stays NaN.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

template <class T>
using V4 = Kokkos::View<T****, Kokkos::LayoutRight, MemSpace>;
template <class T>
using V3 = Kokkos::View<T***, Kokkos::LayoutRight, MemSpace>;

/// The keys [k0, k1) of a host tensor, as a device View.
template <class T>
V4<T> key_slice(const HostTensor& t, int k0, int k1) {
  HostTensor s(t.b, k1 - k0, t.h, t.d);
  for (int a = 0; a < t.b; ++a)
    for (int n = k0; n < k1; ++n)
      for (int x = 0; x < t.h; ++x)
        for (int d = 0; d < t.d; ++d) s(a, n - k0, x, d) = t(a, n, x, d);
  V4<T> v("slice", t.b, k1 - k0, t.h, t.d);
  upload(s, v);  // t holds values already rounded to T: exact
  return v;
}

struct Case {
  Shape s;
  std::vector<int> cuts;  // key splits: [cuts[i], cuts[i + 1])
  index_type q_offset;    // < 0: the first -q_offset rows see no key (causal)
};

const Case cases[] = {
    {{1, 70, 200, 2, 1, 64}, {0, 64, 65, 200}, 0},
    {{2, 33, 129, 3, 3, 40}, {0, 1, 100, 129}, -5},
    {{1, 100, 300, 2, 2, 128}, {0, 150, 300}, 150},
    {{1, 17, 17, 1, 1, 8}, {0, 17}, -20},  // every row fully masked
};

/// Each key split attended separately (attention_forward with k_offset at the
/// split), then merged into one state: as normalised partials
/// (merge_partial) or as open states (merge_state of two halves).
template <class T>
void check_merges(const Case& c, std::uint64_t seed) {
  const Shape& s = c.s;
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng, 2.0);
  HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, 2.0);
  HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  V4<T> qd("q", s.b, s.nq, s.h, s.d);
  upload(q, qd);
  V4<T> kd("k", s.b, s.nk, s.hkv, s.d), vd("v", s.b, s.nk, s.hkv, s.d);
  upload(k, kd);
  upload(v, vd);
  const CausalMask mask;
  const double scale = 1.0 / std::sqrt(double(s.d));
  const ReferenceResult ref = reference_attention(q, k, v, mask, scale, c.q_offset, 0);
  const double tol = tolerance<T>(ref, s.d, s.nk);

  const int splits = int(c.cuts.size()) - 1;
  std::vector<V4<T>> part_o;
  std::vector<V3<T>> part_lse;
  for (int i = 0; i < splits; ++i) {
    const int k0 = c.cuts[std::size_t(i)], k1 = c.cuts[std::size_t(i) + 1];
    part_o.emplace_back("part_o", s.b, s.nq, s.h, s.d);
    part_lse.emplace_back("part_lse", s.b, s.h, s.nq);
    ForwardOptions opts;
    opts.q_offset = c.q_offset;
    opts.k_offset = k0;
    attention_forward(ExecSpace{}, qd, key_slice<T>(k, k0, k1), key_slice<T>(v, k0, k1),
                      part_o.back(), part_lse.back(), mask, opts);
  }
  ExecSpace exec;
  // Normalised partials merged one by one into one state.
  {
    V4<T> o("o", s.b, s.nq, s.h, s.d);
    V3<T> lse("lse", s.b, s.h, s.nq);
    impl::SoftmaxState<T, MemSpace> st(s.b, s.h, s.nq);
    st.init(exec, o, s.d);
    for (int i = 0; i < splits; ++i)
      st.merge_partial(exec, o, part_o[std::size_t(i)], part_lse[std::size_t(i)], s.d);
    st.finalize(exec, o, lse, s.d);
    exec.fence();
    const ErrorReport err = compare(ref, o, lse);
    // Each merge weighs a partial by 2^(lse2 - m'), whose relative error is
    // the partial's LSE error (<= tol) plus 2 ulp of exp2: O stays within
    // the partial's error plus twice the weight error, 3 tol.
    INFO(describe(s), " splits=", splits, " q_offset=", c.q_offset, " tol=", tol,
         " o_err=", err.o_err, " lse_err=", err.lse_err);
    CHECK(err.finite);
    CHECK(err.masked_rows_exact);
    CHECK(err.o_err <= 3 * tol);
    CHECK(err.lse_err <= 3 * tol);
  }
  // Two open states (first split, the rest) merged with merge_state.
  {
    V4<T> o("o", s.b, s.nq, s.h, s.d), o2("o2", s.b, s.nq, s.h, s.d);
    V3<T> lse("lse", s.b, s.h, s.nq);
    impl::SoftmaxState<T, MemSpace> a(s.b, s.h, s.nq), b(s.b, s.h, s.nq);
    a.init(exec, o, s.d);
    b.init(exec, o2, s.d);
    a.merge_partial(exec, o, part_o[0], part_lse[0], s.d);
    for (int i = 1; i < splits; ++i)
      b.merge_partial(exec, o2, part_o[std::size_t(i)], part_lse[std::size_t(i)], s.d);
    a.merge_state(exec, o, b, o2, s.d);
    a.finalize(exec, o, lse, s.d);
    exec.fence();
    const ErrorReport err = compare(ref, o, lse);
    INFO(describe(s), " merge_state, tol=", tol, " o_err=", err.o_err, " lse_err=", err.lse_err);
    CHECK(err.finite);
    CHECK(err.masked_rows_exact);
    CHECK(err.o_err <= 3 * tol);
    CHECK(err.lse_err <= 3 * tol);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("SoftmaxState: merged key splits give the attention over all keys", T, float,
                   double) {
  std::uint64_t seed = 11;
  for (const Case& c : cases) check_merges<T>(c, seed++);
}

TEST_CASE_TEMPLATE("SoftmaxState::finalize is bitwise the forward kernel's own finish", T, float,
                   double) {
  // One kernel launch that finishes, and one that leaves the state open
  // followed by finalize: the same O and LSE, bit for bit (the kernel and
  // SoftmaxState share SoftmaxRow's formulas).
  using mem = MemSpace;
  using Shape = DefaultTileShape<T, impl::is_host_space_v<ExecSpace>>;
  for (const Case& c : cases) {
    const auto& s = c.s;
    std::mt19937_64 rng(7);
    HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng, 2.0);
    HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, 2.0);
    HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
    V4<T> qd("q", s.b, s.nq, s.h, s.d), kd("k", s.b, s.nk, s.hkv, s.d),
        vd("v", s.b, s.nk, s.hkv, s.d), o1("o1", s.b, s.nq, s.h, s.d),
        o2("o2", s.b, s.nq, s.h, s.d);
    V3<T> l1("l1", s.b, s.h, s.nq), l2("l2", s.b, s.h, s.nq);
    upload(q, qd);
    upload(k, kd);
    upload(v, vd);
    ExecSpace exec;
    impl::ForwardExtents e{s.b, s.h, s.hkv, s.nq, s.nk, s.d};
    const CausalMask mask;
    const OffsetPositions qpos{c.q_offset}, kpos{0};
    const T scale = T(1) / std::sqrt(T(s.d));
    impl::with_shape_for<Shape>(s.d, [&](auto static_d, auto shape) {
      constexpr int SD = decltype(static_d)::value;
      using S = decltype(shape);
      using Kernel =
          impl::ForwardKernel<ExecSpace, T, SD, S, CausalMask, OffsetPositions, OffsetPositions>;
      auto kv = impl::allocate_forward_kv<T, mem, S, SD>(s.b, s.hkv, s.nk, Kernel::pad_dim(s.d));
      impl::pack_kv(exec, kd, vd, kv);
      impl::launch_forward<ExecSpace, T, SD, S>(exec, e, qd, kv, o1, l1, mask, qpos, kpos, scale);
      impl::BlockStep<T, mem> open;
      open.state = impl::SoftmaxState<T, mem>(s.b, s.h, s.nq);
      open.finish = false;
      impl::launch_forward<ExecSpace, T, SD, S>(exec, e, qd, kv, o2, l2, mask, qpos, kpos, scale,
                                                open);
      open.state.finalize(exec, o2, l2, s.d);
    });
    exec.fence();
    auto h1 = to_host(o1), h2 = to_host(o2);
    auto g1 = to_host(l1), g2 = to_host(l2);
    int differ = 0;
    for (std::size_t i = 0; i < h1.span(); ++i)
      differ += std::memcmp(h1.data() + i, h2.data() + i, sizeof(T)) != 0;
    for (std::size_t i = 0; i < g1.span(); ++i)
      differ += std::memcmp(g1.data() + i, g2.data() + i, sizeof(T)) != 0;
    INFO(describe(s), " q_offset=", c.q_offset);
    CHECK(differ == 0);
  }
}

TEST_CASE_TEMPLATE("SoftmaxState: a NaN partial makes its rows NaN, a -inf partial adds nothing", T,
                   float, double) {
  const int b = 1, n = 5, h = 2, d = 3;
  V4<T> o("o", b, n, h, d), po("po", b, n, h, d);
  V3<T> lse("lse", b, h, n), pl("pl", b, h, n);
  auto poh = Kokkos::create_mirror_view(po);
  auto plh = Kokkos::create_mirror_view(pl);
  for (int i = 0; i < n; ++i)
    for (int x = 0; x < h; ++x) {
      for (int y = 0; y < d; ++y) poh(0, i, x, y) = T(0.25) * T(y + 1);
      // Row 0: NaN partial; rows 1, 2: -inf partial (no key); others: finite.
      plh(0, x, i) = i == 0 ? std::numeric_limits<T>::quiet_NaN()
                            : (i < 3 ? -std::numeric_limits<T>::infinity() : T(0.5) * T(i));
    }
  Kokkos::deep_copy(po, poh);
  Kokkos::deep_copy(pl, plh);
  ExecSpace exec;
  impl::SoftmaxState<T, MemSpace> st(b, h, n);
  st.init(exec, o, d);
  st.merge_partial(exec, o, po, pl, d);
  st.merge_partial(exec, o, po, pl, d);  // twice: the same partial, LSE + ln 2
  st.finalize(exec, o, lse, d);
  exec.fence();
  auto oh = to_host(o);
  auto lh = to_host(lse);
  for (int x = 0; x < h; ++x) {
    CHECK(std::isnan(double(lh(0, x, 0))));
    for (int y = 0; y < d; ++y) CHECK(std::isnan(double(oh(0, 0, x, y))));
    for (int i = 1; i < 3; ++i) {
      CHECK(lh(0, x, i) == -std::numeric_limits<T>::infinity());
      for (int y = 0; y < d; ++y) CHECK(oh(0, i, x, y) == T(0));
    }
    for (int i = 3; i < n; ++i) {
      // Two equal partials: O unchanged, LSE + ln 2.
      CHECK(
          double(lh(0, x, i)) ==
          doctest::Approx(0.5 * i + std::log(2.0)).epsilon(4 * std::numeric_limits<T>::epsilon()));
      for (int y = 0; y < d; ++y)
        CHECK(double(oh(0, i, x, y)) ==
              doctest::Approx(0.25 * (y + 1)).epsilon(4 * std::numeric_limits<T>::epsilon()));
    }
  }
}
