// SPDX-License-Identifier: Apache-2.0
// cuda_emu (cuda_emu.hpp): the CUDA runtime API subset of BlockAttn's
// tensor-core kernels and their check program, on the host. Device memory is
// host memory; launches run synchronously; one device.
#pragma once

#include "cuda_emu.hpp"

#include <cstddef>

struct CUstream_st;
typedef CUstream_st* cudaStream_t;
struct CUevent_st;
typedef CUevent_st* cudaEvent_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

cudaError_t cudaMalloc(void** p, std::size_t bytes);
template <class T>
cudaError_t cudaMalloc(T** p, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
cudaError_t cudaFree(void* p);
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* p, int value, std::size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
/// The emulated device: blockattn_cuda_emu::emulated_sms SMs (few, so that the
/// kernels' CTA groups, cuda_flash.hpp's cta_grid, split the units in tests).
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

/// CTAs of `block_size` threads and `smem` bytes of dynamic shared memory
/// that one emulated SM holds: 2048 threads, 32 CTAs and 228 KiB of shared
/// memory (1 KiB of it reserved per CTA), as an sm_90; registers are not
/// modelled (the hardware's count can be lower).
template <class... P>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void (*)(P...), int block_size,
                                                          std::size_t smem) {
  if (block_size <= 0 || block_size > 1024) return cudaErrorInvalidValue;
  const std::size_t by_smem = (228 * 1024) / (smem + 1024);
  std::size_t c = std::size_t(2048 / block_size);
  if (by_smem < c) c = by_smem;
  *n = int(c < 32 ? c : 32);
  return cudaSuccess;
}

template <class... P>
cudaError_t cudaFuncSetAttribute(void (*func)(P...), cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  if (value < 0 || value > 227 * 1024) return cudaErrorInvalidValue;
  ::blockattn_cuda_emu::set_max_dynamic_smem(reinterpret_cast<const void*>(func), value);
  return cudaSuccess;
}
