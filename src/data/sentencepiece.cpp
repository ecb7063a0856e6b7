// SentencePiece models: the tokenizer and the trainer, through the plugin
// libmeshtrain_sentencepiece.so loaded in a link-map namespace of its own
// (Note [SentencePiece in its own link-map namespace] in sentencepiece_plugin.h).

#include <dlfcn.h>

#include <cstdlib>
#include <vector>

#include "meshtrain/util.h"
#include "sentencepiece_plugin.h"
#include "tokenizers.h"

namespace meshtrain {
namespace data {

namespace {

constexpr const char* kPluginName = "libmeshtrain_sentencepiece.so";

// The plugin's functions (null `functions_loaded` when it could not be loaded).
struct Plugin {
  bool functions_loaded = false;
  std::string load_error;
  decltype(&mt_spm_load) load = nullptr;
  decltype(&mt_spm_free) free = nullptr;
  decltype(&mt_spm_info) info = nullptr;
  decltype(&mt_spm_encode) encode = nullptr;
  decltype(&mt_spm_decode) decode = nullptr;
  decltype(&mt_spm_train) train = nullptr;
};

// Where to look: $MESHTRAIN_SENTENCEPIECE_PLUGIN, beside the object holding
// this code (libmeshtrain.so in build/lib or the installed libdir; a program
// linking libmeshtrain statically: its directory and ../lib), then the
// library search path.
std::vector<std::string> plugin_candidates() {
  if (const char* given = std::getenv("MESHTRAIN_SENTENCEPIECE_PLUGIN")) return {given};
  std::vector<std::string> out;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&plugin_candidates), &info) != 0 && info.dli_fname) {
    std::string self = info.dli_fname;
    const size_t slash = self.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : self.substr(0, slash);
    out.push_back(dir + "/" + kPluginName);
    out.push_back(dir + "/../lib/" + kPluginName);
  }
  out.push_back(kPluginName);
  return out;
}

template <typename F>
void bind(void* library, const char* name, F& into, std::string& missing) {
  into = reinterpret_cast<F>(::dlsym(library, name));
  if (!into) missing += std::string(missing.empty() ? "" : ", ") + name;
}

Plugin load_plugin() {
  Plugin p;
  void* library = nullptr;
  std::string tried;
  for (const std::string& path : plugin_candidates()) {
    library = ::dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library) break;
    const char* why = ::dlerror();
    tried += "\n  " + path + ": " + (why ? why : "not loadable");
  }
  if (!library) {
    p.load_error = str_cat("SentencePiece: cannot load ", kPluginName, ", meshtrain's bridge to libsentencepiece; "
                           "tried:", tried, "\nIt is built with libmeshtrain (cmake --build build) and installed "
                           "beside it; libsentencepiece0 must be installed (scripts/setup.sh), or set "
                           "MESHTRAIN_SENTENCEPIECE_PLUGIN to the plugin's path");
    return p;
  }
  std::string missing;
  bind(library, "mt_spm_load", p.load, missing);
  bind(library, "mt_spm_free", p.free, missing);
  bind(library, "mt_spm_info", p.info, missing);
  bind(library, "mt_spm_encode", p.encode, missing);
  bind(library, "mt_spm_decode", p.decode, missing);
  bind(library, "mt_spm_train", p.train, missing);
  p.functions_loaded = missing.empty();
  if (!missing.empty()) p.load_error = str_cat("SentencePiece: ", kPluginName, " lacks ", missing, "; rebuild meshtrain");
  return p;
}

// Loaded once per process: each dlmopen(LM_ID_NEWLM) takes one of glibc's 16 namespaces.
const Plugin& plugin() {
  static const Plugin loaded = load_plugin();
  MESHTRAIN_CHECK(loaded.functions_loaded, loaded.load_error);
  return loaded;
}

void append_bytes(void* context, const char* data, size_t size) { static_cast<std::string*>(context)->append(data, size); }

void append_ids(void* context, const int* ids, size_t size) {
  auto* out = static_cast<std::vector<int32_t>*>(context);
  out->insert(out->end(), ids, ids + size);
}

std::optional<int32_t> present(int id) { return id >= 0 ? std::optional<int32_t>(id) : std::nullopt; }

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path), api_(plugin()) {
    std::string error;
    MESHTRAIN_CHECK(api_.load(path.c_str(), &handle_, append_bytes, &error) == 0, "--tokenizer ", path,
                    ": libsentencepiece cannot load it as a model (", error, "); give a SentencePiece .model file");
    int unk = -1, bos = -1, eos = -1;
    api_.info(handle_, &vocab_, &unk, &bos, &eos);
    bos_ = present(bos);
    eos_ = present(eos);
  }
  ~SentencePieceTokenizer() override { api_.free(handle_); }
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids;
    std::string error;
    MESHTRAIN_CHECK(api_.encode(handle_, text.data(), text.size(), append_ids, &ids, append_bytes, &error) == 0,
                    "SentencePiece ", path_, ": encoding failed: ", error);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text, error;
    MESHTRAIN_CHECK(api_.decode(handle_, ids.data(), ids.size(), append_bytes, &text, append_bytes, &error) == 0,
                    "SentencePiece ", path_, ": decoding failed: ", error);
    return text;
  }
  int64_t vocab_size() const override { return vocab_; }
  std::optional<int32_t> end_of_text_id() const override { return eos_; }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::string describe() const override {
    return str_cat("SentencePiece ", path_, ", ", vocab_, " pieces", eos_ ? str_cat(", eos ", *eos_) : ", no eos",
                   bos_ ? str_cat(", bos ", *bos_) : ", no bos");
  }

 private:
  std::string path_;
  const Plugin& api_;
  void* handle_ = nullptr;
  int vocab_ = 0;
  std::optional<int32_t> bos_, eos_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_path) {
  return std::make_unique<SentencePieceTokenizer>(model_path);
}

std::string train_sentencepiece(const std::vector<std::string>& text_files, int vocab_size,
                                const std::string& out_prefix) {
  MESHTRAIN_CHECK(!text_files.empty(), "train_sentencepiece: no input files");
  MESHTRAIN_CHECK(vocab_size >= 1 && vocab_size <= 65536, "--train-tokenizer ", vocab_size,
                  ": a vocabulary of 1 to 65536 pieces (token shards hold uint16 ids)");
  std::string inputs;
  for (const std::string& f : text_files) {
    MESHTRAIN_CHECK(f.find(',') == std::string::npos, "train_sentencepiece: ", f,
                    ": libsentencepiece's --input separates files by commas; rename the file");
    inputs += (inputs.empty() ? "" : ",") + f;
  }
  // See tokenizer.h for why each setting.
  const std::string flags = str_cat(
      "--input=", inputs, " --model_prefix=", out_prefix, " --vocab_size=", vocab_size,
      " --model_type=bpe --byte_fallback=true --split_digits=true --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1"
      " --character_coverage=0.9995 --normalization_rule_name=identity --remove_extra_whitespaces=false"
      " --allow_whitespace_only_pieces=true --max_sentence_length=65536 --num_threads=1 --minloglevel=1");
  std::string error;
  MESHTRAIN_CHECK(plugin().train(flags.c_str(), append_bytes, &error) == 0, "--train-tokenizer ", vocab_size,
                  ": libsentencepiece's trainer failed (a vocabulary must hold the 256 byte pieces, the 3 specials and "
                  "the characters kept: when it says so, give a larger --train-tokenizer): ", error);
  return out_prefix + ".model";
}

}  // namespace data
}  // namespace meshtrain
