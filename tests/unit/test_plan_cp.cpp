// The planner's context-parallel axis (--max-cp, Layout::cp): one rank of a
// cp layout holds seq_len / cp positions of flash (ring) activations, its
// model state is sharded over dp x cp under ZeRO, the ring's bytes follow
// src/cp/ring_attention.cpp, and the longest sequence that fits grows with
// cp. The trainer's --cp flag and its refusals.
#include <gtest/gtest.h>

#include <set>

#include "meshtrain/plan.h"
#include "plan/command.h"
#include "app/trainer/config.h"
#include "app/trainer/memory_check.h"
#include "config_error.h"
#include "split_args.h"

using namespace meshtrain;
using namespace meshtrain::plan;
using meshtrain::testing::config_error_of;
using meshtrain::testing::split_args;

namespace {

// A Llama of 2 layers, hidden 128 (the memory table's, bench/cp), one sample per step.
PlanInput llama(int64_t seq_len, int devices, const std::string& more = "") {
  return parse_plan_args(split_args(str_cat("--model llama --layers 2 --hidden 128 --heads 4 --kv-heads 2 --vocab 256 "
                                            "--seq-len ", seq_len, " --devices ", devices, " --device-memory 4GiB "
                                            "--micro-batch 1 ", more)));
}

TEST(PlanCp, CandidatesGainACpAxisOnlyWhenAsked) {
  const PlanInput without = llama(1024, 4);
  for (const Layout& l : candidate_layouts(without)) EXPECT_EQ(l.cp, 1);
  const PlanInput with = llama(1024, 4, "--max-cp 4");
  std::set<int> cps;
  for (const Layout& l : candidate_layouts(with)) {
    EXPECT_EQ(l.dp * l.pp * l.tp * l.cp, 4);
    cps.insert(l.cp);
    if (l.dp * l.cp == 1) EXPECT_EQ(l.zero, 0);  // nothing to shard over
  }
  EXPECT_EQ(cps, (std::set<int>{1, 2, 4}));  // 3 divides neither the 4 devices nor is asked to
  // 2 cp must divide the sequence: cp 4 needs 8 | seq_len.
  for (const Layout& l : candidate_layouts(llama(12, 4, "--max-cp 4"))) EXPECT_LT(l.cp, 4);
}

TEST(PlanCp, OneRankHoldsSeqLenOverCpPositionsOfFlashActivations) {
  const PlanInput whole = llama(4096, 1, "--attention flash");
  const PlanInput half = llama(2048, 1, "--attention flash");
  const PlanInput in = llama(4096, 2, "--max-cp 2 --global-batch 1");
  const Estimate cp2 = estimate_layout(in, Layout{1, 1, 1, 0, 2});
  // The rank's activations are one process's at T / 2 with flash.
  EXPECT_EQ(cp2.memory.activations, estimate_layout(half, Layout{}).memory.activations);
  EXPECT_LT(cp2.memory.activations, estimate_layout(whole, Layout{}).memory.activations * 0.51);
  // ZeRO-3 over dp 1 x cp 2 halves the model state, as over dp 2.
  const Estimate z3 = estimate_layout(in, Layout{1, 1, 1, 3, 2});
  const Estimate dp2 = estimate_layout(llama(4096, 2), Layout{2, 1, 1, 3});
  EXPECT_EQ(z3.memory.parameters, dp2.memory.parameters);
  EXPECT_EQ(z3.memory.optimizer, dp2.memory.optimizer);
  // Tokens and model FLOPs are the whole model's.
  EXPECT_EQ(cp2.tokens, 4096);
}

TEST(PlanCp, RingBytesByHand) {
  // Local shape: 2048 positions, 2 kv heads of 32 channels, b 1, tp 1, fp32:
  // kv = 2 * 2048 * 2 * 32 = 262,144 values. cp 2: forward 1 hop of kv, backward 1 hop of kv and 2 of dkv (fp32):
  // 4 * 262,144 * 4 = 4,194,304 bytes per block; a recomputed forward adds its hop.
  const PlanInput in = llama(4096, 2, "--max-cp 2 --global-batch 1");
  const DecoderShape local = cp_local_shape(*in.shape, 2);
  EXPECT_EQ(local.seq_len, 2048);
  EXPECT_EQ(cp_bytes_per_block(local, 1, 1, 2, Precision::kFp32), 4 * 262'144 * 4);
  EXPECT_EQ(cp_bytes_per_block(local, 1, 1, 2, Precision::kFp32, /*checkpointing=*/true), 5 * 262'144 * 4);
  EXPECT_EQ(cp_bytes_per_block(local, 1, 1, 1, Precision::kFp32), 0);
  // The estimate: 2 blocks, 1 micro-batch.
  EXPECT_EQ(estimate_layout(in, Layout{1, 1, 1, 0, 2}).comm.cp, 2 * 4 * 262'144 * 4);
}

// The longest sequence whose planned total fits grows with cp: flash
// activations are linear in T, so a cp rank fits about cp times the positions.
TEST(PlanCp, LongestSequenceGrowsWithCp) {
  auto longest = [](int cp) {
    int64_t best = 0;
    for (int64_t T = 1024; T <= (int64_t{1} << 22); T += 1024) {
      const PlanInput in = llama(T, cp, str_cat("--attention flash --global-batch 1 --max-cp ", cp));
      if (!estimate_layout(in, Layout{1, 1, 1, 0, cp}).fits) break;
      best = T;
    }
    return best;
  };
  const int64_t one = longest(1), two = longest(2), four = longest(4);
  EXPECT_GT(one, 0);
  EXPECT_GE(two, 2 * one - 2048);  // the model state is the same on every rank: about cp times
  EXPECT_GE(four, 4 * one - 4096);
  EXPECT_LE(four, 4 * one + 4096);
}

TEST(PlanCp, TheCommandPassesCp) {
  const PlanInput in = llama(4096, 2, "--max-cp 2 --global-batch 1 --precision fp32");
  const Estimate e = estimate_layout(in, Layout{1, 1, 1, 0, 2});
  EXPECT_NE(train_command(in, e).find("--cp 2"), std::string::npos) << train_command(in, e);
  const PlanInput two = llama(4096, 2, "--max-cp 2 --precision fp32");
  EXPECT_EQ(train_command(two, estimate_layout(two, Layout{2, 1, 1, 0})).find("--cp"), std::string::npos);
  try {
    llama(1024, 1, "--max-cp 0");
    ADD_FAILURE() << "--max-cp 0 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("--max-cp"), std::string::npos) << e.what();
  }
}

// What resolving the trainer's flags on `world` ranks raises ("" when it does not).
std::string error(const std::string& args, int world) {
  return config_error_of([&] { train::resolve(train::parse_train_args(split_args(args)), world); });
}

TEST(TrainCp, FlagsAreCheckedBeforeAnyCommunication) {
  const train::TrainConfig c = train::resolve(train::parse_train_args(split_args("--cp 2 --seq-len 16")), 4);
  EXPECT_EQ(c.cp, 2);
  EXPECT_EQ(c.dp, 2);  // the world over pp x tp x cp
  EXPECT_NE(error("--cp 3 --seq-len 16", 3).find("divisible by 6"), std::string::npos);
  EXPECT_NE(error("--cp 2 --model mlp", 2).find("--model mlp"), std::string::npos);
  EXPECT_NE(error("--cp 2 --seq-len 16 --deterministic", 2).find("--deterministic with --cp 2"), std::string::npos);
  EXPECT_NE(error("--cp 2 --seq-len 16 --dp 1", 4).find("dp 1 x pp 1 x tp 1 x cp 2 = 2 ranks"), std::string::npos);
  EXPECT_NE(error("--cp 2 --tp 4 --seq-len 20 --sequence-parallel --heads 4 --hidden 32", 8).find("divisible by 16"),
            std::string::npos);
  EXPECT_NE(error("--cp 0", 1).find("cp 0)"), std::string::npos) << error("--cp 0", 1);
}

// --experts and --ep: refused before any communication, naming the value and the fix.
TEST(TrainExperts, FlagsAreCheckedBeforeAnyCommunication) {
  const train::TrainConfig c = train::resolve(train::parse_train_args(split_args("--experts 8 --top-k 2 --ep 4")), 4);
  EXPECT_EQ(c.ep, 4);
  EXPECT_EQ(c.dp, 4);  // ep uses the data-parallel ranks
  EXPECT_NE(error("--ep 2", 2).find("add --experts"), std::string::npos);
  EXPECT_NE(error("--experts 6 --ep 4", 4).find("--ep 4 does not divide --experts 6"), std::string::npos);
  EXPECT_NE(error("--experts 8 --ep 4 --pp 2", 4).find("dp x cp = 2"), std::string::npos);
  EXPECT_NE(error("--experts 4 --top-k 5", 1).find("--top-k 5"), std::string::npos);
  EXPECT_NE(error("--experts 4 --capacity-factor -1", 1).find("--capacity-factor -1"), std::string::npos);
  EXPECT_NE(error("--experts 4 --model mlp", 1).find("--model mlp"), std::string::npos);
  EXPECT_NE(error("--experts 4 --strategy dp", 2).find("--strategy dp"), std::string::npos);
  EXPECT_NE(error("--experts 4 --tp 2 --sequence-parallel", 2).find("--sequence-parallel"), std::string::npos);
  EXPECT_NE(error("--experts 4 --ep 2 --precision bf16-mixed", 2).find("bf16-mixed"), std::string::npos);
  EXPECT_NE(error("--experts 4 --ep 2 --deterministic --grains 8", 2).find("--deterministic with --ep 2"),
            std::string::npos);
}

// --aux-loss-scope: global (the default) needs every forward of a step before
// its first backward, so a pipeline of experts defaults to GPipe, and a
// schedule that runs a backward first is refused naming both ways out; the
// micro scope keeps 1F1B; a dense model has no scope to choose.
TEST(TrainExperts, TheGlobalBalanceLossPicksAndChecksTheSchedule) {
  auto resolved = [](const std::string& flags, int world) {
    return train::resolve(train::parse_train_args(split_args(flags)), world);
  };
  EXPECT_EQ(resolved("--experts 4 --pp 2 --microbatches 4", 2).schedule, "gpipe");
  EXPECT_EQ(resolved("--experts 4 --pp 2 --microbatches 4 --aux-loss-scope micro", 2).schedule, "1f1b");
  EXPECT_EQ(resolved("--experts 4 --pp 2 --microbatches 4 --aux-loss-coef 0", 2).schedule, "1f1b");
  EXPECT_EQ(resolved("--pp 2 --microbatches 4", 2).schedule, "1f1b");
  EXPECT_EQ(resolved("--experts 4 --pp 2 --microbatches 1 --schedule 1f1b", 2).schedule, "1f1b");  // one micro-batch
  EXPECT_EQ(resolved("--experts 4", 1).aux_loss_scope, "global");
  const std::string refused = error("--experts 4 --pp 2 --microbatches 4 --schedule 1f1b", 2);
  for (const char* part : {"--schedule 1f1b with --experts 4", "--schedule gpipe", "--aux-loss-scope micro"})
    EXPECT_NE(refused.find(part), std::string::npos) << refused;
  EXPECT_NE(error("--experts 4 --pp 2 --virtual-stages 2 --schedule interleaved --microbatches 4", 2)
                .find("--schedule interleaved with --experts 4"),
            std::string::npos);
  EXPECT_NE(error("--experts 4 --aux-loss-scope batch", 1).find("--aux-loss-scope 'batch'"), std::string::npos);
  EXPECT_NE(error("--aux-loss-scope micro", 1).find("add --experts"), std::string::npos);
}

}  // namespace
