// What every rank must share before a run starts, proven rather than assumed:
// the same data bytes (not just the same path) and one save directory.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <cstdio>
#include <string>
#include <vector>

#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/files.h"
#include "util/sha256.h"
#include "util/strings.h"
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

// Note [One job per save directory]
// Two jobs started together with one --save-dir both found it empty, both
// saved, and each pruned and overwrote the other's checkpoints: the directory
// ended holding one job's, while both said "saved". So rank 0 of a job holds
// an exclusive flock(2) on <save-dir>/.meshtrain-lock from its start-up checks
// to its exit, and writes who holds it into the file. A second job's rank 0
// finds the lock held and every rank of that job stops, naming the holder;
// --overwrite does not take a directory from a live job. The kernel drops a
// flock when its process dies, however it dies: a lock file left by a dead
// job is not held, and the next job takes it over (no stale-lock guessing by
// pid or age; on NFS, the server's lock recovery does the same for a lost
// client). The lock goes with the process, so an elastic regroup or a
// restart by meshrun releases it and the new rank 0 takes it again.
namespace {

constexpr const char* kLockFile = ".meshtrain-lock";

std::string holder_description() {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const time_t now = ::time(nullptr);
  struct tm tm {};
  localtime_r(&now, &tm);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
  const char* tag = std::getenv("MESHTRAIN_JOB_TAG");
  return str_cat("a job started ", when, " by pid ", ::getpid(), " on host ", host,
                 tag ? str_cat(" (meshrun job ", tag, ")") : std::string());
}

// Rank 0: the lock's descriptor, or -1 and why not.
std::pair<int, std::string> lock_save_dir(const std::string& dir) {
  const std::string path = dir + "/" + kLockFile;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return {-1, str_cat("--save-dir ", dir, ": cannot create its lock file ", path, ": ", std::strerror(errno),
                        "; --save-dir must be a directory this job can write")};
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    std::string holder = files::read_all(path);
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd);
    return {-1, str_cat("--save-dir ", dir, " is in use by another job (", holder.empty() ? "a job" : holder,
                        " holds ", path, "): two jobs saving into one directory overwrite each other's checkpoints; "
                        "wait for that job to end or stop it, or choose another --save-dir (--overwrite does not "
                        "take a directory from a running job)")};
  }
  const std::string me = holder_description() + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    // Only the description is lost: the lock is held.
  }
  return {fd, ""};
}

}  // namespace

SaveDirLock& SaveDirLock::operator=(SaveDirLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

SaveDirLock::~SaveDirLock() {
  if (fd_ >= 0) ::close(fd_);
}

SaveDirLock check_save_dir(const TrainConfig& c, comm::Communicator& world) {
  if (c.save_dir.empty()) return SaveDirLock();
  check_shared_save_dir(c.save_dir, world);
  std::pair<int, std::string> lock{-1, ""};
  if (world.rank() == 0) lock = lock_save_dir(c.save_dir);
  SaveDirLock held(lock.first);
  const std::string refused = comm::all_gather_strings(world, lock.second)[0];
  MESHTRAIN_CHECK(refused.empty(), refused);
  if (c.resume) return held;
  const std::vector<std::string> committed = complete_checkpoints(c.save_dir);
  const bool has_latest = files::exists(c.save_dir + "/latest");
  if (committed.empty() && !has_latest) return held;
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
  return held;
}

// Rank 0 writes these at the end (and the per-step metrics as it goes): a
// directory that does not exist must not fail a finished run.
void prepare_outputs(const TrainConfig& c, comm::Communicator& world) {
  std::string problem;
  if (world.rank() == 0) {
    for (const auto& out : {std::make_pair("--metrics-out", c.metrics_out), std::make_pair("--plot", c.plot),
                            std::make_pair("--trace", c.trace)}) {
      if (out.second.empty() || !problem.empty()) continue;
      const std::string dir = files::directory_of(out.second);
      try {
        files::make_directories(dir);
      } catch (const std::exception& e) {
        problem = str_cat(out.first, " ", out.second, ": cannot create its directory ", dir, " (", e.what(),
                          "); give a path in a directory this job can write");
      }
      if (problem.empty() && ::access(dir.c_str(), W_OK) != 0) {
        problem = str_cat(out.first, " ", out.second, ": its directory ", dir, " is not writable (",
                          std::strerror(errno), "); give a path in a directory this job can write");
      }
    }
  }
  const std::string refused = comm::all_gather_strings(world, problem)[0];
  MESHTRAIN_CHECK(refused.empty(), refused);
}

}  // namespace train
}  // namespace meshtrain
