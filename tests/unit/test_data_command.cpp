// `meshtrain data` (train::run_data_command over data::write_token_shards):
// documents, the held-out split and its names, the vocabulary in the header,
// and what it refuses.

#include <gtest/gtest.h>

#include <cstring>
#include <sstream>

#include "config_error.h"
#include "meshtrain/data.h"
#include "app/commands/data.h"
#include "meshtrain/train.h"
#include "util/files.h"
#include "scratch.h"

using namespace meshtrain;
using meshtrain::testing::config_error_of;
using meshtrain::testing::Scratch;

namespace {

struct Shard {
  int32_t header[4];
  std::string tokens_as_bytes;  // each uint16 token as one byte (byte-level shards)
};

Shard read_shard(const std::string& path) {
  const std::string bytes = files::read_all(path);
  Shard s{};
  std::memcpy(s.header, bytes.data(), sizeof s.header);
  for (size_t i = 1024; i + 1 < bytes.size(); i += 2) {
    uint16_t t;
    std::memcpy(&t, bytes.data() + i, 2);
    s.tokens_as_bytes += static_cast<char>(t);
  }
  return s;
}

std::string run(const std::vector<std::string>& args) {
  std::ostringstream out;
  EXPECT_EQ(train::run_data_command(args, out), 0);
  return out.str();
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A tokenizer whose ids do not fit uint16.
class HugeVocabulary : public data::Tokenizer {
 public:
  std::vector<int32_t> encode(const std::string&) const override { return {70000}; }
  std::string decode(const std::vector<int32_t>&) const override { return ""; }
  int64_t vocab_size() const override { return 70001; }
  std::optional<int32_t> end_of_text_id() const override { return std::nullopt; }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::string describe() const override { return "huge"; }
};

}  // namespace

TEST(DataCommand, DocumentsArePerFileOrPerNonEmptyLine) {
  const Scratch dir("documents");
  const std::string a = dir.file("a.txt", "one\n\ntwo\nthree"), b = dir.file("b.txt", "four\n");
  EXPECT_EQ(data::read_documents({a, b}, false, false), (std::vector<std::string>{"one\n\ntwo\nthree", "four\n"}));
  EXPECT_EQ(data::read_documents({a, b}, true, false), (std::vector<std::string>{"one", "two", "three", "four"}));
  EXPECT_EQ(data::read_documents({a, b}, true, true), (std::vector<std::string>{"one\n", "two\n", "three", "four\n"}));
  EXPECT_EQ(data::held_out_documents(10, 0), 0);
  EXPECT_EQ(data::held_out_documents(10, 0.2), 2);
  EXPECT_EQ(data::held_out_documents(10, 0.01), 1);   // at least one
  EXPECT_EQ(data::held_out_documents(2, 0.9), 1);     // at least one left to train on
}

// --val-fraction holds out the last documents under names the training glob
// does not match; both globs are printed; the header records the vocabulary.
TEST(DataCommand, HeldOutSplitGetsItsOwnShardsAndGlobs) {
  const Scratch dir("split");
  std::string text;
  for (int i = 0; i < 10; ++i) text += "line " + std::to_string(i) + "\n";
  const std::string out = run({"--out", dir + "/d/p", "--per-line", "--val-fraction", "0.2", dir.file("t.txt", text)});
  EXPECT_TRUE(contains(out, "--data '" + dir.dir + "/d/p_train_*.bin'")) << out;
  EXPECT_TRUE(contains(out, "--val-data '" + dir.dir + "/d/p_val_*.bin'")) << out;
  EXPECT_TRUE(contains(out, "training: 8 documents")) << out;
  EXPECT_TRUE(contains(out, "held out: 2 documents")) << out;
  const Shard train = read_shard(dir + "/d/p_train_000000.bin"), val = read_shard(dir + "/d/p_val_000000.bin");
  // Bytes have no end-of-text token: a line keeps its newline.
  EXPECT_EQ(train.tokens_as_bytes, text.substr(0, 8 * 7));
  EXPECT_EQ(val.tokens_as_bytes, "line 8\nline 9\n");
  EXPECT_EQ(train.header[0], 20240520);
  EXPECT_EQ(train.header[2], 8 * 7);
  EXPECT_EQ(train.header[3], 256);
  EXPECT_EQ(train::expand_data_paths(dir + "/d/p_train_*.bin").size(), 1u);
  EXPECT_EQ(train::token_shards_vocab({dir + "/d/p_val_000000.bin"}), 256);
}

// A rerun under the same prefix removes the shards it did not rewrite (a
// glob would read them); shards of a split run are refused for a run
// without one, whose PREFIX_*.bin would read them as training data.
TEST(DataCommand, RerunsLeaveOnlyTheirOwnShards) {
  const Scratch dir("rerun");
  const std::string input = dir.file("t.txt", std::string(100, 'x'));
  run({"--out", dir + "/p", "--shard-tokens", "10", input});
  EXPECT_EQ(train::expand_data_paths(dir + "/p_*.bin").size(), 10u);
  dir.file("p_notes.bin", "a user's file");
  const std::string out = run({"--out", dir + "/p", "--shard-tokens", "40", input});
  EXPECT_TRUE(contains(out, "removed " + dir.dir + "/p_000009.bin")) << out;
  EXPECT_EQ(train::expand_data_paths(dir + "/p_0*.bin").size(), 3u);
  EXPECT_TRUE(files::exists(dir + "/p_notes.bin"));  // not a name meshtrain data writes

  const std::string lines = dir.file("l.txt", "a\nb\nc\n");
  run({"--out", dir + "/s", "--per-line", "--val-fraction", "0.3", lines});
  EXPECT_TRUE(contains(config_error_of([&] { run({"--out", dir + "/s", lines}); }),
                       dir + "/s_train_000000.bin exists from an earlier run with --val-fraction"));
}

TEST(DataCommand, RefusesWhatCannotWork) {
  const Scratch dir("refusals");
  const std::string input = dir.file("t.txt", "just one document");
  auto error = [&](std::vector<std::string> args) {
    return config_error_of([&] {
      std::ostringstream out;
      train::run_data_command(args, out);
    });
  };
  EXPECT_TRUE(contains(error({"--out", dir + "/p", "--train-tokenizer", "300", "--tokenizer", "x.model", input}),
                       "it cannot be combined with --tokenizer x.model"));
  EXPECT_TRUE(contains(error({"--out", dir + "/p", "--val-fraction", "1.5", input}), "--val-fraction 1.5 must be in [0, 1)"));
  EXPECT_TRUE(contains(error({"--out", dir + "/p", "--val-fraction", "0.1", input}),
                       "the input holds 1 document(s); a held-out split needs at least 2"));
  EXPECT_TRUE(contains(error({"--out", dir + "/p", "--tokenizer", dir + "/none.model", input}),
                       "none.model: no such file or directory"));
  EXPECT_TRUE(contains(error({"--out", dir + "/p", "--tokenizer", dir.dir, input}),
                       "without GPT-2's vocab.json + merges.txt"));
  EXPECT_TRUE(contains(error({"--out", dir + "/p", "--tokenizer", input, input}),
                       "libsentencepiece cannot load it as a model"));
  EXPECT_TRUE(contains(config_error_of([&] {
                         data::write_token_shards({"x"}, HugeVocabulary(), data::TokenShardOptions().out_prefix(dir + "/h"));
                       }),
                       "a vocabulary of 70001 ids does not fit token shards' uint16 ids"));
}
