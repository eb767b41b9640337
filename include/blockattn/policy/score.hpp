// SPDX-License-Identifier: Apache-2.0
// Score policies: a change of the logits before the softmax,
//
//   s' = score(s, q, k, head),   s = scale * q . k,
//
// on global positions q, k and the global query head, composed with a mask at
// compile time:
//
//   auto m = blockattn::with_score(blockattn::CausalMask{}, blockattn::SoftCap{50.0});
//   blockattn::attention_forward(exec, q, k, v, o, lse, m);
//   DistributedAttention<StripedPartition, decltype(m), RingSchedule, Mpi> attn(comm, m);
//
// A score policy is a small, trivially copyable struct with two members, each
// a template on the compute type T (float, or double for fp64 inputs):
//
//   template <class T> KOKKOS_FUNCTION T score(T s, index_type q, index_type k, int head) const;
//   template <class T> KOKKOS_FUNCTION T score_grad(T s, index_type q, index_type k,
//                                                   int head) const;   // d score / d s at s
//
// score() is applied to every allowed pair (the mask decides which pairs
// exist; a masked pair stays out of the softmax whatever score() says), in
// the forward and in the backward's recomputation of P; score_grad() is the
// chain rule's factor of the backward (dS = P o (dP - D) o score_grad). Both
// are called once per allowed pair and tile, so keep them cheap and free of
// side effects. Optional host members:
//   std::string check(int heads) const   "" when the policy fits query heads
//                                        0 .. heads - 1, else what is wrong (the
//                                        entry points throw it, naming 'mask');
//   parameters()                         numbers the distributed calls compare
//                                        between ranks (as masks' parameters()).
//
// A plain mask (no score policy) compiles to exactly the kernels without one.
// Attention sinks are not a score policy (they add a logit without a key):
// see ForwardOptions::sinks (kernel/options.hpp).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/policy/mask.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace blockattn {

namespace impl {
/// tanh in fp32 as a rational function (Eigen's fast tanh: odd degree-13
/// numerator over even degree-6 denominator on |x| < 7.905, exactly +-1 beyond):
/// |error| <= 3.3e-7 (measured on a 1e-4 grid of [-20, 20]: at most 5.5 ulp
/// of the result), NaN stays NaN, +-inf gives +-1. Branch-free, so loops of
/// it vectorise; glibc's tanhf is a call per element (a softcap forward ran
/// at 0.26x the no-policy rate with it). fp64 keeps the library tanh.
KOKKOS_FORCEINLINE_FUNCTION std::uint32_t tanh_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
KOKKOS_FORCEINLINE_FUNCTION float tanh_float(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
KOKKOS_INLINE_FUNCTION float tanh_rational(float x) {
  // |x| clamped to c and the sign put back as integer selects: GCC does not
  // if-convert float comparisons under its default -ftrapping-math, and the
  // loop then stays scalar on AVX2 (0.6x the no-policy rate).
  constexpr std::uint32_t c = 0x40fcf84fu;  // 7.90531110763549805f
  const std::uint32_t bx = tanh_bits(x), ua = bx & 0x7fffffffu;
  const std::uint32_t small = 0u - static_cast<std::uint32_t>(ua < c);
  const float a = tanh_float((ua & small) | (c & ~small));  // min(|x|, c); NaN: c
  const float a2 = a * a;
  float p = a2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = a2 * p + -8.60467152213735e-11f;
  p = a2 * p + 5.12229709037114e-08f;
  p = a2 * p + 1.48572235717979e-05f;
  p = a2 * p + 6.37261928875436e-04f;
  p = a2 * p + 4.89352455891786e-03f;
  float q = a2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = a2 * q + 2.26843463243900e-03f;
  q = a2 * q + 4.89352518554385e-03f;
  // |x| >= c: exactly 1 (error <= 2.7e-7 there), so that the softcap's
  // derivative 1 - t^2 is exactly 0 for saturated logits.
  const std::uint32_t mag = (tanh_bits(a * p / q) & small) | (0x3f800000u & ~small);
  const std::uint32_t t = mag | (bx & 0x80000000u);
  const std::uint32_t nan = 0u - static_cast<std::uint32_t>(ua > 0x7f800000u);
  return tanh_float((t & ~nan) | (bx & nan));  // NaN stays NaN
}
KOKKOS_INLINE_FUNCTION double tanh_rational(double x) {
  return kmath::tanh(x);
}
}  // namespace impl

/// Logit soft-capping (Gemma 2): s' = cap * tanh(s / cap), cap > 0. Logits of
/// any size (also +-inf) become finite, in [-cap, cap]; NaN stays NaN. fp32
/// computes tanh as impl::tanh_rational (|error| <= 3.3e-7).
struct SoftCap {
  double cap = 50.0;

  template <class T>
  KOKKOS_INLINE_FUNCTION T score(T s, index_type, index_type, int) const {
    const T c = T(cap);
    return c * impl::tanh_rational(s * (T(1) / c));
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION T score_grad(T s, index_type, index_type, int) const {
    const T t = impl::tanh_rational(s * (T(1) / T(cap)));
    return T(1) - t * t;
  }
  /// score() and score_grad() at once (the backward needs both).
  template <class T>
  KOKKOS_INLINE_FUNCTION T score_with_grad(T s, index_type, index_type, int, T& grad) const {
    const T c = T(cap), t = impl::tanh_rational(s * (T(1) / c));
    grad = T(1) - t * t;
    return c * t;
  }
  std::string check(int) const {
    return cap > 0.0 && std::isfinite(cap)
               ? std::string()
               : "SoftCap::cap = " + std::to_string(cap) + ", expected a finite value > 0";
  }
  std::array<double, 1> parameters() const { return {{cap}}; }
};

/// ALiBi (Press et al.; BLOOM, MPT): s' = s + slope[head] * (k - q), a
/// penalty growing with the distance to earlier keys (use it with a causal
/// mask); `symmetric`: s' = s - slope[head] * |k - q| (bidirectional models).
/// Positions are global, so the bias is the same however the sequence is
/// partitioned. Slopes: the paper's geometric ones (geometric(heads)) or
/// your own (with_slopes); one per query head, at most max_heads.
struct Alibi {
  static constexpr int max_heads = 256;
  int heads = 0;
  bool symmetric = false;
  float slopes[max_heads] = {};

  /// The paper's slopes for `heads` heads: 2^(-8 i / n) for i = 1 .. n when
  /// n is a power of two; otherwise those of the largest power of two
  /// c < heads, then every other slope of 2c (BLOOM's build_alibi_tensor).
  static Alibi geometric(int heads, bool symmetric = false) {
    Alibi a;
    a.heads = heads;
    a.symmetric = symmetric;
    if (heads <= 0 || heads > max_heads) return a;  // check() names the error
    int c = 1;
    while (2 * c <= heads) c *= 2;
    for (int i = 0; i < c; ++i) a.slopes[i] = float(std::exp2(-8.0 * (i + 1) / c));
    for (int i = 0; i < heads - c; ++i)
      a.slopes[c + i] = float(std::exp2(-8.0 * (2 * i + 1) / (2 * c)));
    return a;
  }
  /// Slopes of your own, one per query head (e.g. trained ones).
  static Alibi with_slopes(const std::vector<float>& slopes, bool symmetric = false) {
    Alibi a;
    a.heads = int(slopes.size());
    a.symmetric = symmetric;
    for (int i = 0; i < a.heads && i < max_heads; ++i) a.slopes[i] = slopes[std::size_t(i)];
    return a;
  }

  template <class T>
  KOKKOS_INLINE_FUNCTION T score(T s, index_type q, index_type k, int head) const {
    const index_type d = k - q;  // positions are bounded by 2^62: no overflow
    return s + T(slopes[head]) * T(symmetric ? (d < 0 ? d : -d) : d);  // integer selects
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION T score_grad(T, index_type, index_type, int) const {
    return T(1);
  }
  std::string check(int call_heads) const {
    std::ostringstream s;
    if (heads < 1 || heads > max_heads)
      s << "Alibi::heads = " << heads << ", expected 1 .. " << max_heads;
    else if (call_heads > heads)
      s << "Alibi::heads = " << heads << ", expected a slope for each of the call's " << call_heads
        << " query heads";
    for (int i = 0; s.str().empty() && i < heads; ++i)
      if (!std::isfinite(slopes[i])) s << "Alibi::slopes[" << i << "] is not finite";
    return s.str();
  }
  std::vector<double> parameters() const {
    std::vector<double> p{double(heads), symmetric ? 1.0 : 0.0};
    for (int i = 0; i < heads && i < max_heads; ++i) p.push_back(double(slopes[i]));
    return p;
  }
};

namespace impl {
template <class S, class = void>
struct has_score_with_grad : std::false_type {};
template <class S>
struct has_score_with_grad<
    S, std::void_t<decltype(std::declval<const S&>().score_with_grad(
           float{}, index_type{}, index_type{}, int{}, std::declval<float&>()))>> : std::true_type {
};

/// score(s) with score_grad(s) in `grad`: the policy's score_with_grad()
/// where it has one (one tanh for SoftCap), else its two members.
template <class P, class T>
KOKKOS_FORCEINLINE_FUNCTION T score_and_grad(const P& p, T s, index_type q, index_type k, int head,
                                             T& grad) {
  if constexpr (has_score_with_grad<P>::value) {
    return p.score_with_grad(s, q, k, head, grad);
  } else {
    grad = p.score_grad(s, q, k, head);
    return p.score(s, q, k, head);
  }
}

template <class M, bool = has_allowed_keys<M>::value>
struct ScoredMaskBase {
  M mask;
};
template <class M>
struct ScoredMaskBase<M, true> {
  M mask;
  KOKKOS_INLINE_FUNCTION constexpr KeyInterval allowed_keys(index_type q) const {
    return mask.allowed_keys(q);
  }
};

template <class X, class = void>
struct has_parameters : std::false_type {};
template <class X>
struct has_parameters<X, std::void_t<decltype(std::begin(std::declval<const X&>().parameters())),
                                     decltype(std::end(std::declval<const X&>().parameters()))>>
    : std::true_type {};

template <class X>
void append_parameters(std::vector<std::string>& out, const X& x) {
  if constexpr (has_parameters<X>::value)
    for (const auto& v : x.parameters()) {
      std::ostringstream s;
      s.precision(17);
      s << v;
      out.push_back(s.str());
    }
}
}  // namespace impl

/// A mask with a score policy: the mask's pairs, the policy's logits. Models
/// the mask concept (classify, allowed, allowed_keys where Mask has it), so
/// every entry point, partition and schedule takes it where it takes Mask.
/// No band(): pairs under a score policy always run on BlockAttn's kernels,
/// never on a vendor's fused attention. `head_offset` is added to the head
/// the kernels pass (the head-parallel schedules set it; leave it 0).
template <class Mask, class Score>
struct ScoredMask : impl::ScoredMaskBase<Mask> {
  Score score_policy;
  int head_offset = 0;

  using mask_type = Mask;
  using score_type = Score;

  KOKKOS_INLINE_FUNCTION constexpr TileKind classify(index_type qb, index_type qe, index_type kb,
                                                     index_type ke) const {
    return this->mask.classify(qb, qe, kb, ke);
  }
  KOKKOS_INLINE_FUNCTION constexpr bool allowed(index_type q, index_type k) const {
    return this->mask.allowed(q, k);
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION T score(T s, index_type q, index_type k, int head) const {
    return score_policy.score(s, q, k, head + head_offset);
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION T score_grad(T s, index_type q, index_type k, int head) const {
    return score_policy.score_grad(s, q, k, head + head_offset);
  }
  template <class T>
  KOKKOS_INLINE_FUNCTION T score_with_grad(T s, index_type q, index_type k, int head,
                                           T& grad) const {
    return impl::score_and_grad(score_policy, s, q, k, head + head_offset, grad);
  }
  /// The mask's parameters, then the policy's (compared between ranks).
  std::vector<std::string> parameters() const {
    std::vector<std::string> p;
    impl::append_parameters(p, this->mask);
    p.push_back("|");
    impl::append_parameters(p, score_policy);
    p.push_back("heads+" + std::to_string(head_offset));
    return p;
  }
};

/// `mask` with the score policy `score` (see the top of this file).
template <class Mask, class Score>
ScoredMask<Mask, Score> with_score(const Mask& mask, const Score& score) {
  ScoredMask<Mask, Score> m;
  m.mask = mask;
  m.score_policy = score;
  return m;
}

namespace impl {
/// True for masks that carry a score policy (the kernels then apply it).
template <class M, class = void>
struct has_score_mod : std::false_type {};
template <class M>
struct has_score_mod<M, std::void_t<decltype(std::declval<const M&>().score(float{}, index_type{},
                                                                            index_type{}, int{})),
                                    decltype(std::declval<const M&>().score_grad(
                                        float{}, index_type{}, index_type{}, int{}))>>
    : std::true_type {};
template <class M>
inline constexpr bool has_score_mod_v = has_score_mod<M>::value;

template <class S, class = void>
struct has_score_check : std::false_type {};
template <class S>
struct has_score_check<S, std::void_t<decltype(std::declval<const S&>().check(int{}))>>
    : std::is_convertible<decltype(std::declval<const S&>().check(int{})), std::string> {};

template <class M>
struct is_scored_mask : std::false_type {};
template <class M, class S>
struct is_scored_mask<ScoredMask<M, S>> : std::true_type {};

/// The mask without its score policy (what decides which pairs exist).
template <class M>
const M& unscored(const M& mask) {
  return mask;
}
template <class M, class S>
const M& unscored(const ScoredMask<M, S>& mask) {
  return mask.mask;
}

/// The mask with its score policy's heads shifted by `offset` (a rank of a
/// head-parallel schedule computes heads offset .. offset + its count - 1 as
/// its heads 0 ..); other masks unchanged.
template <class M>
M shift_heads(const M& mask, int offset) {
  M m = mask;
  if constexpr (is_scored_mask<M>::value) m.head_offset += offset;
  (void)offset;
  return m;
}

/// The score policy's own check for a call with `heads` query heads
/// ("" when it fits, or when the mask has no policy or no check()).
template <class M>
std::string score_check(const M& mask, int heads) {
  if constexpr (is_scored_mask<M>::value) {
    if constexpr (has_score_check<typename M::score_type>::value)
      return mask.score_policy.check(heads + mask.head_offset);
  }
  (void)mask;
  (void)heads;
  return std::string();
}
}  // namespace impl

}  // namespace blockattn
