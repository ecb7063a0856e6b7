// A program for meshrun's tests: behaves as told by its first argument.
//   env                 print the rank's environment
//   fail R CODE         rank R exits with CODE after 0.3 s; the others sleep 60 s
//   fail-first R        like "fail R 3" on the first attempt only; later attempts succeed
//   grandchild DIR      fork a child that sleeps; both write their pids to DIR; then sleep
//   allreduce           init_from_env, all_reduce(rank + 1), print the sum
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "meshtrain/comm/rendezvous.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "env";
  const int rank = std::atoi(std::getenv("RANK") ? std::getenv("RANK") : "-1");
  const int restart = std::atoi(std::getenv("MESHTRAIN_RESTART_COUNT") ? std::getenv("MESHTRAIN_RESTART_COUNT") : "0");
  if (mode == "env") {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS"}) {
      std::cout << v << "=" << (std::getenv(v) ? std::getenv(v) : "") << std::endl;
    }
    std::cout << "line without newline";
    return 0;
  }
  if (mode == "fail" || mode == "fail-first") {
    const int who = std::atoi(argv[2]);
    const int code = mode == "fail" ? std::atoi(argv[3]) : 3;
    if (rank == who && (mode == "fail" || restart == 0)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::cerr << "rank " << rank << " exiting with " << code << std::endl;
      return code;
    }
    if (mode == "fail-first" && restart > 0) {
      std::cout << "attempt " << restart << " ok" << std::endl;
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (mode == "grandchild") {
    const std::string dir = argv[2];
    const pid_t child = fork();
    if (child == 0) {
      std::ofstream(dir + "/grandchild" + std::to_string(rank)) << getpid();
      std::this_thread::sleep_for(std::chrono::seconds(60));
      _exit(0);
    }
    std::ofstream(dir + "/rank" + std::to_string(rank)) << getpid();
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (mode == "allreduce") {
    auto comm = meshtrain::comm::init_from_env();
    auto t = torch::full({4}, static_cast<float>(comm->rank() + 1));
    comm->all_reduce(t);
    std::cout << "rank " << comm->rank() << " of " << comm->size() << " sum " << t[0].item<float>() << std::endl;
    return 0;
  }
  return 2;
}
