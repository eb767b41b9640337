// A consumer of BlockAttn::mpi: the distributed forward with the size-1 MPI world.
#include <blockattn/blockattn.hpp>
#include <blockattn/mpi_communicator.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  int rc = 0;
  {
    blockattn::MpiCommunicator<> comm(MPI_COMM_SELF);
    const int n = 32;
    Kokkos::View<double****> q("q", 1, n, 1, 16), o("o", 1, n, 1, 16);
    Kokkos::View<double***> lse("lse", 1, 1, n);
    Kokkos::deep_copy(q, 1.0);
    blockattn::DistributedAttention<blockattn::StripedPartition, blockattn::CausalMask,
                                    blockattn::RingSchedule, blockattn::MpiCommunicator<>>
        attn(comm);
    attn.forward(q, q, q, o, lse);
    auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
    rc = oh(0, n - 1, 0, 0) == 1.0 ? 0 : 1;  // a mean of ones
    std::printf("consumer_mpi: %s\n", rc == 0 ? "OK" : "FAILED");
  }
  Kokkos::finalize();
  MPI_Finalize();
  return rc;
}
