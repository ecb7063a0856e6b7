// `meshtrain data`: text files -> token shards for the trainer, through a
// tokenizer, with a held-out split (both meshtrain/data.h).

#include <unistd.h>

#include <cstdio>
#include <ostream>

#include "meshtrain/data.h"
#include "app/commands/data.h"
#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/files.h"
#include "util/flags.h"

namespace meshtrain {
namespace train {

namespace {

struct DataFlags {
  std::string prefix;
  int64_t shard_tokens = 100000000;
  std::string tokenizer;   // empty: bytes
  int train_tokenizer = 0;  // pieces of a SentencePiece model to train (0: none)
  bool per_line = false;
  double val_fraction = 0;
};

flags::Parser data_parser(DataFlags& d) {
  auto shard_tokens = [&d](const std::string& f, const std::string& v) {
    d.shard_tokens = flags::to_integer<int32_t>(f, v);
    MESHTRAIN_CHECK(d.shard_tokens > 0, f, " ", v, " must be a positive number of tokens");
  };
  using flags::store;
  return flags::Parser(
      "meshtrain data",
      "usage: meshtrain data --out PREFIX [--tokenizer FILE.model|DIR | --train-tokenizer N] [--per-line]\n"
      "                      [--val-fraction F] [--shard-tokens N] FILE...\n"
      "Writes the text FILEs as llm.c token shards for `meshtrain --data` (and a held-out split for --val-data):\n"
      "one document per file (or per line), each [bos] tokens [end-of-text] as the tokenizer has them.\n",
      {{"", {store("--out", "PREFIX", "where the shards go (directories are made)", d.prefix),
             store("--tokenizer", "FILE.model|DIR", "bytes (default: one byte one token, vocabulary 256), a "
                   "SentencePiece model, or a directory with GPT-2's vocab.json + merges.txt / encoder.json + "
                   "vocab.bpe", d.tokenizer),
             store("--train-tokenizer", "N", "train a SentencePiece BPE model of N pieces on the training documents, "
                   "write PREFIX.model and use it (default 0: none)", d.train_tokenizer),
             flags::turn("--per-line", "one document per non-empty line (default: one per file)", d.per_line),
             store("--val-fraction", "F", "hold out the last F of the documents (at least one) as PREFIX_val_*.bin; "
                   "the rest go to PREFIX_train_*.bin", d.val_fraction),
             {"--shard-tokens", "N", "tokens per shard (default 100000000, llm.c's)", shard_tokens}}}});
}

// Trains a SentencePiece model on the training documents alone (never on the
// held-out ones) and returns its path, PREFIX.model.
std::string train_tokenizer(const std::vector<std::string>& documents, int64_t training_documents, const DataFlags& d) {
  // libsentencepiece's trainer reads files, one line one sentence.
  const std::string input = d.prefix + ".tokenizer-input." + std::to_string(::getpid()) + ".txt";
  std::string text;
  for (int64_t i = 0; i < training_documents; ++i) text += documents[i] + "\n";
  files::write_durable(input, text);
  try {
    const std::string model = data::train_sentencepiece({input}, d.train_tokenizer, d.prefix);
    std::remove(input.c_str());
    return model;
  } catch (...) {
    std::remove(input.c_str());
    throw;
  }
}

// The run writes PREFIX_*.bin (and PREFIX.model) and removes an earlier run's
// shards under those names: an input among them would be overwritten or removed.
void check_inputs_are_not_outputs(const std::vector<std::string>& inputs, const std::string& prefix) {
  const std::string out = files::absolute_path(prefix);
  for (const std::string& input : inputs) {
    const std::string in = files::absolute_path(input);
    const bool shard_name = in.rfind(out + "_", 0) == 0 && in.size() > 4 && in.compare(in.size() - 4, 4, ".bin") == 0;
    MESHTRAIN_CHECK(!shard_name && in != out + ".model", "meshtrain data: the input ", input, " is one of the files "
                    "--out ", prefix, " writes or replaces (", prefix, "_*.bin, ", prefix, ".model); choose another --out");
  }
}

void print_summary(const data::TokenShardSummary& s, const data::Tokenizer& tokenizer, int64_t input_files,
                   std::ostream& out) {
  for (const std::string& path : s.removed_stale) out << "removed " << path << " (an earlier run's shard)\n";
  out << "tokenizer: " << tokenizer.describe() << "\n"
      << "documents: " << s.train_documents + s.val_documents << " from " << input_files << " file(s); "
      << "tokens: " << s.train_tokens + s.val_tokens << "; vocabulary " << s.vocab_size
      << " (recorded in each shard's header)\n"
      << "training: " << s.train_documents << " documents, " << s.train_tokens << " tokens in "
      << s.train_files.size() << " shard(s): --data '" << s.train_glob << "'\n";
  if (!s.val_glob.empty()) {
    out << "held out: " << s.val_documents << " documents, " << s.val_tokens << " tokens in " << s.val_files.size()
        << " shard(s): --val-data '" << s.val_glob << "'\n";
  }
}

}  // namespace

int run_data_command(const std::vector<std::string>& args, std::ostream& out) {
  DataFlags d;
  flags::Parser parser = data_parser(d);
  parser.takes_operands();
  if (parser.asks_for_help(args)) {
    out << parser.usage();
    return 0;
  }
  const std::vector<std::string> inputs = parser.parse(args);
  MESHTRAIN_CHECK(!d.prefix.empty() && !inputs.empty(), "meshtrain data: give --out PREFIX and at least one text "
                  "file\n", parser.usage());
  MESHTRAIN_CHECK(d.train_tokenizer == 0 || d.tokenizer.empty(), "meshtrain data: --train-tokenizer ",
                  d.train_tokenizer, " trains ", d.prefix, ".model and uses it; it cannot be combined with --tokenizer ",
                  d.tokenizer, " (drop one)");
  MESHTRAIN_CHECK(d.train_tokenizer >= 0, "--train-tokenizer ", d.train_tokenizer, " must be a number of pieces");
  check_inputs_are_not_outputs(inputs, d.prefix);
  // A tokenizer trained here is SentencePiece's, which has an end-of-text (eos).
  std::unique_ptr<data::Tokenizer> tokenizer = d.train_tokenizer > 0 ? nullptr : data::load_tokenizer(d.tokenizer);
  const bool keep_newlines = tokenizer && !tokenizer->end_of_text_id();
  const std::vector<std::string> documents = data::read_documents(inputs, d.per_line, keep_newlines);
  MESHTRAIN_CHECK(!documents.empty(), "meshtrain data: the input files hold no document (all empty?)");
  const int64_t held = data::held_out_documents(static_cast<int64_t>(documents.size()), d.val_fraction);
  const std::string dir = files::directory_of(d.prefix);
  if (!dir.empty()) files::make_directories(dir);
  if (d.train_tokenizer > 0) {
    const std::string model = train_tokenizer(documents, static_cast<int64_t>(documents.size()) - held, d);
    out << "trained " << model << " (" << d.train_tokenizer << " pieces, on the training documents)\n";
    tokenizer = data::load_tokenizer(model);
  }
  const auto summary = data::write_token_shards(
      documents, *tokenizer,
      data::TokenShardOptions().out_prefix(d.prefix).shard_tokens(d.shard_tokens).val_fraction(d.val_fraction));
  for (const auto* list : {&summary.train_files, &summary.val_files}) {
    for (const data::ShardFile& f : *list) out << "wrote " << f.path << ": " << f.tokens << " tokens\n";
  }
  print_summary(summary, *tokenizer, static_cast<int64_t>(inputs.size()), out);
  return 0;
}

std::vector<std::string> write_token_shards(const std::vector<std::string>& text_paths, const std::string& prefix,
                                            int64_t tokens_per_shard) {
  // Byte-level documents carry no framing: the shards hold the files' bytes, concatenated.
  const auto tokenizer = data::load_tokenizer("bytes");
  const auto summary = data::write_token_shards(data::read_documents(text_paths, false, true), *tokenizer,
                                                data::TokenShardOptions().out_prefix(prefix).shard_tokens(tokens_per_shard));
  std::vector<std::string> paths;
  for (const data::ShardFile& f : summary.train_files) paths.push_back(f.path);
  return paths;
}

}  // namespace train
}  // namespace meshtrain
