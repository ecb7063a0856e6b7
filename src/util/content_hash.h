#pragma once
// What a file holds and when it last changed, for the checks that every rank
// reads the same bytes and that nobody rewrites them under a running job
// (Note [Input files are proven, then watched] in app/trainer/input_files.h).

#include <cstdint>
#include <string>

namespace meshtrain {
namespace files {

// XXH3-128 of the whole file (Debian's libxxhash; ~10 GB/s from the page
// cache), as 32 hex digits. ConfigError naming the file when it cannot be read.
std::string content_hash(const std::string& path);

// A file's identity in the file system: a rewrite in place keeps the inode
// and the size but moves the modification and change times (ctime cannot be
// set back by a user, mtime can).
struct FileStamp {
  uint64_t device = 0, inode = 0;
  int64_t size = -1;
  int64_t mtime_ns = 0, ctime_ns = 0;
  bool operator==(const FileStamp& o) const {
    return device == o.device && inode == o.inode && size == o.size && mtime_ns == o.mtime_ns &&
           ctime_ns == o.ctime_ns;
  }
  bool operator!=(const FileStamp& o) const { return !(*this == o); }
};
// The stamp of `path`; size -1 when it is gone.
FileStamp stamp_of(const std::string& path);
// How `now` differs from `before`, for a message ("replaced by another
// file", "5000 bytes now, 60000 at start", "rewritten in place (...)").
std::string stamp_change(const FileStamp& before, const FileStamp& now);

}  // namespace files
}  // namespace meshtrain
