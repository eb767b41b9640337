// SPDX-License-Identifier: Apache-2.0
// The start-up of the multi-rank benchmarks: MPI around blockattn_cli::kokkos_main.
#pragma once

#include <mpi.h>

#include "../tools/cli_args.hpp"

namespace bench_mpi {

/// MPI_Init, then body(rank) inside Kokkos (blockattn_cli::kokkos_main), then
/// MPI_Finalize; body's exit status. Every rank reads the same command line
/// and meets the library's errors (collective checks) together: rank 0
/// prints, every rank exits 2.
template <class Body>
int mpi_kokkos_main(int& argc, char** argv, const char* program, const char* usage, Body&& body) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const int rc =
      blockattn_cli::kokkos_main(argc, argv, program, usage, rank == 0, [&] { return body(rank); });
  MPI_Finalize();
  return rc;
}

}  // namespace bench_mpi
