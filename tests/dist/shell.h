#pragma once
// Shell helpers for the end-to-end tests (meshrun, the meshtrain CLI, the examples).

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace meshtrain {
namespace testing {

// Where the build put meshrun, meshtrain and the examples (CMake defines it).
inline const std::string kBin = MESHTRAIN_BIN_DIR;
// The source tree (tools/, examples/).
inline const std::string kSource = MESHTRAIN_SOURCE_DIR;
// meshrun on a port of its own choosing, for one-node runs.
inline const std::string kMeshrun = kBin + "/meshrun --master-port 0 ";

struct Shell {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
};

// Runs a shell command, capturing stdout and stderr together.
inline Shell sh(const std::string& cmd) {
  const auto t0 = std::chrono::steady_clock::now();
  Shell r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// A fresh directory under /tmp for one test, removed when it ends.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/meshtrain-test-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf " + path_).c_str()); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

}  // namespace testing
}  // namespace meshtrain
