#pragma once
// meshtrain::io's file plumbing (internal): whole files memory-mapped for
// reading, tensors that alias those maps, and files written atomically.
//
// Note [Tensors over a mapped file]
// Readers map a weight file once and hand out tensors whose storage is the
// mapping itself (at::from_blob with a deleter holding a shared_ptr to the
// MappedFile): a 7B model's 14 GB are then paged in lazily by the kernel and
// never copied, and the mapping lives exactly as long as the last tensor or
// view over it. The mapping is private and writable (MAP_PRIVATE, copy on
// write): an in-place op on such a tensor copies the touched pages and never
// changes the file nor crashes. Two costs, stated: a tensor whose bytes are not
// aligned to its element size is copied instead (kernels may assume alignment);
// and truncating the file while tensors over it live is undefined (SIGBUS on
// the next touch of a lost page), as for any mmap reader (safetensors' own too).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain {
namespace io {
namespace detail {

// A whole file mapped privately (copy on write); an empty file maps nothing.
class MappedFile {
 public:
  // Maps `path`; ConfigError naming it when it cannot be opened or mapped.
  static std::shared_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return static_cast<const uint8_t*>(data_); }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, void* data, int64_t size) : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  void* data_;
  int64_t size_;
};

// A tensor of `dtype` and `shape` over the mapping's bytes from `offset`
// (which the caller has checked lie inside the file); it keeps the mapping
// alive. See Note [Tensors over a mapped file].
at::Tensor tensor_at(const std::shared_ptr<MappedFile>& file, int64_t offset, const std::vector<int64_t>& shape,
                     at::ScalarType dtype);

// The first `n` bytes of a file (fewer when it is shorter); "" when it cannot be read.
std::string read_prefix(const std::string& path, size_t n);

// A file written under a temporary name next to `path` and renamed over it
// by commit() (after an fsync): a reader sees the old file or the whole new
// one, never half of it. Destroyed before commit() (an exception), it removes
// the temporary file.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* bytes, size_t n);
  void write(const std::string& bytes) { write(bytes.data(), bytes.size()); }
  // The tensor's bytes as they lie in memory (made contiguous on the CPU first).
  void write(const at::Tensor& tensor);
  void commit();

 private:
  std::string path_;
  std::string temp_;
  int fd_ = -1;
};

}  // namespace detail
}  // namespace io
}  // namespace meshtrain
