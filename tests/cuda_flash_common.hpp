// SPDX-License-Identifier: Apache-2.0
// What blockattn_flash_check's two files (cuda_flash_check.cpp: the 16-bit
// kernels; cuda_flash_f32_check.cpp: the fp32 forward) share: CUDA error
// checks, device buffers, problem shapes and the kernels' arguments for
// contiguous operands, event timing, and the packed-document bench mask.
#pragma once

#include <blockattn/kernel/cuda/flash_forward.hpp>
#include <blockattn/plan/balance.hpp>
#include <blockattn/policy/document_mask.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CUDA_OK(x)                                                                             \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace blockattn_flash_test {

template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  explicit DeviceBuffer(std::size_t n) {
    CUDA_OK(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct Shape {
  int batch, heads, kv_heads, queries, keys, dim;
};

/// The kernels' arguments for contiguous [batch, seq, heads, dim] operands
/// and a (batch, heads, rows) LSE; scale 1/sqrt(dim).
inline blockattn::impl::flash::Args contiguous_args(const Shape& s, const void* q, const void* k,
                                                    const void* v, void* o, float* lse) {
  blockattn::impl::flash::Args a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.o = o;
  a.lse = lse;
  const std::int64_t qs[3] = {std::int64_t(s.queries) * s.heads * s.dim,
                              std::int64_t(s.heads) * s.dim, s.dim};
  const std::int64_t ks[3] = {std::int64_t(s.keys) * s.kv_heads * s.dim,
                              std::int64_t(s.kv_heads) * s.dim, s.dim};
  for (int i = 0; i < 3; ++i) {
    a.q_stride[i] = a.o_stride[i] = qs[i];
    a.k_stride[i] = a.v_stride[i] = ks[i];
  }
  a.lse_stride[0] = std::int64_t(s.heads) * s.queries;
  a.lse_stride[1] = s.queries;
  a.lse_stride[2] = 1;
  a.batch = s.batch;
  a.heads = s.heads;
  a.kv_heads = s.kv_heads;
  a.queries = s.queries;
  a.keys = s.keys;
  a.scale = float(1.0 / std::sqrt(double(s.dim)));
  return a;
}

/// Median milliseconds of `reps` launches (CUDA events), after two warm-ups.
template <class F>
double median_ms(int reps, F&& f) {
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  f();
  f();
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CUDA_OK(cudaEventRecord(e0));
    f();
    CUDA_OK(cudaEventRecord(e1));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// The benches' packed documents: plan::long_tailed_documents(n, 1), causal
/// inside each, its offsets on the device, and its allowed pairs.
struct LongTailedDocs {
  std::vector<blockattn::index_type> offsets;
  DeviceBuffer<blockattn::index_type> device;
  blockattn::DocumentMask mask;
  double pairs = 0;
  explicit LongTailedDocs(int n)
      : offsets(blockattn::plan::long_tailed_documents(n, 1)), device(offsets.size()) {
    CUDA_OK(cudaMemcpy(device.p, offsets.data(), offsets.size() * sizeof(blockattn::index_type),
                       cudaMemcpyHostToDevice));
    mask.host_offsets = offsets.data();
    mask.device_offsets = device.p;
    mask.documents = int(offsets.size()) - 1;
    for (std::size_t i = 0; i + 1 < offsets.size(); ++i) {
      const double len = double(offsets[i + 1] - offsets[i]);
      pairs += len * (len + 1) / 2;
    }
  }
};

}  // namespace blockattn_flash_test
