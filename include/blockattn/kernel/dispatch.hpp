// SPDX-License-Identifier: Apache-2.0
// The one place that decides which implementation computes attention over a
// block pair, for every entry point: attention_forward / attention_backward
// and the local attention of UlyssesAttention, HybridAttention and chunked
// prefill (a whole call: forward_call, backward_call), and every step of the
// distributed schedules (ForwardPairs, BackwardPairs). In this order:
//
//   1. yours: a BlockProductImplementation registered for (execution space,
//      storage type, mask) (kernel/block_implementation.hpp)  BlockPath::user
//   2. cuDNN's fused attention (CUDA, bf16 / fp16, BLOCKATTN_ENABLE_CUDNN; its
//      host emulation in tests), for pairs whose mask is band pieces in its
//      form (kernel/band.hpp; kernel/cudnn/)                    BlockPath::fused
//   3. BlockAttn's tensor-core kernels (CUDA: the 16-bit forward, opt-in the
//      16-bit backward and fp32 on TF32; kernel/cuda/)         BlockPath::matrix
//   4. BlockAttn's portable kernels (kernel/portable/, on host spaces with the
//      host/ micro kernels and the host matrix engine: AMX, AVX512-BF16;
//      kernel/block_product.hpp)              BlockPath::portable (matrix: the engine)
//
// Each of 1-3 may decline a pair (a shape, stride, mask or value it does not
// take), which then goes on down the list; portable_only skips 1-3. The
// counts of opts.paths and RunStats::paths() say which ran.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/block_implementation.hpp>
#include <blockattn/kernel/block_product.hpp>
#include <blockattn/kernel/cuda/flash_pair.hpp>
#include <blockattn/kernel/cuda/flash_path.hpp>
#include <blockattn/kernel/cudnn/fused_pair.hpp>
#include <blockattn/kernel/cudnn/fused_path.hpp>
#include <blockattn/kernel/impl/pair_ops.hpp>
#include <blockattn/kernel/impl/user_pair.hpp>
#include <blockattn/kernel/instantiate.hpp>
#include <blockattn/kernel/invariant/invariant_backward.hpp>
#include <blockattn/kernel/invariant/invariant_forward.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/portable_call.hpp>
#include <blockattn/kernel/sinks.hpp>
#include <blockattn/policy/positions.hpp>

#include <string>
#include <type_traits>

namespace blockattn {

/// Whether a fused provider (cuDNN, or its emulation) is built in for
/// ExecSpace and storage type V.
template <class ExecSpace, class V>
constexpr bool fused_available_v = impl::fused_enabled<ExecSpace, V>();

/// Whether BlockAttn's tensor-core backward is compiled for ExecSpace,
/// storage V and Mask (CUDA, 16-bit, no score policy).
template <class ExecSpace, class V, class Mask>
constexpr bool tensor_core_backward_available_v = impl::flash_enabled<ExecSpace, V, Mask>();

namespace impl {

template <class BPC>
void count_path(BPC* paths, BlockPath path, int pieces = 0) {
  if (!paths) return;
  paths->user += path == BlockPath::user ? 1 : 0;
  paths->fused += path == BlockPath::fused ? 1 : 0;
  paths->fused_pieces += pieces;
  paths->portable += path == BlockPath::portable || path == BlockPath::matrix ? 1 : 0;
  paths->matrix += path == BlockPath::matrix ? 1 : 0;
}

template <class P>
constexpr bool is_offset_positions_v = std::is_same<P, OffsetPositions>::value;

/// A registered implementation on a whole call: its result in the compute
/// type (o itself, or a buffer rounded once into a 16-bit o after the sinks).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class Pos,
          class T>
bool user_forward_call(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                       const VV& v, const OV& o, const LV& lse, const Mask& mask, const Pos& qpos,
                       const Pos& kpos, T scale, const SinkLogits& sinks) {
  using OS = typename OV::non_const_value_type;
  if constexpr (std::is_same<OS, T>::value) {
    if (!user_forward(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale)) return false;
    apply_sinks(exec, sinks, o, lse);
  } else {
    Kokkos::View<T****, Kokkos::LayoutRight, typename ExecSpace::memory_space> acc(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::user_o"), e.batch, e.queries,
        e.heads, e.dim);
    if (!user_forward(exec, e, q, k, v, acc, lse, mask, qpos, kpos, scale)) return false;
    apply_sinks(exec, sinks, acc, lse);
    convert_views(exec, o, acc);
    exec.fence();  // acc is freed on return
  }
  return true;
}

/// The forward of a whole single-device call after its checks, the sinks
/// folded in: the queries at global positions qpos(i) against the keys at
/// kpos(j) (any position map). attention_forward, the head-parallel
/// schedules' local attention and chunked prefill call it.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class Pos,
          class T>
void forward_call(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                  const VV& v, const OV& o, const LV& lse, const Mask& mask, const Pos& qpos,
                  const Pos& kpos, T scale, const ForwardOptions& opts) {
  using V = typename QV::non_const_value_type;
  // 0. The invariant mode: its own passes (kernel/invariant/), nothing else.
  if (opts.invariant) {
    if constexpr (!std::is_same<T, double>::value)
      invariant_forward("attention_forward", exec, e, q, k, v, o, lse, mask, qpos, kpos, scale,
                        opts);
    else
      check_invariant<double>("attention_forward", opts.invariant_tile, e.keys);
    count_path(opts.paths, BlockPath::portable);
    apply_sinks(exec, opts.sinks, o, lse);
    return;
  }
  const bool others = !opts.portable_only;
  // 1. Yours.
  if constexpr (user_enabled<ExecSpace, V, Mask>()) {
    if (others &&
        user_forward_call(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale, opts.sinks)) {
      count_path(opts.paths, BlockPath::user);
      return;
    }
  }
  // 2. cuDNN, on a call at offsets (one band piece over the call's positions).
  if constexpr (is_offset_positions_v<Pos>) {
    ForwardOptions at = opts;
    at.q_offset = qpos.offset;
    at.k_offset = kpos.offset;
    int pieces = 0;
    if (fused_forward(exec, e, q, k, v, o, lse, mask, scale, at, pieces)) {
      count_path(opts.paths, BlockPath::fused, pieces);
      apply_sinks(exec, opts.sinks, o, lse);
      return;
    }
  }
  // 3. The tensor-core forward (CUDA, 16-bit), then fp32 on TF32 products.
  if ((others && opts.tensor_cores &&
       flash_forward(exec, e, q, k, v, o, lse, mask, qpos, kpos, float(scale))) ||
      (others && flash_forward_f32(exec, e, q, k, v, o, lse, mask, qpos, kpos, float(scale),
                                   opts.fp32_tensor_cores))) {
    count_path(opts.paths, BlockPath::matrix);
    apply_sinks(exec, opts.sinks, o, lse);
    return;
  }
  // 4. The portable kernels (the host matrix engine counted as matrix).
  count_path(opts.paths, blockattn::forward_uses_matrix<T, V, ExecSpace>(e.dim, opts.host_matrix)
                             ? BlockPath::matrix
                             : BlockPath::portable);
  portable_forward_call(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale, opts.host_matrix);
  apply_sinks(exec, opts.sinks, o, lse);
}

/// The forward block pairs of a step loop (impl/forward_steps.hpp in
/// distributed/): K/V blocks travel in the storage type V, in rows where an
/// implementation that reads them in place is built in (yours, cuDNN); the
/// kernels read them relaid / widened. own() and helper() try 1-3 of the
/// list at the top of this file and return BlockPath::portable, nothing done,
/// for the kernels (the caller launches them in chunks between transfer tests).
template <class ExecSpace, class V, class Mask>
class ForwardPairs {
 public:
  using T = compute_t<V>;
  using mem = typename ExecSpace::memory_space;
  static constexpr bool user = user_enabled<ExecSpace, V, Mask>();
  static constexpr bool fused = fused_enabled<ExecSpace, V>();
  static constexpr bool rows = user || fused;  // K/V travel in rows
  static constexpr bool tensor_cores = rows && flash_enabled<ExecSpace, V, Mask>();
  static constexpr bool relays = rows || !std::is_same<V, T>::value;

  /// The layout K/V blocks travel in.
  static BlockLayout storage_layout(const BlockLayout& layout) {
    BlockLayout l = layout;
    if constexpr (rows) {
      l.kt_panel = 1;
      l.v_panel = l.dim_padded;
    }
    return l;
  }

  /// opts: ForwardOptions or DistributedOptions. Workspace for `most` rows.
  template <class Opts>
  ForwardPairs(const ExecSpace& exec, const Opts& opts, const BlockExtents& e, int most,
               const BlockLayout& layout)
      : m_exec(exec),
        m_others(!opts.portable_only),
        m_tc(opts.tensor_cores),
        m_guard(opts.guard_masked_nonfinite) {
    const auto alloc4 = [&](auto* tag, const char* label, int heads) {
      using X = std::remove_pointer_t<decltype(tag)>;
      return Kokkos::View<X****, Kokkos::LayoutRight, mem>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), e.batch, most, heads,
          e.dim);
    };
    if constexpr (relays)
      m_wide = allocate_forward_block<T, ExecSpace>(layout, e.batch, e.kv_heads, most);
    if (m_others && (fused || tensor_cores))
      m_part_o = alloc4((V*)nullptr, "blockattn::pair_o", e.heads);
    if (m_others && user) m_part_t = alloc4((T*)nullptr, "blockattn::user_o", e.heads);
    if (m_others && rows)
      m_part_lse = Kokkos::View<T***, Kokkos::LayoutRight, mem>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::pair_lse"), e.batch, e.heads,
          most);
  }

  /// Bytes of the pieces' partial results (RunStats::fused_workspace_bytes).
  std::int64_t workspace_bytes() const {
    return std::int64_t(m_part_o.span() * sizeof(V) + m_part_t.span() * sizeof(T) +
                        m_part_lse.span() * sizeof(T));
  }
  /// Bytes of the kernels' relaid / widened block (0: they read the slot).
  std::int64_t relay_bytes() const {
    return std::int64_t((m_wide.kt.span() + m_wide.v.span()) * sizeof(T));
  }

  /// The block the kernels read for K/V slot `slot` (kv in the storage layout).
  const PackedKV<T, mem>& kernel_block(const PackedKV<V, mem>& kv, int slot) {
    if constexpr (relays) {
      if (m_widened != slot) {
        widen_forward_block(m_exec, kv, m_wide);
        m_widened = slot;
      }
      return m_wide;
    } else {
      (void)slot;
      return kv;
    }
  }
  /// A new block arrives in slot `slot`.
  void invalidate(int slot) {
    if (m_widened == slot) m_widened = -1;
  }

  /// An own pair (queries q, e.queries rows, against kv): its normalised
  /// partial merged into the softmax state (o_sum: the unnormalised O), which
  /// `open()` opens first.
  template <class QV, class OS, class Pos, class Open>
  BlockPath own(const BlockExtents& e, const QV& q, const PackedKV<V, mem>& kv, const Mask& mask,
                const Pos& qp, const Pos& kp, T scale, const SoftmaxState<T, mem>& state,
                const OS& o_sum, const Open& open, int& pieces) {
    if (!m_others || e.queries <= 0 || e.keys <= 0) return BlockPath::portable;
    const auto merge = [&](const auto& part_o) {
      open();
      state.merge_partial(m_exec, o_sum, part_o, m_part_lse, e.dim);
    };
    if constexpr (user) {
      if (user_forward(m_exec, e, q, packed_rows(kv, false, e.keys, e.dim),
                       packed_rows(kv, true, e.keys, e.dim), rows_of4(m_part_t, e.queries),
                       rows_of3(m_part_lse, e.queries), mask, qp, kp, scale)) {
        merge(m_part_t);
        return BlockPath::user;
      }
    }
    if constexpr (fused) {
      FusedPair pair = fused_pair<ExecSpace, V>(mask, qp, kp, e, false, q, kv, m_part_o, m_part_lse,
                                                float(scale));
      // inf / NaN in V where the mask hides keys: not cuDNN (it would leak).
      if (pair.fused && m_guard && !pair_covers_all(mask, qp, e.queries, kp, e.keys) &&
          packed_v_has_nonfinite(m_exec, kv))
        pair.fused = false;
      if (pair.fused) {
        pieces = pair.split.count;
        open();
        for (const BandPiece& piece : pair.split) {
          Kokkos::deep_copy(m_exec, m_part_lse, -infinity<T>());  // rows outside the piece
          fused_forward_piece(m_exec, e, piece, q, kv, m_part_o, m_part_lse, float(scale));
          state.merge_partial(m_exec, o_sum, m_part_o, m_part_lse, e.dim);
        }
        return BlockPath::fused;
      }
    }
    if constexpr (tensor_cores) {
      if (m_tc && tensor_core_forward_pair(m_exec, e, q, kv, m_part_o, m_part_lse, mask, qp, kp,
                                           float(scale))) {
        merge(m_part_o);
        return BlockPath::matrix;
      }
    }
    return BlockPath::portable;
  }

  /// A helper's pair (another rank's queries q): its normalised result into
  /// out_o, out_lse (compute type; rows [0, e.queries)).
  template <class QV, class OO, class OL, class Pos>
  BlockPath helper(const BlockExtents& e, const QV& q, const PackedKV<V, mem>& kv, const Mask& mask,
                   const Pos& qp, const Pos& kp, T scale, const OO& out_o, const OL& out_lse,
                   int& pieces) {
    if (!m_others || e.queries <= 0 || e.keys <= 0) return BlockPath::portable;
    if constexpr (user) {
      if (user_forward(m_exec, e, rows_of4(q, e.queries), packed_rows(kv, false, e.keys, e.dim),
                       packed_rows(kv, true, e.keys, e.dim), rows_of4(out_o, e.queries),
                       rows_of3(out_lse, e.queries), mask, qp, kp, scale))
        return BlockPath::user;
    }
    if constexpr (fused) {
      if (fused_forward_result<ExecSpace, V>(m_exec, mask, qp, kp, e, q, kv, m_part_o, m_part_lse,
                                             out_o, out_lse, float(scale), m_guard, pieces))
        return BlockPath::fused;
    }
    if constexpr (tensor_cores) {
      if (m_tc && tensor_core_forward_pair(m_exec, e, q, kv, m_part_o, m_part_lse, mask, qp, kp,
                                           float(scale))) {
        tensor_core_result(m_exec, e, m_part_o, m_part_lse, out_o, out_lse);
        return BlockPath::matrix;
      }
    }
    return BlockPath::portable;
  }

 private:
  template <class X>
  static auto rows_of4(const X& x, index_type n) {
    return Kokkos::subview(x, Kokkos::ALL, std::make_pair(index_type(0), n), Kokkos::ALL,
                           Kokkos::ALL);
  }
  template <class X>
  static auto rows_of3(const X& x, index_type n) {
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(index_type(0), n));
  }

  ExecSpace m_exec;
  bool m_others, m_tc, m_guard;
  PackedKV<T, mem> m_wide;                                  // the kernels' block (relays)
  int m_widened = -1;                                       // the K/V slot m_wide holds (-1: none)
  Kokkos::View<V****, Kokkos::LayoutRight, mem> m_part_o;   // cuDNN, tensor cores: a partial O
  Kokkos::View<T****, Kokkos::LayoutRight, mem> m_part_t;   // yours: a partial O
  Kokkos::View<T***, Kokkos::LayoutRight, mem> m_part_lse;  // -inf: rows outside a piece
};

/// The backward block pairs of a step loop (impl/backward_steps.hpp in
/// distributed/) and of a whole call with T gradients: own queries from the
/// caller's q, o, dout, lse; travelled ones from a packed query slot (Q, dO,
/// LSE log2 e, D). own() and travelled() try 1-3 of the list at the top of
/// this file, adding the pair's gradients into the T sums dq, dk, dv (zeroed
/// first unless acc_dq / acc_dkv), and return BlockPath::portable, nothing
/// done, for the kernels.
template <class ExecSpace, class V, class Mask>
class BackwardPairs {
 public:
  using T = compute_t<V>;
  using mem = typename ExecSpace::memory_space;
  static constexpr bool user = user_enabled<ExecSpace, V, Mask>();
  static constexpr bool fused = fused_enabled<ExecSpace, V>();
  static constexpr bool tensor_cores = flash_enabled<ExecSpace, V, Mask>();
  using Slot = PackedQueries<T, mem, V>;

  /// opts: ForwardOptions or DistributedOptions; `most`: rows of the longest
  /// block (-1: e's); `travels`: a query slot of the shape of those that
  /// arrive from other ranks (nullptr: none arrive).
  template <class Opts, class QV, class OV, class DOV, class LV>
  BackwardPairs(const ExecSpace& exec, const Opts& opts, const BlockExtents& e, const QV& q,
                const OV& o, const DOV& dout, const LV& lse, int most = -1,
                const Slot* travels = nullptr)
      : m_exec(exec), m_guard(opts.guard_masked_nonfinite) {
    if (most < 0) most = e.queries;
    const bool others = !opts.portable_only;
    m_user = user && others;
    if constexpr (fused) {
      m_rows = fused_query_rows(q, o, dout, lse);
      m_fused = others && m_rows.usable;
    }
    m_tc = tensor_cores && others && opts.tensor_cores && opts.tensor_core_backward;
    if (m_user || m_tc) {
      m_q_rows = strided_rows(q, e.queries);
      m_do_rows = strided_rows(dout, e.queries);
      m_o_rows = strided_rows(o, e.queries);
      m_lse_rows = strided_lse(lse, e.queries);
    }
    if (m_user) {  // D = rowsum(dO o O) of the own rows
      m_delta = decltype(m_delta)("blockattn::pair_delta", e.batch, e.heads, e.queries);
      row_delta(exec, dout, o, m_delta, e.dim);
    }
    const auto alloc4 = [&](const char* label, int heads) {
      return Kokkos::View<V****, Kokkos::LayoutRight, mem>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), e.batch, most, heads,
          e.dim);
    };
    if (m_fused || m_tc) {
      m_tq = alloc4("blockattn::pair_dq", e.heads);
      m_tk = alloc4("blockattn::pair_dk", e.kv_heads);
      m_tv = alloc4("blockattn::pair_dv", e.kv_heads);
    }
    m_travels = travels != nullptr && (m_fused || m_tc || m_user);
    if (m_travels) {  // the slots' packed shapes (batch, heads, rows[, dim])
      const auto& d0 = travels->dout;
      if (m_fused || m_tc)
        m_o_proxy = decltype(m_o_proxy)("blockattn::pair_o_proxy", d0.extent(0), d0.extent(1),
                                        d0.extent(2), d0.extent(3));
      m_lse_nat =
          decltype(m_lse_nat)("blockattn::pair_lse", d0.extent(0), d0.extent(1), d0.extent(2));
    }
  }

  std::int64_t workspace_bytes() const {
    return std::int64_t((m_tq.span() + m_tk.span() + m_tv.span() + m_o_proxy.span()) * sizeof(V) +
                        (m_lse_nat.span() + m_delta.span()) * sizeof(T));
  }
  /// A new query slot arrives in slot `slot`.
  void invalidate(int slot) {
    if (m_travelled == slot) m_travelled = -1;
  }

  /// An own pair against the K/V rows [0, e.keys) of k, v (storage V).
  template <class KV, class VV, class Pos, class GQ, class GK>
  BlockPath own(const BlockExtents& e, const KV& kx, const VV& vx, const Pos& qp, const Pos& kp,
                const Mask& mask, T scale, const GQ& dq, const GK& dk, const GK& dv, bool acc_dq,
                bool acc_dkv, int& pieces) {
    if (e.queries <= 0 || e.keys <= 0) return BlockPath::portable;
    return pair(e, Rows{m_q_rows, m_do_rows, m_o_rows, m_lse_rows, strided_lse(m_delta, e.queries)},
                m_rows, strided_rows(kx, e.keys), strided_rows(vx, e.keys), qp, kp, mask, scale, dq,
                dk, dv, acc_dq, acc_dkv, pieces);
  }

  /// A travelled pair: the queries of slot `s` (id `slot`) against k, v.
  template <class KV, class VV, class Pos, class GQ, class GK>
  BlockPath travelled(const BlockExtents& e, const Slot& s, int slot, const KV& kx, const VV& vx,
                      const Pos& qp, const Pos& kp, const Mask& mask, T scale, const GQ& dq,
                      const GK& dk, const GK& dv, bool acc_dq, bool acc_dkv, int& pieces) {
    if (e.queries <= 0 || e.keys <= 0 || !m_travels) return BlockPath::portable;
    const int dim = e.dim;
    if (m_travelled != slot) {  // the slot's operands, once per arrival
      if (m_fused || m_tc)
        m_trows = fused_travelled_rows(m_exec, s, dim, m_o_proxy, m_lse_nat);
      else
        natural_lse(m_exec, s.lse2, m_lse_nat, s.queries);
      m_travelled = slot;
    }
    const StridedRows<V, mem> o_proxy =
        m_o_proxy.size() ? strided_rows(m_o_proxy, e.queries, true, dim) : StridedRows<V, mem>();
    return pair(
        e,
        Rows{strided_rows(s.q, e.queries, true, dim), strided_rows(s.dout, e.queries, true, dim),
             o_proxy, strided_lse(m_lse_nat, e.queries), strided_lse(s.drow, e.queries)},
        m_trows, strided_rows(kx, e.keys), strided_rows(vx, e.keys), qp, kp, mask, scale, dq, dk,
        dv, acc_dq, acc_dkv, pieces);
  }

 private:
  /// A pair's query operands: Q, dO, O (own rows) or the proxy O (a
  /// travelled slot), the natural-log LSE and D.
  struct Rows {
    StridedRows<V, mem> q, dout, o;
    PairIn3<T, mem> lse, delta;
  };

  /// 1-3 of the list on one pair (see own() and travelled()).
  template <class KV, class VV, class Pos, class GQ, class GK>
  BlockPath pair(const BlockExtents& e, const Rows& r, const FusedQueryRows& fused_rows,
                 const KV& k, const VV& v, const Pos& qp, const Pos& kp, const Mask& mask, T scale,
                 const GQ& dq, const GK& dk, const GK& dv, bool acc_dq, bool acc_dkv, int& pieces) {
    if constexpr (user) {
      if (m_user) {
        clear_pair_sums(m_exec, dq, dk, dv, acc_dq, acc_dkv);
        if (user_backward(m_exec, e, r.q, r.dout, k, v, r.lse, r.delta, dq, dk, dv, mask, qp, kp,
                          scale))
          return BlockPath::user;
      }
    }
    if constexpr (fused) {
      if (m_fused && fused_backward_pair<ExecSpace, V>(m_exec, mask, qp, kp, e, fused_rows, k, v,
                                                       m_tq, m_tk, m_tv, dq, dk, dv, acc_dq,
                                                       acc_dkv, float(scale), m_guard, pieces))
        return BlockPath::fused;
    } else {
      (void)fused_rows;
    }
    if constexpr (tensor_cores) {
      if (m_tc &&
          tensor_core_backward_pair(m_exec, mask, qp, kp, e, r.q, r.o, r.dout, r.lse, k, v, m_tq,
                                    m_tk, m_tv, dq, dk, dv, acc_dq, acc_dkv, float(scale)))
        return BlockPath::matrix;
    }
    return BlockPath::portable;
  }

  ExecSpace m_exec;
  bool m_guard = true, m_user = false, m_fused = false, m_tc = false, m_travels = false;
  FusedQueryRows m_rows, m_trows;  // cuDNN's operands: own rows, the travelled slot's
  int m_travelled = -1;            // the query slot m_trows / m_lse_nat describe
  StridedRows<V, mem> m_q_rows, m_do_rows, m_o_rows;
  PairIn3<T, mem> m_lse_rows;
  Kokkos::View<T***, Kokkos::LayoutRight, mem> m_delta, m_lse_nat;
  Kokkos::View<V****, Kokkos::LayoutRight, mem> m_tq, m_tk, m_tv;
  Kokkos::View<V****, Kokkos::LayoutRight, mem> m_o_proxy;  // packed (batch, heads, rows, dim)
};

/// The backward of a whole single-device call after its checks: dq, dk, dv
/// written. Gradients of the storage type V (attention_backward) or of its
/// compute type T (the head-parallel schedules sum replicated kv heads'
/// partials in T): the latter go through the pair path (BackwardPairs).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class DOV, class DQV,
          class DKV, class DVV, class Mask, class Pos, class T>
void backward_call(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                   const VV& v, const OV& o, const LV& lse, const DOV& dout, const DQV& dq,
                   const DKV& dk, const DVV& dv, const Mask& mask, const Pos& qpos, const Pos& kpos,
                   T scale, const ForwardOptions& opts) {
  using V = typename QV::non_const_value_type;
  // 0. The invariant mode: its own passes (kernel/invariant/).
  if (opts.invariant) {
    if constexpr (!std::is_same<T, double>::value)
      invariant_backward("attention_backward", exec, e, q, k, v, o, lse, dout, dq, dk, dv, mask,
                         qpos, kpos, scale, opts);
    else
      check_invariant<double>("attention_backward", opts.invariant_tile, e.keys);
    return;
  }
  using mem = typename ExecSpace::memory_space;
  constexpr bool storage_grads = std::is_same<typename DQV::non_const_value_type, V>::value &&
                                 std::is_same<typename DKV::non_const_value_type, V>::value &&
                                 std::is_same<typename DVV::non_const_value_type, V>::value;
  const bool others = !opts.portable_only;
  if (others && (user_enabled<ExecSpace, V, Mask>() ||
                 (!storage_grads &&
                  (fused_enabled<ExecSpace, V>() || flash_enabled<ExecSpace, V, Mask>())))) {
    // Yours (gradients summed in T), or, for T gradients, cuDNN's and the
    // tensor-core pieces added into T sums: one pair through BackwardPairs.
    BackwardPairs<ExecSpace, V, Mask> pairs(exec, opts, e, q, o, dout, lse);
    using G = Kokkos::View<T****, Kokkos::LayoutRight, mem>;
    const auto sum = [&](const auto& g, const char* label) {
      if constexpr (std::is_same<typename std::decay_t<decltype(g)>::non_const_value_type,
                                 T>::value &&
                    std::is_same<typename std::decay_t<decltype(g)>::array_layout,
                                 Kokkos::LayoutRight>::value)
        return G(g.data(), g.extent(0), g.extent(1), g.extent(2), g.extent(3));
      else
        return G(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), g.extent(0),
                 g.extent(1), g.extent(2), g.extent(3));
    };
    const G sq = sum(dq, "blockattn::dq_sum"), sk = sum(dk, "blockattn::dk_sum"),
            sv = sum(dv, "blockattn::dv_sum");
    int pieces = 0;
    const BlockPath path =
        pairs.own(e, k, v, qpos, kpos, mask, scale, sq, sk, sv, false, false, pieces);
    if (path != BlockPath::portable) {
      count_path(opts.paths, path, pieces);
      const auto out = [&](const auto& to, const G& from) {
        if (static_cast<const void*>(to.data()) != static_cast<const void*>(from.data()))
          convert_views(exec, to, from);
      };
      out(dq, sq);
      out(dk, sk);
      out(dv, sv);
      exec.fence();  // the sums are freed on return
      return;
    }
  }
  if constexpr (storage_grads && is_offset_positions_v<Pos>) {
    // 2. cuDNN, writing the storage-type gradients itself.
    ForwardOptions at = opts;
    at.q_offset = qpos.offset;
    at.k_offset = kpos.offset;
    int pieces = 0;
    if (fused_backward(exec, e, q, k, v, o, lse, dout, dq, dk, dv, mask, scale, at, pieces)) {
      count_path(opts.paths, BlockPath::fused, pieces);
      return;
    }
  }
  if constexpr (storage_grads) {
    // 3. The tensor-core backward (opt-in).
    if (others && opts.tensor_cores && opts.tensor_core_backward &&
        flash_backward(exec, e, q, k, v, o, lse, dout, dq, dk, dv, mask, qpos, kpos,
                       float(scale))) {
      count_path(opts.paths, BlockPath::matrix);
      return;
    }
  }
  // 4. The portable kernels.
  portable_backward_call(exec, e, q, k, v, o, lse, dout, dq, dk, dv, mask, qpos, kpos, scale,
                         opts.host_matrix, opts.paths);
}

}  // namespace impl
}  // namespace blockattn
