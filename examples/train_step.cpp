// SPDX-License-Identifier: Apache-2.0
// One training step of a single attention layer over a sequence split across
// MPI ranks with the zigzag partition, the way a training loop uses BlockAttn:
//   1. permute tokens and their position ids into the partitioned layout,
//   2. apply RoPE with the *global* position ids, forward (KV ring),
//   3. a loss L = 1/2 |O - target|^2, so dL/dO = O - target,
//   4. backward (Q ring, BurstAttention), RoPE's backward (rotate back),
//   5. un-permute the gradients to global order,
// and checks them against the same step on one device.
//
//   mpiexec -n 2 ./blockattn_train_step
#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cmath>
#include <cstdio>
#include <random>

namespace {

using V4 = Kokkos::View<double****>;
using V3 = Kokkos::View<double***>;
using Ids = Kokkos::View<blockattn::index_type*>;

/// RoPE on (batch, seq, heads, dim) with position ids pos(seq): pairs (2i, 2i+1)
/// rotate by pos * theta_i, theta_i = 10000^(-2i/D). sign = -1 applies the
/// inverse (RoPE's backward). The angles are tabulated on the host.
void rope(const V4& x, const Ids& pos, double sign) {
  const int B = int(x.extent(0)), N = int(x.extent(1)), H = int(x.extent(2)), D = int(x.extent(3));
  Kokkos::View<double**> cs("cos", N, D / 2), sn("sin", N, D / 2);
  auto csh = Kokkos::create_mirror_view(cs), snh = Kokkos::create_mirror_view(sn);
  auto ph = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), pos);
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < D / 2; ++i) {
      const double a = sign * double(ph(n)) * std::pow(10000.0, -2.0 * i / D);
      csh(n, i) = std::cos(a);
      snh(n, i) = std::sin(a);
    }
  Kokkos::deep_copy(cs, csh);
  Kokkos::deep_copy(sn, snh);
  Kokkos::parallel_for(
      "rope", Kokkos::RangePolicy<>(0, B * N * H), KOKKOS_LAMBDA(const int w) {
        const int h = w % H, n = (w / H) % N, b = w / (H * N);
        for (int i = 0; i < D / 2; ++i) {
          const double c = cs(n, i), s = sn(n, i);
          const double x0 = x(b, n, h, 2 * i), x1 = x(b, n, h, 2 * i + 1);
          x(b, n, h, 2 * i) = c * x0 - s * x1;
          x(b, n, h, 2 * i + 1) = s * x0 + c * x1;
        }
      });
}

V4 copy_of(const V4& x) {
  V4 y("copy", x.extent(0), x.extent(1), x.extent(2), x.extent(3));
  Kokkos::deep_copy(y, x);
  return y;
}

/// dL/dO of L = |O - target|^2 / 2. (A plain function: nvcc's extended
/// lambdas may not sit in a template instantiated with main's local lambdas.)
void loss_grad(const V4& o, const V4& target, const V4& dout) {
  Kokkos::parallel_for(
      "dloss", Kokkos::RangePolicy<>(0, int(o.span())),
      KOKKOS_LAMBDA(const int i) { dout.data()[i] = o.data()[i] - target.data()[i]; });
}

/// The step on one set of Views: returns dL/dq, dL/dk, dL/dv before RoPE.
template <class Forward, class Backward>
void step(const V4& q_in, const V4& k_in, const V4& v, const V4& target, const Ids& pos, V4& dq,
          V4& dk, V4& dv, Forward&& forward, Backward&& backward) {
  V4 q = copy_of(q_in), k = copy_of(k_in);
  rope(q, pos, +1.0);
  rope(k, pos, +1.0);
  V4 o("o", q.extent(0), q.extent(1), q.extent(2), q.extent(3));
  V3 lse("lse", q.extent(0), q.extent(2), q.extent(1));
  forward(q, k, v, o, lse);
  V4 dout("dout", o.extent(0), o.extent(1), o.extent(2), o.extent(3));
  loss_grad(o, target, dout);
  backward(q, k, v, o, lse, dout, dq, dk, dv);
  rope(dq, pos, -1.0);  // d/dq_in of q = R(pos) q_in is R(pos)^T dq = R(-pos) dq
  rope(dk, pos, -1.0);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  int rc = 0;
  {
    using Part = blockattn::ZigzagPartition;
    using Mask = blockattn::CausalMask;
    blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
    const int P = comm.size(), rank = comm.rank();
    const int n = 64, N = n * P, B = 1, H = 2, D = 32;
    const Kokkos::DefaultExecutionSpace exec;

    // Global data, the same on every rank.
    V4 q("q", B, N, H, D), k("k", B, N, H, D), v("v", B, N, H, D), target("t", B, N, H, D);
    std::mt19937_64 rng(11);
    std::uniform_real_distribution<double> u(-1, 1);
    for (auto x : {q, k, v, target}) {
      auto h = Kokkos::create_mirror_view(x);
      for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = u(rng);
      Kokkos::deep_copy(x, h);
    }
    Ids gpos("pos", N);
    Kokkos::parallel_for(
        "iota", Kokkos::RangePolicy<>(0, N), KOKKOS_LAMBDA(const int i) { gpos(i) = i; });

    // Single device: the reference gradients.
    V4 dq1("dq1", B, N, H, D), dk1("dk1", B, N, H, D), dv1("dv1", B, N, H, D);
    step(
        q, k, v, target, gpos, dq1, dk1, dv1,
        [&](auto... a) { blockattn::attention_forward(exec, a..., Mask{}); },
        [&](auto... a) { blockattn::attention_backward(exec, a..., Mask{}); });

    // Distributed: permute tokens, targets and position ids into this rank's part.
    V4 ql("ql", B, n, H, D), kl("kl", B, n, H, D), vl("vl", B, n, H, D), tl("tl", B, n, H, D);
    blockattn::to_local<Part>(exec, P, rank, q, ql);
    blockattn::to_local<Part>(exec, P, rank, k, kl);
    blockattn::to_local<Part>(exec, P, rank, v, vl);
    blockattn::to_local<Part>(exec, P, rank, target, tl);
    const Ids pos =
        blockattn::local_positions<Part, Kokkos::DefaultExecutionSpace::memory_space>(N, P, rank);
    blockattn::DistributedAttention<Part, Mask, blockattn::BurstSchedule,
                                    blockattn::MpiCommunicator<>>
        attn(comm);
    V4 dql("dql", B, n, H, D), dkl("dkl", B, n, H, D), dvl("dvl", B, n, H, D);
    step(
        ql, kl, vl, tl, pos, dql, dkl, dvl, [&](auto... a) { attn.forward(a...); },
        [&](auto... a) { attn.backward(a...); });

    // Un-permute this rank's gradients into global order and compare its rows.
    V4 dq("dq", B, N, H, D), dk("dk", B, N, H, D), dv("dv", B, N, H, D);
    blockattn::from_local<Part>(exec, P, rank, dql, dq);
    blockattn::from_local<Part>(exec, P, rank, dkl, dk);
    blockattn::from_local<Part>(exec, P, rank, dvl, dv);
    const auto map = Part::positions(N, P, rank);
    double err = 0, scale = 0;
    for (auto pair : {std::make_pair(dq, dq1), std::make_pair(dk, dk1), std::make_pair(dv, dv1)}) {
      auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), pair.first);
      auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), pair.second);
      for (int i = 0; i < n; ++i)
        for (int h = 0; h < H; ++h)
          for (int d = 0; d < D; ++d) {
            err = std::max(err, std::abs(a(0, map(i), h, d) - b(0, map(i), h, d)));
            scale = std::max(scale, std::abs(b(0, map(i), h, d)));
          }
    }
    err = comm.allreduce(err, blockattn::ReduceOp::max);
    scale = comm.allreduce(scale, blockattn::ReduceOp::max);
    if (rank == 0)
      std::printf(
          "train step (zigzag, causal, RoPE, %d ranks, Q-ring backward): max |grad - grad_single| "
          "= %.2e (largest gradient %.2e)\n",
          P, err, scale);
    rc = err <= 1e-11 * scale ? 0 : 1;  // fp64: same math, other order of sums
  }
  Kokkos::finalize();
  MPI_Finalize();
  return rc;
}
