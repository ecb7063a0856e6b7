// llm.c GPT-2 checkpoints: one table of llm.c's tensors and the parameters of
// ours they hold, walked in file order both to read and to write.
#include "io/llmc.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <cstring>
#include <vector>

#include "io/file_io.h"
#include "io/safetensors.h"
#include "io/shapes.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace io {

namespace {

constexpr int64_t kHeaderBytes = kLlmcHeaderInts * 4;
constexpr int32_t kTokenShardMagic = 20240520;  // llm.c's data shards: a common mix-up

// An llm.c tensor and our parameters it holds, back to back (per layer when
// per_layer: layer 0's parts, then layer 1's, ...).
struct LlmcTensor {
  const char* name;
  bool per_layer;
  std::vector<const char*> parts;
};

const std::vector<LlmcTensor>& llmc_tensors() {
  static const std::vector<LlmcTensor> table = {
      {"wte", false, {"embed.tok.weight"}},       {"wpe", false, {"embed.pos"}},
      {"ln1w", true, {"ln1.weight"}},             {"ln1b", true, {"ln1.bias"}},
      {"qkvw", true, {"q.weight", "k.weight", "v.weight"}},
      {"qkvb", true, {"q.bias", "k.bias", "v.bias"}},
      {"attprojw", true, {"proj.weight"}},        {"attprojb", true, {"proj.bias"}},
      {"ln2w", true, {"ln2.weight"}},             {"ln2b", true, {"ln2.bias"}},
      {"fcw", true, {"fc1.weight"}},              {"fcb", true, {"fc1.bias"}},
      {"fcprojw", true, {"fc2.weight"}},          {"fcprojb", true, {"fc2.bias"}},
      {"lnfw", false, {"head.ln.weight"}},        {"lnfb", false, {"head.ln.bias"}}};
  return table;
}

// Our parameter names in the order llm.c's file holds them.
std::vector<std::string> file_order(int64_t layers) {
  std::vector<std::string> order;
  for (const LlmcTensor& t : llmc_tensors()) {
    for (int64_t l = 0; l < (t.per_layer ? layers : 1); ++l) {
      const std::string prefix = t.per_layer ? "blocks." + std::to_string(l) + "." : "";
      for (const char* part : t.parts) order.push_back(prefix + part);
    }
  }
  return order;
}

struct Header {
  int32_t version, maxT, V, L, NH, C, Vp;
};

Header read_header(const detail::MappedFile& f) {
  MESHTRAIN_CHECK(f.size() >= kHeaderBytes, "llm.c checkpoint ", f.path(), ": ", f.size(),
                  " bytes, shorter than the ", kHeaderBytes, "-byte header (truncated, or not a checkpoint)");
  int32_t h[8];
  std::memcpy(h, f.data(), sizeof h);
  MESHTRAIN_CHECK(h[0] != kTokenShardMagic, "llm.c checkpoint ", f.path(),
                  ": this is an llm.c token shard (magic ", kTokenShardMagic, "), not a model; give it as --data");
  MESHTRAIN_CHECK(h[0] == kLlmcMagic, "llm.c checkpoint ", f.path(), ": magic number ", h[0], ", expected ",
                  kLlmcMagic, " (not an llm.c GPT-2 checkpoint)");
  MESHTRAIN_CHECK(h[1] == kLlmcVersionFloat32 || h[1] == kLlmcVersionBFloat16, "llm.c checkpoint ", f.path(),
                  ": version ", h[1], "; meshtrain reads ", kLlmcVersionFloat32, " (float32) and ",
                  kLlmcVersionBFloat16, " (bfloat16)");
  const Header hd{h[1], h[2], h[3], h[4], h[5], h[6], h[7]};
  MESHTRAIN_CHECK(hd.maxT > 0 && hd.V > 0 && hd.L > 0 && hd.NH > 0 && hd.C > 0 && hd.C % hd.NH == 0 && hd.Vp >= hd.V,
                  "llm.c checkpoint ", f.path(), ": the header's sizes maxT ", hd.maxT, ", V ", hd.V, ", L ", hd.L,
                  ", NH ", hd.NH, ", C ", hd.C, ", Vp ", hd.Vp,
                  " are not a model (all positive, NH divides C, Vp >= V): the header is damaged");
  return hd;
}

models::ModelConfig config_of(const Header& h) {
  models::ModelConfig c;
  c.kind = "gpt2";
  c.vocab = h.V;
  c.max_positions = c.seq_len = h.maxT;
  c.hidden = h.C;
  c.heads = h.NH;
  c.layers = h.L;
  c.tie_embeddings = true;
  c.norm_eps = 1e-5;  // llm.c's layernorm_forward
  return c;
}

// The embedding with padded_vocab rows: a file's other Vp cut (rows >= V only) or zero-padded.
at::Tensor to_padded_rows(const at::Tensor& wte, int64_t rows) {
  if (wte.size(0) >= rows) return wte.narrow(0, 0, rows);
  return at::cat({wte, at::zeros({rows - wte.size(0), wte.size(1)}, wte.options())});
}

}  // namespace

bool is_llmc_checkpoint(const std::string& path) {
  const std::string prefix = detail::read_prefix(path, 4);
  int32_t magic = 0;
  if (prefix.size() == 4) std::memcpy(&magic, prefix.data(), 4);
  return magic == kLlmcMagic;
}

LoadedWeights load_llmc(const std::string& path) {
  const auto file = detail::MappedFile::open(path);
  const Header h = read_header(*file);
  LoadedWeights out;
  out.config = config_of(h);
  out.source = "llm.c checkpoint " + path;
  Shapes shapes = parameter_shapes(out.config);
  shapes["embed.tok.weight"] = {h.Vp, h.C};  // as the file holds it
  const at::ScalarType dtype = h.version == kLlmcVersionFloat32 ? at::kFloat : at::kBFloat16;
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  const std::vector<std::string> order = file_order(h.L);
  int64_t expected = kHeaderBytes;
  for (const std::string& name : order) expected += c10::multiply_integers(shapes[name]) * element;
  MESHTRAIN_CHECK(file->size() == expected, "llm.c checkpoint ", path, ": ", file->size(), " bytes, but its header (V ",
                  h.V, ", Vp ", h.Vp, ", maxT ", h.maxT, ", L ", h.L, ", C ", h.C, ", version ", h.version,
                  ") describes ", expected, file->size() < expected ? " (truncated)" : " (trailing bytes: damaged)");
  int64_t offset = kHeaderBytes;
  for (const std::string& name : order) {
    out.tensors[name] = to_float32(detail::tensor_at(file, offset, shapes[name], dtype), name);
    offset += c10::multiply_integers(shapes[name]) * element;
  }
  out.tensors["embed.tok.weight"] = to_padded_rows(out.tensors["embed.tok.weight"], models::padded_vocab(out.config));
  return out;
}

void save_llmc(const std::string& path, const models::ModelConfig& c, const std::map<std::string, at::Tensor>& ours,
               at::ScalarType dtype) {
  MESHTRAIN_CHECK(c.kind == "gpt2", "llm.c checkpoint ", path, ": llm.c holds GPT-2 only, not '", c.kind,
                  "'; export it with --format hf");
  MESHTRAIN_CHECK(c.tie_embeddings, "llm.c checkpoint ", path,
                  ": llm.c ties the head to the token embedding, this gpt2 has its own head (--untied); export it "
                  "with --format hf");
  MESHTRAIN_CHECK(models::ffn_hidden(c) == 4 * c.hidden, "llm.c checkpoint ", path, ": llm.c's MLP is 4 x hidden = ",
                  4 * c.hidden, " wide, this gpt2's is ", models::ffn_hidden(c), "; export it with --format hf");
  MESHTRAIN_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "llm.c checkpoint ", path, ": dtype ", dtype,
                  "; llm.c stores float32 (version 3) or bfloat16 (version 5)");
  check_parameters(c, ours, "llm.c checkpoint " + path);
  int32_t header[kLlmcHeaderInts] = {};
  const int32_t version = dtype == at::kFloat ? kLlmcVersionFloat32 : kLlmcVersionBFloat16;
  const int64_t fields[] = {kLlmcMagic, version, models::max_positions(c), c.vocab, c.layers, c.heads, c.hidden, models::padded_vocab(c)};
  for (size_t i = 0; i < 8; ++i) header[i] = static_cast<int32_t>(fields[i]);
  detail::AtomicFile out(path);
  out.write(header, sizeof header);
  for (const std::string& name : file_order(c.layers)) out.write(ours.at(name).to(dtype));
  out.commit();
}

}  // namespace io
}  // namespace meshtrain
