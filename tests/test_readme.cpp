// SPDX-License-Identifier: Apache-2.0
// Every ```cpp block of README.md and of the docs pages with code
// (docs/distributed.md, docs/planner.md, docs/extending.md; numbered in that
// order), compiled and run with the context its prose implies (Views of
// matching shapes, an MPI communicator, an execution space). The blocks are
// extracted at build time (readme_snippets.cpp), so an edit that breaks the
// code breaks this test; a new block fails to compile here until it is given
// a context below. Snippets in the order of the pages: README.md,
// docs/distributed.md, docs/planner.md, docs/extending.md (9-11),
// docs/serving.md (12-15), docs/score.md (16-18).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cmath>
#include <vector>

#include <readme_snippets.hpp>

static_assert(BLOCKATTN_README_SNIPPETS == 18,
              "the ```cpp blocks of README.md or docs/ changed: give each one its context in "
              "tests/test_readme.cpp, which compiles and runs all of them");

// Snippet 8: a user mask, at namespace scope as a user would write it.
namespace snippet9 {
#include <readme_snippet_9.inc>
}  // namespace snippet9

// docs/extending.md snippet 11: a block-product implementation of your own (a
// specialisation: at global scope, as a user would write it).
namespace snippet11 {
struct MyMask : blockattn::CausalMask {};
}  // namespace snippet11
using snippet11::MyMask;
#include <readme_snippet_11.inc>

namespace snippet17 {  // docs/score.md: a score policy of your own
#include <readme_snippet_17.inc>
}  // namespace snippet17

namespace {

using V4 = Kokkos::View<float****>;
using V3 = Kokkos::View<float***>;

int world_size() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

/// Every value finite (the snippets run on zero inputs: O = 0, LSE = log of
/// the allowed keys, gradients 0; nothing may come out NaN).
template <class View>
bool all_finite(const View& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  for (std::size_t i = 0; i < h.span(); ++i)
    if (!std::isfinite(double(h.data()[i]))) return false;
  return true;
}

}  // namespace

TEST_CASE("README snippet 1: single-device forward") {
  const int B = 2, N = 32, H = 4, Hkv = 2, D = 32;
#include <readme_snippet_1.inc>
  Kokkos::fence();
  CHECK(all_finite(o));
  // Offsets 4096 / 3584, causal window 512: query 4096 + i sees keys 3585 + i ..
  // 3584 + N - 1 (zero logits: LSE = log of their count); the last row sees none.
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  int wrong = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < N; ++i) {
        const double want = i < N - 1 ? std::log(double(N - 1 - i)) : -INFINITY;
        wrong += !(std::abs(double(lh(b, h, i)) - want) <= 1e-5 || double(lh(b, h, i)) == want);
      }
  CHECK(wrong == 0);
}

TEST_CASE("README snippet 2: one sequence over many ranks") {
  const blockattn::index_type N = 48 * world_size();
  const int B = 1, H = 2, D = 16;
  Kokkos::DefaultExecutionSpace exec;
  V4 q_global("qg", B, N, H, D), o_global("og", B, N, H, D);
  const int n = int(N) / world_size();
  V4 q("q", B, n, H, D), k("k", B, n, H, D), v("v", B, n, H, D), o("o", B, n, H, D);
  V3 lse("lse", B, H, n);
  {
#include <readme_snippet_2.inc>
    CHECK(stats.steps.size() == std::size_t(P));
    CHECK(position_ids.extent(0) == std::size_t(n));
  }
  Kokkos::fence();
  CHECK(all_finite(o_global));
  CHECK(all_finite(lse));
}

namespace {

struct Local {
  static constexpr int B = 1, H = 2, D = 16;
  static constexpr int n = 48;
  V4 q{"q", B, n, H, D}, k{"k", B, n, H, D}, v{"v", B, n, H, D}, o{"o", B, n, H, D},
      dout{"do", B, n, H, D}, dq{"dq", B, n, H, D}, dk{"dk", B, n, H, D}, dv{"dv", B, n, H, D};
  V3 lse{"lse", B, H, n};
};

}  // namespace

TEST_CASE("README snippet 3: a score policy and sinks, forward and backward") {
  Local x;
  auto &q = x.q, &k = x.k, &v = x.v, &o = x.o, &dout = x.dout, &dq = x.dq, &dk = x.dk, &dv = x.dv;
  auto& lse = x.lse;
  const int H = int(q.extent(2));
  Kokkos::View<float*> sink_logits("sinks", H), sink_grad("sink_grad", H);
  Kokkos::deep_copy(sink_logits, 0.5f);
  Kokkos::deep_copy(dout, 1.0f);
  blockattn::ForwardOptions opts;
#include <readme_snippet_3.inc>
  Kokkos::fence();
  CHECK(all_finite(o));
  CHECK(all_finite(dq));
  // Zero q, k, v: every visible logit is 0 and O = 0, so D = 0 and dL/dsinks = 0;
  // LSE = log(keys seen + e^0.5) (the sink adds e^0.5 to the denominator).
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  CHECK(lh(0, 0, 3) == doctest::Approx(std::log(4.0 + std::exp(0.5))));
  auto gh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), sink_grad);
  CHECK(gh(0) == 0.0f);
}

TEST_CASE("README snippet 4: gradients, single device and distributed") {
  Local x;
  auto &q = x.q, &k = x.k, &v = x.v, &o = x.o, &dout = x.dout, &dq = x.dq, &dk = x.dk, &dv = x.dv;
  auto& lse = x.lse;
  Kokkos::DefaultExecutionSpace exec;
  blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
  using Part = blockattn::StripedPartition;
  using Mask = blockattn::CausalMask;
  blockattn::attention_forward(exec, q, k, v, o, lse, Mask{});  // "the forward's o and lse"
#include <readme_snippet_4.inc>
  Kokkos::fence();
  CHECK(all_finite(dq));
  CHECK(all_finite(dk));
  CHECK(all_finite(dv));
}

TEST_CASE("README snippet 5: the balanced schedule") {
  Local x;
  auto &q = x.q, &k = x.k, &v = x.v, &o = x.o, &dout = x.dout, &dq = x.dq, &dk = x.dk, &dv = x.dv;
  auto& lse = x.lse;
  blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
#include <readme_snippet_5.inc>
  Kokkos::fence();
  CHECK(all_finite(o));
  CHECK(all_finite(dq));
  CHECK(all_finite(dk));
}

TEST_CASE("README snippet 6: Ulysses") {
  Local x;
  auto &q = x.q, &k = x.k, &v = x.v, &o = x.o, &dout = x.dout, &dq = x.dq, &dk = x.dk, &dv = x.dv;
  auto& lse = x.lse;
  blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
  if (Local::H % comm.size() == 0) {
#include <readme_snippet_6.inc>
    Kokkos::fence();
    CHECK(all_finite(o));
    CHECK(all_finite(dq));
    CHECK(all_finite(dk));
  }
}

TEST_CASE("README snippet 7: the 2D hybrid") {
  Local x;
  auto &q = x.q, &k = x.k, &v = x.v, &o = x.o, &dout = x.dout, &dq = x.dq, &dk = x.dk, &dv = x.dv;
  auto& lse = x.lse;
  blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
  if (comm.size() % 2 == 0) {  // groups of 2 ranks
#include <readme_snippet_7.inc>
    Kokkos::fence();
    CHECK(hybrid.grid().ring == comm.size() / 2);
    CHECK(all_finite(o));
    CHECK(all_finite(dq));
    CHECK(all_finite(dk));
  }
}

TEST_CASE("README snippet 8: the planner") {
  const blockattn::index_type N = 262144;
  const int P = 8, batch = 1, heads = 32, kv_heads = 32, dim = 128;
#include <readme_snippet_8.inc>
  CHECK(best.makespan_s > 0);
  CHECK(!best.partition.empty());
  CHECK(!best.schedule.empty());
}

TEST_CASE("README snippets 9 and 10: a user mask and packed documents") {
  const int N = 4096, H = 2, D = 16;
  V4 q("q", 1, N, H, D), k("k", 1, N, H, D), v("v", 1, N, H, D), o("o", 1, N, H, D);
  V3 lse("lse", 1, H, N);
  blockattn::attention_forward(q, k, v, o, lse, snippet9::PrefixLM{100});
  Kokkos::fence();
  CHECK(all_finite(lse));
#include <readme_snippet_10.inc>
  blockattn::attention_forward(q, k, v, o, lse, mask);
  blockattn::attention_forward(q, k, v, o, lse, local);
  blockattn::attention_forward(q, k, v, o, lse, bidir);
  Kokkos::fence();
  CHECK(all_finite(lse));
}

TEST_CASE("docs/extending.md snippet 11: a registered implementation that declines") {
  // It is asked first; declining, the call goes on to the kernels.
  const int N = 40, H = 2, D = 16;
  Kokkos::View<float****, Kokkos::DefaultHostExecutionSpace> q("q", 1, N, H, D), k("k", 1, N, H, D),
      v("v", 1, N, H, D), o("o", 1, N, H, D);
  Kokkos::View<float***, Kokkos::DefaultHostExecutionSpace> lse("lse", 1, H, N);
  static_assert(blockattn::block_implementation_registered_v<Kokkos::DefaultHostExecutionSpace,
                                                             float, MyMask>);
  blockattn::BlockPathCounts paths;
  blockattn::ForwardOptions opts;
  opts.paths = &paths;
  blockattn::attention_forward(Kokkos::DefaultHostExecutionSpace{}, q, k, v, o, lse, MyMask{},
                               opts);
  Kokkos::fence();
  CHECK(paths.user == 0);
  CHECK(paths.portable == 1);
  // Zero inputs: every allowed logit is 0, so LSE = log(row + 1).
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  CHECK(lh(0, 1, N - 1) == doctest::Approx(std::log(double(N))));
}

TEST_CASE("docs/serving.md snippet 12: prefill, append, decode over a sharded cache") {
  blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
  const Kokkos::DefaultExecutionSpace exec;
  const blockattn::index_type max_tokens = 100;
  using B4 = Kokkos::View<blockattn::bf16****>;
  const int C = 20;  // a prompt chunk of sequence 0
  B4 q_chunk("q", 1, C, 4, 64), k_chunk("k", 1, C, 2, 64), v_chunk("v", 1, C, 2, 64),
      o_chunk("o", 1, C, 4, 64);
  V3 lse_chunk("lse", 1, 4, C);
  B4 k_new("k", 4, 1, 2, 64), v_new("v", 4, 1, 2, 64), q_new("q", 4, 1, 4, 64),
      o_new("o", 4, 1, 4, 64);
  V3 lse_new("lse", 4, 4, 1);
#include <readme_snippet_12.inc>
  Kokkos::fence();
  CHECK(cache.length(0) == C + 1);
  CHECK(cache.length(3) == 1);
  // Zero inputs: every visible logit is 0, so LSE = log(visible keys).
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse_new);
  CHECK(lh(0, 0, 0) == doctest::Approx(std::log(double(C + 1))));
  CHECK(lh(3, 0, 0) == doctest::Approx(0.0));
  auto lc = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse_chunk);
  CHECK(lc(0, 0, C - 1) == doctest::Approx(std::log(double(C))));
}

TEST_CASE("docs/serving.md snippet 13: a paged cache, fork, release") {
  blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
  const Kokkos::DefaultExecutionSpace exec;
  const blockattn::index_type max_tokens = 200;
  const blockattn::RoundRobinPlacement place{1};
  using B4 = Kokkos::View<blockattn::bf16****>;
  const int C = 100;  // sequence 0's prompt
  B4 q_chunk("q", 1, C, 8, 128), k_chunk("k", 1, C, 8, 128), v_chunk("v", 1, C, 8, 128),
      o_chunk("o", 1, C, 8, 128);
  V3 lse_chunk("lse", 1, 8, C);
  B4 k_new("k", 64, 1, 8, 128), v_new("v", 64, 1, 8, 128), q_new("q", 64, 1, 8, 128),
      o_new("o", 64, 1, 8, 128);
  V3 lse_new("lse", 64, 8, 1);
#include <readme_snippet_13.inc>
  Kokkos::fence();
  CHECK(cache.length(0) == C + 1);
  CHECK(cache.length(1) == 0);
  CHECK(cache.length(2) == 71);
  CHECK(cache.length(63) == 1);
  // Zero inputs: every visible logit is 0, so LSE = log(visible keys).
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse_new);
  CHECK(lh(0, 0, 0) == doctest::Approx(std::log(double(C + 1))));
  CHECK(lh(2, 0, 0) == doctest::Approx(std::log(71.0)));
  CHECK(lh(63, 0, 0) == doctest::Approx(0.0));
}

TEST_CASE("docs/serving.md snippet 14: a mixed batch") {
  blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
  const Kokkos::DefaultExecutionSpace exec;
  const blockattn::RoundRobinPlacement place{1};
  using B4 = Kokkos::View<blockattn::bf16****>;
  blockattn::KVCache<blockattn::bf16> cache(comm, 8, place.local_capacity(64, comm.size()), 2, 64,
                                            place);
  B4 q_rows("q", 1, 42, 4, 64), k_rows("k", 1, 42, 2, 64), v_rows("v", 1, 42, 2, 64),
      o_rows("o", 1, 42, 4, 64);
  V3 lse_rows("lse", 1, 4, 42);
#include <readme_snippet_14.inc>
  Kokkos::fence();
  CHECK(cache.length(3) == 1);
  CHECK(cache.length(6) == 40);
  CHECK(cache.length(1) == 1);
  // Zero inputs: every visible logit is 0, so LSE = log(visible keys).
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse_rows);
  CHECK(lh(0, 0, 0) == doctest::Approx(0.0));
  CHECK(lh(0, 0, 40) == doctest::Approx(std::log(40.0)));
  CHECK(lh(0, 3, 41) == doctest::Approx(0.0));
}

TEST_CASE("docs/serving.md snippet 15: merge_attention, n parts and two in place") {
  const Kokkos::DefaultExecutionSpace exec;
  const int n = 2, B = 1, R = 3, H = 2, D = 8;
  Kokkos::View<float*****> o_parts("o_parts", n, B, R, H, D);
  Kokkos::View<float****> lse_parts("lse_parts", n, B, H, R);
  V4 o("o", B, R, H, D), o_a("o_a", B, R, H, D), o_b("o_b", B, R, H, D);
  V3 lse("lse", B, H, R), lse_a("lse_a", B, H, R), lse_b("lse_b", B, H, R);
  // Parts of equal weight (LSE 0) holding 1 and 3; then a part of weight 1
  // holding 1 and one of weight 3 (LSE ln 3) holding 5.
  Kokkos::deep_copy(Kokkos::subview(o_parts, 0, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL),
                    1.0f);
  Kokkos::deep_copy(Kokkos::subview(o_parts, 1, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL),
                    3.0f);
  Kokkos::deep_copy(o_a, 1.0f);
  Kokkos::deep_copy(o_b, 5.0f);
  Kokkos::deep_copy(lse_b, float(std::log(3.0)));
#include <readme_snippet_15.inc>
  Kokkos::fence();
  auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  auto ah = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o_a);
  auto lah = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse_a);
  CHECK(oh(0, 2, 1, 7) == doctest::Approx(2.0));
  CHECK(lh(0, 1, 2) == doctest::Approx(std::log(2.0)));
  CHECK(ah(0, 2, 1, 7) == doctest::Approx(4.0));
  CHECK(lah(0, 1, 2) == doctest::Approx(std::log(4.0)));
}

TEST_CASE("docs/score.md snippets 16 to 18: policies, your own, sinks") {
  using Comm = blockattn::MpiCommunicator<>;
  using Exec = Kokkos::DefaultExecutionSpace;
  Comm comm(MPI_COMM_WORLD);
  const Exec exec;
  const int B = 1, H = 8, D = 16, n = 24;
  V4 q("q", B, n, H, D), k("k", B, n, H, D), v("v", B, n, H, D), o("o", B, n, H, D),
      dout("do", B, n, H, D), dq("dq", B, n, H, D), dk("dk", B, n, H, D), dv("dv", B, n, H, D);
  V3 lse("lse", B, H, n);
  {
#include <readme_snippet_16.inc>
    attn.forward(q, k, v, o, lse);
    Kokkos::fence();
    CHECK(all_finite(lse));
  }
  blockattn::attention_forward(exec, q, k, v, o, lse, snippet17::mask);
  Kokkos::fence();
  CHECK(all_finite(lse));
  {
#include <readme_snippet_18.inc>
    Kokkos::fence();
    CHECK(all_finite(dq));
  }
}
