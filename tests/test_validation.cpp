// SPDX-License-Identifier: Apache-2.0
// Bad input: every case throws blockattn::invalid_argument whose message names
// the argument and the expected value.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <cmath>
#include <limits>
#include <string>

#include "backend.hpp"

using namespace blockattn;
using blockattn::test::ExecSpace;
using blockattn::test::MemSpace;

namespace {

using V4 = Kokkos::View<float****, MemSpace>;
using V3 = Kokkos::View<float***, MemSpace>;

/// Expects a throw whose message contains every fragment.
template <class F>
void expect_error(F&& f, std::initializer_list<const char*> fragments) {
  std::string msg;
  try {
    f();
  } catch (const blockattn::invalid_argument& e) {
    msg = e.what();
  }
  INFO("message: ", msg);
  REQUIRE_FALSE(msg.empty());
  CHECK(msg.find("blockattn::attention_forward") != std::string::npos);
  for (const char* frag : fragments) CHECK(msg.find(frag) != std::string::npos);
}

struct Views {
  V4 q{"q", 2, 10, 4, 16}, k{"k", 2, 12, 2, 16}, v{"v", 2, 12, 2, 16}, o{"o", 2, 10, 4, 16};
  V3 lse{"lse", 2, 4, 10};
  void run() const { attention_forward(ExecSpace{}, q, k, v, o, lse); }
};

/// A memory space that no host execution space can access, standing in for
/// device memory on a host-only build (where no View can be inaccessible).
struct UnreachableSpace {
  using memory_space = UnreachableSpace;
  using execution_space = Kokkos::DefaultHostExecutionSpace;
  using device_type = Kokkos::Device<execution_space, memory_space>;
  using size_type = std::size_t;
  static constexpr const char* name() { return "UnreachableSpace"; }
};

}  // namespace

TEST_CASE("valid views pass") {
  Views w;
  CHECK_NOTHROW(w.run());
  Kokkos::fence();
}

TEST_CASE("mismatched extents name the argument and the expected value") {
  SUBCASE("batch of k") {
    Views w;
    w.k = V4("k", 3, 12, 2, 16);
    expect_error([&] { w.run(); }, {"'k'", "extent(0) (batch) = 3", "expected 2"});
  }
  SUBCASE("head_dim of k") {
    Views w;
    w.k = V4("k", 2, 12, 2, 8);
    expect_error([&] { w.run(); }, {"'k'", "head_dim", "= 8", "expected 16"});
  }
  SUBCASE("v differs from k") {
    Views w;
    w.v = V4("v", 2, 11, 2, 16);
    expect_error([&] { w.run(); }, {"'v'", "extent(1) (seq) = 11", "expected 12"});
  }
  SUBCASE("o differs from q") {
    Views w;
    w.o = V4("o", 2, 10, 3, 16);
    expect_error([&] { w.run(); }, {"'o'", "extent(2) (heads) = 3", "expected 4"});
  }
  SUBCASE("lse shape") {
    Views w;
    w.lse = V3("lse", 2, 10, 4);
    expect_error([&] { w.run(); }, {"'lse'", "extent(1) (heads) = 10", "expected 4"});
  }
  SUBCASE("kv heads must divide heads") {
    Views w;
    w.k = V4("k", 2, 12, 3, 16);
    w.v = V4("v", 2, 12, 3, 16);
    expect_error([&] { w.run(); }, {"'k'", "(heads) = 3", "divisor of the heads of q (4)"});
  }
}

TEST_CASE("unsupported head dim") {
  Views w;
  w.q = V4("q", 2, 10, 4, 300);
  w.k = V4("k", 2, 12, 2, 300);
  w.v = V4("v", 2, 12, 2, 300);
  w.o = V4("o", 2, 10, 4, 300);
  expect_error([&] { w.run(); }, {"'q'", "head_dim) = 300", "at most 256"});
}

TEST_CASE("zero sizes") {
  SUBCASE("no queries") {
    Views w;
    w.q = V4("q", 2, 0, 4, 16);
    expect_error([&] { w.run(); }, {"'q'", "extent(1) (seq) = 0", "expected a positive size"});
  }
  SUBCASE("no keys") {
    Views w;
    w.k = V4("k", 2, 0, 2, 16);
    expect_error([&] { w.run(); }, {"'k'", "extent(1) (seq) = 0", "expected a positive size"});
  }
  SUBCASE("no head dim") {
    Views w;
    w.q = V4("q", 2, 10, 4, 0);
    expect_error([&] { w.run(); }, {"'q'", "head_dim) = 0", "expected a positive size"});
  }
}

TEST_CASE("bad scale") {
  Views w;
  ForwardOptions opts;
  opts.scale = 0.0;
  expect_error([&] { attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, FullMask{}, opts); },
               {"'scale'", "finite non-zero"});
  opts.scale = std::numeric_limits<double>::infinity();
  expect_error([&] { attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, FullMask{}, opts); },
               {"'scale'", "finite non-zero"});
}

TEST_CASE("a scale the value type cannot hold; offsets beyond +-2^62") {
  Views w;
  ForwardOptions opts;
  auto run = [&] { attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, FullMask{}, opts); };
  opts.scale = 1e300;  // finite in double, inf in float: used to give O = 0, LSE = -inf
  expect_error(run, {"'scale' is 1e+300", "overflows float"});
  opts.scale = -1e-300;
  expect_error(run, {"'scale' is -1e-300", "underflows float"});
  opts.scale = 1e30;  // representable: accepted
  CHECK_NOTHROW(run());
  opts.scale = std::numeric_limits<double>::quiet_NaN();
  opts.q_offset = (index_type(1) << 62) + 1;
  expect_error(run, {"'opts.q_offset'", "expected |offset| <= 2^62"});
  opts.q_offset = 0;
  opts.k_offset = -(index_type(1) << 62) - 1;
  expect_error(run, {"'opts.k_offset'"});
  opts.k_offset = -(index_type(1) << 62);
  CHECK_NOTHROW(run());
}

namespace {
/// Causal, but classify() says `full` for boxes that are only partly allowed.
struct OverconfidentCausal {
  KOKKOS_INLINE_FUNCTION bool allowed(index_type q, index_type k) const { return k <= q; }
  KOKKOS_INLINE_FUNCTION TileKind classify(index_type, index_type q1, index_type k0,
                                           index_type) const {
    return k0 > q1 - 1 ? TileKind::empty : TileKind::full;
  }
};
/// Causal, with an allowed_keys() one key too long: [.., q + 2) instead of [.., q + 1).
struct LongIntervalCausal {
  KOKKOS_INLINE_FUNCTION bool allowed(index_type q, index_type k) const { return k <= q; }
  KOKKOS_INLINE_FUNCTION KeyInterval allowed_keys(index_type q) const { return {-100, q + 2}; }
  KOKKOS_INLINE_FUNCTION TileKind classify(index_type q0, index_type q1, index_type k0,
                                           index_type k1) const {
    return CausalMask{}.classify(q0, q1, k0, k1);
  }
};
}  // namespace

TEST_CASE("check_policies: an allowed_keys that disagrees with allowed is named") {
  Views w;
  ForwardOptions opts;
  opts.check_policies = true;
  expect_error(
      [&] {
        attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, LongIntervalCausal{}, opts);
      },
      {"argument 'mask' breaks the mask contract: allowed_keys(", ") = [-100, ",
       ") = false; expected allowed(q, k) to hold exactly for the keys of allowed_keys(q)"});
  // Documents (whose mask has allowed_keys) pass, bounded window or not.
  const Documents<MemSpace> docs(std::vector<index_type>{0, 1, 4, 9, 12});
  CHECK_NOTHROW(attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, docs.mask(), opts));
  CHECK_NOTHROW(
      attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, docs.mask(false, 2, 1), opts));
}

TEST_CASE("check_policies: a classify that breaks the mask contract is named") {
  Views w;
  ForwardOptions opts;
  opts.check_policies = true;
  expect_error(
      [&] {
        attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, OverconfidentCausal{}, opts);
      },
      {"argument 'mask' breaks the mask contract", "= full but allowed(", ") = false"});
  // The built-in masks pass, at offsets too.
  opts.q_offset = -7;
  opts.k_offset = 3;
  CHECK_NOTHROW(attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, CausalMask{}, opts));
  CHECK_NOTHROW(
      attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, SlidingWindowMask{3, 2}, opts));
  // The backward checks too (at offsets where the broken boxes are reachable).
  opts.q_offset = opts.k_offset = 0;
  V4 dout("do", 2, 10, 4, 16), dq("dq", 2, 10, 4, 16), dk("dk", 2, 12, 2, 16),
      dv("dv", 2, 12, 2, 16);
  std::string msg;
  try {
    attention_backward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, dout, dq, dk, dv,
                       OverconfidentCausal{}, opts);
  } catch (const blockattn::invalid_argument& e) {
    msg = e.what();
  }
  CHECK(msg.find("blockattn::attention_backward: argument 'mask' breaks the mask contract") !=
        std::string::npos);
  // Off by default: the broken mask runs (and is silently wrong: the contract's point).
  opts.check_policies = false;
  CHECK_NOTHROW(
      attention_forward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, OverconfidentCausal{}, opts));
}

TEST_CASE("negative offsets are positions like any other") {
  // Shifting both offsets by the same amount changes nothing (masks see k - q);
  // queries before every key under a causal mask are fully masked.
  using D4 = Kokkos::View<double****, MemSpace>;
  using D3 = Kokkos::View<double***, MemSpace>;
  D4 q("q", 1, 24, 2, 8), k("k", 1, 20, 2, 8), o1("o1", 1, 24, 2, 8), o2("o2", 1, 24, 2, 8);
  D3 l1("l1", 1, 2, 24), l2("l2", 1, 2, 24);
  auto h = Kokkos::create_mirror_view(q);
  for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = std::sin(0.37 * double(i));
  Kokkos::deep_copy(q, h);
  Kokkos::deep_copy(
      k, Kokkos::subview(q, Kokkos::ALL, std::make_pair(0, 20), Kokkos::ALL, Kokkos::ALL));
  auto run = [&](auto mask, index_type qo, index_type ko, const D4& o, const D3& l) {
    ForwardOptions opts;
    opts.q_offset = qo;
    opts.k_offset = ko;
    attention_forward(ExecSpace{}, q, k, k, o, l, mask, opts);
    ExecSpace().fence();
  };
  auto same = [&] {
    auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o1);
    auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o2);
    auto la = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), l1);
    auto lb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), l2);
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!(a.data()[i] == b.data()[i])) return false;
    for (std::size_t i = 0; i < la.size(); ++i)
      if (!(la.data()[i] == lb.data()[i])) return false;
    return true;
  };
  run(CausalMask{}, -3, -10, o1, l1);
  run(CausalMask{}, 7, 0, o2, l2);
  CHECK(same());
  run(causal_window(5), -1000, -1004, o1, l1);
  run(causal_window(5), 4, 0, o2, l2);
  CHECK(same());
  // A window "unbounded" to the left at negative positions (used to overflow q - left).
  run(SlidingWindowMask{std::numeric_limits<index_type>::max(), 0}, -(index_type(1) << 62) + 7,
      -(index_type(1) << 62), o1, l1);
  run(CausalMask{}, 7, 0, o2, l2);
  CHECK(same());
  // Queries at -30 .. -7 before keys at 0 .. 19: every row fully masked.
  run(CausalMask{}, -30, 0, o1, l1);
  auto l = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), l1);
  auto o = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o1);
  for (std::size_t i = 0; i < l.size(); ++i)
    CHECK(l.data()[i] == -std::numeric_limits<double>::infinity());
  for (std::size_t i = 0; i < o.size(); ++i) CHECK(o.data()[i] == 0.0);
}

TEST_CASE("a memory space the execution space cannot access") {
  static_assert(!Kokkos::SpaceAccessibility<ExecSpace, UnreachableSpace>::accessible);
  expect_error(
      [] { impl::require_accessible<ExecSpace, UnreachableSpace>("attention_forward", "k"); },
      {"'k'", "UnreachableSpace", ExecSpace::name(), "cannot access"});
  CHECK_NOTHROW(impl::require_accessible<ExecSpace, MemSpace>("attention_forward", "k"));
}

TEST_CASE("backward: gradient views name the argument and the expected extent") {
  Views w;
  V4 dout("do", 2, 10, 4, 16), dq("dq", 2, 10, 4, 16), dk("dk", 2, 12, 2, 16),
      dv("dv", 2, 12, 2, 16);
  auto run = [&] { attention_backward(ExecSpace{}, w.q, w.k, w.v, w.o, w.lse, dout, dq, dk, dv); };
  CHECK_NOTHROW(run());
  auto expect = [&](auto&& f, const char* arg, const char* frag) {
    std::string msg;
    try {
      f();
    } catch (const blockattn::invalid_argument& e) {
      msg = e.what();
    }
    INFO("message: ", msg);
    CHECK(msg.find("blockattn::attention_backward") != std::string::npos);
    CHECK(msg.find(arg) != std::string::npos);
    CHECK(msg.find(frag) != std::string::npos);
  };
  dk = V4("dk", 2, 11, 2, 16);
  expect(run, "'dk'", "extent(1) (seq) = 11, expected 12");
  dk = V4("dk", 2, 12, 2, 16);
  dout = V4("do", 2, 10, 4, 8);
  expect(run, "'dout'", "extent(3) (head_dim) = 8, expected 16");
  dout = V4("do", 2, 10, 4, 16);
  dq = V4("dq", 1, 10, 4, 16);
  expect(run, "'dq'", "extent(0) (batch) = 1, expected 2");
}
