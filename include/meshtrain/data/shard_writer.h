#pragma once
// Documents -> llm.c token shards (what `meshtrain data` does), with an
// optional held-out split.
//
// Shard format (llm.c, dev/data/data_common.py write_datafile, version 1):
//   header  256 little-endian int32: [0] magic 20240520, [1] version 1,
//           [2] number of tokens N, [3] the tokenizer's vocabulary size
//           (meshtrain's addition; llm.c leaves it 0 and ignores it),
//           [4..255] zero
//   body    N little-endian uint16 token ids
//
// Each document is framed as [bos] ids [end-of-text]: bos where the tokenizer
// has one (SentencePiece, as Llama's training data), end-of-text where it has
// one (GPT-2's <|endoftext|>, SentencePiece's eos). Byte-level documents have
// neither and are simply concatenated.

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/data/tokenizer.h"

namespace meshtrain {
namespace data {

// The documents of `text_files`, in order: each file whole, or (per_line)
// each non-empty line. A line keeps its '\n' only with keep_newlines (for
// tokenizers without an end-of-text token, where nothing else separates
// lines). ConfigError naming a missing file.
std::vector<std::string> read_documents(const std::vector<std::string>& text_files, bool per_line,
                                        bool keep_newlines);

// How many of `documents` documents the held-out split takes: none for a
// fraction of 0, else round(fraction x documents), at least 1, leaving at
// least one for training. ConfigError naming the fraction and the count.
int64_t held_out_documents(int64_t documents, double fraction);

struct TokenShardOptions {
  // Shards go to <out_prefix>_000000.bin, ... or, with a held-out split,
  // <out_prefix>_train_000000.bin, ... and <out_prefix>_val_000000.bin, ...
  TORCH_ARG(std::string, out_prefix);
  TORCH_ARG(int64_t, shard_tokens) = 100000000;  // llm.c's shard size
  // The last held_out_documents(n, val_fraction) documents are held out.
  TORCH_ARG(double, val_fraction) = 0.0;
};

struct ShardFile {
  std::string path;
  int64_t tokens = 0;
};

struct TokenShardSummary {
  int64_t train_documents = 0, val_documents = 0;
  int64_t train_tokens = 0, val_tokens = 0;
  int64_t vocab_size = 0;
  std::vector<ShardFile> train_files, val_files;
  std::string train_glob, val_glob;  // for --data and --val-data (val_glob empty without a split)
  // Shards of an earlier run under the same names that this run did not rewrite, removed.
  std::vector<std::string> removed_stale;
};

// Writes `documents` through `tokenizer` as shards. ConfigError when the
// vocabulary exceeds uint16 (65536), when there is nothing to write, or when
// shards of the other naming (with / without a split) exist under the prefix
// and the printed glob would read them.
TokenShardSummary write_token_shards(const std::vector<std::string>& documents, const Tokenizer& tokenizer,
                                     const TokenShardOptions& options);

// The vocabulary size a shard's header records (0: not recorded, as llm.c's
// own shards). ConfigError when the file is not a token shard.
int64_t shard_vocab_size(const std::string& path);

}  // namespace data
}  // namespace meshtrain
