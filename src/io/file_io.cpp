#include "io/file_io.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "meshtrain/util.h"
#include "util/files.h"

namespace meshtrain {
namespace io {
namespace detail {

// Weight files are little endian; tensors alias their bytes as they lie.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "meshtrain::io reads little-endian weight files in place");

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MESHTRAIN_CHECK(fd >= 0, path, ": cannot open it (", std::strerror(errno), ")");
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw ConfigError(str_cat(path, ": not a regular file"));
  }
  const int64_t size = static_cast<int64_t>(st.st_size);
  void* data = nullptr;
  if (size > 0) {
    // Private and writable: in-place ops on the tensors copy pages, never touch the file.
    data = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  }
  const int saved_errno = errno;
  ::close(fd);
  MESHTRAIN_CHECK(data != MAP_FAILED, path, ": cannot map it (", std::strerror(saved_errno), ")");
  return std::shared_ptr<MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(data_, static_cast<size_t>(size_));
}

at::Tensor tensor_at(const std::shared_ptr<MappedFile>& file, int64_t offset, const std::vector<int64_t>& shape,
                     at::ScalarType dtype) {
  auto* bytes = const_cast<uint8_t*>(file->data()) + offset;
  const auto options = at::TensorOptions().dtype(dtype);
  const bool aligned = reinterpret_cast<uintptr_t>(bytes) % c10::elementSize(dtype) == 0;
  if (!aligned) return at::from_blob(bytes, shape, options).clone();  // see Note [Tensors over a mapped file]
  std::shared_ptr<MappedFile> keep = file;
  return at::from_blob(bytes, shape, [keep](void*) mutable { keep.reset(); }, options);
}

std::string read_prefix(const std::string& path, size_t n) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string out(n, '\0');
  const ssize_t got = ::read(fd, &out[0], n);
  ::close(fd);
  out.resize(got > 0 ? static_cast<size_t>(got) : 0);
  return out;
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  temp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MESHTRAIN_CHECK(fd_ >= 0, path_, ": cannot create ", temp_, " (", std::strerror(errno), ")");
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temp_.c_str());
  }
}

void AtomicFile::write(const void* bytes, size_t n) {
  const auto* p = static_cast<const char*>(bytes);
  while (n > 0) {
    const ssize_t done = ::write(fd_, p, n);
    if (done < 0 && errno == EINTR) continue;
    MESHTRAIN_CHECK(done > 0, path_, ": cannot write ", temp_, " (", std::strerror(errno), ")");
    p += done;
    n -= static_cast<size_t>(done);
  }
}

void AtomicFile::write(const at::Tensor& tensor) {
  const at::Tensor t = tensor.cpu().contiguous();
  write(t.data_ptr(), t.numel() * t.element_size());
}

void AtomicFile::commit() {
  MESHTRAIN_CHECK(::fsync(fd_) == 0, path_, ": cannot fsync ", temp_, " (", std::strerror(errno), ")");
  ::close(fd_);
  fd_ = -1;
  try {
    files::rename_durable(temp_, path_);
  } catch (...) {
    ::unlink(temp_.c_str());
    throw;
  }
}

}  // namespace detail
}  // namespace io
}  // namespace meshtrain
