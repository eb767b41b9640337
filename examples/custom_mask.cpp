// SPDX-License-Identifier: Apache-2.0
// Writing your own mask: a small struct with classify() and allowed() on
// global positions. Two examples, a prefix-LM mask and a block-sparse
// "local + global tokens" mask, each checked against a brute-force result.
//
//   ./blockattn_custom_mask
#include <blockattn/blockattn.hpp>

#include <cmath>
#include <cstdio>

using blockattn::index_type;
using blockattn::TileKind;

/// Prefix-LM: the first `prefix` tokens see each other (bidirectional); every
/// later token is causal and also sees the whole prefix.
struct PrefixLM {
  index_type prefix = 0;

  KOKKOS_INLINE_FUNCTION bool allowed(index_type q, index_type k) const {
    return k < prefix || k <= q;
  }
  // Conservative on a box of positions: 'full' / 'empty' only when certain.
  KOKKOS_INLINE_FUNCTION TileKind classify(index_type q_begin, index_type q_end, index_type k_begin,
                                           index_type k_end) const {
    if (k_end <= prefix || k_end - 1 <= q_begin) return TileKind::full;
    if (k_begin >= prefix && k_begin > q_end - 1) return TileKind::empty;
    return TileKind::partial;
  }
};

/// Block-sparse: blocks of `block` tokens attend causally within their own
/// block and the previous one, and to the first `global` tokens.
struct LocalPlusGlobal {
  index_type block = 64;
  index_type global = 16;

  KOKKOS_INLINE_FUNCTION bool allowed(index_type q, index_type k) const {
    if (k > q) return false;
    return k < global || q / block - k / block <= 1;
  }
  KOKKOS_INLINE_FUNCTION TileKind classify(index_type q_begin, index_type q_end, index_type k_begin,
                                           index_type k_end) const {
    if (k_begin > q_end - 1) return TileKind::empty;  // entirely above the diagonal
    const bool all_global = k_end <= global;
    const bool all_local = (q_end - 1) / block - k_begin / block <= 1;
    if (k_end - 1 <= q_begin && (all_global || all_local)) return TileKind::full;
    const bool none_global = k_begin >= global;
    const bool none_local = q_begin / block - (k_end - 1) / block > 1;
    if (none_global && none_local) return TileKind::empty;
    return TileKind::partial;
  }
};

template <class Mask>
double check(const Mask& mask, const char* name) {
  const int n = 300, d = 64;
  Kokkos::View<double****> q("q", 1, n, 1, d), k("k", 1, n, 1, d), v("v", 1, n, 1, d),
      o("o", 1, n, 1, d);
  Kokkos::View<double***> lse("lse", 1, 1, n);
  auto qh = Kokkos::create_mirror_view(q), kh = Kokkos::create_mirror_view(k),
       vh = Kokkos::create_mirror_view(v);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) {
      qh(0, i, 0, c) = std::sin(0.1 * i + c);
      kh(0, i, 0, c) = std::cos(0.07 * i - c);
      vh(0, i, 0, c) = std::sin(0.05 * i * c);
    }
  Kokkos::deep_copy(q, qh);
  Kokkos::deep_copy(k, kh);
  Kokkos::deep_copy(v, vh);

  blockattn::attention_forward(q, k, v, o, lse, mask);

  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  // Brute force with the same mask predicate.
  double err = 0.0;
  for (int i = 0; i < n; ++i) {
    double mx = -INFINITY, sum = 0.0;
    std::vector<double> s(n);
    for (int j = 0; j < n; ++j) {
      double dot = 0.0;
      for (int c = 0; c < d; ++c) dot += qh(0, i, 0, c) * kh(0, j, 0, c);
      s[j] = mask.allowed(i, j) ? dot / std::sqrt(double(d)) : -INFINITY;
      mx = std::max(mx, s[j]);
    }
    for (int j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
    for (int c = 0; c < d; ++c) {
      double acc = 0.0;
      for (int j = 0; j < n; ++j) acc += s[j] * vh(0, j, 0, c);
      err = std::max(err, std::abs(acc / sum - oh(0, i, 0, c)));
    }
  }
  std::printf("%-18s max |O - O_bruteforce| = %.2e\n", name, err);
  return err;
}

int main(int argc, char** argv) {
  Kokkos::initialize(argc, argv);
  int rc = 0;
  {
    static_assert(blockattn::is_mask_policy_v<PrefixLM>, "PrefixLM models the mask concept");
    static_assert(blockattn::is_mask_policy_v<LocalPlusGlobal>, "so does LocalPlusGlobal");
    // fp64 inputs: agreement to 1e-12 (accumulated rounding is ~1e-15).
    if (check(PrefixLM{100}, "prefix-LM(100)") > 1e-12) rc = 1;
    if (check(LocalPlusGlobal{64, 16}, "local+global(64,16)") > 1e-12) rc = 1;
  }
  Kokkos::finalize();
  return rc;
}
