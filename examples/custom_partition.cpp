// SPDX-License-Identifier: Apache-2.0
// Writing your own partition policy: block-cyclic, i.e. blocks of `Block`
// consecutive tokens dealt round-robin to the ranks (Block = 1 is the striped
// partition), for any sequence length: the last block may be short, and the
// ranks hold different numbers of tokens. Checked against the single-device
// forward on the global sequence.
//
//   mpiexec -n 2 ./blockattn_custom_partition
#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cmath>
#include <cstdio>
#include <random>

using blockattn::index_type;

template <index_type Block>
struct BlockCyclicPartition {
  static constexpr const char* name() { return "block-cyclic"; }
  // Whole rounds of P blocks give every rank N / P tokens...
  static index_type multiple_of(int P) { return Block * P; }
  // ...and length() lets any N through: rank r holds blocks r, r + P, ...,
  // the last of them (block N / Block) maybe short.
  static index_type length(index_type N, int P, int rank) {
    const index_type blocks = N / Block, tail = N % Block;
    return (blocks / P + (rank < blocks % P ? 1 : 0)) * Block + (rank == blocks % P ? tail : 0);
  }

  // Local index i -> global position: strictly increasing, as the concept asks.
  struct position_map {
    index_type rank = 0, ranks = 1;
    KOKKOS_INLINE_FUNCTION index_type operator()(index_type i) const {
      return ((i / Block) * ranks + rank) * Block + i % Block;
    }
  };
  static position_map positions(index_type, int P, int rank) { return position_map{rank, P}; }
  static blockattn::Owner owner(index_type, int P, index_type t) {
    const index_type block = t / Block;
    return blockattn::Owner{static_cast<int>(block % P), (block / P) * Block + t % Block};
  }
};

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  int rc = 0;
  {
    using Partition = BlockCyclicPartition<16>;
    static_assert(blockattn::is_partition_policy_v<Partition>, "models the partition concept");
    blockattn::MpiCommunicator<> comm(MPI_COMM_WORLD);
    const int P = comm.size(), rank = comm.rank();
    const int N = 96 * P + 37, H = 2, D = 64;  // not a whole number of rounds
    const int n = int(blockattn::local_length<Partition>(N, P, rank));
    using V4 = Kokkos::View<double****>;
    using V3 = Kokkos::View<double***>;
    V4 q("q", 1, N, H, D), k("k", 1, N, H, D), v("v", 1, N, H, D), o("o", 1, N, H, D);
    V3 lse("lse", 1, H, N);
    std::mt19937_64 rng(3);  // same global sequence on every rank
    std::uniform_real_distribution<double> u(-1, 1);
    for (auto view : {q, k, v}) {
      auto h = Kokkos::create_mirror_view(view);
      for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = u(rng);
      Kokkos::deep_copy(view, h);
    }
    blockattn::attention_forward(q, k, v, o, lse, blockattn::CausalMask{});  // reference

    // This rank's tokens, in the partition's local order.
    V4 ql("ql", 1, n, H, D), kl("kl", 1, n, H, D), vl("vl", 1, n, H, D), ol("ol", 1, n, H, D);
    V3 ll("ll", 1, H, n);
    const Kokkos::DefaultExecutionSpace exec;
    blockattn::to_local<Partition>(exec, P, rank, q, ql);
    blockattn::to_local<Partition>(exec, P, rank, k, kl);
    blockattn::to_local<Partition>(exec, P, rank, v, vl);

    blockattn::DistributedAttention<Partition, blockattn::CausalMask, blockattn::RingSchedule,
                                    blockattn::MpiCommunicator<>>
        attn(comm);
    attn.forward(ql, kl, vl, ol, ll);

    // Back into global order, compare this rank's rows with the reference.
    V4 back("back", 1, N, H, D);
    blockattn::from_local<Partition>(exec, P, rank, ol, back);
    auto bh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back);
    auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
    const auto map = Partition::positions(N, P, rank);
    double err = 0.0;
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d)
          err = std::max(err, std::abs(bh(0, map(i), h, d) - oh(0, map(i), h, d)));
    err = comm.allreduce(err, blockattn::ReduceOp::max);
    if (rank == 0)
      std::printf(
          "block-cyclic(16) partition, N = %d over %d ranks, causal: max |O - O_single| = "
          "%.2e\n",
          N, P, err);
    rc = err <= 1e-12 ? 0 : 1;  // fp64: identical up to rounding (~1e-16)
  }
  Kokkos::finalize();
  MPI_Finalize();
  return rc;
}
