#pragma once
// A POSIX shared-memory segment mapped into this process.
//
// Naming and cleanup: a segment is created as /dev/shm/meshtrain-<pid>-<n>
// (pid: the creator), and unlinked as soon as every member has mapped it, so a
// job that ends in any way, kill -9 included, leaves nothing behind (the kernel
// frees the memory with the last mapping). Only a crash inside the short window
// of the rendezvous can leave a name; every creation first removes the names
// whose creator process no longer exists.

#include <cstddef>
#include <memory>
#include <string>

namespace meshtrain {
namespace comm {
namespace shm_backend {

class Segment {
 public:
  // A new zero-filled segment of `bytes`, with a fresh name.
  static std::unique_ptr<Segment> create(size_t bytes);
  // Maps an existing segment by name (its whole size).
  static std::unique_ptr<Segment> open(const std::string& name);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  char* base() const { return base_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Removes the name (idempotent); the mapping stays valid.
  void unlink();

 private:
  Segment(std::string name, char* base, size_t size, bool owner)
      : name_(std::move(name)), base_(base), size_(size), owner_(owner) {}
  std::string name_;
  char* base_;
  size_t size_;
  bool owner_;
  bool unlinked_ = false;
};

// Unlinks /dev/shm/meshtrain-<pid>-* whose creator pid no longer runs. Returns how many.
int sweep_stale_segments();

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
