// config.json <-> models::ModelConfig for GPT2LMHeadModel and LlamaForCausalLM.
#include <nlohmann/json.hpp>

#include "io/hf.h"
#include "io/shapes.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace io {

namespace {

using Type = json::Value::Type;

// config.json's fields, each error naming the file and the key.
class ConfigReader {
 public:
  ConfigReader(const json::Value& j, const std::string& path) : j_(j), path_(path) {}

  bool present(const std::string& key) const { return j_.has(key) && j_[key].type != Type::kNull; }
  // A required integer > 0.
  int64_t positive(const std::string& key) const {
    MESHTRAIN_CHECK(present(key), path_, ": config.json has no '", key, "' (the model's shape needs it)");
    return positive_or(key, 0);
  }
  int64_t positive_or(const std::string& key, int64_t fallback) const {
    if (!present(key)) return fallback;
    const json::Value& v = j_[key];
    MESHTRAIN_CHECK(v.type == Type::kNumber && v.is_integer && v.integer > 0, path_, ": '", key,
                    "' must be an integer > 0");
    return v.integer;
  }
  double number_or(const std::string& key, double fallback) const {
    if (!present(key)) return fallback;
    MESHTRAIN_CHECK(j_[key].type == Type::kNumber && j_[key].number > 0, path_, ": '", key, "' must be a number > 0");
    return j_[key].number;
  }
  bool flag_or(const std::string& key, bool fallback) const {
    if (!present(key)) return fallback;
    MESHTRAIN_CHECK(j_[key].type == Type::kBool, path_, ": '", key, "' must be true or false");
    return j_[key].boolean;
  }
  std::string text_or(const std::string& key, const std::string& fallback) const {
    if (!present(key)) return fallback;
    MESHTRAIN_CHECK(j_[key].type == Type::kString, path_, ": '", key, "' must be a string");
    return j_[key].string;
  }
  // Refuses a setting whose value meshtrain's model does not compute.
  void require(bool ok, const std::string& key, const std::string& found, const std::string& supported) const {
    MESHTRAIN_CHECK(ok, path_, ": ", key, " ", found, " is not supported; meshtrain's model computes ", supported);
  }

 private:
  const json::Value& j_;
  const std::string& path_;
};

models::ModelConfig gpt2_config(const ConfigReader& r) {
  models::ModelConfig c;
  c.kind = "gpt2";
  c.hidden = r.positive("n_embd");
  c.layers = r.positive("n_layer");
  c.heads = r.positive("n_head");
  c.max_positions = c.seq_len = r.positive("n_positions");
  c.vocab = r.positive("vocab_size");
  c.norm_eps = r.number_or("layer_norm_epsilon", 1e-5);
  c.tie_embeddings = r.flag_or("tie_word_embeddings", true);
  const int64_t inner = r.positive_or("n_inner", 4 * c.hidden);
  c.ffn_hidden = inner == 4 * c.hidden ? 0 : inner;
  const std::string act = r.text_or("activation_function", "gelu_new");
  r.require(act == "gelu_new", "activation_function", "'" + act + "'", "gelu_new (GPT-2's tanh GELU)");
  r.require(r.flag_or("scale_attn_weights", true), "scale_attn_weights", "false", "scores scaled by 1/sqrt(head_dim)");
  r.require(!r.flag_or("scale_attn_by_inverse_layer_idx", false), "scale_attn_by_inverse_layer_idx", "true",
            "no per-layer score scaling");
  return c;
}

models::ModelConfig llama_config(const ConfigReader& r) {
  models::ModelConfig c;
  c.kind = "llama";
  c.hidden = r.positive("hidden_size");
  c.ffn_hidden = r.positive("intermediate_size");
  c.heads = r.positive("num_attention_heads");
  c.kv_heads = r.positive_or("num_key_value_heads", c.heads);
  c.layers = r.positive("num_hidden_layers");
  c.vocab = r.positive("vocab_size");
  c.max_positions = c.seq_len = r.positive("max_position_embeddings");
  c.norm_eps = r.number_or("rms_norm_eps", 1e-6);
  c.rope_theta = r.number_or("rope_theta", 10000.0);
  c.tie_embeddings = r.flag_or("tie_word_embeddings", false);
  const std::string act = r.text_or("hidden_act", "silu");
  r.require(act == "silu", "hidden_act", "'" + act + "'", "silu (SwiGLU)");
  r.require(!r.present("rope_scaling"), "rope_scaling", "(not null)", "plain RoPE (rope_scaling null)");
  r.require(!r.flag_or("attention_bias", false), "attention_bias", "true", "attention without biases");
  r.require(!r.flag_or("mlp_bias", false), "mlp_bias", "true", "an MLP without biases");
  const int64_t head_dim = r.positive_or("head_dim", 0);
  r.require(head_dim == 0 || head_dim * c.heads == c.hidden, "head_dim", std::to_string(head_dim),
            "head_dim = hidden_size / num_attention_heads = " + std::to_string(c.hidden / c.heads));
  return c;
}

std::string torch_dtype_name(at::ScalarType dtype) {
  if (dtype == at::kFloat) return "float32";
  if (dtype == at::kBFloat16) return "bfloat16";
  MESHTRAIN_CHECK(dtype == at::kHalf, "Hugging Face export: dtype ", dtype, " is not written; use float32 or bfloat16");
  return "float16";
}

nlohmann::json gpt2_json(const models::ModelConfig& c) {
  const int64_t ffn = models::ffn_hidden(c);
  return {{"architectures", nlohmann::json::array({"GPT2LMHeadModel"})},
          {"model_type", "gpt2"},
          {"activation_function", "gelu_new"},
          {"attn_pdrop", 0.0}, {"embd_pdrop", 0.0}, {"resid_pdrop", 0.0},  // meshtrain's gpt2 has no dropout
          {"initializer_range", 0.02},
          {"layer_norm_epsilon", c.norm_eps},
          {"n_ctx", models::max_positions(c)}, {"n_positions", models::max_positions(c)},
          {"n_embd", c.hidden}, {"n_head", c.heads}, {"n_layer", c.layers},
          {"n_inner", ffn == 4 * c.hidden ? nlohmann::json(nullptr) : nlohmann::json(ffn)},
          {"reorder_and_upcast_attn", false},
          {"scale_attn_by_inverse_layer_idx", false}, {"scale_attn_weights", true},
          {"tie_word_embeddings", c.tie_embeddings},
          {"use_cache", true},
          {"vocab_size", c.vocab}};
}

nlohmann::json llama_json(const models::ModelConfig& c) {
  return {{"architectures", nlohmann::json::array({"LlamaForCausalLM"})},
          {"model_type", "llama"},
          {"attention_bias", false}, {"attention_dropout", 0.0}, {"mlp_bias", false},
          {"head_dim", c.hidden / c.heads},
          {"hidden_act", "silu"},
          {"hidden_size", c.hidden},
          {"initializer_range", 0.02},
          {"intermediate_size", models::ffn_hidden(c)},
          {"max_position_embeddings", models::max_positions(c)},
          {"num_attention_heads", c.heads},
          {"num_hidden_layers", c.layers},
          {"num_key_value_heads", models::kv_heads(c)},
          {"pretraining_tp", 1},
          {"rms_norm_eps", c.norm_eps},
          {"rope_scaling", nullptr},
          {"rope_theta", c.rope_theta},
          {"tie_word_embeddings", c.tie_embeddings},
          {"use_cache", true},
          {"vocab_size", c.vocab}};
}

}  // namespace

models::ModelConfig config_from_hf(const json::Value& j, const std::string& path) {
  MESHTRAIN_CHECK(j.type == Type::kObject, path, ": config.json is not a JSON object");
  const ConfigReader r(j, path);
  const std::string type = r.text_or("model_type", "");
  MESHTRAIN_CHECK(type == "gpt2" || type == "llama", path, ": model_type '", type,
                  "' is not supported; meshtrain reads gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM)");
  const models::ModelConfig c = type == "gpt2" ? gpt2_config(r) : llama_config(r);
  try {
    parameter_shapes(c);  // sizes that divide
  } catch (const ConfigError& e) {
    throw ConfigError(str_cat(path, ": ", e.what()));
  }
  return c;
}

models::ModelConfig read_hf_config(const std::string& path) { return config_from_hf(json::parse_file(path), path); }

std::string hf_config_json(const models::ModelConfig& c, const HfConfigOptions& options) {
  parameter_shapes(c);  // gpt2 or llama, sizes that divide
  nlohmann::json j = c.kind == "gpt2" ? gpt2_json(c) : llama_json(c);
  j["torch_dtype"] = torch_dtype_name(options.dtype());
  if (options.bos_token_id()) j["bos_token_id"] = *options.bos_token_id();
  if (options.eos_token_id()) j["eos_token_id"] = *options.eos_token_id();
  return j.dump(2) + "\n";  // nlohmann's objects keep keys sorted, as transformers writes them
}

}  // namespace io
}  // namespace meshtrain
