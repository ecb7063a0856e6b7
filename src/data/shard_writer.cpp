#include "meshtrain/data.h"

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>

#include "meshtrain/util.h"
#include "util/files.h"

namespace meshtrain {
namespace data {

namespace {

constexpr int32_t kMagic = 20240520;  // llm.c's; meshtrain/train.h reads the same
constexpr int32_t kVersion = 1;
constexpr size_t kHeaderBytes = 256 * 4;
constexpr int64_t kMaxVocab = 65536;  // uint16 ids

std::vector<std::string> glob_files(const std::string& pattern) {
  glob_t g{};
  std::vector<std::string> out;
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0) out.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  ::globfree(&g);
  return out;
}

// Shards of one split, cut every shard_tokens tokens.
class ShardWriter {
 public:
  // `infix`: "" (no split), "train_" or "val_".
  ShardWriter(std::string prefix, std::string infix, int64_t shard_tokens, int64_t vocab)
      : prefix_(std::move(prefix)), infix_(std::move(infix)), shard_tokens_(shard_tokens), vocab_(vocab) {}

  void append(const std::vector<int32_t>& ids) {
    for (int32_t id : ids) {
      buffer_.push_back(static_cast<uint16_t>(id));
      if (static_cast<int64_t>(buffer_.size()) == shard_tokens_) flush();
    }
    tokens_ += static_cast<int64_t>(ids.size());
  }
  void finish() {
    if (!buffer_.empty()) flush();
  }
  std::string glob() const { return prefix_ + "_" + infix_ + "*.bin"; }
  // Exactly the names this writer makes (and not a user's PREFIX_notes.bin).
  std::string own_names() const { return prefix_ + "_" + infix_ + "[0-9][0-9][0-9][0-9][0-9][0-9]*.bin"; }
  const std::vector<ShardFile>& written() const { return written_; }
  int64_t tokens() const { return tokens_; }

 private:
  void flush() {
    std::string bytes(kHeaderBytes + 2 * buffer_.size(), '\0');
    const int32_t header[4] = {kMagic, kVersion, static_cast<int32_t>(buffer_.size()), static_cast<int32_t>(vocab_)};
    std::memcpy(&bytes[0], header, sizeof header);  // little endian, as on every host meshtrain runs on
    std::memcpy(&bytes[kHeaderBytes], buffer_.data(), 2 * buffer_.size());
    char name[32];
    std::snprintf(name, sizeof name, "%06zu.bin", written_.size());
    written_.push_back({prefix_ + "_" + infix_ + name, static_cast<int64_t>(buffer_.size())});
    files::write_durable(written_.back().path, bytes);
    buffer_.clear();
  }

  std::string prefix_, infix_;
  int64_t shard_tokens_, vocab_;
  std::vector<uint16_t> buffer_;
  std::vector<ShardFile> written_;
  int64_t tokens_ = 0;
};

// [bos] ids [end-of-text], each where the tokenizer has one.
std::vector<int32_t> framed(const std::string& document, const Tokenizer& tokenizer) {
  std::vector<int32_t> ids;
  if (tokenizer.bos_id()) ids.push_back(*tokenizer.bos_id());
  const std::vector<int32_t> body = tokenizer.encode(document);
  ids.insert(ids.end(), body.begin(), body.end());
  if (tokenizer.end_of_text_id()) ids.push_back(*tokenizer.end_of_text_id());
  return ids;
}

// Without a split the glob is PREFIX_*.bin, which would also read the
// PREFIX_train_ and PREFIX_val_ shards of an earlier run with a split.
void check_no_split_shards_remain(const std::string& prefix) {
  std::vector<std::string> old = glob_files(prefix + "_train_*.bin");
  const std::vector<std::string> val = glob_files(prefix + "_val_*.bin");
  old.insert(old.end(), val.begin(), val.end());
  MESHTRAIN_CHECK(old.empty(), "meshtrain data: ", old.empty() ? "" : old.front(), " exists from an earlier run "
                  "with --val-fraction, and ", prefix, "_*.bin would read it as training data; remove those shards "
                  "or choose another --out");
}

// Shards under the writer's glob that this run did not write (an earlier,
// longer run), removed so that the glob reads this run's alone.
void remove_stale(const ShardWriter& writer, std::vector<std::string>& removed) {
  std::set<std::string> mine;
  for (const ShardFile& f : writer.written()) mine.insert(f.path);
  for (const std::string& path : glob_files(writer.own_names())) {
    if (mine.count(path)) continue;
    std::remove(path.c_str());
    removed.push_back(path);
  }
}

}  // namespace

std::vector<std::string> read_documents(const std::vector<std::string>& text_files, bool per_line, bool keep_newlines) {
  std::vector<std::string> documents;
  for (const std::string& path : text_files) {
    MESHTRAIN_CHECK(files::exists(path), "meshtrain data: ", path, ": no such file");
    struct stat st {};
    MESHTRAIN_CHECK(::stat(path.c_str(), &st) == 0 && !S_ISDIR(st.st_mode), "meshtrain data: ", path,
                    " is a directory; give the text files in it (e.g. ", path, "/*.txt)");
    std::string text = files::read_all(path);
    if (!per_line) {
      if (!text.empty()) documents.push_back(std::move(text));
      continue;
    }
    for (size_t begin = 0; begin < text.size();) {
      size_t end = text.find('\n', begin);
      const bool has_newline = end != std::string::npos;
      if (!has_newline) end = text.size();
      if (end > begin) documents.push_back(text.substr(begin, end - begin + (keep_newlines && has_newline ? 1 : 0)));
      begin = end + 1;
    }
  }
  return documents;
}

int64_t held_out_documents(int64_t documents, double fraction) {
  MESHTRAIN_CHECK(fraction >= 0 && fraction < 1, "--val-fraction ", fraction,
                  " must be in [0, 1): the share of documents held out (e.g. 0.05)");
  if (fraction == 0) return 0;
  MESHTRAIN_CHECK(documents >= 2, "--val-fraction ", fraction, ": the input holds ", documents,
                  " document(s); a held-out split needs at least 2 (give more files, or --per-line)");
  const int64_t held = std::llround(fraction * static_cast<double>(documents));
  return std::min(documents - 1, std::max<int64_t>(1, held));
}

TokenShardSummary write_token_shards(const std::vector<std::string>& documents, const Tokenizer& tokenizer,
                                     const TokenShardOptions& options) {
  const std::string& prefix = options.out_prefix();
  MESHTRAIN_CHECK(!prefix.empty(), "meshtrain data: give --out PREFIX");
  MESHTRAIN_CHECK(options.shard_tokens() >= 1, "--shard-tokens ", options.shard_tokens(), " must be positive");
  MESHTRAIN_CHECK(tokenizer.vocab_size() <= kMaxVocab, "--tokenizer: ", tokenizer.describe(), ": a vocabulary of ",
                  tokenizer.vocab_size(), " ids does not fit token shards' uint16 ids (at most ", kMaxVocab,
                  "); use a tokenizer of at most 65536 ids");
  MESHTRAIN_CHECK(!documents.empty(), "meshtrain data: the input files hold no document (empty files?)");
  const int64_t held = held_out_documents(static_cast<int64_t>(documents.size()), options.val_fraction());
  const std::string dir = files::directory_of(prefix);
  if (!dir.empty()) files::make_directories(dir);
  if (held == 0) check_no_split_shards_remain(prefix);

  ShardWriter train(prefix, held > 0 ? "train_" : "", options.shard_tokens(), tokenizer.vocab_size());
  ShardWriter val(prefix, "val_", options.shard_tokens(), tokenizer.vocab_size());
  const size_t first_held = documents.size() - static_cast<size_t>(held);
  for (size_t d = 0; d < documents.size(); ++d) (d < first_held ? train : val).append(framed(documents[d], tokenizer));
  train.finish();
  val.finish();

  TokenShardSummary s;
  s.train_documents = static_cast<int64_t>(first_held);
  s.val_documents = held;
  s.train_tokens = train.tokens();
  s.val_tokens = val.tokens();
  s.vocab_size = tokenizer.vocab_size();
  s.train_files = train.written();
  s.val_files = val.written();
  s.train_glob = train.glob();
  s.val_glob = held > 0 ? val.glob() : "";
  remove_stale(train, s.removed_stale);
  if (held > 0) remove_stale(val, s.removed_stale);
  return s;
}

int64_t shard_vocab_size(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  int32_t header[4] = {0, 0, 0, 0};
  MESHTRAIN_CHECK(in.read(reinterpret_cast<char*>(header), sizeof header) && header[0] == kMagic, path,
                  ": not a token shard (no magic number ", kMagic, ")");
  return header[3];
}

}  // namespace data
}  // namespace meshtrain
