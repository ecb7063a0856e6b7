// What proving an input file costs (Note [Input files are proven, then
// watched]): files::content_hash (XXH3-128) over FILE from the disk (its pages
// dropped from the cache first) and from the page cache, best of RUNS, beside
// the SHA-256 a user would run (sha256sum) for scale.
//   build/bin/bench_input_hash FILE [RUNS]
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "util/sha256.h"
#include "util/content_hash.h"

namespace {

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Drops the file's clean pages from the page cache (no root needed).
void drop_cached_pages(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_input_hash FILE [RUNS]\n");
    return 2;
  }
  const std::string path = argv[1];
  const int runs = argc > 2 ? std::atoi(argv[2]) : 3;
  const double gb = meshtrain::files::stamp_of(path).size / 1e9;
  double cold = 1e9, warm = 1e9;
  std::string digest;
  for (int r = 0; r < runs; ++r) {
    drop_cached_pages(path);
    cold = std::min(cold, seconds_of([&] { digest = meshtrain::files::content_hash(path); }));
    warm = std::min(warm, seconds_of([&] { digest = meshtrain::files::content_hash(path); }));
  }
  double sha = 1e9;
  for (int r = 0; r < runs; ++r) {
    sha = std::min(sha, seconds_of([&] {
      if (std::system(("sha256sum " + path + " > /dev/null").c_str()) != 0) std::fprintf(stderr, "sha256sum failed\n");
    }));
  }
  std::printf("{\"gb\": %.3f, \"xxh3_cold_s\": %.3f, \"xxh3_warm_s\": %.3f, \"sha256sum_warm_s\": %.3f, "
              "\"digest\": \"%s\"}\n", gb, cold, warm, sha, digest.c_str());
}
