// A tour of the Communicator on local ranks: every collective once, checked,
// then this rank's traffic table.
//   meshrun --nproc-per-node 4 -- build/bin/collectives
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm.h"

using namespace meshtrain;

int main() {
  comm::CommPtr world = comm::init_from_env();
  const int r = world->rank(), n = world->size();
  auto check = [&](const char* what, bool ok) {
    if (r == 0) std::cout << (ok ? "ok     " : "WRONG  ") << what << std::endl;
    if (!ok) std::exit(1);
  };

  auto t = torch::full({5}, static_cast<float>(r + 1));
  world->all_reduce(t);  // sum of 1..n
  check("all_reduce(sum)", torch::equal(t, torch::full({5}, n * (n + 1) / 2.0f)));

  auto b = torch::full({3}, static_cast<float>(r));
  world->broadcast(b, /*root=*/n - 1);
  check("broadcast", torch::equal(b, torch::full({3}, static_cast<float>(n - 1))));

  auto parts = world->all_gather(torch::full({r + 1}, static_cast<float>(r)));  // uneven sizes
  bool ok = static_cast<int>(parts.size()) == n;
  for (int p = 0; ok && p < n; ++p) ok = torch::equal(parts[p], torch::full({p + 1}, static_cast<float>(p)));
  check("all_gather (uneven sizes)", ok);

  auto shard = world->reduce_scatter(torch::ones({10}));  // 10 elements over n ranks: uneven shards
  check("reduce_scatter (uneven shards)", torch::equal(shard, torch::full({shard.numel()}, static_cast<float>(n))));

  auto halves = world->split(r % 2, r, "parity");  // sub-communicator of ranks with the same parity
  auto h = torch::ones({2});
  halves->all_reduce(h);
  check("split + all_reduce on the sub-communicator", torch::equal(h, torch::full({2}, static_cast<float>(halves->size()))));

  world->barrier();
  if (r == 0) std::cout << world->traffic().table("traffic of rank 0 on '" + world->label() + "'");
  return 0;
}
