#pragma once
// meshtrain/io.h: Hugging Face safetensors and llm.c weights, in and out.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "meshtrain/models.h"

// ===== weights =====
// One door for published weights, in and out: the trainer's --init-from and
// `meshtrain export` call these. Formats: llm.c GPT-2 checkpoints (io/llmc.h)
// and Hugging Face model directories (io/hf.h); names and shapes on our side
// are io/shapes.h's.

namespace meshtrain {
namespace io {

// A model read from a published format: its shape and its parameters under
// our names (io/shapes.h), whole and float32 (tensors may alias the file's
// mapping: Note [Tensors over a mapped file]; copy them into the model).
struct LoadedWeights {
  models::ModelConfig config;
  std::map<std::string, at::Tensor> tensors;
  std::string source;  // "llm.c checkpoint FILE", "Hugging Face directory DIR", "Hugging Face file FILE"
};

// Reads `path`: a file starting with llm.c's checkpoint magic (20240326); a
// directory holding config.json and model.safetensors or
// model.safetensors.index.json with its shards; or a .safetensors file with a
// config.json beside it. Anything else is refused, naming what was expected.
LoadedWeights load_weights(const std::string& path);

// Writes a model in `format`: "hf" (a directory `path`: config.json and
// model.safetensors, `dtype` float32 or bfloat16) or "llmc" (a file `path`,
// gpt2 with a tied head only; float32 writes version 3, bfloat16 version 5).
// Checks `ours` against `config` (io/shapes.h) before writing anything; each
// file is written atomically.
void save_weights(const std::string& path, const std::string& format, const models::ModelConfig& config,
                  const std::map<std::string, at::Tensor>& ours, at::ScalarType dtype = at::kFloat);

// Refuses a `wanted` shape that differs from the weights', naming every
// differing field as its flag ("--hidden 128 but llm.c checkpoint gpt2.bin
// has 768"). Compared: kind, vocab, seq_len, hidden, heads, kv_heads,
// ffn_hidden (defaults applied), layers, tie_embeddings, rope_theta (llama),
// norm_eps. Meant for `wanted` = loaded.config with the flags the user gave
// applied on top, so only a flag that contradicts the weights is refused.
void check_matches(const models::ModelConfig& wanted, const LoadedWeights& loaded);

}  // namespace io
}  // namespace meshtrain
