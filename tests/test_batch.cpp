// SPDX-License-Identifier: Apache-2.0
// Mixed serving batches (batch_attention): decode rows of some sequences and
// prefill chunks of others in one call give bit for bit the results of one
// prefill_attention per block, in the batch's order, over KVCache and
// PagedKVCache (fp32, bf16, an 8-bit cache), both placements, tree and ring
// merges, at P = 1 .. 4; the fp32 results within the fp64 reference's
// bound; errors (a sequence twice, rows that do not add up, a batch that
// differs between ranks, an exhausted pool on one rank: every rank throws,
// nothing appended anywhere).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"
#include "serve_check.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

using Comm = ServeComm;

/// The batch's packed rows of a global tensor: block i holds rows[i] tokens
/// of sequence sequences[i] from its length `at[i]` on.
template <class T>
V4<T> packed(const HostTensor& t, const ServeBatch& batch, const std::vector<int>& at) {
  HostTensor r(1, int(batch.total()), t.h, t.d);
  for (std::size_t b = 0; b < batch.sequences.size(); ++b)
    for (int i = 0; i < batch.rows[b]; ++i)
      for (int h = 0; h < t.h; ++h)
        for (int d = 0; d < t.d; ++d)
          r(0, int(batch.offset(b)) + i, h, d) = t(batch.sequences[b], at[b] + i, h, d);
  V4<T> out("packed", 1, batch.total(), t.h, t.d);
  upload(r, out);
  return out;
}

/// Two caches fed the same prompts; steps of mixed batches run through
/// batch_attention on one and one prefill_attention per block on the other:
/// the same bits, the same lengths (and, paged, the same free pages).
template <class Cache, class Placement, class Mask>
void check_mixed(Comm& comm, const Placement& pl, MergeAlgorithm merge, const Mask& mask,
                 std::uint64_t seed, const std::vector<float>* sinks = nullptr) {
  using T = typename Cache::value_type;
  const int P = comm.size(), B = 5, H = 4, Hkv = 2, D = 32, longest = 512;
  constexpr bool paged = impl::is_paged_cache<Cache>::value;
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(B, longest, H, D, rng, 2.0);
  HostTensor k = random_tensor(B, longest, Hkv, D, rng, 2.0);
  HostTensor v = random_tensor(B, longest, Hkv, D, rng);
  const auto make = [&] {
    if constexpr (paged)
      return Cache(comm, B, 96, 16, Hkv, D, pl, longest);
    else
      return Cache(comm, B, pl.local_capacity(longest, P), Hkv, D, pl);
  };
  Cache batched = make(), separate = make();
  std::vector<int> len = {0, 20, 150, 7, 300};
  for (int s = 0; s < B; ++s)
    if (len[std::size_t(s)] > 0) {
      const int n = len[std::size_t(s)];
      HostTensor kr = rows_of(k, s, 0, n), vr = rows_of(v, s, 0, n);
      V4<T> kd("k", 1, n, Hkv, D), vd("v", 1, n, Hkv, D);
      upload(kr, kd);
      upload(vr, vd);
      batched.append(ExecSpace{}, s, kd, vd);
      separate.append(ExecSpace{}, s, kd, vd);
    }
  ServeOptions opts;
  opts.merge = merge;
  Kokkos::View<float*, MemSpace> sink_view;
  if (sinks) {
    sink_view = Kokkos::View<float*, MemSpace>("sinks", sinks->size());
    auto h = Kokkos::create_mirror_view(sink_view);
    for (std::size_t i = 0; i < sinks->size(); ++i) h(i) = (*sinks)[i];
    Kokkos::deep_copy(sink_view, h);
    opts.sinks = sink_view;
  }
  // Decode rows (1), short chunks on the decode kernel (5), chunks on the
  // forward's kernels (13, 40), a prompt's first chunk (sequence 0); runs of
  // consecutive sequences with the same rows (one launch where their key
  // splits agree, batch_attention's decode_runs).
  const std::vector<ServeBatch> steps = {{{3, 0, 4, 1}, {1, 40, 1, 13}},
                                         {{2, 4, 0, 3}, {1, 1, 5, 1}},
                                         {{1}, {1}},
                                         {{0, 2}, {64, 1}},
                                         {{1, 2, 3, 4, 0}, {1, 1, 1, 1, 13}},
                                         {{0, 1, 2, 3, 4}, {5, 5, 5, 5, 5}}};
  for (std::size_t step = 0; step < steps.size(); ++step) {
    const ServeBatch& batch = steps[step];
    std::vector<int> at;
    for (int s : batch.sequences) at.push_back(len[std::size_t(s)]);
    const index_type rows = batch.total();
    const V4<T> qd = packed<T>(q, batch, at), kd = packed<T>(k, batch, at),
                vd = packed<T>(v, batch, at);
    V4<T> o_b("o", 1, rows, H, D), o_s("o", 1, rows, H, D);
    V3<T> l_b("lse", 1, H, rows), l_s("lse", 1, H, rows);
    batch_attention(comm, ExecSpace{}, batched, batch, qd, kd, vd, o_b, l_b, mask, opts);
    const auto all = Kokkos::ALL;
    for (std::size_t i = 0; i < batch.sequences.size(); ++i) {
      const auto r = Kokkos::make_pair(batch.offset(i), batch.offset(i + 1));
      prefill_attention(
          comm, ExecSpace{}, separate, batch.sequences[i], Kokkos::subview(qd, all, r, all, all),
          Kokkos::subview(kd, all, r, all, all), Kokkos::subview(vd, all, r, all, all),
          Kokkos::subview(o_s, all, r, all, all), Kokkos::subview(l_s, all, all, r), mask, opts);
    }
    Kokkos::fence();
    INFO("P=", P, " ", impl::type_name<Placement>(), " ", impl::type_name<Cache>(),
         " merge=", impl::merge_name(merge), " step ", step);
    CHECK(same_bits(o_b, o_s));
    CHECK(same_bits(l_b, l_s));
    for (std::size_t i = 0; i < batch.sequences.size(); ++i)
      len[std::size_t(batch.sequences[i])] += batch.rows[i];
    for (int s = 0; s < B; ++s) {
      CHECK(batched.length(s) == len[std::size_t(s)]);
      CHECK(batched.local_length(s) == separate.local_length(s));
    }
    if constexpr (paged) CHECK(batched.free_pages() == separate.free_pages());
    // fp32 without sinks: every block within the fp64 reference's bound.
    if constexpr (std::is_same<T, float>::value && !is_kv_quant_v<typename Cache::stored_type>) {
      if (sinks) continue;
      for (std::size_t i = 0; i < batch.sequences.size(); ++i) {
        const int s = batch.sequences[i], n = batch.rows[i], q0 = at[i];
        const ReferenceResult ref =
            reference_attention(rows_of(q, s, q0, n), rows_of(k, s, 0, q0 + n),
                                rows_of(v, s, 0, q0 + n), mask, 1.0 / std::sqrt(double(D)), q0, 0);
        const auto r = Kokkos::make_pair(batch.offset(i), batch.offset(i + 1));
        const ErrorReport e =
            compare(ref, Kokkos::subview(o_b, all, r, all, all), Kokkos::subview(l_b, all, all, r));
        const double tol = tolerance<float>(ref, D, q0 + n);
        INFO("block ", i, " (sequence ", s, ", ", n, " rows): O err ", e.o_err, " LSE err ",
             e.lse_err, " bound ", tol);
        CHECK(e.finite);
        CHECK(e.o_err <= tol);
        CHECK(e.lse_err <= tol);
      }
    }
  }
}

template <class Cache, class Placement>
void check_all_merges(Comm& comm, const Placement& pl, std::uint64_t seed) {
  for (MergeAlgorithm merge : {MergeAlgorithm::tree, MergeAlgorithm::ring})
    check_mixed<Cache>(comm, pl, merge, CausalMask{}, seed++);
}

}  // namespace

TEST_SUITE("mixed") {
  TEST_CASE_TEMPLATE("a mixed batch gives the bits of separate calls", T, float, bf16) {
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size();
    const RoundRobinPlacement rr{1};
    const ContiguousPlacement ct{(512 + P - 1) / P};
    check_all_merges<KVCache<T, ExecSpace>>(comm, rr, 1);
    check_all_merges<PagedKVCache<T, ExecSpace>>(comm, rr, 3);
    check_all_merges<KVCache<T, ExecSpace, ContiguousPlacement>>(comm, ct, 5);
    check_all_merges<PagedKVCache<T, ExecSpace, ContiguousPlacement>>(comm, ct, 7);
  }

  TEST_CASE("a mixed batch: windows, sinks and score policies, an 8-bit paged cache") {
    Comm comm(MPI_COMM_WORLD);
    const RoundRobinPlacement pl{3};
    const std::vector<float> sinks{0.5f, -1.0f, 2.0f, -0.5f};
    check_mixed<KVCache<float, ExecSpace, RoundRobinPlacement>>(comm, pl, MergeAlgorithm::tree,
                                                                causal_window(60), 11);
    check_mixed<PagedKVCache<bf16, ExecSpace, RoundRobinPlacement>>(
        comm, pl, MergeAlgorithm::ring, with_score(CausalMask{}, SoftCap{1.5}), 12, &sinks);
    check_mixed<PagedKVCache<float, ExecSpace, RoundRobinPlacement, fp8_e4m3>>(
        comm, pl, MergeAlgorithm::tree, CausalMask{}, 13);
  }

  TEST_CASE("a mixed batch's errors: every rank throws, nothing appended anywhere") {
    Comm comm(MPI_COMM_WORLD);
    const int P = comm.size(), Hkv = 1, H = 2, D = 16;
    // Contiguous placement, 40 tokens per rank: rank 0 fills first. Pools of
    // 4 pages of 8 slots.
    const ContiguousPlacement pl{40};
    PagedKVCache<float, ExecSpace, ContiguousPlacement> cache(comm, 3, 4, 8, Hkv, D, pl, 40 * P);
    auto run = [&](const ServeBatch& batch, int rows) {
      V4<float> q("q", 1, rows, H, D), k("k", 1, rows, Hkv, D), v("v", 1, rows, Hkv, D),
          o("o", 1, rows, H, D);
      V3<float> lse("lse", 1, H, rows);
      batch_attention(comm, ExecSpace{}, cache, batch, q, k, v, o, lse);
    };
    auto unchanged = [&] {
      for (int s = 0; s < 3; ++s) CHECK(cache.length(s) == 0);
      CHECK(cache.free_pages() == 4);
    };
    CHECK_THROWS_WITH_AS(run({{0, 2, 0}, {1, 1, 1}}, 3),
                         doctest::Contains("argument 'batch' holds sequence 0 twice"),
                         invalid_argument);
    unchanged();
    CHECK_THROWS_WITH_AS(
        run({{0, 3}, {1, 1}}, 2),
        doctest::Contains("argument 'batch' holds sequence 3 at 1, expected 0 .. 2"),
        invalid_argument);
    CHECK_THROWS_WITH_AS(run({{0, 1}, {1, 0}}, 1),
                         doctest::Contains("gives sequence 1 0 rows, expected >= 1"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(run({{0, 1}, {2, 3}}, 4),
                         doctest::Contains("argument 'q' has 4 rows (extent(1)), expected the "
                                           "batch's 5"),
                         invalid_argument);
    unchanged();
    // Rank 1 sends another batch: every rank names the difference.
    if (P > 1) {
      const ServeBatch mine =
          comm.rank() == 1 ? ServeBatch{{0, 1}, {2, 1}} : ServeBatch{{0, 1}, {1, 2}};
      CHECK_THROWS_WITH_AS(run(mine, 3), doctest::Contains("sequences, rows and lengths"),
                           invalid_argument);
      unchanged();
    }
    // 16 + 17 tokens on rank 0 take 5 pages of its 4: the pool of rank 0 is
    // exhausted, on every rank; 16 + 16 fit.
    CHECK_THROWS_WITH_AS(run({{1, 2}, {16, 17}}, 33),
                         doctest::Contains("the page pool of rank 0 is exhausted: the batch's "
                                           "appends need 5 pages"),
                         invalid_argument);
    unchanged();
    run({{1, 2}, {16, 16}}, 32);
    CHECK(cache.length(1) == 16);
    CHECK(cache.length(2) == 16);
    CHECK(cache.free_pages() == (comm.rank() == 0 ? 0 : 4));
  }
}
