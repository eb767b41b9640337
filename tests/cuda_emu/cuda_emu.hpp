// SPDX-License-Identifier: Apache-2.0
// cuda_emu: a host emulator of the CUDA subset that BlockAttn's tensor-core
// kernels (include/blockattn/kernel/cuda/flash_*.hpp) use, so that their
// source, unchanged, runs and is checked on a CPU: in CI, and before the rare
// session with a GPU. Not a CUDA implementation: only what those kernels and
// their check program (tests/cuda_flash_check.cpp) need.
//
// Model. Every CUDA thread of a block is a fiber (its own stack) on one OS
// thread; blocks run one after another on each of a few OS threads. A fiber
// runs until it reaches a collective (a warp shuffle, ldmatrix, mma.sync,
// __syncthreads), where it waits for its warp (or its block); the last to
// arrive releases the others. So:
//   * warp collectives require all 32 lanes at the same collective (a lane at
//     another one, or at __syncthreads, is reported as a divergence, with the
//     block and the threads' places, and the process aborts);
//   * __shared__ variables are thread_local (one copy per OS thread, which runs
//     one block at a time); the dynamic shared memory (the kernels declare it
//     by BLOCKATTN_DYNAMIC_SHARED) is the launch's size exactly, its end
//     against an unmapped page (an access past it faults), and poisoned (all
//     bytes 0xff: NaN in bf16, fp16 and fp32) before every block;
//   * cp.async copies land at the thread's cp.async.wait_group (the latest
//     moment the hardware may complete them): a read of a tile before the
//     wait, or without the barrier after it, sees poison or stale data; under
//     BLOCKATTN_CUDA_EMU_SHUFFLE (below) they land when issued (the earliest):
//     a load into a buffer that another warp still reads changes it under it;
//     destinations must lie in the launch's dynamic shared memory, sources be
//     16-byte aligned (checked);
//   * ldmatrix addresses must be 16-byte aligned rows in the dynamic shared
//     memory (checked); fragments follow the PTX ISA's layouts;
//   * mma.sync sums the exact products in fp64 and rounds once into the fp32
//     accumulator (the hardware's fp32 accumulation differs in the last bits);
//     .tf32 operands drop their 13 low mantissa bits; ex2.approx is exp2f;
//   * a launch checks its configuration (at most 1024 threads per block, the
//     grid's limits; dynamic shared memory at most 48 KiB unless the kernel's
//     cudaFuncAttributeMaxDynamicSharedMemorySize allows more, at most 227 KiB)
//     and fails as CUDA does (cudaGetLastError); a block of partial warps
//     aborts (not emulated);
//   * launches run synchronously; streams and events are accepted, event
//     times are host times (meaningless as GPU speed);
//   * one device of emulated_sms SMs; occupancy from threads and shared
//     memory (cuda_runtime.h), not registers.
// BLOCKATTN_CUDA_EMU_SHUFFLE=<seed>: an adversarial schedule, seeded: the warps
// of each block get random priorities and the runnable thread of the best one
// runs first, so one warp runs ahead as far as the barriers let it, threads
// leave each barrier in random order, and cp.async lands when issued (a
// missing "buffer free" __syncthreads shows: a warp's next tile overwrites
// the one another warp still reads);
// BLOCKATTN_CUDA_EMU_THREADS=<n> sets the OS threads (default: the cores, at
// most 8).
//
// Used by defining BLOCKATTN_CUDA_EMULATION and putting this directory first
// on the include path (its cuda_runtime.h, cuda_bf16.h, cuda_fp16.h stand in
// for the toolkit's); the kernels' PTX wrappers then come from
// cuda_emu_ptx.hpp. Runtime: cuda_emu.cpp (x86-64: its own context switch;
// elsewhere ucontext). Not for sanitizer builds (stack switching).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- qualifiers -------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ thread_local
#define __align__(n)

// ---- vector types -----------------------------------------------------------
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) {
  return {x, y};
}

// ---- CUDA errors (cuda_runtime.h's subset) ----------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNoDevice = 100,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotSupported = 801,
};

namespace blockattn_cuda_emu {

/// SMs of the emulated device (cudaDeviceGetAttribute).
constexpr int emulated_sms = 8;

/// The collectives a warp's lanes meet at (all 32 at the same one).
enum class Op : int {
  shfl,
  ldmatrix,
  ldmatrix_trans,
  mma_bf16,
  mma_f16,
  mma_tf32,
  syncwarp,
  ballot
};

// The running thread (fiber) of the calling OS thread.
const uint3& thread_idx();
const uint3& block_idx();
const dim3& grid_dim();
const dim3& block_dim();
int lane_id();

/// Block barrier: every thread of the block; returns the number of threads
/// whose pred was nonzero.
int sync_block(int pred);

/// Warp collective: this lane's `bytes` (<= 64) in, then every lane's, 64
/// bytes apart (valid until this lane's next collective). `mine` may be null
/// (bytes 0) for a bare warp barrier.
const unsigned char* warp_exchange(const void* mine, std::size_t bytes, Op op);

/// The fp64 product A B of the warp's current mma (computed once per warp, from
/// every lane's operands in `slots`): 16 x 8, row-major.
const double* warp_mma_product(const unsigned char* slots, Op op);

/// The running launch's dynamic shared memory (128-byte aligned; its end
/// borders an unmapped page).
void* dynamic_shared();

/// Whether [p, p + bytes) lies in the dynamic shared memory of the running
/// launch; aborts with `what` if not.
void check_shared(const void* p, std::size_t bytes, const char* what);

/// cp.async: queue a 16-byte copy (src_bytes of src, zeros after), deferred
/// to the thread's wait; commit closes a group; wait_group(n) completes all
/// committed groups but the newest n.
void cp_async(void* dst, const void* src, int src_bytes);
void cp_async_commit();
void cp_async_wait(int n);

[[noreturn]] void fail(const char* fmt, ...);

/// Runs a grid: body() in every thread of every block. Returns the launch's
/// error (configuration), as cudaGetLastError() will.
cudaError_t run_grid(const void* func, dim3 grid, dim3 block, std::size_t smem,
                     const std::function<void()>& body);
void set_max_dynamic_smem(const void* func, int bytes);

/// kernel<<<grid, block, smem, stream>>>(args...).
template <class... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  std::size_t smem;
  template <class... A>
  void operator()(A&&... args) const {
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    auto* k = kernel;
    run_grid(reinterpret_cast<const void*>(k), grid, block, smem,
             [&params, k] { std::apply(k, params); });
  }
};
template <class... P, class Stream>
Launch<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t smem, Stream) {
  return Launch<P...>{kernel, grid, block, smem};
}

}  // namespace blockattn_cuda_emu

#define threadIdx (::blockattn_cuda_emu::thread_idx())
#define blockIdx (::blockattn_cuda_emu::block_idx())
#define gridDim (::blockattn_cuda_emu::grid_dim())
#define blockDim (::blockattn_cuda_emu::block_dim())

// ---- built-in functions -----------------------------------------------------
inline void __syncthreads() {
  ::blockattn_cuda_emu::sync_block(0);
}
inline int __syncthreads_or(int pred) {
  return ::blockattn_cuda_emu::sync_block(pred) != 0;
}
inline int __syncthreads_and(int pred) {
  const uint3 n{blockDim.x, blockDim.y, blockDim.z};
  return ::blockattn_cuda_emu::sync_block(pred != 0) == int(n.x * n.y * n.z);
}
inline int __syncthreads_count(int pred) {
  return ::blockattn_cuda_emu::sync_block(pred);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) ::blockattn_cuda_emu::fail("__syncwarp: only the full mask is emulated");
  ::blockattn_cuda_emu::warp_exchange(nullptr, 0, ::blockattn_cuda_emu::Op::syncwarp);
}

/// Bit l: lane l's pred was nonzero (every lane at the same ballot).
inline unsigned __ballot_sync(unsigned mask, int pred) {
  if (mask != 0xffffffffu)
    ::blockattn_cuda_emu::fail("__ballot_sync: only the full mask is emulated");
  const int mine = pred != 0;
  const unsigned char* all =
      ::blockattn_cuda_emu::warp_exchange(&mine, sizeof mine, ::blockattn_cuda_emu::Op::ballot);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) {
    int p = 0;
    std::memcpy(&p, all + 64 * l, sizeof p);
    if (p) bits |= 1u << l;
  }
  return bits;
}
/// 1 + the index of the lowest set bit of x, 0 if none.
inline int __ffs(int x) {
  return x == 0 ? 0 : __builtin_ctz(static_cast<unsigned>(x)) + 1;
}

namespace blockattn_cuda_emu {
template <class T>
T shfl_from(unsigned mask, const T& var, int lane_of(int lane, int arg), int arg, int width) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 64, "__shfl: a small value");
  if (mask != 0xffffffffu) fail("__shfl_*_sync: only the full mask is emulated");
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    fail("__shfl_*_sync: width %d is not a power of 2 up to 32", width);
  const unsigned char* all = warp_exchange(&var, sizeof(T), Op::shfl);
  const int lane = lane_id();
  const int base = lane & ~(width - 1);
  int src = lane_of(lane - base, arg);
  if (src < 0 || src >= width) src = lane - base;  // outside the segment: own value
  T out;
  std::memcpy(&out, all + 64 * (base + src), sizeof(T));
  return out;
}
}  // namespace blockattn_cuda_emu

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::blockattn_cuda_emu::shfl_from(
      mask, var, [](int, int a) { return a; }, src_lane & (width - 1), width);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ::blockattn_cuda_emu::shfl_from(
      mask, var, [](int l, int a) { return l ^ a; }, lane_mask, width);
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::blockattn_cuda_emu::shfl_from(
      mask, var, [](int l, int a) { return l + a; }, int(delta), width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::blockattn_cuda_emu::shfl_from(
      mask, var, [](int l, int a) { return l - a; }, int(delta), width);
}

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
