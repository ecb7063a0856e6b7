// The article's toy example: one tensor from node to node.
// Rank 0 sends ten 1.0s; rank 1 receives into ten 0.0s and prints them.
//
//   meshrun --nproc-per-node 2 -- build/bin/send_recv
// or, like the article, in two shells (possibly on two machines):
//   build/bin/send_recv --init tcp://127.0.0.1:29500 --rank 0 --world-size 2
//   build/bin/send_recv --init tcp://127.0.0.1:29500 --rank 1 --world-size 2
#include <torch/torch.h>

#include <iostream>
#include <string>

#include "meshtrain/comm.h"

using namespace meshtrain;

int main(int argc, char** argv) {
  std::string init;
  int rank = -1, world_size = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--init") init = argv[i + 1];
    else if (flag == "--rank") rank = std::stoi(argv[i + 1]);
    else if (flag == "--world-size") world_size = std::stoi(argv[i + 1]);
  }
  try {
    comm::CommPtr comm = init.empty() ? comm::init_from_env() : comm::init_tcp(init, rank, world_size);
    if (comm->size() < 2) {
      std::cerr << "send_recv needs two ranks: run it under meshrun --nproc-per-node 2\n";
      return 2;
    }
    if (comm->rank() == 0) {
      torch::Tensor t = torch::ones({10});
      comm->send(t, /*dst=*/1);
      std::cout << "rank 0 sent ten 1.0s to rank 1" << std::endl;
    } else if (comm->rank() == 1) {
      torch::Tensor t = torch::zeros({10});
      comm->recv(t, /*src=*/0);
      std::cout << "rank 1 received tensor [";
      for (int64_t i = 0; i < t.numel(); ++i) std::cout << (i ? ", " : "") << t[i].item<float>();
      std::cout << "] from rank 0" << std::endl;
    }
  } catch (const std::exception& e) {
    std::cerr << "send_recv: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
