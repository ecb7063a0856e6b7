#pragma once
// meshtrain's own parameter names and shapes for the published models (the
// whole, unsharded model): what io's readers return and its writers take.
//
// GPT-2 (kind "gpt2"), C = hidden, F = ffn_hidden, Vp = padded_vocab:
//   embed.tok.weight [Vp, C], embed.pos [seq_len, C];
//   blocks.{i}.ln1.weight/.bias [C], blocks.{i}.{q,k,v,proj}.weight [C, C] /.bias [C],
//   blocks.{i}.ln2.weight/.bias [C], blocks.{i}.fc1.weight [F, C] /.bias [F],
//   blocks.{i}.fc2.weight [C, F] /.bias [C]; head.ln.weight/.bias [C];
//   head.out.weight [Vp, C] when untied.
// Llama (kind "llama"), d = C / heads, KV = kv_heads:
//   embed.tok.weight [V, C]; blocks.{i}.attn_norm.weight [C];
//   blocks.{i}.q.weight [heads*d, C], .k/.v.weight [KV*d, C], .o.weight [C, heads*d];
//   blocks.{i}.mlp_norm.weight [C]; .gate/.up.weight [F, C], .down.weight [C, F];
//   head.norm.weight [C]; head.out.weight [V, C] when untied.
//   q and k rows in Hugging Face's order (rotate-half RoPE).

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "meshtrain/models.h"

namespace meshtrain {
namespace io {

using Shapes = std::map<std::string, std::vector<int64_t>>;

// Every parameter of the whole model with its shape. ConfigError for a kind
// other than gpt2 and llama (the built-in gpt and mlp save through
// train::checkpoint), or sizes that do not divide (hidden by heads, heads by
// kv_heads).
Shapes parameter_shapes(const models::ModelConfig& config);

// Refuses, naming `what` (the file or model) and the tensor, a parameter
// missing from `ours`, one `config` does not have, or a shape that differs.
void check_parameters(const models::ModelConfig& config, const std::map<std::string, at::Tensor>& ours,
                      const std::string& what);

// "[768, 2304]": a shape as the messages print it.
std::string shape_text(at::IntArrayRef shape);

}  // namespace io
}  // namespace meshtrain
