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
#include <blockattn/kernel/dispatch.hpp>
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
/// rank; results that arrive are merged (SoftmaxState::merge_partial). Which
/// implementation computes each pair is the dispatcher's choice
/// (kernel/dispatch.hpp ForwardPairs): K, V and Q travel in the storage type,
/// K/V in the layout it names, and the kernels read the slot in use relaid /
/// widened to fp32; with 16-bit storage the unnormalised O lives in an fp32
/// accumulator. communicate = false: every remote buffer is the local one
/// (the same steps and work, no transfers, a wrong result).
template <class Partition, class Mask, class ExecSpace, class Xfer, class QV, class OV, class LV>
class ForwardSteps
    : StepContext<Partition, Mask, ExecSpace, Xfer, compute_t<typename OV::non_const_value_type>> {
  using Base =
      StepContext<Partition, Mask, ExecSpace, Xfer, compute_t<typename OV::non_const_value_type>>;

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
        m_comm(opts.communicate),
        m_pairs(exec, opts, c.e, c.most, layout) {
    const BlockExtents& e = c.e;
    const int most = c.most;
    // K/V travel in the storage type, in the layout the dispatcher names
    // (rows where an implementation reads them in place).
    const BlockLayout storage = Pairs::storage_layout(layout);
    m_kv.resize(std::size_t(slots.kv));
    for (auto& b : m_kv)
      b = allocate_forward_block<V, ExecSpace>(storage, e.batch, e.kv_heads, most);
    m_kv[0].keys = e.keys;  // ours: the rest of the slot is zero padding
    pack_forward_block(exec, k, v, m_kv[0]);
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
    b.widened_kv = m_pairs.relay_bytes();
    if constexpr (half) b.accumulator = bytes_of(m_acc);
    stats.workspace_bytes = forward_workspace_bytes(slots, b);
    // The other implementations' partial results (rows of the longest rank:
    // a helper's task on another rank's queries too).
    stats.fused_workspace_bytes = m_pairs.workspace_bytes();
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
    Posting<Xfer> go(this->m_x, t, this->m_rank, list);
    const bool send = go.send;
    const int slot = go.slot;
    const std::size_t i = std::size_t(slot);
    if (t.payload == Payload::kv) {
      if (!send) m_pairs.invalidate(slot);  // a new block in the slot
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
    const PackedKV<V, mem>& kv = m_kv[std::size_t(kv_slot)];
    // The block pair's extents; without communication the queries are ours.
    BlockExtents te = task.idle() ? this->m_c.e : this->m_c.task(task.q_rank, task.k_rank);
    if (!m_comm && te.queries > this->m_c.e.queries) te.queries = this->m_c.e.queries;
    const auto pos = [&](int r) { return this->positions(r); };
    const bool own = task.q_rank == this->m_rank;
    const bool finish = own && s == m_last_own && !m_merges;
    // The dispatcher's implementations other than the kernels (own pairs
    // merge into the state; a helper's result goes to its slot).
    if (computed && own) {
      st.path = m_pairs.own(
          te, m_q, kv, this->m_mask, pos(this->m_rank), pos(task.k_rank), this->m_scale,
          m_state.state, o_sum(), [&] { open_state(); }, st.fused_pieces);
      if (st.path != BlockPath::portable) {
        if (finish) m_state.state.finalize(this->m_exec, o_sum(), m_o, m_lse, this->m_c.e.dim);
        this->m_exec.fence();
        return true;
      }
    } else if (computed && m_comm) {
      const Result& out = m_hout[std::size_t(f.result_slot)];
      st.path = m_pairs.helper(te, m_qs[std::size_t(f.q_slot)], kv, this->m_mask, pos(task.q_rank),
                               pos(task.k_rank), this->m_scale, out.o, out.lse, st.fused_pieces);
      if (st.path != BlockPath::portable) {
        this->m_exec.fence();
        return true;
      }
    }
    if (computed) st.path = BlockPath::portable;
    const PackedKV<T, mem>& kp = m_pairs.kernel_block(kv, kv_slot);
    if (own) {
      if (computed || finish) {
        ForwardBlockState<T, mem> b = m_state;
        b.resume = m_opened;
        b.finish = finish;
        b.skip_keys = !computed;
        launch_chunked(te, m_q, kp, m_o, m_lse, pos(this->m_rank), pos(task.k_rank), b, in_flight);
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
        launch_chunked(te, m_qs[std::size_t(f.q_slot)], kp, out.o, out.lse, pos(task.q_rank),
                       pos(task.k_rank), b, in_flight);
      else
        launch_chunked(te, m_q, kp, out.o, out.lse, pos(task.q_rank), pos(task.k_rank), b,
                       in_flight);
    }
    this->m_exec.fence();
    return computed;
  }

  /// Merges the results that arrived by the end of step s.
  void arrived(int s) {
    const auto& slots = m_merge_at[std::size_t(s)];
    if (slots.empty()) return;
    open_state();
    for (const int i : slots) {
      const Result& r = m_rout[std::size_t(i)];
      m_state.state.merge_partial(this->m_exec, o_sum(), r.o, r.lse, this->m_c.e.dim);
    }
    this->m_exec.fence();
  }

  /// After the loop: normalises the merged state into o and lse (when
  /// results arrived); returns whether it did.
  bool finish() {
    if (!m_merges) return false;
    open_state();
    m_state.state.finalize(this->m_exec, o_sum(), m_o, m_lse, this->m_c.e.dim);
    this->m_exec.fence();
    return true;
  }

 private:
  struct Result {
    Buffer4<T, ExecSpace> o;
    LseBuffer<T, ExecSpace> lse;
  };

  /// Where the unnormalised O lives: the caller's o, or the fp32 accumulator.
  const auto& o_sum() const {
    if constexpr (half)
      return m_acc;
    else
      return m_o;
  }
  void open_state() {
    if (!m_opened) m_state.state.init(this->m_exec, o_sum(), this->m_c.e.dim);
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
    const int league = this->m_layout.forward_league(e);
    const int chunks = reqs.empty() ? 1 : (league < progress_chunks ? league : progress_chunks);
    if (chunks == 0) return;
    int per = (league + chunks - 1) / chunks;  // teams per launch
    if constexpr (impl::is_host_space_v<ExecSpace>) {
      const int threads = this->m_exec.concurrency() > 1 ? int(this->m_exec.concurrency()) : 1;
      per = (per + threads - 1) / threads * threads;
    }
    if (per < 1) per = 1;
    int begin = 0;
    do {
      state.league_begin = begin;
      state.league_end = league - begin > per ? begin + per : league;
      forward_block(this->m_exec, e, q, kv, o, lse, this->m_mask, qpos, kpos, this->m_scale, state);
      if (!reqs.empty()) {
        this->m_exec.fence();
        for (auto* r : reqs) this->m_x.test(*r);
      }
      begin = state.league_end;
    } while (begin < league);
  }

  const QV& m_q;
  const OV& m_o;
  const LV& m_lse;
  bool m_comm;
  using Pairs = ForwardPairs<ExecSpace, V, Mask>;
  Pairs m_pairs;                            // which implementation computes a pair
  std::vector<PackedKV<V, mem>> m_kv;       // K/V slots (0: own) in the storage type
  std::vector<Buffer4<V, ExecSpace>> m_qs;  // query slots (0: a copy of ours, if it travels)
  std::vector<Result> m_hout, m_rout;       // results computed here / arriving
  ForwardBlockState<T, mem> m_state;
  Buffer4<T, ExecSpace> m_acc;
  std::vector<std::vector<int>> m_merge_at;  // result-in slots, by the step they complete
  std::int64_t m_kv_bytes = 0, m_q_bytes = 0, m_res_bytes = 0;
  int m_last_own = -1;
  bool m_merges = false, m_opened = false;
};

}  // namespace blockattn::impl
