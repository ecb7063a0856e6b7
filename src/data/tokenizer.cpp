// load_tokenizer, and the byte-level tokenizer.

#include <sys/stat.h>

#include "meshtrain/data.h"
#include "meshtrain/util.h"
#include "tokenizers.h"

namespace meshtrain {
namespace data {

namespace {

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text(ids.size(), '\0');
    for (size_t i = 0; i < ids.size(); ++i) {
      MESHTRAIN_CHECK(ids[i] >= 0 && ids[i] < 256, "byte tokenizer: id ", ids[i], " at position ", i,
                      " is not a byte (0..255)");
      text[i] = static_cast<char>(ids[i]);
    }
    return text;
  }
  int64_t vocab_size() const override { return 256; }
  std::optional<int32_t> end_of_text_id() const override { return std::nullopt; }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::string describe() const override { return "bytes (one byte one token, vocabulary 256, no end-of-text token)"; }
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec.empty() || spec == "bytes") return make_byte_tokenizer();
  struct stat st{};
  MESHTRAIN_CHECK(::stat(spec.c_str(), &st) == 0, "--tokenizer ", spec, ": no such file or directory; give bytes, "
                  "a SentencePiece FILE.model, or a directory with GPT-2's vocab.json + merges.txt (or encoder.json "
                  "+ vocab.bpe)");
  if (S_ISDIR(st.st_mode)) return make_gpt2_tokenizer(spec);
  return make_sentencepiece_tokenizer(spec);
}

}  // namespace data
}  // namespace meshtrain
