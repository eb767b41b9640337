// SPDX-License-Identifier: Apache-2.0
// Attention sinks (gpt-oss; "StreamingLLM"'s learned variant): one logit per
// query head in every row's softmax denominator, with no value row:
//
//   O = sum_j e^(s_j - LSE) v_j,   LSE = log(e^sink[h] + sum_j e^(s_j)).
//
// Where it enters: once per row, after every partial result of the row has
// been merged (all key blocks, ranks and steps), on the rank that returns the
// row: LSE' = logaddexp(LSE, sink), O' = O e^(LSE - LSE'). That is exactly a
// merge with one more part of LSE = sink and O = 0, so it counts once however
// the row's keys were spread, and the backward needs nothing new: the saved
// LSE' already holds the sink, so P = e^(S - LSE') and dS = P o (dP - D) are
// the gradients of the sunk softmax. The sink's own gradient is
//
//   dL/dsink[h] = - sum over the rows of head h of e^(sink[h] - LSE') D,   D = rowsum(dO o O).
//
// A row that sees no key gets O = 0 and LSE = sink[h] (the denominator holds
// only the sink); sink = -inf is no sink; a NaN sink makes its head's rows NaN.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>

#include <cstdint>
#include <limits>

namespace blockattn {

/// Per-head sink logits as the options hold them (fp32, natural log, in the
/// memory of the call's execution space; empty: no sinks).
using SinkLogits = Kokkos::View<const float*, Kokkos::AnonymousSpace>;
/// Where a backward writes dL/dsinks (fp32, one per query head; empty: not wanted).
using SinkGradient = Kokkos::View<float*, Kokkos::AnonymousSpace>;

namespace impl {

template <class MemorySpace>
using sink_view = Kokkos::View<const float*, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// The checks of the sink arguments against a call with `heads` query heads.
inline void check_sinks(const char* fn, const SinkLogits& sinks, const SinkGradient& grad,
                        int heads, bool backward) {
  if (sinks.data() != nullptr && int(sinks.extent(0)) != heads)
    fail(fn, "argument 'options.sinks' has extent(0) = ", sinks.extent(0),
         ", expected one sink logit per query head (q.extent(2) = ", heads, ")");
  if (!backward) return;
  if (grad.data() != nullptr && sinks.data() == nullptr)
    fail(fn,
         "argument 'options.sink_grad' is set but 'options.sinks' is empty; expected the "
         "sink logits the forward used");
  if (grad.data() != nullptr && int(grad.extent(0)) != heads)
    fail(fn, "argument 'options.sink_grad' has extent(0) = ", grad.extent(0),
         ", expected one entry per query head (q.extent(2) = ", heads, ")");
}

/// The sink logit of head h (-inf: none).
template <class T, class SV>
KOKKOS_INLINE_FUNCTION T sink_of(const SV& sinks, int h) {
  return sinks.data() != nullptr ? T(sinks(h)) : -infinity<T>();
}

/// A row's sink folded into its normalisation: from the row's natural-log
/// LSE (over its keys; -inf: none, NaN) and the head's sink, returns the
/// row's LSE' = logaddexp(LSE, sink) and sets f = e^(LSE - LSE'), the factor
/// its normalised O takes. A kernel that multiplies its 1/l by f before it
/// rounds O rounds a 16-bit output once. sink = -inf: LSE, f = 1; no key: the
/// sink (O stays 0); a NaN LSE or sink: NaN.
template <class T>
KOKKOS_INLINE_FUNCTION T fold_sink(T lse, T sink, T& f) {
  f = T(1);
  if (sink == -infinity<T>()) return lse;  // no sink
  if (lse == -infinity<T>()) return sink;  // no key: only the sink (O stays 0)
  const T mx = lse > sink ? lse : sink;    // NaN: mx = sink, the sums below give NaN
  const T lnew = mx + kmath::log(kmath::exp(lse - mx) + kmath::exp(sink - mx));
  f = kmath::exp(lse - lnew);
  return lse != lse ? lse : lnew;
}

/// O and LSE of every row folded with its head's sink (see the top of this
/// file): o (batch, rows, heads, dim), lse (batch, heads, rows), in place.
/// A second rounding of a 16-bit o; the serving paths fold the sink into
/// their normalisation instead (fold_sink).
template <class ExecSpace, class OV, class LV>
void apply_sinks(const ExecSpace& exec, const SinkLogits& sinks, const OV& o, const LV& lse) {
  using mem = typename ExecSpace::memory_space;
  using T = typename LV::non_const_value_type;
  using S = typename OV::non_const_value_type;
  if (sinks.data() == nullptr || o.extent(0) * o.extent(1) * o.extent(2) == 0) return;
  const sink_view<mem> sk(sinks.data(), sinks.extent(0));
  const int B = int(o.extent(0)), N = int(o.extent(1)), H = int(o.extent(2)), D = int(o.extent(3));
  Kokkos::parallel_for(
      "blockattn::apply_sinks",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0,
                                                                      std::int64_t(B) * N * H),
      KOKKOS_LAMBDA(const std::int64_t idx) {
        const int h = int(idx % H), i = int((idx / H) % N), b = int(idx / (std::int64_t(H) * N));
        T f;
        lse(b, h, i) = fold_sink(T(lse(b, h, i)), T(sk(h)), f);
        if (f != T(1))
          for (int d = 0; d < D; ++d) o(b, i, h, d) = S(T(o(b, i, h, d)) * f);
      });
}

/// This call's rows' part of dL/dsinks, in double: out(h) = -sum over the
/// rows of head h of e^(sink[h] - lse) rowsum(dO o O). One team per head.
template <class ExecSpace, class OV, class DOV, class LV>
Kokkos::View<double*, typename ExecSpace::memory_space> sink_gradient_part(
    const ExecSpace& exec, const SinkLogits& sinks, const OV& o, const DOV& dout, const LV& lse) {
  using mem = typename ExecSpace::memory_space;
  using T = typename LV::non_const_value_type;
  const int B = int(o.extent(0)), N = int(o.extent(1)), H = int(o.extent(2)), D = int(o.extent(3));
  Kokkos::View<double*, mem> out(Kokkos::view_alloc(exec, "blockattn::sink_grad"), H);
  if (std::int64_t(B) * N == 0 || H == 0) return out;
  const sink_view<mem> sk(sinks.data(), sinks.extent(0));
  using policy = Kokkos::TeamPolicy<ExecSpace>;
  Kokkos::parallel_for(
      "blockattn::sink_gradient", policy(exec, H, Kokkos::AUTO),
      KOKKOS_LAMBDA(const typename policy::member_type& team) {
        const int h = team.league_rank();
        double sum = 0.0;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, B * N),
            [&](const int r, double& acc) {
              const int b = r / N, i = r % N;
              const T l = lse(b, h, i);
              if (l == -infinity<T>()) return;  // no key and no sink: no gradient
              T dot = T(0);
              for (int d = 0; d < D; ++d) dot += T(dout(b, i, h, d)) * T(o(b, i, h, d));
              acc -= double(kmath::exp(T(sk(h)) - l) * dot);
            },
            sum);
        Kokkos::single(Kokkos::PerTeam(team), [&] { out(h) = sum; });
      });
  return out;
}

/// Writes `part` (double, per head) into the fp32 `grad` (the caller's memory).
template <class ExecSpace, class PV>
void store_sink_gradient(const ExecSpace& exec, const PV& part, const SinkGradient& grad) {
  using mem = typename ExecSpace::memory_space;
  const Kokkos::View<float*, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> g(grad.data(),
                                                                             grad.extent(0));
  Kokkos::parallel_for(
      "blockattn::store_sink_gradient",
      Kokkos::RangePolicy<ExecSpace>(exec, 0, int(grad.extent(0))),
      KOKKOS_LAMBDA(const int h) { g(h) = float(part(h)); });
}

}  // namespace impl
}  // namespace blockattn
