// SPDX-License-Identifier: Apache-2.0
// The tensor-core forward (kernel/cuda/flash_forward.hpp) on a GPU: checks
// against an fp64 reference and, with --bench, its speed next to PyTorch's.
//
//   blockattn_flash_check                 every check case; exit 0 / 1, 77 without a GPU
//   blockattn_flash_check --bench [--torch FILE] [--reps R]   (forward, "bwd" rows, then fp32)
//   --variant regs|smem|wide   only that kernel variant (default: all three)
//   --half bf16|fp16           the 16-bit forward and backward cases of that type only
//                              (default: both; the fp32 cases run either way)
//
// Checks: bf16 and fp16, head dims 64 and 128, GQA, lengths that are not
// multiples of the tiles, position maps with offsets and two pieces (a
// zigzag rank's), the full, causal, sliding-window, prefix-LM and document
// masks, rows that see no key (O = 0, LSE = -inf exactly), a NaN in Q (NaN
// in its row only). O and LSE are poisoned (NaN) before each call, so an
// element the kernel does not write fails. Tolerance: P is rounded to the
// storage type before P V and O once at the end, each a relative error of at
// most u (2^-8 bf16, 2^-11 fp16): |O - O_ref| <= 2 u max|V| + 1e-6; the
// scores are exact products summed in fp32: |LSE - LSE_ref| <= 1e-3.
//
// The tensor-core backward (cuda/flash_backward.hpp) on the same cases
// (finite inputs: the library sends others to the fp32 kernels), from the
// forward's own O and LSE, against fp64 gradients of the same 16-bit inputs,
// per element: P carries a relative error rp = u + 2e-3 (its rounding before
// P^T dO, the forward's LSE within 1e-3, exp2.approx), dS = P (dP - Δ) then
// eS = P (rp |dP - Δ| + 1e-5 (Σ|dO||V| + Σ|dO||O|)) + u |dS| (dP and Δ are
// fp32 sums of exact products; dS rounded before its products), and
//   |dV - ref| <= 2 Σ_i rp P |dO| + 1e-5,
//   |dK - ref| <= 2 scale Σ_i eS |Q| + 1e-5,  |dQ - ref| <= 2 scale Σ_j eS |K| + 1e-5;
// rows that see no key get dQ = 0 and keys no row sees dK = dV = 0, exactly.
// dQ, dK, dV are poisoned (NaN) before the call.
//
// Then the fp32 tensor-core forward (cuda/flash_forward_f32.hpp), its cases and
// bounds in cuda_flash_f32_check.cpp.
//
// The same program runs without a GPU as blockattn_flash_emulated (ctest
// flash_emulated*): compiled for the host with BLOCKATTN_CUDA_EMULATION
// against tests/cuda_emu, which runs the kernels' source on a model of warps,
// ldmatrix, mma.sync, cp.async and barriers (cuda_emu/cuda_emu.hpp); checks
// only there (its times are not a GPU's).
#include <blockattn/kernel/cuda/flash_backward.hpp>
#include <blockattn/kernel/cuda/flash_forward.hpp>
#include <blockattn/policy/document_mask.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>

#include "../tools/torch_rates.hpp"
#include "cuda_flash_common.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace blockattn_flash_test;
using blockattn::index_type;
namespace flash = blockattn::impl::flash;

flash::Variant variant = flash::Variant::regs;  // the kernel variant under check
std::vector<flash::Variant> variants{flash::Variant::regs, flash::Variant::smem,
                                     flash::Variant::wide};  // --variant

std::uint16_t to_bits(float x, bool bf16) {
  if (bf16) return __nv_bfloat16_raw(__float2bfloat16_rn(x)).x;
  return __half_raw(__float2half_rn(x)).x;
}
float from_bits(std::uint16_t u, bool bf16) {
  if (bf16) {
    __nv_bfloat16_raw r;
    r.x = u;
    return __bfloat162float(__nv_bfloat16(r));
  }
  __half_raw r;
  r.x = u;
  return __half2float(__half(r));
}

/// What a check plants in its inputs.
enum class Plant { none, nan_q, bad_v };

template <bool IsBf16, class Mask, class QPos, class KPos>
bool check(const char* name, const Shape& s, const Mask& mask, const QPos& qpos, const KPos& kpos,
           std::uint64_t seed, Plant plant = Plant::none) {
  const bool nan_in_q = plant == Plant::nan_q;
  const bool bf = IsBf16;
  const std::size_t nq = std::size_t(s.batch) * s.queries * s.heads * s.dim;
  const std::size_t nk = std::size_t(s.batch) * s.keys * s.kv_heads * s.dim;
  std::vector<std::uint16_t> q(nq), k(nk), v(nk);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& x : q) x = to_bits(2.0f * u(rng), bf);  // scores of a few units
  for (auto& x : k) x = to_bits(2.0f * u(rng), bf);
  double vmax = 0.0;
  for (auto& x : v) {
    x = to_bits(u(rng), bf);
    vmax = std::max(vmax, std::abs(double(from_bits(x, bf))));
  }  // (before the planted inf / NaN: the bound is over finite values)
  // A NaN in Q at (batch 0, row nan_row, head 0, dim 3).
  const int nan_row = s.queries / 2;
  if (nan_in_q) q[(std::size_t(0) * s.queries + nan_row) * s.heads * s.dim + 3] = to_bits(NAN, bf);
  // inf and NaN in V (batch 0, kv head 0) at keys 70 and 71 (dims 5 and 9):
  // NaN / inf exactly in the rows that see them, hidden from the others.
  if (plant == Plant::bad_v) {
    v[(std::size_t(70) * s.kv_heads) * s.dim + 5] = to_bits(INFINITY, bf);
    v[(std::size_t(71) * s.kv_heads) * s.dim + 9] = to_bits(NAN, bf);
  }

  DeviceBuffer<std::uint16_t> dq(nq), dk(nk), dv(nk), dout(nq);
  DeviceBuffer<float> dlse(std::size_t(s.batch) * s.heads * s.queries);
  CUDA_OK(cudaMemcpy(dq.p, q.data(), nq * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dk.p, k.data(), nk * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dv.p, v.data(), nk * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dout.p, 0xff, nq * 2));  // NaN in both types
  CUDA_OK(cudaMemset(dlse.p, 0xff, std::size_t(s.batch) * s.heads * s.queries * 4));

  flash::Args a = contiguous_args(s, dq.p, dk.p, dv.p, dout.p, dlse.p);
  a.variant = variant;
  if (!flash::supports(a, s.dim)) {
    std::printf("FAIL %-28s not supported\n", name);
    return false;
  }
  CUDA_OK(flash::forward<IsBf16>(a, s.dim, mask, qpos, kpos, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::uint16_t> o(nq);
  std::vector<float> lse(std::size_t(s.batch) * s.heads * s.queries);
  CUDA_OK(cudaMemcpy(o.data(), dout.p, nq * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(lse.data(), dlse.p, lse.size() * 4, cudaMemcpyDeviceToHost));

  const double unit = bf ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double tol_o = 2.0 * unit * vmax + 1e-6, tol_lse = 1e-3;
  double err_o = 0.0, err_lse = 0.0, num = 0.0, den = 0.0;
  long bad = 0, empty_rows = 0, nan_rows = 0;
  std::vector<double> p(std::size_t(s.keys)), acc(std::size_t(s.dim));
  const int group = s.heads / s.kv_heads;
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      for (int i = 0; i < s.queries; ++i) {
        const index_type qp = qpos(i);
        const std::uint16_t* qr = &q[((std::size_t(b) * s.queries + i) * s.heads + h) * s.dim];
        double m = -INFINITY;
        bool row_nan = false;
        for (int j = 0; j < s.keys; ++j) {
          if (!mask.allowed(qp, kpos(j))) {
            p[std::size_t(j)] = -INFINITY;
            continue;
          }
          const std::uint16_t* kr =
              &k[((std::size_t(b) * s.keys + j) * s.kv_heads + h / group) * s.dim];
          double dot = 0.0;
          for (int d = 0; d < s.dim; ++d)
            dot += double(from_bits(qr[d], bf)) * from_bits(kr[d], bf);
          dot *= a.scale;
          if (std::isnan(dot)) row_nan = true;
          p[std::size_t(j)] = dot;
          m = std::max(m, dot);
        }
        double l = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        if (m > -INFINITY)
          for (int j = 0; j < s.keys; ++j) {
            if (p[std::size_t(j)] == -INFINITY) continue;
            const double e = std::exp(p[std::size_t(j)] - m);
            l += e;
            const std::uint16_t* vr =
                &v[((std::size_t(b) * s.keys + j) * s.kv_heads + h / group) * s.dim];
            for (int d = 0; d < s.dim; ++d) acc[std::size_t(d)] += e * from_bits(vr[d], bf);
          }
        const std::uint16_t* orow = &o[((std::size_t(b) * s.queries + i) * s.heads + h) * s.dim];
        const float got_lse = lse[(std::size_t(b) * s.heads + h) * s.queries + i];
        if (row_nan) {  // NaN visible in this row: NaN in O and LSE
          ++nan_rows;
          bool all = std::isnan(got_lse);
          for (int d = 0; d < s.dim; ++d) all = all && std::isnan(from_bits(orow[d], bf));
          if (!all) ++bad;
          continue;
        }
        if (l == 0.0) {  // sees nothing: exactly 0 and -inf
          ++empty_rows;
          bool ok = got_lse == -INFINITY;
          for (int d = 0; d < s.dim; ++d) ok = ok && from_bits(orow[d], bf) == 0.0f;
          if (!ok) ++bad;
          continue;
        }
        const double ref_lse = m + std::log(l);
        const double dl = std::abs(double(got_lse) - ref_lse);
        err_lse = std::max(err_lse, std::isnan(dl) ? INFINITY : dl);
        if (!(dl <= tol_lse)) ++bad;
        for (int d = 0; d < s.dim; ++d) {
          const double ref = acc[std::size_t(d)] / l;
          const double got = from_bits(orow[d], bf);
          if (!std::isfinite(ref)) {  // inf or NaN from V: the same, exactly
            ++nan_rows;
            if (!(std::isnan(ref) ? std::isnan(got) : got == ref)) ++bad;
            continue;
          }
          const double diff = std::abs(got - ref);
          err_o = std::max(err_o, std::isnan(diff) ? INFINITY : diff);
          if (!(diff <= tol_o)) ++bad;
          num += diff * diff;
          den += ref * ref;
        }
      }
  const bool ok = bad == 0 && (plant == Plant::none || nan_rows > 0);
  std::printf(
      "%s %-30s %s D=%3d B=%d H=%d/%d %4dx%-4d max|dO| %.2e (tol %.2e) rel %.1e "
      "max|dLSE| %.1e, %ld empty rows, %ld non-finite%s\n",
      ok ? "ok  " : "FAIL", name, bf ? "bf16" : "fp16", s.dim, s.batch, s.heads, s.kv_heads,
      s.queries, s.keys, err_o, tol_o, den > 0 ? std::sqrt(num / den) : 0.0, err_lse, empty_rows,
      nan_rows, bad ? (" — " + std::to_string(bad) + " bad values").c_str() : "");
  return ok;
}

/// The backward of one problem against fp64 gradients (see the top).
template <bool IsBf16, class Mask, class QPos, class KPos>
bool check_backward(const char* name, const Shape& s, const Mask& mask, const QPos& qpos,
                    const KPos& kpos, std::uint64_t seed) {
  const bool bf = IsBf16;
  const std::size_t nq = std::size_t(s.batch) * s.queries * s.heads * s.dim;
  const std::size_t nk = std::size_t(s.batch) * s.keys * s.kv_heads * s.dim;
  const std::size_t nl = std::size_t(s.batch) * s.heads * s.queries;
  std::vector<std::uint16_t> q(nq), k(nk), v(nk), g(nq);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& x : q) x = to_bits(2.0f * u(rng), bf);
  for (auto& x : k) x = to_bits(2.0f * u(rng), bf);
  for (auto& x : v) x = to_bits(u(rng), bf);
  for (auto& x : g) x = to_bits(u(rng), bf);
  DeviceBuffer<std::uint16_t> dq_in(nq), dk_in(nk), dv_in(nk), dg(nq), dout(nq), gq(nq), gk(nk),
      gv(nk);
  DeviceBuffer<float> dlse(nl), delta(nl);
  CUDA_OK(cudaMemcpy(dq_in.p, q.data(), nq * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dk_in.p, k.data(), nk * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dv_in.p, v.data(), nk * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dg.p, g.data(), nq * 2, cudaMemcpyHostToDevice));
  flash::Args fa = contiguous_args(s, dq_in.p, dk_in.p, dv_in.p, dout.p, dlse.p);
  CUDA_OK(flash::forward<IsBf16>(fa, s.dim, mask, qpos, kpos, nullptr));
  CUDA_OK(cudaMemset(gq.p, 0xff, nq * 2));
  CUDA_OK(cudaMemset(gk.p, 0xff, nk * 2));
  CUDA_OK(cudaMemset(gv.p, 0xff, nk * 2));
  flash::BackwardArgs a;
  a.q = dq_in.p;
  a.k = dk_in.p;
  a.v = dv_in.p;
  a.o = dout.p;
  a.dout = dg.p;
  a.lse = dlse.p;
  a.dq = gq.p;
  a.dk = gk.p;
  a.dv = gv.p;
  a.delta = delta.p;
  for (int i = 0; i < 3; ++i) {
    a.q_stride[i] = a.o_stride[i] = a.dout_stride[i] = a.dq_stride[i] = fa.q_stride[i];
    a.k_stride[i] = a.v_stride[i] = a.dk_stride[i] = a.dv_stride[i] = fa.k_stride[i];
    a.lse_stride[i] = fa.lse_stride[i];
  }
  a.batch = s.batch;
  a.heads = s.heads;
  a.kv_heads = s.kv_heads;
  a.queries = s.queries;
  a.keys = s.keys;
  a.scale = fa.scale;
  if (!flash::supports(a, s.dim)) {
    std::printf("FAIL %-28s backward: not supported\n", name);
    return false;
  }
  CUDA_OK(flash::backward<IsBf16>(a, s.dim, mask, qpos, kpos, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::uint16_t> o(nq), rq(nq), rk(nk), rv(nk);
  CUDA_OK(cudaMemcpy(o.data(), dout.p, nq * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(rq.data(), gq.p, nq * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(rk.data(), gk.p, nk * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(rv.data(), gv.p, nk * 2, cudaMemcpyDeviceToHost));

  const double unit = bf ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double rp = unit + 2e-3, scale = a.scale;
  const int D = s.dim, group = s.heads / s.kv_heads, nqr = s.queries, nkr = s.keys;
  auto at = [&](const std::vector<std::uint16_t>& x, int b, int row, int head, int heads, int rows,
                int d) {
    return double(from_bits(x[((std::size_t(b) * rows + row) * heads + head) * D + d], bf));
  };
  // Reference gradients and bounds, fp64; dK, dV summed over a kv head's query heads.
  std::vector<double> ref_q(nq, 0.0), tol_q(nq, 0.0), ref_k(nk, 0.0), tol_k(nk, 0.0),
      ref_v(nk, 0.0), tol_v(nk, 0.0);
  std::vector<char> seen_q(std::size_t(s.batch) * s.heads * nqr, 0),
      seen_k(std::size_t(s.batch) * s.kv_heads * nkr, 0);
  std::vector<double> P(std::size_t(nqr) * nkr), dS(std::size_t(nqr) * nkr),
      eS(std::size_t(nqr) * nkr);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const int hk = h / group;
      for (int i = 0; i < nqr; ++i) {
        double m = -INFINITY;
        for (int j = 0; j < nkr; ++j) {
          double& p = P[std::size_t(i) * nkr + j];
          if (!mask.allowed(qpos(i), kpos(j))) {
            p = -INFINITY;
            continue;
          }
          double dot = 0.0;
          for (int d = 0; d < D; ++d)
            dot += at(q, b, i, h, s.heads, nqr, d) * at(k, b, j, hk, s.kv_heads, nkr, d);
          p = dot * scale;
          m = std::max(m, p);
        }
        double l = 0.0;
        for (int j = 0; j < nkr; ++j) {
          double& p = P[std::size_t(i) * nkr + j];
          p = p == -INFINITY ? 0.0 : std::exp(p - m);
          l += p;
        }
        double delta_i = 0.0, abs_i = 0.0;
        for (int d = 0; d < D; ++d) {
          delta_i += at(g, b, i, h, s.heads, nqr, d) * at(o, b, i, h, s.heads, nqr, d);
          abs_i += std::abs(at(g, b, i, h, s.heads, nqr, d) * at(o, b, i, h, s.heads, nqr, d));
        }
        for (int j = 0; j < nkr; ++j) {
          double& p = P[std::size_t(i) * nkr + j];
          if (l > 0) p /= l;
          if (p > 0) {
            seen_q[(std::size_t(b) * s.heads + h) * nqr + i] = 1;
            seen_k[(std::size_t(b) * s.kv_heads + hk) * nkr + j] = 1;
          }
          double dp = 0.0, dp_abs = 0.0;
          for (int d = 0; d < D; ++d) {
            const double x = at(g, b, i, h, s.heads, nqr, d) * at(v, b, j, hk, s.kv_heads, nkr, d);
            dp += x;
            dp_abs += std::abs(x);
          }
          const double ds = p * (dp - delta_i);
          dS[std::size_t(i) * nkr + j] = ds;
          eS[std::size_t(i) * nkr + j] =
              p * (rp * std::abs(dp - delta_i) + 1e-5 * (dp_abs + abs_i)) + unit * std::abs(ds);
        }
      }
      for (int i = 0; i < nqr; ++i)
        for (int j = 0; j < nkr; ++j) {
          const double p = P[std::size_t(i) * nkr + j], ds = dS[std::size_t(i) * nkr + j],
                       es = eS[std::size_t(i) * nkr + j];
          if (p == 0.0) continue;
          for (int d = 0; d < D; ++d) {
            const std::size_t iq = ((std::size_t(b) * nqr + i) * s.heads + h) * D + d;
            const std::size_t ik = ((std::size_t(b) * nkr + j) * s.kv_heads + hk) * D + d;
            const double kd = at(k, b, j, hk, s.kv_heads, nkr, d),
                         qd = at(q, b, i, h, s.heads, nqr, d), gd = at(g, b, i, h, s.heads, nqr, d);
            ref_q[iq] += scale * ds * kd;
            tol_q[iq] += 2 * scale * es * std::abs(kd);
            ref_k[ik] += scale * ds * qd;
            tol_k[ik] += 2 * scale * es * std::abs(qd);
            ref_v[ik] += p * gd;
            tol_v[ik] += 2 * rp * p * std::abs(gd);
          }
        }
    }
  long bad = 0, zero_rows = 0, zero_keys = 0;
  double worst = 0.0;  // largest |err| / tol
  auto compare = [&](const std::vector<std::uint16_t>& got, const std::vector<double>& ref,
                     const std::vector<double>& tol, const std::vector<char>& seen, int heads,
                     int rows, long& zeros) {
    for (int b = 0; b < s.batch; ++b)
      for (int r = 0; r < rows; ++r)
        for (int h = 0; h < heads; ++h) {
          const bool live = seen[(std::size_t(b) * heads + h) * rows + r] != 0;
          zeros += !live;
          for (int d = 0; d < D; ++d) {
            const std::size_t x = ((std::size_t(b) * rows + r) * heads + h) * D + d;
            const double gv_ = from_bits(got[x], bf);
            if (!live) {
              bad += gv_ != 0.0;
              continue;
            }
            const double err = std::abs(gv_ - ref[x]), t = tol[x] + 1e-5;
            worst = std::max(worst, std::isnan(err) ? INFINITY : err / t);
            bad += !(err <= t);
          }
        }
  };
  compare(rq, ref_q, tol_q, seen_q, s.heads, nqr, zero_rows);
  compare(rk, ref_k, tol_k, seen_k, s.kv_heads, nkr, zero_keys);
  compare(rv, ref_v, tol_v, seen_k, s.kv_heads, nkr, zero_keys);
  const bool ok = bad == 0;
  std::printf(
      "%s %-30s %s D=%3d B=%d H=%d/%d %4dx%-4d backward: max err/tol %.2f, %ld rows and "
      "%ld keys unseen%s\n",
      ok ? "ok  " : "FAIL", name, bf ? "bf16" : "fp16", s.dim, s.batch, s.heads, s.kv_heads,
      s.queries, s.keys, worst, zero_rows, zero_keys / 2,
      bad ? (" — " + std::to_string(bad) + " bad values").c_str() : "");
  return ok;
}

template <bool IsBf16>
int check_backward_all(int dim) {
  using namespace blockattn;
  int failed = 0;
  const Shape s{2, 4, 2, 200, 333, dim};
  const Shape sq{1, 2, 2, 130, 130, dim};
  const OffsetPositions at0{0};
  failed += !check_backward<IsBf16>("full", s, FullMask{}, at0, at0, 21);
  failed += !check_backward<IsBf16>("causal", s, CausalMask{}, at0, at0, 22);
  failed += !check_backward<IsBf16>("causal, queries at 133", s, CausalMask{}, OffsetPositions{133},
                                    at0, 23);
  failed += !check_backward<IsBf16>("causal, keys after queries", s, CausalMask{}, at0,
                                    OffsetPositions{150}, 24);
  failed += !check_backward<IsBf16>("causal, all rows empty", sq, CausalMask{}, at0,
                                    OffsetPositions{1000}, 25);
  // 40 query tiles x 2 query heads per kv head, keys at 2400: the dK/dV
  // kernel's scan for live pairs passes whole rounds of 32 empty ones.
  failed += !check_backward<IsBf16>("causal, keys at 2400 of 2560", Shape{1, 2, 1, 2560, 128, dim},
                                    CausalMask{}, at0, OffsetPositions{2400}, 33);
  failed +=
      !check_backward<IsBf16>("sliding window 50/0", s, SlidingWindowMask{50, 0}, at0, at0, 26);
  failed += !check_backward<IsBf16>("prefix-LM 90", s, PrefixLMMask{90}, at0, at0, 28);
  failed += !check_backward<IsBf16>("causal, zigzag x strided", s, CausalMask{},
                                    AffinePositions{100, 100, 700, 1}, StridedPositions{1, 3}, 29);
  {
    const std::vector<index_type> off{0, 50, 51, 200, 260, 333};
    index_type* d = nullptr;
    CUDA_OK(cudaMalloc(&d, off.size() * sizeof(index_type)));
    CUDA_OK(cudaMemcpy(d, off.data(), off.size() * sizeof(index_type), cudaMemcpyHostToDevice));
    DocumentMask m;
    m.host_offsets = off.data();
    m.device_offsets = d;
    m.documents = int(off.size()) - 1;
    failed += !check_backward<IsBf16>("documents, causal", s, m, at0, at0, 32);
    cudaFree(d);
  }
  return failed;
}

template <bool IsBf16>
int check_all(int dim) {
  using namespace blockattn;
  int failed = 0;
  const Shape s{2, 4, 2, 200, 333, dim};
  const Shape sq{1, 2, 2, 130, 130, dim};
  const OffsetPositions at0{0};
  failed += !check<IsBf16>("full", s, FullMask{}, at0, at0, 1);
  failed += !check<IsBf16>("causal", s, CausalMask{}, at0, at0, 2);
  failed += !check<IsBf16>("causal, queries at 133", s, CausalMask{}, OffsetPositions{133}, at0, 3);
  failed += !check<IsBf16>("causal, keys after queries", s, CausalMask{}, at0, OffsetPositions{150},
                           4);  // rows < 150 see nothing
  failed +=
      !check<IsBf16>("causal, all rows empty", sq, CausalMask{}, at0, OffsetPositions{1000}, 5);
  failed += !check<IsBf16>("sliding window 50/0", s, SlidingWindowMask{50, 0}, at0, at0, 6);
  failed += !check<IsBf16>("sliding window 7/20", s, SlidingWindowMask{7, 20}, OffsetPositions{40},
                           at0, 7);
  failed += !check<IsBf16>("prefix-LM 90", s, PrefixLMMask{90}, at0, at0, 8);
  // A zigzag rank's map: two pieces of 100 (queries) against a striped key map.
  failed += !check<IsBf16>("causal, zigzag x strided", s, CausalMask{},
                           AffinePositions{100, 100, 700, 1}, StridedPositions{1, 3}, 9);
  failed += !check<IsBf16>("full, NaN in Q", s, FullMask{}, at0, at0, 10, Plant::nan_q);
  failed += !check<IsBf16>("causal, NaN in Q", s, CausalMask{}, at0, at0, 11, Plant::nan_q);
  failed += !check<IsBf16>("causal, inf/NaN in V", s, CausalMask{}, at0, at0, 14, Plant::bad_v);
  failed += !check<IsBf16>("window 20/0, inf/NaN in V", s, SlidingWindowMask{20, 0}, at0, at0, 15,
                           Plant::bad_v);
  failed += !check<IsBf16>("full, inf/NaN in V", s, FullMask{}, at0, at0, 16, Plant::bad_v);
  {
    // Documents [0, 50), [50, 51), [51, 200), [200, 260), [260, 333): causal inside each.
    const std::vector<index_type> off{0, 50, 51, 200, 260, 333};
    index_type* d = nullptr;
    CUDA_OK(cudaMalloc(&d, off.size() * sizeof(index_type)));
    CUDA_OK(cudaMemcpy(d, off.data(), off.size() * sizeof(index_type), cudaMemcpyHostToDevice));
    DocumentMask m;
    m.host_offsets = off.data();
    m.device_offsets = d;
    m.documents = int(off.size()) - 1;
    failed += !check<IsBf16>("documents, causal", s, m, at0, at0, 12);
    m.causal = false;
    failed += !check<IsBf16>("documents", s, m, OffsetPositions{20}, at0, 13);
    cudaFree(d);
  }
  return failed;
}

void bench(const std::string& torch_file, int reps) {
  using namespace blockattn;
  const auto torch = blockattn_cli::read_torch_rates(torch_file);
  const int H = 16, D = 128;
  std::printf(
      "tensor-core forward (cuda/flash_forward.hpp), bf16, B = 1, H = %d, D = %d, median of %d\n",
      H, D, reps);
  std::printf(
      "(hbh, bhbh: the wide forward and the backward with Args::cta_group = 1, their CTAs\n"
      " unit by unit as before cta_order.hpp; the other rows in its order)\n");
  std::printf("%-9s %-4s %6s %10s %12s %12s %10s\n", "mask", "Q", "N", "ms", "TFLOP/s", "torch",
              "ours/pt");
  for (int n : {4096, 8192, 16384}) {
    const std::size_t count = std::size_t(n) * H * D;
    std::vector<std::uint16_t> host(count);
    std::mt19937_64 rng(n);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    DeviceBuffer<std::uint16_t> q(count), k(count), v(count), o(count);
    DeviceBuffer<float> lse(std::size_t(H) * n);
    for (auto* buf : {&q, &k, &v}) {
      for (auto& x : host) x = to_bits(u(rng), true);
      CUDA_OK(cudaMemcpy(buf->p, host.data(), count * 2, cudaMemcpyHostToDevice));
    }
    flash::Args a = contiguous_args({1, H, H, n, n, D}, q.p, k.p, v.p, o.p, lse.p);
    const OffsetPositions at0{0};
    const LongTailedDocs docs(n);
    const DocumentMask& dm = docs.mask;
    const double doc_pairs = docs.pairs;
    for (const flash::Variant fv : variants)
      for (int mk = 0; mk < 3; ++mk)
        for (int group : {0, 1}) {  // cta_order.hpp's order; unit by unit (masks but full)
          if (group == 1 && (mk == 0 || fv != flash::Variant::wide)) continue;
          a.variant = fv;
          a.cta_group = group;
          const char* qv = group == 1 ? "hbh" : flash::variant_name(fv);
          const char* name = mk == 0 ? "full" : mk == 1 ? "causal" : "documents";
          const double pairs = mk == 0   ? double(n) * n
                               : mk == 1 ? double(n) * (n + 1) / 2
                                         : doc_pairs;
          const double ms = median_ms(reps, [&] {
            if (mk == 0)
              CUDA_OK(flash::forward<true>(a, D, FullMask{}, at0, at0, nullptr));
            else if (mk == 1)
              CUDA_OK(flash::forward<true>(a, D, CausalMask{}, at0, at0, nullptr));
            else
              CUDA_OK(flash::forward<true>(a, D, dm, at0, at0, nullptr));
          });
          CUDA_OK(cudaDeviceSynchronize());
          const double tf = 4.0 * D * pairs * H / (ms * 1e-3) * 1e-12;
          const auto it = torch.find("fwd/" + std::to_string(n) + "/" + std::to_string(D) + "/" +
                                     (mk == 1 ? "causal" : "full") + "/bf16");
          if (it != torch.end() && mk < 2)
            std::printf("%-9s %-4s %6d %10.3f %12.1f %8.1f %-4s %6.2f\n", name, qv, n, ms, tf,
                        it->second.first, it->second.second.c_str(), tf / it->second.first);
          else
            std::printf("%-9s %-4s %6d %10.3f %12.1f %12s %10s%s\n", name, qv, n, ms, tf, "-", "-",
                        mk == 2 ? "  (TFLOP/s of the allowed pairs: long-tailed documents)" : "");
        }
    // The tensor-core backward (cuda/flash_backward.hpp) from the wide
    // forward's O and LSE; TFLOP/s counted as 2.5x the forward's, as PyTorch's.
    DeviceBuffer<std::uint16_t> g(count), gq(count), gk(count), gv(count);
    DeviceBuffer<float> delta(std::size_t(H) * n);
    for (auto& x : host) x = to_bits(u(rng), true);
    CUDA_OK(cudaMemcpy(g.p, host.data(), count * 2, cudaMemcpyHostToDevice));
    flash::BackwardArgs ba;
    ba.q = q.p;
    ba.k = k.p;
    ba.v = v.p;
    ba.o = o.p;
    ba.dout = g.p;
    ba.lse = lse.p;
    ba.dq = gq.p;
    ba.dk = gk.p;
    ba.dv = gv.p;
    ba.delta = delta.p;
    for (int i = 0; i < 3; ++i) {
      ba.q_stride[i] = ba.k_stride[i] = ba.v_stride[i] = ba.o_stride[i] = ba.dout_stride[i] =
          ba.dq_stride[i] = ba.dk_stride[i] = ba.dv_stride[i] = a.q_stride[i];
      ba.lse_stride[i] = a.lse_stride[i];
    }
    ba.batch = 1;
    ba.heads = ba.kv_heads = H;
    ba.queries = ba.keys = n;
    ba.scale = a.scale;
    a.variant = flash::Variant::wide;
    a.cta_group = 0;
    for (int mk = 0; mk < 3; ++mk)
      for (int group : {0, 1}) {
        if (group == 1 && mk == 0) continue;
        ba.cta_group = group;
        const char* name = mk == 0 ? "full" : mk == 1 ? "causal" : "documents";
        const double pairs = mk == 0   ? double(n) * n
                             : mk == 1 ? double(n) * (n + 1) / 2
                                       : doc_pairs;
        auto run = [&](bool fwd) {
          if (mk == 0)
            CUDA_OK(fwd ? flash::forward<true>(a, D, FullMask{}, at0, at0, nullptr)
                        : flash::backward<true>(ba, D, FullMask{}, at0, at0, nullptr));
          else if (mk == 1)
            CUDA_OK(fwd ? flash::forward<true>(a, D, CausalMask{}, at0, at0, nullptr)
                        : flash::backward<true>(ba, D, CausalMask{}, at0, at0, nullptr));
          else
            CUDA_OK(fwd ? flash::forward<true>(a, D, dm, at0, at0, nullptr)
                        : flash::backward<true>(ba, D, dm, at0, at0, nullptr));
        };
        run(true);
        const double ms = median_ms(reps, [&] { run(false); });
        CUDA_OK(cudaDeviceSynchronize());
        const double tf = 2.5 * 4.0 * D * pairs * H / (ms * 1e-3) * 1e-12;
        const auto it = torch.find("bwd/" + std::to_string(n) + "/" + std::to_string(D) + "/" +
                                   (mk == 1 ? "causal" : "full") + "/bf16");
        if (it != torch.end() && mk < 2)
          std::printf("%-9s %-4s %6d %10.3f %12.1f %8.1f %-4s %6.2f\n", name,
                      group == 1 ? "bhbh" : "bwd", n, ms, tf, it->second.first,
                      it->second.second.c_str(), tf / it->second.first);
        else
          std::printf("%-9s %-4s %6d %10.3f %12.1f %12s %10s\n", name, group == 1 ? "bhbh" : "bwd",
                      n, ms, tf, "-", "-");
      }
  }
}

#if defined(BLOCKATTN_CUDA_EMULATION)
/// The kernels' per-tile key ranges (flash::tile_key_range, TileKeys) against
/// brute force on the host: every key of a tile is in the range exactly when
/// its position is in the row's interval, keys past the tile's end never;
/// maps with gaps and a piece boundary inside the tile, tiles of 1 to 64
/// keys, intervals starting and ending before, at, between and after the
/// tile's positions, empty and reversed ones, and unbounded ends.
int check_tile_keys() {
  using blockattn::AffinePositions;
  using blockattn::index_type;
  const AffinePositions maps[] = {{index_type(1) << 62, 0, 0, 1},
                                  {index_type(1) << 62, 5, 0, 3},
                                  {40, 100, 900, 2},  // a second piece from key 40
                                  {10, -50, 7, 1}};   // the pieces meet with a gap of 47
  int bad = 0, cases = 0;
  for (const AffinePositions& kpos : maps)
    for (const int k0 : {0, 3, 32, 64})
      for (const int n : {1, 2, 7, 63, 64}) {
        std::vector<index_type> ends = {INT64_MIN, INT64_MAX, kpos(k0) - 1000};
        for (int i = 0; i < n; ++i)
          for (const index_type d : {-1, 0, 1}) ends.push_back(kpos(k0 + i) + d);
        ends.push_back(kpos(k0 + n - 1) + 1000);
        for (const index_type begin : ends)
          for (const index_type end : ends) {
            const flash::TileKeys keys(flash::tile_key_range(kpos, k0, n, begin, end));
            ++cases;
            for (int i = 0; i < flash::block_n; ++i) {
              const bool want = i < n && begin <= kpos(k0 + i) && kpos(k0 + i) < end;
              if (keys(i) != want && bad++ < 5)
                std::printf("FAIL tile keys: k0 %d, n %d, [%lld, %lld), key %d: %d, want %d\n", k0,
                            n, static_cast<long long>(begin), static_cast<long long>(end), i,
                            int(keys(i)), int(want));
            }
          }
      }
  std::printf("%s tile key ranges: %d intervals x tiles, %d wrong keys\n", bad ? "FAIL" : "ok  ",
              cases, bad);
  return bad ? 1 : 0;
}
#endif

}  // namespace

// cuda_flash_f32_check.cpp: the fp32 tensor-core forward.
int check_f32_all();
void bench_f32(const std::string& torch_file, int reps);

int main(int argc, char** argv) {
  bool do_bench = false;
  std::string torch_file;
  int reps = 20;
  bool bf16 = true, fp16 = true;  // --half
  bool f32 = true;                // --no-fp32: the 16-bit kernels only
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--bench")
      do_bench = true;
    else if (f == "--torch" && i + 1 < argc)
      torch_file = argv[++i];
    else if (f == "--no-fp32")
      f32 = false;
    else if (f == "--reps" && i + 1 < argc)
      reps = std::max(1, std::atoi(argv[++i]));
    else if (f == "--variant" && i + 1 < argc) {
      flash::Variant fv;
      if (!flash::parse_variant(argv[++i], fv)) {
        std::fprintf(stderr,
                     "blockattn_flash_check: --variant: expected regs, smem or wide, got %s\n",
                     argv[i]);
        return 2;
      }
      variants = {fv};
    } else if (f == "--half" && i + 1 < argc) {
      const std::string t = argv[++i];
      if (t != "bf16" && t != "fp16") {
        std::fprintf(stderr, "blockattn_flash_check: --half: expected bf16 or fp16, got %s\n",
                     t.c_str());
        return 2;
      }
      bf16 = t == "bf16";
      fp16 = !bf16;
    } else {
      std::fprintf(stderr, "blockattn_flash_check: unknown argument %s\n", f.c_str());
      return 2;
    }
  }
#if defined(BLOCKATTN_CUDA_EMULATION)
  if (do_bench) {
    std::fprintf(stderr, "blockattn_flash_check: --bench: the emulator's times are not a GPU's\n");
    return 2;
  }
  std::printf("the kernels on the host emulator of tests/cuda_emu, not on a GPU\n");
  const int tile_keys_failed = check_tile_keys();
#endif
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  if (do_bench) {
    bench(torch_file, reps);
    bench_f32(torch_file, reps);
    return 0;
  }
  int failed = 0;
#if defined(BLOCKATTN_CUDA_EMULATION)
  failed += tile_keys_failed;
#endif
  for (const flash::Variant fv : variants) {
    variant = fv;
    std::printf("-- variant %s\n", flash::variant_name(fv));
    for (int dim : {64, 128}) {
      if (bf16) failed += check_all<true>(dim);
      if (fp16) failed += check_all<false>(dim);
    }
  }
  // The backward after the forward (a fault in it would end the process).
  std::printf("-- backward\n");
  for (int dim : {64, 128}) {
    if (bf16) failed += check_backward_all<true>(dim);
    if (fp16) failed += check_backward_all<false>(dim);
  }
  if (f32) {
    std::printf("-- fp32 (cuda/flash_forward_f32.hpp: tf32x3, tf32)\n");
    failed += check_f32_all();
  }
  std::printf("%s: %d failed\n", failed ? "FAILED" : "passed", failed);
  return failed ? 1 : 0;
}
