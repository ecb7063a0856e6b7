#include "resolve_data.h"

#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <map>

#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/files.h"
#include "util/sha256.h"

namespace meshtrain {
namespace train {

namespace {

constexpr const char* kSplitHint = "`meshtrain data --val-fraction 0.05 --out PREFIX ...` writes a training and a "
                                   "held-out split of the same documents";

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) ? std::string(buf) : path;
}

int64_t file_size(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

std::string file_sha256(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  Sha256 hash;
  std::string buf(1 << 20, '\0');
  while (in.read(&buf[0], static_cast<std::streamsize>(buf.size())) || in.gcount() > 0) {
    hash.update(buf.data(), static_cast<size_t>(in.gcount()));
  }
  return hash.hex_digest();
}

// Refuses a held-out file that is a training file: the same file (by real
// path: a link, another spelling) or the same bytes (SHA-256, compared only
// between files of equal size).
void check_no_overlap(const std::vector<std::string>& train, const std::vector<std::string>& val) {
  std::map<std::string, std::string> hashes;  // path -> SHA-256, computed once
  auto hash_of = [&hashes](const std::string& p) -> const std::string& {
    auto it = hashes.find(p);
    return it != hashes.end() ? it->second : hashes.emplace(p, file_sha256(p)).first->second;
  };
  for (const std::string& v : val) {
    for (const std::string& t : train) {
      MESHTRAIN_CHECK(real_path(v) != real_path(t), "--val-data ", v, " is the training file ", t, " (the same file "
                      "by its real path, ", real_path(v), "): a held-out loss must come from documents the model "
                      "never trains on; ", kSplitHint);
      MESHTRAIN_CHECK(file_size(v) != file_size(t) || hash_of(v) != hash_of(t), "--val-data ", v, " holds the same "
                      "bytes as the training file ", t, " (identical content, SHA-256 ", hash_of(v).substr(0, 16),
                      "...): a held-out loss must come from documents the model never trains on; ", kSplitHint);
    }
  }
}

// The vocabulary the shards record (int [3]) becomes the model's unless
// --vocab was given, which must then cover it.
void resolve_vocabulary(TrainConfig& c, const std::vector<std::string>& train, const std::vector<std::string>& val) {
  const int64_t train_vocab = token_shards_vocab(train);
  const int64_t val_vocab = val.empty() ? 0 : token_shards_vocab(val, "--val-data");
  MESHTRAIN_CHECK(train_vocab == 0 || val_vocab == 0 || train_vocab == val_vocab, "--val-data ", c.val_data,
                  ": its shards record a vocabulary of ", val_vocab, " but the training shards (", c.data, ") ",
                  train_vocab, ": different tokenizers? Write both with the same `meshtrain data --tokenizer`");
  const int64_t recorded = std::max(train_vocab, val_vocab);
  if (recorded == 0) return;  // llm.c's shards record none: --vocab (or its default) stands
  if (!c.vocab_given) {
    c.model.vocab = recorded;
    return;
  }
  MESHTRAIN_CHECK(c.model.vocab >= recorded, "--vocab ", c.model.vocab, " is smaller than the vocabulary ", recorded,
                  " recorded in the token shards' header (", c.data, "): the model needs an output for every id the "
                  "tokenizer can write; give --vocab ", recorded, " or more, or leave --vocab out to take it");
}

void resolve_token_shards(TrainConfig& c) {
  MESHTRAIN_CHECK(models::is_language_model(c.model), "--data ", c.data, ": token shards need a language model "
                  "(--model gpt, gpt2 or llama), not --model ", c.model.kind);
  MESHTRAIN_CHECK(!c.val_data.empty() || c.eval_every == 0, "--eval-every ", c.eval_every, ": token shards need "
                  "--val-data for a held-out loss: samples from index 2^40 on (the held-out batch of text files and "
                  "the built-in task) wrap back into the training windows of shards. Write a held-out split with "
                  "`meshtrain data --val-fraction 0.05 --out PREFIX ...` and give --data 'PREFIX_train_*.bin' "
                  "--val-data 'PREFIX_val_*.bin'");
  MESHTRAIN_CHECK(c.val_data.empty() || data_is_token_shards(c.val_data), "--val-data ", c.val_data,
                  " is a text file (byte tokens) but --data ", c.data, " is token shards; write the held-out text "
                  "as shards with the same tokenizer (", kSplitHint, ")");
  const std::vector<std::string> train = expand_data_paths(c.data);
  const std::vector<std::string> val = c.val_data.empty() ? std::vector<std::string>{}
                                                          : expand_data_paths(c.val_data, "--val-data");
  resolve_vocabulary(c, train, val);
  check_token_shards(train, c.model.vocab, c.model.seq_len);
  if (val.empty()) return;
  check_no_overlap(train, val);
  const int64_t windows = check_token_shards(val, c.model.vocab, c.model.seq_len, "--val-data");
  const int64_t needed = static_cast<int64_t>(c.val_batches) * c.global_batch;
  MESHTRAIN_CHECK(windows >= needed, "--val-data ", c.val_data, " holds ", windows, " windows of --seq-len + 1 = ",
                  c.model.seq_len + 1, " tokens, fewer than --val-batches ", c.val_batches, " x --global-batch ",
                  c.global_batch, " = ", needed, " (each held-out window is read once); give --val-batches ",
                  std::max<int64_t>(1, windows / c.global_batch), windows >= c.global_batch ? " or less" : "",
                  ", or hold out more documents");
}

void check_regular_file(const std::string& path, const std::string& flag) {
  MESHTRAIN_CHECK(files::exists(path), flag, " ", path, ": no such file; give a text file or token shards to train "
                  "on, or leave --data out for the built-in task");
  struct stat st{};
  MESHTRAIN_CHECK(::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode), flag, " ", path, " is not a regular file "
                  "(a directory or a device); give a text file, or shards as 'dir/*.bin'");
}

void resolve_text_file(TrainConfig& c) {
  check_regular_file(c.data, "--data");
  MESHTRAIN_CHECK(c.shuffle, "--no-shuffle applies to token shards; a text file (", c.data, ") is read at random "
                  "windows from (--seed, sample index)");
  MESHTRAIN_CHECK(!models::is_language_model(c.model) || !c.vocab_given || !c.init_from.empty() ||
                      c.model.vocab >= 256, "--vocab ", c.model.vocab, " is too small for --data ", c.data,
                  ", a text file read as byte tokens (0-255): give --vocab 256 or more, or leave --vocab out");
  if (models::is_language_model(c.model) && c.init_from.empty()) c.model.vocab = std::max<int64_t>(c.model.vocab, 256);
  MESHTRAIN_CHECK(!models::is_language_model(c.model) || c.model.vocab >= 256, "--data ", c.data, " is a text file "
                  "(byte tokens 0-255) but the model of --init-from ", c.init_from, " predicts ", c.model.vocab,
                  " tokens; give token shards written with the model's tokenizer (meshtrain data --tokenizer)");
  if (c.val_data.empty()) return;
  MESHTRAIN_CHECK(!data_is_token_shards(c.val_data), "--val-data ", c.val_data, " is token shards but --data ",
                  c.data, " is a text file (byte tokens); give a held-out text file, or train on shards too");
  check_regular_file(c.val_data, "--val-data");
  check_no_overlap({c.data}, {c.val_data});
  const int64_t size = file_size(c.val_data);
  MESHTRAIN_CHECK(size > c.model.seq_len + 1, "--val-data ", c.val_data, " has ", size, " bytes; it needs more "
                  "than --seq-len + 1 = ", c.model.seq_len + 1);
}

}  // namespace

void resolve_data(TrainConfig& c) {
  MESHTRAIN_CHECK(c.val_batches >= 1, "--val-batches ", c.val_batches, " must be at least 1");
  const bool val_is_glob = c.val_data.find_first_of("*?[") != std::string::npos;
  MESHTRAIN_CHECK(c.val_data.empty() || val_is_glob || files::exists(c.val_data), "--val-data ", c.val_data,
                  ": no such file; give held-out token shards (a file or a glob such as 'PREFIX_val_*.bin') or, with "
                  "a text file as --data, a held-out text file");
  if (c.data.empty()) {
    MESHTRAIN_CHECK(c.val_data.empty(), "--val-data ", c.val_data, " needs --data: the built-in task holds out "
                    "samples of its own (--eval-every alone)");
    MESHTRAIN_CHECK(c.shuffle, "--no-shuffle applies to token shards (--data 'dir/*.bin'); the built-in task "
                    "draws its samples from (--seed, sample index)");
    return;
  }
  if (data_is_token_shards(c.data)) return resolve_token_shards(c);
  resolve_text_file(c);
}

}  // namespace train
}  // namespace meshtrain
