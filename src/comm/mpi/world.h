#pragma once
// Making the MPI world, for init_from_env (no mpi.h here: only the MPI
// sources are compiled with MPI's include path).

#include "meshtrain/comm.h"

namespace meshtrain {
namespace comm {
namespace mpi_backend {

// The world of a job started by mpirun: MPI_COMM_WORLD, duplicated (the
// communicator's own context), initializing MPI on first use. No store, no
// MASTER_ADDR. Collective: every rank of the job calls it.
CommPtr make_world(CommOptions options);

}  // namespace mpi_backend
}  // namespace comm
}  // namespace meshtrain
