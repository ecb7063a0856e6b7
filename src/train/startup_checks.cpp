// What every rank must share before a run starts, proven rather than assumed:
// the same data bytes (not just the same path) and one save directory.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/token_shards.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/files.h"
#include "meshtrain/util/sha256.h"
#include "meshtrain/util/strings.h"
#include "run_parts.h"

namespace meshtrain {
namespace train {

namespace {

// A file's identity, cheap on any size: its length and the SHA-256 of its first
// KiB (a shard's header) and of 64 blocks of 4 KiB spread evenly over it, which
// cover the whole of a file up to 256 KiB. Two copies that differ in length,
// or anywhere in those bytes, differ here; a larger copy that differs only
// between the sampled blocks does not (docs/data.md says so).
std::string file_identity(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MESHTRAIN_CHECK(fd >= 0, "cannot open ", path);
  struct stat st {};
  ::fstat(fd, &st);
  const int64_t size = st.st_size;
  constexpr int64_t kBlock = 4096, kBlocks = 64;
  std::string sampled;
  auto read_at = [&](int64_t offset, int64_t n) {
    std::string bytes(static_cast<size_t>(n), '\0');
    const ssize_t got = ::pread(fd, &bytes[0], bytes.size(), offset);
    sampled += bytes.substr(0, got > 0 ? static_cast<size_t>(got) : 0);
  };
  read_at(0, std::min<int64_t>(size, 1024));
  if (size <= kBlock) read_at(0, size);  // spread blocks would start before the file
  for (int64_t i = 0; size > kBlock && i < kBlocks; ++i) read_at(i * (size - kBlock) / (kBlocks - 1), kBlock);
  ::close(fd);
  return str_cat(size, " bytes, sampled SHA-256 ", sha256_hex(sampled).substr(0, 16));
}

std::vector<std::pair<std::string, std::string>> data_files(const TrainConfig& c) {
  std::vector<std::pair<std::string, std::string>> files;  // flag, path
  auto add = [&](const std::string& flag, const std::string& spec) {
    if (spec.empty()) return;
    const std::vector<std::string> paths =
        data_is_token_shards(spec) ? expand_data_paths(spec, flag) : std::vector<std::string>{spec};
    for (const std::string& p : paths) files.emplace_back(flag, p);
  };
  add("--data", c.data);
  add("--val-data", c.val_data);
  return files;
}

}  // namespace

void check_same_data(const TrainConfig& c, comm::Communicator& world) {
  const auto files = data_files(c);
  std::string mine;
  for (const auto& f : files) mine += f.second + ": " + file_identity(f.second) + "\n";
  const std::vector<std::string> all = comm::all_gather_strings(world, mine);
  for (int r = 1; r < static_cast<int>(all.size()); ++r) {
    if (all[r] == all[0]) continue;
    const std::vector<std::string> a = split(all[0], '\n'), b = split(all[r], '\n');
    size_t i = 0;
    while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
    const std::string flag = i < files.size() ? files[i].first : "--data";
    throw ConfigError(str_cat(flag, ": rank ", r, " reads other bytes than rank 0 under the same name (rank 0: ",
                              i < a.size() ? a[i] : "no file", "; rank ", r, ": ", i < b.size() ? b[i] : "no file",
                              "). Every rank must read the same data: copy the same files to every node"));
  }
}

// Each rank writes a file named by rank 0's nonce, then every rank looks for
// every rank's file: a rank that misses one is on another file system, or
// resolved a relative --save-dir elsewhere.
void check_shared_save_dir(const std::string& dir, comm::Communicator& world) {
  files::make_directories(dir);
  const std::string nonce = comm::all_gather_strings(
      world, str_cat(::getpid(), "-", std::chrono::steady_clock::now().time_since_epoch().count()))[0];
  auto probe = [&](int r) { return str_cat(dir, "/.meshtrain-probe-", nonce, "-rank-", r); };
  files::write_durable(probe(world.rank()), "");
  world.barrier();
  std::string missing;
  for (int r = 0; r < world.size(); ++r)
    if (!files::exists(probe(r))) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  const std::vector<std::string> all = comm::all_gather_strings(world, missing);
  ::unlink(probe(world.rank()).c_str());
  for (int r = 0; r < world.size(); ++r) {
    MESHTRAIN_CHECK(all[r].empty(), "--save-dir ", dir, ": rank ", r, " does not see the file rank(s) ", all[r],
                    " wrote there: --save-dir must be one directory every node sees, at the same path (a shared "
                    "file system; an absolute path when the ranks start in different directories)");
  }
}

void check_save_dir(const TrainConfig& c, comm::Communicator& world) {
  const bool saving = !c.save_dir.empty() && c.save_every > 0;
  if (!saving && !c.resume) return;
  check_shared_save_dir(c.save_dir, world);
  if (!saving || c.resume) return;
  const std::vector<std::string> committed = complete_checkpoints(c.save_dir);
  const bool has_latest = files::exists(c.save_dir + "/latest");
  if (committed.empty() && !has_latest) return;
  MESHTRAIN_CHECK(c.overwrite, "--save-dir ", c.save_dir, " holds the checkpoints of another run (",
                  committed.empty() ? "a 'latest' file" : "the newest: " + committed.front(),
                  "); add --resume to continue it, --overwrite to replace it, or choose another --save-dir");
  world.barrier();  // every rank has looked before rank 0 removes
  if (world.rank() == 0) {
    for (const std::string& step_dir : committed) files::remove_tree(step_dir);
    ::unlink((c.save_dir + "/latest").c_str());
    std::printf("--overwrite: removed the %zu checkpoints of the previous run in %s\n", committed.size(),
                c.save_dir.c_str());
  }
  world.barrier();
}

}  // namespace train
}  // namespace meshtrain
