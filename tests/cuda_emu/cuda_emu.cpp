// SPDX-License-Identifier: Apache-2.0
// cuda_emu's runtime (the model: cuda_emu.hpp): fibers, the scheduler of a
// block, warp and block barriers, deferred cp.async, the warp's mma product,
// launches, and the CUDA runtime API subset of cuda_runtime.h.
#include "cuda_emu.hpp"

#include "cuda_runtime.h"

#include <blockattn/core/half.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>

#if !defined(__x86_64__) || defined(BLOCKATTN_CUDA_EMU_UCONTEXT)
#define BLOCKATTN_CUDA_EMU_USE_UCONTEXT 1
#include <ucontext.h>
#endif

#if !defined(BLOCKATTN_CUDA_EMU_USE_UCONTEXT)
// x86-64 System V: switch stacks saving the callee-saved registers, MXCSR and
// the x87 control word on the old stack; blockattn_emu_start is where a new
// fiber's first switch returns to (r12: its argument, r13: its entry).
extern "C" void blockattn_emu_switch(void** save_sp, void* to_sp);
extern "C" void blockattn_emu_start();
asm(R"(
  .text
  .p2align 4
  .globl blockattn_emu_switch
  .type blockattn_emu_switch, @function
blockattn_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size blockattn_emu_switch, .-blockattn_emu_switch
  .p2align 4
  .globl blockattn_emu_start
  .type blockattn_emu_start, @function
blockattn_emu_start:
  movq %r12, %rdi
  andq $-16, %rsp
  callq *%r13
  ud2
  .size blockattn_emu_start, .-blockattn_emu_start
)");
#endif

namespace blockattn_cuda_emu {
namespace {

constexpr std::size_t kStack = 256 * 1024;  // per thread (fiber)
constexpr std::size_t kGuard = 4096;        // an unmapped page below each stack
constexpr std::size_t kSlot = 64;           // bytes of a lane's share of a collective

const char* op_name(Op op) {
  switch (op) {
    case Op::shfl:
      return "__shfl_*_sync";
    case Op::ldmatrix:
      return "ldmatrix";
    case Op::ldmatrix_trans:
      return "ldmatrix.trans";
    case Op::mma_bf16:
      return "mma.m16n8k16.bf16";
    case Op::mma_f16:
      return "mma.m16n8k16.f16";
    case Op::mma_tf32:
      return "mma.m16n8k8.tf32";
    case Op::syncwarp:
      return "__syncwarp";
    case Op::ballot:
      return "__ballot_sync";
  }
  return "?";
}

struct Copy {
  unsigned char* dst;
  const unsigned char* src;
  int src_bytes;
};

struct Fiber {
  void* sp = nullptr;
#if defined(BLOCKATTN_CUDA_EMU_USE_UCONTEXT)
  ucontext_t uc;
#endif
  unsigned char* stack = nullptr;  // lowest address of the usable stack
  uint3 tid{0, 0, 0};
  int linear = 0, warp = 0, lane = 0;
  bool done = false;
  unsigned phase = 0;  // parity of the lane's warp collectives
  std::vector<Copy> copies;
  std::size_t completed = 0;        // copies[0, completed) have landed
  std::vector<std::size_t> groups;  // committed groups not waited for: end index in copies
  const char* at = "start";         // where it waits (reports)
};

struct Warp {
  int count = 0;
  Op op = Op::shfl;
  std::vector<int> waiters;
  alignas(16) unsigned char slots[2][32][kSlot];
  bool product_ready[2] = {false, false};
  double product[2][16 * 8];
};

struct Worker {
  void* sched_sp = nullptr;
#if defined(BLOCKATTN_CUDA_EMU_USE_UCONTEXT)
  ucontext_t sched_uc;
#endif
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::deque<int> runq;
  Fiber* cur = nullptr;
  int nthreads = 0;
  int bar_count = 0, bar_acc = 0, bar_result = 0;
  std::vector<int> bar_waiters;
  uint3 bidx{0, 0, 0};
  dim3 grid, block;
  std::size_t smem = 0;
  const std::function<void()>* body = nullptr;
  unsigned char* stacks = nullptr;
  std::size_t stacks_bytes = 0;
  unsigned char* shared = nullptr;  // the dynamic shared memory: smem bytes, then a guard page
  unsigned char* shared_map = nullptr;
  std::size_t shared_map_bytes = 0;
  bool shuffle = false;
  std::mt19937_64 rng;
  std::vector<int> rank;               // shuffling: the warps' priorities (0 runs first)
  std::vector<std::deque<int>> warpq;  // shuffling: runnable threads by their warp's rank

  Worker(dim3 b, std::size_t smem_bytes, const std::function<void()>* f, std::uint64_t seed,
         bool shuf)
      : fibers(std::size_t(b.x) * b.y * b.z),
        warps(fibers.size() / 32),
        nthreads(int(fibers.size())),
        block(b),
        smem(smem_bytes),
        body(f),
        shuffle(shuf),
        rng(seed),
        rank(warps.size()),
        warpq(warps.size()) {
    stacks_bytes = fibers.size() * (kStack + kGuard);
    void* m =
        mmap(nullptr, stacks_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) fail("cannot map %zu bytes of thread stacks", stacks_bytes);
    stacks = static_cast<unsigned char*>(m);
    for (std::size_t i = 0; i < fibers.size(); ++i) {
      unsigned char* base = stacks + i * (kStack + kGuard);
      mprotect(base, kGuard, PROT_NONE);
      Fiber& f = fibers[i];
      f.stack = base + kGuard;
      f.linear = int(i);
      f.warp = int(i / 32);
      f.lane = int(i % 32);
      f.tid = uint3{unsigned(i % b.x), unsigned(i / b.x % b.y), unsigned(i / (b.x * b.y))};
    }
    // Its end against an unmapped page: a read or write past it faults.
    const std::size_t page = 4096,
                      rounded = (std::max<std::size_t>(smem, 1) + page - 1) / page * page;
    shared_map_bytes = rounded + page;
    m = mmap(nullptr, shared_map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) fail("cannot map %zu bytes of shared memory", shared_map_bytes);
    shared_map = static_cast<unsigned char*>(m);
    mprotect(shared_map + rounded, page, PROT_NONE);
    shared = shared_map + rounded - (smem + 127) / 128 * 128;
  }
  ~Worker() {
    munmap(stacks, stacks_bytes);
    munmap(shared_map, shared_map_bytes);
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
};

thread_local Worker* tw = nullptr;

std::mutex attr_mutex;
std::map<const void*, int> max_dynamic_smem;
std::atomic<int> last_error{cudaSuccess};

void record(cudaError_t e) {
  int expected = cudaSuccess;
  last_error.compare_exchange_strong(expected, int(e));
}

}  // namespace

void fail(const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (tw != nullptr && tw->cur != nullptr)
    std::fprintf(stderr, "cuda_emu: block (%u,%u,%u) thread (%u,%u,%u): %s\n", tw->bidx.x,
                 tw->bidx.y, tw->bidx.z, tw->cur->tid.x, tw->cur->tid.y, tw->cur->tid.z, msg);
  else
    std::fprintf(stderr, "cuda_emu: %s\n", msg);
  std::fflush(stderr);
  std::abort();
}

namespace {

#if defined(BLOCKATTN_CUDA_EMU_USE_UCONTEXT)
void fiber_entry(unsigned hi, unsigned lo);
void init_fiber(Fiber& f) {
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack;
  f.uc.uc_stack.ss_size = kStack;
  f.uc.uc_link = nullptr;
  const auto p = reinterpret_cast<std::uintptr_t>(&f);
  makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_entry), 2, unsigned(p >> 32),
              unsigned(p & 0xffffffffu));
}
void to_fiber(Worker& w, Fiber& f) {
  w.cur = &f;
  swapcontext(&w.sched_uc, &f.uc);
  w.cur = nullptr;
}
void to_sched(Fiber& f) {
  swapcontext(&f.uc, &tw->sched_uc);
}
#else
extern "C" void blockattn_emu_fiber_main(void* arg);
void init_fiber(Fiber& f) {
  auto* top = reinterpret_cast<std::uintptr_t*>(f.stack + kStack);  // 16-byte aligned
  std::uintptr_t* sp = top - 8;
  sp[0] = 0x1f80u | (std::uintptr_t(0x037fu) << 32);  // MXCSR, x87 control word: defaults
  sp[1] = 0;                                          // r15
  sp[2] = 0;                                          // r14
  sp[3] = reinterpret_cast<std::uintptr_t>(&blockattn_emu_fiber_main);  // r13
  sp[4] = reinterpret_cast<std::uintptr_t>(&f);                         // r12
  sp[5] = 0;                                                            // rbx
  sp[6] = 0;                                                            // rbp
  sp[7] = reinterpret_cast<std::uintptr_t>(&blockattn_emu_start);       // return address
  f.sp = sp;
}
void to_fiber(Worker& w, Fiber& f) {
  w.cur = &f;
  blockattn_emu_switch(&w.sched_sp, f.sp);
  w.cur = nullptr;
}
void to_sched(Fiber& f) {
  blockattn_emu_switch(&f.sp, tw->sched_sp);
}
#endif

void fiber_run(Fiber& f) {
  (*tw->body)();
  f.done = true;
  f.at = "exit";
  to_sched(f);
  std::abort();  // never resumed
}

#if defined(BLOCKATTN_CUDA_EMU_USE_UCONTEXT)
void fiber_entry(unsigned hi, unsigned lo) {
  fiber_run(*reinterpret_cast<Fiber*>((std::uintptr_t(hi) << 32) | lo));
}
#endif

void block_on(Fiber& f, const char* at) {
  f.at = at;
  to_sched(f);
  f.at = "running";
}

/// Makes `waiters` runnable (and, shuffling, `self` too: it yields).
void release(Worker& w, std::vector<int>& waiters, Fiber& self) {
  if (!w.shuffle) {
    for (int i : waiters) w.runq.push_back(i);
    waiters.clear();
    return;
  }
  waiters.push_back(self.linear);
  std::shuffle(waiters.begin(), waiters.end(), w.rng);
  for (int i : waiters) w.warpq[std::size_t(w.rank[std::size_t(i / 32)])].push_back(i);
  waiters.clear();
  block_on(self, "released");
}

void warp_arrive(Worker& w, Fiber& f, Op op) {
  Warp& wp = w.warps[std::size_t(f.warp)];
  if (wp.count == 0)
    wp.op = op;
  else if (wp.op != op)
    fail("warp %d: lane %d reaches %s while %d lanes wait at %s (divergent warp collective)",
         f.warp, f.lane, op_name(op), wp.count, op_name(wp.op));
  if (++wp.count == 32) {
    wp.count = 0;
    release(w, wp.waiters, f);
  } else {
    wp.waiters.push_back(f.linear);
    block_on(f, op_name(op));
  }
}

void complete_copies(Fiber& f, std::size_t upto) {
  for (std::size_t i = f.completed; i < upto; ++i) {
    const Copy& c = f.copies[i];
    if (c.src_bytes > 0) std::memcpy(c.dst, c.src, std::size_t(c.src_bytes));
    std::memset(c.dst + c.src_bytes, 0, std::size_t(16 - c.src_bytes));
  }
  f.completed = std::max(f.completed, upto);
  if (f.completed == f.copies.size() && f.groups.empty()) {
    f.copies.clear();
    f.completed = 0;
  }
}

void run_block(Worker& w) {
  for (Fiber& f : w.fibers) {
    f.done = false;
    f.phase = 0;
    f.copies.clear();
    f.completed = 0;
    f.groups.clear();
    f.at = "start";
    init_fiber(f);
  }
  for (Warp& wp : w.warps) {
    wp.count = 0;
    wp.waiters.clear();
  }
  w.bar_count = 0;
  w.bar_waiters.clear();
  std::memset(w.shared, 0xff, w.smem);
  w.runq.clear();
  for (int i = 0; i < w.nthreads; ++i) w.runq.push_back(i);
  for (std::size_t i = 0; i < w.rank.size(); ++i) w.rank[i] = int(i);
  if (w.shuffle) std::shuffle(w.rank.begin(), w.rank.end(), w.rng);
  if (w.shuffle) {
    // The first thread of the warp of the best rank (a queue per warp): that
    // warp runs ahead as far as the barriers let it.
    for (auto& q : w.warpq) q.clear();
    for (int i : w.runq) w.warpq[std::size_t(w.rank[std::size_t(i / 32)])].push_back(i);
    w.runq.clear();
    for (;;) {
      std::size_t r = 0;
      while (r < w.warpq.size() && w.warpq[r].empty()) ++r;
      if (r == w.warpq.size()) break;
      const int i = w.warpq[r].front();
      w.warpq[r].pop_front();
      to_fiber(w, w.fibers[std::size_t(i)]);
    }
  }
  while (!w.runq.empty()) {  // in order
    const int i = w.runq.front();
    w.runq.pop_front();
    to_fiber(w, w.fibers[std::size_t(i)]);
  }
  std::string stuck;
  for (const Fiber& f : w.fibers)
    if (!f.done) {
      char line[160];
      std::snprintf(line, sizeof line, "\n  thread (%u,%u,%u) (warp %d lane %d) waits at %s",
                    f.tid.x, f.tid.y, f.tid.z, f.warp, f.lane, f.at);
      stuck += line;
    }
  if (!stuck.empty())
    fail("block (%u,%u,%u) cannot finish (divergent barrier?):%s", w.bidx.x, w.bidx.y, w.bidx.z,
         stuck.c_str());
}

std::uint64_t shuffle_seed(bool& on) {
  const char* s = std::getenv("BLOCKATTN_CUDA_EMU_SHUFFLE");
  on = s != nullptr && *s != '\0';
  return on ? std::strtoull(s, nullptr, 10) : 0;
}

int worker_threads() {
  if (const char* s = std::getenv("BLOCKATTN_CUDA_EMU_THREADS")) {
    const int n = std::atoi(s);
    if (n >= 1) return n;
  }
  const unsigned c = std::thread::hardware_concurrency();
  return int(std::min(8u, std::max(1u, c)));
}

}  // namespace
}  // namespace blockattn_cuda_emu

#if !defined(BLOCKATTN_CUDA_EMU_USE_UCONTEXT)
extern "C" void blockattn_emu_fiber_main(void* arg) {
  blockattn_cuda_emu::fiber_run(*static_cast<blockattn_cuda_emu::Fiber*>(arg));
}
#endif

namespace blockattn_cuda_emu {

const uint3& thread_idx() {
  if (tw == nullptr || tw->cur == nullptr) fail("threadIdx outside a kernel");
  return tw->cur->tid;
}
const uint3& block_idx() {
  return tw->bidx;
}
const dim3& grid_dim() {
  return tw->grid;
}
const dim3& block_dim() {
  return tw->block;
}
int lane_id() {
  return tw->cur->lane;
}

int sync_block(int pred) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  if (w.bar_count == 0) w.bar_acc = 0;
  w.bar_acc += pred != 0;
  if (++w.bar_count == w.nthreads) {
    w.bar_result = w.bar_acc;
    w.bar_count = 0;
    release(w, w.bar_waiters, f);
  } else {
    w.bar_waiters.push_back(f.linear);
    block_on(f, "__syncthreads");
  }
  return w.bar_result;
}

const unsigned char* warp_exchange(const void* mine, std::size_t bytes, Op op) {
  Worker& w = *tw;
  Fiber& f = *w.cur;
  Warp& wp = w.warps[std::size_t(f.warp)];
  if (bytes > kSlot) fail("warp collective of %zu bytes per lane (at most %zu)", bytes, kSlot);
  const unsigned ph = f.phase;
  f.phase ^= 1u;
  if (bytes > 0) std::memcpy(wp.slots[ph][f.lane], mine, bytes);
  if (wp.count == 0) wp.product_ready[ph] = false;
  warp_arrive(w, f, op);
  return &wp.slots[ph][0][0];
}

const double* warp_mma_product(const unsigned char* slots, Op op) {
  Warp& wp = tw->warps[std::size_t(tw->cur->warp)];
  const unsigned ph = slots == &wp.slots[1][0][0] ? 1u : 0u;
  if (wp.product_ready[ph]) return wp.product[ph];
  const bool tf32 = op == Op::mma_tf32;
  const int K = tf32 ? 8 : 16;
  // A (16 x K) and B (K x 8), row-major, in fp64 (exact).
  double A[16][16], B[16][8];
  auto value = [op](std::uint32_t reg, int hi) -> double {
    const std::uint16_t h = std::uint16_t(hi ? reg >> 16 : reg & 0xffffu);
    if (op == Op::mma_bf16) return double(blockattn::impl::bits_float(std::uint32_t(h) << 16));
    return double(blockattn::impl::fp16_to_float(h));
  };
  auto tf = [](std::uint32_t reg) -> double {
    return double(blockattn::impl::bits_float(reg & ~0x1fffu));
  };
  for (int lane = 0; lane < 32; ++lane) {
    std::uint32_t in[6];
    std::memcpy(in, slots + kSlot * std::size_t(lane), sizeof in);
    const int g = lane / 4, t = lane % 4;
    if (tf32) {
      A[g][t] = tf(in[0]);
      A[g + 8][t] = tf(in[1]);
      A[g][t + 4] = tf(in[2]);
      A[g + 8][t + 4] = tf(in[3]);
      B[t][g] = tf(in[4]);
      B[t + 4][g] = tf(in[5]);
    } else {
      for (int h = 0; h < 2; ++h) {
        A[g][2 * t + h] = value(in[0], h);
        A[g + 8][2 * t + h] = value(in[1], h);
        A[g][2 * t + 8 + h] = value(in[2], h);
        A[g + 8][2 * t + 8 + h] = value(in[3], h);
        B[2 * t + h][g] = value(in[4], h);
        B[2 * t + 8 + h][g] = value(in[5], h);
      }
    }
  }
  // Each element summed over k in order; rows and columns are independent
  // chains (the compiler keeps them in vector registers).
  double acc[16][8] = {};
  for (int k = 0; k < K; ++k)
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < 8; ++n) acc[r][n] += A[r][k] * B[k][n];
  std::memcpy(wp.product[ph], acc, sizeof acc);
  wp.product_ready[ph] = true;
  return wp.product[ph];
}

void* dynamic_shared() {
  if (tw == nullptr || tw->cur == nullptr) fail("dynamic shared memory outside a kernel");
  return tw->shared;
}

void check_shared(const void* p, std::size_t bytes, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  const unsigned char* s = tw->shared;
  const std::size_t n = tw->smem;
  if (c >= s && c + bytes <= s + n) return;
  if (c >= s && c < s + n + 4096)
    fail("%s at byte %td of the dynamic shared memory, past the launch's %zu", what, c - s, n);
  fail("%s at %p: not in the dynamic shared memory", what, p);
}

void cp_async(void* dst, const void* src, int src_bytes) {
  Fiber& f = *tw->cur;
  if (reinterpret_cast<std::uintptr_t>(dst) % 16 != 0)
    fail("cp.async: destination %p is not 16-byte aligned", dst);
  check_shared(dst, 16, "cp.async destination");
  if (src_bytes < 0 || src_bytes > 16) fail("cp.async: src-size %d (0 .. 16)", src_bytes);
  if (src_bytes > 0 && reinterpret_cast<std::uintptr_t>(src) % 16 != 0)
    fail("cp.async: source %p is not 16-byte aligned", src);
  f.copies.push_back(
      Copy{static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), src_bytes});
  // Shuffling: the copy lands now, the earliest the hardware may write it (a
  // warp that still reads the buffer sees it change); otherwise at the wait.
  if (tw->shuffle) complete_copies(f, f.copies.size());
}

void cp_async_commit() {
  Fiber& f = *tw->cur;
  f.groups.push_back(f.copies.size());
}

void cp_async_wait(int n) {
  Fiber& f = *tw->cur;
  if (n < 0) fail("cp.async.wait_group %d", n);
  if (f.groups.size() <= std::size_t(n)) return;
  const std::size_t k = f.groups.size() - std::size_t(n);
  const std::size_t upto = f.groups[k - 1];
  f.groups.erase(f.groups.begin(), f.groups.begin() + std::ptrdiff_t(k));
  complete_copies(f, upto);
}

void set_max_dynamic_smem(const void* func, int bytes) {
  const std::lock_guard<std::mutex> lock(attr_mutex);
  max_dynamic_smem[func] = bytes;
}

cudaError_t run_grid(const void* func, dim3 grid, dim3 block, std::size_t smem,
                     const std::function<void()>& body) {
  const std::size_t threads = std::size_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535 || block.z > 64) {
    record(cudaErrorInvalidConfiguration);
    return cudaErrorInvalidConfiguration;
  }
  if (threads % 32 != 0)
    fail("launch of %zu threads per block: the emulator needs whole warps", threads);
  int limit = 48 * 1024;
  {
    const std::lock_guard<std::mutex> lock(attr_mutex);
    const auto it = max_dynamic_smem.find(func);
    if (it != max_dynamic_smem.end()) limit = std::max(limit, it->second);
  }
  if (smem > std::size_t(limit)) {
    record(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  const std::size_t blocks = std::size_t(grid.x) * grid.y * grid.z;
  bool shuffle = false;
  const std::uint64_t seed = shuffle_seed(shuffle);
  std::atomic<std::size_t> next{0};
  auto work = [&](int id) {
    Worker w(block, smem, &body, seed + std::uint64_t(id) * 0x9e3779b97f4a7c15ull, shuffle);
    w.grid = grid;
    Worker* const saved = tw;
    tw = &w;
    for (std::size_t b; (b = next.fetch_add(1)) < blocks;) {
      w.bidx = uint3{unsigned(b % grid.x), unsigned(b / grid.x % grid.y),
                     unsigned(b / (std::size_t(grid.x) * grid.y))};
      run_block(w);
    }
    tw = saved;
  };
  const int n = int(std::min<std::size_t>(blocks, std::size_t(worker_threads())));
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(work, i);
  work(0);
  for (auto& t : pool) t.join();
  return cudaSuccess;
}

}  // namespace blockattn_cuda_emu

// ---- cuda_runtime.h ---------------------------------------------------------
struct CUevent_st {
  std::chrono::steady_clock::time_point t;
};

cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  const std::size_t n = (std::max<std::size_t>(bytes, 1) + 255) / 256 * 256;
  *p = std::aligned_alloc(256, n);
  return *p != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind) {
  if (bytes > 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  if (bytes > 0) std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t) {
  return cudaMemset(p, value, bytes);
}
cudaError_t cudaDeviceSynchronize() {
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0 || attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = blockattn_cuda_emu::emulated_sms;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  return cudaError_t(blockattn_cuda_emu::last_error.exchange(cudaSuccess));
}
cudaError_t cudaPeekAtLastError() {
  return cudaError_t(blockattn_cuda_emu::last_error.load());
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorNotSupported:
      return "operation not supported";
  }
  return "unknown error";
}
cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  e->t = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->t - start->t).count();
  return cudaSuccess;
}
