#include "util/files.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace meshtrain {
namespace files {

namespace {
[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}
}  // namespace

void write_durable(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create", path);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      fail("cannot write", path);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail("cannot fsync", path);
  }
  ::close(fd);
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("cannot open directory", dir);
  ::fsync(fd);
  ::close(fd);
}

std::string directory_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

std::string absolute_path(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  if (!p.empty() && p[0] == '/') return p;
  char cwd[4096];
  if (!::getcwd(cwd, sizeof cwd)) fail("cannot read the working directory for", path);
  while (p.rfind("./", 0) == 0) p = p.substr(2);
  return std::string(cwd) + (p.empty() || p == "." ? "" : "/" + p);
}

void rename_durable(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail("cannot rename " + from + " to", to);
  fsync_directory(directory_of(to));
}

void make_directories(const std::string& dir) {
  std::string partial;
  std::stringstream ss(dir);
  std::string part;
  if (!dir.empty() && dir[0] == '/') partial = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    partial += part + "/";
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) fail("cannot create directory", partial);
  }
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void remove_tree(const std::string& path) {
  if (!exists(path)) return;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); };
  if (nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    throw std::runtime_error("cannot remove " + path + ": " + std::strerror(errno));
  }
}

}  // namespace files
}  // namespace meshtrain
