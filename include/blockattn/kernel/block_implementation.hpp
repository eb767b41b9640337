// SPDX-License-Identifier: Apache-2.0
// A block-product implementation of your own (a vendor library, a kernel of
// yours, a reference), registered for the (execution space, storage type,
// mask) it takes, as Kokkos Kernels' TPL specialisations register a vendor
// routine: specialise BlockProductImplementation below. The dispatcher
// (kernel/dispatch.hpp) asks it first for every block pair of every entry
// point (attention_forward, attention_backward, each step of the KV ring, Q
// ring, balanced and all-gather schedules, Ulysses, the hybrid, chunked
// prefill), before cuDNN, the tensor-core kernels and BlockAttn's portable
// kernels; it may decline a pair (return false), which then goes on down
// that list. ForwardOptions::portable_only / DistributedOptions::portable_only
// skip it. The pairs it computes are counted as BlockPath::user
// (opts.paths, RunStats::paths()).
//
//   template <>
//   struct blockattn::BlockProductImplementation<Kokkos::Serial, float, MyMask> {
//     static constexpr bool available = true;
//     template <class Call> static bool forward(const Kokkos::Serial&, const Call& c);
//     template <class Call> static bool backward(const Kokkos::Serial&, const Call& c);
//   };
//
// forward() gets a ForwardPairCall: the pair's queries q (batch, queries,
// heads, dim) and keys k, v (batch, keys, kv_heads, dim; head h reads kv
// head h / (heads / kv_heads)), storage type V, at global positions
// qpos(i), kpos(j) under `mask` with `scale`; it writes every row's
// normalised O and natural-log LSE over the pair's keys into o and lse
// (compute type: float for float, bf16, fp16; double for double). A row
// that sees no key of the pair: O = 0, LSE = -inf. The dispatcher merges
// the pairs of a row (their LSEs weigh them), folds in sinks and rounds a
// 16-bit O once.
//
// backward() gets a BackwardPairCall: q, dout (batch, queries, heads, dim),
// k, v, the forward's lse over ALL of the row's keys (so P = exp(scale q.k -
// lse) is the pair's part of the whole softmax) and delta = rowsum(dO o O)
// (batch, heads, queries; compute type); it ADDS the pair's dQ into dq
// (batch, queries, heads, dim) and dK, dV into dk, dv (batch, keys,
// kv_heads, dim), all in the compute type (the dispatcher zeroes them first
// where a pair starts a sum, and rounds 16-bit gradients once at the end).
//
// Every View is an unmanaged LayoutStride View in the execution space's
// memory; the work is enqueued on the instance passed (no fence needed).
// tests/test_seam.cpp registers a reference implementation this way and runs
// every schedule on it.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/validate.hpp>

#include <type_traits>

namespace blockattn {

template <class X, class MemorySpace>
using PairIn4 = Kokkos::View<const X****, Kokkos::LayoutStride, MemorySpace,
                             Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class X, class MemorySpace>
using PairOut4 =
    Kokkos::View<X****, Kokkos::LayoutStride, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class X, class MemorySpace>
using PairIn3 = Kokkos::View<const X***, Kokkos::LayoutStride, MemorySpace,
                             Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class X, class MemorySpace>
using PairOut3 =
    Kokkos::View<X***, Kokkos::LayoutStride, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// One forward block pair (see the top of this file). T: the compute type.
template <class V, class MemorySpace, class Mask, class QPos, class KPos>
struct ForwardPairCall {
  using value_type = V;
  using compute_type = compute_t<V>;
  BlockExtents extents;  // batch, heads, kv_heads, queries, keys, dim
  PairIn4<V, MemorySpace> q, k, v;
  PairOut4<compute_type, MemorySpace> o;    // written: normalised O of every row
  PairOut3<compute_type, MemorySpace> lse;  // written: natural-log LSE (-inf: no key)
  Mask mask;
  QPos qpos;
  KPos kpos;
  compute_type scale = compute_type(1);
};

/// One backward block pair (see the top of this file).
template <class V, class MemorySpace, class Mask, class QPos, class KPos>
struct BackwardPairCall {
  using value_type = V;
  using compute_type = compute_t<V>;
  BlockExtents extents;
  PairIn4<V, MemorySpace> q, dout, k, v;
  PairIn3<compute_type, MemorySpace> lse;          // the forward's, over all of the row's keys
  PairIn3<compute_type, MemorySpace> delta;        // rowsum(dO o O)
  PairOut4<compute_type, MemorySpace> dq, dk, dv;  // the pair's gradients are added
  Mask mask;
  QPos qpos;
  KPos kpos;
  compute_type scale = compute_type(1);
};

/// The registration point (see the top of this file): not available unless
/// specialised for (ExecSpace, V, Mask). The last parameter is free for
/// enable_if-style partial specialisations.
template <class ExecSpace, class V, class Mask, class = void>
struct BlockProductImplementation {
  static constexpr bool available = false;
};

/// Whether an implementation of your own is registered for (ExecSpace, V, Mask).
template <class ExecSpace, class V, class Mask>
inline constexpr bool block_implementation_registered_v =
    BlockProductImplementation<ExecSpace, V, Mask>::available;

}  // namespace blockattn
