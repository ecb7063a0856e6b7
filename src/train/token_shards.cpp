#include "meshtrain/train.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "meshtrain/data.h"
#include "meshtrain/util.h"
#include "util/files.h"

namespace meshtrain {
namespace train {

namespace {

constexpr int64_t kHeaderBytes = kTokenShardHeaderInts * 4;

// A read-only memory map of a whole file.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    MESHTRAIN_CHECK(fd >= 0, "--data ", path, ": cannot open it (", std::strerror(errno), ")");
    struct stat st{};
    ::fstat(fd, &st);
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      throw ConfigError(str_cat("--data ", path, " is a directory; give the shards in it (e.g. '", path, "/*.bin')"));
    }
    size_ = static_cast<int64_t>(st.st_size);
    if (size_ > 0) data_ = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED, fd, 0);
    fd_ = fd;
    MESHTRAIN_CHECK(data_ != MAP_FAILED, "--data ", path, ": cannot map it (", std::strerror(errno), ")");
  }
  ~MappedFile() {
    if (data_ && data_ != MAP_FAILED) ::munmap(data_, static_cast<size_t>(size_));
    ::close(fd_);
  }
  // The file's size now: a file truncated under the map would raise SIGBUS on
  // the first read past its new end.
  int64_t current_size() const {
    struct stat st{};
    return ::fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(data_); }
  int64_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  int64_t size_ = 0;
  int fd_ = -1;
};

int32_t header_int(const MappedFile& f, int i) {
  int32_t v;
  std::memcpy(&v, f.bytes() + 4 * i, 4);  // little endian on the hosts meshtrain runs on (x86-64, aarch64)
  return v;
}

const uint16_t* tokens_of(const MappedFile& f) { return reinterpret_cast<const uint16_t*>(f.bytes() + kHeaderBytes); }

// The shard's token count, after checking its header and size; errors start with `flag`.
int64_t checked_token_count(const MappedFile& f, const std::string& path, const std::string& flag = "--data") {
  MESHTRAIN_CHECK(f.size() >= kHeaderBytes, flag, " ", path, ": ", f.size(), " bytes, shorter than a token shard's ",
                  kHeaderBytes, "-byte header (truncated, or not a shard)");
  MESHTRAIN_CHECK(header_int(f, 0) == kTokenShardMagic, flag, " ", path, ": not a token shard (magic number ",
                  header_int(f, 0), ", expected ", kTokenShardMagic, "); write shards with `meshtrain data`, or give "
                  "a text file");
  MESHTRAIN_CHECK(header_int(f, 1) == kTokenShardVersion, flag, " ", path, ": token shard version ", header_int(f, 1),
                  "; meshtrain reads version ", kTokenShardVersion, " (uint16 tokens)");
  const int64_t n = header_int(f, 2);
  MESHTRAIN_CHECK(n >= 0 && f.size() == kHeaderBytes + 2 * n, flag, " ", path, ": the header promises ", n,
                  " tokens (", kHeaderBytes + 2 * n, " bytes) but the file has ", f.size(), " bytes",
                  f.size() < kHeaderBytes + 2 * n ? " (truncated)" : "");
  return n;
}

// Windows of seq_len + 1 tokens with stride seq_len in a shard of `tokens`.
int64_t windows_in(int64_t tokens, int64_t seq_len) { return std::max<int64_t>(0, (tokens - 1) / seq_len); }

void check_has_a_window(int64_t windows, int64_t seq_len, const std::string& flag = "--data") {
  MESHTRAIN_CHECK(windows > 0, flag, ": the shards hold no window of --seq-len + 1 = ", seq_len + 1, " tokens");
}

class TokenShardDataset : public Dataset {
 public:
  TokenShardDataset(const std::vector<std::string>& paths, int64_t seq_len, WindowOrder order)
      : paths_(paths), seq_len_(seq_len), order_(order) {
    starts_.push_back(0);
    for (const std::string& p : paths) {
      shards_.push_back(std::make_unique<MappedFile>(p));
      const int64_t n = checked_token_count(*shards_.back(), p);
      counts_.push_back(n);
      starts_.push_back(starts_.back() + windows_in(n, seq_len));
    }
    check_has_a_window(windows(), seq_len);
  }

  Batch samples(int64_t first, int64_t count) const override {
    at::Tensor tokens = at::empty({count, seq_len_ + 1}, at::kLong);
    auto acc = tokens.accessor<int64_t, 2>();
    for (int64_t s = 0; s < count; ++s) {
      const int64_t w = data::sample_at(first + s, windows(), order_.seed(), order_.shuffle());
      const size_t shard = std::upper_bound(starts_.begin(), starts_.end(), w) - starts_.begin() - 1;
      check_unchanged(shard);
      const uint16_t* t = tokens_of(*shards_[shard]) + (w - starts_[shard]) * seq_len_;
      for (int64_t j = 0; j <= seq_len_; ++j) {
        MESHTRAIN_CHECK(order_.vocab() == 0 || t[j] < order_.vocab(), "--data ", paths_[shard], ": token ", t[j],
                        " at position ", (w - starts_[shard]) * seq_len_ + j, " is not below the vocabulary size ",
                        order_.vocab(), ": the file changed while training (it was checked at start)");
        acc[s][j] = t[j];
      }
    }
    return {tokens.narrow(1, 0, seq_len_).contiguous(), tokens.narrow(1, 1, seq_len_).contiguous()};
  }
  int64_t tokens_per_sample() const override { return seq_len_; }
  std::string describe() const override {
    int64_t total = 0;
    for (int64_t n : counts_) total += n;
    return str_cat(paths_.size(), " token shard(s), ", total, " tokens, ", windows(), " windows per epoch, ",
                   order_.shuffle() ? str_cat("shuffled by seed ", order_.seed(), " each epoch") : "in file order");
  }

 private:
  int64_t windows() const { return starts_.back(); }
  void check_unchanged(size_t shard) const {
    const int64_t now = shards_[shard]->current_size();
    MESHTRAIN_CHECK(now == shards_[shard]->size(), "--data ", paths_[shard], " changed while training: ", now,
                    " bytes now, ", shards_[shard]->size(), " at start; training data must not be rewritten under a "
                    "running job (write new shards under another name)");
  }

  std::vector<std::string> paths_;
  int64_t seq_len_;
  WindowOrder order_;
  std::vector<std::unique_ptr<MappedFile>> shards_;
  std::vector<int64_t> counts_, starts_;  // starts_[s]: the first window of shard s; starts_.back(): all windows
};

bool has_glob_characters(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

std::vector<std::string> expand_data_paths(const std::string& pattern, const std::string& flag) {
  if (!has_glob_characters(pattern)) return {pattern};
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> paths;
  if (rc == 0) paths.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  ::globfree(&g);
  MESHTRAIN_CHECK(!paths.empty(), flag, " ", pattern, ": the pattern matches no file");
  for (const std::string& p : paths) {
    struct stat st{};
    MESHTRAIN_CHECK(::stat(p.c_str(), &st) != 0 || !S_ISDIR(st.st_mode), flag, " ", pattern, " matches the directory ",
                    p, "; give a pattern that matches the shard files alone");
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

bool is_token_shard(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  int32_t magic = 0;
  return in.read(reinterpret_cast<char*>(&magic), 4) && magic == kTokenShardMagic;
}

bool data_is_token_shards(const std::string& data) {
  const bool bin = data.size() > 4 && data.compare(data.size() - 4, 4, ".bin") == 0;
  return has_glob_characters(data) || bin || is_token_shard(data);
}

int64_t check_token_shards(const std::vector<std::string>& paths, int64_t vocab, int64_t seq_len,
                           const std::string& flag) {
  MESHTRAIN_CHECK(vocab <= 65536, "--vocab ", vocab, ": token shards hold uint16 ids, so at most 65536");
  int64_t windows = 0;
  for (const std::string& p : paths) {
    MESHTRAIN_CHECK(files::exists(p), flag, " ", p, ": no such file");
    MappedFile f(p);
    const int64_t n = checked_token_count(f, p, flag);
    const uint16_t* t = tokens_of(f);
    const uint16_t* worst = std::max_element(t, t + n);
    MESHTRAIN_CHECK(n == 0 || *worst < vocab, flag, " ", p, ": token ", *worst, " at position ", worst - t,
                    " is not below the vocabulary size ", vocab, "; give --vocab ", *worst + 1, " or more");
    windows += windows_in(n, seq_len);
  }
  check_has_a_window(windows, seq_len, flag);
  return windows;
}

int64_t token_shards_vocab(const std::vector<std::string>& paths, const std::string& flag) {
  int64_t vocab = 0;
  std::string first;  // the first shard that records one
  for (const std::string& p : paths) {
    const int64_t v = data::shard_vocab_size(p);
    if (v == 0) continue;
    MESHTRAIN_CHECK(vocab == 0 || v == vocab, flag, ": ", first, " records a vocabulary of ", vocab, " but ", p, " ",
                    v, ": shards of different tokenizers give the same ids other meanings. Tokenize every shard with "
                    "the same `meshtrain data --tokenizer`, or give them to separate runs");
    if (vocab == 0) first = p;
    vocab = v;
  }
  return vocab;
}

std::unique_ptr<Dataset> make_token_shard_dataset(const std::vector<std::string>& paths, int64_t seq_len,
                                                  WindowOrder order) {
  return std::make_unique<TokenShardDataset>(paths, seq_len, order);
}

}  // namespace train
}  // namespace meshtrain
