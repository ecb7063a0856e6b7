// The planner's model kinds (gpt, gpt2, llama) against meshtrain's models:
// parameter counts, tensor-parallel splits and pipeline pieces measured on the
// built modules; activations (eager and flash attention) against hand counts;
// the --model, --kv-heads, --ffn-hidden and --attention flags; the trainer's
// memory check planning its own model.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "meshtrain/models.h"
#include "meshtrain/plan.h"
#include "meshtrain/tp.h"
#include "app/trainer/config.h"
#include "app/trainer/memory_check.h"
#include "meshtrain/util.h"
#include "config_error.h"
#include "split_args.h"

using namespace meshtrain;
using meshtrain::testing::split_args;
using namespace meshtrain::plan;

namespace {

std::string error_of(const std::function<void()>& fn) { return meshtrain::testing::config_error_of(fn); }

models::ModelConfig config(const std::string& kind, int64_t vocab, int64_t kv_heads, int64_t ffn_hidden, bool tied) {
  models::ModelConfig c;
  c.kind = kind;
  c.layers = 3;
  c.hidden = 64;
  c.heads = 4;
  c.kv_heads = kv_heads;
  c.ffn_hidden = ffn_hidden;
  c.vocab = vocab;
  c.seq_len = 16;
  c.max_positions = kind == "llama" ? 0 : 24;
  c.tie_embeddings = tied;
  return c;
}

// Shapes of every kind: GPT-2's padded vocabulary (300 -> 384 rows), Llama's
// grouped-query attention (1, 2, 4 key/value heads), SwiGLU's default 8/3 H
// (192) and a given inner size, tied and untied heads.
std::vector<models::ModelConfig> shapes() {
  return {config("gpt", 128, 0, 0, true),     config("gpt", 128, 0, 96, false), config("gpt2", 300, 0, 0, true),
          config("gpt2", 300, 0, 0, false),   config("llama", 128, 2, 0, false), config("llama", 128, 1, 96, false),
          config("llama", 100, 4, 0, true)};
}

// What one tp rank of piece `piece` holds, from the built module and the
// model's own tensor-parallel plan (models::tp_plan): column-parallel layers
// split weight and bias, row-parallel ones the weight, the embedding its rows.
int64_t measured_piece_parameters(const models::ModelConfig& c, int64_t piece, int tp) {
  models::Stage stage = models::build_stage(c, piece, piece + 1);
  const std::map<std::string, std::string> styles = models::tp_plan(c, *stage, tp, false);
  int64_t n = 0;
  for (const auto& p : stage->named_parameters()) {
    const std::string& name = p.key();
    const std::string module = name.substr(0, name.rfind('.'));
    const bool bias = name.substr(name.rfind('.') + 1) == "bias";
    const auto style = styles.find(module);
    const bool split = style != styles.end() && (tp::parse_style(style->second) != tp::Style::kRowwise || !bias);
    n += split ? p.value().numel() / tp : p.value().numel();
  }
  return n;
}

}  // namespace

TEST(PlanModels, ParameterCountsAndSplitsMatchTheBuiltModels) {
  for (const models::ModelConfig& c : shapes()) {
    models::validate(c);
    const DecoderShape s = train::decoder_shape(c);
    SCOPED_TRACE(c.kind + " vocab " + std::to_string(c.vocab) + " kv " + std::to_string(kv_heads_of(s)) + " ffn " +
                 std::to_string(ffn_hidden_of(s)) + (c.tie_embeddings ? " tied" : " untied"));
    EXPECT_EQ(parameter_count(s), models::parameter_count(c));
    EXPECT_EQ(kv_heads_of(s), models::kv_heads(c));
    EXPECT_EQ(ffn_hidden_of(s), models::ffn_hidden(c));
    EXPECT_EQ(embedding_rows(s), models::padded_vocab(c));
    // The same with the planner's own defaults (fields left 0).
    DecoderShape defaults = s;
    if (c.kv_heads == 0) defaults.kv_heads = 0;
    if (c.ffn_hidden == 0) defaults.ffn_hidden = 0;
    EXPECT_EQ(parameter_count(defaults), models::parameter_count(c));
    for (int tp = 1; tp <= 4; ++tp) {
      // tp is refused by the planner exactly when models::validate refuses it.
      const bool model_takes = error_of([&] { models::validate(c, tp); }).empty();
      EXPECT_EQ(layout_problem(s, Layout{1, 1, tp, 0}).empty(), model_takes) << "tp " << tp;
      if (!model_takes) continue;
      for (int64_t piece = 0; piece < num_pieces(s); ++piece)
        EXPECT_EQ(piece_parameter_count(s, tp, piece), measured_piece_parameters(c, piece, tp))
            << "tp " << tp << " piece " << piece;
    }
  }
  EXPECT_EQ(embedding_rows(train::decoder_shape(config("gpt2", 300, 0, 0, true))), 384);
  EXPECT_EQ(ffn_hidden_of(train::decoder_shape(config("llama", 128, 2, 0, false))), 192);
}

TEST(PlanModels, LlamaEightBParameterCount) {
  // Llama 3 8B: 32 layers, hidden 4,096, 32 heads, 8 key/value heads, SwiGLU
  // 14,336, vocabulary 128,256, untied: 8,030,261,248 parameters (Meta's 8.03 B).
  const PlanInput in = parse_plan_args(
      split_args("--model llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn-hidden 14336 --vocab 128256 "
                 "--seq-len 8192 --devices 64 --device-memory 80GB"));
  ASSERT_TRUE(in.shape);
  EXPECT_FALSE(in.shape->tie_embeddings);
  EXPECT_EQ(in.params, 8'030'261'248);
  // Per block: q, o 2 * 4096^2 + k, v 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096 norms.
  EXPECT_EQ(block_parameter_count(*in.shape, 1), 218'112'000);
  EXPECT_EQ(largest_tensor(*in.shape).numel(), 128'256LL * 4096);
}

TEST(PlanModels, LlamaLayerActivationsByHand) {
  // Llama, hidden 64, 4 heads, 2 key/value heads, SwiGLU 176, seq-len 32,
  // micro-batch 2: s*b*h = 4,096. bf16 (2 bytes a value), tp 1:
  //   2 RMSNorms    2 * (4 fp32 input + 2 normalized + 2 output) * 4,096     =  65,536
  //   eager         2 * (q, k, v repeated, output 4 * 4,096 + softmax 4*32*32*2) =  49,152
  //   SwiGLU        2 * 4 * 32*2*176                                         =  90,112
  //   flash         2 * (q, output 2 + k, v at 2 of 4 heads 1) * 4,096
  //                 + fp32 log-sum-exp 4 * 4*32*2                           =  25,600
  DecoderShape s;
  s.kind = ModelKind::kLlama, s.layers = 1, s.hidden = 64, s.heads = 4, s.kv_heads = 2, s.ffn_hidden = 176;
  s.vocab = 128, s.seq_len = 32;
  EXPECT_EQ(layer_activation_bytes(s, 2, 1, Precision::kBf16Mixed, Attention::kEager), 65'536 + 49'152 + 90'112);
  EXPECT_EQ(layer_activation_bytes(s, 2, 1, Precision::kBf16Mixed, Attention::kFlash), 65'536 + 25'600 + 90'112);
  // tp 2 splits all but the norms: 65,536 + (49,152 + 90,112) / 2.
  EXPECT_EQ(layer_activation_bytes(s, 2, 2, Precision::kBf16Mixed, Attention::kEager), 65'536 + 69'632);
  // fp32: the norms' input is 4 bytes either way: 2 * (4 + 4 + 4) * 4,096; the rest doubles.
  EXPECT_EQ(layer_activation_bytes(s, 2, 1, Precision::kFp32, Attention::kEager),
            98'304 + 2 * (49'152 + 90'112));
}

TEST(PlanModels, GptFlashAttentionDropsKorthikantisScoreTerms) {
  // Korthikanti et al.: s*b*h*(34 + 5*a*s/h) in 16-bit; flash keeps the 34
  // and adds the fp32 log-sum-exp, 4 * a*s*b bytes.
  DecoderShape s;
  s.layers = 1, s.hidden = 1024, s.heads = 16, s.vocab = 1000, s.seq_len = 2048;
  const int64_t sbh = 2048LL * 2 * 1024;
  EXPECT_EQ(layer_activation_bytes(s, 2, 1, Precision::kBf16Mixed, Attention::kEager), sbh * (34 + 160));
  EXPECT_EQ(layer_activation_bytes(s, 2, 1, Precision::kBf16Mixed, Attention::kFlash), sbh * 34 + 4 * 16 * 2048 * 2);
  // tp 4: 10 + 24/4 per s*b*h; the log-sum-exp of 4 heads per rank.
  EXPECT_EQ(layer_activation_bytes(s, 2, 4, Precision::kBf16Mixed, Attention::kFlash), sbh * 16 + 4 * 4 * 2048 * 2);
}

TEST(PlanModels, EagerAttentionGrowsQuadraticallyFlashLinearlyInT) {
  for (ModelKind kind : {ModelKind::kGpt, ModelKind::kGpt2, ModelKind::kLlama}) {
    DecoderShape s;
    s.kind = kind, s.layers = 2, s.hidden = 256, s.heads = 8, s.kv_heads = kind == ModelKind::kLlama ? 2 : 0;
    s.vocab = 512, s.seq_len = 1024;
    DecoderShape twice = s;
    twice.seq_len = 2048;
    for (int tp : {1, 2}) {
      SCOPED_TRACE(model_kind_name(kind) + " tp " + std::to_string(tp));
      auto bytes = [&](const DecoderShape& shape, Attention a) {
        return layer_activation_bytes(shape, 1, tp, Precision::kBf16Mixed, a);
      };
      // Flash: every term is linear in T.
      EXPECT_EQ(bytes(twice, Attention::kFlash), 2 * bytes(s, Attention::kFlash));
      // Eager: L*T + Q*T^2, so doubling T leaves 2*Q*T^2 beyond twice the bytes:
      // the softmax, 2 bytes per score (Llama), Korthikanti's 5 (GPT's, with dropout).
      const int64_t per_score = kind == ModelKind::kLlama ? 2 : 5;
      const int64_t scores = s.heads * s.seq_len * s.seq_len / tp;
      EXPECT_EQ(bytes(twice, Attention::kEager) - 2 * bytes(s, Attention::kEager), 2 * per_score * scores);
      EXPECT_GT(bytes(s, Attention::kEager), bytes(s, Attention::kFlash));
    }
  }
}

TEST(PlanModels, ParsesTheModelFlags) {
  const std::string cluster = " --devices 8 --device-memory 80GB";
  PlanInput in = parse_plan_args(split_args("--model llama --layers 2 --hidden 64 --heads 4 --vocab 128 --seq-len 32" +
                                            cluster + " --attention flash"));
  ASSERT_TRUE(in.shape);
  EXPECT_EQ(in.shape->kind, ModelKind::kLlama);
  EXPECT_FALSE(in.shape->tie_embeddings);  // llama's default, as the trainer's
  EXPECT_EQ(kv_heads_of(*in.shape), 4);
  EXPECT_EQ(ffn_hidden_of(*in.shape), 192);  // 2 * 256 / 3 = 170, up to a multiple of 32
  EXPECT_EQ(in.attention, Attention::kFlash);
  in = parse_plan_args(split_args("--layers 2 --hidden 64 --heads 4 --vocab 128 --seq-len 32 --model=gpt2 --untied "
                                  "--ffn-hidden 100 --max-positions 64" + cluster));
  EXPECT_EQ(in.shape->kind, ModelKind::kGpt2);
  EXPECT_FALSE(in.shape->tie_embeddings);
  EXPECT_EQ(in.attention, Attention::kEager);
  // 128 rows (vocabulary padded), 64 positions, fc1/fc2 of inner size 100.
  EXPECT_EQ(in.params, 128 * 64 * 2 + 64 * 64 + 2 * (4 * 64 + 4 * (64 * 64 + 64) + 64 * 100 + 100 + 100 * 64 + 64) +
                           2 * 64);
  in = parse_plan_args(split_args("--model llama --tied --layers 2 --hidden 64 --heads 4 --kv-heads 1 --vocab 128 "
                                  "--seq-len 32" + cluster));
  EXPECT_TRUE(in.shape->tie_embeddings);

  const std::string shape = "--layers 2 --hidden 64 --heads 4 --vocab 128 --seq-len 32";
  const std::pair<std::string, std::string> refused[] = {
      {shape + " --kv-heads 2", "--kv-heads 2 (grouped-query attention) is for --model llama"},
      {"--model llama " + shape + " --kv-heads 3", "--kv-heads 3 must divide --heads 4"},
      {"--model llama --layers 2 --hidden 96 --heads 32 --vocab 128 --seq-len 32",
       "rotary embeddings need an even head dimension"},
      {"--model mlp " + shape, "for the MLP give its parameter count, --params COUNT"},
      {"--model bert " + shape, "--model 'bert': expected gpt, gpt2 or llama"},
      {"--model llama --params 7B", "give either --params or the model's shape, not both (got --params and --model)"},
      {"--model llama --layers 2", "--hidden is missing"},
      {shape + " --attention sdpa", "--attention 'sdpa': expected eager"},
      {shape + " --max-positions 16", "--seq-len 32 is longer than --max-positions 16"},
  };
  for (const auto& [args, words] : refused) {
    const std::string message = error_of([&] { parse_plan_args(split_args(args + cluster)); });
    EXPECT_NE(message.find(words), std::string::npos) << args << "\nmessage: " << message;
  }
  // tp must divide the key/value heads too: 4 heads over 2 key/value heads allow tp 1, 2.
  in = parse_plan_args(split_args("--model llama " + shape + " --kv-heads 2" + cluster));
  EXPECT_EQ(layout_problem(*in.shape, Layout{2, 1, 4, 0}), "tp 4 does not divide --kv-heads 2; choose tp in {1, 2}");
  for (const Layout& l : candidate_layouts(in)) EXPECT_LE(l.tp, 2);
}

TEST(PlanModels, FlashAttentionShrinksTheRecommendedLayoutsActivations) {
  const std::string args =
      "--model llama --layers 4 --hidden 1024 --heads 16 --kv-heads 4 --vocab 32000 --seq-len 4096 "
      "--precision bf16-mixed --devices 8 --device-memory 80GB";
  for (const std::string attention : {"eager", "flash"}) {
    const Plan plan = make_plan(parse_plan_args(split_args(args + " --attention " + attention)));
    ASSERT_TRUE(plan.recommendation);
    const Recommendation& r = *plan.recommendation;
    EXPECT_GT(r.eager_activation_bytes, r.flash_activation_bytes);
    const int64_t planned = attention == "eager" ? r.eager_activation_bytes : r.flash_activation_bytes;
    EXPECT_EQ(planned, r.estimate.memory.activations);
    const std::string text = format_plan_text(plan);
    EXPECT_NE(text.find("the T x T softmax kept"), std::string::npos) << text;
    EXPECT_NE(text.find("linear in T" + std::string(attention == "flash" ? " (planned)" : "") + ": saves "),
              std::string::npos)
        << text;
  }
}

TEST(MemoryCheck, PlansTheTrainersOwnModel) {
  // The trainer's memory check gives the planner its model: a Llama is planned
  // as a Llama (grouped-query attention, SwiGLU, untied head), not as a GPT.
  const train::TrainConfig c = train::resolve(
      train::parse_train_args(split_args("--model llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 128 "
                                         "--seq-len 32 --tp 2")),
      4);
  const PlanInput in = train::planner_input(c, 4, int64_t{1} << 40);
  ASSERT_TRUE(in.shape);
  EXPECT_EQ(in.shape->kind, ModelKind::kLlama);
  EXPECT_EQ(in.shape->kv_heads, 2);
  EXPECT_FALSE(in.shape->tie_embeddings);
  EXPECT_EQ(in.attention, Attention::kEager);
  EXPECT_EQ(parameter_count(*in.shape), models::parameter_count(c.model));
  EXPECT_EQ(in.params, models::parameter_count(c.model));
  EXPECT_EQ(train::estimated_rank_bytes(c), estimate_layout(in, Layout{2, 1, 2, 0}).memory.total());
  models::ModelConfig mlp;
  mlp.kind = "mlp";
  EXPECT_NE(error_of([&] { train::decoder_shape(mlp); }).find("plan it with --params"), std::string::npos);
}
