// SPDX-License-Identifier: Apache-2.0
// Test main for multi-rank tests: MPI, then Kokkos, then doctest on every rank.
// Every rank reports its own failures; the exit code is non-zero on every rank
// if any rank failed (MPI_Allreduce of the failure flag).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdio>

#include "device_gate.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // No GPU for a device build: every rank skips (the same answer everywhere).
  int missing = blockattn::test::device_missing() ? 1 : 0, any_missing = 0;
  MPI_Allreduce(&missing, &any_missing, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any_missing) {
    MPI_Finalize();
    return blockattn::test::skip_return_code;
  }
  Kokkos::initialize(argc, argv);
  int failed = 0;
  {
    // Every rank runs and reports (doctest prints failures and a summary).
    doctest::Context context(argc, argv);
    failed = context.run() != 0 ? 1 : 0;
    if (failed) std::fprintf(stderr, "[blockattn] rank %d of %d: FAILED\n", rank, size);
  }
  Kokkos::finalize();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0)
    std::printf("[blockattn] %d ranks: %s\n", size,
                any ? "FAILED on some rank" : "all ranks passed");
  MPI_Finalize();
  return any;
}
