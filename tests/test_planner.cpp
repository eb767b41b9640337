// SPDX-License-Identifier: Apache-2.0
// The planner reproduces the papers' numbers (published values, stated
// tolerances) and its own invariants.
#include <doctest/doctest.h>

#include <blockattn/plan/balance.hpp>
#include <blockattn/plan/decode.hpp>
#include <blockattn/plan/planner.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

using namespace blockattn;

namespace {

/// A machine where one c x c block (one tile) costs 1 s and links are free.
plan::Problem block_problem(int P, int c) {
  plan::Problem p;
  p.N = index_type(P) * c;
  p.P = P;
  p.dim = 1;
  p.block_q = p.block_k = c;
  return p;
}
plan::Hardware unit_machine(int c) {
  plan::Hardware hw;
  hw.flops = 4.0 * c * c;  // 4 D c^2 FLOPs of a block (D = 1) per second
  hw.bandwidth = 0;        // free communication
  return hw;
}

}  // namespace

TEST_CASE(
    "Ring Attention (arXiv:2310.01889) Table 2: minimal block size c = F/B and sequence length "
    "6c") {
  // Published: (minimal block size, minimal sequence length), both x 1e3,
  // printed with one decimal. Tolerance: 1 % or half a unit of the printed
  // digit, whichever is larger (the paper's 24.8 for F/B = 24.96 is 0.6 % off).
  struct Row {
    plan::Hardware hw;
    double c, s;
  };
  const Row rows[] = {{plan::a100_nvlink(), 1.0, 6.2},
                      {plan::a100_infiniband(), 24.8, 149.6},
                      {plan::tpu_v3(), 1.1, 6.6},
                      {plan::tpu_v4(), 1.0, 6.2},
                      {plan::tpu_v5e(), 1.1, 6.3}};
  for (const Row& r : rows) {
    const double c = plan::overlap_block_size(r.hw) / 1e3;  // bf16, heads = kv heads
    const double s = plan::ring_min_sequence(r.hw) / 1e3;
    INFO(r.hw.name, ": c = ", c, "e3 (paper ", r.c, "e3), s = ", s, "e3 (paper ", r.s, "e3)");
    CHECK(std::abs(c - r.c) <= std::max(0.05, 0.01 * r.c));
    CHECK(std::abs(s - r.s) <= std::max(0.05, 0.01 * r.s));
  }
}

TEST_CASE(
    "Ring Attention (arXiv:2310.01889) §3: the simulated ring hides transfers exactly from c = F/B "
    "on") {
  // Full mask, bf16, one head, tile = block: above c_min the makespan is the
  // compute of P blocks; below, the transfers show.
  plan::Hardware hw = plan::a100_infiniband();
  const double c_min = plan::overlap_block_size(hw);
  for (double f : {0.5, 0.9, 1.1, 2.0}) {
    const int c = int(std::lround(f * c_min / 128.0)) * 128;
    plan::Problem p;
    p.P = 4;
    p.N = index_type(p.P) * c;
    p.dim = 128;
    p.dtype_bytes = 2;
    p.block_q = p.block_k = c;
    const auto pr = plan::predict<ContiguousPartition, RingSchedule>(p, FullMask{}, hw);
    const double compute = p.P * 4.0 * c * double(c) * p.dim / hw.flops;
    INFO("c = ", c, " = ", f, " c_min: makespan / compute = ", pr.makespan_s / compute);
    if (f > 1)
      CHECK(pr.makespan_s == doctest::Approx(compute).epsilon(1e-12));
    else
      CHECK(pr.makespan_s > 1.05 * compute);
  }
}

TEST_CASE("DistFlashAttn (arXiv:2310.03294) §4.6: 8 workers, work 36 of 64, speedup 4.5x vs 7.2x") {
  // One tile per block, every computed tile 1 unit (the paper counts the
  // diagonal block as a whole unit).
  const int P = 8, c = 256;
  const plan::Problem p = block_problem(P, c);
  const plan::Hardware hw = unit_machine(c);
  const auto ring = plan::predict<ContiguousPartition, RingSchedule>(p, CausalMask{}, hw);
  const auto bal = plan::predict<ContiguousPartition, BalancedSchedule>(p, CausalMask{}, hw);
  std::int64_t work = 0;
  for (const auto& r : ring.ranks)
    for (const auto& s : r.steps) work += s.tiles.computed();
  CHECK(work == 36);  // of P * P = 64 slots
  CHECK(ring.single_device_s == doctest::Approx(36.0));
  CHECK(ring.makespan_s == doctest::Approx(8.0));
  CHECK(ring.speedup_over_single() == doctest::Approx(4.5));
  CHECK(bal.makespan_s == doctest::Approx(5.0));
  CHECK(bal.speedup_over_single() == doctest::Approx(7.2));
  // Idle fractions, eq. (2) and §3.2: (P^2 - P) / (2 P^2) for the ring, 1 / (2P) balanced.
  CHECK(ring.idle_step_fraction() == doctest::Approx((P * P - P) / (2.0 * P * P)));
  CHECK(bal.idle_step_fraction() == doctest::Approx(1.0 / (2 * P)));
  // Odd P: no idle rank-step at all.
  const auto bal7 =
      plan::predict<ContiguousPartition, BalancedSchedule>(block_problem(7, c), CausalMask{}, hw);
  CHECK(bal7.idle_steps() == 0);
  CHECK(bal7.makespan_s == doctest::Approx(4.0));  // 28 units on 7 ranks
}

TEST_CASE(
    "Striped Attention (arXiv:2311.09431) §2.3: workloads c(c+1)/2 and c(c-1)/2, speedup below 2") {
  // Tiles of one token: tiles = pairs.
  for (int P : {2, 3, 4, 8})
    for (int c : {1, 2, 5, 16}) {
      plan::Problem p = block_problem(P, c);
      p.block_q = p.block_k = 1;
      const auto st =
          plan::predict<StripedPartition, RingSchedule>(p, CausalMask{}, unit_machine(1));
      for (int i = 0; i < P; ++i)
        for (int s = 0; s < P; ++s) {
          const int j = st.ranks[std::size_t(i)].steps[std::size_t(s)].task.k_rank;
          const std::int64_t want = i >= j ? c * (c + 1) / 2 : c * (c - 1) / 2;
          CHECK(st.ranks[std::size_t(i)].steps[std::size_t(s)].tiles.full == want);
        }
    }
  // Speedup of striped over the contiguous ring: increases with the block
  // size, stays below 2, and approaches 2 for many devices and large blocks.
  for (int P : {2, 4, 8, 64}) {
    double last = 0;
    for (int c : {1, 4, 16, 64}) {
      plan::Problem p = block_problem(P, c);
      p.block_q = p.block_k = 1;
      const auto all = plan::compare(p, CausalMask{}, unit_machine(1));
      const double sp = all[1].speedup_over_ring();
      INFO("P = ", P, " c = ", c, " striped speedup ", sp);
      CHECK(all[1].schedule == std::string("ring"));
      CHECK(all[1].partition == std::string("striped"));
      // Closed form: (c(c+1)/2 + (P-1) c^2) / (P c(c+1)/2).
      CHECK(sp ==
            doctest::Approx((c * (c + 1) / 2.0 + (P - 1.0) * c * c) / (P * c * (c + 1) / 2.0)));
      CHECK(sp < 2.0);
      CHECK(sp > last);
      last = sp;
    }
  }
  // §3.2 with tiles: 2048 x 2048 tiles in a 4096-token block skip 1 tile of 4.
  plan::Problem p;
  p.P = 8;
  p.N = 8 * 4096;
  p.block_q = p.block_k = 2048;
  const auto st = plan::predict<StripedPartition, RingSchedule>(p, CausalMask{}, unit_machine(1));
  for (const auto& r : st.ranks)
    for (const auto& s : r.steps) {
      CHECK(s.tiles.total() == 4);
      CHECK(s.tiles.skipped == 1);
    }
}

TEST_CASE("planner: the backward and the training step on the same unit machine") {
  // The backward's tiles priced at 10 D FLOPs per pair: backward_flops = 10 c^2
  // makes a backward tile 1 s as well; the same 36 of 64 block pairs as the
  // forward; with free links the ring and the balanced schedule take 8 and 5
  // steps (the partial gradients travel for free).
  const int P = 8, c = 256;
  plan::Problem p = block_problem(P, c);
  plan::Hardware hw = unit_machine(c);
  hw.backward_flops = 10.0 * c * c;
  p.pass = plan::Pass::backward;
  const auto ring = plan::predict<ContiguousPartition, RingSchedule>(p, CausalMask{}, hw);
  const auto burst = plan::predict<ContiguousPartition, BurstSchedule>(p, CausalMask{}, hw);
  const auto bal = plan::predict<ContiguousPartition, BalancedSchedule>(p, CausalMask{}, hw);
  REQUIRE(ring.valid);
  REQUIRE(bal.valid);
  std::int64_t work = 0;
  for (const auto& r : ring.ranks)
    for (const auto& s : r.steps) work += s.tiles.computed();
  CHECK(work == 36);
  CHECK(ring.single_device_s == doctest::Approx(36.0));
  CHECK(ring.makespan_s == doctest::Approx(8.0));
  CHECK(burst.makespan_s == doctest::Approx(8.0));
  CHECK(bal.makespan_s == doctest::Approx(5.0));
  CHECK(bal.speedup_over_single() == doctest::Approx(7.2));
  // A step's FLOPs: 10 D per pair of its computed tiles.
  CHECK(ring.ranks[7].steps[0].flops == doctest::Approx(10.0 * c * c));
  // Training: the forward, then the backward.
  p.pass = plan::Pass::training;
  const auto ring_t = plan::predict<ContiguousPartition, RingSchedule>(p, CausalMask{}, hw);
  const auto bal_t = plan::predict<ContiguousPartition, BalancedSchedule>(p, CausalMask{}, hw);
  CHECK(ring_t.makespan_s == doctest::Approx(16.0));
  CHECK(bal_t.makespan_s == doctest::Approx(10.0));
  CHECK(ring_t.single_device_s == doctest::Approx(72.0));
  CHECK(ring_t.steps() == 16);
  CHECK(ring_t.ranks[3].steps[8].start_s == doctest::Approx(8.0));  // the backward's first step
  // Without a backward rate the backward runs at the forward's FLOP rate: 2.5x its time.
  hw.backward_flops = 0;
  p.pass = plan::Pass::backward;
  CHECK(plan::predict<ContiguousPartition, RingSchedule>(p, CausalMask{}, hw).makespan_s ==
        doctest::Approx(20.0));
}

TEST_CASE("planner: the backward's bytes per rank, and the link-bound rings") {
  // P = 16 (more ranks than the multi-rank tests run): the KV ring sends P - 1
  // K/V blocks (storage type) and P dK/dV partials (the last one home, compute
  // type); the Q ring P - 1 packed query blocks and P dQ partials.
  const int P = 16;
  plan::Problem p;
  p.N = index_type(P) * 1000;
  p.P = P;
  p.heads = 8;
  p.kv_heads = 2;
  p.dim = 96;
  p.dtype_bytes = 2;
  p.compute_bytes = 4;
  p.block_q = p.block_k = 64;
  p.bwd_block_q = 32;
  p.bwd_block_k = 64;
  p.bwd_dim_padded = 96;
  p.pass = plan::Pass::backward;
  plan::Hardware hw;
  hw.flops = 1e30;  // compute takes no time
  hw.bandwidth = 1e9;
  const std::int64_t n = 1000, kv = 2 * n * 2 * 96 * 2, dkv = 2 * n * 2 * 96 * 4;
  const std::int64_t rows = 8 * 1024;  // 1000 queries padded to 32-row tiles, 8 heads
  const std::int64_t qb = 2 * rows * 96 * 2 + 2 * rows * 4, dq = n * 8 * 96 * 4;
  const auto ring = plan::predict<ZigzagPartition, RingSchedule>(p, FullMask{}, hw);
  const auto burst = plan::predict<ZigzagPartition, BurstSchedule>(p, FullMask{}, hw);
  REQUIRE(ring.valid);
  REQUIRE(burst.valid);
  for (int r = 0; r < P; ++r) {
    CHECK(ring.ranks[std::size_t(r)].bytes_sent() == (P - 1) * kv + P * dkv);
    CHECK(burst.ranks[std::size_t(r)].bytes_sent() == (P - 1) * qb + P * dq);
  }
  // Link-bound: a step's block and the previous step's partial share the
  // link; the last partial goes home after the loop.
  CHECK(ring.makespan_s == doctest::Approx(((P - 1) * (kv + dkv) + dkv) / 1e9));
  CHECK(burst.makespan_s == doctest::Approx(((P - 1) * (qb + dq) + dq) / 1e9));
  // A training step moves both passes' bytes; Ulysses' backward its all-to-alls.
  p.pass = plan::Pass::training;
  const auto both = plan::predict<ZigzagPartition, RingSchedule>(p, FullMask{}, hw);
  const std::int64_t packed_kv = 2 * 1024 * 2 * 96 * 2;  // the forward's block, keys padded to 64
  CHECK(both.ranks[0].bytes_sent() == ring.ranks[0].bytes_sent() + (P - 1) * packed_kv);
  CHECK(both.peak_bytes() == ring.peak_bytes());  // the backward holds more
}

namespace {
/// The KV ring under another name: predict_backward() treats it as a
/// description of the user's (it keeps the history of step starts).
struct UsersRing : RingSchedule {};
}  // namespace

TEST_CASE("planner: the backward model's shortcuts equal the descriptions") {
  // The all-gather's steps without its O(s) slot() equal its description
  // (every field but a send's receiver slot, which no count reads), and
  // give the same buffers.
  for (int P : {1, 2, 3, 5, 8}) {
    const index_type N = index_type(P) * 96 + 5;
    for (int m = 0; m < 3; ++m) {
      const auto win = causal_window(40);
      const ScheduleContext c = m == 0   ? schedule_context<ContiguousPartition>(CausalMask{}, N, P)
                                : m == 1 ? schedule_context<ContiguousPartition>(win, N, P)
                                         : schedule_context<ZigzagPartition>(FullMask{}, N, P);
      for (int r = 0; r < P; ++r) {
        int used = 0;
        BackwardSlots a, b;
        for (int s = 0; s < AllGatherSchedule::Backward::steps(c); ++s) {
          BackwardStep x, y;
          AllGatherSchedule::Backward::step(c, r, s, x);
          plan::detail::allgather_backward_step(c, r, s, used, y);
          INFO("P ", P, " mask ", m, " rank ", r, " step ", s);
          CHECK(x.task.q_rank == y.task.q_rank);
          CHECK(x.task.k_rank == y.task.k_rank);
          CHECK(x.kv_slot == y.kv_slot);
          CHECK(x.dkv_slot == y.dkv_slot);
          REQUIRE(x.transfers.size() == y.transfers.size());
          for (std::size_t i = 0; i < x.transfers.size(); ++i) {
            const auto &t = x.transfers[i], &u = y.transfers[i];
            CHECK(t.src == u.src);
            CHECK(t.dst == u.dst);
            CHECK(t.payload == u.payload);
            CHECK(t.src_step == u.src_step);
            CHECK(t.dst_step == u.dst_step);
            CHECK(t.after_compute == u.after_compute);
            CHECK(t.done_step == u.done_step);
            CHECK(t.src_slot == u.src_slot);
            if (t.dst == r) CHECK(t.dst_slot == u.dst_slot);
            CHECK(t.add_to == u.add_to);
          }
          add_backward_slots(a, x, r, s);
          add_backward_slots(b, y, r, s);
        }
        CHECK(a.kv == b.kv);
        CHECK(a.kv_copy == b.kv_copy);
        CHECK(a.dkv_out == b.dkv_out);
        CHECK(a.dkv_in == b.dkv_in);
      }
    }
  }
  // The built-in rings need no history of step starts: a user's copy of the
  // ring (which keeps it) times every step the same, link- and compute-bound.
  for (double bw : {1e6, 1e12}) {
    plan::Problem p = block_problem(6, 64);
    p.N += 7;
    p.pass = plan::Pass::backward;
    plan::Hardware hw = unit_machine(64);
    hw.bandwidth = bw;
    hw.latency = 1e-3;
    const auto a = plan::predict<ZigzagPartition, RingSchedule>(p, CausalMask{}, hw);
    const auto b = plan::predict<ZigzagPartition, UsersRing>(p, CausalMask{}, hw);
    REQUIRE(a.valid);
    REQUIRE(b.valid);
    CHECK(a.makespan_s == b.makespan_s);
    for (std::size_t r = 0; r < a.ranks.size(); ++r)
      for (std::size_t s = 0; s < a.ranks[r].steps.size(); ++s) {
        CHECK(a.ranks[r].steps[s].start_s == b.ranks[r].steps[s].start_s);
        CHECK(a.ranks[r].steps[s].end_s == b.ranks[r].steps[s].end_s);
      }
  }
}

TEST_CASE("planner: balanced beats the ring for causal, recommendation respects memory") {
  plan::Problem p =
      plan::problem_for<float, Kokkos::DefaultHostExecutionSpace>(65536, 8, 1, 8, 8, 128);
  plan::Hardware hw = plan::a100_nvlink();
  auto all = plan::compare(p, CausalMask{}, hw);
  REQUIRE(all.size() == 6);
  CHECK(all[4].schedule == std::string("all-gather"));
  CHECK(all[4].partition == std::string("zigzag"));
  CHECK(all[5].schedule == std::string("ulysses"));
  for (const auto& x : all) CHECK(x.valid);
  // Contiguous ring is the slowest; the others are within a few % of each other.
  for (std::size_t i = 1; i < all.size(); ++i) CHECK(all[i].speedup_over_ring() > 1.5);
  const int best = plan::recommend(all);
  REQUIRE(best > 0);
  // The balanced schedule needs more workspace; with memory for the ring's
  // peak only, it is never recommended.
  CHECK(all[3].peak_bytes() > all[0].peak_bytes());
  // The all-gather holds every K/V block (P of them; the ring 2), and sends
  // what the zigzag ring sends: its block to every other rank once.
  CHECK(all[4].peak_bytes() > all[3].peak_bytes());
  CHECK(all[4].max_bytes_sent() == all[2].max_bytes_sent());
  hw.memory_bytes = double(all[0].peak_bytes());
  all = plan::compare(p, CausalMask{}, hw);
  const int best2 = plan::recommend(all);
  REQUIRE(best2 >= 0);
  CHECK(all[std::size_t(best2)].schedule == std::string("ring"));
  CHECK_FALSE(all[3].fits);
  CHECK_FALSE(all[4].fits);
  CHECK_FALSE(all[5].fits);
  // Nothing fits in too little memory.
  hw.memory_bytes = 1;
  CHECK(plan::recommend(plan::compare(p, CausalMask{}, hw)) == -1);
  // Full mask: no balanced candidate, and every partition does the same work.
  const auto full = plan::compare(p, FullMask{}, plan::a100_nvlink());
  CHECK(full.size() == 5);
  for (std::size_t i = 0; i < 3; ++i)
    CHECK(full[i].makespan_s == doctest::Approx(full[0].makespan_s));
  // The all-gather computes the same tiles (its order differs).
  auto total_flops = [](const plan::Prediction& x) {
    double f = 0;
    for (const auto& r : x.ranks)
      for (const auto& st : r.steps) f += st.flops;
    return f;
  };
  CHECK(total_flops(full[3]) == doctest::Approx(total_flops(full[0])));
  // Any N: 8 * 1001 + 3 tokens over 8 ranks, 1001 or 1002 each; the buffers
  // that travel hold the longest rank's 1002.
  plan::Problem odd = p;
  odd.N = 8 * 1001 + 3;
  const auto uneven = plan::compare(odd, CausalMask{}, plan::a100_nvlink());
  REQUIRE(uneven.size() == 6);
  for (const auto& x : uneven) CHECK(x.valid);  // rings, balanced, all-gather, Ulysses
  // Inputs (q, k, v, o) and LSE of the longest rank: 1002 rows.
  const std::int64_t rows = std::int64_t(odd.batch) * 1002;
  CHECK(uneven[2].ranks[0].input_bytes ==
        rows * (2 * odd.heads + 2 * odd.kv_heads) * odd.dim * odd.dtype_bytes +
            rows * odd.heads * odd.accumulator_bytes());
  // The work is that of each rank's own tokens: together every allowed pair once.
  const auto zz =
      plan::predict<ZigzagPartition, RingSchedule>(odd, CausalMask{}, plan::a100_nvlink(), true);
  std::int64_t pairs = 0;
  for (const auto& r : zz.ranks)
    for (const auto& st : r.steps) pairs += st.tiles.allowed_pairs;
  CHECK(pairs == odd.N * (odd.N + 1) / 2);
}

TEST_CASE("planner: Ulysses (head-parallel all-to-all)") {
  // 8 heads over 8 ranks: one head each, the whole sequence per rank.
  plan::Problem p =
      plan::problem_for<float, Kokkos::DefaultHostExecutionSpace>(65536, 8, 1, 8, 8, 128);
  const plan::Hardware hw = plan::a100_nvlink();
  const auto all = plan::compare(p, CausalMask{}, hw);
  const plan::Prediction& u = all.back();
  REQUIRE(u.schedule == std::string("ulysses"));
  REQUIRE(u.valid);
  // Every rank the same work: total / P, so no idle time beyond the all-to-alls.
  for (const auto& r : u.ranks) {
    REQUIRE(r.steps.size() == 1);
    CHECK(r.steps[0].flops == doctest::Approx(u.ranks[0].steps[0].flops));
  }
  CHECK(u.makespan_s > u.single_device_s / 8);
  // It moves Q, K, V, O once ((P-1)/P of 4 blocks), the zigzag ring K and V
  // P-1 times: 2 (P-1) blocks against 4 (P-1)/P.
  const double block = double(p.local()) * p.heads * p.dim * p.dtype_bytes;
  CHECK(double(u.max_bytes_sent()) ==
        doctest::Approx(4 * block * 7 / 8 + double(p.local()) * p.heads * 7 / 8 * 4));
  CHECK(u.max_bytes_sent() < all[2].max_bytes_sent() / 3);
  // Heads that P does not divide, and K/V groups that cut across ranks: invalid.
  plan::Problem q = p;
  q.heads = q.kv_heads = 12;
  CHECK_FALSE(plan::predict_ulysses<ContiguousPartition>(q, CausalMask{}, hw).valid);
  q.heads = 24;
  q.kv_heads = 2;
  q.P = 8;  // 3 heads per rank, K/V groups of 12: valid (replicated)
  CHECK(plan::predict_ulysses<ContiguousPartition>(q, CausalMask{}, hw).valid);
  q.kv_heads = 4;  // groups of 6, 3 heads per rank: valid
  CHECK(plan::predict_ulysses<ContiguousPartition>(q, CausalMask{}, hw).valid);
  q.kv_heads = 3;  // groups of 8 against 3 per rank: neither divides
  const auto bad = plan::predict_ulysses<ContiguousPartition>(q, CausalMask{}, hw);
  CHECK_FALSE(bad.valid);
  CHECK(bad.why_not.find("kv heads") != std::string::npos);
}

TEST_CASE("planner: two link levels and the 2D hybrid") {
  plan::Problem p =
      plan::problem_for<float, Kokkos::DefaultHostExecutionSpace>(65536, 16, 1, 32, 8, 128);
  plan::Hardware hw = plan::h100_cluster();  // 8 ranks per node
  CHECK(hw.same_node(0, 7));
  CHECK_FALSE(hw.same_node(7, 8));
  CHECK(hw.transfer_seconds(0, 1, 450e9) == doctest::Approx(1.0));
  CHECK(hw.transfer_seconds(0, 8, 50e9) == doctest::Approx(1.0));

  // The grid's two ends are the other schedules: P_a = 1 is the ring on P
  // ranks, P_a = P is Ulysses over a contiguous split (same bytes and time).
  const auto ring = plan::predict<ZigzagPartition, RingSchedule>(p, CausalMask{}, hw);
  const auto h1 = plan::predict_hybrid<ZigzagPartition, RingSchedule>(p, CausalMask{}, hw, 1);
  REQUIRE(h1.valid);
  CHECK(h1.makespan_s == doctest::Approx(ring.makespan_s));
  CHECK(h1.max_bytes_sent() == ring.max_bytes_sent());
  CHECK(h1.ranks[0].alltoall_bytes == 0);
  plan::Problem p8 = p;
  p8.P = 8;  // one node
  const auto u = plan::predict_ulysses<ContiguousPartition>(p8, CausalMask{}, hw);
  const auto h8 = plan::predict_hybrid<ContiguousPartition, RingSchedule>(p8, CausalMask{}, hw, 8);
  REQUIRE(h8.valid);
  CHECK(h8.makespan_s == doctest::Approx(u.makespan_s));
  CHECK(h8.max_bytes_sent() == u.max_bytes_sent());

  // Ulysses over two nodes: 7 of a rank's 15 messages on NVLink, 8 on the network.
  const auto u16 = plan::predict_ulysses<ContiguousPartition>(p, CausalMask{}, hw);
  const double q_chunk = double(p.local()) * (32 / 16) * 128 * 4;
  CHECK(plan::detail::alltoall_seconds(hw, 0, 16, 1, std::int64_t(q_chunk)) ==
        doctest::Approx(7 * q_chunk / 450e9 + 8 * q_chunk / 50e9));
  // The hybrid 8 x 2 keeps its all-to-alls on NVLink and sends only its ring
  // across the network: fewer bytes over the slow links than Ulysses on 16.
  const auto all = plan::compare(p, CausalMask{}, hw);
  std::vector<std::string> names;
  for (const auto& x : all) names.push_back(x.schedule);
  REQUIRE(std::find(names.begin(), names.end(), "hybrid 8x2 ring") != names.end());
  CHECK(std::find(names.begin(), names.end(), "hybrid 2x8 ring") != names.end());
  CHECK(std::find(names.begin(), names.end(), "hybrid 4x4 ring") != names.end());
  const auto& h82 = *std::find_if(all.begin(), all.end(),
                                  [](const auto& x) { return x.schedule == "hybrid 8x2 ring"; });
  REQUIRE(h82.valid);
  CHECK(h82.ulysses == 8);
  CHECK(h82.ranks[3].alltoall_s ==
        doctest::Approx(h82.ranks[0].alltoall_s));  // same on every rank of a group
  const double a2a_in_node = plan::detail::alltoall_seconds(hw, 0, 8, 2, std::int64_t(q_chunk * 2));
  CHECK(a2a_in_node == doctest::Approx(7 * q_chunk * 2 / 450e9));
  CHECK(h82.makespan_s < u16.makespan_s);

  // Bytes over the slow links. Ulysses on one node: none; on two nodes: 8 of
  // every rank's 15 equal chunks. The hybrid 8 x 2: its all-to-alls stay on
  // the node, its ring (between the two nodes) crosses; fewer network bytes
  // than Ulysses on 16. The zigzag ring on 16: only the two ranks whose
  // neighbour is on the other node (7 -> 8 and 15 -> 0) use the network.
  for (const auto& r : u.ranks) CHECK(r.network_bytes_sent() == 0);
  for (const auto& r : u16.ranks) {
    CHECK(r.bytes_sent() > 0);
    CHECK(r.network_bytes_sent() * 15 == r.bytes_sent() * 8);
  }
  for (const auto& r : h82.ranks) {
    CHECK(r.alltoall_bytes > 0);
    CHECK(r.alltoall_network_bytes == 0);
    CHECK(r.network_bytes_sent() == r.bytes_sent() - r.alltoall_bytes);
    CHECK(r.network_bytes_sent() > 0);
  }
  CHECK(h82.max_network_bytes_sent() < u16.max_network_bytes_sent());
  int crossing = 0;
  for (const auto& r : ring.ranks) {
    if (r.network_bytes_sent() == 0) continue;
    ++crossing;
    CHECK(r.network_bytes_sent() == r.bytes_sent());
  }
  CHECK(crossing == 2);
  const bool up = ring.ranks[7].network_bytes_sent() > 0;  // sends to rank + 1 (else - 1)
  CHECK(ring.ranks[up ? 15 : 0].network_bytes_sent() > 0);
  CHECK(ring.ranks[up ? 8 : 7].network_bytes_sent() == 0);
  // One link level: every byte is a network byte.
  const auto flat =
      plan::predict<ZigzagPartition, RingSchedule>(p, CausalMask{}, plan::a100_nvlink());
  for (const auto& r : flat.ranks) CHECK(r.network_bytes_sent() == r.bytes_sent());
  // One level (no ranks_per_node): no hybrid candidates.
  CHECK(plan::compare(p, CausalMask{}, plan::a100_nvlink()).size() == 6);
  // Bad grids are named.
  const auto bad = plan::predict_hybrid<ZigzagPartition, RingSchedule>(p, CausalMask{}, hw, 3);
  CHECK_FALSE(bad.valid);
  CHECK(bad.why_not.find("does not divide the number of ranks P = 16") != std::string::npos);
}

namespace {
/// Allowed pairs of the whole sequence, brute force on allowed().
template <class Mask>
std::int64_t brute_pairs(const Mask& mask, index_type N) {
  std::int64_t n = 0;
  for (index_type q = 0; q < N; ++q)
    for (index_type k = 0; k < N; ++k) n += mask.allowed(q, k) ? 1 : 0;
  return n;
}

/// Every position 0 .. N-1 on exactly one rank, each rank's list increasing.
void check_covers(const plan::Layout& l) {
  std::vector<int> seen(std::size_t(l.N), 0);
  for (const auto& r : l.ranks) {
    for (std::size_t i = 0; i < r.size(); ++i) {
      REQUIRE(r[i] >= 0);
      REQUIRE(r[i] < l.N);
      ++seen[std::size_t(r[i])];
      if (i > 0) CHECK(r[i] > r[i - 1]);
    }
  }
  CHECK(std::count(seen.begin(), seen.end(), 1) == l.N);
}
}  // namespace

TEST_CASE("balance: layouts of packed documents and the mask-aware assignment") {
  // The long-tailed mix: starts at 0, ends at N, strictly increasing, the
  // same for the same seed, and long-tailed (the longest document many
  // times the median).
  const index_type N = 8192;
  const auto off = plan::long_tailed_documents(N, 7);
  REQUIRE(off.size() > 10);
  CHECK(off.front() == 0);
  CHECK(off.back() == N);
  CHECK(std::adjacent_find(off.begin(), off.end(), std::greater_equal<index_type>()) == off.end());
  CHECK(plan::long_tailed_documents(N, 7) == off);
  CHECK(plan::long_tailed_documents(N, 8) != off);
  std::vector<index_type> len;
  for (std::size_t d = 0; d + 1 < off.size(); ++d) len.push_back(off[d + 1] - off[d]);
  std::vector<index_type> sorted = len;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted.back() >= 5 * sorted[sorted.size() / 2]);

  const DocumentMask mask = plan::host_document_mask(off);

  // Built-in partitions: the layout is positions().
  const auto zz = plan::layout_of<ZigzagPartition>(96, 3);
  for (int r = 0; r < 3; ++r)
    for (index_type i = 0; i < 32; ++i)
      CHECK(zz.ranks[std::size_t(r)][std::size_t(i)] == ZigzagPartition::positions(96, 3, r)(i));

  // Per-document head-tail on documents of 1, 5, 6 and 40 tokens over P = 3:
  // rank r holds pieces r and 5 - r of every document (pieces of 0 or 1
  // token where a document is shorter than 2P).
  const std::vector<index_type> small{0, 1, 6, 12, 52};
  const auto pd = plan::per_document_zigzag(small, 3);
  check_covers(pd);
  for (int r = 0; r < 3; ++r)
    for (index_type t : pd.ranks[std::size_t(r)]) {
      const std::size_t d =
          std::size_t(std::upper_bound(small.begin(), small.end(), t) - small.begin() - 1);
      const index_type a = small[d], n = small[d + 1] - a;
      // t lies in piece k iff a + n k / 6 <= t < a + n (k + 1) / 6.
      index_type k = 0;
      while (!(a + n * k / 6 <= t && t < a + n * (k + 1) / 6)) ++k;
      CHECK((k == r || k == 5 - r));
    }

  // Tile counts of every layout hold exactly the allowed pairs of the sequence.
  const index_type n_small = 384;
  const auto off_small = plan::long_tailed_documents(n_small, 3, 1.1, 8);
  const DocumentMask ms = plan::host_document_mask(off_small);
  const std::int64_t pairs = brute_pairs(ms, n_small);
  for (const auto& l :
       {plan::layout_of<ContiguousPartition>(n_small, 4),
        plan::layout_of<StripedPartition>(n_small, 4), plan::layout_of<ZigzagPartition>(n_small, 4),
        plan::per_document_zigzag(off_small, 4), plan::mask_balanced(ms, n_small, 4, 32, 16, 32)}) {
    check_covers(l);
    CHECK(plan::balance_of(l, ms, 16, 32).total_pairs() == pairs);
  }

  // The mask-aware layout: N / P tokens per rank in whole chunks, and on the
  // long-tailed mix (P = 8, 32 x 32 tiles) within 5 % of the ideal and better
  // balanced than contiguous, striped, zigzag and per-document head-tail.
  const auto mb = plan::mask_balanced(mask, N, 8, 128, 32, 32);
  check_covers(mb);
  for (const auto& r : mb.ranks) {
    CHECK(r.size() == std::size_t(N / 8));
    for (std::size_t i = 0; i < r.size(); i += 128) CHECK(r[i] % 128 == 0);
  }
  const auto b = plan::balance_of(mb, mask, 32, 32);
  CHECK(b.makespan_over_ideal() <= 1.05);
  for (const auto& other :
       {plan::layout_of<ContiguousPartition>(N, 8), plan::layout_of<StripedPartition>(N, 8),
        plan::layout_of<ZigzagPartition>(N, 8), plan::per_document_zigzag(off, 8)}) {
    const auto o = plan::balance_of(other, mask, 32, 32);
    INFO(other.name);
    CHECK(b.max_cost() < o.max_cost());
    CHECK(b.total_cost() <= o.total_cost());
  }
  // Chunks that the tiles do not divide, or lengths the chunks do not, are named.
  CHECK_THROWS_WITH(plan::mask_balanced(mask, N, 8, 48, 32, 32),
                    doctest::Contains("chunk = 48, expected a positive multiple of block_q"));
  // Any N: at P = 3 (N / 128 chunks do not split in 3) and N + 77 (a short
  // last chunk), every rank holds at most ceil(chunks / P) chunks, the short
  // one last, and the balance holds.
  for (const index_type n : {N, N + 77}) {
    const auto m3 = plan::mask_balanced(mask, n, 3, 128, 32, 32);
    check_covers(m3);
    const index_type room = ((n + 127) / 128 + 2) / 3 * 128;
    for (const auto& r : m3.ranks) CHECK(index_type(r.size()) <= room);
    CHECK(plan::balance_of(m3, mask, 32, 32).makespan_over_ideal() <= 1.05);
  }
  CHECK_THROWS_WITH(plan::mask_balanced(mask, 0, 3, 128, 32, 32),
                    doctest::Contains("N = 0, expected at least 1 token"));
}

namespace {

template <class Partition, class Schedule, class Mask>
void check_fast_equals_reference(const plan::Problem& p, const Mask& mask, const plan::Hardware& hw,
                                 bool pairs, int stride = 1) {
  const auto ref = plan::predict_reference<Partition, Schedule>(p, mask, hw, pairs, stride);
  const auto fast = plan::predict<Partition, Schedule>(p, mask, hw, pairs, stride, true);
  const auto lean = plan::predict<Partition, Schedule>(p, mask, hw, pairs, stride, false);
  INFO(Partition::name(), " + ", Schedule::name(), " N = ", p.N, " P = ", p.P, " tiles ", p.block_q,
       "x", p.block_k, " ", hw.name, " pairs ", pairs);
  REQUIRE(fast.valid == ref.valid);
  CHECK(fast.why_not == ref.why_not);
  CHECK(lean.valid == ref.valid);
  if (!ref.valid) return;
  // The same arithmetic in the same order: equal, not close.
  CHECK(fast.makespan_s == ref.makespan_s);
  CHECK(lean.makespan_s == ref.makespan_s);
  CHECK(fast.single_device_s == ref.single_device_s);
  CHECK(fast.fits == ref.fits);
  CHECK(fast.idle_steps() == ref.idle_steps());
  CHECK(lean.idle_steps() == ref.idle_steps());
  CHECK(lean.peak_bytes() == ref.peak_bytes());
  CHECK(lean.max_bytes_sent() == ref.max_bytes_sent());
  CHECK(lean.max_network_bytes_sent() == ref.max_network_bytes_sent());
  CHECK(lean.idle_time_fraction() == doctest::Approx(ref.idle_time_fraction()).epsilon(1e-12));
  REQUIRE(fast.ranks.size() == ref.ranks.size());
  for (std::size_t r = 0; r < ref.ranks.size(); ++r) {
    const plan::RankPlan &a = fast.ranks[r], &b = ref.ranks[r], &c = lean.ranks[r];
    INFO("rank ", r);
    CHECK(a.workspace_bytes == b.workspace_bytes);
    CHECK(a.input_bytes == b.input_bytes);
    CHECK(c.workspace_bytes == b.workspace_bytes);
    CHECK(c.steps.empty());
    CHECK(c.step_count == b.step_count);
    CHECK(c.idle_step_count == b.idle_step_count);
    CHECK(c.sent == b.sent);
    CHECK(c.network == b.network);
    CHECK(c.compute_s == doctest::Approx(b.compute_s).epsilon(1e-12));
    REQUIRE(a.steps.size() == b.steps.size());
    for (std::size_t s = 0; s < b.steps.size(); ++s) {
      const plan::StepPlan &x = a.steps[s], &y = b.steps[s];
      INFO("step ", s);
      CHECK(x.task.q_rank == y.task.q_rank);
      CHECK(x.task.k_rank == y.task.k_rank);
      CHECK(x.tiles.full == y.tiles.full);
      CHECK(x.tiles.partial == y.tiles.partial);
      CHECK(x.tiles.skipped == y.tiles.skipped);
      CHECK(x.tiles.allowed_pairs == y.tiles.allowed_pairs);
      CHECK(x.flops == y.flops);
      CHECK(x.compute_s == y.compute_s);
      CHECK(x.comm_s == doctest::Approx(y.comm_s).epsilon(1e-12));
      CHECK(x.start_s == y.start_s);
      CHECK(x.end_s == y.end_s);
      CHECK(x.bytes_sent == y.bytes_sent);
      CHECK(x.bytes_received == y.bytes_received);
      CHECK(x.network_bytes == y.network_bytes);
    }
  }
}

/// Every built-in partition x schedule the planner knows (plan::builtin_partitions x
/// plan::builtin_schedules; a pair a schedule does not support must be invalid in both), with
/// rank strides 1, 2, 3 in turn (a hybrid's rings).
template <class Mask>
void check_all_schedules(const plan::Problem& p, const Mask& mask, const plan::Hardware& hw,
                         bool pairs) {
  int stride = 0;
  plan::for_each_pair<plan::builtin_partitions, plan::builtin_schedules>([&](auto part,
                                                                             auto sched) {
    using S = decltype(sched);
    if constexpr (!std::is_same<S, BalancedSchedule>::value || !std::is_same<Mask, FullMask>::value)
      check_fast_equals_reference<decltype(part), S>(p, mask, hw, pairs, 1 + stride++ % 3);
  });
}

}  // namespace

TEST_CASE("planner: the O(P) models equal the reference simulation, every schedule and mask") {
  // Links slower and faster than the compute, one and two levels, even and
  // uneven lengths, tiles that do and do not divide the blocks (zigzag
  // chunks of whole tiles take the chunk tables).
  std::vector<plan::Hardware> machines;
  plan::Hardware slow = plan::a100_infiniband();
  slow.step_overhead = 2e-6;
  slow.latency = 3e-6;
  machines.push_back(slow);
  machines.push_back(plan::a100_nvlink());
  plan::Hardware two = plan::h100_cluster();
  two.ranks_per_node = 3;
  two.intra_latency = 1e-6;
  machines.push_back(two);
  plan::Hardware pairs_of_nodes;  // two levels, links slower than the compute
  pairs_of_nodes.name = "2 per node";
  pairs_of_nodes.flops = 1e15;
  pairs_of_nodes.bandwidth = 1e9;
  pairs_of_nodes.ranks_per_node = 2;
  pairs_of_nodes.intra_bandwidth = 7e9;
  pairs_of_nodes.latency = 1e-6;
  machines.push_back(pairs_of_nodes);
  plan::Hardware cpu;  // compute-bound
  cpu.flops = 1e11;
  cpu.partial_tile_cost = 1.7;
  cpu.bandwidth = 5e10;
  machines.push_back(cpu);
  // Under AddressSanitizer (ctest sanitize_host, -O0) two of the machines
  // per problem, in turn (every machine meets every P): all five took 60 s.
#if defined(__SANITIZE_ADDRESS__)
  const std::size_t per_problem = 2;
#else
  const std::size_t per_problem = machines.size();
#endif
  std::size_t problem = 0;
  for (int P : {1, 2, 3, 4, 5, 6, 8, 12, 13, 16})
    for (index_type per : {index_type(64), index_type(96), index_type(256)})
      for (index_type extra : {index_type(0), index_type(2 * P), index_type(5)}) {
        const std::size_t first = problem++;
        for (std::size_t m = 0; m < per_problem; ++m) {
          const plan::Hardware& hw = machines[(first + m) % machines.size()];
          plan::Problem p;
          p.N = per * P + extra;
          p.P = P;
          p.heads = 4;
          p.kv_heads = 2;
          p.dim = 64;
          p.block_q = 32;
          p.block_k = 16;
          const bool pairs = P <= 4;
          check_all_schedules(p, FullMask{}, hw, pairs);
          check_all_schedules(p, CausalMask{}, hw, pairs);
          check_all_schedules(p, causal_window(per + 7), hw, pairs);
          check_all_schedules(p, SlidingWindowMask{40, 3}, hw, pairs);
          check_all_schedules(p, PrefixLMMask{per / 2}, hw, false);
        }
      }
}

TEST_CASE("planner: whole-sequence tiles of the band masks in O(N / block_q)") {
  for (index_type N : {1, 5, 64, 100, 1000, 4097})
    for (int bq : {1, 16, 48})
      for (int bk : {1, 32, 96}) {
        const auto same = [&](const auto& mask) {
          const TileCounts a = plan::detail::whole_sequence_tiles(mask, N, bq, bk, false);
          const TileCounts b = count_tiles(mask, N, N, bq, bk, {}, {}, false);
          INFO("N = ", N, " tiles ", bq, "x", bk);
          CHECK(a.full == b.full);
          CHECK(a.partial == b.partial);
          CHECK(a.skipped == b.skipped);
          CHECK(a.allowed_pairs == b.allowed_pairs);
        };
        same(FullMask{});
        same(CausalMask{});
        same(causal_window(37));
        same(SlidingWindowMask{5, 70});
        same(SlidingWindowMask{INT64_MAX, 3});
      }
}

TEST_CASE("planner: the decode step over a sharded cache, tree and ring merges") {
  plan::Hardware hw;
  hw.memory_bandwidth = 1e12;
  hw.flops = 1e15;
  hw.bandwidth = 1e10;
  hw.latency = 1e-5;
  plan::DecodeProblem pb;
  pb.cache = 1000;
  pb.batch = 2;
  pb.heads = 8;
  pb.kv_heads = 2;
  pb.dim = 64;
  pb.dtype_bytes = 2;
  pb.compute_bytes = 4;
  pb.P = 1;
  plan::DecodePrediction d = plan::predict_decode(hw, pb);
  CHECK(d.shard_tokens == 1000);
  CHECK(d.shard_bytes == doctest::Approx(2.0 * 1000 * 2 * 2 * 64 * 2));
  CHECK(d.local_s == doctest::Approx(d.shard_bytes / 1e12));
  CHECK(d.tree_s == 0.0);
  CHECK(d.ring_s == 0.0);
  // P = 5: busiest shard ceil(1000 / 5) = 200 tokens; 3 levels of two
  // messages (max: 16 rows x 4 bytes; sums: 16 rows x 65 x 4 bytes); the ring
  // 4 steps of the partials.
  pb.P = 5;
  d = plan::predict_decode(hw, pb);
  CHECK(d.shard_tokens == 200);
  CHECK(d.tree_levels == 3);
  const double rows = 2 * 8 * 1, part = rows * 65 * 4;
  CHECK(d.partial_bytes == doctest::Approx(part));
  CHECK(d.tree_s == doctest::Approx(3 * (2e-5 + rows * 4 / 1e10 + part / 1e10)));
  CHECK(d.ring_s == doctest::Approx(4 * (1e-5 + part / 1e10)));
  // Two levels: the ring crosses nodes (the slow link), the tree's first
  // levels stay inside them.
  hw.ranks_per_node = 4;
  hw.intra_bandwidth = 1e11;
  hw.intra_latency = 1e-6;
  pb.P = 8;
  d = plan::predict_decode(hw, pb);
  CHECK(d.ring_s == doctest::Approx(7 * (1e-5 + part / 1e10)));
  const double near = 2e-6 + rows * 4 / 1e11 + part / 1e11,
               far = 2e-5 + rows * 4 / 1e10 + part / 1e10;
  CHECK(d.tree_s == doctest::Approx(2 * near + far));
  // Compute bound: many rows.
  pb.rows = 100000;
  hw.flops = 1e9;
  d = plan::predict_decode(hw, pb);
  CHECK(d.local_s == doctest::Approx(4.0 * 125 * 2 * 100000 * 8 * 64 / 1e9));
  pb.kv_heads = 3;
  CHECK_THROWS_WITH_AS(plan::predict_decode(hw, pb), doctest::Contains("kv_heads dividing heads"),
                       invalid_argument);
}
