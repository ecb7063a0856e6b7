// The command `meshtrain plan` prints after its recommendation, read back by
// meshrun's and the trainer's own parsers: it must resolve for the planned
// world size and run exactly the recommended layout, batch and model.
#include <gtest/gtest.h>

#include <sstream>

#include "app/launch/launcher.h"
#include "meshtrain/models.h"
#include "plan/command.h"
#include "meshtrain/plan.h"
#include "app/trainer/config.h"
#include "app/trainer/memory_check.h"
#include "meshtrain/util.h"
#include "split_args.h"

using namespace meshtrain;
using meshtrain::testing::split_args;
using namespace meshtrain::plan;

namespace {

// The printed command as the shell would run it on node `node_rank`.
std::vector<std::string> shell_words(const std::string& line, int node_rank) {
  std::vector<std::string> words = split_args(line);
  for (std::string& w : words) {
    if (w == "$NODE_RANK") w = std::to_string(node_rank);
    if (w == "$MASTER_ADDR") w = "10.0.0.1";
  }
  return words;
}

// The words after `meshtrain`, parsed and resolved by the trainer: the
// recommended layout, batch and model.
void check_trainer_config(const PlanInput& in, const Plan& plan, const std::vector<std::string>& command) {
  const std::vector<std::string> trainer(command.begin() + 1, command.end());
  EXPECT_EQ(trainer, trainer_args(in, plan.recommendation->estimate));
  const train::TrainConfig c = train::resolve(train::parse_train_args(trainer), in.devices);
  const Estimate& e = plan.recommendation->estimate;
  EXPECT_EQ(c.dp, e.layout.dp);
  EXPECT_EQ(c.pp, e.layout.pp);
  EXPECT_EQ(c.tp, e.layout.tp);
  EXPECT_EQ(c.zero, e.layout.zero);
  EXPECT_EQ(c.micro_batch, in.micro_batch);
  EXPECT_EQ(c.global_batch, global_batch_of(in));
  EXPECT_EQ(train::accumulation_steps(c), e.microbatches);
  if (c.pp > 1) {
    EXPECT_EQ(c.schedule, "1f1b");
    EXPECT_EQ(c.microbatches, e.microbatches);
  }
  EXPECT_EQ(c.precision, precision_name(in.precision));
  EXPECT_EQ(c.activation_checkpointing, in.activation_checkpointing ? "blocks" : "none");
  // The trainer builds the planned model: its shape with every default applied.
  const DecoderShape planned = *in.shape, built = train::decoder_shape(c.model);
  EXPECT_EQ(built.kind, planned.kind);
  EXPECT_EQ(built.layers, planned.layers);
  EXPECT_EQ(built.hidden, planned.hidden);
  EXPECT_EQ(built.heads, planned.heads);
  EXPECT_EQ(built.kv_heads, kv_heads_of(planned));
  EXPECT_EQ(built.ffn_hidden, ffn_hidden_of(planned));
  EXPECT_EQ(built.vocab, planned.vocab);
  EXPECT_EQ(built.seq_len, planned.seq_len);
  EXPECT_EQ(built.max_positions, max_positions_of(planned));
  EXPECT_EQ(built.tie_embeddings, planned.tie_embeddings);
  EXPECT_EQ(models::parameter_count(c.model), in.params);
  // And the trainer's own memory check estimates what the planner did.
  EXPECT_EQ(train::estimated_rank_bytes(c), estimate_layout(train::planner_input(c, in.devices, in.device_memory),
                                                            e.layout).memory.total());
}

// The printed line through meshrun's parser (on node 1 of several), then the trainer's.
void run_the_printed_command(const PlanInput& in, const Plan& plan) {
  // The text report prints the same line.
  EXPECT_NE(format_plan_text(plan).find("\n  " + *plan.command + "\n"), std::string::npos);

  const std::vector<std::string> words = shell_words(*plan.command, devices_per_node_of(in) < in.devices ? 1 : 0);
  ASSERT_EQ(words.front(), "meshrun");
  const launch::LaunchOptions launch = launch::parse_launch_args({words.begin() + 1, words.end()});
  EXPECT_EQ(launch.nproc_per_node * launch.nnodes, in.devices);
  EXPECT_EQ(launch.nproc_per_node, devices_per_node_of(in));
  ASSERT_FALSE(launch.command.empty());
  ASSERT_EQ(launch.command.front(), "meshtrain");
  check_trainer_config(in, plan, launch.command);
}

// Plans `args`, reads the printed command back with meshrun's and the
// trainer's parsers, resolves it for the planned world size and checks it
// runs the recommendation. Returns the recommended layout.
Layout expect_command_runs_the_plan(const std::string& args) {
  SCOPED_TRACE(args);
  const PlanInput in = parse_plan_args(split_args(args));
  const Plan plan = make_plan(in);
  if (!plan.recommendation || !plan.command) {
    ADD_FAILURE() << "no command: " << plan.command_note << plan.no_fit_message;
    return Layout{};
  }
  run_the_printed_command(in, plan);
  return plan.recommendation->estimate.layout;
}

}  // namespace

TEST(PlanCommand, ParsesBackAndResolvesToTheRecommendation) {
  const std::string cluster = " --precision bf16-mixed --devices 64 --devices-per-node 8 --device-memory 80GB";
  // The Llama 3 8B shape the docs use: several nodes, tensor parallel inside a node.
  expect_command_runs_the_plan(
      "--model llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn-hidden 14336 --vocab 128256 "
      "--seq-len 8192 --global-batch 512 --micro-batch 1" + cluster);
  // A GPT on one node, fp32, SGD with momentum and checkpointing.
  expect_command_runs_the_plan(
      "--layers 4 --hidden 256 --heads 8 --vocab 512 --seq-len 128 --micro-batch 2 --global-batch 32 "
      "--optimizer sgd --momentum 0.9 --activation-checkpointing blocks --devices 4 --device-memory 1GB");
  // GPT-2 untied with a longer position table (the vocabulary padded to 50,304
  // rows), on two nodes of 4; a tied Llama planned with flash attention.
  expect_command_runs_the_plan(
      "--model gpt2 --untied --layers 12 --hidden 768 --heads 12 --vocab 50257 --seq-len 512 --max-positions 1024 "
      "--micro-batch 4 --global-batch 64 --devices 8 --devices-per-node 4 --device-memory 6GB --precision bf16-mixed");
  expect_command_runs_the_plan(
      "--model llama --tied --layers 8 --hidden 1024 --heads 16 --kv-heads 4 --vocab 32000 --seq-len 2048 "
      "--global-batch 16 --devices 8 --device-memory 8GB --precision bf16-mixed --attention flash");
  // A pipeline: this small Llama's shortest estimated step is with 8 stages.
  const Layout piped = expect_command_runs_the_plan(
      "--model llama --layers 8 --hidden 64 --heads 2 --vocab 128 --seq-len 32 --global-batch 4 --devices 8 "
      "--device-memory 1GB");
  EXPECT_GT(piped.pp, 1);
}

TEST(PlanCommand, PipelineCommandsNameTheScheduleAndMicrobatches) {
  // A pipeline layout given by hand: dp 2 x pp 4, 16 micro-batches of 1 per dp rank.
  const PlanInput in = parse_plan_args(split_args(
      "--layers 16 --hidden 2048 --heads 16 --vocab 50304 --seq-len 1024 --micro-batch 1 --global-batch 32 "
      "--precision bf16-mixed --devices 8 --device-memory 80GB"));
  Estimate e;
  e.layout = Layout{2, 4, 1, 1};
  e.microbatches = 16;
  const std::vector<std::string> args = trainer_args(in, e);
  const std::string line = train_command(in, e);
  EXPECT_NE(line.find("meshrun --nproc-per-node 8 -- meshtrain --model gpt --layers 16 --hidden 2048 --heads 16 "
                      "--vocab 50304 --seq-len 1024 --dp 2 --pp 4 --tp 1 --zero 1 --schedule 1f1b --microbatches 16 "
                      "--attention eager --precision bf16-mixed --global-batch 32 --micro-batch 1"),
            std::string::npos)
      << line;
  const train::TrainConfig c = train::resolve(train::parse_train_args(args), 8);
  EXPECT_EQ(c.microbatches, 16);
  EXPECT_EQ(c.micro_batch, 1);
}

TEST(PlanCommand, MultiNodeCommandsLeaveTheNodeRankAndAddressToTheShell) {
  PlanInput in = parse_plan_args(split_args("--layers 2 --hidden 64 --heads 4 --vocab 128 --seq-len 32 --devices 16 "
                                            "--devices-per-node 8 --device-memory 80GB"));
  EXPECT_EQ(launcher_command(in),
            "meshrun --nproc-per-node 8 --nnodes 2 --node-rank $NODE_RANK --master-addr $MASTER_ADDR "
            "--master-port 29500 --");
  const Plan plan = make_plan(in);
  EXPECT_NE(plan.command_note.find("on each of the 2 nodes with NODE_RANK 0 to 1"), std::string::npos)
      << plan.command_note;
  in.devices_per_node = 16;
  EXPECT_EQ(launcher_command(in), "meshrun --nproc-per-node 16 --");
}

TEST(PlanCommand, NoCommandWithoutAShapeOrForFp16) {
  const Plan params = make_plan(parse_plan_args(split_args("--params 1B --devices 8 --device-memory 80GB")));
  ASSERT_TRUE(params.recommendation);
  EXPECT_FALSE(params.command);
  EXPECT_NE(params.command_note.find("no command: with --params the planner knows no shape"), std::string::npos)
      << params.command_note;
  EXPECT_NE(format_plan_text(params).find("no command: with --params"), std::string::npos);
  std::ostringstream out;
  EXPECT_EQ(run_plan(split_args("--params 1B --devices 8 --device-memory 80GB --json"), out), 0);
  const json::Value v = json::parse(out.str());
  EXPECT_EQ(v["command"].type, json::Value::Type::kNull);
  EXPECT_NE(v["command_note"].str().find("give the shape"), std::string::npos);

  const Plan fp16 = make_plan(parse_plan_args(
      split_args("--layers 2 --hidden 64 --heads 4 --vocab 128 --seq-len 32 --precision fp16-mixed --devices 8 "
                 "--device-memory 80GB")));
  EXPECT_FALSE(fp16.command);
  EXPECT_NE(fp16.command_note.find("plan with --precision bf16-mixed"), std::string::npos) << fp16.command_note;
}

TEST(PlanCommand, JsonCarriesTheCommand) {
  const std::string args =
      "--model llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 128 --seq-len 32 --devices 4 "
      "--device-memory 1GB --json";
  const Plan plan = make_plan(parse_plan_args(split_args(args)));
  ASSERT_TRUE(plan.command);
  std::ostringstream out;
  EXPECT_EQ(run_plan(split_args(args), out), 0);
  const json::Value v = json::parse(out.str());
  EXPECT_EQ(v["command"].str(), *plan.command);
  EXPECT_EQ(v["input"]["model"]["kind"].str(), "llama");
  EXPECT_EQ(v["input"]["model"]["kv_heads"].num(), 2);
  EXPECT_EQ(v["input"]["attention"].str(), "eager");
  EXPECT_GT(v["recommendation"]["eager_activation_bytes"].num(), v["recommendation"]["flash_activation_bytes"].num());
}
