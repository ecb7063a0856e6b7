#pragma once
// Durable file operations for checkpoints: write + fsync, atomic rename,
// directory fsync (so a rename survives a crash), reading whole files.

#include <string>

namespace meshtrain {
namespace files {

// Writes `bytes` to `path` and fsyncs it. Throws std::runtime_error naming the path.
void write_durable(const std::string& path, const std::string& bytes);
// rename(2), then fsync of the directory holding `to`.
void rename_durable(const std::string& from, const std::string& to);
void fsync_directory(const std::string& dir);
void make_directories(const std::string& dir);
bool exists(const std::string& path);
std::string read_all(const std::string& path);
std::string directory_of(const std::string& path);
// `path` from the root: relative ones joined to the working directory (not
// resolving links or "..", so two spellings of one directory may differ).
std::string absolute_path(const std::string& path);
// Removes a directory and everything in it (rm -r); nothing when it is absent.
void remove_tree(const std::string& path);

}  // namespace files
}  // namespace meshtrain
