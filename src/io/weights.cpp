// The entry points: which format a path holds, and checks of a wanted shape.
#include "meshtrain/io.h"

#include <sys/stat.h>

#include <vector>

#include "io/hf.h"
#include "io/llmc.h"
#include "io/shapes.h"
#include "meshtrain/util.h"
#include "util/files.h"

namespace meshtrain {
namespace io {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

const char* const kExpected =
    "meshtrain reads an llm.c GPT-2 checkpoint (a .bin file starting with magic 20240326), a Hugging Face model "
    "directory (config.json with model.safetensors, or model.safetensors.index.json and its shards), or a "
    ".safetensors file with its config.json beside it";

// Every shape field where `wanted` and `has` differ, as "--flag X but SOURCE has Y".
std::vector<std::string> differences(const models::ModelConfig& w, const models::ModelConfig& h,
                                     const std::string& source) {
  std::vector<std::string> out;
  if (w.kind != h.kind) return {str_cat("--model ", w.kind, " but ", source, " holds a ", h.kind)};
  auto differ = [&](const char* flag, auto wanted, auto has) {
    if (wanted != has) out.push_back(str_cat(flag, " ", wanted, " but ", source, " has ", has));
  };
  differ("--vocab", w.vocab, h.vocab);
  differ("--max-positions", models::max_positions(w), models::max_positions(h));
  differ("--hidden", w.hidden, h.hidden);
  differ("--heads", w.heads, h.heads);
  differ("--kv-heads", models::kv_heads(w), models::kv_heads(h));
  differ("--ffn-hidden", models::ffn_hidden(w), models::ffn_hidden(h));
  differ("--layers", w.layers, h.layers);
  if (w.tie_embeddings != h.tie_embeddings) {
    out.push_back(w.tie_embeddings ? str_cat("a head tied to the embedding (no --untied) but ", source, " has its own head")
                                   : str_cat("--untied but ", source, " ties the head to the embedding"));
  }
  if (w.kind == "llama") differ("--rope-theta", w.rope_theta, h.rope_theta);
  differ("--norm-eps", w.norm_eps, h.norm_eps);
  return out;
}

}  // namespace

LoadedWeights load_weights(const std::string& path) {
  struct stat st{};
  MESHTRAIN_CHECK(::stat(path.c_str(), &st) == 0, path, ": no such file or directory; ", kExpected);
  if (S_ISDIR(st.st_mode)) {
    MESHTRAIN_CHECK(files::exists(path + "/config.json"), path, " is a directory without config.json; ", kExpected);
    return load_hf(path);
  }
  // A .bin of another kind gets llm.c's reader's message (a token shard, a wrong magic).
  if (is_llmc_checkpoint(path) || ends_with(path, ".bin")) return load_llmc(path);
  if (ends_with(path, ".safetensors")) {
    MESHTRAIN_CHECK(files::exists(files::directory_of(path) + "/config.json"), path,
                    ": a .safetensors file holds no model shape; put its config.json beside it (",
                    files::directory_of(path), "/config.json is missing)");
    return load_hf(path);
  }
  throw ConfigError(str_cat(path, " is not a weight file meshtrain knows; ", kExpected));
}

void save_weights(const std::string& path, const std::string& format, const models::ModelConfig& config,
                  const std::map<std::string, at::Tensor>& ours, at::ScalarType dtype) {
  MESHTRAIN_CHECK(format == "hf" || format == "llmc", "--format '", format,
                  "' is unknown; use hf (a Hugging Face directory) or llmc (an llm.c GPT-2 checkpoint)");
  MESHTRAIN_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "--dtype ", dtype,
                  " is not written; use float32 or bfloat16");
  if (format == "hf") {
    save_hf(path, config, ours, HfConfigOptions().dtype(dtype));
  } else {
    save_llmc(path, config, ours, dtype);
  }
}

void check_matches(const models::ModelConfig& wanted, const LoadedWeights& loaded) {
  const std::vector<std::string> diffs = differences(wanted, loaded.config, loaded.source);
  std::string all;
  for (const std::string& d : diffs) all += (all.empty() ? "" : "; ") + d;
  MESHTRAIN_CHECK(diffs.empty(), "--init-from: ", all,
                  ". The model's shape comes from the weights: drop ", diffs.size() == 1 ? "this flag" : "these flags",
                  " or give weights of that shape");
}

}  // namespace io
}  // namespace meshtrain
