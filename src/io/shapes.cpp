#include "io/shapes.h"

#include "meshtrain/util.h"

namespace meshtrain {
namespace io {

namespace {

void check_sizes(const models::ModelConfig& c) {
  MESHTRAIN_CHECK(c.vocab >= 1 && c.seq_len >= 1 && c.layers >= 1, c.kind, ": vocab ", c.vocab, ", seq_len ",
                  c.seq_len, " and layers ", c.layers, " must be positive");
  MESHTRAIN_CHECK(c.hidden >= 1 && c.heads >= 1 && c.hidden % c.heads == 0, c.kind, ": hidden ", c.hidden,
                  " must be a positive multiple of heads ", c.heads);
  const int64_t kv = models::kv_heads(c);
  MESHTRAIN_CHECK(kv >= 1 && c.heads % kv == 0, c.kind, ": kv_heads ", kv, " must divide heads ", c.heads);
  MESHTRAIN_CHECK(models::ffn_hidden(c) >= 1, c.kind, ": ffn_hidden ", models::ffn_hidden(c), " must be positive");
}

Shapes gpt2_shapes(const models::ModelConfig& c) {
  const int64_t C = c.hidden, F = models::ffn_hidden(c), Vp = models::padded_vocab(c);
  Shapes s{{"embed.tok.weight", {Vp, C}}, {"embed.pos", {models::max_positions(c), C}}};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    for (const char* vec : {"ln1.weight", "ln1.bias", "q.bias", "k.bias", "v.bias", "proj.bias", "ln2.weight",
                            "ln2.bias", "fc2.bias"})
      s[b + vec] = {C};
    for (const char* mat : {"q.weight", "k.weight", "v.weight", "proj.weight"}) s[b + mat] = {C, C};
    s[b + "fc1.weight"] = {F, C};
    s[b + "fc1.bias"] = {F};
    s[b + "fc2.weight"] = {C, F};
  }
  s["head.ln.weight"] = {C};
  s["head.ln.bias"] = {C};
  if (!c.tie_embeddings) s["head.out.weight"] = {Vp, C};
  return s;
}

Shapes llama_shapes(const models::ModelConfig& c) {
  const int64_t C = c.hidden, F = models::ffn_hidden(c), d = c.hidden / c.heads;
  const int64_t q_rows = c.heads * d, kv_rows = models::kv_heads(c) * d;
  Shapes s{{"embed.tok.weight", {c.vocab, C}}};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    s[b + "attn_norm.weight"] = {C};
    s[b + "q.weight"] = {q_rows, C};
    s[b + "k.weight"] = {kv_rows, C};
    s[b + "v.weight"] = {kv_rows, C};
    s[b + "o.weight"] = {C, q_rows};
    s[b + "mlp_norm.weight"] = {C};
    s[b + "gate.weight"] = {F, C};
    s[b + "up.weight"] = {F, C};
    s[b + "down.weight"] = {C, F};
  }
  s["head.norm.weight"] = {C};
  if (!c.tie_embeddings) s["head.out.weight"] = {c.vocab, C};
  return s;
}

}  // namespace

std::string shape_text(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

Shapes parameter_shapes(const models::ModelConfig& c) {
  MESHTRAIN_CHECK(c.kind == "gpt2" || c.kind == "llama", "model '", c.kind,
                  "' has no published weight format; meshtrain::io reads and writes gpt2 and llama "
                  "(the built-in gpt and mlp save with the trainer's checkpoints)");
  check_sizes(c);
  return c.kind == "gpt2" ? gpt2_shapes(c) : llama_shapes(c);
}

void check_parameters(const models::ModelConfig& c, const std::map<std::string, at::Tensor>& ours,
                      const std::string& what) {
  const Shapes shapes = parameter_shapes(c);
  for (const auto& expected : shapes) {
    const auto it = ours.find(expected.first);
    MESHTRAIN_CHECK(it != ours.end() && it->second.defined(), what, ": parameter '", expected.first,
                    "' is missing (a ", c.kind, " with ", c.layers, " layers", c.tie_embeddings ? ", tied head" : ", untied head",
                    " has it)");
    MESHTRAIN_CHECK(it->second.sizes() == at::IntArrayRef(expected.second), what, ": parameter '", expected.first,
                    "' has shape ", shape_text(it->second.sizes()), " but the model needs ",
                    shape_text(expected.second));
  }
  for (const auto& named : ours) {
    MESHTRAIN_CHECK(shapes.count(named.first), what, ": parameter '", named.first, "' is not part of a ", c.kind,
                    " with ", c.layers, " layers", c.tie_embeddings ? " and a tied head" : "");
  }
}

}  // namespace io
}  // namespace meshtrain
