// Hugging Face tensor names and layouts <-> ours (io/shapes.h), both ways.
#include <ATen/ATen.h>

#include <set>
#include <utility>
#include <vector>

#include "io/hf.h"
#include "io/safetensors.h"
#include "io/shapes.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace io {

namespace {

// Hands out a checkpoint's tensors by name as float32, each checked against
// the shape the config gives; finish() refuses what nobody took.
class HfTensorTaker {
 public:
  HfTensorTaker(const std::map<std::string, at::Tensor>& hf, const std::string& source,
                const std::map<std::string, std::string>& file_of)
      : hf_(hf), source_(source), file_of_(file_of) {}

  bool has(const std::string& name) const { return hf_.count(name) > 0; }

  at::Tensor take(const std::string& name, const std::vector<int64_t>& shape) {
    const auto it = hf_.find(name);
    MESHTRAIN_CHECK(it != hf_.end(), source_, ": tensor '", name, "' is missing (config.json's model has it)");
    MESHTRAIN_CHECK(it->second.sizes() == at::IntArrayRef(shape), where(name), " has shape ",
                    shape_text(it->second.sizes()), " but config.json's model needs ", shape_text(shape));
    taken_.insert(name);
    return to_float32(it->second, where(name));
  }

  // Buffers a checkpoint may carry that are not parameters.
  void ignore(const std::string& name) { taken_.insert(name); }

  // "FILE: tensor 'NAME'", the file it came from (else the source) for messages.
  std::string where(const std::string& name) const {
    const auto file = file_of_.find(name);
    return str_cat(file == file_of_.end() ? source_ : file->second, ": tensor '", name, "'");
  }

  void finish(const models::ModelConfig& c) const {
    for (const auto& named : hf_) {
      MESHTRAIN_CHECK(taken_.count(named.first), where(named.first), " is unexpected: a ", c.kind, " with ", c.layers,
                      " layers", c.tie_embeddings ? " and a tied head" : "",
                      " has no such tensor (does config.json match the weights?)");
    }
  }

 private:
  const std::map<std::string, at::Tensor>& hf_;
  const std::string& source_;
  const std::map<std::string, std::string>& file_of_;
  std::set<std::string> taken_;
};

// `t` with `rows` rows: zero rows appended (gpt2's padded vocabulary).
at::Tensor pad_rows(const at::Tensor& t, int64_t rows) {
  if (t.size(0) == rows) return t;
  return at::cat({t, at::zeros({rows - t.size(0), t.size(1)}, t.options())});
}

// A tied model's lm_head.weight, when the file has one, must be the embedding.
void check_tied_head(HfTensorTaker& hf, const std::string& embedding_name, const at::Tensor& embedding) {
  if (!hf.has("lm_head.weight")) return;
  const at::Tensor head = hf.take("lm_head.weight", embedding.sizes().vec());
  MESHTRAIN_CHECK(at::equal(head, embedding), hf.where("lm_head.weight"), " differs from '", embedding_name,
                  "' but config.json ties them (tie_word_embeddings true); set tie_word_embeddings to false "
                  "to load the head as its own weight");
}

void gpt2_block_from_hf(HfTensorTaker& hf, const models::ModelConfig& c, const std::string& h, const std::string& b,
                        std::map<std::string, at::Tensor>& ours) {
  const int64_t C = c.hidden, F = models::ffn_hidden(c);
  ours[b + "ln1.weight"] = hf.take(h + "ln_1.weight", {C});
  ours[b + "ln1.bias"] = hf.take(h + "ln_1.bias", {C});
  const at::Tensor qkv_w = hf.take(h + "attn.c_attn.weight", {C, 3 * C});  // Conv1D: [in, out]
  const at::Tensor qkv_b = hf.take(h + "attn.c_attn.bias", {3 * C});
  const char* parts[] = {"q", "k", "v"};
  for (int64_t j = 0; j < 3; ++j) {
    ours[b + parts[j] + ".weight"] = qkv_w.narrow(1, j * C, C).t().contiguous();
    ours[b + parts[j] + ".bias"] = qkv_b.narrow(0, j * C, C);
  }
  ours[b + "proj.weight"] = hf.take(h + "attn.c_proj.weight", {C, C}).t().contiguous();
  ours[b + "proj.bias"] = hf.take(h + "attn.c_proj.bias", {C});
  ours[b + "ln2.weight"] = hf.take(h + "ln_2.weight", {C});
  ours[b + "ln2.bias"] = hf.take(h + "ln_2.bias", {C});
  ours[b + "fc1.weight"] = hf.take(h + "mlp.c_fc.weight", {C, F}).t().contiguous();
  ours[b + "fc1.bias"] = hf.take(h + "mlp.c_fc.bias", {F});
  ours[b + "fc2.weight"] = hf.take(h + "mlp.c_proj.weight", {F, C}).t().contiguous();
  ours[b + "fc2.bias"] = hf.take(h + "mlp.c_proj.bias", {C});
  hf.ignore(h + "attn.bias");  // the causal mask and its fill value, saved as buffers by older transformers
  hf.ignore(h + "attn.masked_bias");
}

std::map<std::string, at::Tensor> gpt2_from_hf(HfTensorTaker& hf, const models::ModelConfig& c) {
  // GPT2LMHeadModel saves "transformer.wte.weight", GPT2Model "wte.weight".
  const std::string p = hf.has("wte.weight") ? "" : "transformer.";
  const int64_t C = c.hidden, Vp = models::padded_vocab(c);
  std::map<std::string, at::Tensor> ours;
  const at::Tensor wte = hf.take(p + "wte.weight", {c.vocab, C});
  ours["embed.tok.weight"] = pad_rows(wte, Vp);
  ours["embed.pos"] = hf.take(p + "wpe.weight", {models::max_positions(c), C});
  for (int64_t i = 0; i < c.layers; ++i) {
    gpt2_block_from_hf(hf, c, p + "h." + std::to_string(i) + ".", "blocks." + std::to_string(i) + ".", ours);
  }
  ours["head.ln.weight"] = hf.take(p + "ln_f.weight", {C});
  ours["head.ln.bias"] = hf.take(p + "ln_f.bias", {C});
  if (c.tie_embeddings) check_tied_head(hf, p + "wte.weight", wte);
  else ours["head.out.weight"] = pad_rows(hf.take("lm_head.weight", {c.vocab, C}), Vp);
  return ours;
}

void gpt2_block_to_hf(const std::map<std::string, at::Tensor>& ours, const std::string& b, const std::string& h,
                      std::map<std::string, at::Tensor>& hf) {
  auto get = [&](const std::string& name) { return ours.at(b + name); };
  hf[h + "ln_1.weight"] = get("ln1.weight");
  hf[h + "ln_1.bias"] = get("ln1.bias");
  hf[h + "attn.c_attn.weight"] = at::cat({get("q.weight"), get("k.weight"), get("v.weight")}).t().contiguous();
  hf[h + "attn.c_attn.bias"] = at::cat({get("q.bias"), get("k.bias"), get("v.bias")});
  hf[h + "attn.c_proj.weight"] = get("proj.weight").t().contiguous();
  hf[h + "attn.c_proj.bias"] = get("proj.bias");
  hf[h + "ln_2.weight"] = get("ln2.weight");
  hf[h + "ln_2.bias"] = get("ln2.bias");
  hf[h + "mlp.c_fc.weight"] = get("fc1.weight").t().contiguous();
  hf[h + "mlp.c_fc.bias"] = get("fc1.bias");
  hf[h + "mlp.c_proj.weight"] = get("fc2.weight").t().contiguous();
  hf[h + "mlp.c_proj.bias"] = get("fc2.bias");
}

std::map<std::string, at::Tensor> gpt2_to_hf(const models::ModelConfig& c, const std::map<std::string, at::Tensor>& ours) {
  std::map<std::string, at::Tensor> hf;
  hf["transformer.wte.weight"] = ours.at("embed.tok.weight").narrow(0, 0, c.vocab);  // the padded rows stay behind
  hf["transformer.wpe.weight"] = ours.at("embed.pos");
  for (int64_t i = 0; i < c.layers; ++i) {
    gpt2_block_to_hf(ours, "blocks." + std::to_string(i) + ".", "transformer.h." + std::to_string(i) + ".", hf);
  }
  hf["transformer.ln_f.weight"] = ours.at("head.ln.weight");
  hf["transformer.ln_f.bias"] = ours.at("head.ln.bias");
  if (!c.tie_embeddings) hf["lm_head.weight"] = ours.at("head.out.weight").narrow(0, 0, c.vocab);
  return hf;
}

// Llama's names map one to one: (Hugging Face name, ours), the head's apart.
std::vector<std::pair<std::string, std::string>> llama_names(const models::ModelConfig& c) {
  std::vector<std::pair<std::string, std::string>> names = {{"model.embed_tokens.weight", "embed.tok.weight"},
                                                            {"model.norm.weight", "head.norm.weight"}};
  const std::pair<const char*, const char*> per_layer[] = {
      {"input_layernorm.weight", "attn_norm.weight"},   {"self_attn.q_proj.weight", "q.weight"},
      {"self_attn.k_proj.weight", "k.weight"},          {"self_attn.v_proj.weight", "v.weight"},
      {"self_attn.o_proj.weight", "o.weight"},          {"post_attention_layernorm.weight", "mlp_norm.weight"},
      {"mlp.gate_proj.weight", "gate.weight"},          {"mlp.up_proj.weight", "up.weight"},
      {"mlp.down_proj.weight", "down.weight"}};
  for (int64_t i = 0; i < c.layers; ++i) {
    for (const auto& n : per_layer) {
      names.emplace_back("model.layers." + std::to_string(i) + "." + n.first, "blocks." + std::to_string(i) + "." + n.second);
    }
  }
  if (!c.tie_embeddings) names.emplace_back("lm_head.weight", "head.out.weight");
  return names;
}

std::map<std::string, at::Tensor> llama_from_hf(HfTensorTaker& hf, const models::ModelConfig& c) {
  const Shapes shapes = parameter_shapes(c);
  std::map<std::string, at::Tensor> ours;
  for (const auto& n : llama_names(c)) ours[n.second] = hf.take(n.first, shapes.at(n.second));
  for (int64_t i = 0; i < c.layers; ++i) hf.ignore("model.layers." + std::to_string(i) + ".self_attn.rotary_emb.inv_freq");
  if (c.tie_embeddings) check_tied_head(hf, "model.embed_tokens.weight", ours.at("embed.tok.weight"));
  return ours;
}

}  // namespace

std::map<std::string, at::Tensor> from_hf(const models::ModelConfig& c, const std::map<std::string, at::Tensor>& hf,
                                          const std::string& source, const std::map<std::string, std::string>& file_of) {
  parameter_shapes(c);  // a kind we map
  HfTensorTaker taker(hf, source, file_of);
  std::map<std::string, at::Tensor> ours = c.kind == "gpt2" ? gpt2_from_hf(taker, c) : llama_from_hf(taker, c);
  taker.finish(c);
  return ours;
}

std::map<std::string, at::Tensor> to_hf(const models::ModelConfig& c, const std::map<std::string, at::Tensor>& ours) {
  check_parameters(c, ours, "Hugging Face export");
  if (c.kind == "gpt2") return gpt2_to_hf(c, ours);
  std::map<std::string, at::Tensor> hf;
  for (const auto& n : llama_names(c)) hf[n.first] = ours.at(n.second);
  return hf;
}

}  // namespace io
}  // namespace meshtrain
