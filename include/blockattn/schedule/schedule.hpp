// SPDX-License-Identifier: Apache-2.0
// The schedule concept: a schedule is a complete host-side description of a
// distributed forward, written once and read by everything that needs it —
// DistributedAttention's step loop (which block pair to compute, which
// transfers to post into which buffer, when to wait), the planner (messages,
// workspace, idle steps) and the tests.
//
// A schedule S provides, all static:
//   using schedule_type = S;          using backward_type = <backward variant>;
//   const char* name();
//   template <class Partition, class Mask> constexpr bool supports;   // compile time
//   template <class Partition, class Mask>
//   std::string can_implement(const Mask&, index_type N, int P);    // run time; "" = yes,
//                                                                    // else the reason
//   int steps(const ScheduleContext&);                 // steps of the forward
//   void step(const ScheduleContext&, int rank, int s, ForwardStep&);
//                                  // what rank does at step s: block pair, buffers, transfers
//   using backward_type = B;       // the backward's description: B::steps(context) and
//                                  // B::step(const ScheduleContext&, int rank, int s,
//                                  //         BackwardStep&)
// A schedule that takes every partition and mask may inherit both from
// AnyPartitionAndMask (the ring's and the all-gather's do).
// Everything else is derived from these: the workspace (forward_slots), the
// messages (schedule_transfers), the tasks (schedule_task).
// impl::check_schedule<S>() turns a missing member into a static_assert that
// names it.
#pragma once

#include <blockattn/core/config.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace blockattn {

/// What a description knows of the run besides the number of ranks: which
/// block pairs the mask leaves empty, so that a schedule may move and compute
/// only the blocks that carry work. Every rank builds the same context (the
/// configuration is the same on every rank; DistributedAttention checks it).
struct ScheduleContext {
  int P = 1;
  /// empty(q_rank, k_rank): the keys of rank k_rank are all masked out for
  /// the queries of rank q_rank. Unset: no pair is empty.
  std::function<bool(int, int)> empty_pair;
  /// ring_reach(), cached (schedule_context() fills it in); < 0: computed on demand.
  int reach = -1;
  bool empty(int q_rank, int k_rank) const { return empty_pair && empty_pair(q_rank, k_rank); }
  /// The largest ring distance d (0 <= d < P) at which some block pair
  /// (x, (x - d) mod P) is not empty. A ring that moves K/V (or queries) one
  /// rank per step is done after ring_reach() + 1 steps: with a sliding window
  /// of w tokens on a contiguous partition of c tokens per rank that is at most
  /// ceil(w / c) + 1 instead of P.
  int ring_reach() const {
    if (reach >= 0) return reach;
    if (!empty_pair) return P - 1;
    for (int d = P - 1; d > 0; --d)
      for (int x = 0; x < P; ++x)
        if (!empty(x, ((x - d) % P + P) % P)) return d;
    return 0;
  }
};

/// One step of one rank: attention of the queries of rank `q_rank` against the
/// keys of rank `k_rank`, or nothing (idle) when q_rank < 0.
struct BlockTask {
  int q_rank = -1;
  int k_rank = -1;
  bool idle() const { return q_rank < 0; }
};

/// What a transfer carries. Forward: a packed K/V block, a block of queries,
/// or a helper's result for another rank's queries (normalised O and LSE).
/// Backward: a K/V block, a packed query block (Q, dO, LSE, D = rowsum(dO O)),
/// and partial gradients (dQ of a query block, dK and dV of a key block).
enum class Payload : int { kv, q, result, dq, dkv };

inline const char* payload_name(Payload p) {
  switch (p) {
    case Payload::kv:
      return "K/V block";
    case Payload::q:
      return "Q block";
    case Payload::result:
      return "partial O and LSE";
    case Payload::dq:
      return "dQ partial";
    case Payload::dkv:
      return "dK/dV partial";
  }
  return "payload";
}

/// One point-to-point transfer of a forward, as both of its ends see it.
/// Posted by the sender at the start of src_step (after its compute of
/// src_step when after_compute), by the receiver at the start of dst_step;
/// both complete it by the end of done_step (done_step == steps: after the
/// last step). Slots name the buffers at both ends (see ForwardBuffers): a K/V
/// is sent from and received into K/V slots, a Q block from / into query
/// slots, a result from a helper's result slot into a received-result slot.
struct ScheduledTransfer {
  int src = 0, dst = 0;
  Payload payload = Payload::kv;
  int src_step = 0, dst_step = 0;
  bool after_compute = false;
  int done_step = 0;
  int src_slot = 0, dst_slot = 0;
  /// Backward partial gradients (dq, dkv) only: what the receiver does with
  /// it once complete: -1 adds it into its own gradient (dQ, or dK and dV;
  /// the first contribution is copied), k >= 0 adds it into its partial slot k.
  int add_to = -1;
};

/// The step a transfer is named by (in its message tag and in errors): an
/// input, posted before a compute, by the step that needs it (done_step + 1);
/// a result, posted after a compute, by the step that computed it.
inline int transfer_step(const ScheduledTransfer& t) {
  return t.after_compute ? t.src_step : t.done_step + 1;
}

/// What one rank does at one step of a forward.
struct ForwardStep {
  BlockTask task;        // the block pair computed (idle: none)
  int q_slot = 0;        // query slot the task reads (0: the caller's q)
  int kv_slot = 0;       // K/V slot the task reads (0: this rank's own packed K/V)
  int result_slot = -1;  // >= 0: the task is for another rank's queries; its
                         // normalised O and LSE go to this result-out slot
  std::vector<ScheduledTransfer> transfers;  // what this rank posts at this step
  void clear() {
    task = {};
    q_slot = kv_slot = 0;
    result_slot = -1;
    transfers.clear();
  }
};

/// The buffers one rank of a forward uses, derived from its steps: K/V slot 0
/// (its own packed K/V) always, every other slot that a task or a transfer of
/// this rank names; a contiguous copy of the caller's q when query slot 0 is
/// sent; result slots out (a helper's results) and in (results for its own
/// queries). Counts are slot index + 1 (slots are numbered densely).
struct ForwardSlots {
  int kv = 1;
  int q = 1;            // query slots including slot 0 (the caller's q, not allocated)
  bool q_copy = false;  // query slot 0 is sent: a contiguous copy is allocated
  int results_out = 0, results_in = 0;
  bool merges = false;  // results for this rank's queries arrive from other ranks
};

/// The sizes of the buffers a forward allocates (bytes of one of each).
struct ForwardBufferBytes {
  std::int64_t kv = 0;           // a packed K/V slot (storage type)
  std::int64_t q = 0;            // a query slot (storage type)
  std::int64_t result = 0;       // a partial result: O and LSE (compute type)
  std::int64_t state = 0;        // the softmax state (m, l) of the longest rank's rows
  std::int64_t widened_kv = 0;   // 16-bit storage: the block in use widened (else 0)
  std::int64_t accumulator = 0;  // 16-bit storage: the fp32 unnormalised O (else 0)
};

/// The workspace a rank's forward allocates for its slots: the one formula
/// the run (RunStats::workspace_bytes) and the planner both use.
inline std::int64_t forward_workspace_bytes(const ForwardSlots& u, const ForwardBufferBytes& b) {
  return u.kv * b.kv + b.state + (u.q - 1 + (u.q_copy ? 1 : 0)) * b.q +
         std::int64_t(u.results_out + u.results_in) * b.result + b.widened_kv + b.accumulator;
}

/// What one rank does at one step of a backward: the gradients of the block
/// pair `task` from the packed query slot q_slot (0: this rank's own Q, dO,
/// LSE, D) and the K/V slot kv_slot (0: this rank's own K and V); dQ goes
/// into this rank's own dq (dq_slot = -1) or is written into a dQ partial
/// slot, likewise dK, dV (dkv_slot). A partial slot of a task that does no
/// work is zeroed.
struct BackwardStep {
  BlockTask task;
  int q_slot = 0, kv_slot = 0;
  int dq_slot = -1, dkv_slot = -1;
  std::vector<ScheduledTransfer> transfers;
  void clear() {
    task = {};
    q_slot = kv_slot = 0;
    dq_slot = dkv_slot = -1;
    transfers.clear();
  }
};

/// The buffers of one rank's backward, derived from its steps like
/// ForwardSlots: K/V slots (slot 0 copies this rank's k and v when it is sent
/// or received into, else the caller's Views are read), packed query slots
/// (slot 0: its own), partial-gradient slots written by tasks (out) and
/// receiving partials (in).
struct BackwardSlots {
  int kv = 1, q = 1;
  bool kv_copy = false;
  int dq_out = 0, dkv_out = 0, dq_in = 0, dkv_in = 0;
};

/// The sizes of the buffers a backward allocates (bytes of one of each; the
/// run's BackwardSteps and the planner both fill it).
struct BackwardBufferBytes {
  std::int64_t kv = 0;         // a K/V slot: K and V rows (storage type)
  std::int64_t q = 0;          // a packed query slot: Q, dO rows (storage), LSE, D (compute)
  std::int64_t widened_q = 0;  // 16-bit storage: the query slot in use widened (else 0)
  std::int64_t keys = 0;       // the packed key side in use: K^T, V^T panels and K rows
  std::int64_t dq = 0;         // a dQ partial slot (compute type)
  std::int64_t dkv = 0;        // a dK/dV partial slot (compute type)
  std::int64_t own = 0;        // the own dQ, dK, dV sums when the caller's Views are not
                               // contiguous Views of the compute type (16-bit gradients)
};

/// The workspace a rank's backward allocates for its slots: the one formula
/// the run (RunStats::workspace_bytes) and the planner both use. K/V slot 0
/// is the caller's k, v unless it travels (kv_copy).
inline std::int64_t backward_workspace_bytes(const BackwardSlots& u, const BackwardBufferBytes& b) {
  return (u.kv - (u.kv_copy ? 0 : 1)) * b.kv + std::int64_t(u.q) * b.q + b.widened_q + b.keys +
         std::int64_t(u.dq_out + u.dq_in) * b.dq + std::int64_t(u.dkv_out + u.dkv_in) * b.dkv +
         b.own;
}

/// supports and can_implement() of a schedule that takes every partition and
/// mask: true, and "" (no reason against).
struct AnyPartitionAndMask {
  template <class Partition, class Mask>
  static constexpr bool supports = true;
  template <class Partition, class Mask>
  static std::string can_implement(const Mask&, index_type, int) {
    return {};
  }
};

template <class S, class = void>
struct is_schedule : std::false_type {};
template <class S>
struct is_schedule<S, std::void_t<typename S::schedule_type, decltype(S::name())>>
    : std::is_same<typename S::schedule_type, S> {};
template <class S>
inline constexpr bool is_schedule_v = is_schedule<S>::value;

namespace impl {

#define BLOCKATTN_SCHEDULE_MEMBER(trait, expr) \
  template <class S, class = void>             \
  struct trait : std::false_type {};           \
  template <class S>                           \
  struct trait<S, std::void_t<decltype(expr)>> : std::true_type {};
BLOCKATTN_SCHEDULE_MEMBER(has_steps, int(S::steps(std::declval<const ScheduleContext&>())))
BLOCKATTN_SCHEDULE_MEMBER(has_step, S::step(std::declval<const ScheduleContext&>(), 0, 0,
                                            std::declval<ForwardStep&>()))
BLOCKATTN_SCHEDULE_MEMBER(has_backward_type, std::declval<typename S::backward_type>())
BLOCKATTN_SCHEDULE_MEMBER(has_backward_steps,
                          int(S::backward_type::steps(std::declval<const ScheduleContext&>())))
BLOCKATTN_SCHEDULE_MEMBER(has_backward_step,
                          S::backward_type::step(std::declval<const ScheduleContext&>(), 0, 0,
                                                 std::declval<BackwardStep&>()))
#undef BLOCKATTN_SCHEDULE_MEMBER

/// One static_assert per missing member of the schedule concept.
template <class S>
constexpr bool check_schedule() {
  static_assert(has_steps<S>::value,
                "BlockAttn: a schedule must describe its steps: static int steps(const "
                "blockattn::ScheduleContext& c)");
  static_assert(has_step<S>::value,
                "BlockAttn: a schedule must describe what each rank does at each step (block "
                "pair, buffers, transfers): static void step(const blockattn::ScheduleContext& c, "
                "int rank, int s, blockattn::ForwardStep& out)");
  static_assert(has_backward_type<S>::value,
                "BlockAttn: a schedule must name its backward's description: using "
                "backward_type = ... (e.g. KVRingBackward, QRingBackward, BalancedBackward)");
  static_assert(has_backward_steps<S>::value && has_backward_step<S>::value,
                "BlockAttn: a schedule's backward_type must describe its steps: static int "
                "steps(const blockattn::ScheduleContext& c) and static void step(const "
                "blockattn::ScheduleContext& c, int "
                "rank, int s, blockattn::BackwardStep& out)");
  return has_steps<S>::value && has_step<S>::value && has_backward_type<S>::value &&
         has_backward_steps<S>::value && has_backward_step<S>::value;
}

/// check_schedule<S>() for a schedule S (its static_asserts fire when the
/// class is instantiated); true for any other type, whose own message comes
/// from the caller.
template <class S, bool = is_schedule_v<S>>
struct schedule_complete : std::true_type {};
template <class S>
struct schedule_complete<S, true> : std::bool_constant<check_schedule<S>()> {};

/// S::supports<Partition, Mask> for a schedule S; true for any other type.
template <class S, class Partition, class Mask, bool = is_schedule_v<S>>
struct schedule_supports : std::true_type {};
template <class S, class Partition, class Mask>
struct schedule_supports<S, Partition, Mask, true>
    : std::bool_constant<S::template supports<Partition, Mask>> {};

}  // namespace impl

/// Number of steps of a schedule's forward in context c.
template <class Schedule>
int schedule_steps(const ScheduleContext& c) {
  return Schedule::steps(c);
}
/// Same, when no block pair is empty.
template <class Schedule>
int schedule_steps(int P) {
  return Schedule::steps(ScheduleContext{P, {}});
}

/// What `rank` does at `step`.
template <class Schedule>
ForwardStep schedule_step(const ScheduleContext& c, int rank, int step) {
  ForwardStep f;
  Schedule::step(c, rank, step, f);
  return f;
}

/// The task of `rank` at `step` of a schedule, as a block pair.
template <class Schedule>
BlockTask schedule_task(const ScheduleContext& c, int rank, int step) {
  return schedule_step<Schedule>(c, rank, step).task;
}
/// Same, when no block pair is empty.
template <class Schedule>
BlockTask schedule_task(int rank, int step, int P) {
  return schedule_task<Schedule>(ScheduleContext{P, {}}, rank, step);
}

/// Every transfer of a forward over P ranks, once each (as its sender lists it).
template <class Schedule>
std::vector<ScheduledTransfer> schedule_transfers(const ScheduleContext& c) {
  std::vector<ScheduledTransfer> all;
  ForwardStep f;
  const int steps = Schedule::steps(c);
  for (int r = 0; r < c.P; ++r)
    for (int s = 0; s < steps; ++s) {
      f.clear();
      Schedule::step(c, r, s, f);
      for (const auto& t : f.transfers)
        if (t.src == r && t.src_step == s) all.push_back(t);
    }
  return all;
}

/// The buffers `rank` uses over a whole forward (see ForwardSlots).
template <class Schedule>
ForwardSlots forward_slots(const ScheduleContext& c, int rank) {
  ForwardSlots u;
  ForwardStep f;
  const auto grow = [](int& n, int slot) { n = slot + 1 > n ? slot + 1 : n; };
  const int steps = Schedule::steps(c);
  for (int s = 0; s < steps; ++s) {
    f.clear();
    Schedule::step(c, rank, s, f);
    if (!f.task.idle()) {
      grow(u.kv, f.kv_slot);
      grow(u.q, f.q_slot);
      if (f.result_slot >= 0) grow(u.results_out, f.result_slot);
    }
    for (const auto& t : f.transfers) {
      const bool out = t.src == rank && t.src_step == s;
      const int slot = out ? t.src_slot : t.dst_slot;
      if (t.payload == Payload::kv) grow(u.kv, slot);
      if (t.payload == Payload::q) {
        grow(u.q, slot);
        u.q_copy = u.q_copy || (out && slot == 0);
      }
      if (t.payload == Payload::result) {
        if (out)
          grow(u.results_out, slot);
        else {
          grow(u.results_in, slot);
          u.merges = true;
        }
      }
    }
  }
  return u;
}

/// What `rank` does at `step` of a backward description B (a schedule's
/// backward_type).
template <class B>
BackwardStep backward_step(const ScheduleContext& c, int rank, int step) {
  BackwardStep f;
  B::step(c, rank, step, f);
  return f;
}

/// Adds step s of `rank` (its description f) to the buffers u it uses.
inline void add_backward_slots(BackwardSlots& u, const BackwardStep& f, int rank, int s) {
  const auto grow = [](int& n, int slot) { n = slot + 1 > n ? slot + 1 : n; };
  if (!f.task.idle()) {
    grow(u.kv, f.kv_slot);
    grow(u.q, f.q_slot);
    if (f.dq_slot >= 0) grow(u.dq_out, f.dq_slot);
    if (f.dkv_slot >= 0) grow(u.dkv_out, f.dkv_slot);
  }
  for (const auto& t : f.transfers) {
    const bool out = t.src == rank && t.src_step == s;
    const int slot = out ? t.src_slot : t.dst_slot;
    switch (t.payload) {
      case Payload::kv:
        grow(u.kv, slot);
        u.kv_copy = u.kv_copy || slot == 0;
        break;
      case Payload::q:
        grow(u.q, slot);
        break;
      case Payload::dq:
        grow(out ? u.dq_out : u.dq_in, slot);
        if (!out && t.add_to >= 0) grow(u.dq_out, t.add_to);
        break;
      case Payload::dkv:
        grow(out ? u.dkv_out : u.dkv_in, slot);
        if (!out && t.add_to >= 0) grow(u.dkv_out, t.add_to);
        break;
      case Payload::result:
        break;
    }
  }
}

/// The buffers `rank` uses over a whole backward (see BackwardSlots).
template <class B>
BackwardSlots backward_slots(const ScheduleContext& c, int rank) {
  BackwardSlots u;
  BackwardStep f;
  const int steps = B::steps(c);
  for (int s = 0; s < steps; ++s) {
    f.clear();
    B::step(c, rank, s, f);
    add_backward_slots(u, f, rank, s);
  }
  return u;
}

}  // namespace blockattn
