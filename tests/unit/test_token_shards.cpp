// Token shards (llm.c's format): what `meshtrain data` writes, the windows the
// dataset reads back, and a clear error for each kind of bad file.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "meshtrain/data.h"
#include "app/trainer/config.h"
#include "app/commands/data.h"
#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/files.h"

using namespace meshtrain;
using namespace meshtrain::train;

namespace {

// A directory of the test's own, removed when the test ends.
struct Scratch {
  explicit Scratch(const std::string& name) : dir("/tmp/meshtrain-shards-" + std::to_string(getpid()) + "-" + name) {
    std::system(("rm -rf " + dir).c_str());
    files::make_directories(dir);
  }
  ~Scratch() { std::system(("rm -rf " + dir).c_str()); }
  operator const std::string&() const { return dir; }
  std::string operator+(const std::string& tail) const { return dir + tail; }
  std::string dir;
};

std::string write_text(const std::string& dir, const std::string& text) {
  std::ofstream(dir + "/corpus.txt", std::ios::binary) << text;
  return dir + "/corpus.txt";
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

// Header fields as llm.c writes them, then `tokens`.
void write_shard(const std::string& path, int32_t magic, int32_t version, int32_t count, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic, header[1] = version, header[2] = count;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(2 * tokens.size()));
}

}  // namespace

// The bytes of the shard are exactly llm.c's: a 256-int header, then uint16 tokens.
TEST(TokenShards, DataCommandWritesLlmcShards) {
  const Scratch dir("write");
  const std::string text = "0123456789abcdefghijklmnopqrstuvwxyz";  // 36 bytes
  std::ostringstream out;
  ASSERT_EQ(run_data_command({"--out", dir + "/s/part", "--shard-tokens", "16", write_text(dir, text)}, out), 0);
  EXPECT_NE(out.str().find("part_000002.bin: 4 tokens"), std::string::npos) << out.str();
  const std::string bytes = files::read_all(dir + "/s/part_000001.bin");
  ASSERT_EQ(bytes.size(), 1024u + 2 * 16);
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 16);
  uint16_t first;
  std::memcpy(&first, bytes.data() + 1024, 2);
  EXPECT_EQ(first, static_cast<uint16_t>('g'));  // token 16 of the text
}

// A directory given as input, and an input among the names --out writes or
// replaces, are refused naming them; nothing is written.
TEST(TokenShards, DataCommandRefusesADirectoryAndAnInputItWouldOverwrite) {
  const Scratch dir("inputs");
  const std::string text = write_text(dir, "some text for the shards");
  std::ostringstream out;
  EXPECT_EQ(error_of([&] { run_data_command({"--out", dir + "/x", dir.dir}, out); }),
            "meshtrain data: " + dir.dir + " is a directory; give the text files in it (e.g. " + dir.dir + "/*.txt)");
  ASSERT_EQ(run_data_command({"--out", dir + "/x", text}, out), 0);
  const std::string shard = files::read_all(dir + "/x_000000.bin");
  EXPECT_EQ(error_of([&] { run_data_command({"--out", dir + "/x", text, dir + "/x_000000.bin"}, out); }),
            "meshtrain data: the input " + dir.dir + "/x_000000.bin is one of the files --out " + dir.dir +
                "/x writes or replaces (" + dir.dir + "/x_*.bin, " + dir.dir + "/x.model); choose another --out");
  EXPECT_EQ(files::read_all(dir + "/x_000000.bin"), shard);
}

// A directory matched by a --data glob (it used to be "cannot map it (No such device)").
TEST(TokenShards, ADirectoryMatchedByTheGlobIsNamed) {
  const Scratch dir("glob");
  std::ostringstream out;
  ASSERT_EQ(run_data_command({"--out", dir + "/s", write_text(dir, "text for one shard")}, out), 0);
  files::make_directories(dir + "/old.bin");
  EXPECT_EQ(error_of([&] { expand_data_paths(dir + "/*.bin"); }),
            "--data " + dir.dir + "/*.bin matches the directory " + dir.dir + "/old.bin; give a pattern that matches "
            "the shard files alone");
}

// A text file is byte tokens: an explicit --vocab below 256 used to be raised
// to 256 without a word (and a later resume then said "256 now").
TEST(TokenShards, AnExplicitVocabularyTooSmallForATextFileIsRefused) {
  const Scratch dir("vocab");
  const std::string text = write_text(dir, "a text file of more than a window of bytes");
  EXPECT_EQ(error_of([&] { resolve(parse_train_args({"--data", text, "--seq-len", "8", "--vocab", "64"}), 1); }),
            "--vocab 64 is too small for --data " + text + ", a text file read as byte tokens (0-255): give --vocab "
            "256 or more, or leave --vocab out");
  EXPECT_EQ(resolve(parse_train_args({"--data", text, "--seq-len", "8"}), 1).model.vocab, 256);
}

// Unshuffled: windows of T + 1 tokens with stride T inside each shard, in path order,
// wrapping after the last: shards of 16, 16 and 4 tokens at T = 5 hold 3, 3
// and 0 windows.
TEST(TokenShards, SamplesAreTheWindowsInOrder) {
  const Scratch dir("windows");
  std::string text;
  for (int i = 0; i < 36; ++i) text += static_cast<char>(i);
  const auto paths = write_token_shards({write_text(dir, text)}, dir + "/p", 16);
  ASSERT_EQ(paths.size(), 3u);
  ASSERT_EQ(expand_data_paths(dir + "/p_*.bin"), paths);
  const int64_t T = 5;
  auto data = make_token_shard_dataset(paths, T, WindowOrder().shuffle(false));  // llm.c's order (--no-shuffle)
  const Batch b = data->samples(0, 7);  // windows 0..5, then window 0 again
  const int64_t starts[7] = {0, 5, 10, 16, 21, 26, 0};
  for (int s = 0; s < 7; ++s) {
    for (int j = 0; j < T; ++j) {
      EXPECT_EQ(b.inputs[s][j].item<int64_t>(), starts[s] + j) << "sample " << s;
      EXPECT_EQ(b.targets[s][j].item<int64_t>(), starts[s] + j + 1) << "sample " << s;
    }
  }
  EXPECT_TRUE(torch::equal(data->samples(4, 2).inputs, b.inputs.narrow(0, 4, 2)));  // any slice, same samples
}

// Shuffled (the default): each epoch reads every window exactly once, in the
// order of data::Permutation(W, seed, epoch), and another epoch or seed
// reads them in another order.
TEST(TokenShards, ShuffledSamplesVisitEveryWindowOncePerEpoch) {
  const Scratch dir("shuffle");
  std::string text;
  for (int i = 0; i < 200; ++i) text += static_cast<char>(i);
  const auto paths = write_token_shards({write_text(dir, text)}, dir + "/p", 64);  // 64, 64, 64, 8 tokens
  const int64_t T = 4;
  const int64_t W = 3 * 15 + 1;  // (64 - 1) / 4 = 15 windows per full shard, (8 - 1) / 4 = 1 in the last
  auto data = make_token_shard_dataset(paths, T, WindowOrder().seed(1234));
  auto ordered = make_token_shard_dataset(paths, T, WindowOrder().shuffle(false));
  const Batch all = ordered->samples(0, W);
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    const Batch b = data->samples(epoch * W, W);
    std::vector<bool> seen(W, false);
    for (int64_t s = 0; s < W; ++s) {
      const int64_t w = meshtrain::data::Permutation(W, 1234, epoch)(s);
      EXPECT_TRUE(torch::equal(b.inputs[s], all.inputs[w])) << "epoch " << epoch << " sample " << s;
      EXPECT_TRUE(torch::equal(b.targets[s], all.targets[w]));
      EXPECT_FALSE(seen[w]);
      seen[w] = true;
      (epoch == 0 ? epoch0 : epoch1).push_back(w);
    }
  }
  EXPECT_NE(epoch0, epoch1);
  EXPECT_FALSE(torch::equal(data->samples(0, W).inputs, all.inputs));
  auto other_seed = make_token_shard_dataset(paths, T, WindowOrder().seed(1235));
  EXPECT_FALSE(torch::equal(other_seed->samples(0, W).inputs, data->samples(0, W).inputs));
}

TEST(TokenShards, BadFilesAreNamedWithTheFix) {
  const Scratch dir("bad");
  const std::vector<uint16_t> tokens(40, 7);
  write_shard(dir + "/magic.bin", 12345, 1, 40, tokens);
  write_shard(dir + "/version.bin", 20240520, 2, 40, tokens);
  write_shard(dir + "/short.bin", 20240520, 1, 50, tokens);  // promises 50, holds 40
  auto big = tokens;
  big[33] = 300;
  write_shard(dir + "/vocab.bin", 20240520, 1, 40, big);
  write_shard(dir + "/tiny.bin", 20240520, 1, 3, {1, 2, 3});
  std::ofstream(dir + "/stub.bin") << "x";
  auto check = [&](const std::string& file, int64_t vocab) {
    return error_of([&] { check_token_shards({dir + "/" + file}, vocab, 8); });
  };
  EXPECT_NE(check("magic.bin", 256).find("magic.bin: not a token shard (magic number 12345, expected 20240520)"), std::string::npos);
  EXPECT_NE(check("version.bin", 256).find("version.bin: token shard version 2"), std::string::npos);
  EXPECT_NE(check("short.bin", 256).find("short.bin: the header promises 50 tokens (1124 bytes) but the file has 1104 bytes (truncated)"),
            std::string::npos);
  EXPECT_NE(check("vocab.bin", 256).find("vocab.bin: token 300 at position 33 is not below the vocabulary size 256; give --vocab 301"),
            std::string::npos);
  EXPECT_NE(check("tiny.bin", 256).find("no window of --seq-len + 1 = 9 tokens"), std::string::npos);
  EXPECT_NE(check("stub.bin", 256).find("stub.bin: 1 bytes, shorter than a token shard's 1024-byte header"), std::string::npos);
  EXPECT_NE(error_of([&] { expand_data_paths(dir + "/none_*.bin"); }).find("none_*.bin: the pattern matches no file"),
            std::string::npos);
}

// The trainer checks the data in resolve, before it joins the group; a text
// file stays a text file.
TEST(TokenShards, ResolveChecksTheShardsBeforeAnyCommunication) {
  const Scratch dir("resolve");
  std::vector<uint16_t> tokens(100, 1);
  tokens[60] = 200;
  write_shard(dir + "/a.bin", 20240520, 1, 100, tokens);
  auto resolve_with = [&](const std::string& data, const std::string& vocab) {
    return error_of([&] { resolve(parse_train_args({"--model", "gpt", "--data", data, "--vocab", vocab}), 1); });
  };
  EXPECT_NE(resolve_with(dir + "/*.bin", "128").find("a.bin: token 200 at position 60"), std::string::npos);
  EXPECT_EQ(resolve_with(dir + "/*.bin", "256"), "(no error)");
  EXPECT_NE(resolve_with(dir + "/missing_*.bin", "256").find("matches no file"), std::string::npos);
  EXPECT_FALSE(data_is_token_shards(write_text(dir, "plain text")));
  EXPECT_TRUE(data_is_token_shards(dir + "/a.bin"));
}

// One --data glob mixing shards whose headers record vocabularies 256 and
// 1000 (two tokenizers: the same id means other tokens) trained a model of
// 1000; now refused, naming both shards, as --data against --val-data is.
TEST(TokenShards, AGlobMixingTwoRecordedVocabulariesIsRefused) {
  const Scratch dir("mixed-vocab");
  auto write_with_vocab = [&](const std::string& name, int32_t vocab) {
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520, header[1] = 1, header[2] = 100, header[3] = vocab;
    const std::vector<uint16_t> tokens(100, 7);
    std::ofstream out(dir + "/" + name, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    out.write(reinterpret_cast<const char*>(tokens.data()), 200);
  };
  write_with_vocab("a_000000.bin", 256);
  write_with_vocab("a_000001.bin", 256);
  write_with_vocab("a_000002.bin", 1000);
  write_with_vocab("b_000000.bin", 0);  // llm.c records none: no conflict
  EXPECT_EQ(token_shards_vocab({dir + "/a_000000.bin", dir + "/a_000001.bin", dir + "/b_000000.bin"}), 256);
  const std::string e = error_of([&] { resolve(parse_train_args({"--model", "gpt", "--data", dir + "/a_*.bin"}), 1); });
  EXPECT_NE(e.find("--data: " + dir.dir + "/a_000000.bin records a vocabulary of 256 but " + dir.dir + "/a_000002.bin 1000"),
            std::string::npos) << e;
  EXPECT_NE(e.find("Tokenize every shard with the same `meshtrain data --tokenizer`"), std::string::npos) << e;
}
