// SPDX-License-Identifier: Apache-2.0
// The backward direction of the step loop (impl/step_loop.hpp): the buffers a
// backward description names, what each step computes, and the partial
// gradients that arrive.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/distributed/impl/buffers.hpp>
#include <blockattn/distributed/impl/step_loop.hpp>
#include <blockattn/distributed/impl/transfer.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/kernel/dispatch.hpp>
#include <blockattn/schedule/context.hpp>
#include <blockattn/schedule/schedule.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace blockattn::impl {

/// The backward of one call over a description (BackwardStep). Each step
/// computes its task's gradients (dQ into the own dq or a dQ partial slot; dK,
/// dV into the own dk, dv or a partial slot; a partial of a task without work
/// is zeroed); the partials that arrive are added where the description says
/// (into a partial slot: the ring's sum; into the own gradient: home). K, V,
/// Q, dO travel in the storage type; gradient partials and sums are fp32 for
/// 16-bit storage, rounded once into the caller's Views by finish().
template <class Partition, class Mask, class ExecSpace, class Xfer, class V, class KV, class VV>
class BackwardSteps : StepContext<Partition, Mask, ExecSpace, Xfer, compute_t<V>> {
  using Base = StepContext<Partition, Mask, ExecSpace, Xfer, compute_t<V>>;

 public:
  using Base::work;
  using T = compute_t<V>;
  static constexpr bool half = !std::is_same<V, T>::value;
  using mem = typename ExecSpace::memory_space;
  using request = typename Xfer::transfer_type;
  using B4 = Buffer4<T, ExecSpace>;
  static constexpr bool results_first = false;

  template <class QV, class OV, class LV, class DOV, class DQV, class DKV, class DVV>
  BackwardSteps(const ExecSpace& exec, Xfer& x, const Partition& part, const Mask& mask,
                const CallExtents& c, const BlockLayout& layout, int P, int rank,
                const BackwardSlots& slots, const QV& q, const KV& k, const VV& v, const OV& o,
                const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk, const DVV& dv,
                const DistributedOptions& opts, RunStats& stats)
      : Base(exec, x, part, mask, c, layout, P, rank, opts),
        m_k(k),
        m_v(v),
        m_kv_copy(slots.kv_copy),
        m_host_matrix(opts.host_matrix) {
    const BlockExtents& e = c.e;
    const int most = c.most;
    // K/V slots (slot 0 a copy of k, v when it travels), packed query slots
    // (slot 0: ours), one packed key block, partial gradients.
    m_kv.resize(std::size_t(slots.kv));
    for (std::size_t i = (slots.kv_copy ? 0 : 1); i < m_kv.size(); ++i)
      m_kv[i] = {buffer_like<V, ExecSpace>(k, "blockattn::k_slot", most),
                 buffer_like<V, ExecSpace>(v, "blockattn::v_slot", most)};
    if (slots.kv_copy) {
      Kokkos::deep_copy(exec, rows_of(m_kv[0][0], e.keys), k);
      Kokkos::deep_copy(exec, rows_of(m_kv[0][1], e.keys), v);
    }  // else slot 0 is the caller's k, v
    m_qs.resize(std::size_t(slots.q));
    for (auto& b : m_qs)
      b = allocate_backward_queries<T, ExecSpace, V>(layout, e.batch, e.heads, most);
    m_qs[0].queries = e.queries;  // ours: the rest of the slot is zero padding
    BackwardBlockOptions bf16_blk;
    bf16_blk.operands_bf16 = std::is_same<V, bf16>::value;
    bf16_blk.host_matrix = opts.host_matrix;
    pack_backward_queries(exec, q, dout, o, lse, m_qs[0],
                          blockattn::backward_uses_matrix<T, ExecSpace, Mask>(c.e.dim, bf16_blk),
                          opts.host_matrix);
    if constexpr (half) {  // the kernels read the query slot in use widened to T
      m_wide = allocate_backward_queries<T, ExecSpace>(layout, e.batch, e.heads, most);
      m_wide.lse2 = {};
      m_wide.drow = {};
    }
    m_keys = allocate_backward_keys<T, ExecSpace>(layout, e.batch, e.kv_heads, most);
    const auto slot_buffers = [&](int n, const auto& like, const char* label) {
      std::vector<B4> b(static_cast<std::size_t>(n));
      for (auto& y : b) y = buffer_like<T, ExecSpace>(like, label, most);
      return b;
    };
    m_dq_out = slot_buffers(slots.dq_out, dq, "blockattn::dq_partial");
    m_dq_in = slot_buffers(slots.dq_in, dq, "blockattn::dq_in");
    m_dkv_out.resize(std::size_t(slots.dkv_out));
    m_dkv_in.resize(std::size_t(slots.dkv_in));
    for (auto* list : {&m_dkv_out, &m_dkv_in})
      for (auto& y : *list)
        y = {buffer_like<T, ExecSpace>(dk, "blockattn::dk_partial", most),
             buffer_like<T, ExecSpace>(dv, "blockattn::dv_partial", most)};
    m_own = {own_gradient<T, ExecSpace>(dq, "blockattn::dq"),
             own_gradient<T, ExecSpace>(dk, "blockattn::dk"),
             own_gradient<T, ExecSpace>(dv, "blockattn::dv")};
    // Bytes of the (contiguous) blocks that travel: the caller's Views may be
    // strided. K, V in the storage type; their gradient partials in T.
    const std::int64_t kv_elems = 2 * std::int64_t(e.batch) * most * e.kv_heads * e.dim;
    m_kv_bytes = kv_elems * std::int64_t(sizeof(V));
    m_dkv_bytes = kv_elems * std::int64_t(sizeof(T));
    const auto& q0 = m_qs[0];
    m_q_bytes = bytes_of(q0.q) + bytes_of(q0.dout) + bytes_of(q0.lse2) + bytes_of(q0.drow);
    m_dq_bytes = std::int64_t(e.batch) * most * e.heads * e.dim * std::int64_t(sizeof(T));
    const std::int64_t own_dq_bytes =
        std::int64_t(e.batch) * e.queries * e.heads * e.dim * std::int64_t(sizeof(T));
    const std::int64_t own_dkv_bytes =
        2 * std::int64_t(e.batch) * e.keys * e.kv_heads * e.dim * std::int64_t(sizeof(T));
    stats.block_q = layout.block_q;
    stats.block_k = layout.block_k;
    BackwardBufferBytes bb;
    bb.kv = m_kv_bytes;
    bb.q = m_q_bytes;
    bb.widened_q = half ? bytes_of(m_wide.q) + bytes_of(m_wide.dout) : 0;
    bb.keys = bytes_of(m_keys.kt) + bytes_of(m_keys.vt) + bytes_of(m_keys.k);
    bb.dq = m_dq_bytes;
    bb.dkv = m_dkv_bytes;
    bb.own = (same_memory(m_own[0], dq) ? 0 : own_dq_bytes) +
             (same_memory(m_own[1], dk) ? 0 : own_dkv_bytes / 2) +
             (same_memory(m_own[2], dv) ? 0 : own_dkv_bytes / 2);
    stats.workspace_bytes = backward_workspace_bytes(slots, bb);
    // The dispatcher's implementations other than the kernels (yours, cuDNN,
    // the tensor-core backward): own queries from the caller's q, o, dout,
    // lse; travelled ones from their slot.
    m_pairs.emplace(exec, opts, e, q, o, dout, lse, most, slots.q > 1 ? &m_qs[0] : nullptr);
    stats.fused_workspace_bytes = m_pairs->workspace_bytes();
  }

  void set_plan(int steps) { m_arrive.assign(std::size_t(steps) + 1, {}); }

  void post(const ScheduledTransfer& t, std::vector<request>& list, StepStats& st) {
    Posting<Xfer> go(this->m_x, t, this->m_rank, list);
    const bool send = go.send;
    const int slot = go.slot;
    const std::size_t i = std::size_t(slot);
    std::int64_t b = 0;
    switch (t.payload) {
      case Payload::kv:
        go(m_kv[i][0], Message::k);
        go(m_kv[i][1], Message::v);
        b = m_kv_bytes;
        break;
      case Payload::q:
        go(m_qs[i].q, Message::q);
        go(m_qs[i].dout, Message::dout);
        go(m_qs[i].lse2, Message::q_lse);
        go(m_qs[i].drow, Message::q_drow);
        b = m_q_bytes;
        break;
      case Payload::dq:
        go(send ? m_dq_out[i] : m_dq_in[i], Message::dq);
        b = m_dq_bytes;
        break;
      case Payload::dkv: {
        const auto& y = send ? m_dkv_out[i] : m_dkv_in[i];
        go(y[0], Message::dk);
        go(y[1], Message::dv);
        b = m_dkv_bytes;
        break;
      }
      case Payload::result:
        break;
    }
    if (!send) m_arrive[std::size_t(t.done_step)].push_back({t.payload, slot, t.add_to});
    (send ? st.bytes_sent : st.bytes_received) += b;
  }

  bool compute(int s, const BackwardStep& f, std::vector<std::vector<request>>& due,
               StepStats& st) {
    const BlockTask task = f.task;
    const bool computed = this->has_work(task);
    const B4 dqt = f.dq_slot >= 0 ? m_dq_out[std::size_t(f.dq_slot)] : m_own[0];
    const B4 dkt = f.dkv_slot >= 0 ? m_dkv_out[std::size_t(f.dkv_slot)][0] : m_own[1];
    const B4 dvt = f.dkv_slot >= 0 ? m_dkv_out[std::size_t(f.dkv_slot)][1] : m_own[2];
    const bool acc_dq = f.dq_slot < 0 && m_dq_written;
    const bool acc_dkv = f.dkv_slot < 0 && m_dkv_written;
    if (computed)
      st.path = pair(task, f.q_slot, f.kv_slot, dqt, dkt, dvt, acc_dq, acc_dkv, st.fused_pieces);
    if (computed && st.path == BlockPath::portable) {
      st.path = BlockPath::portable;
      if (m_packed != f.kv_slot) {
        m_keys.keys = int(this->m_c.lengths[std::size_t(task.k_rank)]);
        if (f.kv_slot == 0 && !m_kv_copy)
          pack_backward_keys(this->m_exec, m_k, m_v, m_keys);
        else
          pack_backward_keys(this->m_exec, m_kv[std::size_t(f.kv_slot)][0],
                             m_kv[std::size_t(f.kv_slot)][1], m_keys);
        m_packed = f.kv_slot;
      }
      BackwardBlockOptions blk;
      blk.accumulate_dq = acc_dq;
      blk.accumulate_dkv = acc_dkv;
      blk.operands_bf16 = std::is_same<V, bf16>::value;
      blk.host_matrix = m_host_matrix;
      const PackedQueries<T, mem>* rows = nullptr;
      if constexpr (half) {
        if (m_widened != f.q_slot)
          widen_backward_queries(this->m_exec, m_qs[std::size_t(f.q_slot)], m_wide);
        m_widened = f.q_slot;
        rows = &m_wide;
      } else {
        rows = &m_qs[std::size_t(f.q_slot)];
      }
      const auto pos = [&](int r) { return this->positions(r); };
      backward_block(this->m_exec, this->m_c.task(task.q_rank, task.k_rank), *rows, m_keys, dqt,
                     dkt, dvt, this->m_mask, pos(task.q_rank), pos(task.k_rank), this->m_scale,
                     blk);
    }
    if (computed) {
      m_dq_written = m_dq_written || f.dq_slot < 0;
      m_dkv_written = m_dkv_written || f.dkv_slot < 0;
    } else if (!task.idle()) {
      if (f.dq_slot >= 0) Kokkos::deep_copy(this->m_exec, dqt, T(0));
      if (f.dkv_slot >= 0) {
        Kokkos::deep_copy(this->m_exec, dkt, T(0));
        Kokkos::deep_copy(this->m_exec, dvt, T(0));
      }
    }
    for (auto& r : due[std::size_t(s)]) this->m_x.test(r);
    this->m_exec.fence();
    return computed;
  }

  /// Adds the partials that arrived by the end of step s.
  void arrived(int s) {
    const BlockExtents& e = this->m_c.e;
    for (const Arrival& a : m_arrive[std::size_t(s)]) {
      if (a.what == Payload::kv && a.slot == m_packed) m_packed = -1;  // a new block in the slot
      if (a.what == Payload::q && a.slot == m_widened) m_widened = -1;
      if (a.what == Payload::q) m_pairs->invalidate(a.slot);
      if (a.what == Payload::dq) {
        const auto& in = m_dq_in[std::size_t(a.slot)];
        if (a.add_to >= 0)
          add_views(this->m_exec, m_dq_out[std::size_t(a.add_to)], in);
        else
          home(m_own[0], rows_of(in, e.queries), m_dq_written);
      } else if (a.what == Payload::dkv) {
        const auto& in = m_dkv_in[std::size_t(a.slot)];
        for (int j = 0; j < 2; ++j) {
          if (a.add_to >= 0) {
            add_views(this->m_exec, m_dkv_out[std::size_t(a.add_to)][std::size_t(j)],
                      in[std::size_t(j)]);
          } else {
            bool written = m_dkv_written;
            home(m_own[std::size_t(j) + 1], rows_of(in[std::size_t(j)], e.keys), written);
          }
        }
        if (a.add_to < 0) m_dkv_written = true;
      }
    }
    this->m_exec.fence();
  }

  /// After the loop: the caller's gradients from the sums (copied, or rounded
  /// once to 16 bits); gradients no task wrote are 0.
  template <class DQV, class DKV, class DVV>
  void finish(const DQV& dq, const DKV& dk, const DVV& dv) {
    if (!m_dq_written) Kokkos::deep_copy(this->m_exec, m_own[0], T(0));
    if (!m_dkv_written) {
      Kokkos::deep_copy(this->m_exec, m_own[1], T(0));
      Kokkos::deep_copy(this->m_exec, m_own[2], T(0));
    }
    const auto out = [&](const auto& target, const B4& sum) {
      if (same_memory(sum, target)) return;
      if constexpr (half)
        convert_views(this->m_exec, target, sum);
      else
        Kokkos::deep_copy(this->m_exec, target, sum);
    };
    out(dq, m_own[0]);
    out(dk, m_own[1]);
    out(dv, m_own[2]);
    this->m_exec.fence();
  }

 private:
  struct Arrival {
    Payload what;
    int slot, add_to;
  };

  /// The step's pair on the dispatcher's implementations other than the
  /// kernels: own queries, or those of query slot q_slot, against K/V slot
  /// kv_slot (slot 0 without a copy: the caller's k, v). portable: the
  /// kernels take it.
  BlockPath pair(const BlockTask& task, int q_slot, int kv_slot, const B4& dqt, const B4& dkt,
                 const B4& dvt, bool acc_dq, bool acc_dkv, int& pieces) {
    const BlockExtents te = this->m_c.task(task.q_rank, task.k_rank);
    const auto qp = this->positions(task.q_rank);
    const auto kp = this->positions(task.k_rank);
    const auto run = [&](const auto& k, const auto& v) {
      if (task.q_rank == this->m_rank)
        return m_pairs->own(te, k, v, qp, kp, this->m_mask, this->m_scale, dqt, dkt, dvt, acc_dq,
                            acc_dkv, pieces);
      return m_pairs->travelled(te, m_qs[std::size_t(q_slot)], q_slot, k, v, qp, kp, this->m_mask,
                                this->m_scale, dqt, dkt, dvt, acc_dq, acc_dkv, pieces);
    };
    if (kv_slot == 0 && !m_kv_copy) return run(m_k, m_v);
    const auto& kv = m_kv[std::size_t(kv_slot)];
    return run(kv[0], kv[1]);
  }

  /// A partial arriving home: the first one is copied, the next ones added.
  template <class In>
  void home(const B4& own, const In& in, bool& written) {
    if (written)
      add_views(this->m_exec, own, in);
    else
      Kokkos::deep_copy(this->m_exec, own, in);
    written = true;
  }

  const KV& m_k;
  const VV& m_v;
  bool m_kv_copy;
  HostMatrix m_host_matrix;  // bf16: the pairs on the host matrix engine (BackwardBlock)
  std::vector<std::array<Buffer4<V, ExecSpace>, 2>> m_kv;  // K/V slots, storage type
  std::vector<PackedQueries<T, mem, V>> m_qs;              // query slots (0: ours)
  PackedQueries<T, mem> m_wide;  // 16-bit storage: the slot in use, widened
  int m_widened = -1;            // the query slot m_wide holds (-1: none)
  PackedKeys<T, mem> m_keys;     // the packed key side of the block in use
  int m_packed = -1;             // the K/V slot m_keys holds (-1: none)
  std::vector<B4> m_dq_out, m_dq_in;
  std::vector<std::array<B4, 2>> m_dkv_out, m_dkv_in;
  std::array<B4, 3> m_own;  // the sums of dq, dk, dv (the caller's Views where they fit)
  std::vector<std::vector<Arrival>> m_arrive;  // by the step they complete
  std::int64_t m_kv_bytes = 0, m_dkv_bytes = 0, m_q_bytes = 0, m_dq_bytes = 0;
  bool m_dq_written = false, m_dkv_written = false;
  // Which implementation computes a pair (kernel/dispatch.hpp).
  std::optional<BackwardPairs<ExecSpace, V, Mask>> m_pairs;
};

}  // namespace blockattn::impl
