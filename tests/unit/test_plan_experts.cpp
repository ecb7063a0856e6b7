// The planner's mixtures of experts (--experts, --top-k, --max-ep): the
// parameter count equals the trainer's model's, the FLOPs count the active
// experts, the experts held apart under ep are whole on each replica while
// ZeRO shards the rest, the all-to-all bytes by hand, ep candidates only with
// --max-ep, and the command passes --experts, --top-k and --ep.
#include <gtest/gtest.h>

#include "config_error.h"
#include "meshtrain/models.h"
#include "plan/command.h"
#include "meshtrain/plan.h"
#include "app/trainer/config.h"
#include "app/trainer/memory_check.h"

namespace meshtrain {
namespace {

models::ModelConfig moe_model(const std::string& kind) {
  models::ModelConfig m;
  m.kind = kind;
  m.layers = 3;
  m.hidden = 64;
  m.heads = 4;
  m.vocab = 100;
  m.seq_len = 32;
  m.experts = 8;
  m.top_k = 2;
  m.tie_embeddings = kind != "llama";
  return m;
}

plan::PlanInput input(const plan::DecoderShape& s, int devices, int max_ep) {
  plan::PlanInput in;
  in.shape = s;
  in.params = plan::parameter_count(s);
  in.devices = devices;
  in.device_memory = int64_t{1} << 40;
  in.micro_batch = 2;
  in.global_batch = 2 * devices;
  in.max_ep = max_ep;
  return in;
}

TEST(PlanExperts, CountsEqualTheModelsAndFlopsCountTheActiveExperts) {
  for (const std::string kind : {"gpt", "llama"}) {
    const models::ModelConfig m = moe_model(kind);
    const plan::DecoderShape s = train::decoder_shape(m);
    EXPECT_EQ(plan::parameter_count(s), models::parameter_count(m)) << kind;
    // Each block's experts: E x (2 or 3) H F; a token computes with top_k of them.
    const int64_t F = models::ffn_hidden(m), per_expert = (kind == "llama" ? 3 : 2) * 64 * F;
    EXPECT_EQ(plan::expert_parameter_count(s), 8 * per_expert) << kind;
    EXPECT_EQ(plan::block_parameter_count(s, 1) - plan::block_active_parameter_count(s, 1), 6 * per_expert) << kind;
    EXPECT_EQ(models::parameter_count(m) - models::active_parameter_count(m), 3 * 6 * per_expert) << kind;
  }
}

TEST(PlanExperts, ExpertsWholeOnEachReplicaTheRestShardedAndAllToAllBytesByHand) {
  const plan::DecoderShape s = train::decoder_shape(moe_model("llama"));
  const int64_t experts = 3 * plan::expert_parameter_count(s), rest = plan::parameter_count(s) - experts;
  // dp 4, ep 2, ZeRO-1: the rest's Adam state sharded 4 ways; each rank's 4 experts (of 8) whole,
  // their Adam state sharded over their 2 replicas.
  const plan::ModelStateBytes m = plan::predict_rank_state_bytes(s, plan::Layout{4, 1, 1, 1, 1, 2}, 0, 0, 0);
  EXPECT_EQ(m.parameters, 4 * (rest + experts / 2));
  EXPECT_EQ(m.optimizer, 8 * ((rest + 3) / 4 + (experts / 2 + 1) / 2));  // shard_of: the first ranks one more
  // ZeRO-3: the rest sharded 4 ways, the experts as ZeRO-2 (weights whole, gradients and state sharded).
  const plan::ModelStateBytes z3 = plan::predict_rank_state_bytes(s, plan::Layout{4, 1, 1, 3, 1, 2}, 0, 0, 0);
  EXPECT_EQ(z3.parameters, 4 * ((rest + 3) / 4 + experts / 2));
  EXPECT_EQ(z3.gradients, 4 * ((rest + 3) / 4 + (experts / 2 + 1) / 2));
  EXPECT_EQ(plan::stage_expert_parameter_count(s, plan::Layout{4, 1, 1, 1, 1, 2}, 0), experts / 2);
  // Per block and micro-batch of 2 x 32 tokens, top-2, ep 4: 3/4 of the 128 routes leave the rank,
  // dispatch + combine forward and backward of H = 64 fp32 values, and the routes' ids.
  const double routes = 2 * 32 * 2 * 3.0 / 4;
  EXPECT_EQ(plan::ep_bytes_per_block(s, 2, 4, plan::Precision::kFp32, false),
            std::llround(4 * routes * 64 * 4 + routes * 8));
  EXPECT_EQ(plan::ep_bytes_per_block(s, 2, 1, plan::Precision::kFp32, false), 0);
  const plan::Estimate e = plan::estimate_layout(input(s, 4, 4), plan::Layout{4, 1, 1, 0, 1, 4});
  EXPECT_EQ(e.comm.ep, 3 * plan::ep_bytes_per_block(s, 2, 4, plan::Precision::kFp32, false));
  EXPECT_GT(e.seconds.ep, 0);
}

TEST(PlanExperts, EpCandidatesOnlyWithMaxEpAndTheCommandPassesThem) {
  const plan::DecoderShape s = train::decoder_shape(moe_model("gpt"));
  auto eps = [&](int max_ep) {
    std::set<int> out;
    for (const plan::Layout& l : plan::candidate_layouts(input(s, 4, max_ep))) out.insert(l.ep);
    return out;
  };
  EXPECT_EQ(eps(1), std::set<int>({1}));
  EXPECT_EQ(eps(4), std::set<int>({1, 2, 4}));  // dividing the 8 experts and dp
  plan::Estimate e = plan::estimate_layout(input(s, 4, 4), plan::Layout{4, 1, 1, 0, 1, 2});
  const std::string command = plan::train_command(input(s, 4, 4), e);
  for (const char* flag : {"--experts 8", "--top-k 2", "--ep 2"})
    EXPECT_NE(command.find(flag), std::string::npos) << command;
  EXPECT_EQ(command.find("--aux-loss-scope"), std::string::npos) << command;  // no pipeline: the default
  EXPECT_NE(plan::layout_problem(s, plan::Layout{4, 1, 1, 0, 1, 3}).find("ep 3"), std::string::npos);
  plan::DecoderShape dense = s;
  dense.experts = 0;
  EXPECT_NE(testing::config_error_of([&] { plan::check_plan_input(input(dense, 4, 2)); }).find("--max-ep 2"),
            std::string::npos);
}

// The planned pipeline runs 1F1B, whose order the default (global-batch)
// balance loss refuses: the command asks for the per-micro-batch loss, and
// the trainer takes it.
TEST(PlanExperts, APipelinedCommandTrainsUnderThePlannedSchedule) {
  const plan::DecoderShape s = train::decoder_shape(moe_model("gpt"));
  const plan::Estimate e = plan::estimate_layout(input(s, 4, 1), plan::Layout{2, 2, 1, 0, 1, 1});
  const std::vector<std::string> args = plan::trainer_args(input(s, 4, 1), e);
  std::string command;
  for (const std::string& a : args) command += a + " ";
  EXPECT_NE(command.find("--schedule 1f1b"), std::string::npos) << command;
  EXPECT_NE(command.find("--aux-loss-scope micro"), std::string::npos) << command;
  const train::TrainConfig c = train::resolve(train::parse_train_args(args), 4);
  EXPECT_EQ(c.schedule, "1f1b");
  EXPECT_EQ(c.aux_loss_scope, "micro");
}

}  // namespace
}  // namespace meshtrain
