// The trainer's data flags resolved before any communication: the vocabulary
// from the shards' header, --val-data and what it refuses (overlap with the
// training files, another tokenizer, too few windows), --eval-every on shards
// without it, --no-shuffle where it means nothing.

#include <gtest/gtest.h>

#include <sstream>

#include "config_error.h"
#include "app/trainer/config.h"
#include "app/commands/data.h"
#include "meshtrain/train.h"
#include "scratch.h"

using namespace meshtrain;
using meshtrain::testing::config_error_of;
using meshtrain::testing::Scratch;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Byte-level train and held-out shards of `lines` lines ("line i\n") under dir/p.
void write_split(const Scratch& dir, int lines) {
  std::string text;
  for (int i = 0; i < lines; ++i) text += "line " + std::to_string(i) + "\n";
  std::ostringstream out;
  train::run_data_command({"--out", dir + "/p", "--per-line", "--val-fraction", "0.25", dir.file("t.txt", text)}, out);
}

train::TrainConfig resolve_flags(std::vector<std::string> flags) {
  flags.insert(flags.begin(), {"--model", "gpt", "--seq-len", "8", "--global-batch", "4"});
  return train::resolve(train::parse_train_args(flags), 1);
}

std::string refusal(const std::vector<std::string>& flags) {
  return config_error_of([&] { resolve_flags(flags); });
}

}  // namespace

TEST(ValData, VocabularyComesFromTheShardsHeaderUnlessGiven) {
  const Scratch dir("vocab");
  write_split(dir, 40);
  const std::string train = dir + "/p_train_*.bin", val = dir + "/p_val_*.bin";
  EXPECT_EQ(resolve_flags({"--data", train}).model.vocab, 256);  // not the default 128
  EXPECT_EQ(resolve_flags({"--data", train, "--vocab", "512"}).model.vocab, 512);
  EXPECT_TRUE(contains(refusal({"--data", train, "--vocab", "128"}),
                       "--vocab 128 is smaller than the vocabulary 256 recorded in the token shards' header"));
  EXPECT_EQ(resolve_flags({"--data", train, "--val-data", val, "--val-batches", "1"}).val_batches, 1);
}

TEST(ValData, TokenShardsNeedValDataForAHeldOutLoss) {
  const Scratch dir("eval");
  write_split(dir, 40);
  EXPECT_TRUE(contains(refusal({"--data", dir + "/p_train_*.bin", "--eval-every", "5"}),
                       "token shards need --val-data for a held-out loss"));
  EXPECT_EQ(refusal({"--data", dir + "/p_train_*.bin", "--eval-every", "5", "--val-data", dir + "/p_val_*.bin",
                     "--val-batches", "2"}),
            "");
  // Text files and the built-in task keep their own held-out samples.
  EXPECT_EQ(refusal({"--data", dir + "/t.txt", "--eval-every", "5"}), "");
  EXPECT_EQ(refusal({"--eval-every", "5"}), "");
}

// The same file (by real path, whatever the spelling) or the same bytes in
// another file is refused, naming both files and which of the two it is.
TEST(ValData, OverlapWithTheTrainingFilesIsRefused) {
  const Scratch dir("overlap");
  write_split(dir, 40);
  const std::string shard = dir + "/p_train_000000.bin";
  EXPECT_TRUE(contains(refusal({"--data", dir + "/p_train_*.bin", "--val-data", dir + "/./p_train_000000.bin"}),
                       "--val-data " + dir.dir + "/./p_train_000000.bin is the training file " + shard +
                           " (the same file by its real path"));
  dir.file("copy.bin", files::read_all(shard));
  EXPECT_TRUE(contains(refusal({"--data", dir + "/p_train_*.bin", "--val-data", dir + "/copy.bin"}),
                       "--val-data " + dir.dir + "/copy.bin holds the same bytes as the training file " + shard +
                           " (identical content, SHA-256"));
  const std::string text = dir.file("a.txt", std::string(200, 'a'));
  dir.file("b.txt", std::string(200, 'a'));
  EXPECT_TRUE(contains(refusal({"--data", text, "--val-data", dir + "/b.txt"}), "holds the same bytes"));
  dir.file("c.txt", std::string(200, 'c'));
  EXPECT_EQ(refusal({"--data", text, "--val-data", dir + "/c.txt", "--eval-every", "2"}), "");
}

TEST(ValData, MismatchedOrTooSmallHeldOutSetsAreRefused) {
  const Scratch dir("mismatch");
  write_split(dir, 40);  // 10 held-out lines of 8 bytes ("line 30\n"): 80 tokens, (80 - 1) / 8 = 9 windows
  const std::string train = dir + "/p_train_*.bin", val = dir + "/p_val_*.bin";
  EXPECT_TRUE(contains(refusal({"--data", train, "--val-data", val}),
                       "holds 9 windows of --seq-len + 1 = 9 tokens, fewer than --val-batches 8 x --global-batch 4 "
                       "= 32 (each held-out window is read once); give --val-batches 2 or less"));
  EXPECT_TRUE(contains(refusal({"--data", train, "--val-data", dir + "/t.txt"}),
                       "is a text file (byte tokens) but --data " + train + " is token shards"));
  EXPECT_TRUE(contains(refusal({"--data", dir + "/t.txt", "--val-data", val}), "is token shards but --data"));
  EXPECT_TRUE(contains(refusal({"--val-data", val}), "needs --data"));
  EXPECT_TRUE(contains(refusal({"--data", train, "--val-data", dir + "/none.txt"}), "none.txt: no such file"));
  EXPECT_TRUE(contains(refusal({"--data", dir + "/t.txt", "--no-shuffle"}), "--no-shuffle applies to token shards"));
}
