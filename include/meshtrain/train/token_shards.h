#pragma once
// Token shards: llm.c's (and nanoGPT-style) pre-tokenized training data, read
// memory-mapped.
//
// File format (llm.c, dev/data/data_common.py write_datafile, version 1):
//   header  256 little-endian int32: [0] magic 20240520, [1] version 1,
//           [2] number of tokens N, [3] the vocabulary size (written by
//           `meshtrain data`; 0 in llm.c's own shards), [4..255] zero
//   body    N little-endian uint16 token ids
// so a shard is exactly 1024 + 2 N bytes.
//
// Samples: the shards, in path order, are cut into windows of seq_len + 1
// tokens with stride seq_len (llm.c's loader; a window never crosses a
// shard). Sample i of the run is window data::sample_at(i, W, seed, shuffle)
// of the W windows (data/sampler.h): by default a new seeded permutation of
// all windows every epoch, the same on every layout and rank; in order
// (window i mod W, llm.c's unshuffled loader) with --no-shuffle. The global
// batch of step k is samples [kG, (k+1)G) on every layout, so the position in
// the data is the step number (a checkpoint's step), and resuming, on any
// layout, continues at the same sample.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/arg.h>

#include "meshtrain/train/data.h"

namespace meshtrain {
namespace train {

constexpr int32_t kTokenShardMagic = 20240520;
constexpr int32_t kTokenShardVersion = 1;
constexpr int64_t kTokenShardHeaderInts = 256;

// The files `pattern` names: itself, or a glob's matches, sorted. ConfigError
// (starting with `flag`) when a glob matches nothing.
std::vector<std::string> expand_data_paths(const std::string& pattern, const std::string& flag = "--data");

// Whether `path` starts with the token-shard magic number.
bool is_token_shard(const std::string& path);

// Whether --data means token shards: a glob, a .bin file, or a file with the
// shard magic (anything else is a text file).
bool data_is_token_shards(const std::string& data);

// Checks every shard (header, size, every token id below `vocab`, enough
// tokens for one window); ConfigError naming the file, what is wrong and the
// fix, prefixed by `flag` (--data, --val-data). Runs before any communication.
// Returns the number of windows of seq_len + 1 tokens.
int64_t check_token_shards(const std::vector<std::string>& paths, int64_t vocab, int64_t seq_len,
                           const std::string& flag = "--data");

// The vocabulary the shards' headers record (int [3], `meshtrain data`
// writes it), 0 when none records one (llm.c's shards). Shards that record
// different vocabularies were written by different tokenizers: ConfigError
// naming two of them and `flag`.
int64_t token_shards_vocab(const std::vector<std::string>& paths, const std::string& flag = "--data");

// The order samples read the windows in.
struct WindowOrder {
  // A seeded permutation of all windows per epoch; off: file order.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(uint64_t, seed) = 0;
  // Every token read is checked below it (0: not checked): a shard rewritten
  // under a running job is an error naming it, never an id a vocabulary-parallel
  // layer would silently mask.
  TORCH_ARG(int64_t, vocab) = 0;
};

// The dataset over checked shards.
std::unique_ptr<Dataset> make_token_shard_dataset(const std::vector<std::string>& paths, int64_t seq_len,
                                                  WindowOrder order = WindowOrder());

// Writes `text_paths` (concatenated, byte-level tokens: each byte is a token,
// vocabulary 256) as shards `<prefix>_000000.bin`, ... of at most
// `tokens_per_shard` tokens; returns their paths. data::write_token_shards
// (data/shard_writer.h) takes any tokenizer and a held-out split.
std::vector<std::string> write_token_shards(const std::vector<std::string>& text_paths, const std::string& prefix,
                                            int64_t tokens_per_shard);

}  // namespace train
}  // namespace meshtrain
