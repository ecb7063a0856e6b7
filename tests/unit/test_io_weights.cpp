// The entry points (meshtrain/io.h): each format recognised, what is neither
// refused by name, save_weights' refusals, check_matches naming every differing
// flag, GPT-2 as llm.c and as Hugging Face agreeing, and the reference fixtures
// (tests/fixtures/make_reference_models.py, an independent Python writer)
// loading to identical tensors in every format.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "config_error.h"
#include "io_test_util.h"
#include "io/hf.h"
#include "io/llmc.h"
#include "io/safetensors.h"
#include "meshtrain/io.h"

using namespace meshtrain;
using meshtrain::testing::config_error_of;
using meshtrain::testing::ScratchDir;
namespace mtest = meshtrain::testing;

namespace {

std::map<std::string, at::Tensor> gpt2_with_zero_padding(const models::ModelConfig& c, uint64_t seed) {
  auto ours = mtest::random_parameters(c, seed);
  ours["embed.tok.weight"].narrow(0, c.vocab, models::padded_vocab(c) - c.vocab).zero_();
  return ours;
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  const std::string error = config_error_of(f);
  ASSERT_FALSE(error.empty()) << "accepted; expected: " << parts.back();
  for (const std::string& part : parts) EXPECT_NE(error.find(part), std::string::npos) << error;
}

}  // namespace

TEST(Weights, LoadWeightsRecognisesEachFormat) {
  ScratchDir dir;
  const models::ModelConfig c = mtest::tiny_gpt2();
  const auto ours = gpt2_with_zero_padding(c, 31);
  io::save_weights(dir / "gpt2.bin", "llmc", c, ours);
  io::save_weights(dir / "hf", "hf", c, ours);
  const io::LoadedWeights llmc = io::load_weights(dir / "gpt2.bin");
  const io::LoadedWeights hf = io::load_weights(dir / "hf/");
  const io::LoadedWeights single = io::load_weights(dir / "hf/model.safetensors");
  EXPECT_EQ(llmc.source, "llm.c checkpoint " + (dir / "gpt2.bin"));
  EXPECT_EQ(hf.source, "Hugging Face directory " + (dir / "hf"));
  EXPECT_EQ(single.source, "Hugging Face file " + (dir / "hf/model.safetensors"));
  for (const io::LoadedWeights* w : {&llmc, &hf, &single}) {
    mtest::expect_bitwise_equal(ours, w->tensors, w->source);
    EXPECT_EQ(config_error_of([&] { io::check_matches(c, *w); }), "");
  }
}

TEST(Weights, LoadWeightsRefusesWhatItCannotReadNamingWhatItExpects) {
  ScratchDir dir;
  files::make_directories(dir / "empty");
  mtest::write_bytes(dir / "notes.txt", "hello");
  const int32_t token_shard_header[256] = {20240520, 1, 0};  // llm.c's data shard, not a model
  mtest::write_bytes(dir / "tokens.bin", std::string(reinterpret_cast<const char*>(token_shard_header), 1024));
  io::save_safetensors(dir / "empty/lonely.safetensors", {{"x", torch::ones({1})}});
  const std::string expected = "meshtrain reads an llm.c GPT-2 checkpoint";
  expect_error([&] { io::load_weights(dir / "absent"); }, {dir / "absent", "no such file or directory", expected});
  expect_error([&] { io::load_weights(dir / "empty"); }, {dir / "empty", "directory without config.json", expected});
  expect_error([&] { io::load_weights(dir / "notes.txt"); }, {dir / "notes.txt", "not a weight file", expected});
  expect_error([&] { io::load_weights(dir / "tokens.bin"); }, {dir / "tokens.bin", "llm.c token shard"});
  expect_error([&] { io::load_weights(dir / "empty/lonely.safetensors"); },
               {"put its config.json beside it", dir / "empty/config.json"});
}

TEST(Weights, SaveWeightsRefusesWhatAFormatCannotHold) {
  ScratchDir dir;
  const models::ModelConfig llama = mtest::tiny_llama();
  const auto ours = mtest::random_parameters(llama, 32);
  expect_error([&] { io::save_weights(dir / "l.bin", "llmc", llama, ours); }, {"--format hf"});
  expect_error([&] { io::save_weights(dir / "l", "onnx", llama, ours); }, {"--format 'onnx' is unknown", "hf", "llmc"});
  expect_error([&] { io::save_weights(dir / "l", "hf", llama, ours, at::kHalf); }, {"use float32 or bfloat16"});
  models::ModelConfig builtin;  // the built-in gpt
  expect_error([&] { io::save_weights(dir / "g", "hf", builtin, {}); }, {"model 'gpt' has no published weight format"});
}

TEST(Weights, CheckMatchesNamesEveryDifferingFlag) {
  io::LoadedWeights loaded{mtest::tiny_gpt2(), {}, "llm.c checkpoint gpt2_124M.bin"};
  models::ModelConfig wanted = loaded.config;
  EXPECT_EQ(config_error_of([&] { io::check_matches(wanted, loaded); }), "");
  wanted.hidden = 128;
  wanted.layers = 12;
  wanted.tie_embeddings = false;
  expect_error([&] { io::check_matches(wanted, loaded); },
               {"--hidden 128 but llm.c checkpoint gpt2_124M.bin has 32", "--layers 12 but llm.c checkpoint gpt2_124M.bin has 2",
                "--untied but llm.c checkpoint gpt2_124M.bin ties the head", "drop these flags"});
  wanted = mtest::tiny_llama();
  expect_error([&] { io::check_matches(wanted, loaded); }, {"--model llama but llm.c checkpoint gpt2_124M.bin holds a gpt2"});
  io::LoadedWeights llama{mtest::tiny_llama(), {}, "Hugging Face directory L"};
  wanted = llama.config;
  wanted.kv_heads = 4;
  wanted.rope_theta = 10000.0;
  expect_error([&] { io::check_matches(wanted, llama); },
               {"--kv-heads 4 but Hugging Face directory L has 2", "--rope-theta 10000 but Hugging Face directory L has 500000"});
}

TEST(Weights, Gpt2AsLlmcAndAsHuggingFaceAgree) {
  ScratchDir dir;
  for (bool bf16 : {false, true}) {
    const models::ModelConfig c = mtest::tiny_gpt2();
    auto ours = gpt2_with_zero_padding(c, bf16 ? 34 : 33);
    if (bf16) for (auto& named : ours) named.second = named.second.to(at::kBFloat16).to(at::kFloat);
    const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
    io::save_weights(dir / "m.bin", "llmc", c, ours, dtype);
    io::save_weights(dir / "m", "hf", c, ours, dtype);
    const io::LoadedWeights from_llmc = io::load_weights(dir / "m.bin");
    const io::LoadedWeights from_hf = io::load_weights(dir / "m");
    mtest::expect_bitwise_equal(from_llmc.tensors, from_hf.tensors, "llm.c vs Hugging Face");
    EXPECT_EQ(config_error_of([&] { io::check_matches(from_llmc.config, from_hf); }), "");
  }
}

// The reference fixtures: llm.c's and Hugging Face's GPT-2 and the llama in
// float32 and in sharded bfloat16, all written by the Python generator.
TEST(Weights, ReferenceFixturesLoadToIdenticalTensorsInEveryFormat) {
  ScratchDir dir;
  const std::string generator = std::string(MESHTRAIN_SOURCE_DIR) + "/tests/fixtures/make_reference_models.py";
  ASSERT_TRUE(files::exists(generator)) << generator << " is missing";
  ASSERT_EQ(::access(mtest::kPython, X_OK), 0) << mtest::kPython << " is missing (install python3)";
  const std::string command = std::string(mtest::kPython) + " " + generator + " " + dir.path + " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;

  const io::LoadedWeights gpt2_llmc = io::load_weights(dir / "gpt2_tiny.bin");
  const io::LoadedWeights gpt2_hf = io::load_weights(dir / "gpt2_tiny_hf");
  EXPECT_EQ(gpt2_llmc.config.vocab, 1000);
  EXPECT_EQ(models::padded_vocab(gpt2_llmc.config), 1024);
  EXPECT_EQ(gpt2_llmc.config.layers, 4);
  mtest::expect_bitwise_equal(gpt2_llmc.tensors, gpt2_hf.tensors, "gpt2_tiny.bin vs gpt2_tiny_hf");
  EXPECT_EQ(config_error_of([&] { io::check_matches(gpt2_llmc.config, gpt2_hf); }), "");

  const io::LoadedWeights llama = io::load_weights(dir / "llama_tiny_hf");
  const io::LoadedWeights llama_bf16 = io::load_weights(dir / "llama_tiny_hf_bf16");
  EXPECT_EQ(models::kv_heads(llama.config), 2);
  EXPECT_EQ(models::ffn_hidden(llama.config), 176);
  EXPECT_FALSE(llama.config.tie_embeddings);
  mtest::expect_bitwise_equal(llama.tensors, llama_bf16.tensors, "llama_tiny_hf vs llama_tiny_hf_bf16");
  EXPECT_EQ(config_error_of([&] { io::check_matches(llama.config, llama_bf16); }), "");
}
