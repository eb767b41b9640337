// SPDX-License-Identifier: Apache-2.0
// Host-only: the index maths of the tensor-core kernels
// (kernel/cuda/flash_frag.hpp) against a lane-by-lane model of a warp's
// ldmatrix.x4 (plain and .trans) and mma.sync.m16n8k16, written from the
// PTX ISA's fragment tables independently of the helpers. Every product the
// forward and backward kernels make is one of two warp products:
//   X Y^T: X rows (A, ldsm_a) against the rows of a tile Y (B, ldsm_b);
//   P Y:   P from C fragments (c2a_*) against a tile Y read k-major (ldsm_bt);
// both checked here for head dims 64 and 128 against plain loops, exactly
// (small integers: every sum is exact in fp32). The same for the fp32
// kernel's mma.sync.m16n8k8 (.tf32) products (cuda/flash_forward_f32.hpp), whose
// P V reads V by 32-bit loads in a permuted key order. And the order in
// which the kernels' CTAs start (kernel/cuda/cta_order.hpp). No GPU needed.
#include <doctest/doctest.h>

#include <blockattn/kernel/cuda/cta_order.hpp>
#include <blockattn/kernel/cuda/flash_frag.hpp>

#include <algorithm>
#include <array>
#include <functional>
#include <queue>
#include <set>
#include <vector>

namespace {

namespace flash = blockattn::impl::flash;

using Reg = std::array<float, 2>;  // one 32-bit register: two 16-bit values
using Regs4 = std::array<Reg, 4>;

/// A (rows x D) matrix stored as the kernels store tiles in shared memory.
template <int D>
struct Tile {
  int rows;
  std::vector<float> mem;
  explicit Tile(int r) : rows(r), mem(std::size_t(r) * D, 0.0f) {}
  void set(int r, int c, float x) { mem[std::size_t(flash::swz<D>(r, c / 8) + c % 8)] = x; }
};

/// ldmatrix.x4 of a warp: lane L hands the element offset off[L] of one row
/// of 8 values; lanes 8i .. 8i + 7 give rows 0-7 of matrix i.
template <int D>
std::array<Regs4, 32> ldmatrix_x4(const Tile<D>& tile, const std::array<int, 32>& off, bool trans) {
  std::array<Regs4, 32> out{};
  for (int i = 0; i < 4; ++i)
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int j = 0; j < 2; ++j) {
        // M_i(r, c) = mem[off[8 i + r] + c]
        const int r = trans ? 2 * t + j : g, c = trans ? g : 2 * t + j;
        out[std::size_t(lane)][std::size_t(i)][std::size_t(j)] =
            tile.mem[std::size_t(off[std::size_t(8 * i + r)] + c)];
      }
    }
  return out;
}

/// mma.sync.m16n8k16 of a warp: c += a b, from the PTX fragment tables.
void mma(std::array<std::array<float, 4>, 32>& c, const std::array<Regs4, 32>& a,
         const std::array<std::array<Reg, 2>, 32>& b) {
  float A[16][16] = {}, B[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int j = 0; j < 2; ++j) {
      const auto& al = a[std::size_t(lane)];
      A[g][2 * t + j] = al[0][std::size_t(j)];
      A[g + 8][2 * t + j] = al[1][std::size_t(j)];
      A[g][2 * t + 8 + j] = al[2][std::size_t(j)];
      A[g + 8][2 * t + 8 + j] = al[3][std::size_t(j)];
      B[2 * t + j][g] = b[std::size_t(lane)][0][std::size_t(j)];
      B[2 * t + 8 + j][g] = b[std::size_t(lane)][1][std::size_t(j)];
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int e = 0; e < 4; ++e) {
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) sum += A[rows[e]][k] * B[k][cols[e]];
      c[std::size_t(lane)][std::size_t(e)] += sum;
    }
  }
}

/// B fragments of n-tile `half` (0 or 1) from an ldmatrix.x4 result.
std::array<std::array<Reg, 2>, 32> b_of(const std::array<Regs4, 32>& r, int half) {
  std::array<std::array<Reg, 2>, 32> b{};
  for (std::size_t lane = 0; lane < 32; ++lane) {
    b[lane][0] = r[lane][std::size_t(2 * half)];
    b[lane][1] = r[lane][std::size_t(2 * half + 1)];
  }
  return b;
}

template <class F>
std::array<int, 32> offsets(F&& f) {
  std::array<int, 32> off{};
  for (int lane = 0; lane < 32; ++lane) off[std::size_t(lane)] = f(lane);
  return off;
}

float value(int r, int c, int salt) {  // small integers: exact sums
  return float((r * 7 + c * 3 + salt) % 9 - 4);
}

/// S (16 x 64) = X (rows row0 .. row0 + 15 of tx) times the 64 rows of ty,
/// transposed: as the kernels compute Q K^T (and K Q^T, V dO^T, dO V^T).
template <int D>
void check_x_yt(int row0) {
  Tile<D> tx(64), ty(64);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < D; ++c) {
      tx.set(r, c, value(r, c, 1));
      ty.set(r, c, value(r, c, 5));
    }
  std::array<std::array<std::array<float, 4>, 32>, 8> s{};
  for (int kk = 0; kk < D / 16; ++kk) {
    const auto a = ldmatrix_x4(
        tx, offsets([&](int l) { return flash::frag_offset<D>(flash::ldsm_a(l), row0, 2 * kk); }),
        false);
    for (int p = 0; p < 4; ++p) {
      const auto r = ldmatrix_x4(ty, offsets([&](int l) {
                                   return flash::frag_offset<D>(flash::ldsm_b(l), 16 * p, 2 * kk);
                                 }),
                                 false);
      mma(s[std::size_t(2 * p)], a, b_of(r, 0));
      mma(s[std::size_t(2 * p + 1)], a, b_of(r, 1));
    }
  }
  int wrong = 0;
  for (int n = 0; n < 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const int row = flash::c_row(lane, e), col = 8 * n + flash::c_col(lane, e);
        float want = 0.0f;
        for (int d = 0; d < D; ++d) want += value(row0 + row, d, 1) * value(col, d, 5);
        wrong += s[std::size_t(n)][std::size_t(lane)][std::size_t(e)] != want;
      }
  CHECK(wrong == 0);
}

/// O (16 x D) = P (16 x 64, C fragments) times the 64 rows of ty: as the
/// kernels compute P V (and P^T dO, dS^T Q, dS K).
template <int D>
void check_p_y() {
  Tile<D> ty(64);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < D; ++c) ty.set(r, c, value(r, c, 2));
  // P's C fragments, placed by c_row / c_col.
  std::array<std::array<std::array<float, 4>, 32>, 8> p{};
  for (int n = 0; n < 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e)
        p[std::size_t(n)][std::size_t(lane)][std::size_t(e)] =
            value(flash::c_row(lane, e), 8 * n + flash::c_col(lane, e), 3);
  std::vector<std::array<std::array<float, 4>, 32>> o(std::size_t(D / 8));
  for (int ks = 0; ks < 4; ++ks) {
    std::array<Regs4, 32> pa{};
    for (std::size_t lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        const auto& c = p[std::size_t(2 * ks + flash::c2a_ntile(i))][lane];
        pa[lane][std::size_t(i)] = {c[std::size_t(flash::c2a_elem(i))],
                                    c[std::size_t(flash::c2a_elem(i) + 1)]};
      }
    for (int dp = 0; dp < D / 16; ++dp) {
      const auto r = ldmatrix_x4(ty, offsets([&](int l) {
                                   return flash::frag_offset<D>(flash::ldsm_bt(l), 16 * ks, 2 * dp);
                                 }),
                                 true);
      mma(o[std::size_t(2 * dp)], pa, b_of(r, 0));
      mma(o[std::size_t(2 * dp + 1)], pa, b_of(r, 1));
    }
  }
  int wrong = 0;
  for (int n = 0; n < D / 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const int row = flash::c_row(lane, e), col = 8 * n + flash::c_col(lane, e);
        float want = 0.0f;
        for (int k = 0; k < 64; ++k) want += value(row, k, 3) * value(k, col, 2);
        wrong += o[std::size_t(n)][std::size_t(lane)][std::size_t(e)] != want;
      }
  CHECK(wrong == 0);
}

/// The 8 rows of each ldmatrix matrix fall in 8 different 16-byte bank
/// groups (no bank conflict), for every 16 x 16 block a kernel reads.
template <int D, class F>
int conflicts(F&& rc_of) {
  int bad = 0;
  for (int row0 = 0; row0 < 64; row0 += 16)
    for (int chunk0 = 0; chunk0 < D / 8; chunk0 += 2)
      for (int i = 0; i < 4; ++i) {
        std::set<int> groups;
        for (int r = 0; r < 8; ++r) {
          const int off = flash::frag_offset<D>(rc_of(8 * i + r), row0, chunk0);
          groups.insert((off * 2 / 16) % 8);
        }
        bad += groups.size() != 8;
      }
  return bad;
}

// ---- fp32 values, mma.sync.m16n8k8 (.tf32): cuda/flash_forward_f32.hpp ------------

using Frag4 = std::array<std::array<float, 4>, 32>;  // 4 registers of each lane
using Frag2 = std::array<std::array<float, 2>, 32>;

/// A (rows x D) fp32 matrix stored as the fp32 kernel stores tiles.
template <int D>
struct Tile32 {
  std::vector<float> mem;
  explicit Tile32(int rows) : mem(std::size_t(rows) * D, 0.0f) {}
  void set(int r, int c, float x) { mem[std::size_t(flash::swz32<D>(r, c / 4) + c % 4)] = x; }
};

/// ldmatrix.x4 (.b16, no .trans) of 32-bit values: a matrix row is 16 bytes,
/// 4 values; lane L receives bytes 4t .. 4t + 3 of row g of matrix i.
template <int D>
Frag4 ldmatrix_x4_32(const Tile32<D>& tile, const std::array<int, 32>& off) {
  Frag4 out{};
  for (int i = 0; i < 4; ++i)
    for (int lane = 0; lane < 32; ++lane)
      out[std::size_t(lane)][std::size_t(i)] =
          tile.mem[std::size_t(off[std::size_t(8 * i + lane / 4)] + lane % 4)];
  return out;
}

/// mma.sync.m16n8k8 .tf32 of a warp: c += a b, from the PTX fragment tables.
void mma32(Frag4& c, const Frag4& a, const Frag2& b) {
  float A[16][8] = {}, B[8][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const auto& al = a[std::size_t(lane)];
    A[g][t] = al[0];
    A[g + 8][t] = al[1];
    A[g][t + 4] = al[2];
    A[g + 8][t + 4] = al[3];
    B[t][g] = b[std::size_t(lane)][0];
    B[t + 4][g] = b[std::size_t(lane)][1];
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int e = 0; e < 4; ++e) {
      float sum = 0.0f;
      for (int k = 0; k < 8; ++k) sum += A[rows[e]][k] * B[k][cols[e]];
      c[std::size_t(lane)][std::size_t(e)] += sum;
    }
  }
}

Frag2 b32_of(const Frag4& r, int half) {
  Frag2 b{};
  for (std::size_t lane = 0; lane < 32; ++lane)
    b[lane] = {r[lane][std::size_t(2 * half)], r[lane][std::size_t(2 * half + 1)]};
  return b;
}

/// S (16 x 64) = X (rows row0 ..) Y^T in fp32: Q K^T of the fp32 kernel.
template <int D>
void check_x_yt32(int row0) {
  Tile32<D> tx(64), ty(64);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < D; ++c) {
      tx.set(r, c, value(r, c, 1));
      ty.set(r, c, value(r, c, 5));
    }
  std::array<Frag4, 8> s{};
  for (int kk = 0; kk < D / 8; ++kk) {
    const Frag4 a = ldmatrix_x4_32(tx, offsets([&](int l) {
                                     return flash::frag32_offset<D>(flash::ldsm_a(l), row0, 2 * kk);
                                   }));
    for (int p = 0; p < 4; ++p) {
      const Frag4 r =
          ldmatrix_x4_32(ty, offsets([&](int l) {
                           return flash::frag32_offset<D>(flash::ldsm_b(l), 16 * p, 2 * kk);
                         }));
      mma32(s[std::size_t(2 * p)], a, b32_of(r, 0));
      mma32(s[std::size_t(2 * p + 1)], a, b32_of(r, 1));
    }
  }
  int wrong = 0;
  for (int n = 0; n < 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const int row = flash::c_row(lane, e), col = 8 * n + flash::c_col(lane, e);
        float want = 0.0f;
        for (int d = 0; d < D; ++d) want += value(row0 + row, d, 1) * value(col, d, 5);
        wrong += s[std::size_t(n)][std::size_t(lane)][std::size_t(e)] != want;
      }
  CHECK(wrong == 0);
}

/// O (16 x D) = P (16 x 64, C fragments) Y in fp32, through c2a32 and
/// pv32_offset: P V of the fp32 kernel.
template <int D>
void check_p_y32() {
  Tile32<D> ty(64);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < D; ++c) ty.set(r, c, value(r, c, 2));
  std::array<Frag4, 8> p{};
  for (int n = 0; n < 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e)
        p[std::size_t(n)][std::size_t(lane)][std::size_t(e)] =
            value(flash::c_row(lane, e), 8 * n + flash::c_col(lane, e), 3);
  std::vector<Frag4> o(std::size_t(D / 8));
  for (int ks = 0; ks < 8; ++ks) {
    Frag4 pa{};
    for (std::size_t lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i)
        pa[lane][std::size_t(i)] = p[std::size_t(ks)][lane][std::size_t(flash::c2a32(i))];
    for (int n = 0; n < D / 8; ++n) {
      Frag2 b{};
      for (int lane = 0; lane < 32; ++lane)
        for (int i = 0; i < 2; ++i)
          b[std::size_t(lane)][std::size_t(i)] =
              ty.mem[std::size_t(flash::pv32_offset<D>(lane, i, 8 * ks, 8 * n))];
      mma32(o[std::size_t(n)], pa, b);
    }
  }
  int wrong = 0;
  for (int n = 0; n < D / 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const int row = flash::c_row(lane, e), col = 8 * n + flash::c_col(lane, e);
        float want = 0.0f;
        for (int k = 0; k < 64; ++k) want += value(row, k, 3) * value(k, col, 2);
        wrong += o[std::size_t(n)][std::size_t(lane)][std::size_t(e)] != want;
      }
  CHECK(wrong == 0);
}

/// Bank conflicts of the fp32 kernel's shared-memory reads: each ldmatrix
/// matrix's 8 rows in 8 different 16-byte bank groups, and each 32-bit load
/// of V's B fragments in 32 different banks.
template <int D, class F>
int conflicts32(F&& rc_of) {
  int bad = 0;
  for (int row0 = 0; row0 < 64; row0 += 16)
    for (int chunk0 = 0; chunk0 < D / 4; chunk0 += 2)
      for (int i = 0; i < 4; ++i) {
        std::set<int> groups;
        for (int r = 0; r < 8; ++r)
          groups.insert((flash::frag32_offset<D>(rc_of(8 * i + r), row0, chunk0) / 4) % 8);
        bad += groups.size() != 8;
      }
  return bad;
}
template <int D>
int pv_conflicts32() {
  int bad = 0;
  for (int ks = 0; ks < 8; ++ks)
    for (int n = 0; n < D / 8; ++n)
      for (int i = 0; i < 2; ++i) {
        std::set<int> banks;
        for (int lane = 0; lane < 32; ++lane)
          banks.insert(flash::pv32_offset<D>(lane, i, 8 * ks, 8 * n) % 32);
        bad += banks.size() != 32;
      }
  return bad;
}

}  // namespace

TEST_CASE("tensor-core fragments: swizzled rows hold every chunk once") {
  for (int r = 0; r < 64; ++r) {
    std::set<int> seen64, seen128;
    for (int c = 0; c < 8; ++c) seen64.insert(flash::swz<64>(r, c) - r * 64);
    for (int c = 0; c < 16; ++c) seen128.insert(flash::swz<128>(r, c) - r * 128);
    CHECK(seen64.size() == 8);
    CHECK(seen128.size() == 16);
    CHECK(*seen64.rbegin() == 56);
    CHECK(*seen128.rbegin() == 120);
  }
}

TEST_CASE("tensor-core fragments: C layout as the PTX table gives it") {
  for (int lane = 0; lane < 32; ++lane) {
    CHECK(flash::c_row(lane, 0) == lane / 4);
    CHECK(flash::c_row(lane, 3) == lane / 4 + 8);
    CHECK(flash::c_col(lane, 1) == 2 * (lane % 4) + 1);
    CHECK(flash::c_col(lane, 2) == 2 * (lane % 4));
  }
}

TEST_CASE("tensor-core fragments: X Y^T through ldsm_a and ldsm_b, exact") {
  for (int row0 : {0, 16, 48}) {
    check_x_yt<64>(row0);
    check_x_yt<128>(row0);
  }
}

TEST_CASE("tensor-core fragments: P Y through c2a and ldsm_bt (.trans), exact") {
  check_p_y<64>();
  check_p_y<128>();
}

TEST_CASE("tensor-core fragments: ldmatrix reads are free of bank conflicts") {
  CHECK(conflicts<64>(flash::ldsm_a) == 0);
  CHECK(conflicts<64>(flash::ldsm_b) == 0);
  CHECK(conflicts<64>(flash::ldsm_bt) == 0);
  CHECK(conflicts<128>(flash::ldsm_a) == 0);
  CHECK(conflicts<128>(flash::ldsm_b) == 0);
  CHECK(conflicts<128>(flash::ldsm_bt) == 0);
}

TEST_CASE("tensor-core fragments, fp32 (m16n8k8): X Y^T through ldsm_a and ldsm_b, exact") {
  for (int row0 : {0, 16, 48}) {
    check_x_yt32<64>(row0);
    check_x_yt32<128>(row0);
  }
}

TEST_CASE("tensor-core fragments, fp32 (m16n8k8): P Y through c2a32 and pv32_offset, exact") {
  check_p_y32<64>();
  check_p_y32<128>();
}

TEST_CASE("tensor-core fragments, fp32 (m16n8k8): shared-memory reads free of bank conflicts") {
  CHECK(conflicts32<64>(flash::ldsm_a) == 0);
  CHECK(conflicts32<64>(flash::ldsm_b) == 0);
  CHECK(conflicts32<128>(flash::ldsm_a) == 0);
  CHECK(conflicts32<128>(flash::ldsm_b) == 0);
  CHECK(pv_conflicts32<64>() == 0);
  CHECK(pv_conflicts32<128>() == 0);
}

// ---- The CTAs' order (cta_order.hpp) ------------------------------------------

TEST_CASE("CTA order: FastDiv divides exactly") {
  std::vector<int> ds, ns;
  for (int d = 1; d <= 300; ++d) ds.push_back(d);
  for (int e = 9; e <= 30; ++e)
    for (int o : {-1, 0, 1}) ds.push_back((1 << e) + o);
  ds.push_back(0x7fffffff);
  for (int n = 0; n <= 2000; ++n) ns.push_back(n);
  for (int e = 11; e <= 30; ++e)
    for (int o : {-3, -1, 0, 1, 7}) ns.push_back((1 << e) + o);
  ns.push_back(0x7ffffffe);
  ns.push_back(0x7fffffff);
  long long bad = 0;
  for (int d : ds) {
    const flash::FastDiv f(d);
    for (int n : ns) bad += f.div(n) != n / d;
    for (int k : {1, 2, 3, 1000, 65535})  // multiples of d and their neighbours
      for (int o : {-1, 0, 1}) {
        const long long n = static_cast<long long>(k) * d + o;
        if (n >= 0 && n <= 0x7fffffff) bad += f.div(int(n)) != int(n) / d;
      }
  }
  CHECK(bad == 0);
}

namespace {
/// The CTAs of an order in the order a GPU starts them (x fastest, then y,
/// then z; launch after launch): (block, batch, head), idle ones skipped.
std::vector<flash::CtaTile> started(flash::CtaOrder o, bool longest_last, int* idle = nullptr) {
  std::vector<flash::CtaTile> out;
  for (o.rank_offset = 0; o.rank_offset < o.blocks; o.rank_offset += flash::max_ranks) {
    const flash::CtaGrid g = flash::cta_grid_extents(o);
    for (int z = 0; z < g.z; ++z)
      for (int y = 0; y < g.y; ++y)
        for (int x = 0; x < g.x; ++x) {
          const flash::CtaTile c = flash::cta_tile(o, x, y, z, longest_last);
          if (c.live)
            out.push_back(c);
          else if (idle)
            ++*idle;
        }
  }
  return out;
}
}  // namespace

TEST_CASE(
    "CTA order: every (block, batch, head) once, groups of consecutive units, longest first") {
  for (int blocks : {1, 2, 3, 7, 32})
    for (int batch : {1, 2, 3})
      for (int heads : {1, 2, 5, 16})
        for (int group = 1; group <= batch * heads; ++group)
          for (bool last : {true, false}) {
            CAPTURE(blocks);
            CAPTURE(batch);
            CAPTURE(heads);
            CAPTURE(group);
            CAPTURE(last);
            flash::CtaOrder o;
            REQUIRE(flash::cta_order(blocks, batch, heads, group, o));
            int idle = 0;
            const std::vector<flash::CtaTile> cs = started(o, last, &idle);
            const int units = batch * heads;
            std::vector<int> seen(std::size_t(blocks) * units, 0);
            int bad_range = 0, bad_group = 0, bad_rank = 0, prev_group = -1, prev_rank = -1;
            for (const flash::CtaTile& c : cs) {
              if (c.block < 0 || c.block >= blocks || c.batch < 0 || c.batch >= batch ||
                  c.head < 0 || c.head >= heads) {
                ++bad_range;
                continue;
              }
              const int unit = c.batch * heads + c.head;
              ++seen[std::size_t(unit) * blocks + c.block];
              // Groups in order, each a run of consecutive units; ranks
              // non-decreasing within a group.
              const int g = unit / group, rank = last ? blocks - 1 - c.block : c.block;
              if (g < prev_group) ++bad_group;
              if (g == prev_group && rank < prev_rank) ++bad_rank;
              if (g != prev_group) prev_rank = -1;
              prev_group = g;
              prev_rank = rank;
            }
            CHECK(bad_range == 0);
            CHECK(bad_group == 0);
            CHECK(bad_rank == 0);
            CHECK(std::count(seen.begin(), seen.end(), 1) == blocks * units);
            // Idle places: only the last group's missing units, in each rank.
            CHECK(idle == ((units + group - 1) / group * group - units) * blocks);
          }
}

TEST_CASE("CTA order: a group of 1 is the unit-by-unit order (longest block of each unit first)") {
  const int blocks = 5, batch = 2, heads = 3;
  flash::CtaOrder o;
  REQUIRE(flash::cta_order(blocks, batch, heads, 1, o));
  const std::vector<flash::CtaTile> cs = started(o, true), ds = started(o, false);
  REQUIRE(cs.size() == std::size_t(blocks * batch * heads));
  for (int i = 0; i < int(cs.size()); ++i) {
    CHECK(cs[std::size_t(i)].batch * heads + cs[std::size_t(i)].head == i / blocks);
    CHECK(cs[std::size_t(i)].block == blocks - 1 - i % blocks);
    CHECK(ds[std::size_t(i)].block == i % blocks);
  }
}

TEST_CASE("CTA order: CUDA's grid limits (65535 in y and z)") {
  // More ranks than a grid's y: several launches, every block once.
  flash::CtaOrder o;
  REQUIRE(flash::cta_order(70000, 1, 2, 2, o));
  const std::vector<flash::CtaTile> cs = started(o, true);
  CHECK(cs.size() == std::size_t(140000));
  std::vector<int> seen(140000, 0);
  for (const flash::CtaTile& c : cs) ++seen[std::size_t(c.head) * 70000 + c.block];
  CHECK(std::count(seen.begin(), seen.end(), 1) == 140000);
  // More units than a grid's z at group 1: groups grow so that z fits.
  REQUIRE(flash::cta_order(3, 70000, 2, 1, o));
  CHECK(flash::cta_grid_extents(o).z <= 65535);
  CHECK(flash::cta_grid_extents(o).y == 3);
  CHECK(long(o.group) * flash::cta_grid_extents(o).z >= 140000L);
  // Beyond 2^31 - 1 units or blocks: refused.
  CHECK_FALSE(flash::cta_order(3, 65536, 65536, 1, o));
  CHECK_FALSE(flash::cta_order(0x80000000LL, 1, 1, 1, o));
}

TEST_CASE("CTA order: cta_group, one group unless its units would run fewer than ~8 CTAs each") {
  for (int units = 1; units <= 300; ++units)
    for (long long slots : {0LL, 1LL, 8LL, 64LL, 132LL, 264LL, 1056LL}) {
      const int g = flash::cta_group(units, slots);
      CAPTURE(units);
      CAPTURE(slots);
      CHECK(g >= 1);
      CHECK(g <= units);
      const long long cap = std::max(1LL, slots / 8);
      if (slots <= 0) CHECK(g == 1);
      if (slots > 0 && units <= cap) CHECK(g == units);
      if (slots > 0) CHECK(g <= cap);
      // Equal groups: as few as the cap allows.
      if (slots > 0) CHECK((units + g - 1) / g == (units + cap - 1) / cap);
    }
}

namespace {
/// Greedy list scheduling of a grid on `slots` (a slot takes the next CTA in
/// start order when it frees up): the makespan, each CTA's time its work.
double makespan(const std::vector<double>& work, int slots) {
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (int i = 0; i < slots; ++i) free_at.push(0.0);
  double end = 0.0;
  for (double w : work) {
    const double t = free_at.top() + w;
    free_at.pop();
    free_at.push(t);
    end = std::max(end, t);
  }
  return end;
}

/// The grid's efficiency (work / (slots x makespan)) of a causal forward
/// (B = 1): query block i of `rows` rows costs its (i + 1) * rows keys.
double causal_efficiency(int n, int rows, int heads, int slots, int group) {
  flash::CtaOrder o;
  REQUIRE(flash::cta_order(n / rows, 1, heads, group, o));
  std::vector<double> work;
  double total = 0.0;
  for (const flash::CtaTile& c : started(o, true)) {
    work.push_back(double(c.block + 1) * rows);
    total += work.back();
  }
  return total / (double(slots) * makespan(work, slots));
}
}  // namespace

TEST_CASE("CTA order: on a model of a GPU, cta_group's order ends a causal grid evenly") {
  // 132 SMs x 2 CTAs (an H100 / H200 with the wide forward), B = 1, H = 16,
  // 128-row blocks: unit by unit the grid ends on long blocks (0.62 at
  // N = 4096); in cta_group's order, >= 0.97.
  for (int n : {4096, 8192, 16384}) {
    CAPTURE(n);
    const double before = causal_efficiency(n, 128, 16, 264, 1);
    const double now = causal_efficiency(n, 128, 16, 264, flash::cta_group(16, 264));
    CHECK(now >= 0.97);
    CHECK(now >= before);
    if (n == 4096) CHECK(before < 0.7);
  }
  // Wherever the grid is over twice the slots: 64- and 128-row blocks, 8-128
  // units, 1-4 CTAs per SM: >= 0.96 (16 blocks of 2048 rows: 0.97).
  for (int slots : {132, 264, 528})
    for (int rows : {64, 128})
      for (int units : {8, 16, 32, 64, 128})
        for (int n : {2048, 4096, 8192, 16384}) {
          if ((n / rows) * units <= 2 * slots) continue;
          CAPTURE(slots);
          CAPTURE(rows);
          CAPTURE(units);
          CAPTURE(n);
          CHECK(causal_efficiency(n, rows, units, slots, flash::cta_group(units, slots)) >= 0.96);
        }
}
