// SPDX-License-Identifier: Apache-2.0
// The one step loop every schedule's description runs, forward and backward
// (DistributedAttention). The skeleton lives here; a direction
// (impl/forward_steps.hpp, impl/backward_steps.hpp) supplies its buffers and
// its compute.
#pragma once

#include <blockattn/distributed/impl/buffers.hpp>
#include <blockattn/distributed/impl/transfer.hpp>
#include <blockattn/distributed/options.hpp>
#include <blockattn/kernel/block_product.hpp>
#include <blockattn/schedule/context.hpp>
#include <blockattn/schedule/schedule.hpp>

#include <chrono>
#include <cstddef>
#include <sstream>
#include <vector>

namespace blockattn::impl {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// One transfer of a description as this rank posts it: a send when the rank
/// is its source, else a receive; `go(view, message)` starts one message of
/// its payload and lists it with the transfers due at its done step.
template <class Xfer>
struct Posting {
  Xfer& x;
  const ScheduledTransfer& t;
  std::vector<typename Xfer::transfer_type>& due;
  bool send;
  int peer, slot;  // the other end, and this end's slot
  Posting(Xfer& xf, const ScheduledTransfer& tr, int rank,
          std::vector<typename Xfer::transfer_type>& list)
      : x(xf),
        t(tr),
        due(list),
        send(tr.src == rank),
        peer(send ? tr.dst : tr.src),
        slot(send ? tr.src_slot : tr.dst_slot) {}
  template <class View>
  void operator()(const View& view, Message m) {
    const int named = transfer_step(t);
    due.push_back(send ? x.send(view, peer, named, m) : x.receive(view, peer, named, m));
  }
};

/// What both directions of a call know (impl/forward_steps.hpp,
/// impl/backward_steps.hpp): the instance, the transfers, the partition and
/// mask, the call's extents and tiles, the options.
template <class Partition, class Mask, class ExecSpace, class Xfer, class T>
struct StepContext {
  ExecSpace m_exec;
  Xfer& m_x;
  const Partition& m_part;
  const Mask& m_mask;
  const CallExtents& m_c;
  BlockLayout m_layout;
  int m_P, m_rank;
  const DistributedOptions& m_opts;
  T m_scale;  // the softmax scale in the compute type

  StepContext(const ExecSpace& exec, Xfer& x, const Partition& part, const Mask& mask,
              const CallExtents& c, const BlockLayout& layout, int P, int rank,
              const DistributedOptions& opts)
      : m_exec(exec),
        m_x(x),
        m_part(part),
        m_mask(mask),
        m_c(c),
        m_layout(layout),
        m_P(P),
        m_rank(rank),
        m_opts(opts),
        m_scale(softmax_scale<T>(opts.scale, c.e.dim)) {}

  /// Global positions of rank r's rows.
  auto positions(int r) const { return m_part.positions(m_c.N, m_P, r); }
  /// Whether the task launches kernels (not idle, not wholly masked).
  bool has_work(const BlockTask& task) const {
    return !task.idle() && !block_is_empty(m_part, m_mask, m_c.N, m_P, task.q_rank, task.k_rank);
  }
  /// The task's tiles (RunStats).
  TileCounts work(const BlockTask& task) const {
    return task_work(m_part, m_mask, m_c.N, m_P, task, m_layout.block_q, m_layout.block_k,
                     m_opts.count_pairs);
  }
};

/// Runs the steps of a description on this rank. At each step s:
///   1. posts the step's transfers that start before its compute (inputs of
///      later steps, and the receives of results or partial gradients),
///   2. computes the step's task (Dir::compute: the kernels; it may test the
///      transfers in flight, and fences the instance),
///   3. completes the transfers due at s and hands what arrived to the
///      direction (Dir::arrived: merge results, add partial gradients), and
///      posts what the step produced, after the compute: before step 3 when
///      Dir::results_first (the forward's results do not depend on what
///      arrives), after it otherwise (a partial gradient is sent with the
///      partials that arrived at s added in),
///   4. accounts the step in `stats` (block pair, tiles, bytes, seconds).
/// After the last step it completes what is due at the end and returns the
/// seconds that took. `communicate` = false: no transfer is posted (the
/// forward's compute-only measurement).
///
/// A direction provides:
///   void post(const ScheduledTransfer&, std::vector<Xfer::transfer_type>& due, StepStats&)
///   bool compute(int s, const Step&, std::vector<std::vector<Xfer::transfer_type>>& due,
///                StepStats&)   -> whether kernels ran (false: no work, or an idle step)
///   void arrived(int s)        after the waits of step s (s = steps: the end)
///   TileCounts work(const BlockTask&) const
///   static constexpr bool results_first
/// A communicator that groups a step's transfers (flush(), e.g.
/// NcclCommunicator) runs a description only if both ends of every transfer
/// post it at the start of the same step: the k-th group of every rank then
/// pairs with the k-th groups of its peers, and no group waits for one queued
/// behind it (ends posted at different steps, or after a compute, could close
/// such a cycle: a hang). Checked on every rank (one allreduce), the same
/// verdict everywhere.
template <class Step, class Xfer>
void require_grouped_posting(Xfer& x, const std::vector<Step>& desc, int rank) {
  const ScheduledTransfer* bad = nullptr;
  for (const Step& f : desc)
    for (const ScheduledTransfer& t : f.transfers)
      if (bad == nullptr && (t.after_compute || t.src_step != t.dst_step)) bad = &t;
  if (x.agree_max(bad != nullptr ? 1 : 0) == 0) return;
  std::ostringstream why;
  why << "the communicator groups each step's transfers (flush(): NcclCommunicator), which "
         "needs both ends of every transfer posted at the start of the same step; this "
         "schedule's ";
  if (bad != nullptr)
    why << payload_name(bad->payload) << " from rank " << bad->src << " (step " << bad->src_step
        << (bad->after_compute ? ", after its compute" : "") << ") to rank " << bad->dst
        << " (step " << bad->dst_step << ") is not one (rank " << rank << " found it)";
  else
    why << "transfers are not all such (another rank found one)";
  why << ": run this schedule with MpiCommunicator";
  fail(x.function(), why.str());
}

template <class Step, class Xfer, class Dir>
double run_step_loop(Xfer& x, const std::vector<Step>& desc, int rank, bool communicate, Dir& dir,
                     RunStats& stats) {
  using request = typename Xfer::transfer_type;
  using clock = std::chrono::steady_clock;
  if constexpr (Xfer::grouped)
    if (communicate) require_grouped_posting(x, desc, rank);
  const std::size_t steps = desc.size();
  std::vector<std::vector<request>> due(steps + 1);  // by the step that completes them
  const auto post = [&](const Step& f, bool after_compute, StepStats& st) {
    if (!communicate) return;
    for (const ScheduledTransfer& t : f.transfers)
      if (after_compute ? (t.after_compute && t.src == rank) : (!t.after_compute || t.dst == rank))
        dir.post(t, due[std::size_t(t.done_step)], st);
    x.flush();  // the step's transfers as one group where the communicator groups them
  };
  const auto complete = [&](std::size_t s) {
    for (auto& r : due[s]) x.wait(r);
    dir.arrived(int(s));
  };
  for (std::size_t s = 0; s < steps; ++s) {
    const auto t0 = clock::now();
    const Step& f = desc[s];
    StepStats st;
    post(f, false, st);
    const auto c0 = clock::now();
    st.computed = dir.compute(int(s), f, due, st);
    st.compute_seconds = seconds_since(c0);
    if (Dir::results_first) {
      post(f, true, st);
      complete(s);
    } else {
      complete(s);
      post(f, true, st);
    }
    st.step = int(s);
    st.source = f.task.k_rank;
    st.query_source = f.task.q_rank;
    st.tiles = dir.work(f.task);
    st.seconds = seconds_since(t0);
    stats.steps.push_back(st);
  }
  const auto t0 = clock::now();
  complete(steps);
  return seconds_since(t0);
}

}  // namespace blockattn::impl
