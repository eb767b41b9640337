// SPDX-License-Identifier: Apache-2.0
// Bad input: every case throws blockattn::invalid_argument whose message names
// the argument and the expected value.
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

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
