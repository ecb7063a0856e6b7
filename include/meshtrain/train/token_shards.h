#pragma once
// Token shards: llm.c's (and nanoGPT-style) pre-tokenized training data, read
// memory-mapped.
//
// File format (llm.c, dev/data/data_common.py write_datafile, version 1):
//   header  256 little-endian int32: [0] magic 20240520, [1] version 1,
//           [2] number of tokens N, [3..255] zero
//   body    N little-endian uint16 token ids
// so a shard is exactly 1024 + 2 N bytes.
//
// Samples: the shards, in path order, are cut into windows of seq_len + 1
// tokens with stride seq_len (llm.c's loader; a window never crosses a
// shard). Sample i is window i mod W of the W windows: the global batch of
// step k is samples [kG, (k+1)G) on every layout, so the position in the data
// is the step number (a checkpoint's step), and resuming, on any layout,
// continues at the same sample. After W samples the data repeats (an epoch).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/train/data.h"

namespace meshtrain {
namespace train {

constexpr int32_t kTokenShardMagic = 20240520;
constexpr int32_t kTokenShardVersion = 1;
constexpr int64_t kTokenShardHeaderInts = 256;

// The files `pattern` names: itself, or a glob's matches, sorted. ConfigError
// when a glob matches nothing.
std::vector<std::string> expand_data_paths(const std::string& pattern);

// Whether `path` starts with the token-shard magic number.
bool is_token_shard(const std::string& path);

// Whether --data means token shards: a glob, a .bin file, or a file with the
// shard magic (anything else is a text file).
bool data_is_token_shards(const std::string& data);

// Checks every shard (header, size, every token id below `vocab`, enough
// tokens for one window); ConfigError naming the file, what is wrong and the
// fix. Runs before any communication.
void check_token_shards(const std::vector<std::string>& paths, int64_t vocab, int64_t seq_len);

// The dataset over checked shards.
std::unique_ptr<Dataset> make_token_shard_dataset(const std::vector<std::string>& paths, int64_t seq_len);

// Writes `texts` (byte-level tokens: each byte is a token, vocabulary 256) as
// shards `<prefix>_000000.bin`, ... of at most `tokens_per_shard` tokens;
// returns their paths (`meshtrain data`).
std::vector<std::string> write_token_shards(const std::vector<std::string>& text_paths, const std::string& prefix,
                                            int64_t tokens_per_shard);

// `meshtrain data [--out PREFIX] [--shard-tokens N] FILE...`; returns the exit code.
int run_data_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace train
}  // namespace meshtrain
