#pragma once
// The files a run reads (--data, --val-data, --init-from): proven the same on
// every rank, then watched while training (internal to the trainer).
//
// Note [Input files are proven, then watched]
// The same path on two nodes may hold other bytes, and a file may be rewritten
// while a job reads it (a data pipeline that regenerates shards in place, an
// `rsync --inplace`). Either trains a model on data nobody chose, silently.
//  - At start, each file's stamp (inode, size, mtime, ctime) is taken and a
//    background thread, at low priority, hashes every byte of it (XXH3-128;
//    a sampled fingerprint missed a 3 MB difference in a 100M-token shard).
//    The ranks compare the hashes as soon as every rank has them (the loss's
//    all-reduce carries who is done), and always before the first checkpoint
//    or the end of the run: nothing trained on differing data is ever saved
//    or reported. A difference stops every rank, naming the file and the ranks.
//  - Every step, each rank compares the stamps with the first ones (a stat per
//    file: microseconds); a file that moved stops every rank before the step's
//    checkpoint, naming it. A change of ctime alone (chmod, a new hard link)
//    is checked against the hash before it stops anything.
// --init-from files are proven the same way: under tensor parallelism each
// rank loads its own slice of them, so nothing else compares them.

#include <atomic>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/comm.h"
#include "app/trainer/config.h"
#include "util/content_hash.h"

namespace meshtrain {
namespace train {

struct InputFile {
  std::string flag;  // "--data", "--val-data", "--init-from"
  std::string path;
};

// The files of `c`: every shard of --data and --val-data (a text file is one
// file), and those of --init-from that its reader opens (llm.c: the file; a
// Hugging Face directory: config.json, the index and the safetensors shards).
std::vector<InputFile> input_files(const TrainConfig& c);

class InputFiles {
 public:
  // Stamps every file now and hashes them in a background thread.
  explicit InputFiles(std::vector<InputFile> files);
  ~InputFiles();
  InputFiles(const InputFiles&) = delete;
  InputFiles& operator=(const InputFiles&) = delete;

  // Whether the background hashing has ended (done or failed).
  bool hashed() const { return hashed_.load(std::memory_order_acquire); }
  // "--data a.bin: 123 bytes, xxh3 <hex>" a line per file, after waiting for
  // the hashes; rethrows the hashing thread's error.
  std::string identities();
  // The first file that changed since it was stamped, as "--data a.bin
  // changed while training: rewritten in place (...)"; "" when none.
  std::string first_change();
  bool empty() const { return files_.empty(); }
  size_t count() const { return files_.size(); }
  // The files' bytes, and the seconds the background thread took (once hashed()).
  int64_t bytes() const;
  double seconds() const { return seconds_; }

 private:
  void hash_all();

  std::vector<InputFile> files_;
  std::vector<files::FileStamp> stamps_;
  std::vector<std::string> hashes_;  // written by the thread before hashed_ is set
  std::string changed_while_hashing_;
  std::exception_ptr error_;
  double seconds_ = 0;  // written by the thread before hashed_ is set
  std::atomic<bool> hashed_{false};
  std::thread thread_;
};

// Collective over `world`: every rank's identities equal rank 0's, else a
// ConfigError on every rank naming the flag, the file, the rank and both
// identities.
void check_same_inputs(InputFiles& inputs, comm::Communicator& world);

// Collective over `world` once some rank found a changed file: a ConfigError
// on every rank naming the first rank's change and the fix.
[[noreturn]] void stop_for_changed_input(const std::string& mine, comm::Communicator& world);

}  // namespace train
}  // namespace meshtrain
