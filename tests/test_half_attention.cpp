// SPDX-License-Identifier: Apache-2.0
// Single-device forward and backward with bf16 / fp16 storage (fp32 compute):
// against the fp64 reference of the rounded inputs within the documented
// bound, and bitwise against the fp32 kernels rounded once. Calls a fused
// provider takes (cuDNN on CUDA; the emulation with BLOCKATTN_EMULATE_FUSED)
// are held to the fused bound instead (fused_bound below) and compared with
// the same call on BlockAttn's kernels (portable_only). So are bf16 forwards
// on the host matrix engine (AMX, where the CPU has it: P rounded to bf16),
// whose call is then repeated on the fp32 kernels (HostMatrix::off).
#include <doctest/doctest.h>

#include <blockattn/blockattn.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "backend.hpp"
#include "forward_check.hpp"
#include "reference.hpp"

using namespace blockattn;
using namespace blockattn::test;

namespace {

// LayoutRight on every space (a GPU's default is LayoutLeft), so that on
// CUDA with cuDNN the calls reach the fused path (it needs a unit stride in
// the head dim); the strided cases below are sub-views of these.
template <class S>
using V4 = Kokkos::View<S****, Kokkos::LayoutRight, MemSpace>;
using L3 = Kokkos::View<float***, Kokkos::LayoutRight, MemSpace>;

/// Calls of this file that a fused provider computed, that ran on the host
/// matrix engine, and all calls.
struct FusedTally {
  long fused = 0, matrix = 0, calls = 0;
};
FusedTally fused_tally;
FusedTally backward_tally;  // the backward calls (matrix: on the host matrix engine)

/// Whether bf16 forwards of this backend run on the host matrix engine for
/// `setting`: a host space whose kernels dispatch to AVX-512, on a CPU and OS
/// with AMX (automatic) or AVX512-BF16 (avx512_bf16).
bool matrix_expected(HostMatrix setting = HostMatrix::automatic) {
  const HostMatrixEngine& e = impl::host_matrix_engine();
  const bool engine = setting == HostMatrix::automatic
                          ? e.amx || (e.vector_by_default && e.avx512_bf16)
                          : setting == HostMatrix::avx512_bf16 && e.avx512_bf16;
  return impl::is_host_space_v<ExecSpace> && dispatched_host_isa() == HostIsa::avx512 && engine;
}

/// Whether BlockAttn's tensor-core forward (CUDA, 16-bit) takes a call that
/// cuDNN did not: head dims 64 and 128, no score policy, tensor_cores on.
template <class S, class Mask>
bool tensor_core_expected(const Shape& s, bool fused, const ForwardOptions& opts) {
  return impl::flash_enabled<ExecSpace, S, Mask>() && !fused && opts.tensor_cores &&
         !opts.portable_only && (s.d == 64 || s.d == 128) && s.b > 0 && s.nq > 0 && s.nk > 0;
}

/// The bound of a fused provider's result: one rounding of an fp32 result
/// plus 16-bit rounding of the probabilities (and of dS in the backward)
/// before their products, as FlashAttention-style kernels do: at most
/// u16 * `scale` per element, where `scale` is max |V| (forward) or the
/// largest gradient entry (backward); twice that for margin.
template <class S>
double fused_bound(double e32, double x, double scale) {
  return rounded_bound<S>(e32, x) + 2.0 * S::unit_roundoff * scale;
}

/// max over elements of |got - want| / rounded_bound(e32, want) (fused:
/// fused_bound(e32, want, fused_scale)); false when got is not finite.
template <class S>
double worst_ratio(const HostTensor& got, const HostTensor& want, double e32, bool& finite,
                   bool fused = false, double fused_scale = 0.0) {
  double worst = 0.0;
  for (std::size_t i = 0; i < got.data.size(); ++i) {
    if (!std::isfinite(got.data[i])) finite = false;
    const double bound = fused ? fused_bound<S>(e32, want.data[i], fused_scale)
                               : rounded_bound<S>(e32, want.data[i]);
    worst = std::max(worst, std::abs(got.data[i] - want.data[i]) / bound);
  }
  return worst;
}

double max_abs(const HostTensor& t) {
  double m = 0.0;
  for (double x : t.data) m = std::max(m, std::abs(x));
  return m;
}

/// Copies a host tensor into a fresh View of T (no rounding beyond T's).
template <class T>
V4<T> make_view(const HostTensor& t, const char* name) {
  V4<T> v(std::string(name), t.b, t.n, t.h, t.d);
  HostTensor copy = t;
  upload(copy, v);
  return v;
}

/// right: LayoutRight Views; strided: sub-views of larger LayoutRight
/// allocations; left: LayoutLeft Views (the head dim strided: no tensor-core
/// or fused kernel takes them).
enum class Layout { right, strided, left };

const char* layout_name(Layout layout) {
  return layout == Layout::right ? "right" : layout == Layout::strided ? "strided" : "left";
}

/// Forward in S: O within the bound of one rounding of an fp32 result, LSE
/// within the fp32 bound, masked rows exact; and bitwise the fp32 forward on
/// the same (rounded) inputs, rounded once.
template <class S, class Mask>
ErrorReport run_forward(const Shape& s, const Mask& mask, Layout layout, std::uint64_t seed,
                        ForwardOptions opts = {}) {
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng);
  HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  const double scale = std::isnan(opts.scale) ? 1.0 / std::sqrt(double(s.d)) : opts.scale;
  V4<S> qd("q", s.b, s.nq, s.h, s.d), kd("k", s.b, s.nk, s.hkv, s.d),
      vd("v", s.b, s.nk, s.hkv, s.d);
  upload(q, qd);  // q, k, v now hold the rounded values
  upload(k, kd);
  upload(v, vd);
  HostTensor o16;
  Kokkos::View<float***, Kokkos::HostSpace> lse16;
  BlockPathCounts paths;
  opts.paths = &paths;
  // The call under test, on Views of any layout; O and the LSE back on the host.
  const auto run = [&](const auto& qx, const auto& kx, const auto& vx, const auto& ox,
                       const auto& lx) {
    attention_forward(ExecSpace{}, qx, kx, vx, ox, lx, mask, opts);
    o16 = download(ox);
    lse16 = to_host(lx);
  };
  if (layout == Layout::right) {
    run(qd, kd, vd, V4<S>("o", s.b, s.nq, s.h, s.d), L3("lse", s.b, s.h, s.nq));
  } else if (layout == Layout::left) {
    using VL = Kokkos::View<S****, Kokkos::LayoutLeft, MemSpace>;
    VL ql("q", s.b, s.nq, s.h, s.d), kl("k", s.b, s.nk, s.hkv, s.d), vl("v", s.b, s.nk, s.hkv, s.d),
        ol("o", s.b, s.nq, s.h, s.d);
    Kokkos::View<float***, Kokkos::LayoutLeft, MemSpace> ll("lse", s.b, s.h, s.nq);
    Kokkos::deep_copy(ql, qd);
    Kokkos::deep_copy(kl, kd);
    Kokkos::deep_copy(vl, vd);
    run(ql, kl, vl, ol, ll);
  } else {
    // Strided sub-views of larger allocations, inputs and outputs.
    const auto all = Kokkos::ALL;
    const auto dims = std::make_pair(0, s.d);
    V4<S> qb("q", s.b, s.nq, s.h + 1, s.d + 3), kb("k", s.b, s.nk, s.hkv + 2, s.d + 1),
        vb("v", s.b, s.nk, s.hkv + 1, s.d + 2), ob("o", s.b, s.nq, s.h + 2, s.d + 1);
    L3 lb("lse", s.b, s.h + 1, s.nq + 3);
    auto qs = Kokkos::subview(qb, all, all, std::make_pair(1, 1 + s.h), dims);
    auto ks = Kokkos::subview(kb, all, all, std::make_pair(2, 2 + s.hkv), dims);
    auto vs = Kokkos::subview(vb, all, all, std::make_pair(0, s.hkv), dims);
    auto os = Kokkos::subview(ob, all, all, std::make_pair(1, 1 + s.h), dims);
    auto ls = Kokkos::subview(lb, all, std::make_pair(1, 1 + s.h), std::make_pair(2, 2 + s.nq));
    auto qc = contiguous_like(qs), kc = contiguous_like(ks), vc = contiguous_like(vs);
    Kokkos::deep_copy(qc, qd);
    Kokkos::deep_copy(kc, kd);
    Kokkos::deep_copy(vc, vd);
    Kokkos::deep_copy(qs, qc);
    Kokkos::deep_copy(ks, kc);
    Kokkos::deep_copy(vs, vc);
    run(qs, ks, vs, os, ls);
  }
  Kokkos::fence();
  const ReferenceResult ref =
      reference_attention(q, k, v, mask, scale, opts.q_offset, opts.k_offset);
  ErrorReport err;
  {
    // The same comparison as the fp32/fp64 tests, for LSE and masked rows.
    V4<double> oh("o", s.b, s.nq, s.h, s.d);
    HostTensor copy = o16;
    upload(copy, oh);
    err = compare(ref, oh, lse16);
  }
  const double e32 = tolerance<float>(ref, s.d, s.nk);
  const bool fused = paths.fused > 0, matrix = paths.matrix > 0;
  CHECK(paths.fused + paths.portable == 1);
  // The matrix engine takes exactly the bf16 calls of host spaces where it
  // runs (and where the host kernels are the AVX-512 ones). Where the
  // tensor-core forward is built (CUDA; Kokkos::Serial under the emulator,
  // whose test turns the host engine off) it is that forward.
  if (!impl::flash_enabled<ExecSpace, S, Mask>()) {
    CHECK(matrix == (std::is_same<S, bf16>::value && matrix_expected(opts.host_matrix)));
  } else {
    // CUDA: the tensor-core forward takes what cuDNN does not, where its
    // conditions hold; contiguous Views of head dim 64 / 128 always meet them.
    const bool tc = tensor_core_expected<S, Mask>(s, fused, opts);
    CHECK((!matrix || tc));
    if (layout == Layout::right) CHECK(matrix == tc);
    if (layout == Layout::left) CHECK(!matrix);  // declined: the head dim is strided
  }
  fused_tally.fused += fused ? 1 : 0;
  fused_tally.matrix += matrix ? 1 : 0;
  ++fused_tally.calls;
  bool finite = true;
  // 16-bit P (fused providers, AMX): the fused bound.
  const double ratio = worst_ratio<S>(o16, ref.o, e32, finite, fused || matrix, max_abs(v));
  INFO(value_type_name<S>(), " ", describe(s), " ", layout_name(layout),
       (fused    ? " fused"
        : matrix ? " matrix"
                 : " portable"),
       " e32=", e32, " O err/bound=", ratio, " lse_err=", err.lse_err);
  CHECK(err.finite);
  CHECK(finite);
  CHECK(err.masked_rows_exact);
  CHECK(ratio <= 1.0);
  CHECK(err.lse_err <= e32);
  if (fused) return err;  // the bitwise property below is the portable path's
  if (matrix) {
    // The same call on the fp32 kernels, with its own checks (bitwise below).
    ForwardOptions fp32_products = opts;
    fp32_products.host_matrix = HostMatrix::off;
    fp32_products.tensor_cores = false;
    run_forward<S>(s, mask, layout, seed, fp32_products);
    return err;
  }

  // Bitwise: the fp32 forward of the same inputs, rounded once.
  V4<float> o32("o32", s.b, s.nq, s.h, s.d);
  L3 l32("lse32", s.b, s.h, s.nq);
  attention_forward(ExecSpace{}, make_view<float>(q, "q32"), make_view<float>(k, "k32"),
                    make_view<float>(v, "v32"), o32, l32, mask, opts);
  const HostTensor o32h = download(o32);
  auto l32h = to_host(l32);
  std::size_t o_diff = 0, l_diff = 0;
  for (std::size_t i = 0; i < o32h.data.size(); ++i)
    o_diff += static_cast<double>(S(float(o32h.data[i]))) != o16.data[i];
  for (int a = 0; a < s.b; ++a)
    for (int h = 0; h < s.h; ++h)
      for (int n = 0; n < s.nq; ++n) {
        const float x = l32h(a, h, n), y = lse16(a, h, n);
        l_diff += !(x == y || (std::isnan(x) && std::isnan(y)));
      }
  CHECK(o_diff == 0);
  CHECK(l_diff == 0);
  return err;
}

const Shape shapes[] = {
    {1, 1, 1, 1, 1, 64},     {1, 17, 33, 1, 1, 40},  {2, 64, 64, 2, 1, 64},
    {1, 130, 63, 4, 2, 128}, {1, 97, 97, 1, 1, 256}, {1, 193, 257, 2, 1, 128},
};

/// Documents of uneven lengths (1-token ones too) over [0, length).
std::vector<index_type> document_offsets(index_type length) {
  std::vector<index_type> off{0};
  for (index_type cut : {1, 2, 7, 40, 41, 100, 101, 190})
    if (cut < length) off.push_back(cut);
  off.push_back(length);
  return off;
}

/// Backward in S: every gradient within the bound of one rounding of the fp32
/// result (the fp32 bound: 1e-4 of the largest entry), against the fp64
/// gradients of the rounded inputs with rowsum(dO o O) formed from the O the
/// forward returned (as the kernels do); and bitwise the fp32 backward of the
/// same inputs (and the same O), rounded once.
template <class S, class Mask>
void run_backward(const Shape& s, const Mask& mask, std::uint64_t seed, ForwardOptions opts = {},
                  Layout layout = Layout::right) {
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng),
             k = random_tensor(s.b, s.nk, s.hkv, s.d, rng),
             v = random_tensor(s.b, s.nk, s.hkv, s.d, rng),
             dout = random_tensor(s.b, s.nq, s.h, s.d, rng);
  V4<S> qd("q", s.b, s.nq, s.h, s.d), kd("k", s.b, s.nk, s.hkv, s.d),
      vd("v", s.b, s.nk, s.hkv, s.d), od("o", s.b, s.nq, s.h, s.d), dod("do", s.b, s.nq, s.h, s.d);
  L3 ld("lse", s.b, s.h, s.nq);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
  BlockPathCounts paths;
  opts.paths = &paths;
  HostTensor g16[3];
  if (layout == Layout::right) {
    V4<S> dqd("dq", s.b, s.nq, s.h, s.d), dkd("dk", s.b, s.nk, s.hkv, s.d),
        dvd("dv", s.b, s.nk, s.hkv, s.d);
    attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd, mask, opts);
    g16[0] = download(dqd);
    g16[1] = download(dkd);
    g16[2] = download(dvd);
  } else {
    // Gradients into strided sub-views.
    const auto all = Kokkos::ALL;
    const auto dims = std::make_pair(1, 1 + s.d);
    V4<S> dqb("dq", s.b, s.nq, s.h + 1, s.d + 2), dkb("dk", s.b, s.nk, s.hkv + 2, s.d + 1),
        dvb("dv", s.b, s.nk, s.hkv + 1, s.d + 3);
    auto dqs = Kokkos::subview(dqb, all, all, std::make_pair(1, 1 + s.h), dims);
    auto dks = Kokkos::subview(dkb, all, all, std::make_pair(0, s.hkv), dims);
    auto dvs = Kokkos::subview(dvb, all, all, std::make_pair(1, 1 + s.hkv), dims);
    attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqs, dks, dvs, mask, opts);
    g16[0] = download(dqs);
    g16[1] = download(dks);
    g16[2] = download(dvs);
  }
  Kokkos::fence();
  const HostTensor o16 = download(od);
  const double scale = std::isnan(opts.scale) ? 1.0 / std::sqrt(double(s.d)) : opts.scale;
  const ReferenceGrads ref =
      reference_backward(q, k, v, dout, mask, scale, opts.q_offset, opts.k_offset, &o16);
  const HostTensor* want[3] = {&ref.dq, &ref.dk, &ref.dv};
  const char* names[3] = {"dq", "dk", "dv"};

  // fp32 backward of the same inputs and the same O and LSE.
  V4<float> q32 = make_view<float>(q, "q32"), k32 = make_view<float>(k, "k32"),
            v32 = make_view<float>(v, "v32"), o32 = make_view<float>(o16, "o32"),
            do32 = make_view<float>(dout, "do32"), dq32("dq32", s.b, s.nq, s.h, s.d),
            dk32("dk32", s.b, s.nk, s.hkv, s.d), dv32("dv32", s.b, s.nk, s.hkv, s.d);
  const bool fused = paths.fused > 0, matrix = paths.matrix > 0;
  CHECK(paths.fused + paths.portable == 1);
  // The backward's matrix engine: AMX tiles (P and dS in bf16) for bf16 on
  // host spaces where it runs; on CUDA the tensor-core backward, only where
  // asked for (it declines unaligned or strided operands); no other backend
  // has one.
  if (impl::flash_enabled<ExecSpace, S, Mask>())
    CHECK((!matrix || opts.tensor_core_backward));
  else
    CHECK(matrix == (impl::is_host_space_v<ExecSpace> && std::is_same<S, bf16>::value &&
                     matrix_expected(opts.host_matrix)));
  fused_tally.fused += fused ? 1 : 0;
  backward_tally.matrix += matrix ? 1 : 0;
  ++backward_tally.calls;
  ++fused_tally.calls;
  attention_backward(ExecSpace{}, q32, k32, v32, o32, ld, do32, dq32, dk32, dv32, mask, opts);
  const HostTensor g32[3] = {download(dq32), download(dk32), download(dv32)};

  for (int w = 0; w < 3; ++w) {
    double largest = 0.0;
    for (double x : want[w]->data) largest = std::max(largest, std::abs(x));
    const double e32 = 1e-4 * largest;  // the fp32 gradient bound (test_backward.cpp)
    bool finite = true;
    const double ratio = worst_ratio<S>(g16[w], *want[w], e32, finite, fused || matrix, largest);
    std::size_t diff = 0;
    for (std::size_t i = 0; i < g32[w].data.size(); ++i)
      diff += static_cast<double>(S(float(g32[w].data[i]))) != g16[w].data[i];
    INFO(value_type_name<S>(), " ", describe(s), " ", names[w],
         (fused    ? " fused"
          : matrix ? " matrix"
                   : " portable"),
         " err/bound=", ratio, " differing from rounded fp32: ", diff);
    CHECK(finite);
    CHECK(ratio <= 1.0);
    if (!fused && !matrix) CHECK(diff == 0);  // bitwise: the fp32 kernels' property
  }
  if (matrix) {
    // The same call on the fp32 kernels, with its own checks (bitwise above).
    opts.host_matrix = HostMatrix::off;
    opts.tensor_core_backward = false;
    opts.paths = nullptr;
    run_backward<S>(s, mask, seed, opts, layout);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("16-bit forward: every mask and layout, within one rounding of fp32", S, bf16,
                   fp16) {
  std::uint64_t seed = 300;
  for (const Shape& s : shapes) {
    ++seed;
    const Layout layout = seed % 2 ? Layout::strided : Layout::right;
    run_forward<S>(s, FullMask{}, layout, seed);
    run_forward<S>(s, CausalMask{}, layout, seed);
    run_forward<S>(s, SlidingWindowMask{20, 5}, layout, seed);
    run_forward<S>(s, PrefixLMMask{40}, layout, seed);
    const Documents<MemSpace> docs(document_offsets(s.nq > s.nk ? s.nq : s.nk));
    run_forward<S>(s, docs.mask(), layout, seed);
  }
  // Offsets (decode-like chunk), and rows that see no key.
  ForwardOptions opts;
  opts.q_offset = 150;
  run_forward<S>({1, 50, 200, 2, 1, 64}, CausalMask{}, Layout::right, 7, opts);
  opts.q_offset = 0;
  opts.k_offset = 100;
  const ErrorReport e =
      run_forward<S>({1, 180, 70, 2, 1, 64}, CausalMask{}, Layout::strided, 9, opts);
  CHECK(e.masked_rows == 2 * 100);
  // LayoutLeft Views (a GPU's default layout) at head dims the tensor-core
  // forward would take in LayoutRight.
  run_forward<S>({1, 70, 45, 2, 1, 64}, CausalMask{}, Layout::left, 11);
  const Documents<MemSpace> docs(document_offsets(97));
  run_forward<S>({1, 97, 97, 4, 2, 128}, docs.mask(), Layout::left, 12);
}

TEST_CASE_TEMPLATE("16-bit backward: every mask, within one rounding of fp32", S, bf16, fp16) {
  std::uint64_t seed = 700;
  const Shape bshapes[] = {{1, 1, 1, 1, 1, 64},
                           {1, 70, 45, 2, 1, 40},
                           {2, 64, 64, 2, 2, 64},
                           {1, 97, 130, 4, 2, 128},
                           {1, 50, 80, 1, 1, 200}};
  for (const Shape& s : bshapes) {
    run_backward<S>(s, FullMask{}, ++seed);
    run_backward<S>(s, CausalMask{}, ++seed);
    run_backward<S>(s, SlidingWindowMask{17, 9}, ++seed, {}, Layout::strided);
    run_backward<S>(s, PrefixLMMask{30}, ++seed);
    const Documents<MemSpace> docs(document_offsets(s.nq > s.nk ? s.nq : s.nk));
    run_backward<S>(s, docs.mask(), ++seed, {}, Layout::strided);
  }
  ForwardOptions opts;
  opts.q_offset = 100;
  opts.k_offset = 60;
  run_backward<S>({1, 66, 90, 2, 1, 64}, CausalMask{}, 77, opts);
}

TEST_CASE_TEMPLATE("16-bit backward on the tensor cores (ForwardOptions::tensor_core_backward)", S,
                   bf16, fp16) {
  // CUDA: BlockAttn's tensor-core backward where cuDNN does not take the call
  // (head dims 64 and 128, aligned rows). Elsewhere the option changes
  // nothing: skipped (the cases above cover those backends).
  if (!impl::flash_enabled<ExecSpace, S, FullMask>()) {
    MESSAGE("SKIPPED: this backend has no tensor-core backward");
    return;
  }
  const long before = backward_tally.matrix;
  ForwardOptions opts;
  opts.tensor_core_backward = true;
  std::uint64_t seed = 800;
  const Shape bshapes[] = {{1, 70, 45, 2, 1, 64}, {2, 64, 64, 2, 2, 64}, {1, 97, 130, 4, 2, 128}};
  for (const Shape& s : bshapes) {
    run_backward<S>(s, FullMask{}, ++seed, opts);
    run_backward<S>(s, CausalMask{}, ++seed, opts);
    run_backward<S>(s, PrefixLMMask{30}, ++seed, opts);
    const Documents<MemSpace> docs(document_offsets(s.nq > s.nk ? s.nq : s.nk));
    run_backward<S>(s, docs.mask(), ++seed, opts);
  }
  ForwardOptions offsets = opts;
  offsets.q_offset = 100;
  offsets.k_offset = 60;
  run_backward<S>({1, 66, 90, 2, 1, 64}, CausalMask{}, 78, offsets);
  MESSAGE("16-bit backward calls on the tensor cores: ", backward_tally.matrix - before);
  CHECK(backward_tally.matrix > before);
}

TEST_CASE("16-bit: the fused path ran where a provider is built in") {
  // After the forward and backward cases above (doctest runs a file's cases in order).
  MESSAGE("16-bit calls on the fused path: ", fused_tally.fused, " of ", fused_tally.calls);
  if (fused_available_v<ExecSpace, bf16>)
    CHECK(fused_tally.fused > 0);
  else
    CHECK(fused_tally.fused == 0);
}

TEST_CASE("16-bit: the host matrix engine ran where the CPU has it") {
  // After the forward cases above. Where the CPU (or the OS, or
  // BLOCKATTN_HOST_MATRIX=off) rules AMX out, its cases ran on the fp32
  // kernels: reported as skipped here, not passed.
  const HostMatrixEngine& e = impl::host_matrix_engine();
  MESSAGE("host matrix engine: ", std::string(e.name()),
          e.reason.empty() ? "" : " (" + e.reason + ")",
          "; bf16 forward calls on it: ", fused_tally.matrix, " of ", fused_tally.calls);
  if (impl::flash_enabled<ExecSpace, bf16, FullMask>()) {  // CUDA: the tensor-core forward
    MESSAGE("16-bit forward calls on the tensor cores: ", fused_tally.matrix);
    CHECK(fused_tally.matrix > 0);
    return;
  }
  MESSAGE("bf16 backward calls on it: ", backward_tally.matrix, " of ", backward_tally.calls);
  if (matrix_expected()) {
    CHECK(fused_tally.matrix > 0);
    CHECK(backward_tally.matrix > 0);
  } else {
    CHECK(fused_tally.matrix == 0);
    CHECK(backward_tally.matrix == 0);
    MESSAGE("SKIPPED: the matrix-engine forward and backward cases (", e.reason, ")");
  }
}

TEST_CASE("bf16 forward on AVX512-BF16 vector products (HostMatrix::avx512_bf16)") {
  // The vector engine (automatic's on AMD's CPUs, opt-in on others) on the
  // shapes of the forward cases, where the CPU has AVX512-BF16; the fp32
  // kernels (and the count says so) elsewhere.
  const long before = fused_tally.matrix;
  ForwardOptions opts;
  opts.host_matrix = HostMatrix::avx512_bf16;
  std::uint64_t seed = 900;
  for (const Shape& s : shapes) {
    ++seed;
    const Layout layout = seed % 2 ? Layout::strided : Layout::right;
    run_forward<bf16>(s, CausalMask{}, layout, seed, opts);
    const Documents<MemSpace> docs(document_offsets(s.nq > s.nk ? s.nq : s.nk));
    run_forward<bf16>(s, docs.mask(), layout, seed, opts);
  }
  if (matrix_expected(HostMatrix::avx512_bf16))
    CHECK(fused_tally.matrix > before);
  else
    MESSAGE("SKIPPED: the AVX512-BF16 cases (", impl::host_matrix_engine().reason, ")");
}

namespace {

/// The bf16 forward through launch_forward with the query tiles `split`
/// (host_matrix: the engine setting): O (as fp32 values) and LSE on the host.
template <class Mask>
std::pair<std::vector<float>, std::vector<float>> bf16_forward_split(
    const Shape& s, const Mask& mask, index_type q_offset, impl::QueryTiles split,
    HostMatrix host_matrix, std::uint64_t seed) {
  using TS = DefaultTileShape<float, impl::is_host_space_v<ExecSpace>>;
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng, 2.0);
  HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, 2.0);
  HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
  const V4<bf16> qd = make_view<bf16>(q, "q"), kd = make_view<bf16>(k, "k"),
                 vd = make_view<bf16>(v, "v");
  V4<bf16> od("o", s.b, s.nq, s.h, s.d);
  L3 ld("lse", s.b, s.h, s.nq);
  ExecSpace exec;
  const impl::ForwardExtents e{s.b, s.h, s.hkv, s.nq, s.nk, s.d};
  const float scale = 1.0f / std::sqrt(float(s.d));
  impl::with_shape_for<TS>(s.d, [&](auto static_d, auto shape) {
    constexpr int SD = decltype(static_d)::value;
    using Sh = decltype(shape);
    using Kernel = impl::ForwardKernel<ExecSpace, float, SD, Sh, Mask, OffsetPositions,
                                       OffsetPositions, bf16, bf16>;
    auto kv =
        impl::allocate_forward_kv<float, MemSpace, Sh, SD>(s.b, s.hkv, s.nk, Kernel::pad_dim(s.d));
    impl::pack_kv(exec, kd, vd, kv);
    impl::BlockStep<float, MemSpace> step;
    step.query_tiles = split;
    step.host_matrix = host_matrix;
    impl::launch_forward<ExecSpace, float, SD, Sh>(
        exec, e, qd, kv, od, ld, mask, OffsetPositions{q_offset}, OffsetPositions{0}, scale, step);
  });
  exec.fence();
  const HostTensor oh = download(od);
  auto lh = to_host(ld);
  return {std::vector<float>(oh.data.begin(), oh.data.end()),
          std::vector<float>(lh.data(), lh.data() + lh.span())};
}

/// Elements that differ (an exact zero of either sign counts as equal; NaN
/// where NaN).
int count_differences(const std::vector<float>& a, const std::vector<float>& b) {
  int n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += !(a[i] == b[i] || (a[i] != a[i] && b[i] != b[i]));
  return n;
}

}  // namespace

TEST_CASE("bf16 forward: query tiles cut at 32-row blocks give the same O and LSE") {
  // With few query tiles per thread, the matrix engine's tiles are cut at
  // whole 32-row blocks (balanced_query_tiles, granule 32). Each row's sums
  // run over the same keys in the same order whatever tile holds it: O and LSE
  // must not change, on the engine and on the fp32 kernels alike.
  using TS = DefaultTileShape<float, impl::is_host_space_v<ExecSpace>>;
  const Shape split_shapes[] = {
      {1, 200, 150, 2, 1, 64}, {2, 97, 300, 2, 2, 128}, {1, 33, 65, 1, 1, 64}};
  std::uint64_t seed = 1200;
  for (const HostMatrix setting : {HostMatrix::automatic, HostMatrix::off}) {
    for (const Shape& s : split_shapes) {
      ++seed;
      const Documents<MemSpace> docs(document_offsets(s.nq + 30));
      const int block_q = forward_tile_sizes<float, ExecSpace, TS>(s.d).block_q;
      if (block_q < 32) continue;  // a device shape with shorter tiles than one block
      const int groups = (s.nq + 31) / 32, per_tile = block_q / 32;
      for (int mask_kind = 0; mask_kind < 3; ++mask_kind)
        for (int tiles = (groups + per_tile - 1) / per_tile; tiles <= groups; ++tiles) {
          INFO(describe(s), " mask=", mask_kind, " tiles=", tiles,
               " engine=", setting == HostMatrix::off ? "off" : "automatic");
          auto run = [&](impl::QueryTiles t) {
            if (mask_kind == 0) return bf16_forward_split(s, FullMask{}, 0, t, setting, seed);
            if (mask_kind == 1) return bf16_forward_split(s, CausalMask{}, 30, t, setting, seed);
            return bf16_forward_split(s, docs.mask(), 30, t, setting, seed);
          };
          const auto whole = run({}), cut = run(impl::QueryTiles{tiles, groups, 32});
          CHECK(count_differences(whole.first, cut.first) == 0);
          CHECK(count_differences(whole.second, cut.second) == 0);
        }
    }
  }
}

TEST_CASE("bf16 forward: GQA heads packed into one set of rows give each head's own O and LSE") {
  // With few query rows (well under its 32-row blocks, or 40 and 48 rows) and
  // several query heads per kv head, the matrix engine computes a kv head's
  // query heads as one set of rows (impl::forward_packs_gqa). Each row's sums are its own: O and
  // LSE must be bit for bit those of one call per query head (one head: nothing packed), sinks
  // included; and the call must have packed where the engine runs.
  if (!impl::is_host_space_v<ExecSpace>) {
    MESSAGE("SKIPPED: the host matrix engine's packing (a device space)");
    return;
  }
  const Shape shapes[] = {{1, 1, 300, 4, 1, 64}, {2, 5, 97, 8, 2, 128}, {1, 13, 64, 6, 3, 64},
                          {1, 9, 1, 4, 2, 128},  {2, 3, 200, 2, 1, 80}, {1, 48, 100, 4, 2, 64},
                          {1, 40, 70, 8, 1, 64}};
  std::uint64_t seed = 1300;
  for (const Shape& s : shapes) {
    ++seed;
    std::mt19937_64 rng(seed);
    const HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng, 2.0);
    const HostTensor k = random_tensor(s.b, s.nk, s.hkv, s.d, rng, 2.0);
    const HostTensor v = random_tensor(s.b, s.nk, s.hkv, s.d, rng);
    const V4<bf16> qd = make_view<bf16>(q, "q"), kd = make_view<bf16>(k, "k"),
                   vd = make_view<bf16>(v, "v");
    Kokkos::View<float*, MemSpace> sinks("sinks", s.h);
    auto sh = Kokkos::create_mirror_view(sinks);
    for (int h = 0; h < s.h; ++h) sh(h) = 0.25f * float(h) - 0.5f;
    Kokkos::deep_copy(sinks, sh);
    const Documents<MemSpace> docs(document_offsets(s.nk));
    const index_type q_offset = s.nk - s.nq;  // the chunk at the end of the keys
    for (int mask_kind = 0; mask_kind < 5; ++mask_kind)
      for (const bool with_sinks : {false, true}) {
        INFO(describe(s), " mask=", mask_kind, " sinks=", with_sinks);
        ForwardOptions opts;
        opts.q_offset = q_offset;
        if (with_sinks) opts.sinks = sinks;
        auto call = [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov,
                        const auto& lv, const ForwardOptions& o) {
          switch (mask_kind) {
            case 0:
              attention_forward(ExecSpace{}, qv, kv, vv, ov, lv, FullMask{}, o);
              break;
            case 1:
              attention_forward(ExecSpace{}, qv, kv, vv, ov, lv, CausalMask{}, o);
              break;
            case 2:
              attention_forward(ExecSpace{}, qv, kv, vv, ov, lv, SlidingWindowMask{7, 0}, o);
              break;
            case 3:
              attention_forward(ExecSpace{}, qv, kv, vv, ov, lv, PrefixLMMask{9}, o);
              break;
            default:
              attention_forward(ExecSpace{}, qv, kv, vv, ov, lv, docs.mask(), o);
              break;
          }
        };
        V4<bf16> op("o", s.b, s.nq, s.h, s.d), o1("o1", s.b, s.nq, s.h, s.d);
        L3 lp("lse", s.b, s.h, s.nq), l1("lse1", s.b, s.h, s.nq);
        BlockPathCounts paths;
        opts.paths = &paths;
        call(qd, kd, vd, op, lp, opts);
        opts.paths = nullptr;
        CHECK(paths.matrix == (matrix_expected() ? 1 : 0));
        CHECK(impl::forward_packs_gqa(BlockExtents{s.b, s.h, s.hkv, s.nq, s.nk, s.d}));
        const int G = s.h / s.hkv;
        const auto all = Kokkos::ALL;
        for (int h = 0; h < s.h; ++h) {
          const auto one = std::make_pair(h, h + 1), kvh = std::make_pair(h / G, h / G + 1);
          ForwardOptions oh = opts;
          if (with_sinks) oh.sinks = Kokkos::subview(sinks, one);
          call(Kokkos::subview(qd, all, all, one, all), Kokkos::subview(kd, all, all, kvh, all),
               Kokkos::subview(vd, all, all, kvh, all), Kokkos::subview(o1, all, all, one, all),
               Kokkos::subview(l1, all, one, all), oh);
        }
        Kokkos::fence();
        const HostTensor a = download(op), b = download(o1);
        auto la = to_host(lp), lb = to_host(l1);
        CHECK(count_differences(std::vector<float>(a.data.begin(), a.data.end()),
                                std::vector<float>(b.data.begin(), b.data.end())) == 0);
        CHECK(count_differences(std::vector<float>(la.data(), la.data() + la.span()),
                                std::vector<float>(lb.data(), lb.data() + lb.span())) == 0);
      }
  }
}

TEST_CASE("host matrix engine: BLOCKATTN_HOST_MATRIX is parsed and named") {
  CHECK_FALSE(impl::detect_host_matrix_engine("off").amx);
  CHECK(impl::detect_host_matrix_engine("off").reason == "BLOCKATTN_HOST_MATRIX=off");
  try {
    (void)impl::detect_host_matrix_engine("tiles");
    FAIL("BLOCKATTN_HOST_MATRIX=tiles was accepted");
  } catch (const blockattn::invalid_argument& x) {
    const std::string what = x.what();
    CHECK(what.find("BLOCKATTN_HOST_MATRIX") != std::string::npos);
    CHECK(what.find("\"tiles\"") != std::string::npos);
  }
  // Unset and auto agree (the CPU decides: AMX, else the vectors on AMD's
  // CPUs); amx runs AMX or nothing; avx512bf16 makes the vector products
  // automatic's engine and never runs AMX.
  const HostMatrixEngine unset = impl::detect_host_matrix_engine(nullptr);
  const HostMatrixEngine amx_only = impl::detect_host_matrix_engine("amx");
  const HostMatrixEngine automatic = impl::detect_host_matrix_engine("auto");
  CHECK(unset.amx == amx_only.amx);
  CHECK(unset.amx == automatic.amx);
  CHECK(unset.vector_by_default == automatic.vector_by_default);
  CHECK(std::string(unset.name()) == automatic.name());
  CHECK_FALSE(amx_only.vector_by_default);
  CHECK_FALSE((unset.amx && unset.vector_by_default));
#if BLOCKATTN_HOST_AMX
  // Without AMX the vectors are automatic's engine exactly where the CPU has
  // them and is AMD's.
  if (!unset.amx && dispatched_host_isa() == HostIsa::avx512)
    CHECK(unset.vector_by_default ==
          (unset.avx512_bf16 && impl::avx512_bf16_default_reason().empty()));
  if (!unset.amx && unset.avx512_bf16 && !unset.vector_by_default)
    CHECK(unset.reason.find("avx512bf16") != std::string::npos);
#endif
  const HostMatrixEngine vec = impl::detect_host_matrix_engine("avx512bf16");
  CHECK_FALSE(vec.amx);
#if BLOCKATTN_HOST_AMX  // builds without the host engines' code (nvcc passes) report none
  CHECK(vec.vector_by_default);
#endif
  CHECK(vec.avx512_bf16 == unset.avx512_bf16);
  CHECK(std::string(vec.name()) == (vec.avx512_bf16 ? "avx512-bf16" : "none"));
  CHECK_FALSE(impl::detect_host_matrix_engine("off").avx512_bf16);
}

TEST_CASE("bf16 forward: inf and NaN in V where the mask hides them, and long rows") {
  // Partial tiles whose masked keys hold inf / NaN in V: P = 0 there must add
  // nothing (the matrix engine's products would make 0 * inf = NaN; such
  // tiles take the selecting fp32 path). SlidingWindowMask{40, 0}: key j is
  // seen by rows j .. j + 40 only.
  const int n = 300, d = 64;
  std::mt19937_64 rng(11);
  HostTensor q = random_tensor(1, n, 2, d, rng), k = random_tensor(1, n, 2, d, rng),
             v = random_tensor(1, n, 2, d, rng);
  v(0, 100, 0, 3) = std::numeric_limits<double>::infinity();
  v(0, 101, 1, 5) = std::numeric_limits<double>::quiet_NaN();
  V4<bf16> qd("q", 1, n, 2, d), kd("k", 1, n, 2, d), vd("v", 1, n, 2, d), od("o", 1, n, 2, d);
  L3 ld("lse", 1, 2, n);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  const SlidingWindowMask mask{40, 0};
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask);
  const HostTensor o = download(od);
  int wrong = 0;
  for (int i = 0; i < n; ++i)
    for (int x = 0; x < d; ++x) {
      // Head 0 sees inf at (100, 3) in rows 100 .. 140 (O inf or NaN in that
      // column), head 1 NaN at (101, 5) in rows 101 .. 141.
      const bool h0 = i >= 100 && i <= 140 && x == 3, h1 = i >= 101 && i <= 141 && x == 5;
      wrong += std::isfinite(o(0, i, 0, x)) == h0;
      wrong += std::isfinite(o(0, i, 1, x)) == h1;
    }
  CHECK(wrong == 0);
}

TEST_CASE("bf16 backward: inf and NaN reach the same gradients on the matrix engine as on fp32") {
  // One inf or NaN per head, in K, Q, dO and V, under a sliding window
  // (partial tiles along the band): the matrix engine's products would make
  // 0 * inf = NaN where the mask hides a pair, so those tile pairs select.
  // Its gradients must be non-finite exactly where the fp32 kernels' are.
  const int n = 200, d = 64, heads = 4;
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::mt19937_64 rng(12);
  HostTensor q = random_tensor(1, n, heads, d, rng), k = random_tensor(1, n, heads, d, rng),
             v = random_tensor(1, n, heads, d, rng), dout = random_tensor(1, n, heads, d, rng);
  k(0, 100, 0, 3) = inf;
  q(0, 120, 1, 5) = nan;
  dout(0, 90, 2, 7) = inf;
  v(0, 60, 3, 9) = nan;
  V4<bf16> qd("q", 1, n, heads, d), kd("k", 1, n, heads, d), vd("v", 1, n, heads, d),
      od("o", 1, n, heads, d), dod("do", 1, n, heads, d);
  L3 ld("lse", 1, heads, n);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  const SlidingWindowMask mask{40, 0};
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask);
  HostTensor grads[2][3];
  long on_matrix[2] = {0, 0};
  for (int run = 0; run < 2; ++run) {
    ForwardOptions opts;
    BlockPathCounts paths;
    opts.paths = &paths;
    opts.host_matrix = run == 0 ? HostMatrix::automatic : HostMatrix::off;
    V4<bf16> dqd("dq", 1, n, heads, d), dkd("dk", 1, n, heads, d), dvd("dv", 1, n, heads, d);
    attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dqd, dkd, dvd, mask, opts);
    grads[run][0] = download(dqd);
    grads[run][1] = download(dkd);
    grads[run][2] = download(dvd);
    on_matrix[run] = paths.matrix;
  }
  CHECK(on_matrix[0] == (matrix_expected() ? 1 : 0));
  CHECK(on_matrix[1] == 0);
  long differ = 0, nonfinite = 0, finite = 0;
  for (int w = 0; w < 3; ++w)
    for (std::size_t i = 0; i < grads[0][w].data.size(); ++i) {
      const bool a = std::isfinite(grads[0][w].data[i]), b = std::isfinite(grads[1][w].data[i]);
      differ += a != b;
      (b ? finite : nonfinite) += 1;
    }
  INFO("non-finite gradient entries (fp32 kernels): ", nonfinite, " finite: ", finite);
  CHECK(differ == 0);
  CHECK(nonfinite > 0);
  CHECK(finite > nonfinite);
  if (!matrix_expected())
    MESSAGE("SKIPPED: the matrix-engine side (", impl::host_matrix_engine().reason, ")");
}

namespace {

/// The bf16 backward twice: attention_backward (on the matrix engine its
/// operands are packed straight from the views) and the block-product seam
/// the distributed schedules call (fp32 blocks, then pack_amx_backward).
/// Gradients of the two that differ (NaN where NaN counts as equal).
template <class Mask>
long seam_differences(const Shape& s, const Mask& mask, index_type q_offset, bool strided,
                      bool poison, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostTensor q = random_tensor(s.b, s.nq, s.h, s.d, rng),
             k = random_tensor(s.b, s.nk, s.hkv, s.d, rng),
             v = random_tensor(s.b, s.nk, s.hkv, s.d, rng),
             dout = random_tensor(s.b, s.nq, s.h, s.d, rng);
  if (poison) {  // an inf or NaN in each operand, seen by some pairs
    q(0, s.nq / 2, 0, 1) = std::numeric_limits<double>::quiet_NaN();
    k(0, s.nk / 3, s.hkv - 1, 2) = std::numeric_limits<double>::infinity();
    dout(0, s.nq - 1, s.h - 1, 3) = -std::numeric_limits<double>::infinity();
    v(0, 5, 0, 4) = std::numeric_limits<double>::quiet_NaN();
  }
  // Inputs as sub-views of wider allocations (strided rows, offset heads) or contiguous.
  const auto all = Kokkos::ALL;
  const int pad = strided ? 1 : 0;
  V4<bf16> qb("q", s.b, s.nq, s.h + pad, s.d + 2 * pad), kb("k", s.b, s.nk, s.hkv + pad, s.d),
      vb("v", s.b, s.nk, s.hkv, s.d + pad), ob("o", s.b, s.nq, s.h, s.d + pad),
      dob("do", s.b, s.nq, s.h + pad, s.d);
  auto qd =
      Kokkos::subview(qb, all, all, std::make_pair(pad, pad + s.h), std::make_pair(pad, pad + s.d));
  auto kd = Kokkos::subview(kb, all, all, std::make_pair(0, s.hkv), all);
  auto vd = Kokkos::subview(vb, all, all, all, std::make_pair(0, s.d));
  auto od = Kokkos::subview(ob, all, all, all, std::make_pair(pad, pad + s.d));
  auto dod = Kokkos::subview(dob, all, all, std::make_pair(pad, pad + s.h), all);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  upload(dout, dod);
  L3 ld("lse", s.b, s.h, s.nq);
  ForwardOptions opts;
  opts.q_offset = q_offset;
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, mask, opts);
  HostTensor g[2][3];
  {
    V4<bf16> dq("dq", s.b, s.nq, s.h, s.d), dk("dk", s.b, s.nk, s.hkv, s.d),
        dv("dv", s.b, s.nk, s.hkv, s.d);
    attention_backward(ExecSpace{}, qd, kd, vd, od, ld, dod, dq, dk, dv, mask, opts);
    g[0][0] = download(dq);
    g[0][1] = download(dk);
    g[0][2] = download(dv);
  }
  {
    V4<bf16> dq("dq", s.b, s.nq, s.h, s.d), dk("dk", s.b, s.nk, s.hkv, s.d),
        dv("dv", s.b, s.nk, s.hkv, s.d);
    const BlockExtents e{s.b, s.h, s.hkv, s.nq, s.nk, s.d};
    const BlockLayout layout = backward_layout<float, ExecSpace>(s.d);
    BackwardBlockOptions blk;
    blk.operands_bf16 = true;
    const bool matrix = backward_uses_matrix<float, ExecSpace, Mask>(s.d, blk);
    const auto keys = allocate_backward_keys<float, ExecSpace>(layout, s.b, s.hkv, s.nk);
    pack_backward_keys(ExecSpace{}, kd, vd, keys);
    const auto rows = allocate_backward_queries<float, ExecSpace>(layout, s.b, s.h, s.nq);
    pack_backward_queries(ExecSpace{}, qd, dod, od, ld, rows, matrix);
    backward_block(ExecSpace{}, e, rows, keys, dq, dk, dv, mask, OffsetPositions{q_offset},
                   OffsetPositions{0}, 1.0f / std::sqrt(float(s.d)), blk);
    Kokkos::fence();
    g[1][0] = download(dq);
    g[1][1] = download(dk);
    g[1][2] = download(dv);
  }
  long differ = 0;
  for (int w = 0; w < 3; ++w)
    for (std::size_t i = 0; i < g[0][w].data.size(); ++i) {
      const double a = g[0][w].data[i], b = g[1][w].data[i];
      differ += !(a == b || (a != a && b != b));
    }
  return differ;
}

}  // namespace

TEST_CASE("bf16 backward: the engine's operands from the views give the seam's gradients") {
  // attention_backward packs the matrix engine's operands straight from the
  // bf16 views; the step loops' seam packs fp32 blocks first and repacks
  // them. Same bits in, same gradients out: bitwise, with GQA, strided
  // views, partial tiles, and inf / NaN inputs (the selecting tile pairs).
  // Where the CPU has no engine both run the fp32 kernels (still equal). Host
  // spaces: on a GPU attention_backward may take a vendor's fused call.
  if (!impl::is_host_space_v<ExecSpace>) return;
  const Shape seam_shapes[] = {
      {1, 200, 150, 4, 2, 64}, {2, 97, 130, 2, 2, 40}, {1, 70, 300, 2, 1, 128}};
  std::uint64_t seed = 1300;
  for (const Shape& s : seam_shapes)
    for (int mask_kind = 0; mask_kind < 3; ++mask_kind)
      for (int variant = 0; variant < 3; ++variant) {
        ++seed;
        const bool strided = variant == 1, poison = variant == 2;
        INFO(describe(s), " mask=", mask_kind, " strided=", strided, " inf/NaN=", poison);
        const Documents<MemSpace> docs(document_offsets(s.nq + 30));
        long differ = 0;
        if (mask_kind == 0) differ = seam_differences(s, FullMask{}, 0, strided, poison, seed);
        if (mask_kind == 1) differ = seam_differences(s, CausalMask{}, 30, strided, poison, seed);
        if (mask_kind == 2) differ = seam_differences(s, docs.mask(), 30, strided, poison, seed);
        CHECK(differ == 0);
      }
  if (!matrix_expected())
    MESSAGE("SKIPPED: the matrix-engine side (", impl::host_matrix_engine().reason, ")");
}

TEST_CASE_TEMPLATE("16-bit NaN inputs give NaN exactly where they are visible", S, bf16, fp16) {
  // One NaN in K at key 30, causal: rows >= 30 get NaN in O and LSE, rows < 30 are finite.
  const int n = 70, d = 64;
  std::mt19937_64 rng(5);
  HostTensor q = random_tensor(1, n, 1, d, rng), k = random_tensor(1, n, 1, d, rng),
             v = random_tensor(1, n, 1, d, rng);
  k(0, 30, 0, 7) = std::numeric_limits<double>::quiet_NaN();
  V4<S> qd("q", 1, n, 1, d), kd("k", 1, n, 1, d), vd("v", 1, n, 1, d), od("o", 1, n, 1, d);
  L3 ld("lse", 1, 1, n);
  upload(q, qd);
  upload(k, kd);
  upload(v, vd);
  attention_forward(ExecSpace{}, qd, kd, vd, od, ld, CausalMask{});
  const HostTensor o = download(od);
  auto l = to_host(ld);
  int wrong = 0;
  for (int i = 0; i < n; ++i) {
    const bool want_nan = i >= 30;
    wrong += std::isnan(l(0, 0, i)) != want_nan;
    for (int x = 0; x < d; ++x) wrong += std::isnan(o(0, i, 0, x)) != want_nan;
  }
  CHECK(wrong == 0);
}
