// The planner (meshtrain plan): pure arithmetic, checked against the ZeRO
// paper's numbers, the article's embedding example and hand counts.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "meshtrain/plan.h"
#include "plan/time.h"
#include "plan/units.h"
#include "meshtrain/util.h"
#include "split_args.h"

using namespace meshtrain;
using meshtrain::testing::split_args;
using namespace meshtrain::plan;

namespace {

// The message of the ConfigError fn throws ("" when it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// A tiny GPT whose parameters are counted by hand below.
DecoderShape tiny_gpt() {
  DecoderShape s;
  s.layers = 2;
  s.hidden = 8;
  s.heads = 2;
  s.vocab = 10;
  s.seq_len = 4;
  return s;
}

}  // namespace

TEST(Plan, ZeroPaperModelStatePerDevice) {
  // ZeRO paper, Figure 1: psi = 7.5B, N = 64, mixed-precision Adam (K = 12).
  const int64_t psi = 7'500'000'000;
  const StateBytesPerParam bytes = state_bytes_per_param(Precision::kFp16Mixed, OptimizerKind::kAdam, false);
  EXPECT_EQ(bytes.total(), 16);
  EXPECT_EQ(bytes.optimizer, 12);
  const double expected_gb[] = {120.0, 31.4, 16.6, 1.9};  // the paper's rounding
  for (int zero = 0; zero <= 3; ++zero) {
    const double gb = zero_model_state(psi, bytes, zero, 64).total() / 1e9;
    EXPECT_NEAR(gb, expected_gb[zero], 0.05) << "ZeRO stage " << zero;
  }
  // Exactly: (2+2)psi + 12psi/64, 2psi + 14psi/64, 16psi/64.
  EXPECT_EQ(zero_model_state(psi, bytes, 1, 64).total(), 4 * psi + 12 * psi / 64);
  EXPECT_EQ(zero_model_state(psi, bytes, 2, 64).total(), 2 * psi + 14 * psi / 64);
  EXPECT_EQ(zero_model_state(psi, bytes, 3, 64).total(), 16 * psi / 64);
}

TEST(Plan, ZeroPaperNumbersThroughThePlanner) {
  const PlanInput in = parse_plan_args(
      split_args("--params 7.5B --devices 64 --devices-per-node 8 --device-memory 32GB --precision fp16-mixed"));
  EXPECT_EQ(in.params, 7'500'000'000);
  const double expected_gb[] = {120.0, 31.4, 16.6, 1.9};
  for (int zero = 0; zero <= 3; ++zero) {
    const MemoryBytes m = estimate_layout(in, Layout{64, 1, 1, zero}).memory;
    EXPECT_NEAR((m.parameters + m.gradients + m.optimizer) / 1e9, expected_gb[zero], 0.05) << "ZeRO stage " << zero;
  }
  const Plan plan = make_plan(in);
  ASSERT_TRUE(plan.recommendation);
  EXPECT_TRUE(plan.recommendation->estimate.fits);
  EXPECT_EQ(plan.scenario.number, 2);  // 120 GB per device with DDP does not fit 28.8 GB
}

TEST(Plan, ArticleEmbeddingIsScenarioThree) {
  // The article: a 128,000-token vocabulary, hidden 8,192: 1.05B parameters,
  // 16 bytes each with fp32 Adam = 16.8 GB, more than a 16 GB device.
  DecoderShape s;
  s.layers = 1, s.hidden = 8192, s.heads = 64, s.vocab = 128000, s.seq_len = 2048;
  const TensorShape largest = largest_tensor(s);
  EXPECT_EQ(largest.numel(), 1'048'576'000);
  EXPECT_EQ(largest.rows, 128000);
  EXPECT_EQ(state_bytes_per_param(Precision::kFp32, OptimizerKind::kAdam, false).total(), 16);
  EXPECT_NEAR(largest.numel() * 16 / 1e9, 16.8, 0.05);

  const PlanInput in = parse_plan_args(
      split_args("--layers 1 --hidden 8192 --heads 64 --vocab 128000 --seq-len 2048 --devices 8 --device-memory 16GB"));
  const Scenario scenario = classify_scenario(in);
  EXPECT_EQ(scenario.number, 3);
  EXPECT_NE(scenario.reason.find("128,000 x 8,192 embedding"), std::string::npos) << scenario.reason;
  EXPECT_NE(scenario.reason.find("16.8 GB"), std::string::npos) << scenario.reason;
  EXPECT_NE(scenario.reason.find("16 GB device"), std::string::npos) << scenario.reason;
  EXPECT_NE(scenario.reason.find("tensor parallel"), std::string::npos) << scenario.reason;

  // On 80 GB devices the same tensor fits: not scenario 3.
  PlanInput big = in;
  big.device_memory = 80'000'000'000;
  EXPECT_NE(classify_scenario(big).number, 3);
}

TEST(Plan, GptParameterCountByHand) {
  // layers 2, hidden 8, heads 2, vocab 10, seq-len 4:
  //   token embedding   10 * 8                      =    80
  //   position          4 * 8                       =    32
  //   per block: 2 LayerNorms 2 * 2 * 8             =    32
  //              q, k, v, proj 4 * (8*8 + 8)        =   288
  //              fc1 8*32 + 32                      =   288
  //              fc2 32*8 + 8                       =   264
  //              block                              =   872, x 2 = 1744
  //   final LayerNorm 2 * 8                         =    16
  //   tied: 80 + 32 + 1744 + 16                     =  1872; untied + 10*8 = 1952
  DecoderShape s = tiny_gpt();
  EXPECT_EQ(block_parameter_count(s, 1), 872);
  EXPECT_EQ(parameter_count(s), 1872);
  s.tie_embeddings = false;
  EXPECT_EQ(parameter_count(s), 1952);
}

TEST(Plan, StageParametersUnderPipelineAndTensorParallel) {
  const DecoderShape s = tiny_gpt();
  // tp = 2, one block: LayerNorms 32 (replicated) + q,k,v 3 * (64/2 + 8/2) = 108
  //   + proj 64/2 + 8 (bias replicated) = 40 + fc1 256/2 + 32/2 = 144 + fc2 256/2 + 8 = 136  -> 460
  EXPECT_EQ(block_parameter_count(s, 2), 460);
  // Pieces and the trainer's balancing costs: embeddings 80 + 32 = 112, two
  // blocks of 872, the tied head 16 (+ 80 for the weight it multiplies by).
  EXPECT_EQ(piece_costs(s), (std::vector<int64_t>{112, 872, 872, 96}));
  // pp = 2: [embed, block | block, head] has the least largest stage (984 vs
  // 1840 for [embed | ...] and 1856 for [... | head]).
  EXPECT_EQ(stage_bounds(s, 2), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(stage_parameter_count(s, 2, 1, 0), 984);
  // The last stage's tied head holds no weight of its own: 872 + 16; it
  // receives a copy every step (80 values), counted as a buffer.
  EXPECT_EQ(stage_parameter_count(s, 2, 1, 1), 888);
  EXPECT_EQ(tied_weight_copy_count(s, 2, 1, 1), 80);
  EXPECT_EQ(tied_weight_copy_count(s, 2, 1, 0), 0);
  EXPECT_EQ(stage_parameter_count(s, 2, 1, 0) + stage_parameter_count(s, 2, 1, 1), parameter_count(s));
  // pp = 3: [embed | block | block, head] (largest 968) beats [embed, block | block | head] (984).
  EXPECT_EQ(stage_bounds(s, 3), (std::vector<int64_t>{0, 1, 2, 4}));
  EXPECT_EQ(blocks_on_stage(s, 3, 0), 0);
  EXPECT_EQ(blocks_on_stage(s, 3, 1), 1);
  EXPECT_EQ(blocks_on_stage(s, 3, 2), 1);
  // pp = 1 holds the whole model, the tied head without a copy.
  EXPECT_EQ(stage_parameter_count(s, 1, 1, 0), parameter_count(s));
  EXPECT_EQ(tied_weight_copy_count(s, 1, 1, 0), 0);
  // pp = 2, tp = 2, stage 0: 460 + vocab 10/2 * 8 = 40 + positions 32 = 532.
  EXPECT_EQ(stage_parameter_count(s, 2, 2, 0), 532);
  // An untied head owns its [V/tp, H] weight wherever it is.
  DecoderShape untied = s;
  untied.tie_embeddings = false;
  EXPECT_EQ(stage_parameter_count(untied, 2, 1, 1), 872 + 16 + 80);
  EXPECT_EQ(tied_weight_copy_count(untied, 2, 1, 1), 0);
}

TEST(Plan, PredictedRankStateBytesFp32Adam) {
  const DecoderShape s = tiny_gpt();
  // dp 2, pp 2, tp 2, ZeRO-1, stage 0: psi = 532; parameters 4 * 532, gradients
  // 4 * 532, Adam's two moments 8 bytes on this rank's 266.
  ModelStateBytes m = predict_rank_state_bytes(s, Layout{2, 2, 2, 1}, 0, 1);
  EXPECT_EQ(m.parameters, 2128);
  EXPECT_EQ(m.gradients, 2128);
  EXPECT_EQ(m.optimizer, 2128);
  // ZeRO-3 over 3 ranks: 532 = 178 + 177 + 177 (the first 532 % 3 ranks get one more).
  m = predict_rank_state_bytes(s, Layout{3, 2, 2, 3}, 0, 0, 0);
  EXPECT_EQ(m.total(), 16 * 178);
  m = predict_rank_state_bytes(s, Layout{3, 2, 2, 3}, 0, 0, 2);
  EXPECT_EQ(m.total(), 16 * 177);
  // DDP: the whole 16 bytes per parameter.
  EXPECT_EQ(predict_rank_state_bytes(s, Layout{4, 1, 1, 0}, 0, 0).total(), 16 * 1872);
  EXPECT_NE(error_of([&] {
              predict_rank_state_bytes(s, Layout{1, 1, 3, 0}, 0, 0);
            }).find("tp 3 does not divide --heads 2"),
            std::string::npos);
  EXPECT_NE(error_of([&] { predict_rank_state_bytes(s, Layout{1, 2, 1, 0}, 2, 0); }), "");
}

TEST(Plan, ActivationAndCommunicationFormulas) {
  DecoderShape s;
  s.layers = 1, s.hidden = 1024, s.heads = 16, s.vocab = 1000, s.seq_len = 2048;
  const double sbh = 2048.0 * 2 * 1024;
  // Megatron: s*b*h*(34 + 5*a*s/h) in 16-bit; with tp: 10 + 24/t + 5as/(ht).
  EXPECT_EQ(layer_activation_bytes(s, 2, 1, Precision::kBf16Mixed), std::llround(sbh * (34 + 5.0 * 16 * 2048 / 1024)));
  EXPECT_EQ(layer_activation_bytes(s, 2, 4, Precision::kBf16Mixed),
            std::llround(sbh * (10 + 24.0 / 4 + 5.0 * 16 * 2048 / (1024 * 4))));
  EXPECT_EQ(layer_activation_bytes(s, 2, 1, Precision::kFp32),
            2 * layer_activation_bytes(s, 2, 1, Precision::kBf16Mixed));
  EXPECT_EQ(checkpointed_layer_bytes(s, 2, Precision::kBf16Mixed), std::llround(2 * sbh));
  EXPECT_EQ(microbatches_in_flight(4, 0, 8), 4);
  EXPECT_EQ(microbatches_in_flight(4, 3, 8), 1);
  EXPECT_EQ(microbatches_in_flight(4, 0, 2), 2);
  EXPECT_EQ(microbatches_in_flight(1, 0, 8), 1);

  // 1F1B bubble: (pp - 1) / m of the compute.
  EXPECT_DOUBLE_EQ(pipeline_bubble_seconds(1.0, 4, 12), 0.25);
  EXPECT_DOUBLE_EQ(pipeline_bubble_seconds(1.0, 1, 12), 0.0);

  // DDP 2 psi (n-1)/n, ZeRO-3 1.5x that (one micro-batch).
  EXPECT_EQ(dp_comm_bytes(1000, 2, 0, 4, 1), 3000);
  EXPECT_EQ(dp_comm_bytes(1000, 2, 1, 4, 1), 3000);
  EXPECT_EQ(dp_comm_bytes(1000, 2, 2, 4, 1), 3000);
  EXPECT_EQ(dp_comm_bytes(1000, 2, 3, 4, 1), 4500);
  EXPECT_EQ(dp_comm_bytes(1000, 2, 0, 1, 1), 0);
  // Stage 2 reduce-scatters each of 3 micro-batches, then gathers once.
  EXPECT_EQ(dp_comm_bytes(1000, 2, 2, 4, 3), 4 * 1500);
  // tp: 4 all-reduces of b*s*h per block per micro-batch, ring 2(t-1)/t.
  EXPECT_EQ(tp_comm_bytes(s, 2, 4, 3, 5, Precision::kBf16Mixed), std::llround(4 * 3 * 5 * 2 * 0.75 * 2 * sbh));
  // pp: a middle stage sends to both neighbours, an end stage to one.
  EXPECT_EQ(pp_comm_bytes(s, 2, 4, 1, 5, Precision::kBf16Mixed), std::llround(2 * 5 * 2 * sbh));
  EXPECT_EQ(pp_comm_bytes(s, 2, 4, 3, 5, Precision::kBf16Mixed), std::llround(5 * 2 * sbh));
}

TEST(Plan, ParsesUnits) {
  EXPECT_EQ(parse_bytes("--device-memory", "80GB"), 80'000'000'000);
  EXPECT_EQ(parse_bytes("--device-memory", "80GiB"), 80LL << 30);
  EXPECT_EQ(parse_bytes("--device-memory", "1.5TB"), 1'500'000'000'000);
  EXPECT_EQ(parse_bytes("--device-memory", "512MiB"), 512LL << 20);
  EXPECT_EQ(parse_bytes("--device-memory", "16 GB"), 16'000'000'000);
  EXPECT_DOUBLE_EQ(parse_bandwidth("--inter-node-bandwidth", "25GB/s"), 25e9);
  EXPECT_DOUBLE_EQ(parse_bandwidth("--intra-node-bandwidth", "1TiB/s"), 1099511627776.0);
  EXPECT_EQ(parse_count("--params", "7.5e9"), 7'500'000'000);
  EXPECT_EQ(parse_count("--params", "7.5B"), 7'500'000'000);
  EXPECT_EQ(parse_count("--params", "350M"), 350'000'000);
  EXPECT_EQ(parse_count("--params", "1234"), 1234);

  const std::string unknown = error_of([] { parse_bytes("--device-memory", "80Gb"); });
  EXPECT_NE(unknown.find("--device-memory '80Gb': unknown unit 'Gb'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("GiB"), std::string::npos) << unknown;
  EXPECT_NE(error_of([] { parse_bytes("--device-memory", "80"); }).find("has no unit"), std::string::npos);
  EXPECT_NE(error_of([] { parse_bytes("--device-memory", "lots"); }).find("expected a positive number"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_bytes("--device-memory", "0x10GB"); }), "");
  EXPECT_NE(error_of([] { parse_bandwidth("--inter-node-bandwidth", "25GB"); }).find("e.g. 25GB/s"), std::string::npos);
  EXPECT_NE(error_of([] { parse_bandwidth("--inter-node-bandwidth", "200Gb/s"); }).find("25GB/s"), std::string::npos);
  EXPECT_NE(error_of([] { parse_count("--params", "7.5X"); }).find("unknown suffix 'X'"), std::string::npos);
  EXPECT_NE(error_of([] { parse_positive_int("--layers", "2.5"); }).find("--layers '2.5'"), std::string::npos);
  EXPECT_EQ(with_commas(128000), "128,000");
  EXPECT_EQ(with_commas(999), "999");
}

TEST(Plan, ParsesFlagsInBothForms) {
  const PlanInput in = parse_plan_args(split_args(
      "--layers=2 --hidden 8 --heads=2 --vocab 10 --seq-len=4 --untied --micro-batch 2 --global-batch=16 "
      "--precision bf16-mixed --optimizer=sgd --momentum 0.9 --devices=8 --device-memory 80GiB --devices-per-node 4 "
      "--intra-node-bandwidth 600GB/s --inter-node-bandwidth=50GB/s --activation-checkpointing blocks --margin 20% --json"));
  ASSERT_TRUE(in.shape);
  EXPECT_FALSE(in.shape->tie_embeddings);
  EXPECT_EQ(in.params, 1952);
  EXPECT_EQ(in.micro_batch, 2);
  EXPECT_EQ(global_batch_of(in), 16);
  EXPECT_EQ(in.precision, Precision::kBf16Mixed);
  EXPECT_EQ(in.optimizer, OptimizerKind::kSgd);
  EXPECT_TRUE(in.momentum && in.activation_checkpointing && in.json);
  EXPECT_EQ(in.devices, 8);
  EXPECT_EQ(in.device_memory, 80LL << 30);
  EXPECT_EQ(devices_per_node_of(in), 4);
  EXPECT_DOUBLE_EQ(in.intra_node_bandwidth, 600e9);
  EXPECT_DOUBLE_EQ(in.inter_node_bandwidth, 50e9);
  EXPECT_DOUBLE_EQ(in.memory_margin, 0.2);
  // Mixed-precision SGD with momentum: 2 + 2 + (4 master + 4 momentum); fp32: 4 + 4 (+ 4).
  EXPECT_EQ(state_bytes_per_param(in.precision, in.optimizer, in.momentum).total(), 12);
  EXPECT_EQ(state_bytes_per_param(Precision::kFp32, OptimizerKind::kSgd, false).total(), 8);
  EXPECT_EQ(state_bytes_per_param(Precision::kFp32, OptimizerKind::kSgd, true).total(), 12);
}

TEST(Plan, RejectsBadInputWithClearMessages) {
  auto error = [](const std::string& line) { return error_of([&] { parse_plan_args(split_args(line)); }); };
  const std::string shape = "--layers 2 --hidden 8 --heads 2 --vocab 10 --seq-len 4 ";
  const std::string cluster = "--devices 8 --device-memory 80GB ";
  const std::pair<std::string, std::string> cases[] = {
      {cluster, "no model given"},
      {shape + "--devices 12 --devices-per-node 8 --device-memory 80GB",
       "--devices 12 is not a multiple of --devices-per-node 8"},
      {"--layers 2 --hidden 100 --heads 3 --vocab 10 --seq-len 4 " + cluster,
       "--hidden 100 is not a multiple of --heads 3"},
      {"--layers 2 --hidden 8 --heads 2 --vocab 10 " + cluster, "--seq-len is missing"},
      {shape + "--params 7B " + cluster, "either --params or the model's shape"},
      {shape + "--device-memory 80GB", "--devices is missing"},
      {shape + "--devices 8", "--device-memory is missing"},
      {shape + cluster + "--precision fp8", "--precision 'fp8': expected fp32, bf16-mixed or fp16-mixed"},
      {shape + cluster + "--momentum 0.9", "--momentum applies to --optimizer sgd"},
      {shape + cluster + "--optimizer sgd --momentum yes", "--momentum yes: expected the momentum factor in [0, 1)"},
      {shape + cluster + "--activation-checkpointing every-2", "the planner estimates none and blocks"},
      {shape + cluster + "--pipeline 2", "unknown flag '--pipeline'"},
      {shape + cluster + "--micro-batch 3 --global-batch 8", "--global-batch 8 is not a multiple of --micro-batch 3"},
      {shape + cluster + "--json=yes", "--json takes no value"},
      {shape + "--devices", "--devices needs a value"},
      {shape + "--devices 8 --device-memory 80Gb", "unknown unit 'Gb'"},
  };
  for (const auto& c : cases) {
    const std::string message = error(c.first);
    EXPECT_NE(message.find(c.second), std::string::npos) << "args: " << c.first << "\nmessage: " << message;
  }
  // heads not dividing hidden also lists the choices.
  EXPECT_NE(error("--layers 2 --hidden 12 --heads 5 --vocab 10 --seq-len 4 " + cluster).find("{1, 2, 3, 4, 6, 12}"),
            std::string::npos);
}

TEST(Plan, CandidateLayoutsCoverTheMesh) {
  const PlanInput in = parse_plan_args(
      split_args("--layers 4 --hidden 64 --heads 4 --vocab 128 --seq-len 32 --devices 8 --device-memory 1GB"));
  const std::vector<Layout> layouts = candidate_layouts(in);
  for (const Layout& l : layouts) {
    EXPECT_EQ(l.dp * l.pp * l.tp, 8);
    EXPECT_LE(l.tp, 4);  // tp divides the 4 heads
    EXPECT_LE(l.pp, 6);  // at most one stage per piece (embedding, 4 blocks, head)
    if (l.dp == 1) {
      EXPECT_EQ(l.zero, 0);
    }
  }
  // (dp, pp, tp): (8,1,1) (4,2,1) (2,4,1) (4,1,2) (2,2,2) (1,4,2) (2,1,4) (1,2,4); ZeRO 0-3 when dp > 1.
  // pp = 8 would need 8 pieces: there are 6.
  EXPECT_EQ(layouts.size(), 6u * 4 + 2);
}

TEST(Plan, RecommendationFitsAndKeepsTpInsideANode) {
  // Scenario 3 on 16 GB devices, two nodes of 8: the recommendation must fit
  // the usable memory and keep its tp group inside a node.
  const PlanInput in = parse_plan_args(
      split_args("--layers 4 --hidden 8192 --heads 64 --vocab 128000 --seq-len 512 --precision bf16-mixed "
                 "--devices 16 --devices-per-node 8 --device-memory 16GB"));
  const Plan plan = make_plan(in);
  EXPECT_EQ(plan.scenario.number, 3);
  ASSERT_TRUE(plan.recommendation);
  const Estimate& best = plan.recommendation->estimate;
  EXPECT_TRUE(best.fits);
  EXPECT_LE(best.memory.total(), usable_memory(in));
  EXPECT_TRUE(best.tp_in_node);
  EXPECT_EQ(8 % best.layout.tp, 0);
  // It is the best of the fitting layouts by the documented order, and every
  // layout's "fits" agrees with its memory.
  for (const Estimate& e : plan.candidates) {
    EXPECT_EQ(e.fits, e.memory.total() <= usable_memory(in));
    if (e.fits) {
      EXPECT_FALSE(better_layout(e, best)) << describe_layout(e.layout);
    }
  }
  // Layouts are ranked by predicted step time alone: a tp group across nodes
  // loses because its all-reduces are slower, not by rule.
  Estimate across = best, inside = best;
  across.tp_in_node = false;
  across.seconds = CommSeconds{};
  inside.seconds.tp = 100;
  EXPECT_TRUE(better_layout(across, inside));
}

TEST(Plan, FitsNowhereNamesTheSmallestCluster) {
  // 7.5B parameters with fp32 Adam need 120 GB of state: 8 devices of 16 GB
  // cannot hold it even with ZeRO-3 (15 GB each > 14.4 GB usable).
  const std::string args = "--params 7.5B --devices 8 --device-memory 16GB";
  const Plan plan = make_plan(parse_plan_args(split_args(args)));
  EXPECT_FALSE(plan.recommendation);
  ASSERT_TRUE(plan.smallest_cluster);
  // 120 GB / 14.4 GB usable = 8.3 devices: ZeRO-3 on 9 devices (nodes of 8: 16).
  EXPECT_EQ(plan.smallest_cluster->devices, 16);
  EXPECT_EQ(plan.smallest_cluster->nodes, 2);
  EXPECT_NE(plan.no_fit_message.find("smallest cluster that fits has 16 devices"), std::string::npos)
      << plan.no_fit_message;

  std::ostringstream out;
  EXPECT_EQ(run_plan(split_args(args), out), 2);
  EXPECT_NE(out.str().find("nothing fits"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("16 devices (2 nodes of 8)"), std::string::npos) << out.str();

  // One node per device: the search steps by one device, and 9 fit.
  const Plan single = make_plan(parse_plan_args(split_args(args + " --devices-per-node 1")));
  ASSERT_TRUE(single.smallest_cluster);
  EXPECT_EQ(single.smallest_cluster->devices, 9);
}

TEST(Plan, ActivationsBeyondAnyClusterSuggestCheckpointing) {
  // 80 layers of hidden 8,192 at seq-len 4,096: under 1F1B the first stage
  // holds about all 80 layers' activations whatever pp and tp, more than a
  // 16 GB device; keeping only layer inputs makes it fit on more devices.
  const std::string args =
      "--layers 80 --hidden 8192 --heads 64 --vocab 128000 --seq-len 4096 --precision bf16-mixed "
      "--devices 8 --device-memory 16GB";
  const PlanInput in = parse_plan_args(split_args(args));
  EXPECT_GT(activation_floor_bytes(in), usable_memory(in));
  const Plan plan = make_plan(in);
  EXPECT_FALSE(plan.recommendation);
  EXPECT_FALSE(plan.smallest_cluster);
  EXPECT_NE(plan.no_fit_message.find("the activations alone need at least"), std::string::npos) << plan.no_fit_message;
  EXPECT_NE(plan.no_fit_message.find("With --activation-checkpointing blocks the smallest cluster that fits has"),
            std::string::npos)
      << plan.no_fit_message;

  PlanInput checkpointed = in;
  checkpointed.activation_checkpointing = true;
  EXPECT_LT(activation_floor_bytes(checkpointed), usable_memory(checkpointed));
  const Layout l{1, 8, 1, 0};
  EXPECT_LT(stage_activation_bytes(checkpointed, l, 0, 8), stage_activation_bytes(in, l, 0, 8));
}

TEST(Plan, RunPlanPrintsTableOrJson) {
  const std::string args =
      "--layers 4 --hidden 64 --heads 4 --vocab 128 --seq-len 32 --devices 4 --devices-per-node 2 --device-memory 1GB";
  std::ostringstream text;
  EXPECT_EQ(run_plan(split_args(args), text), 0);
  EXPECT_NE(text.str().find("scenario 1:"), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("recommended (*)"), std::string::npos) << text.str();

  std::ostringstream js;
  EXPECT_EQ(run_plan(split_args(args + " --json"), js), 0);
  const json::Value v = json::parse(js.str());
  EXPECT_EQ(v["scenario"]["number"].num(), 1);
  EXPECT_EQ(v["input"]["parameters"].num(), 210304);
  EXPECT_GT(v["candidates"].size(), 0u);
  EXPECT_TRUE(v["recommendation"]["estimate"]["fits"].boolean);

  std::ostringstream bad;
  EXPECT_EQ(run_plan(split_args("--devices 8 --json"), bad), 2);
  EXPECT_NE(json::parse(bad.str())["error"].str().find("no model given"), std::string::npos);

  std::ostringstream help;
  EXPECT_EQ(run_plan({"--help"}, help), 0);
  EXPECT_NE(help.str().find("--device-memory"), std::string::npos);
}
