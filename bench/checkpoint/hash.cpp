// Checksum throughput of what checkpoints use (meshtrain::sha256_hex) on a
// buffer the size of a large shard.
//   build/bin/bench_checkpoint_hash [MiB]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "util/sha256.h"

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 256;
  std::string bytes(mib << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 2654435761u >> 13);
  double best = 1e9;
  std::string digest;
  for (int run = 0; run < 3; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    digest = meshtrain::sha256_hex(bytes);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("sha256_hex: %zu MiB in %.3f s = %.2f GB/s (best of 3; digest %.16s...)\n", mib, best,
              bytes.size() / best / 1e9, digest.c_str());
}
