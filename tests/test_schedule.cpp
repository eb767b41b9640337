// SPDX-License-Identifier: Apache-2.0
// Host-only: partitions (maps, inverses, permutations) and the ring's work
// model against the properties the papers state, for P = 2..8.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/schedule/allgather.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

using namespace blockattn;

namespace {

template <class Partition>
void check_partition(index_type N, int P) {
  std::set<index_type> seen;
  for (int r = 0; r < P; ++r) {
    const auto map = Partition::positions(N, P, r);
    for (index_type i = 0; i < local_length<Partition>(N, P, r); ++i) {
      const index_type g = map(i);
      CHECK(g >= 0);
      CHECK(g < N);
      if (i > 0) CHECK(map(i - 1) < g);  // strictly increasing
      const Owner o = Partition::owner(N, P, g);
      CHECK(o.rank == r);
      CHECK(o.local == i);
      seen.insert(g);
    }
  }
  CHECK(index_type(seen.size()) == N);  // a permutation of 0..N-1
}

}  // namespace

TEST_CASE("partitions are permutations with inverse and increasing local order") {
  for (int P = 1; P <= 8; ++P) {
    check_partition<ContiguousPartition>(24 * P, P);
    check_partition<StripedPartition>(24 * P, P);
    check_partition<ZigzagPartition>(24 * P, P);
  }
  // Striped: token t on rank t mod P (Striped Attention (arXiv:2311.09431) Figure 1).
  CHECK(StripedPartition::positions(16, 4, 1)(2) == 9);
  // Zigzag: rank r holds chunks r and 2P - 1 - r.
  CHECK(ZigzagPartition::positions(16, 4, 0)(2) == 14);
}

TEST_CASE("any N over any P: lengths differ by at most one, ranks may hold none") {
  for (int P = 1; P <= 7; ++P)
    for (index_type N = 1; N <= 3 * P + 5; ++N) {
      CAPTURE(P);
      CAPTURE(N);
      check_partition<ContiguousPartition>(N, P);
      check_partition<StripedPartition>(N, P);
      check_partition<ZigzagPartition>(N, P);
      index_type lo = N, hi = 0, zz_lo = N, zz_hi = 0;
      for (int r = 0; r < P; ++r) {
        CHECK(local_length<StripedPartition>(N, P, r) ==
              local_length<ContiguousPartition>(N, P, r));
        const index_type n = local_length<ContiguousPartition>(N, P, r),
                         z = local_length<ZigzagPartition>(N, P, r);
        lo = n < lo ? n : lo;
        hi = n > hi ? n : hi;
        zz_lo = z < zz_lo ? z : zz_lo;
        zz_hi = z > zz_hi ? z : zz_hi;
      }
      CHECK(hi - lo <= 1);
      CHECK(zz_hi - zz_lo <= 1);
      CHECK(hi == (N + P - 1) / P);
      CHECK(max_local_length<ZigzagPartition>(N, P) == hi);
    }
  // N < P: the last ranks hold nothing.
  CHECK(local_length<ContiguousPartition>(3, 5, 3) == 0);
  CHECK(local_length<ZigzagPartition>(3, 5, 4) == 0);
  CHECK_THROWS_AS(require_partitionable<StripedPartition>("t", 0, 4), invalid_argument);
}

/// A partition without length(): N must be a multiple of multiple_of(P).
struct EvenOnly {
  static constexpr const char* name() { return "even-only"; }
  static index_type multiple_of(int P) { return 2 * index_type(P); }
  using position_map = OffsetPositions;
  static position_map positions(index_type N, int P, int rank) { return {rank * (N / P)}; }
  static Owner owner(index_type N, int P, index_type t) {
    return Owner{int(t / (N / P)), t % (N / P)};
  }
};

TEST_CASE("a partition without length() needs N a multiple of what it asks") {
  CHECK_NOTHROW(require_partitionable<EvenOnly>("t", 24, 3));
  CHECK(local_length<EvenOnly>(24, 3, 2) == 8);
  try {
    require_partitionable<EvenOnly>("t", 21, 3);
    FAIL("no exception");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("N must be a positive multiple of 6") != std::string::npos);
  }
  // The built-ins split unevenly for the schedules, evenly only when asked.
  CHECK_NOTHROW(require_partitionable<ZigzagPartition>("t", 21, 3));
  CHECK_THROWS_AS(require_even_partition<ZigzagPartition>("t", 21, 3), invalid_argument);
}

TEST_CASE(
    "contiguous causal ring: from step 1 some ranks skip everything, others do a full block") {
  const int b = 16;  // tile size
  for (int P = 2; P <= 8; ++P) {
    const index_type n = 4 * b, N = n * P;
    const std::int64_t tiles = (n / b) * (n / b);
    for (int s = 1; s < P; ++s) {
      int idle = 0, full = 0;
      for (int r = 0; r < P; ++r) {
        const TileCounts t = ring_step_work<ContiguousPartition>(CausalMask{}, N, P, r, s, b, b);
        if (t.skipped == tiles) ++idle;
        if (t.full == tiles) ++full;
        CHECK((t.skipped == tiles || t.full == tiles));
        CHECK(block_is_empty<ContiguousPartition>(CausalMask{}, N, P, r, ring_source(r, s, P)) ==
              (t.skipped == tiles));
      }
      CHECK(idle == s);      // ranks r < s hold a block from their future
      CHECK(full == P - s);  // the others a block entirely in their past
    }
  }
}

TEST_CASE(
    "striped causal ring: per-step work is Work(i, j) of Striped Attention (arXiv:2311.09431)") {
  // Work(i, j) = c(c+1)/2 if i >= j else c(c-1)/2, c tokens per rank.
  for (int P = 2; P <= 8; ++P) {
    const index_type c = 40, N = c * P;
    for (int s = 0; s < P; ++s)
      for (int r = 0; r < P; ++r) {
        const int j = ring_source(r, s, P);
        const TileCounts t = ring_step_work<StripedPartition>(CausalMask{}, N, P, r, s, 16, 16);
        CHECK(t.allowed_pairs == (r >= j ? c * (c + 1) / 2 : c * (c - 1) / 2));
        // A triangle on every step: no rank is idle, and the tiles above the
        // local diagonal are skipped.
        CHECK_FALSE(block_is_empty<StripedPartition>(CausalMask{}, N, P, r, j));
        CHECK(t.skipped > 0);
        CHECK(t.computed() > 0);
      }
  }
}

TEST_CASE("zigzag causal ring: per-step work is equal across ranks") {
  for (int P = 2; P <= 8; ++P) {
    const index_type chunk = 24, N = 2 * P * chunk;
    for (int s = 0; s < P; ++s) {
      std::set<std::int64_t> pairs;
      for (int r = 0; r < P; ++r)
        pairs.insert(ring_step_work<ZigzagPartition>(CausalMask{}, N, P, r, s, 8, 8).allowed_pairs);
      CHECK(pairs.size() == 1);
      // Off the diagonal step a rank computes exactly half of the block.
      if (s > 0) CHECK(*pairs.begin() == 2 * chunk * chunk);
    }
  }
}

TEST_CASE("the ring's steps together compute every allowed pair once") {
  for (int P = 1; P <= 6; ++P) {
    const index_type N = 12 * P;
    std::int64_t total = 0;
    for (int r = 0; r < P; ++r)
      for (int s = 0; s < P; ++s)
        total += ring_step_work<ZigzagPartition>(SlidingWindowMask{5, 3}, N, P, r, s, 4, 4)
                     .allowed_pairs;
    std::int64_t want = 0;
    for (index_type q = 0; q < N; ++q)
      for (index_type k = 0; k < N; ++k) want += SlidingWindowMask{5, 3}.allowed(q, k);
    CHECK(total == want);
  }
}

TEST_CASE("balanced schedule: every block pair once, the paper's idle fractions") {
  for (int P = 1; P <= 16; ++P) {
    std::vector<int> seen(std::size_t(P) * P, 0);
    int idle = 0;
    for (int t = 0; t < balanced_steps(P); ++t)
      for (int p = 0; p < P; ++p) {
        const BlockTask task = balanced_task(p, t, P);
        if (task.idle()) {
          ++idle;
          continue;
        }
        // A rank works on its own queries or on its own keys.
        CHECK((task.q_rank == p || task.k_rank == p));
        CHECK(task.k_rank <= task.q_rank);
        ++seen[std::size_t(task.q_rank) * P + task.k_rank];
        if (task.q_rank != p) {
          CHECK(balanced_helps(p, t, P) == task.q_rank);
          CHECK(balanced_helper_of(task.q_rank, t, P) == p);
        }
      }
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < P; ++j) CHECK(seen[std::size_t(i) * P + j] == (j <= i ? 1 : 0));
    // DistFlashAttn (arXiv:2310.03294) eq. (2): idle fraction (idle rank-steps over P^2) 0 for
    // odd P, 1 / (2P) for even P; the plain ring's (P^2 - P) / (2 P^2).
    const double balanced = double(idle) / (double(P) * P);
    CHECK(balanced == doctest::Approx(P % 2 ? 0.0 : 1.0 / (2.0 * P)));
    int ring_idle = 0;
    for (int s = 0; s < P; ++s)
      for (int p = 0; p < P; ++p)
        ring_idle += block_is_empty<ContiguousPartition>(CausalMask{}, index_type(P) * 8, P, p,
                                                         ring_source(p, s, P))
                         ? 1
                         : 0;
    CHECK(double(ring_idle) / (double(P) * P) ==
          doctest::Approx((double(P) * P - P) / (2.0 * P * P)));
  }
}

namespace {

/// Runs a schedule's description (blockattn/schedule/schedule.hpp) on paper for P
/// ranks, following what every buffer slot holds, and checks that it is a
/// complete, race-free description: both ends list each transfer alike; every
/// task reads the blocks it names (the K/V of task.k_rank, the queries of
/// task.q_rank) from its slots; no slot is read or sent while a receive into
/// it is in flight; a helper's result goes to the queries' rank; every block
/// pair in `expected` is computed exactly once and nothing else.
template <class Schedule>
void check_description(const ScheduleContext& c, const std::set<std::pair<int, int>>& expected) {
  const int P = c.P;
  INFO(Schedule::name(), " P=", P);
  const int steps = Schedule::steps(c);
  REQUIRE(steps >= 1);
  std::vector<std::vector<ForwardStep>> desc(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r)
    for (int s = 0; s < steps; ++s)
      desc[std::size_t(r)].push_back(schedule_step<Schedule>(c, r, s));
  const auto same = [](const ScheduledTransfer& a, const ScheduledTransfer& b) {
    return a.src == b.src && a.dst == b.dst && a.payload == b.payload && a.src_step == b.src_step &&
           a.dst_step == b.dst_step && a.after_compute == b.after_compute &&
           a.done_step == b.done_step && a.src_slot == b.src_slot && a.dst_slot == b.dst_slot;
  };
  const std::vector<ScheduledTransfer> all = schedule_transfers<Schedule>(c);
  for (const auto& t : all) {
    CHECK(t.src != t.dst);
    CHECK(t.dst >= 0);
    CHECK(t.dst < P);
    CHECK(t.done_step >= t.src_step);
    CHECK(t.done_step >= t.dst_step);
    CHECK(t.done_step <= steps);
    CHECK(t.dst_step < steps);
    if (t.after_compute) CHECK(t.done_step > t.src_step);
    int listed = 0;
    for (const auto& u : desc[std::size_t(t.dst)][std::size_t(t.dst_step)].transfers)
      listed += same(t, u) ? 1 : 0;
    CHECK(listed == 1);  // the receiver lists it at dst_step
  }
  // Every entry a rank lists is a transfer it sends or receives at that step.
  for (int r = 0; r < P; ++r)
    for (int s = 0; s < steps; ++s)
      for (const auto& t : desc[std::size_t(r)][std::size_t(s)].transfers)
        CHECK(((t.src == r && t.src_step == s) || (t.dst == r && t.dst_step == s)));

  // What each slot holds: the rank whose K/V or queries are in it (-1: nothing).
  using Slots = std::map<int, int>;
  std::vector<Slots> kv(static_cast<std::size_t>(P)), q(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) kv[std::size_t(r)][0] = q[std::size_t(r)][0] = r;
  struct Flight {
    ScheduledTransfer t;
    int origin;
  };
  std::vector<Flight> flying;
  std::map<std::pair<int, int>, int> computed;  // block pair -> times
  const auto busy = [&](int rank, Payload p, int slot, int s) {
    for (const auto& f : flying)
      if (f.t.dst == rank && f.t.payload == p && f.t.dst_slot == slot && f.t.dst_step <= s)
        return true;
    return false;
  };
  for (int s = 0; s < steps; ++s) {
    INFO("step ", s);
    for (const auto& t : all)
      if (t.src_step == s && t.payload != Payload::result) {
        auto& held = (t.payload == Payload::kv ? kv : q)[std::size_t(t.src)];
        const auto it = held.find(t.src_slot);
        REQUIRE(it != held.end());  // sends a slot that holds a block
        CHECK_FALSE(busy(t.src, t.payload, t.src_slot, s));
        flying.push_back({t, it->second});
      }
    for (int r = 0; r < P; ++r) {
      const ForwardStep& f = desc[std::size_t(r)][std::size_t(s)];
      if (f.task.idle()) continue;
      INFO("rank ", r, " task (", f.task.q_rank, ", ", f.task.k_rank, ")");
      ++computed[{f.task.q_rank, f.task.k_rank}];
      CHECK(kv[std::size_t(r)].count(f.kv_slot) == 1);
      CHECK(kv[std::size_t(r)][f.kv_slot] == f.task.k_rank);
      CHECK_FALSE(busy(r, Payload::kv, f.kv_slot, s));
      CHECK(q[std::size_t(r)].count(f.q_slot) == 1);
      CHECK(q[std::size_t(r)][f.q_slot] == f.task.q_rank);
      CHECK_FALSE(busy(r, Payload::q, f.q_slot, s));
      if (f.task.q_rank == r) {
        CHECK(f.result_slot == -1);
      } else {
        // A helper: exactly one result transfer to the queries' rank.
        REQUIRE(f.result_slot >= 0);
        int results = 0;
        for (const auto& t : all)
          results += (t.payload == Payload::result && t.src == r && t.src_step == s &&
                      t.after_compute && t.dst == f.task.q_rank && t.src_slot == f.result_slot)
                         ? 1
                         : 0;
        CHECK(results == 1);
      }
    }
    // Arrivals at the end of the step.
    for (auto it = flying.begin(); it != flying.end();)
      if (it->t.done_step == s) {
        (it->t.payload == Payload::kv ? kv : q)[std::size_t(it->t.dst)][it->t.dst_slot] =
            it->origin;
        it = flying.erase(it);
      } else {
        ++it;
      }
  }
  CHECK(flying.empty());  // inputs all arrive within the steps
  for (const auto& entry : computed) {
    // Not a structured binding: INFO captures it in a lambda (C++17 forbids
    // capturing bindings; clang before 16 says so).
    const auto& pair = entry.first;
    INFO("pair (", pair.first, ", ", pair.second, ")");
    CHECK(entry.second == 1);
    CHECK(expected.count(pair) == 1);
  }
  CHECK(computed.size() == expected.size());
}

}  // namespace

TEST_CASE("schedule descriptions: complete, race-free, every block pair once (P = 1..9)") {
  for (int P = 1; P <= 9; ++P) {
    std::set<std::pair<int, int>> every, causal;
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < P; ++j) {
        every.insert({i, j});
        if (j <= i) causal.insert({i, j});
      }
    const ScheduleContext dense{P, {}};
    check_description<RingSchedule>(dense, every);
    check_description<BurstSchedule>(dense, every);
    check_description<BalancedSchedule>(dense, causal);
  }
}

TEST_CASE("schedule descriptions: the buffers each rank uses") {
  // The ring holds two K/V blocks (double buffering); one at P = 1.
  CHECK(forward_slots<RingSchedule>({1, {}}, 0).kv == 1);
  for (int P = 2; P <= 6; ++P)
    for (int r = 0; r < P; ++r) {
      const ForwardSlots u = forward_slots<RingSchedule>({P, {}}, r);
      CHECK(u.kv == 2);
      CHECK(u.q == 1);
      CHECK_FALSE(u.q_copy);
      CHECK(u.results_in + u.results_out == 0);
      CHECK_FALSE(u.merges);
    }
  // Balanced at P = 5: rank 0 never owns a remote block (its own K/V only)
  // but helps rank 3 at step 2 (receives Q in two slots, sends two results);
  // rank 4 owns remote blocks (3 K/V slots) and is helped (q copy, results in).
  const ForwardSlots r0 = forward_slots<BalancedSchedule>({5, {}}, 0);
  CHECK(r0.kv == 1);
  CHECK(r0.q == 3);
  CHECK(r0.results_out == 2);
  CHECK_FALSE(r0.merges);
  const ForwardSlots r4 = forward_slots<BalancedSchedule>({5, {}}, 4);
  CHECK(r4.kv == 3);
  CHECK(r4.q_copy);
  CHECK(r4.merges);
  CHECK(r4.results_in == 2);
}

namespace {

/// Runs a backward description (a schedule's backward_type) on paper, like
/// check_description: both ends list each transfer alike; tasks read the
/// blocks they name from slots no receive is writing; partial gradients are
/// followed as the lists of block pairs they sum, and in the end every rank's
/// dQ holds each expected pair of its queries exactly once, its dK and dV
/// each pair of its keys exactly once.
template <class B>
void check_backward_description(const ScheduleContext& c,
                                const std::set<std::pair<int, int>>& expected) {
  const int P = c.P;
  INFO(B::name(), " P=", P);
  using Pair = std::pair<int, int>;
  using Sum = std::vector<Pair>;
  const int steps = B::steps(c);
  std::vector<std::vector<BackwardStep>> desc(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r)
    for (int s = 0; s < steps; ++s) desc[std::size_t(r)].push_back(backward_step<B>(c, r, s));
  std::vector<ScheduledTransfer> all;
  for (int r = 0; r < P; ++r)
    for (int s = 0; s < steps; ++s)
      for (const auto& t : desc[std::size_t(r)][std::size_t(s)].transfers) {
        CHECK(((t.src == r && t.src_step == s) || (t.dst == r && t.dst_step == s)));
        if (t.src == r && t.src_step == s) all.push_back(t);
      }
  for (const auto& t : all) {
    CHECK(t.src != t.dst);
    CHECK(t.done_step <= steps);
    CHECK(t.done_step >= t.dst_step);
    // A transfer posted after a compute completes at a later step: the
    // receiver waits for it only after the sender could post it.
    if (t.after_compute)
      CHECK(t.done_step > t.src_step);
    else
      CHECK(t.done_step >= t.src_step);
    int listed = 0;
    for (const auto& u : desc[std::size_t(t.dst)][std::size_t(t.dst_step)].transfers)
      listed +=
          (u.src == t.src && u.dst == t.dst && u.payload == t.payload && u.src_step == t.src_step &&
           u.after_compute == t.after_compute && u.done_step == t.done_step &&
           u.src_slot == t.src_slot && u.dst_slot == t.dst_slot && u.add_to == t.add_to)
              ? 1
              : 0;
    CHECK(listed == 1);
  }
  struct Rank {
    std::map<int, int> kv, q;            // slot -> whose block
    std::map<int, Sum> dq_out, dkv_out;  // partial slots
    std::map<int, Sum> dq_in, dkv_in;    // receive slots
    Sum dq, dkv;                         // own gradients
  };
  std::vector<Rank> rk(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) rk[std::size_t(r)].kv[0] = rk[std::size_t(r)].q[0] = r;
  struct Flight {
    ScheduledTransfer t;
    int origin;
    Sum sum;
  };
  std::vector<Flight> flying;
  // A receive into `slot` of `rank` in flight (K/V, Q: the slot; partials:
  // the receive slot), or a send from it (K/V, Q: the slot; partials: the
  // partial slot).
  const auto receiving = [&](int rank, Payload p, int slot) {
    for (const auto& f : flying)
      if (f.t.payload == p && f.t.dst == rank && f.t.dst_slot == slot) return true;
    return false;
  };
  const auto sending = [&](int rank, Payload p, int slot) {
    for (const auto& f : flying)
      if (f.t.payload == p && f.t.src == rank && f.t.src_slot == slot) return true;
    return false;
  };
  const auto send = [&](const ScheduledTransfer& t) {
    Rank& src = rk[std::size_t(t.src)];
    Flight f{t, -1, {}};
    if (t.payload == Payload::kv || t.payload == Payload::q) {
      auto& held = t.payload == Payload::kv ? src.kv : src.q;
      REQUIRE(held.count(t.src_slot) == 1);
      f.origin = held[t.src_slot];
    } else {
      auto& held = t.payload == Payload::dq ? src.dq_out : src.dkv_out;
      REQUIRE(held.count(t.src_slot) == 1);
      f.sum = held[t.src_slot];
    }
    CHECK_FALSE(receiving(t.dst, t.payload, t.dst_slot));  // one receive per slot at a time
    if (t.payload == Payload::kv || t.payload == Payload::q)
      CHECK_FALSE(sending(t.dst, t.payload, t.dst_slot));  // not into a slot being sent
    flying.push_back(f);
  };
  const auto complete = [&](int s) {
    for (auto it = flying.begin(); it != flying.end();) {
      if (it->t.done_step != s) {
        ++it;
        continue;
      }
      Rank& dst = rk[std::size_t(it->t.dst)];
      const Payload p = it->t.payload;
      if (p == Payload::kv) dst.kv[it->t.dst_slot] = it->origin;
      if (p == Payload::q) dst.q[it->t.dst_slot] = it->origin;
      if (p == Payload::dq || p == Payload::dkv) {
        Sum& target = it->t.add_to >= 0
                          ? (p == Payload::dq ? dst.dq_out : dst.dkv_out)[it->t.add_to]
                          : (p == Payload::dq ? dst.dq : dst.dkv);
        target.insert(target.end(), it->sum.begin(), it->sum.end());
      }
      it = flying.erase(it);
    }
  };
  for (int s = 0; s < steps; ++s) {
    INFO("step ", s);
    for (const auto& t : all)
      if (t.src_step == s && !t.after_compute) send(t);
    for (int r = 0; r < P; ++r) {
      const BackwardStep& f = desc[std::size_t(r)][std::size_t(s)];
      if (f.task.idle()) continue;
      INFO("rank ", r, " task (", f.task.q_rank, ", ", f.task.k_rank, ")");
      Rank& me = rk[std::size_t(r)];
      CHECK(me.kv.count(f.kv_slot) == 1);
      CHECK(me.kv[f.kv_slot] == f.task.k_rank);
      CHECK_FALSE(receiving(r, Payload::kv, f.kv_slot));
      CHECK(me.q.count(f.q_slot) == 1);
      CHECK(me.q[f.q_slot] == f.task.q_rank);
      CHECK_FALSE(receiving(r, Payload::q, f.q_slot));
      const Pair pair{f.task.q_rank, f.task.k_rank};
      if (f.dq_slot >= 0) {
        CHECK_FALSE(sending(r, Payload::dq, f.dq_slot));  // not written while sent
        me.dq_out[f.dq_slot] = {pair};
      } else {
        CHECK(f.task.q_rank == r);
        me.dq.push_back(pair);
      }
      if (f.dkv_slot >= 0) {
        CHECK_FALSE(sending(r, Payload::dkv, f.dkv_slot));
        me.dkv_out[f.dkv_slot] = {pair};
      } else {
        CHECK(f.task.k_rank == r);
        me.dkv.push_back(pair);
      }
    }
    complete(s);
    for (const auto& t : all)
      if (t.src_step == s && t.after_compute) send(t);
  }
  complete(steps);
  CHECK(flying.empty());
  for (int r = 0; r < P; ++r) {
    INFO("rank ", r);
    Sum want_dq, want_dkv;
    for (const Pair& p : expected) {
      if (p.first == r) want_dq.push_back(p);
      if (p.second == r) want_dkv.push_back(p);
    }
    Sum got_dq = rk[std::size_t(r)].dq, got_dkv = rk[std::size_t(r)].dkv;
    std::sort(got_dq.begin(), got_dq.end());
    std::sort(got_dkv.begin(), got_dkv.end());
    std::sort(want_dq.begin(), want_dq.end());
    std::sort(want_dkv.begin(), want_dkv.end());
    CHECK(got_dq == want_dq);
    CHECK(got_dkv == want_dkv);
  }
}

}  // namespace

TEST_CASE("backward descriptions: race-free, every partial gradient home exactly once (P = 1..9)") {
  for (int P = 1; P <= 9; ++P) {
    std::set<std::pair<int, int>> every, causal;
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < P; ++j) {
        every.insert({i, j});
        if (j <= i) causal.insert({i, j});
      }
    const ScheduleContext dense{P, {}};
    check_backward_description<KVRingBackward>(dense, every);
    check_backward_description<QRingBackward>(dense, every);
    check_backward_description<BalancedBackward>(dense, causal);
  }
}

TEST_CASE("the rings stop at the mask's reach: fewer steps and hops, race-free (P = 1..9)") {
  for (int P = 1; P <= 9; ++P) {
    const ScheduleContext causal{P, [](int q, int k) { return k > q; }};
    const ScheduleContext band{P, [](int q, int k) { return q - k > 1 || k > q; }};
    const ScheduleContext diagonal{P, [](int q, int k) { return q != k; }};
    // Reaches further than its neighbour only through the wrap-around pair (0, P - 1).
    const ScheduleContext wrap{P,
                               [P](int q, int k) { return !(q == k || (q == 0 && k == P - 1)); }};
    CHECK(causal.ring_reach() == P - 1);
    CHECK(band.ring_reach() == (P > 1 ? 1 : 0));
    CHECK(diagonal.ring_reach() == 0);
    CHECK(wrap.ring_reach() == (P > 1 ? 1 : 0));
    for (const ScheduleContext* c : {&causal, &band, &diagonal, &wrap}) {
      const int S = c->ring_reach() + 1;
      INFO("P = ", P, " reach ", S - 1);
      std::set<std::pair<int, int>> scheduled;  // distance < S: every pair the mask leaves
      for (int x = 0; x < P; ++x)
        for (int d = 0; d < S; ++d) scheduled.insert({x, ring_source(x, d, P)});
      for (int i = 0; i < P; ++i)
        for (int j = 0; j < P; ++j)
          if (!c->empty(i, j)) CHECK(scheduled.count({i, j}) == 1);
      check_description<RingSchedule>(*c, scheduled);
      check_description<BurstSchedule>(*c, scheduled);
      check_backward_description<KVRingBackward>(*c, scheduled);
      check_backward_description<QRingBackward>(*c, scheduled);
      CHECK(schedule_steps<RingSchedule>(*c) == S);
      CHECK(schedule_steps<AllGatherSchedule>(*c) == S);
      // Each rank sends its K/V block S - 1 hops on (none when S = 1).
      int kv = 0;
      for (const auto& t : schedule_transfers<RingSchedule>(*c)) kv += t.payload == Payload::kv;
      CHECK(kv == P * (S - 1));
      // Two K/V slots while the ring moves, one when it does not.
      for (int r = 0; r < P; ++r) CHECK(forward_slots<RingSchedule>(*c, r).kv == (S > 1 ? 2 : 1));
    }
  }
}

TEST_CASE("all-gather description: only the block pairs the mask reaches, race-free (P = 1..9)") {
  for (int P = 1; P <= 9; ++P) {
    const ScheduleContext dense{P, {}};
    const ScheduleContext causal{P, [](int q, int k) { return k > q; }};
    const ScheduleContext band{P, [](int q, int k) { return q - k > 1 || k > q; }};
    std::set<std::pair<int, int>> every, lower, near;
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < P; ++j) {
        every.insert({i, j});
        if (j <= i) lower.insert({i, j});
        if (j <= i && i - j <= 1) near.insert({i, j});
      }
    check_description<AllGatherSchedule>(dense, every);
    check_description<AllGatherSchedule>(causal, lower);
    check_description<AllGatherSchedule>(band, near);
    check_backward_description<AllGatherSchedule::backward_type>(dense, every);
    check_backward_description<AllGatherSchedule::backward_type>(causal, lower);
    check_backward_description<AllGatherSchedule::backward_type>(band, near);
    // Memory: every block the rank needs at once (the all-gather's price).
    for (int r = 0; r < P; ++r) {
      CHECK(forward_slots<AllGatherSchedule>(dense, r).kv == P);
      CHECK(forward_slots<AllGatherSchedule>(causal, r).kv == r + 1);
      CHECK(forward_slots<AllGatherSchedule>(band, r).kv == (r > 0 ? 2 : 1));
    }
  }
}
