// Checkpoints: exact resume, resharding across layouts, atomic commit under a
// crash at every stage of a save, and corrupted shards.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "equivalence.h"
#include "meshtrain/comm.h"
#include "harness.h"
#include "meshtrain/train.h"
#include "app/trainer/run_training.h"
#include "meshtrain/util.h"
#include "util/files.h"
#include "util/tensor_io.h"

using meshtrain::testing::checkpoint_dir;
using meshtrain::testing::expect_same_training;
using meshtrain::testing::tiny_gpt;
using meshtrain::testing::Tolerance;
using meshtrain::testing::train_in_one_process;
using meshtrain::testing::train_on_ranks;
using meshtrain::train::TrainConfig;

namespace {

TrainConfig layout(int dp, int pp, int tp, int zero) {
  auto c = tiny_gpt();
  c.steps = 6;
  c.dp = dp;
  c.pp = pp;
  c.tp = tp;
  c.zero = zero;
  if (pp > 1) c.microbatches = 2;
  return c;
}

void set_latest(const std::string& dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d\n", step);
  std::ofstream(dir + "/latest") << name;
}

// Same layout: resuming is the same computation, so the losses and the weights
// are bitwise those of the uninterrupted run.
TEST(Checkpoint, ExactResumeOnTheSameLayout) {
  struct L { int dp, pp, tp, zero; };
  for (const L& l : std::vector<L>{{3, 1, 1, 0}, {2, 1, 1, 1}, {3, 1, 1, 3}, {1, 2, 1, 0}, {1, 1, 2, 0}, {2, 1, 2, 2}}) {
    const std::string name = "exact" + std::to_string(l.dp) + std::to_string(l.pp) + std::to_string(l.tp) + std::to_string(l.zero);
    const std::string dir = checkpoint_dir(name);
    TrainConfig c = layout(l.dp, l.pp, l.tp, l.zero);
    c.save_dir = dir;
    c.save_every = 2;
    const int world = l.dp * l.pp * l.tp;
    auto full = train_on_ranks(c, world);  // saves at steps 2, 4 and 6
    if (!meshtrain::testing::in_rank_process()) set_latest(dir, 2);
    c.resume = true;
    auto resumed = train_on_ranks(c, world);
    if (meshtrain::testing::in_rank_process()) continue;
    EXPECT_EQ(resumed.first_step, 2) << name;
    EXPECT_EQ(resumed.losses.size(), 4u) << name;
    expect_same_training(resumed, full, Tolerance{0, 0, 0, 0}, name + " (exact)");
  }
}

// Whether two shards hold the same tensors, bit for bit, but for "rng": the
// generator state each rank process happens to start from (the test
// harness's, not the training's).
bool same_tensors_but_rng(const std::string& a, const std::string& b) {
  auto x = meshtrain::torch_load_bytes(meshtrain::files::read_all(a), a);
  auto y = meshtrain::torch_load_bytes(meshtrain::files::read_all(b), b);
  x.erase("rng");
  y.erase("rng");
  if (x.size() != y.size()) return false;
  for (const auto& kv : x)
    if (!y.count(kv.first) || !at::equal(kv.second, y.at(kv.first))) return false;
  return true;
}

// --async-save writes the same bytes as a synchronous save (the snapshot is
// taken at the step boundary, before the next step changes the tensors), and
// resuming from it is bitwise the uninterrupted run.
TEST(Checkpoint, AsyncSaveWritesTheSameShardsAndResumesExactly) {
  struct L { int dp, pp, tp, zero; };
  for (const L& l : std::vector<L>{{2, 1, 1, 1}, {1, 2, 1, 0}, {2, 1, 1, 3}}) {
    const std::string name = "async" + std::to_string(l.dp) + std::to_string(l.pp) + std::to_string(l.tp) + std::to_string(l.zero);
    const std::string sync_dir = checkpoint_dir(name + "-sync"), async_dir = checkpoint_dir(name);
    const int world = l.dp * l.pp * l.tp;
    TrainConfig c = layout(l.dp, l.pp, l.tp, l.zero);
    c.save_every = 2;
    c.save_dir = sync_dir;
    const auto full = train_on_ranks(c, world);
    c.save_dir = async_dir;
    c.async_save = true;
    train_on_ranks(c, world);  // saves at steps 2, 4 and 6, each while the next steps run
    if (!meshtrain::testing::in_rank_process()) {
      for (const char* step : {"/step-00000002", "/step-00000004", "/step-00000006"}) {
        for (int r = 0; r < world; ++r) {
          char shard[32];
          std::snprintf(shard, sizeof shard, "/rank-%05d.bin", r);
          const std::string a = async_dir + step + shard, b = sync_dir + step + shard;
          ASSERT_TRUE(meshtrain::files::exists(a)) << a;
          EXPECT_TRUE(same_tensors_but_rng(a, b)) << a << " differs from " << b;
        }
      }
      set_latest(async_dir, 2);
    }
    c.resume = true;
    auto resumed = train_on_ranks(c, world);
    if (meshtrain::testing::in_rank_process()) continue;
    EXPECT_EQ(resumed.first_step, 2) << name;
    expect_same_training(resumed, full, Tolerance{0, 0, 0, 0}, name + " (async, exact)");
  }
}

// bf16-mixed checkpoints hold the float32 masters (DDP: dp rank 0's; ZeRO:
// every rank's shard), so resuming is still bitwise, and a bf16 run saved
// under ZeRO-2 continues under DDP on other ranks from the same masters.
TEST(Checkpoint, Bf16MixedResumesExactlyAndReshards) {
  for (int zero : {0, 1, 2, 3}) {
    const std::string name = "bf16zero" + std::to_string(zero);
    const std::string dir = checkpoint_dir(name);
    TrainConfig c = layout(2, 1, 1, zero);
    c.precision = "bf16-mixed";
    c.save_dir = dir;
    c.save_every = 2;
    auto full = train_on_ranks(c, 2);
    if (!meshtrain::testing::in_rank_process()) set_latest(dir, 2);
    c.resume = true;
    auto resumed = train_on_ranks(c, 2);
    if (zero == 2) {  // continue from the step-2 checkpoint under DDP on 3 ranks
      if (!meshtrain::testing::in_rank_process()) set_latest(dir, 2);
      TrainConfig d = layout(3, 1, 1, 0);
      d.precision = "bf16-mixed";
      d.save_dir = dir;
      d.resume = true;
      auto moved = train_on_ranks(d, 3);
      if (!meshtrain::testing::in_rank_process()) {
        EXPECT_EQ(moved.first_step, 2);
        meshtrain::testing::Tolerance bf16;  // bf16 rounding in other places (see MixedPrecision.*)
        bf16.loss_rtol = 5e-4;
        bf16.weight_atol = 4e-3;
        expect_same_training(moved, full, bf16, "bf16 ZeRO-2 on 2 ranks -> DDP on 3");
      }
    }
    if (meshtrain::testing::in_rank_process()) continue;
    EXPECT_EQ(resumed.first_step, 2) << name;
    expect_same_training(resumed, full, Tolerance{0, 0, 0, 0}, name + " (exact)");
  }
}

// Save under one layout, continue under another: the same as never stopping,
// in one process, within the equivalence tolerance.
TEST(Checkpoint, ReshardingAcrossLayouts) {
  struct Move { TrainConfig from; int from_world; TrainConfig to; int to_world; const char* what; };
  std::vector<Move> moves = {
      {layout(2, 1, 1, 0), 2, layout(4, 1, 1, 0), 4, "dp 2 -> 4"},
      {layout(4, 1, 1, 2), 4, layout(2, 1, 1, 2), 2, "dp 4 -> 2 (ZeRO 2)"},
      {layout(1, 1, 1, 0), 1, layout(1, 1, 2, 0), 2, "tp 1 -> 2"},
      {layout(2, 1, 2, 0), 4, layout(2, 1, 1, 0), 2, "tp 2 -> 1"},
      {layout(1, 1, 1, 0), 1, layout(1, 2, 1, 0), 2, "pp 1 -> 2"},
      {layout(1, 2, 1, 1), 2, layout(2, 1, 1, 3), 2, "pp 2 (ZeRO 1) -> dp 2 (ZeRO 3)"},
      {layout(2, 1, 1, 3), 2, layout(1, 1, 1, 0), 1, "ZeRO 3 -> one process"},
      {layout(2, 2, 1, 2), 4, layout(2, 1, 2, 1), 4, "dp 2 x pp 2 (ZeRO 2) -> dp 2 x tp 2 (ZeRO 1)"},
  };
  const auto reference = meshtrain::testing::in_rank_process() ? meshtrain::testing::TrainOutput{} : train_in_one_process(layout(1, 1, 1, 0));
  for (size_t i = 0; i < moves.size(); ++i) {
    Move& m = moves[i];
    const std::string dir = checkpoint_dir("reshard" + std::to_string(i));
    m.from.save_dir = m.to.save_dir = dir;
    m.from.steps = 3;
    m.from.save_every = 3;
    m.to.resume = true;
    if (m.from_world > 1) train_on_ranks(m.from, m.from_world);
    else if (!meshtrain::testing::in_rank_process()) train_in_one_process(m.from);
    meshtrain::testing::TrainOutput got;
    if (m.to_world > 1) got = train_on_ranks(m.to, m.to_world);
    else if (!meshtrain::testing::in_rank_process()) got = train_in_one_process(m.to);
    if (meshtrain::testing::in_rank_process()) continue;
    EXPECT_EQ(got.first_step, 3) << m.what;
    expect_same_training(got, reference, Tolerance{}, m.what);
  }
}

// Token shards as data (llm.c's format, written here by `meshtrain data`'s
// writer from byte text whose tokens fit the tiny GPT's vocabulary of 64):
// dp 2 x pp 2 trains like one process; saved there at step 3 and resumed in
// one process, training continues at the same sample, as if never stopped.
TEST(Checkpoint, TokenShardsTrainLikeOneProcessAndResumeAcrossLayouts) {
  const std::string dir = checkpoint_dir("shards");
  if (!meshtrain::testing::in_rank_process()) {
    std::ofstream(dir + "/corpus.txt") << meshtrain::train::arithmetic_text(5, 0, 4000);  // digits, + = and newlines: bytes < 64
    meshtrain::train::write_token_shards({dir + "/corpus.txt"}, dir + "/data/part", 1500);
  }
  auto with_shards = [&](TrainConfig c) {
    c.data = dir + "/data/part_*.bin";
    return c;
  };
  meshtrain::testing::expect_trains_like_one_process(with_shards(layout(2, 2, 1, 0)), 4);

  TrainConfig from = with_shards(layout(2, 2, 1, 0)), to = with_shards(layout(1, 1, 1, 0));
  from.save_dir = to.save_dir = dir + "/ckpt";
  from.steps = 3;
  from.save_every = 3;
  to.resume = true;
  train_on_ranks(from, 4);
  if (meshtrain::testing::in_rank_process()) return;
  const auto reference = train_in_one_process(with_shards(layout(1, 1, 1, 0)));
  const auto resumed = train_in_one_process(to);
  EXPECT_EQ(resumed.first_step, 3);
  expect_same_training(resumed, reference, Tolerance{}, "token shards, dp 2 x pp 2 -> one process");
}

// What --resume does with a checkpoint directory that was tampered with or
// does not fit: `latest` gone -> the newest committed step (it used to start
// over at step 0 and overwrite them); `latest`'s manifest corrupt -> the
// previous step; `latest` pointing outside its pattern, a manifest moved to
// another step, another model or optimizer -> a ConfigError naming it.
TEST(Checkpoint, ResumeFindsTheNewestIntactStepAndRefusesAnotherModel) {
  if (meshtrain::testing::in_rank_process()) return;  // one process throughout
  const std::string dir = checkpoint_dir("resume-checks");
  TrainConfig c = layout(1, 1, 1, 0);
  c.save_dir = dir;
  c.save_every = 2;
  train_in_one_process(c);  // steps 2, 4 and 6
  c.resume = true;
  c.steps = 8;
  auto error_of = [&](const TrainConfig& run) {
    try {
      train_in_one_process(run);
    } catch (const meshtrain::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  TrainConfig fallback = c;
  fallback.resume_fallback = true;
  fallback.steps = 6;  // resumes without saving: the directory stays as the test makes it
  std::remove((dir + "/latest").c_str());
  EXPECT_NE(error_of(c).find("has no 'latest' but holds committed checkpoints"), std::string::npos) << error_of(c);
  EXPECT_EQ(train_in_one_process(fallback).first_step, 6);
  meshtrain::files::make_directories(dir + "/step-00000008");
  std::ofstream(dir + "/step-00000008/manifest.json") << "{";  // committed, then corrupted
  set_latest(dir, 8);
  EXPECT_NE(error_of(c).find("step-00000008/manifest.json"), std::string::npos) << error_of(c);
  EXPECT_NE(error_of(c).find("add --resume-fallback"), std::string::npos) << error_of(c);
  EXPECT_EQ(train_in_one_process(fallback).first_step, 6);  // step 8's manifest is corrupt: the previous one
  {
    std::fstream shard(dir + "/step-00000006/rank-00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    shard.seekg(1000);
    const char byte = static_cast<char>(shard.get());
    shard.seekp(1000);
    shard.put(static_cast<char>(~byte));  // one byte of step 6 flipped
  }
  set_latest(dir, 6);
  EXPECT_NE(error_of(c).find("rank-00000.bin is corrupt"), std::string::npos) << error_of(c);
  EXPECT_EQ(train_in_one_process(fallback).first_step, 4);  // step 6's shard is corrupt, step 8 unreadable
  std::ofstream(dir + "/latest", std::ios::trunc) << "step-00000002/../step-00000006\n";
  EXPECT_NE(error_of(c).find("not a step directory name"), std::string::npos) << error_of(c);
  set_latest(dir, 4);
  TrainConfig other = c;
  other.model.layers = 4;
  EXPECT_NE(error_of(other).find("--layers is 3 in the checkpoint but 4 now"), std::string::npos) << error_of(other);
  other = c;
  other.optimizer = "sgd";
  EXPECT_NE(error_of(other).find("--optimizer is \"adamw\" in the checkpoint but \"sgd\" now"), std::string::npos)
      << error_of(other);
  other.optimizer = "adam";  // Adam's state is AdamW's: a deliberate change loads
  EXPECT_NE(error_of(other).find("--allow-config-change"), std::string::npos) << error_of(other);
  other.allow_config_change = true;
  EXPECT_EQ(train_in_one_process(other).first_step, 4);
  std::string manifest = meshtrain::files::read_all(dir + "/step-00000004/manifest.json");
  const size_t at = manifest.find("\"step\": 4");
  ASSERT_NE(at, std::string::npos) << manifest.substr(0, 200);
  manifest.replace(at, 9, "\"step\": 12");
  std::ofstream(dir + "/step-00000004/manifest.json", std::ios::trunc) << manifest;
  try {
    meshtrain::train::CheckpointReader reader(dir + "/step-00000004");
    ADD_FAILURE() << "an edited manifest was accepted";
  } catch (const meshtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("says step 12 but lives in step-00000004"), std::string::npos) << e.what();
  }
}

// --keep-last N keeps the newest N checkpoints, pruning after each commit, and
// a step directory a crash left without its manifest goes too; a save that
// fails leaves no step directory behind.
TEST(Checkpoint, KeepLastPrunesAfterCommitAndFailedSavesLeaveNothing) {
  if (meshtrain::testing::in_rank_process()) return;  // one process throughout
  const std::string dir = checkpoint_dir("keep-last");
  TrainConfig c = layout(1, 1, 1, 0);
  c.steps = 4;
  c.save_dir = dir;
  c.save_every = 1;
  c.keep_last = 2;
  train_in_one_process(c);
  EXPECT_EQ(meshtrain::train::complete_checkpoints(dir),
            (std::vector<std::string>{dir + "/step-00000004", dir + "/step-00000003"}));
  meshtrain::files::make_directories(dir + "/step-00000002");  // a crash mid-save left it
  std::ofstream(dir + "/step-00000002/rank-00000.bin.tmp") << "partial";
  c.steps = 6;
  c.resume = true;
  EXPECT_EQ(train_in_one_process(c).first_step, 4);
  EXPECT_EQ(meshtrain::train::complete_checkpoints(dir),
            (std::vector<std::string>{dir + "/step-00000006", dir + "/step-00000005"}));
  EXPECT_FALSE(meshtrain::files::exists(dir + "/step-00000002"));
  // A save that cannot write its shard (a directory where its file goes) fails and leaves nothing.
  meshtrain::files::make_directories(dir + "/step-00000008/rank-00000.bin.tmp");
  meshtrain::train::RankState state;
  state.chunks.push_back({"w", "value", {3}, -1, 0, 1, 0, torch::ones({3})});
  auto world = meshtrain::comm::make_single_process_world();
  try {
    meshtrain::train::save_checkpoint(dir, 8, state, *world, "{}");
    ADD_FAILURE() << "the save of step 8 could not have succeeded";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint of step 8 failed on rank 0"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(meshtrain::files::exists(dir + "/step-00000008"));
  EXPECT_EQ(meshtrain::train::latest_checkpoint(dir), dir + "/step-00000006");
  // A kill -9 mid-save leaves a newer step directory without a manifest: the next run removes it first.
  meshtrain::files::make_directories(dir + "/step-00000009");
  std::ofstream(dir + "/step-00000009/rank-00000.bin.tmp") << "partial";
  EXPECT_EQ(train_in_one_process(c).first_step, 6);  // steps 6 to 6: nothing trained, nothing saved
  EXPECT_FALSE(meshtrain::files::exists(dir + "/step-00000009"));
}

// A crash at every stage of committing the step-4 save never leaves a
// checkpoint that loads as complete: `latest` still names step 2 (after the
// manifest's rename, step 4 is complete too, but not yet `latest`), and an
// incomplete step 4 refuses to load.
TEST(Checkpoint, CrashAtEveryStageOfASaveLeavesTheLastCompleteCheckpoint) {
  struct Stage { const char* name; int rank; bool step4_complete; };
  for (const bool async : {false, true})  // --async-save: the kill lands in the writer thread
  for (const Stage& s : std::vector<Stage>{{"shard-written", 1, false},
                                           {"shard-renamed", 1, false},
                                           {"manifest-written", 0, false},
                                           {"manifest-renamed", 0, true},
                                           {"latest-written", 0, true}}) {
    const std::string what = std::string(s.name) + (async ? " (async)" : "");
    const std::string dir = checkpoint_dir(std::string("crash-") + s.name + (async ? "-async" : ""));
    TrainConfig c = layout(2, 1, 1, 1);
    c.async_save = async;
    c.save_dir = dir;
    c.save_every = 2;
    c.steps = 4;
    meshtrain::testing::RankOptions crash;
    crash.may_die = {0, 1};  // the crashing rank dies; the other fails when it does
    crash.env = {std::string("MESHTRAIN_CHECKPOINT_CRASH_AT=") + s.name,
                 "MESHTRAIN_CHECKPOINT_CRASH_RANK=" + std::to_string(s.rank), "MESHTRAIN_CRASH_ONLY_AT_STEP=4"};
    {
      ::testing::ScopedTrace trace(__FILE__, __LINE__, what);
      // The ranks of this call are expected to fail: run them without the equivalence helper.
      meshtrain::testing::run_ranks(2, [&](meshtrain::comm::Communicator& comm) {
        auto self = std::shared_ptr<meshtrain::comm::Communicator>(&comm, [](meshtrain::comm::Communicator*) {});
        meshtrain::train::RunOptions quiet;
        quiet.verbose = false;
        quiet.evaluate = false;
        try {
          meshtrain::train::run_training(meshtrain::train::resolve(c, 2), self, quiet);
        } catch (const std::exception&) {
          std::_Exit(0);  // the peer's crash: expected
        }
      }, crash);
    }
    if (meshtrain::testing::in_rank_process()) continue;
    EXPECT_EQ(meshtrain::train::latest_checkpoint(dir), dir + "/step-00000002") << what;
    EXPECT_EQ(meshtrain::files::exists(dir + "/step-00000004/manifest.json"), s.step4_complete) << what;
    if (!s.step4_complete) {
      EXPECT_THROW(meshtrain::train::CheckpointReader(dir + "/step-00000004"), meshtrain::ConfigError);
    }
  }
}

// Every rank saves its random generator's state, and takes it back on resume:
// the numbers it draws after loading are those it would have drawn next.
TEST(Checkpoint, EachRankResumesItsRandomGenerator) {
  const std::string dir = checkpoint_dir("rng");
  meshtrain::testing::run_ranks(3, [&](meshtrain::comm::Communicator& comm) {
    torch::manual_seed(100 + comm.rank());
    torch::rand({5});  // advance it somewhere
    meshtrain::train::RankState mine;
    mine.rng_state = meshtrain::train::cpu_rng_state();
    meshtrain::train::save_checkpoint(dir, 1, mine, comm, "{}");
    const auto next = torch::rand({4});  // what the generator draws next
    torch::manual_seed(7);               // a fresh process would start elsewhere
    meshtrain::train::CheckpointReader reader(meshtrain::train::latest_checkpoint(dir));
    ASSERT_EQ(reader.world_size(), 3);
    meshtrain::train::set_cpu_rng_state(reader.rng_state(comm.rank()));
    EXPECT_TRUE(torch::equal(torch::rand({4}), next)) << "rank " << comm.rank();
  });
}

TEST(Checkpoint, CorruptOrTruncatedShardsAreNamed) {
  const std::string dir = checkpoint_dir("corrupt");
  TrainConfig c = layout(2, 1, 1, 0);
  c.save_dir = dir;
  c.save_every = 2;
  c.steps = 2;
  train_on_ranks(c, 2);
  if (meshtrain::testing::in_rank_process()) return;
  const std::string shard = dir + "/step-00000002/rank-00000.bin";
  std::string bytes = meshtrain::files::read_all(shard);
  auto load_all = [&] {
    meshtrain::train::CheckpointReader r(dir + "/step-00000002");
    r.full("blocks.0.fc1.weight", "value");
  };
  bytes[bytes.size() / 2] ^= 0x01;  // one flipped bit
  std::ofstream(shard, std::ios::binary).write(bytes.data(), bytes.size());
  try {
    load_all();
    ADD_FAILURE() << "a flipped bit went unnoticed";
  } catch (const meshtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("rank-00000.bin is corrupt: SHA-256"), std::string::npos) << e.what();
  }
  std::ofstream(shard, std::ios::binary).write(bytes.data(), bytes.size() / 3);
  try {
    load_all();
    ADD_FAILURE() << "a truncated shard went unnoticed";
  } catch (const meshtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("rank-00000.bin is truncated"), std::string::npos) << e.what();
  }
}

}  // namespace
