// See Note [Input files are proven, then watched] in input_files.h.
#include "input_files.h"

#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/strings.h"

namespace meshtrain {
namespace train {

namespace {

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// What io::load_weights reads from a Hugging Face directory: config.json,
// the index and every safetensors shard (sorted: the same order everywhere).
std::vector<std::string> weight_files_in(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name == "config.json" || ends_with(name, ".safetensors") || ends_with(name, ".safetensors.index.json"))
        names.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  for (std::string& n : names) n = dir + "/" + n;
  return names;
}

}  // namespace

std::vector<InputFile> input_files(const TrainConfig& c) {
  std::vector<InputFile> out;
  auto add_data = [&](const std::string& flag, const std::string& spec) {
    if (spec.empty()) return;
    const std::vector<std::string> paths =
        data_is_token_shards(spec) ? expand_data_paths(spec, flag) : std::vector<std::string>{spec};
    for (const std::string& p : paths) out.push_back({flag, p});
  };
  add_data("--data", c.data);
  add_data("--val-data", c.val_data);
  if (!c.init_from.empty()) {
    if (is_directory(c.init_from)) {
      for (const std::string& p : weight_files_in(c.init_from)) out.push_back({"--init-from", p});
    } else {
      out.push_back({"--init-from", c.init_from});
    }
  }
  return out;
}

InputFiles::InputFiles(std::vector<InputFile> files) : files_(std::move(files)) {
  for (const InputFile& f : files_) stamps_.push_back(files::stamp_of(f.path));
  if (files_.empty()) {
    hashed_ = true;
    return;
  }
  thread_ = std::thread([this] { hash_all(); });
}

InputFiles::~InputFiles() {
  if (thread_.joinable()) thread_.join();
}

int64_t InputFiles::bytes() const {
  int64_t n = 0;
  for (const files::FileStamp& s : stamps_) n += std::max<int64_t>(0, s.size);
  return n;
}

void InputFiles::hash_all() {
  // Below the training threads: on a shared core the hash waits, not the step.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    std::vector<std::string> hashes;
    for (size_t i = 0; i < files_.size(); ++i) {
      hashes.push_back(files::content_hash(files_[i].path));
      const files::FileStamp after = files::stamp_of(files_[i].path);
      if (after != stamps_[i] && changed_while_hashing_.empty()) {
        changed_while_hashing_ = str_cat(files_[i].flag, " ", files_[i].path, " changed while training: ",
                                         files::stamp_change(stamps_[i], after));
      }
    }
    hashes_ = std::move(hashes);
  } catch (...) {
    error_ = std::current_exception();
  }
  seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  hashed_.store(true, std::memory_order_release);
}

std::string InputFiles::identities() {
  if (thread_.joinable()) thread_.join();
  if (error_) std::rethrow_exception(error_);
  std::string out;
  for (size_t i = 0; i < files_.size(); ++i) {
    out += str_cat(files_[i].flag, " ", files_[i].path, ": ", stamps_[i].size, " bytes, xxh3 ", hashes_[i], "\n");
  }
  return out;
}

std::string InputFiles::first_change() {
  if (hashed() && !changed_while_hashing_.empty()) return changed_while_hashing_;
  for (size_t i = 0; i < files_.size(); ++i) {
    const files::FileStamp now = files::stamp_of(files_[i].path);
    if (now == stamps_[i]) continue;
    const bool status_only = now.device == stamps_[i].device && now.inode == stamps_[i].inode &&
                             now.size == stamps_[i].size && now.mtime_ns == stamps_[i].mtime_ns;
    if (status_only) {  // chmod, a hard link: the bytes decide
      identities();
      if (files::content_hash(files_[i].path) == hashes_[i]) {
        stamps_[i] = now;
        continue;
      }
    }
    return str_cat(files_[i].flag, " ", files_[i].path, " changed while training: ",
                   files::stamp_change(stamps_[i], now));
  }
  return "";
}

void check_same_inputs(InputFiles& inputs, comm::Communicator& world) {
  const std::vector<std::string> all = comm::all_gather_strings(world, inputs.identities());
  for (int r = 1; r < static_cast<int>(all.size()); ++r) {
    if (all[r] == all[0]) continue;
    const std::vector<std::string> a = split(all[0], '\n'), b = split(all[r], '\n');
    size_t i = 0;
    while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
    const std::string line = i < a.size() ? a[i] : (i < b.size() ? b[i] : "");
    const std::string flag = line.substr(0, line.find(' '));
    throw ConfigError(str_cat(flag, ": rank ", r, " read other bytes than rank 0 under the same name (rank 0: ",
                              i < a.size() ? a[i] : "no file", "; rank ", r, ": ", i < b.size() ? b[i] : "no file",
                              "). Every rank must read the same files: copy the same files to every node"));
  }
}

void stop_for_changed_input(const std::string& mine, comm::Communicator& world) {
  const std::vector<std::string> all = comm::all_gather_strings(world, mine);
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r].empty()) continue;
    throw ConfigError(str_cat(all[r], " (seen by rank ", r, "); stopped before saving anything trained on the new "
                              "bytes. Input files must not be rewritten under a running job: write new data under "
                              "another name, then start (or --resume) a job on it"));
  }
  throw ConfigError("an input file changed while the job was training from it");  // not reached: some rank saw it
}

}  // namespace train
}  // namespace meshtrain
