// The built-in language models' pieces against their definitions, computed
// here independently: RMSNorm, rotary embeddings, grouped-query attention and
// its cache, GPT-2's padded vocabulary, incremental decoding, parameter counts.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>

#include "meshtrain/models.h"
#include "config_error.h"

using namespace meshtrain;

namespace {

models::ModelConfig small(const std::string& kind) {
  models::ModelConfig c;
  c.kind = kind;
  c.vocab = kind == "gpt2" ? 200 : 128;  // GPT-2: padded to 256
  c.seq_len = 24;
  c.hidden = 32;
  c.heads = 4;
  c.layers = 2;
  if (kind == "llama") {
    c.kv_heads = 2;
    c.tie_embeddings = false;
  }
  return c;
}

void expect_refused(const std::function<void()>& f, const std::string& words) {
  const std::string message = meshtrain::testing::config_error_of(f);
  EXPECT_NE(message.find(words), std::string::npos) << "wanted a ConfigError with '" << words << "', got '" << message << "'";
}

}  // namespace

TEST(Models, RmsNormIsXOverItsRootMeanSquareTimesTheWeight) {
  nn::RMSNorm norm(8, 1e-5);
  at::NoGradGuard no_grad;
  norm->weight.copy_(at::linspace(0.5, 2.0, 8));
  const at::Tensor x = at::randn({3, 8}, at::kDouble).to(at::kFloat);
  const at::Tensor y = norm->forward(x);
  for (int64_t r = 0; r < 3; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < 8; ++i) ss += std::pow(x[r][i].item<double>(), 2);
    const double scale = 1.0 / std::sqrt(ss / 8 + 1e-5);
    for (int64_t i = 0; i < 8; ++i)
      EXPECT_NEAR(y[r][i].item<double>(), x[r][i].item<double>() * scale * norm->weight[i].item<double>(), 1e-5);
  }
}

TEST(Models, RotaryRotatesChannelPairsIAndIPlusHalfByPositionTimesFrequency) {
  const int64_t d = 8, theta = 10000;
  nn::Rotary rotary(d, 16, theta);
  const at::Tensor x = at::randn({1, 2, 5, d});
  const at::Tensor y = rotary.apply(x, /*start=*/3);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t t = 0; t < 5; ++t) {
      for (int64_t i = 0; i < d / 2; ++i) {
        const double angle = (3 + t) * std::pow(theta, -2.0 * i / d);
        const double a = x[0][h][t][i].item<double>(), b = x[0][h][t][i + d / 2].item<double>();
        EXPECT_NEAR(y[0][h][t][i].item<double>(), a * std::cos(angle) - b * std::sin(angle), 1e-5);
        EXPECT_NEAR(y[0][h][t][i + d / 2].item<double>(), b * std::cos(angle) + a * std::sin(angle), 1e-5);
      }
    }
  }
}

TEST(Models, GroupedQueryAttentionReadsKeyHeadHOverGroupSize) {
  const at::Tensor q = at::randn({2, 4, 6, 8}), k = at::randn({2, 2, 6, 8}), v = at::randn({2, 2, 6, 8});
  const at::Tensor y = nn::causal_attention(q, k, v);
  for (int64_t h = 0; h < 4; ++h) {
    const at::Tensor qh = q.narrow(1, h, 1), kh = k.narrow(1, h / 2, 1), vh = v.narrow(1, h / 2, 1);
    at::Tensor scores = at::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(8.0);
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t j = i + 1; j < 6; ++j) scores.select(2, i).select(2, j).fill_(-1e30);
    EXPECT_TRUE(at::allclose(y.narrow(1, h, 1), at::matmul(at::softmax(scores, -1), vh), 1e-5, 1e-6)) << "head " << h;
  }
}

TEST(Models, AttentionOfTheLastQueriesOverACacheEqualsTheLastRowsOfFullAttention) {
  const at::Tensor q = at::randn({1, 4, 7, 8}), k = at::randn({1, 2, 7, 8}), v = at::randn({1, 2, 7, 8});
  const at::Tensor full = nn::causal_attention(q, k, v);
  const at::Tensor last = nn::causal_attention(q.narrow(2, 5, 2), k, v);
  EXPECT_TRUE(at::allclose(last, full.narrow(2, 5, 2), 1e-6, 1e-6));
}

TEST(Models, ParameterCountIsTheSumOfTheBuiltParameters) {
  for (const char* kind : {"gpt", "gpt2", "llama"}) {
    for (bool tied : {true, false}) {
      auto c = small(kind);
      c.tie_embeddings = tied;
      int64_t n = 0;
      for (const auto& p : models::build_stage(c, 0, models::num_pieces(c))->parameters()) n += p.numel();
      EXPECT_EQ(models::parameter_count(c), n) << kind << (tied ? " tied" : " untied");
    }
  }
}

TEST(Models, LlamaHasItsShape) {
  const auto c = small("llama");
  auto stage = models::build_stage(c, 0, models::num_pieces(c));
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : stage->named_parameters()) shapes[p.key()] = p.value().sizes().vec();
  const int64_t f = models::ffn_hidden(c);
  EXPECT_EQ(f, 96);  // 2/3 x 4 x 32 = 85.3, rounded up to a multiple of 32
  EXPECT_EQ(shapes["embed.tok.weight"], (std::vector<int64_t>{128, 32}));
  EXPECT_EQ(shapes["blocks.0.q.weight"], (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(shapes["blocks.0.k.weight"], (std::vector<int64_t>{16, 32}));  // 2 key/value heads of 8
  EXPECT_EQ(shapes["blocks.1.down.weight"], (std::vector<int64_t>{32, f}));
  EXPECT_EQ(shapes["head.out.weight"], (std::vector<int64_t>{128, 32}));
  EXPECT_EQ(shapes["head.norm.weight"], (std::vector<int64_t>{32}));
  EXPECT_EQ(shapes.count("embed.pos"), 0u);
  EXPECT_EQ(shapes.count("blocks.0.q.bias"), 0u);
}

TEST(Models, Gpt2NeverPredictsItsPaddedVocabularyRows) {
  const auto c = small("gpt2");
  EXPECT_EQ(models::padded_vocab(c), 256);
  auto stage = models::build_stage(c, 0, models::num_pieces(c));
  const at::Tensor wte = stage->named_parameters()["embed.tok.weight"];
  EXPECT_EQ(wte.narrow(0, 200, 56).abs().sum().item<double>(), 0.0);  // padded rows start at zero
  const at::Tensor tokens = at::randint(0, 200, {2, 10}, at::kLong), targets = at::randint(0, 200, {2, 10}, at::kLong);
  const at::Tensor logits = stage->forward(tokens);
  ASSERT_EQ(logits.size(-1), 256);
  // The loss is cross-entropy over the 200 real logits alone.
  const at::Tensor want = at::cross_entropy_loss(logits.narrow(-1, 0, 200).reshape({-1, 200}), targets.reshape({-1}));
  const at::Tensor loss = models::loss(c, logits, targets);
  EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-6);
  // Even padded rows that would dominate the softmax change nothing, and get no gradient.
  {
    at::NoGradGuard no_grad;
    wte.narrow(0, 200, 56).fill_(5.0);
  }
  const at::Tensor loss2 = models::loss(c, stage->forward(tokens), targets);
  EXPECT_EQ(loss2.item<double>(), loss.item<double>());
  loss2.backward();
  EXPECT_EQ(wte.grad().narrow(0, 200, 56).abs().sum().item<double>(), 0.0);
}

TEST(Models, DecodingWithACacheGivesTheTokensOfTheWholeSequenceEachStep) {
  for (const char* kind : {"gpt", "gpt2", "llama"}) {
    const auto c = small(kind);
    auto stage = models::build_stage(c, 0, models::num_pieces(c));
    for (double temperature : {0.0, 1.0}) {
      auto o = models::GenerateOptions().max_new_tokens(12).temperature(temperature).top_k(40).top_p(0.9).seed(7);
      const auto cached = models::generate(c, *stage, {3, 1, 4, 1, 5}, o);
      const auto whole = models::generate(c, *stage, {3, 1, 4, 1, 5}, o.use_cache(false));
      EXPECT_EQ(cached.ids, whole.ids) << kind << " temperature " << temperature;
      EXPECT_EQ(cached.ids.size(), 12u);
      for (int64_t id : cached.ids) EXPECT_LT(id, c.vocab) << kind;
    }
  }
}

TEST(Models, GenerationStopsAtAStopTokenAndAtTheLastPosition) {
  const auto c = small("llama");
  auto stage = models::build_stage(c, 0, models::num_pieces(c));
  const auto free = models::generate(c, *stage, {1}, models::GenerateOptions().max_new_tokens(5).temperature(0));
  const auto stopped = models::generate(
      c, *stage, {1}, models::GenerateOptions().max_new_tokens(5).temperature(0).stop_ids({free.ids[2]}));
  EXPECT_TRUE(stopped.stopped);
  EXPECT_EQ(stopped.ids, std::vector<int64_t>(free.ids.begin(), free.ids.begin() + 3));
  const auto full = models::generate(c, *stage, {1, 2, 3}, models::GenerateOptions().max_new_tokens(100).temperature(0));
  EXPECT_TRUE(full.hit_max_positions);
  EXPECT_EQ(full.ids.size() + 3, static_cast<size_t>(c.seq_len) + 1);  // the last from the last position's logits
}

TEST(Models, SamplingKeepsTheTopKAndTheNucleus) {
  const at::Tensor logits = at::log(at::tensor({0.5, 0.3, 0.15, 0.05}, at::kDouble)).to(at::kFloat);
  std::map<int64_t, int> seen_k, seen_p;
  for (int64_t step = 0; step < 400; ++step) {
    seen_k[models::sample_next(logits, models::GenerateOptions().top_k(2), step)]++;
    seen_p[models::sample_next(logits, models::GenerateOptions().top_p(0.85), step)]++;
  }
  EXPECT_EQ(seen_k.size(), 2u);  // only tokens 0 and 1
  EXPECT_EQ(seen_p.size(), 3u);  // 0.5 + 0.3 < 0.85: token 2 joins the nucleus
  EXPECT_GT(seen_k[0], seen_k[1]);
  EXPECT_EQ(models::sample_next(logits, models::GenerateOptions().temperature(0), 0), 0);
}

TEST(Models, WhatTheShapesCannotDoIsRefusedNamingTheFix) {
  auto c = small("llama");
  c.kv_heads = 3;
  expect_refused([&] { models::validate(c); }, "--kv-heads 3 must divide --heads 4");
  c.kv_heads = 2;
  expect_refused([&] { models::validate(c, 4); }, "tp 4 does not divide --kv-heads 2");
  c = small("gpt2");
  c.kv_heads = 2;
  expect_refused([&] { models::validate(c); }, "is for --model llama");
  c = small("llama");
  c.max_positions = 16;
  expect_refused([&] { models::validate(c); }, "--seq-len 24 is longer than the model's 16");
}
