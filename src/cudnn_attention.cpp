// SPDX-License-Identifier: Apache-2.0
// cuDNN's fused attention (SDPA) for one band piece, through cuDNN's C++
// frontend graph API (blockattn/kernel/cudnn/cudnn.hpp). The only translation unit
// that includes the frontend; it includes no Kokkos, so plain g++ compiles it.
//
// Graphs: one per distinct problem (shape, type, band, strides, scale) and
// device, built on first use (validate, operation graph, heuristics A then
// the fallback list, support check, plans) and kept for the process. A
// problem cuDNN does not support is remembered as such (supports_*() false),
// so the block product asks once and takes its own kernel from then on.
#include <blockattn/kernel/cudnn/cudnn.hpp>

#include <cuda_runtime.h>
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace blockattn::cudnn {
namespace {

namespace fe = cudnn_frontend;

enum Uid : std::int64_t { q_uid = 1, k_uid, v_uid, o_uid, lse_uid, do_uid, dq_uid, dk_uid, dv_uid };

[[noreturn]] void fail(const char* fn, const std::string& what) {
  throw vendor_error(std::string("blockattn::cudnn::") + fn + ": " + what);
}

void check_cuda(const char* fn, cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    fail(fn, std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                 ")");
}

void check_cudnn(const char* fn, cudnnStatus_t s, const char* what) {
  if (s != CUDNN_STATUS_SUCCESS) fail(fn, std::string(what) + " failed: " + cudnnGetErrorString(s));
}

/// One cuDNN handle per device, shared by the threads of the process (the
/// stream is set under the lock before every execute).
struct Handles {
  std::mutex mutex;
  std::map<int, cudnnHandle_t> by_device;
  ~Handles() {
    for (auto& h : by_device) cudnnDestroy(h.second);
  }
  cudnnHandle_t get(const char* fn, int device) {
    auto it = by_device.find(device);
    if (it != by_device.end()) return it->second;
    cudnnHandle_t h = nullptr;
    check_cudnn(fn, cudnnCreate(&h), "cudnnCreate");
    by_device.emplace(device, h);
    return h;
  }
};

Handles& handles() {
  static Handles h;
  return h;
}

/// The key of a graph: everything the graph fixes.
using Key = std::vector<std::int64_t>;

void push_tensor(Key& key, const FusedTensor& t) {
  for (int i = 0; i < 4; ++i) key.push_back(t.stride[i]);
}

Key problem_key(int kind, int device, const FusedProblem& p) {
  std::int32_t scale_bits = 0;
  static_assert(sizeof(scale_bits) == sizeof(p.scale), "float is 32 bits");
  std::memcpy(&scale_bits, &p.scale, sizeof(scale_bits));
  return Key{kind,
             device,
             p.batch,
             p.heads,
             p.kv_heads,
             p.queries,
             p.keys,
             p.dim,
             std::int64_t(p.type),
             p.band.has_right ? 1 : 0,
             p.band.right_bound,
             p.band.has_left ? 1 : 0,
             p.band.left_bound,
             scale_bits};
}

struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;  // null: not supported (why says why)
  std::string why;
  std::int64_t workspace = 0;
};

struct Cache {
  std::mutex mutex;
  std::map<Key, Entry> entries;
};

Cache& cache() {
  static Cache c;
  return c;
}

fe::DataType_t io_type(FusedType t) {
  return t == FusedType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
}

std::vector<std::int64_t> dims(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) {
  return {b, h, s, d};
}
std::vector<std::int64_t> strides(const FusedTensor& t) {
  return {t.stride[0], t.stride[1], t.stride[2], t.stride[3]};
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name,
                                                    std::int64_t uid, std::vector<std::int64_t> d,
                                                    const FusedTensor& t) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim(std::move(d))
                      .set_stride(strides(t)));
}

template <class Attributes>
void set_band(Attributes& a, const CudnnBand& band) {
  if (!band.has_right && !band.has_left) return;
  a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT);
  if (band.has_right) a.set_diagonal_band_right_bound(int(band.right_bound));
  if (band.has_left) a.set_diagonal_band_left_bound(int(band.left_bound));
}

/// Builds the graph's plans; the reason when cuDNN declines.
std::string finish_graph(fe::graph::Graph& g, cudnnHandle_t h, std::int64_t& workspace) {
  auto step = [](fe::error_t e, const char* what) -> std::string {
    if (e.is_good()) return {};
    std::ostringstream s;
    s << what << ": " << e.get_message();
    return s.str();
  };
  std::string why;
  if (!(why = step(g.validate(), "validate")).empty()) return why;
  if (!(why = step(g.build_operation_graph(h), "build_operation_graph")).empty()) return why;
  if (!(why = step(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                   "create_execution_plans"))
           .empty())
    return why;
  if (!(why = step(g.check_support(h), "check_support")).empty()) return why;
  if (!(why = step(g.build_plans(h, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans"))
           .empty())
    return why;
  if (!(why = step(g.get_workspace_size(workspace), "get_workspace_size")).empty()) return why;
  return {};
}

/// A problem's limits BlockAttn checks before asking cuDNN (its documented
/// ones, so that the answer does not depend on a failed build).
std::string precheck(const FusedProblem& p) {
  std::ostringstream s;
  if (p.dim % 8 != 0 || p.dim > 256)
    s << "head dim " << p.dim << " (cuDNN: a multiple of 8, <= 256)";
  if (p.kv_heads <= 0 || p.heads % p.kv_heads != 0)
    s << "heads " << p.heads << " / kv_heads " << p.kv_heads;
  if (!p.band.supported) s << "a band cuDNN does not express";
  if (p.queries <= 0 || p.keys <= 0) s << "an empty piece";
  if (p.queries > INT32_MAX || p.keys > INT32_MAX) s << "more than 2^31 rows";
  return s.str();
}

int current_device(const char* fn) {
  int device = 0;
  check_cuda(fn, cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

const Entry& forward_entry(const FusedForwardCall& c) {
  const char* fn = "forward";
  const int device = current_device(fn);
  Key key = problem_key(0, device, c.p);
  for (const FusedTensor* t : {&c.q, &c.k, &c.v, &c.o, &c.lse}) push_tensor(key, *t);
  std::lock_guard<std::mutex> lock(cache().mutex);
  auto it = cache().entries.find(key);
  if (it != cache().entries.end()) return it->second;
  Entry e;
  e.why = precheck(c.p);
  if (e.why.empty()) {
    const FusedProblem& p = c.p;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(io_type(p.type))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = input(*g, "Q", q_uid, dims(p.batch, p.heads, p.queries, p.dim), c.q);
    auto k = input(*g, "K", k_uid, dims(p.batch, p.kv_heads, p.keys, p.dim), c.k);
    auto v = input(*g, "V", v_uid, dims(p.batch, p.kv_heads, p.keys, p.dim), c.v);
    auto a = fe::graph::SDPA_attributes()
                 .set_name("blockattn_forward")
                 .set_generate_stats(true)
                 .set_attn_scale(p.scale);
    set_band(a, p.band);
    auto [o, stats] = g->sdpa(q, k, v, a);
    o->set_output(true)
        .set_uid(o_uid)
        .set_dim(dims(p.batch, p.heads, p.queries, p.dim))
        .set_stride(strides(c.o));
    stats->set_output(true)
        .set_uid(lse_uid)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(dims(p.batch, p.heads, p.queries, 1))
        .set_stride({c.lse.stride[0], c.lse.stride[1], c.lse.stride[2], 1});
    std::lock_guard<std::mutex> hl(handles().mutex);
    e.why = finish_graph(*g, handles().get(fn, device), e.workspace);
    if (e.why.empty()) e.graph = std::move(g);
  }
  return cache().entries.emplace(std::move(key), std::move(e)).first->second;
}

const Entry& backward_entry(const FusedBackwardCall& c) {
  const char* fn = "backward";
  const int device = current_device(fn);
  Key key = problem_key(1, device, c.p);
  for (const FusedTensor* t : {&c.q, &c.k, &c.v, &c.o, &c.dout, &c.lse, &c.dq, &c.dk, &c.dv})
    push_tensor(key, *t);
  std::lock_guard<std::mutex> lock(cache().mutex);
  auto it = cache().entries.find(key);
  if (it != cache().entries.end()) return it->second;
  Entry e;
  e.why = precheck(c.p);
  if (e.why.empty()) {
    const FusedProblem& p = c.p;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(io_type(p.type))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const auto qd = dims(p.batch, p.heads, p.queries, p.dim);
    const auto kd = dims(p.batch, p.kv_heads, p.keys, p.dim);
    auto q = input(*g, "Q", q_uid, qd, c.q);
    auto k = input(*g, "K", k_uid, kd, c.k);
    auto v = input(*g, "V", v_uid, kd, c.v);
    auto o = input(*g, "O", o_uid, qd, c.o);
    auto dout = input(*g, "dO", do_uid, qd, c.dout);
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("LSE")
                               .set_uid(lse_uid)
                               .set_dim(dims(p.batch, p.heads, p.queries, 1))
                               .set_stride({c.lse.stride[0], c.lse.stride[1], c.lse.stride[2], 1})
                               .set_data_type(fe::DataType_t::FLOAT));
    auto a = fe::graph::SDPA_backward_attributes()
                 .set_name("blockattn_backward")
                 .set_attn_scale(p.scale);
    set_band(a, p.band);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, a);
    dq->set_output(true).set_uid(dq_uid).set_dim(qd).set_stride(strides(c.dq));
    dk->set_output(true).set_uid(dk_uid).set_dim(kd).set_stride(strides(c.dk));
    dv->set_output(true).set_uid(dv_uid).set_dim(kd).set_stride(strides(c.dv));
    std::lock_guard<std::mutex> hl(handles().mutex);
    e.why = finish_graph(*g, handles().get(fn, device), e.workspace);
    if (e.why.empty()) e.graph = std::move(g);
  }
  return cache().entries.emplace(std::move(key), std::move(e)).first->second;
}

void* ptr(const FusedTensor& t) {
  return const_cast<void*>(t.data);
}

void execute(const char* fn, const Entry& e, std::unordered_map<std::int64_t, void*>& pack,
             void* stream, void* workspace) {
  if (!e.graph) fail(fn, "cuDNN does not run this problem: " + e.why);
  if (e.workspace > 0 && workspace == nullptr)
    fail(fn, "the problem needs " + std::to_string(e.workspace) + " bytes of workspace, got none");
  const int device = current_device(fn);
  std::lock_guard<std::mutex> lock(handles().mutex);
  cudnnHandle_t h = handles().get(fn, device);
  check_cudnn(fn, cudnnSetStream(h, static_cast<cudaStream_t>(stream)), "cudnnSetStream");
  auto status = e.graph->execute(h, pack, workspace);
  if (status.is_bad()) fail(fn, "execute: " + status.get_message());
}

/// cuDNN reads every tensor at a 16-byte aligned address (its error at
/// execute otherwise: "device pointer is not aligned"); a graph is cached by
/// strides, so each call's pointers are checked here.
std::string misaligned(std::initializer_list<const FusedTensor*> ts) {
  for (const FusedTensor* t : ts)
    if (reinterpret_cast<std::uintptr_t>(t->data) % 16 != 0)
      return "a tensor's address is not 16-byte aligned";
  return {};
}

/// BLOCKATTN_CUDNN_VERBOSE=1: every problem cuDNN declines, once, on stderr
/// (why a call took BlockAttn's kernels).
bool verbose() {
  static const bool v = [] {
    const char* e = std::getenv("BLOCKATTN_CUDNN_VERBOSE");
    return e && *e && std::string(e) != "0";
  }();
  return v;
}

bool answer(const char* fn, const FusedProblem& p, const Entry& e, const std::string& call_why,
            std::string* why) {
  const std::string& w = e.graph ? call_why : e.why;
  if (why) *why = w;
  if (!w.empty() && verbose()) {
    static std::mutex m;
    static std::map<std::string, bool> seen;
    std::ostringstream s;
    s << "blockattn: cuDNN " << fn << " declined b=" << p.batch << " h=" << p.heads << "/"
      << p.kv_heads << " " << p.queries << "x" << p.keys << " d=" << p.dim
      << " band(right=" << (p.band.has_right ? std::to_string(p.band.right_bound) : "-")
      << ", left=" << (p.band.has_left ? std::to_string(p.band.left_bound) : "-") << "): " << w;
    std::lock_guard<std::mutex> lock(m);
    if (!seen[s.str()]) {
      seen[s.str()] = true;
      std::fprintf(stderr, "%s\n", s.str().c_str());
    }
  }
  return w.empty();
}

}  // namespace

bool supports_forward(const FusedForwardCall& call, std::string* why) {
  const Entry& e = forward_entry(call);
  return answer("forward", call.p, e, misaligned({&call.q, &call.k, &call.v, &call.o, &call.lse}),
                why);
}

std::size_t forward_workspace(const FusedForwardCall& call) {
  return std::size_t(forward_entry(call).workspace);
}

void forward(const FusedForwardCall& c) {
  std::unordered_map<std::int64_t, void*> pack = {{q_uid, ptr(c.q)},
                                                  {k_uid, ptr(c.k)},
                                                  {v_uid, ptr(c.v)},
                                                  {o_uid, ptr(c.o)},
                                                  {lse_uid, ptr(c.lse)}};
  execute("forward", forward_entry(c), pack, c.stream, c.workspace);
}

bool supports_backward(const FusedBackwardCall& call, std::string* why) {
  const Entry& e = backward_entry(call);
  return answer("backward", call.p, e,
                misaligned({&call.q, &call.k, &call.v, &call.o, &call.dout, &call.lse, &call.dq,
                            &call.dk, &call.dv}),
                why);
}

std::size_t backward_workspace(const FusedBackwardCall& call) {
  return std::size_t(backward_entry(call).workspace);
}

void backward(const FusedBackwardCall& c) {
  std::unordered_map<std::int64_t, void*> pack = {
      {q_uid, ptr(c.q)},   {k_uid, ptr(c.k)},     {v_uid, ptr(c.v)},
      {o_uid, ptr(c.o)},   {do_uid, ptr(c.dout)}, {lse_uid, ptr(c.lse)},
      {dq_uid, ptr(c.dq)}, {dk_uid, ptr(c.dk)},   {dv_uid, ptr(c.dv)}};
  execute("backward", backward_entry(c), pack, c.stream, c.workspace);
}

long version() {
  return long(cudnnGetVersion());
}

}  // namespace blockattn::cudnn
