// llm.c checkpoints (io/llmc.h): the file layout against a hand-written file,
// round trips in float32 (version 3) and bfloat16 (version 5), other padded
// vocabularies, and damaged files and unsupported models refused by name.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <vector>

#include "config_error.h"
#include "io_test_util.h"
#include "io/llmc.h"

using namespace meshtrain;
using meshtrain::testing::config_error_of;
using meshtrain::testing::ScratchDir;
namespace mtest = meshtrain::testing;

namespace {

struct Sizes {
  int32_t maxT, V, L, NH, C, Vp;
};

// llm.c's 16 tensor sizes in file order (train_gpt2.c's fill_in_parameter_sizes).
std::vector<int64_t> llmc_sizes(const Sizes& s) {
  const int64_t C = s.C, L = s.L;
  return {s.Vp * C, s.maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C,
          L * C,    L * C,      L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C};
}

// A float32 checkpoint whose i-th parameter value is i (exact in float32 at these sizes).
std::string numbered_checkpoint(const Sizes& s, int32_t magic = io::kLlmcMagic, int32_t version = 3) {
  int32_t header[256] = {magic, version, s.maxT, s.V, s.L, s.NH, s.C, s.Vp};
  int64_t total = 0;
  for (int64_t n : llmc_sizes(s)) total += n;
  const at::Tensor values = torch::arange(total, at::kFloat);
  return std::string(reinterpret_cast<const char*>(header), sizeof header) +
         std::string(static_cast<const char*>(values.data_ptr()), total * 4);
}

// The numbered values of llm.c tensor `index`, from element `from`, `n` of them.
at::Tensor numbered(const Sizes& s, int index, int64_t from, int64_t n) {
  const std::vector<int64_t> sizes = llmc_sizes(s);
  int64_t offset = 0;
  for (int i = 0; i < index; ++i) offset += sizes[i];
  return torch::arange(offset + from, offset + from + n, at::kFloat);
}

const Sizes kSmall{4, 200, 2, 2, 4, 256};

}  // namespace

TEST(Llmc, ReadsLlmcsLayoutIntoOurNames) {
  ScratchDir dir;
  mtest::write_bytes(dir / "m.bin", numbered_checkpoint(kSmall));
  const io::LoadedWeights w = io::load_llmc(dir / "m.bin");
  const int64_t C = kSmall.C;
  EXPECT_EQ(w.config.kind, "gpt2");
  EXPECT_EQ(w.config.vocab, 200);
  EXPECT_EQ(w.config.seq_len, 4);
  EXPECT_EQ(w.config.layers, 2);
  EXPECT_EQ(w.config.heads, 2);
  EXPECT_EQ(w.config.hidden, 4);
  EXPECT_TRUE(w.config.tie_embeddings);
  EXPECT_EQ(w.source, "llm.c checkpoint " + (dir / "m.bin"));
  io::check_parameters(w.config, w.tensors, "loaded");
  EXPECT_TRUE(at::equal(w.tensors.at("embed.tok.weight"), numbered(kSmall, 0, 0, 256 * C).view({256, C})));
  EXPECT_TRUE(at::equal(w.tensors.at("embed.pos"), numbered(kSmall, 1, 0, 4 * C).view({4, C})));
  EXPECT_TRUE(at::equal(w.tensors.at("blocks.1.ln1.bias"), numbered(kSmall, 3, C, C)));
  // qkvw [L, 3C, C]: layer 1's rows C..2C are k, [out, in] as torch's Linear.
  EXPECT_TRUE(at::equal(w.tensors.at("blocks.1.k.weight"), numbered(kSmall, 4, 3 * C * C + C * C, C * C).view({C, C})));
  EXPECT_TRUE(at::equal(w.tensors.at("blocks.0.v.bias"), numbered(kSmall, 5, 2 * C, C)));
  EXPECT_TRUE(at::equal(w.tensors.at("blocks.1.proj.weight"), numbered(kSmall, 6, C * C, C * C).view({C, C})));
  EXPECT_TRUE(at::equal(w.tensors.at("blocks.0.ln2.weight"), numbered(kSmall, 8, 0, C)));
  EXPECT_TRUE(at::equal(w.tensors.at("blocks.1.fc1.weight"), numbered(kSmall, 10, 4 * C * C, 4 * C * C).view({4 * C, C})));
  EXPECT_TRUE(at::equal(w.tensors.at("blocks.0.fc2.weight"), numbered(kSmall, 12, 0, 4 * C * C).view({C, 4 * C})));
  EXPECT_TRUE(at::equal(w.tensors.at("blocks.1.fc2.bias"), numbered(kSmall, 13, C, C)));
  EXPECT_TRUE(at::equal(w.tensors.at("head.ln.bias"), numbered(kSmall, 15, 0, C)));
}

TEST(Llmc, RoundTripFloat32IsBitwise) {
  ScratchDir dir;
  const models::ModelConfig c = mtest::tiny_gpt2();
  const auto ours = mtest::random_parameters(c, 11);  // padded rows random: written and read as they are
  io::save_llmc(dir / "m.bin", c, ours);
  const io::LoadedWeights w = io::load_llmc(dir / "m.bin");
  mtest::expect_bitwise_equal(ours, w.tensors, "llm.c float32");
  EXPECT_EQ(w.config.vocab, c.vocab);
  EXPECT_EQ(w.config.seq_len, c.seq_len);
  EXPECT_EQ(w.config.hidden, c.hidden);
  int64_t params = 0;
  for (const auto& named : ours) params += named.second.numel();
  EXPECT_EQ(static_cast<int64_t>(mtest::read_bytes(dir / "m.bin").size()), 1024 + 4 * params);
}

TEST(Llmc, RoundTripBFloat16IsVersion5AndBitwise) {
  ScratchDir dir;
  const models::ModelConfig c = mtest::tiny_gpt2();
  const auto ours = mtest::random_parameters(c, 12, /*bf16_values=*/true);
  io::save_llmc(dir / "m.bin", c, ours, at::kBFloat16);
  const std::string bytes = mtest::read_bytes(dir / "m.bin");
  int32_t version = 0;
  std::memcpy(&version, bytes.data() + 4, 4);
  EXPECT_EQ(version, 5);
  int64_t params = 0;
  for (const auto& named : ours) params += named.second.numel();
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), 1024 + 2 * params);
  mtest::expect_bitwise_equal(ours, io::load_llmc(dir / "m.bin").tensors, "llm.c bfloat16");
}

TEST(Llmc, AnotherPaddedVocabularyIsReadAsPaddedVocab) {
  ScratchDir dir;
  const Sizes odd{4, 130, 1, 2, 4, 133};  // padded_vocab(130) = 256: rows 133.. are zero
  mtest::write_bytes(dir / "odd.bin", numbered_checkpoint(odd));
  const at::Tensor wte = io::load_llmc(dir / "odd.bin").tensors.at("embed.tok.weight");
  ASSERT_EQ(wte.sizes(), at::IntArrayRef({256, 4}));
  EXPECT_TRUE(at::equal(wte.narrow(0, 0, 133), numbered(odd, 0, 0, 133 * 4).view({133, 4})));
  EXPECT_TRUE(at::equal(wte.narrow(0, 133, 123), torch::zeros({123, 4})));
  const Sizes wide{4, 100, 1, 2, 4, 256};  // padded_vocab(100) = 128: rows 128.. dropped (never predicted)
  mtest::write_bytes(dir / "wide.bin", numbered_checkpoint(wide));
  const at::Tensor cut = io::load_llmc(dir / "wide.bin").tensors.at("embed.tok.weight");
  EXPECT_TRUE(at::equal(cut, numbered(wide, 0, 0, 128 * 4).view({128, 4})));
}

TEST(Llmc, RefusesDamagedFilesNamingTheFile) {
  ScratchDir dir;
  const std::string file = dir / "bad.bin";
  const std::string good = numbered_checkpoint(kSmall);
  const std::pair<std::string, std::string> cases[] = {
      {good.substr(0, 100), "shorter than the 1024-byte header"},
      {numbered_checkpoint(kSmall, 12345), "magic number 12345, expected 20240326"},
      {numbered_checkpoint(kSmall, 20240520), "llm.c token shard"},
      {numbered_checkpoint(kSmall, io::kLlmcMagic, 4), "version 4; meshtrain reads 3 (float32) and 5 (bfloat16)"},
      {good.substr(0, good.size() - 4), "(truncated)"},
      {good + "xxxx", "(trailing bytes: damaged)"},
      {numbered_checkpoint(Sizes{4, 200, 2, 3, 4, 256}), "NH 3, C 4"},
      {numbered_checkpoint(Sizes{4, 200, 2, 2, 4, 100}), "Vp 100"},
  };
  for (const auto& c : cases) {
    mtest::write_bytes(file, c.first);
    const std::string error = config_error_of([&] { io::load_llmc(file); });
    EXPECT_NE(error.find(file), std::string::npos) << error;
    EXPECT_NE(error.find(c.second), std::string::npos) << "expected '" << c.second << "' in: " << error;
  }
}

TEST(Llmc, RefusesModelsItCannotHoldNamingTheFix) {
  ScratchDir dir;
  const std::string file = dir / "m.bin";
  const models::ModelConfig llama = mtest::tiny_llama();
  EXPECT_NE(config_error_of([&] { io::save_llmc(file, llama, mtest::random_parameters(llama, 1)); })
                .find("llm.c holds GPT-2 only, not 'llama'; export it with --format hf"),
            std::string::npos);
  const models::ModelConfig untied = mtest::tiny_gpt2(/*tied=*/false);
  EXPECT_NE(config_error_of([&] { io::save_llmc(file, untied, mtest::random_parameters(untied, 1)); })
                .find("--format hf"),
            std::string::npos);
  models::ModelConfig narrow = mtest::tiny_gpt2();
  narrow.ffn_hidden = 3 * narrow.hidden;
  EXPECT_NE(config_error_of([&] { io::save_llmc(file, narrow, mtest::random_parameters(narrow, 1)); })
                .find("4 x hidden = 128 wide, this gpt2's is 96"),
            std::string::npos);
  const models::ModelConfig c = mtest::tiny_gpt2();
  auto missing = mtest::random_parameters(c, 1);
  missing.erase("blocks.1.fc1.bias");
  EXPECT_NE(config_error_of([&] { io::save_llmc(file, c, missing); }).find("parameter 'blocks.1.fc1.bias' is missing"),
            std::string::npos);
  auto misshaped = mtest::random_parameters(c, 1);
  misshaped["embed.tok.weight"] = torch::zeros({200, 32});
  EXPECT_NE(config_error_of([&] { io::save_llmc(file, c, misshaped); })
                .find("'embed.tok.weight' has shape [200, 32] but the model needs [256, 32]"),
            std::string::npos);
  EXPECT_FALSE(files::exists(file)) << "nothing written when refused";
}
