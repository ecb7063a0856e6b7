#include "segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "meshtrain/comm.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {
namespace shm_backend {

namespace {

constexpr const char* kPrefix = "meshtrain-";

std::string errno_text() { return std::strerror(errno); }

char* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw CommError(str_cat("cannot map shared-memory segment ", name, " (", bytes, " bytes): ", errno_text()));
  }
  return static_cast<char*>(p);
}

}  // namespace

std::unique_ptr<Segment> Segment::create(size_t bytes) {
  static std::atomic<int> counter{0};
  sweep_stale_segments();
  const std::string name = str_cat("/", kPrefix, ::getpid(), "-", counter++);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throw CommError(str_cat("cannot create shared-memory segment ", name, ": ", errno_text(),
                            " (is /dev/shm mounted and writable? MESHTRAIN_BACKEND=gloo avoids shared memory)"));
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw CommError(str_cat("cannot size shared-memory segment ", name, " to ", bytes, " bytes: ", why));
  }
  char* base = nullptr;
  try {
    base = map_fd(fd, bytes, name);
  } catch (...) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw;
  }
  ::close(fd);
  return std::unique_ptr<Segment>(new Segment(name, base, bytes, true));
}

std::unique_ptr<Segment> Segment::open(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw CommError(str_cat("cannot open shared-memory segment ", name, ": ", errno_text()));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    throw CommError(str_cat("cannot stat shared-memory segment ", name, ": ", why));
  }
  char* base = nullptr;
  try {
    base = map_fd(fd, static_cast<size_t>(st.st_size), name);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return std::unique_ptr<Segment>(new Segment(name, base, static_cast<size_t>(st.st_size), false));
}

Segment::~Segment() {
  if (owner_) unlink();
  ::munmap(base_, size_);
}

void Segment::unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  ::shm_unlink(name_.c_str());
}

int sweep_stale_segments() {
  DIR* dir = ::opendir("/dev/shm");
  if (!dir) return 0;
  int removed = 0;
  const size_t prefix_len = std::strlen(kPrefix);
  while (dirent* e = ::readdir(dir)) {
    if (std::strncmp(e->d_name, kPrefix, prefix_len) != 0) continue;
    const long pid = std::strtol(e->d_name + prefix_len, nullptr, 10);
    if (pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      removed += ::shm_unlink((std::string("/") + e->d_name).c_str()) == 0;
    }
  }
  ::closedir(dir);
  return removed;
}

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
