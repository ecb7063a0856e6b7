// Hugging Face directories (io/hf.h): config.json both ways, the tensor name
// mapping both ways (transposed Conv1D, split c_attn, padded vocabulary),
// directories in float32 and bfloat16, sharded directories with an index, and
// every refusal naming the file and the tensor.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "config_error.h"
#include "io_test_util.h"
#include "io/hf.h"
#include "io/safetensors.h"

using namespace meshtrain;
using meshtrain::testing::config_error_of;
using meshtrain::testing::ScratchDir;
namespace mtest = meshtrain::testing;

namespace {

const char* const kGpt2Json = R"({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
  "n_positions": 16, "vocab_size": 200, "activation_function": "gelu_new", "n_inner": null})";
const char* const kLlamaJson = R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 88,
  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 96,
  "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "hidden_act": "silu",
  "rope_scaling": null})";

// `json` with one more key (a later key wins over an earlier one).
std::string with(const std::string& json, const std::string& key, const std::string& value) {
  return json.substr(0, json.rfind('}')) + ", \"" + key + "\": " + value + "}";
}

models::ModelConfig parse_config(const std::string& text) { return io::config_from_hf(json::parse(text), "dir/config.json"); }

// No shape field differs (check_matches throws naming the first that does).
void expect_same_shape(const models::ModelConfig& a, const models::ModelConfig& b) {
  EXPECT_EQ(config_error_of([&] { io::check_matches(a, io::LoadedWeights{b, {}, "the other"}); }), "");
}

// Random parameters whose padded embedding rows are zero (what an HF import gives back).
std::map<std::string, at::Tensor> zero_padded(const models::ModelConfig& c, uint64_t seed, bool bf16_values = false) {
  auto ours = mtest::random_parameters(c, seed, bf16_values);
  for (const char* name : {"embed.tok.weight", "head.out.weight"}) {
    if (ours.count(name)) ours[name].narrow(0, c.vocab, models::padded_vocab(c) - c.vocab).zero_();
  }
  return ours;
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  const std::string error = config_error_of(f);
  ASSERT_FALSE(error.empty()) << "accepted; expected: " << parts.back();
  for (const std::string& part : parts) EXPECT_NE(error.find(part), std::string::npos) << error;
}

// A llama directory in two shards and an index: layer 0 and the embedding, then the rest.
void write_sharded_llama(const std::string& dir, const models::ModelConfig& c, const std::map<std::string, at::Tensor>& ours) {
  std::map<std::string, at::Tensor> shards[2];
  json::Object weight_map;
  for (const auto& named : io::to_hf(c, ours)) {
    const bool first = named.first.rfind("model.layers.0.", 0) == 0 || named.first == "model.embed_tokens.weight";
    shards[first ? 0 : 1][named.first] = named.second;
    weight_map.str(named.first, first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors");
  }
  files::make_directories(dir);
  io::save_safetensors(dir + "/model-00001-of-00002.safetensors", shards[0]);
  io::save_safetensors(dir + "/model-00002-of-00002.safetensors", shards[1]);
  mtest::write_bytes(dir + "/model.safetensors.index.json",
                       json::Object().raw("metadata", "{}").raw("weight_map", weight_map.str()).str());
  mtest::write_bytes(dir + "/config.json", io::hf_config_json(c));
}

}  // namespace

TEST(Hf, ConfigFromConfigJsonWithHfDefaults) {
  const models::ModelConfig gpt2 = parse_config(kGpt2Json);
  expect_same_shape(gpt2, mtest::tiny_gpt2());
  EXPECT_TRUE(gpt2.tie_embeddings) << "GPT2Config ties by default";
  EXPECT_EQ(gpt2.norm_eps, 1e-5);
  EXPECT_EQ(parse_config(with(kGpt2Json, "n_inner", "96")).ffn_hidden, 96);
  const models::ModelConfig llama = parse_config(kLlamaJson);
  expect_same_shape(llama, mtest::tiny_llama());
  EXPECT_FALSE(llama.tie_embeddings) << "LlamaConfig does not tie by default";
  const std::string minimal = R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 88,
    "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96, "max_position_embeddings": 64})";
  const models::ModelConfig defaults = parse_config(minimal);
  EXPECT_EQ(models::kv_heads(defaults), 4);
  EXPECT_EQ(defaults.norm_eps, 1e-6);
  EXPECT_EQ(defaults.rope_theta, 10000.0);
}

TEST(Hf, ConfigRefusesWhatTheModelsDoNotComputeNamingTheKey) {
  const std::pair<std::string, std::string> cases[] = {
      {with(kGpt2Json, "model_type", "\"mistral\""),
       "model_type 'mistral' is not supported; meshtrain reads gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM)"},
      {with(kGpt2Json, "activation_function", "\"relu\""), "activation_function 'relu' is not supported"},
      {with(kGpt2Json, "scale_attn_by_inverse_layer_idx", "true"), "scale_attn_by_inverse_layer_idx true"},
      {with(kGpt2Json, "n_head", "5"), "hidden 32 must be a positive multiple of heads 5"},
      {with(kGpt2Json, "n_embd", "null"), "config.json has no 'n_embd'"},
      {with(kGpt2Json, "vocab_size", "\"many\""), "'vocab_size' must be an integer > 0"},
      {with(kLlamaJson, "rope_scaling", R"({"type": "linear", "factor": 2.0})"), "rope_scaling (not null) is not supported"},
      {with(kLlamaJson, "attention_bias", "true"), "attention_bias true is not supported"},
      {with(kLlamaJson, "mlp_bias", "true"), "mlp_bias true is not supported"},
      {with(kLlamaJson, "hidden_act", "\"gelu\""), "hidden_act 'gelu' is not supported"},
      {with(kLlamaJson, "head_dim", "16"), "head_dim 16 is not supported"},
      {with(kLlamaJson, "num_key_value_heads", "3"), "kv_heads 3 must divide heads 4"},
  };
  for (const auto& c : cases) expect_error([&] { parse_config(c.first); }, {"dir/config.json: ", c.second});
}

TEST(Hf, ConfigJsonRoundTripsAndNamesTheArchitecture) {
  for (const models::ModelConfig& c : {mtest::tiny_gpt2(), mtest::tiny_gpt2(false), mtest::tiny_llama(),
                                       mtest::tiny_llama(true)}) {
    const json::Value j = json::parse(io::hf_config_json(c, io::HfConfigOptions().dtype(at::kBFloat16)));
    expect_same_shape(io::config_from_hf(j, "written"), c);
    EXPECT_EQ(j["torch_dtype"].str(), "bfloat16");
    EXPECT_EQ(j["architectures"][0].str(), c.kind == "gpt2" ? "GPT2LMHeadModel" : "LlamaForCausalLM");
    EXPECT_FALSE(j.has("bos_token_id")) << "written only when given";
  }
  const json::Value j = json::parse(io::hf_config_json(mtest::tiny_gpt2(), io::HfConfigOptions().bos_token_id(1).eos_token_id(2)));
  EXPECT_EQ(j["bos_token_id"].i64(), 1);
  EXPECT_EQ(j["eos_token_id"].i64(), 2);
  EXPECT_EQ(j["torch_dtype"].str(), "float32");
}

TEST(Hf, Gpt2MappingTransposesSplitsAndPads) {
  for (bool tied : {true, false}) {
    const models::ModelConfig c = mtest::tiny_gpt2(tied);
    const auto ours = zero_padded(c, 21);
    const auto hf = io::to_hf(c, ours);
    const std::string h = "transformer.h.1.";
    EXPECT_EQ(hf.at("transformer.wte.weight").sizes(), at::IntArrayRef({200, 32})) << "trimmed to vocab";
    EXPECT_TRUE(at::equal(hf.at(h + "attn.c_attn.weight").narrow(1, 32, 32), ours.at("blocks.1.k.weight").t()));
    EXPECT_TRUE(at::equal(hf.at(h + "attn.c_attn.bias").narrow(0, 64, 32), ours.at("blocks.1.v.bias")));
    EXPECT_TRUE(at::equal(hf.at(h + "attn.c_proj.weight"), ours.at("blocks.1.proj.weight").t()));
    EXPECT_EQ(hf.at(h + "mlp.c_fc.weight").sizes(), at::IntArrayRef({32, 128})) << "Conv1D: [in, out]";
    EXPECT_TRUE(at::equal(hf.at(h + "mlp.c_proj.weight"), ours.at("blocks.1.fc2.weight").t()));
    EXPECT_EQ(hf.count("lm_head.weight"), tied ? 0u : 1u);
    mtest::expect_bitwise_equal(ours, io::from_hf(c, hf, "memory"), tied ? "tied" : "untied");
  }
}

TEST(Hf, Gpt2AcceptsGpt2ModelNamesBuffersAndAnEqualTiedHead) {
  const models::ModelConfig c = mtest::tiny_gpt2();
  const auto ours = zero_padded(c, 22);
  std::map<std::string, at::Tensor> bare;  // GPT2Model's names, no "transformer."
  for (const auto& named : io::to_hf(c, ours)) bare[named.first.substr(std::string("transformer.").size())] = named.second;
  bare["h.0.attn.bias"] = torch::ones({1, 1, 16, 16});
  bare["h.0.attn.masked_bias"] = torch::tensor(-1e4f);
  bare["lm_head.weight"] = bare.at("wte.weight").clone();
  mtest::expect_bitwise_equal(ours, io::from_hf(c, bare, "memory"), "GPT2Model names");
  bare["lm_head.weight"].add_(1);
  expect_error([&] { io::from_hf(c, bare, "dir"); },
               {"dir: tensor 'lm_head.weight' differs from 'wte.weight'", "set tie_word_embeddings to false"});
}

TEST(Hf, LlamaMappingRenamesOnly) {
  for (bool tied : {false, true}) {
    const models::ModelConfig c = mtest::tiny_llama(tied);
    const auto ours = mtest::random_parameters(c, 23);
    auto hf = io::to_hf(c, ours);
    EXPECT_EQ(hf.size(), ours.size());
    EXPECT_TRUE(hf.at("model.layers.1.self_attn.k_proj.weight").is_same(ours.at("blocks.1.k.weight")));
    EXPECT_EQ(hf.count("lm_head.weight"), tied ? 0u : 1u);
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch::ones({4});  // an old buffer: ignored
    mtest::expect_bitwise_equal(ours, io::from_hf(c, hf, "memory"), "llama");
  }
}

TEST(Hf, MappingRefusesMissingUnexpectedAndMisshapedTensorsNamingThem) {
  const models::ModelConfig c = mtest::tiny_gpt2();
  const auto hf = io::to_hf(c, zero_padded(c, 24));
  auto missing = hf;
  missing.erase("transformer.h.1.mlp.c_fc.bias");
  expect_error([&] { io::from_hf(c, missing, "DIR"); }, {"DIR: tensor 'transformer.h.1.mlp.c_fc.bias' is missing"});
  auto extra = hf;
  extra["transformer.h.2.ln_1.weight"] = torch::ones({32});
  expect_error([&] { io::from_hf(c, extra, "DIR", {{"transformer.h.2.ln_1.weight", "DIR/shard-2.safetensors"}}); },
               {"DIR/shard-2.safetensors: tensor 'transformer.h.2.ln_1.weight' is unexpected"});
  auto misshaped = hf;
  misshaped["transformer.h.0.attn.c_attn.weight"] = misshaped["transformer.h.0.attn.c_attn.weight"].t();
  expect_error([&] { io::from_hf(c, misshaped, "DIR", {{"transformer.h.0.attn.c_attn.weight", "DIR/a.safetensors"}}); },
               {"DIR/a.safetensors: tensor 'transformer.h.0.attn.c_attn.weight' has shape [96, 32]", "needs [32, 96]"});
  expect_error([&] { io::from_hf(mtest::tiny_gpt2(false), hf, "DIR"); }, {"DIR: tensor 'lm_head.weight' is missing"});
  const models::ModelConfig llama = mtest::tiny_llama();
  auto wide_k = io::to_hf(llama, mtest::random_parameters(llama, 25));
  wide_k["model.layers.1.self_attn.k_proj.weight"] = torch::zeros({32, 32});
  expect_error([&] { io::from_hf(llama, wide_k, "DIR"); },
               {"tensor 'model.layers.1.self_attn.k_proj.weight' has shape [32, 32]", "needs [16, 32]"});
}

TEST(Hf, DirectoryRoundTripInFloat32AndBFloat16IsBitwise) {
  ScratchDir dir;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (const models::ModelConfig& c : {mtest::tiny_gpt2(), mtest::tiny_llama()}) {
      const std::string out = dir / (c.kind + "-" + std::string(c10::toString(dtype)));
      const auto ours = zero_padded(c, 26, /*bf16_values=*/true);
      io::save_hf(out, c, ours, io::HfConfigOptions().dtype(dtype));
      const io::LoadedWeights w = io::load_hf(out);
      mtest::expect_bitwise_equal(ours, w.tensors, out);
      expect_same_shape(w.config, c);
      EXPECT_EQ(w.source, "Hugging Face directory " + out);
      for (const auto& named : io::load_safetensors(out + "/model.safetensors")) EXPECT_EQ(named.second.scalar_type(), dtype);
      EXPECT_EQ(json::parse_file(out + "/config.json")["torch_dtype"].str(), dtype == at::kFloat ? "float32" : "bfloat16");
    }
  }
}

TEST(Hf, ShardedDirectoryWithIndexLoadsEveryShard) {
  ScratchDir dir;
  const models::ModelConfig c = mtest::tiny_llama();
  const auto ours = mtest::random_parameters(c, 27);
  write_sharded_llama(dir / "m", c, ours);
  mtest::expect_bitwise_equal(ours, io::load_hf(dir / "m").tensors, "sharded");
  std::set<std::string> files_read;
  for (const auto& f : io::read_hf_tensors(dir / "m").file_of) files_read.insert(f.second);
  EXPECT_EQ(files_read.size(), 2u);
}

TEST(Hf, ShardedDirectoryRefusesMissingShardsAndTensorsNamingThem) {
  ScratchDir dir;
  const models::ModelConfig c = mtest::tiny_llama();
  const auto ours = mtest::random_parameters(c, 28);
  const std::string m = dir / "m", shard1 = m + "/model-00001-of-00002.safetensors";
  write_sharded_llama(m, c, ours);
  std::rename((m + "/model-00002-of-00002.safetensors").c_str(), (m + "/elsewhere").c_str());
  expect_error([&] { io::load_hf(m); }, {"in shard model-00002-of-00002.safetensors", "more)",
                                         m + "/model-00002-of-00002.safetensors does not exist"});
  write_sharded_llama(m, c, ours);
  const std::string index = mtest::read_bytes(m + "/model.safetensors.index.json");
  mtest::write_bytes(m + "/model.safetensors.index.json",
                       with(index.substr(0, index.size() - 1), "model.extra.weight", "\"model-00001-of-00002.safetensors\"") + "}");
  expect_error([&] { io::load_hf(m); }, {shard1, "tensor 'model.extra.weight' is missing from this shard"});
  write_sharded_llama(m, c, ours);
  io::save_safetensors(m + "/model-00002-of-00002.safetensors", {{"model.layers.1.mlp.up_proj.weight", torch::ones({1})}});
  expect_error([&] { io::load_hf(m); }, {"model-00002-of-00002.safetensors: tensor", "is missing from this shard"});
  write_sharded_llama(m, c, ours);
  auto with_stray = io::load_safetensors(shard1);
  with_stray["stray"] = torch::ones({1});
  io::save_safetensors(shard1, with_stray);
  expect_error([&] { io::load_hf(m); }, {shard1, "tensor 'stray' is in this shard but model.safetensors.index.json does not place it here"});
  std::remove((m + "/model.safetensors.index.json").c_str());
  expect_error([&] { io::load_hf(m); }, {m, "neither model.safetensors nor model.safetensors.index.json"});
  std::remove((m + "/config.json").c_str());
  expect_error([&] { io::load_hf(m); }, {m + "/config.json does not exist"});
}

TEST(Hf, ASingleSafetensorsFileBesideItsConfig) {
  ScratchDir dir;
  const models::ModelConfig c = mtest::tiny_gpt2(false);
  const auto ours = zero_padded(c, 29);
  io::save_hf(dir.path, c, ours);
  std::rename((dir / "model.safetensors").c_str(), (dir / "weights.safetensors").c_str());
  const io::LoadedWeights w = io::load_hf(dir / "weights.safetensors");
  mtest::expect_bitwise_equal(ours, w.tensors, "single file");
  EXPECT_EQ(w.source, "Hugging Face file " + (dir / "weights.safetensors"));
}
