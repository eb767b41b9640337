// SPDX-License-Identifier: Apache-2.0
// The fp32 tensor-core forward (kernel/cuda/flash_forward_f32.hpp) on a GPU,
// part of blockattn_flash_check (cuda_flash_check.cpp calls these): checks
// against an fp64 reference of the same fp32 inputs, and its speed next to
// PyTorch's fp32 SDPA.
//
// Checks: head dims 64 and 128, GQA, lengths that are not multiples of the
// tiles, offsets and a zigzag x strided position map, the full, causal,
// sliding-window, prefix-LM and document masks, rows that see no key (O = 0,
// LSE = -inf exactly); both product modes, tf32x3 (Passes = 3) and tf32
// (Passes = 1); O and LSE poisoned (NaN) before each call. Finite inputs only
// (the kernel's contract; the library sends others to the fp32 kernels).
//
// Bounds, per row i and element d (u = 2^-22, the tf32x3 product's relative
// error; the tensor cores' fp32 accumulation taken at its worst, 2^-23 per
// addition): with A_i = max over allowed j of sum_d |q_id k_jd|,
//   scores:  eS_i = scale A_i gS,  gS = 3u + D 2^-23  (tf32: 2^-10 + D 2^-23);
//   P:       rP_i = 2 eS_i + 2^-21 (the LSE's error and exp2.approx);
//   O:       |O - O_ref| <= 4 ((2 rP_i + gV) W_id) + 1e-7, W_id = sum_j P_ij |V_jd|,
//            gV = 3u + keys 2^-23 (tf32: 2^-10 + keys 2^-23);
//   LSE:     |LSE - LSE_ref| <= 4 (eS_i + 2^-21 (1 + |LSE_ref|)).
// And, as the modes' point: the relative RMS error of O under tf32x3 at most
// 2^-16 and at most 1/32 of tf32's in the same case (splitting must buy the
// accuracy it claims), tf32's at most 2^-7.
#include <blockattn/kernel/cuda/flash_forward_f32.hpp>
#include <blockattn/policy/document_mask.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>

#include "../tools/torch_rates.hpp"
#include "cuda_flash_common.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace blockattn_flash_test;
using blockattn::index_type;
namespace flash = blockattn::impl::flash;

/// One problem in one mode against fp64; returns whether it passed, and the
/// relative RMS error of O in `rel`.
template <int Passes, class Mask, class QPos, class KPos>
bool check_mode(const char* name, const Shape& s, const std::vector<float>& q,
                const std::vector<float>& k, const std::vector<float>& v, const Mask& mask,
                const QPos& qpos, const KPos& kpos, double& rel) {
  const std::size_t nq = q.size(), nk = k.size(), nl = std::size_t(s.batch) * s.heads * s.queries;
  DeviceBuffer<float> dq(nq), dk(nk), dv(nk), dout(nq), dlse(nl);
  CUDA_OK(cudaMemcpy(dq.p, q.data(), nq * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dk.p, k.data(), nk * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dv.p, v.data(), nk * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dout.p, 0xff, nq * 4));  // NaN
  CUDA_OK(cudaMemset(dlse.p, 0xff, nl * 4));
  const flash::Args a = contiguous_args(s, dq.p, dk.p, dv.p, dout.p, dlse.p);
  if (!flash::supports_f32(a, s.dim)) {
    std::printf("FAIL %-30s fp32: not supported\n", name);
    return false;
  }
  CUDA_OK(flash::forward_f32<Passes>(a, s.dim, mask, qpos, kpos, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> o(nq), lse(nl);
  CUDA_OK(cudaMemcpy(o.data(), dout.p, nq * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(lse.data(), dlse.p, nl * 4, cudaMemcpyDeviceToHost));

  const double u = std::ldexp(1.0, -22), acc = std::ldexp(1.0, -23);
  const double g_s = Passes == 3 ? 3 * u + s.dim * acc : std::ldexp(1.0, -10) + s.dim * acc;
  const double g_v = Passes == 3 ? 3 * u + s.keys * acc : std::ldexp(1.0, -10) + s.keys * acc;
  const int D = s.dim, group = s.heads / s.kv_heads;
  double err_o = 0, worst = 0, num = 0, den = 0, err_lse = 0;
  long bad = 0, empty_rows = 0;
  std::vector<double> p(static_cast<std::size_t>(s.keys)), out(static_cast<std::size_t>(D)),
      w(static_cast<std::size_t>(D));
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      for (int i = 0; i < s.queries; ++i) {
        const float* qr = &q[((std::size_t(b) * s.queries + i) * s.heads + h) * D];
        double m = -INFINITY, a_i = 0;
        for (int j = 0; j < s.keys; ++j) {
          p[std::size_t(j)] = -INFINITY;
          if (!mask.allowed(qpos(i), kpos(j))) continue;
          const float* kr = &k[((std::size_t(b) * s.keys + j) * s.kv_heads + h / group) * D];
          double dot = 0, mag = 0;
          for (int d = 0; d < D; ++d) {
            dot += double(qr[d]) * kr[d];
            mag += std::abs(double(qr[d]) * kr[d]);
          }
          p[std::size_t(j)] = dot * a.scale;
          m = std::max(m, p[std::size_t(j)]);
          a_i = std::max(a_i, mag);
        }
        double l = 0;
        std::fill(out.begin(), out.end(), 0.0);
        std::fill(w.begin(), w.end(), 0.0);
        if (m > -INFINITY)
          for (int j = 0; j < s.keys; ++j) {
            if (p[std::size_t(j)] == -INFINITY) continue;
            const double e = std::exp(p[std::size_t(j)] - m);
            l += e;
            const float* vr = &v[((std::size_t(b) * s.keys + j) * s.kv_heads + h / group) * D];
            for (int d = 0; d < D; ++d) {
              out[std::size_t(d)] += e * vr[d];
              w[std::size_t(d)] += e * std::abs(double(vr[d]));
            }
          }
        const float* orow = &o[((std::size_t(b) * s.queries + i) * s.heads + h) * D];
        const float got_lse = lse[(std::size_t(b) * s.heads + h) * s.queries + i];
        if (l == 0) {
          ++empty_rows;
          bool ok = got_lse == -INFINITY;
          for (int d = 0; d < D; ++d) ok = ok && orow[d] == 0.0f;
          bad += !ok;
          continue;
        }
        const double e_s = a.scale * a_i * g_s, r_p = 2 * e_s + std::ldexp(1.0, -21);
        const double ref_lse = m + std::log(l);
        const double dl = std::abs(double(got_lse) - ref_lse);
        const double tol_lse = 4 * (e_s + std::ldexp(1.0, -21) * (1 + std::abs(ref_lse)));
        err_lse = std::max(err_lse, std::isnan(dl) ? INFINITY : dl);
        bad += !(dl <= tol_lse);
        for (int d = 0; d < D; ++d) {
          const double ref = out[std::size_t(d)] / l;
          const double tol = 4 * (2 * r_p + g_v) * w[std::size_t(d)] / l + 1e-7;
          const double diff = std::abs(double(orow[d]) - ref);
          err_o = std::max(err_o, std::isnan(diff) ? INFINITY : diff);
          worst = std::max(worst, std::isnan(diff) ? INFINITY : diff / tol);
          bad += !(diff <= tol);
          num += diff * diff;
          den += ref * ref;
        }
      }
  rel = den > 0 ? std::sqrt(num / den) : 0.0;
  const bool ok = bad == 0 && !std::isnan(rel);
  std::printf(
      "%s %-30s fp32 %-6s D=%3d B=%d H=%d/%d %4dx%-4d max|dO| %.2e (%.2f of its bound) "
      "rel rms %.1e max|dLSE| %.1e, %ld empty rows%s\n",
      ok ? "ok  " : "FAIL", name, Passes == 3 ? "tf32x3" : "tf32", s.dim, s.batch, s.heads,
      s.kv_heads, s.queries, s.keys, err_o, worst, rel, err_lse, empty_rows,
      bad ? (" — " + std::to_string(bad) + " bad values").c_str() : "");
  return ok;
}

/// One problem in both modes, and the modes' accuracy against each other.
template <class Mask, class QPos, class KPos>
bool check(const char* name, const Shape& s, const Mask& mask, const QPos& qpos, const KPos& kpos,
           std::uint64_t seed) {
  const std::size_t nq = std::size_t(s.batch) * s.queries * s.heads * s.dim;
  const std::size_t nk = std::size_t(s.batch) * s.keys * s.kv_heads * s.dim;
  std::vector<float> q(nq), k(nk), v(nk);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& x : q) x = 2.0f * u(rng);  // scores of a few units
  for (auto& x : k) x = 2.0f * u(rng);
  for (auto& x : v) x = u(rng);
  double rel3 = 0, rel1 = 0;
  bool ok = check_mode<3>(name, s, q, k, v, mask, qpos, kpos, rel3);
  ok = check_mode<1>(name, s, q, k, v, mask, qpos, kpos, rel1) && ok;
  if (rel1 > 0 || rel3 > 0) {
    const bool modes =
        rel3 <= std::ldexp(1.0, -16) && rel3 * 32 <= rel1 && rel1 <= std::ldexp(1.0, -7);
    std::printf(
        "%s %-30s fp32 rel rms: tf32x3 %.1e, tf32 %.1e (want <= 2^-16, <= 1/32 of "
        "tf32's; tf32 <= 2^-7)\n",
        modes ? "ok  " : "FAIL", name, rel3, rel1);
    ok = ok && modes;
  }
  return ok;
}

}  // namespace

/// Every fp32 check case; returns the number failed.
int check_f32_all() {
  using namespace blockattn;
  int failed = 0;
  for (int dim : {64, 128}) {
    const Shape s{2, 4, 2, 200, 333, dim};
    const Shape sq{1, 2, 2, 130, 130, dim};
    const OffsetPositions at0{0};
    failed += !check("full", s, FullMask{}, at0, at0, 41);
    failed += !check("causal", s, CausalMask{}, at0, at0, 42);
    failed += !check("causal, queries at 133", s, CausalMask{}, OffsetPositions{133}, at0, 43);
    failed += !check("causal, keys after queries", s, CausalMask{}, at0, OffsetPositions{150}, 44);
    failed += !check("causal, all rows empty", sq, CausalMask{}, at0, OffsetPositions{1000}, 45);
    failed += !check("sliding window 50/0", s, SlidingWindowMask{50, 0}, at0, at0, 46);
    failed +=
        !check("sliding window 7/20", s, SlidingWindowMask{7, 20}, OffsetPositions{40}, at0, 47);
    failed += !check("prefix-LM 90", s, PrefixLMMask{90}, at0, at0, 48);
    failed += !check("causal, zigzag x strided", s, CausalMask{}, AffinePositions{100, 100, 700, 1},
                     StridedPositions{1, 3}, 49);
    const std::vector<index_type> off{0, 50, 51, 200, 260, 333};
    index_type* d = nullptr;
    CUDA_OK(cudaMalloc(&d, off.size() * sizeof(index_type)));
    CUDA_OK(cudaMemcpy(d, off.data(), off.size() * sizeof(index_type), cudaMemcpyHostToDevice));
    DocumentMask m;
    m.host_offsets = off.data();
    m.device_offsets = d;
    m.documents = int(off.size()) - 1;
    failed += !check("documents, causal", s, m, at0, at0, 50);
    m.causal = false;
    failed += !check("documents", s, m, OffsetPositions{20}, at0, 51);
    cudaFree(d);
  }
  return failed;
}

/// The fp32 kernel's rates, B = 1, H = 16, D = 128, next to PyTorch's fp32
/// SDPA (its memory-efficient backend: three TF32 products, as tf32x3).
void bench_f32(const std::string& torch_file, int reps) {
  using namespace blockattn;
  const auto torch = blockattn_cli::read_torch_rates(torch_file);
  const int H = 16, D = 128;
  std::printf(
      "fp32 tensor-core forward (cuda/flash_forward_f32.hpp), B = 1, H = %d, D = %d, median of "
      "%d\n",
      H, D, reps);
  std::printf(
      "(x3-hbh: tf32x3 with Args::cta_group = 1, its CTAs unit by unit as before\n"
      " cta_order.hpp; the other rows in its order)\n");
  std::printf("%-9s %-6s %6s %10s %12s %12s %10s\n", "mask", "mode", "N", "ms", "TFLOP/s",
              "torch fp32", "ours/pt");
  for (int n : {4096, 8192, 16384}) {
    const std::size_t count = std::size_t(n) * H * D;
    std::vector<float> host(count);
    std::mt19937_64 rng(n);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    DeviceBuffer<float> q(count), k(count), v(count), o(count), lse(std::size_t(H) * n);
    for (auto* buf : {&q, &k, &v}) {
      for (auto& x : host) x = u(rng);
      CUDA_OK(cudaMemcpy(buf->p, host.data(), count * 4, cudaMemcpyHostToDevice));
    }
    flash::Args a = contiguous_args({1, H, H, n, n, D}, q.p, k.p, v.p, o.p, lse.p);
    const OffsetPositions at0{0};
    const LongTailedDocs docs(n);
    const DocumentMask& dm = docs.mask;
    const double doc_pairs = docs.pairs;
    for (int mode : {3, 1})
      for (int mk = 0; mk < 3; ++mk)
        for (int group : {0, 1}) {  // cta_order.hpp's order; unit by unit (tf32x3, masks)
          if (group == 1 && (mk == 0 || mode != 3)) continue;
          a.cta_group = group;
          auto run = [&] {
            if (mode == 3) {
              if (mk == 0) CUDA_OK(flash::forward_f32<3>(a, D, FullMask{}, at0, at0, nullptr));
              if (mk == 1) CUDA_OK(flash::forward_f32<3>(a, D, CausalMask{}, at0, at0, nullptr));
              if (mk == 2) CUDA_OK(flash::forward_f32<3>(a, D, dm, at0, at0, nullptr));
            } else {
              if (mk == 0) CUDA_OK(flash::forward_f32<1>(a, D, FullMask{}, at0, at0, nullptr));
              if (mk == 1) CUDA_OK(flash::forward_f32<1>(a, D, CausalMask{}, at0, at0, nullptr));
              if (mk == 2) CUDA_OK(flash::forward_f32<1>(a, D, dm, at0, at0, nullptr));
            }
          };
          const double ms = median_ms(reps, run);
          const char* name = mk == 0 ? "full" : mk == 1 ? "causal" : "documents";
          const double pairs = mk == 0   ? double(n) * n
                               : mk == 1 ? double(n) * (n + 1) / 2
                                         : doc_pairs;
          const double tf = 4.0 * D * pairs * H / (ms * 1e-3) * 1e-12;
          const auto it = torch.find("fwd/" + std::to_string(n) + "/" + std::to_string(D) + "/" +
                                     (mk == 1 ? "causal" : "full") + "/fp32");
          const char* mode_name = group == 1 ? "x3-hbh" : mode == 3 ? "tf32x3" : "tf32";
          if (it != torch.end() && mk < 2)
            std::printf("%-9s %-6s %6d %10.3f %12.1f %8.1f %-4s %6.2f\n", name, mode_name, n, ms,
                        tf, it->second.first, it->second.second.c_str(), tf / it->second.first);
          else
            std::printf("%-9s %-6s %6d %10.3f %12.1f %12s %10s%s\n", name, mode_name, n, ms, tf,
                        "-", "-",
                        mk == 2 ? "  (TFLOP/s of the allowed pairs: long-tailed documents)" : "");
        }
  }
}
