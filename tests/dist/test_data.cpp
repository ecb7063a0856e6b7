// Data on several ranks: shuffled token shards train like one process (the
// permutation is global, then split), and the held-out loss of --val-data is
// the same on every layout and equals an independent computation from the
// final weights and the held-out files.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "equivalence.h"
#include "harness.h"
#include "meshtrain/comm.h"
#include "meshtrain/dp.h"
#include "meshtrain/models.h"
#include "meshtrain/train.h"
#include "app/commands/data.h"
#include "app/trainer/run_training.h"
#include "util/files.h"

using meshtrain::testing::in_rank_process;
using meshtrain::testing::tiny_gpt;
using meshtrain::testing::train_in_one_process;
using meshtrain::train::TrainConfig;

namespace {

// A directory per test, made by the parent (the ranks see it as their
// parent's) and removed by the parent when the test ends.
struct DataDir {
  explicit DataDir(const std::string& test)
      : path("/tmp/meshtrain-data-" + std::to_string(in_rank_process() ? getppid() : getpid()) + "-" + test) {
    if (in_rank_process()) return;
    meshtrain::files::remove_tree(path);
    meshtrain::files::make_directories(path);
  }
  ~DataDir() {
    if (!in_rank_process()) meshtrain::files::remove_tree(path);
  }
  std::string path;
};

// Byte-level shards of arithmetic lines ("17+25=42\n": bytes below 64), one
// document per line, the last fifth held out: dir/p_train_*.bin, dir/p_val_*.bin.
void write_corpus(const std::string& dir) {
  if (in_rank_process()) return;
  std::ofstream(dir + "/corpus.txt") << meshtrain::train::arithmetic_text(5, 0, 6000, 2);
  std::ostringstream log;
  meshtrain::train::run_data_command({"--out", dir + "/p", "--per-line", "--val-fraction", "0.2", "--shard-tokens",
                                      "1500", dir + "/corpus.txt"}, log);
}

TrainConfig on_shards(const std::string& dir) {
  TrainConfig c = tiny_gpt();  // its --vocab 64 is not "given": the shards' recorded 256 is taken
  c.data = dir + "/p_train_*.bin";
  return c;
}

// Tokens of llm.c shards, in order.
std::vector<std::vector<int64_t>> read_shards(const std::vector<std::string>& paths) {
  std::vector<std::vector<int64_t>> out;
  for (const std::string& p : paths) {
    const std::string bytes = meshtrain::files::read_all(p);
    std::vector<int64_t> tokens;
    for (size_t i = 1024; i + 1 < bytes.size(); i += 2) {
      uint16_t t;
      std::memcpy(&t, bytes.data() + i, 2);
      tokens.push_back(t);
    }
    out.push_back(tokens);
  }
  return out;
}

// The mean next-token loss of the first `count` held-out windows (T + 1
// tokens, stride T, in file order, never across a shard) under `weights`,
// computed here from the files and a dense model: not through the trainer.
double held_out_loss(const TrainConfig& c, const std::map<std::string, at::Tensor>& weights,
                     const std::vector<std::string>& val_files, int64_t count) {
  const int64_t T = c.model.seq_len;
  std::vector<at::Tensor> windows;
  for (const auto& tokens : read_shards(val_files)) {
    for (size_t start = 0; start + T + 1 <= tokens.size() && static_cast<int64_t>(windows.size()) < count; start += T)
      windows.push_back(torch::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.begin() + start + T + 1)));
  }
  EXPECT_EQ(static_cast<int64_t>(windows.size()), count);
  const at::Tensor batch = torch::stack(windows);
  meshtrain::models::Stage model = meshtrain::models::build_stage(c.model, 0, meshtrain::models::num_pieces(c.model));
  torch::NoGradGuard no_grad;
  for (auto& p : meshtrain::dp::unique_parameters(*model)) p.tensor.copy_(weights.at(p.name));
  const at::Tensor logits = model->forward(batch.narrow(1, 0, T));
  return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), batch.narrow(1, 1, T).reshape({-1}))
      .item<double>();
}

}  // namespace

// Shuffled windows (the default) on dp 2 give one process's losses and
// weights: one permutation of all windows, then each rank's slice. And the
// shuffle is on: file order trains on other windows, to other losses.
TEST(Data, ShuffledTokenShardsTrainLikeOneProcess) {
  const DataDir scratch("shuffle");
  const std::string& dir = scratch.path;
  write_corpus(dir);
  TrainConfig c = on_shards(dir);
  c.dp = 2;
  meshtrain::testing::expect_trains_like_one_process(c, 2);
  if (in_rank_process()) return;
  TrainConfig ordered = on_shards(dir);
  ordered.shuffle = false;
  EXPECT_NE(train_in_one_process(on_shards(dir)).losses, train_in_one_process(ordered).losses);
}

// --val-data: the held-out loss after steps 2 and 4 is one process's on dp 2
// and on pp 2, and equals the loss of the final weights on the first
// --val-batches x --global-batch held-out windows, computed independently.
TEST(Data, HeldOutLossOfValDataMatchesAnIndependentComputation) {
  const DataDir scratch("held-out");
  const std::string& dir = scratch.path;
  write_corpus(dir);
  TrainConfig c = on_shards(dir);
  c.val_data = dir + "/p_val_*.bin";
  c.val_batches = 2;
  c.eval_every = 2;
  c.dp = 2;
  meshtrain::testing::expect_trains_like_one_process(c, 2);
  c.dp = 1;
  c.pp = 2;
  c.microbatches = 2;
  meshtrain::testing::expect_trains_like_one_process(c, 2);
  if (in_rank_process()) return;

  TrainConfig single = on_shards(dir);
  single.val_data = c.val_data;
  single.val_batches = 2;
  single.eval_every = 2;
  const TrainConfig resolved = meshtrain::train::resolve(single, 1);
  meshtrain::train::RunOptions quiet;
  quiet.verbose = quiet.evaluate = false;
  const auto r = meshtrain::train::run_training(resolved, meshtrain::comm::make_single_process_world(), quiet);
  ASSERT_EQ(r.eval_steps, (std::vector<int64_t>{2, 4}));
  const double want = held_out_loss(resolved, r.full_parameters, meshtrain::train::expand_data_paths(c.val_data),
                                    single.val_batches * single.global_batch);
  EXPECT_NEAR(r.eval_losses.back(), want, 1e-5 * want) << "the trainer's held-out loss vs the files' own";
  EXPECT_NE(r.eval_losses.front(), r.eval_losses.back());  // evaluated twice, on other weights
}
