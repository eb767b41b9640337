// SPDX-License-Identifier: Apache-2.0
// The forward direction of the step loop (impl/step_loop.hpp): the buffers a
// forward description names, what each step computes, and the merge of the
// results that arrive.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/distributed/impl/buffers.hpp>
#include <blockattn/distributed/impl/step_loop.hpp>
#include <blockattn/distributed/impl/transfer.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/kernel/block_product.hpp>
#include <blockattn/kernel/fused_block.hpp>
#include <blockattn/schedule/context.hpp>
#include <blockattn/schedule/schedule.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace blockattn::impl {

/// The forward of one call over a description (ForwardStep). Own queries
/// resume the softmax state from step to step; another rank's queries (a
/// helper's task) start a fresh state whose normalised result goes to that
/// rank; results that arrive are merged (SoftmaxState::merge_partial). With
/// 16-bit storage, K, V and Q travel in 16 bits and the kernels read `wide`,
/// the slot in use widened to fp32; the unnormalised O lives in an fp32
/// accumulator. communicate = false: every remote buffer is the local one
/// (the same steps and work, no transfers, a wrong result).
template <class Partition, class Mask, class ExecSpace, class Xfer, class QV, class OV, class LV>
class ForwardSteps
    : StepContext<Partition, Mask, ExecSpace, Xfer, compute_t<typename OV::non_const_value_type>> {
  using Base =
      StepContext<Partition, Mask, ExecSpace, Xfer, compute_t<typename OV::non_const_value_type>>;
  using Base::m_c;
  using Base::m_exec;
  using Base::m_layout;
  using Base::m_mask;
  using Base::m_rank;
  using Base::m_scale;
  using Base::m_x;

 public:
  using Base::work;
  // V: the storage type (what travels: K, V, Q); T: the compute type (the
  // kernels, the softmax state, the unnormalised O, partial results).
  using V = typename OV::non_const_value_type;
  using T = compute_t<V>;
  static constexpr bool half = !std::is_same<V, T>::value;
  using mem = typename ExecSpace::memory_space;
  using request = typename Xfer::transfer_type;
  static constexpr bool results_first = true;
  static constexpr int progress_chunks = 8;  // launches per step with a transfer in flight

  template <class KV, class VV>
  ForwardSteps(const ExecSpace& exec, Xfer& x, const Partition& part, const Mask& mask,
               const CallExtents& c, const BlockLayout& layout, int P, int rank,
               const ForwardSlots& slots, const QV& q, const KV& k, const VV& v, const OV& o,
               const LV& lse, const DistributedOptions& opts, RunStats& stats)
      : Base(exec, x, part, mask, c, layout, P, rank, opts),
        m_q(q),
        m_o(o),
        m_lse(lse),
        m_comm(opts.communicate) {
    const BlockExtents& e = c.e;
    const int most = c.most;
    // K/V travel in the storage type, in rows where a fused provider reads
    // them (fused_storage_layout; widened into the kernels' panels).
    const BlockLayout storage = fused_storage_layout<V, ExecSpace>(layout);
    m_kv.resize(std::size_t(slots.kv));
    for (auto& b : m_kv)
      b = allocate_forward_block<V, ExecSpace>(storage, e.batch, e.kv_heads, most);
    m_kv[0].keys = e.keys;  // ours: the rest of the slot is zero padding
    pack_forward_block(exec, k, v, m_kv[0]);
    if constexpr (half)
      m_wide = allocate_forward_block<T, ExecSpace>(layout, e.batch, e.kv_heads, most);
    m_qs.resize(std::size_t(slots.q));
    for (std::size_t i = 1; i < m_qs.size(); ++i)
      m_qs[i] = buffer_like<V, ExecSpace>(q, "blockattn::q_in", most);
    if (slots.q_copy) {
      m_qs[0] = buffer_like<V, ExecSpace>(q, "blockattn::q_copy", most);
      Kokkos::deep_copy(exec, rows_of(m_qs[0], e.queries), q);
    }
    const auto lse_buffer = [&](const char* label) {
      return LseBuffer<T, ExecSpace>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), e.batch, e.heads,
          most);
    };
    m_hout.resize(std::size_t(slots.results_out));
    m_rout.resize(std::size_t(slots.results_in));
    for (auto& h : m_hout)
      h = {buffer_like<T, ExecSpace>(o, "blockattn::result_out", most),
           lse_buffer("blockattn::result_out_lse")};
    for (auto& r : m_rout)
      r = {buffer_like<T, ExecSpace>(o, "blockattn::result_in", most),
           lse_buffer("blockattn::result_in_lse")};
    // Rows of the longest rank: a helper's task on another rank's queries uses it too.
    m_state.state = SoftmaxState<T, mem>(e.batch, e.heads, most, "blockattn::forward");
    if constexpr (half) {  // 16-bit o: the unnormalised O between steps in fp32
      m_acc = buffer_like<T, ExecSpace>(o, "blockattn::o_accumulator");
      m_state.o_acc = m_acc;
    }
    m_kv_bytes = bytes_of(m_kv[0].kt) + bytes_of(m_kv[0].v);
    const std::int64_t q_elems = std::int64_t(e.batch) * most * e.heads * e.dim;
    m_q_bytes = q_elems * std::int64_t(sizeof(V));
    m_res_bytes = (q_elems + std::int64_t(e.batch) * e.heads * most) * std::int64_t(sizeof(T));
    stats.block_q = layout.block_q;
    stats.block_k = layout.block_k;
    ForwardBufferBytes b;  // the planner's formula (schedule/schedule.hpp)
    b.kv = m_kv_bytes;
    b.q = m_q_bytes;
    b.result = m_res_bytes;
    b.state = m_state.state.bytes();
    if constexpr (half) {
      b.widened_kv = bytes_of(m_wide.kt) + bytes_of(m_wide.v);
      b.accumulator = bytes_of(m_acc);
    }
    stats.workspace_bytes = forward_workspace_bytes(slots, b);
    if constexpr (fused_available_v<ExecSpace, V>) {
      if (!opts.portable_only) {  // the fused pieces' normalised partial results
        // (rows of the longest rank: a helper's task on another rank's queries too)
        m_part_o = buffer_like<V, ExecSpace>(o, "blockattn::fused_o", most);
        m_part_lse = lse_buffer("blockattn::fused_lse");
        stats.fused_workspace_bytes = bytes_of(m_part_o) + bytes_of(m_part_lse);
      }
    }
    m_portable_only = opts.portable_only;
    m_tensor_cores = opts.tensor_cores;
    m_guard_nonfinite = opts.guard_masked_nonfinite;
    m_state.host_matrix = opts.host_matrix;
  }

  /// `last_own`: the last step computing on this rank's queries; `merges`:
  /// results of other ranks arrive (then finish() normalises).
  void set_plan(int steps, int last_own, bool merges) {
    m_merge_at.assign(std::size_t(steps) + 1, {});
    m_last_own = last_own;
    m_merges = merges;
  }

  void post(const ScheduledTransfer& t, std::vector<request>& list, StepStats& st) {
    Posting<Xfer> go(m_x, t, m_rank, list);
    const bool send = go.send;
    const int slot = go.slot;
    const std::size_t i = std::size_t(slot);
    if (t.payload == Payload::kv) {
      if (!send && slot == m_widened) m_widened = -1;  // a new block in the slot
      go(m_kv[i].kt, Message::k);
      go(m_kv[i].v, Message::v);
    } else if (t.payload == Payload::q) {
      go(m_qs[i], Message::q);
    } else {
      const Result& r = send ? m_hout[i] : m_rout[i];
      go(r.o, Message::o);
      go(r.lse, Message::o_lse);
      if (!send) m_merge_at[std::size_t(t.done_step)].push_back(slot);
    }
    const std::int64_t b = t.payload == Payload::kv  ? m_kv_bytes
                           : t.payload == Payload::q ? m_q_bytes
                                                     : m_res_bytes;
    (send ? st.bytes_sent : st.bytes_received) += b;
  }

  bool compute(int s, const ForwardStep& f, std::vector<std::vector<request>>& due, StepStats& st) {
    std::vector<request*> in_flight;  // tested between compute chunks
    for (std::size_t d = std::size_t(s); d < due.size(); ++d)
      for (auto& r : due[d]) in_flight.push_back(&r);
    const BlockTask task = f.task;
    const bool computed = this->has_work(task);
    const int kv_slot = m_comm ? f.kv_slot : 0;
    BlockPath own_path = BlockPath::fused;
    if (computed && task.q_rank == m_rank && fused(s, task, kv_slot, st.fused_pieces, own_path)) {
      st.path = own_path;
      m_exec.fence();
      return true;
    }
    if (computed && task.q_rank != m_rank && helper_fused(f, kv_slot, st.fused_pieces, own_path)) {
      st.path = own_path;
      m_exec.fence();
      return true;
    }
    if (computed) st.path = BlockPath::portable;
    const PackedKV<T, mem>* kp = nullptr;
    if constexpr (half) {
      if (computed && m_widened != kv_slot) {
        widen_forward_block(m_exec, m_kv[std::size_t(kv_slot)], m_wide);
        m_widened = kv_slot;
      }
      kp = &m_wide;
    } else {
      kp = &m_kv[std::size_t(kv_slot)];
    }
    // The block pair's extents; without communication the queries are ours.
    BlockExtents te = task.idle() ? m_c.e : m_c.task(task.q_rank, task.k_rank);
    if (!m_comm && te.queries > m_c.e.queries) te.queries = m_c.e.queries;
    const auto pos = [&](int r) { return this->positions(r); };
    if (task.q_rank == m_rank) {
      const bool finish = s == m_last_own && !m_merges;
      if (computed || finish) {
        ForwardBlockState<T, mem> b = m_state;
        b.resume = m_opened;
        b.finish = finish;
        b.skip_keys = !computed;
        launch_chunked(te, m_q, *kp, m_o, m_lse, pos(m_rank), pos(task.k_rank), b, in_flight);
        m_opened = true;
      }
    } else if (!task.idle()) {
      // A helper's task: fresh state, normalised result to its slot.
      ForwardBlockState<T, mem> b = m_state;
      b.resume = false;
      b.finish = true;
      b.skip_keys = !computed;
      b.o_acc = {};  // a fresh, finished result: no accumulator
      const Result& out = m_hout[std::size_t(f.result_slot)];
      if (m_comm)
        launch_chunked(te, m_qs[std::size_t(f.q_slot)], *kp, out.o, out.lse, pos(task.q_rank),
                       pos(task.k_rank), b, in_flight);
      else
        launch_chunked(te, m_q, *kp, out.o, out.lse, pos(task.q_rank), pos(task.k_rank), b,
                       in_flight);
    }
    m_exec.fence();
    return computed;
  }

  /// Merges the results that arrived by the end of step s.
  void arrived(int s) {
    const auto& slots = m_merge_at[std::size_t(s)];
    if (slots.empty()) return;
    open_state();
    for (const int i : slots) {
      const Result& r = m_rout[std::size_t(i)];
      m_state.state.merge_partial(m_exec, o_sum(), r.o, r.lse, m_c.e.dim);
    }
    m_exec.fence();
  }

  /// After the loop: normalises the merged state into o and lse (when
  /// results arrived); returns whether it did.
  bool finish() {
    if (!m_merges) return false;
    open_state();
    m_state.state.finalize(m_exec, o_sum(), m_o, m_lse, m_c.e.dim);
    m_exec.fence();
    return true;
  }

 private:
  struct Result {
    Buffer4<T, ExecSpace> o;
    LseBuffer<T, ExecSpace> lse;
  };

  /// The step's pair on the fused path (own queries only; a helper's task
  /// takes the kernels): every band piece's normalised result merged into
  /// the state, which the next kernel call resumes; finished here when this
  /// is the last own step. A pair that cuDNN does not take runs on the
  /// tensor-core forward where it can (path: BlockPath::matrix), merged the
  /// same way. False: the pair takes the kernels.
  bool fused(int s, const BlockTask& task, int kv_slot, int& pieces, BlockPath& path) {
    if constexpr (fused_available_v<ExecSpace, V>) {
      if (m_portable_only) return false;
      const BlockExtents te = m_c.task(task.q_rank, task.k_rank);
      const PackedKV<V, mem>& kv = m_kv[std::size_t(kv_slot)];
      const auto qp = this->positions(task.q_rank);
      const auto kp = this->positions(task.k_rank);
      FusedPair pair = fused_pair<ExecSpace, V>(m_mask, qp, kp, te, false, m_q, kv, m_part_o,
                                                m_part_lse, float(m_scale));
      // inf / NaN in V where the mask hides keys: not cuDNN (it would leak).
      if (pair.fused && m_guard_nonfinite &&
          !pair_covers_all(m_mask, qp, te.queries, kp, te.keys) &&
          packed_v_has_nonfinite(m_exec, kv))
        pair.fused = false;
      if (!pair.fused) {
        if (!m_tensor_cores || !tensor_core_forward_pair(m_exec, te, m_q, kv, m_part_o, m_part_lse,
                                                         m_mask, qp, kp, float(m_scale)))
          return false;
        path = BlockPath::matrix;
        open_state();
        m_state.state.merge_partial(m_exec, o_sum(), m_part_o, m_part_lse, m_c.e.dim);
        if (s == m_last_own && !m_merges)
          m_state.state.finalize(m_exec, o_sum(), m_o, m_lse, m_c.e.dim);
        return true;
      }
      pieces = pair.split.count;
      open_state();
      for (const BandPiece& piece : pair.split) {
        Kokkos::deep_copy(m_exec, m_part_lse, -infinity<T>());  // rows outside the piece
        fused_forward_piece(m_exec, te, piece, m_q, kv, m_part_o, m_part_lse, float(m_scale));
        m_state.state.merge_partial(m_exec, o_sum(), m_part_o, m_part_lse, m_c.e.dim);
      }
      if (s == m_last_own && !m_merges)
        m_state.state.finalize(m_exec, o_sum(), m_o, m_lse, m_c.e.dim);
      return true;
    } else {
      (void)s, (void)task, (void)kv_slot, (void)pieces, (void)path;
      return false;
    }
  }

  /// A helper's task (another rank's queries, which travelled) on the fused
  /// path, or else on the tensor-core forward (path: BlockPath::matrix): the
  /// pair's normalised result into its result slot, as the kernels would
  /// leave it. False: the kernels take it.
  bool helper_fused(const ForwardStep& f, int kv_slot, int& pieces, BlockPath& path) {
    if constexpr (fused_available_v<ExecSpace, V>) {
      if (m_portable_only || !m_comm) return false;
      const BlockTask task = f.task;
      const BlockExtents te = m_c.task(task.q_rank, task.k_rank);
      const PackedKV<V, mem>& kv = m_kv[std::size_t(kv_slot)];
      const auto& q = m_qs[std::size_t(f.q_slot)];
      const Result& out = m_hout[std::size_t(f.result_slot)];
      const auto qp = this->positions(task.q_rank);
      const auto kp = this->positions(task.k_rank);
      if (fused_forward_result<ExecSpace, V>(m_exec, m_mask, qp, kp, te, q, kv, m_part_o,
                                             m_part_lse, out.o, out.lse, float(m_scale),
                                             m_guard_nonfinite, pieces)) {
        path = BlockPath::fused;
        return true;
      }
      if (!m_tensor_cores || !tensor_core_forward_pair(m_exec, te, q, kv, m_part_o, m_part_lse,
                                                       m_mask, qp, kp, float(m_scale)))
        return false;
      tensor_core_result(m_exec, te, m_part_o, m_part_lse, out.o, out.lse);
      path = BlockPath::matrix;
      return true;
    } else {
      (void)f, (void)kv_slot, (void)pieces, (void)path;
      return false;
    }
  }

  /// Where the unnormalised O lives: the caller's o, or the fp32 accumulator.
  const auto& o_sum() const {
    if constexpr (half)
      return m_acc;
    else
      return m_o;
  }
  void open_state() {
    if (!m_opened) m_state.state.init(m_exec, o_sum(), m_c.e.dim);
    m_opened = true;
  }

  /// The launches of one task in chunks of query tiles, testing the
  /// transfers in flight between them (MPI moves large messages only inside
  /// MPI calls). On host spaces every chunk but the last holds a multiple of
  /// the threads' count of teams (query tiles): a chunk of 5 teams on 4
  /// threads takes two rounds of one team's time. (One head's 43 tiles in 8
  /// chunks of 5 or 6 is the likely cause of the step loops' 20-30 % over
  /// the planner on 16 cores, 4 ranks x 4 threads; unmeasured since.)
  template <class Q, class O, class L, class Pos>
  void launch_chunked(const BlockExtents& e, const Q& q, const PackedKV<T, mem>& kv, const O& o,
                      const L& lse, const Pos& qpos, const Pos& kpos,
                      ForwardBlockState<T, mem> state, std::vector<request*>& reqs) {
    const int league = m_layout.forward_league(e);
    const int chunks = reqs.empty() ? 1 : (league < progress_chunks ? league : progress_chunks);
    if (chunks == 0) return;
    int per = (league + chunks - 1) / chunks;  // teams per launch
    if constexpr (impl::is_host_space_v<ExecSpace>) {
      const int threads = m_exec.concurrency() > 1 ? int(m_exec.concurrency()) : 1;
      per = (per + threads - 1) / threads * threads;
    }
    if (per < 1) per = 1;
    int begin = 0;
    do {
      state.league_begin = begin;
      state.league_end = league - begin > per ? begin + per : league;
      forward_block(m_exec, e, q, kv, o, lse, m_mask, qpos, kpos, m_scale, state);
      if (!reqs.empty()) {
        m_exec.fence();
        for (auto* r : reqs) m_x.test(*r);
      }
      begin = state.league_end;
    } while (begin < league);
  }

  const QV& m_q;
  const OV& m_o;
  const LV& m_lse;
  bool m_comm;
  std::vector<PackedKV<V, mem>> m_kv;       // K/V slots (0: own) in the storage type
  PackedKV<T, mem> m_wide;                  // 16-bit storage: the slot in use, widened
  int m_widened = -1;                       // the K/V slot whose block m_wide holds (-1: none)
  std::vector<Buffer4<V, ExecSpace>> m_qs;  // query slots (0: a copy of ours, if it travels)
  std::vector<Result> m_hout, m_rout;       // results computed here / arriving
  ForwardBlockState<T, mem> m_state;
  Buffer4<T, ExecSpace> m_acc;
  std::vector<std::vector<int>> m_merge_at;  // result-in slots, by the step they complete
  std::int64_t m_kv_bytes = 0, m_q_bytes = 0, m_res_bytes = 0;
  int m_last_own = -1;
  bool m_merges = false, m_opened = false, m_portable_only = false, m_tensor_cores = true,
       m_guard_nonfinite = true;
  Buffer4<V, ExecSpace> m_part_o;      // fused path: a piece's normalised O (storage type)
  LseBuffer<T, ExecSpace> m_part_lse;  // and its LSE (-inf: rows outside the piece)
};

}  // namespace blockattn::impl
