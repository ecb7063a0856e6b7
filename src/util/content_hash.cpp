#include "util/content_hash.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <memory>
#include <vector>

#include "meshtrain/util.h"

namespace meshtrain {
namespace files {

namespace {

std::string hex128(const XXH128_hash_t& h) {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return buf;
}

int64_t ns_of(const timespec& t) { return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec; }

std::string local_time(int64_t ns) {
  const time_t s = static_cast<time_t>(ns / 1000000000);
  struct tm tm {};
  localtime_r(&s, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

}  // namespace

std::string content_hash(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MESHTRAIN_CHECK(fd >= 0, "cannot open ", path, " to hash it: ", std::strerror(errno));
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(), XXH3_freeState);
  XXH3_128bits_reset(state.get());
  // Sequential reads: the kernel reads ahead, and a file hashed just before
  // training leaves its pages cached for the data loader.
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<char> buffer(1 << 20);
  for (;;) {
    const ssize_t got = ::read(fd, buffer.data(), buffer.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int err = errno;
      ::close(fd);
      throw ConfigError(str_cat("cannot read ", path, " to hash it: ", std::strerror(err)));
    }
    if (got == 0) break;
    XXH3_128bits_update(state.get(), buffer.data(), static_cast<size_t>(got));
  }
  ::close(fd);
  return hex128(XXH3_128bits_digest(state.get()));
}

FileStamp stamp_of(const std::string& path) {
  struct stat st {};
  FileStamp s;
  if (::stat(path.c_str(), &st) != 0) return s;
  s.device = st.st_dev;
  s.inode = st.st_ino;
  s.size = st.st_size;
  s.mtime_ns = ns_of(st.st_mtim);
  s.ctime_ns = ns_of(st.st_ctim);
  return s;
}

std::string stamp_change(const FileStamp& before, const FileStamp& now) {
  if (now.size < 0) return "removed";
  if (now.device != before.device || now.inode != before.inode) return "replaced by another file (a new inode)";
  if (now.size != before.size) return str_cat(now.size, " bytes now, ", before.size, " at start");
  if (now.mtime_ns != before.mtime_ns) return str_cat("rewritten in place (modified at ", local_time(now.mtime_ns), ")");
  return str_cat("changed in place (its status changed at ", local_time(now.ctime_ns), ")");
}

}  // namespace files
}  // namespace meshtrain
