#pragma once
// Hugging Face model directories: config.json and model.safetensors (or
// model.safetensors.index.json and its shards), for GPT2LMHeadModel
// (model_type gpt2) and LlamaForCausalLM (model_type llama), and the mapping
// between their tensor names and ours (io/shapes.h). docs/weights.md has the
// table.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <map>
#include <string>

#include "meshtrain/io.h"
#include "meshtrain/models.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace io {

// What config.json says beyond the model's shape.
struct HfConfigOptions {
  // The tensors' dtype: torch_dtype in config.json, and what save_hf writes
  // (float32, bfloat16 or float16).
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
  // Special tokens, written only when given (the tokenizer knows them, not the model).
  TORCH_ARG(c10::optional<int64_t>, bos_token_id) = c10::nullopt;
  TORCH_ARG(c10::optional<int64_t>, eos_token_id) = c10::nullopt;
};

// The model's shape from a parsed config.json; `path` names it in errors.
// gpt2: n_embd, n_layer, n_head, n_positions, vocab_size, layer_norm_epsilon
// (default 1e-5), n_inner (null: 4 x n_embd), tie_word_embeddings (default
// true); activation_function must be gelu_new. llama: hidden_size,
// intermediate_size, num_attention_heads, num_key_value_heads (default: the
// heads), num_hidden_layers, vocab_size, max_position_embeddings (seq_len),
// rms_norm_eps (default 1e-6), rope_theta (default 10000), tie_word_embeddings
// (default false); hidden_act must be silu, rope_scaling null, attention_bias
// and mlp_bias false, head_dim (if given) hidden_size / heads. Any other
// model_type, or a setting meshtrain's models do not compute, is refused
// naming the key and what is supported.
models::ModelConfig config_from_hf(const json::Value& config, const std::string& path);
// config_from_hf of the file `path`.
models::ModelConfig read_hf_config(const std::string& path);
// config.json's text for `config` (gpt2 or llama) as transformers writes it:
// keys sorted, indented by 2, architectures, model_type, torch_dtype.
std::string hf_config_json(const models::ModelConfig& config, const HfConfigOptions& options = {});

// Hugging Face tensors -> ours, float32 (BF16/F16 converted; F32 ones may
// alias the file). gpt2: Conv1D weights ([in, out]) transposed, c_attn split
// into q, k, v; wte (and an untied lm_head) zero-padded to padded_vocab rows;
// names with or without "transformer."; the buffers attn.bias and
// attn.masked_bias ignored; a tied model's lm_head.weight accepted when equal
// to the embedding. llama: renamed only (rotary_emb.inv_freq buffers ignored).
// Refuses, naming the tensor and its file (file_of[name], else `source`), a
// missing tensor, an unexpected one, or a shape config does not give.
std::map<std::string, at::Tensor> from_hf(const models::ModelConfig& config, const std::map<std::string, at::Tensor>& hf,
                                          const std::string& source,
                                          const std::map<std::string, std::string>& file_of = {});
// Ours -> Hugging Face names (gpt2 with "transformer.", as GPT2LMHeadModel
// saves; embedding rows trimmed to vocab; lm_head only when untied), in the
// dtype `ours` has. Checks `ours` against config first.
std::map<std::string, at::Tensor> to_hf(const models::ModelConfig& config, const std::map<std::string, at::Tensor>& ours);

// A directory's tensors under Hugging Face's names, and the file each came from.
struct HfTensors {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> file_of;
};
// model.safetensors, else model.safetensors.index.json with every shard it
// names (each mapped once). Refuses, naming them, a missing shard, a tensor
// missing from the shard the index gives, or a shard tensor the index does
// not place there.
HfTensors read_hf_tensors(const std::string& dir);

// A Hugging Face directory (config.json + weights), or one .safetensors file
// with a config.json beside it, as our names and config.
LoadedWeights load_hf(const std::string& path);
// Writes directory `dir` (created if needed): config.json and model.safetensors
// in options.dtype, each atomically.
void save_hf(const std::string& dir, const models::ModelConfig& config, const std::map<std::string, at::Tensor>& ours,
             const HfConfigOptions& options = {});

}  // namespace io
}  // namespace meshtrain
