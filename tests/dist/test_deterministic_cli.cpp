// Issue 33 from the command line: `meshtrain --deterministic` on dp 1, 2, 4
// and 8, under DDP, ZeRO-1/2/3 and a pipeline, fp32 and bf16-mixed, on shared
// memory and Gloo: every step's loss and gradient norm equal (==) to one
// process's and the same weights_sha256 at the end; the same flags without
// the mode do not give one process's bits; what it cannot make exact is
// refused on every rank before training.

#include <gtest/gtest.h>

#include "util/files.h"
#include "meshtrain/util.h"
#include "metrics_run.h"
#include "shell.h"

using meshtrain::json::Value;
using meshtrain::testing::contains;
using meshtrain::testing::kBin;
using meshtrain::testing::kMeshrun;
using meshtrain::testing::sh;
using meshtrain::testing::Shell;
using meshtrain::testing::TempDir;

namespace {

// Tied embedding and head (across pipeline stages with --pp 2), clipping on.
const std::string kTiny =
    " --model gpt --layers 3 --hidden 32 --heads 4 --vocab 64 --seq-len 16 --global-batch 32 --steps 6"
    " --lr 1e-2 --adam-eps 1e-6 --clip-grad-norm 0.5 --eval-problems 0 --log-every 100 ";

Value train(int ranks, const std::string& flags, const std::string& metrics) {
  return meshtrain::testing::train_metrics(ranks, kTiny + flags, metrics);
}

void expect_same_bits(const Value& got, const Value& want, const std::string& layout) {
  ASSERT_EQ(got["losses"].size(), want["losses"].size()) << layout;
  for (size_t s = 0; s < want["losses"].size(); ++s) {
    EXPECT_EQ(got["losses"][s].num(), want["losses"][s].num()) << layout << ", step " << s + 1;
    EXPECT_EQ(got["grad_norms"][s].num(), want["grad_norms"][s].num()) << layout << ", step " << s + 1;
  }
  EXPECT_EQ(got["weights_sha256"].str(), want["weights_sha256"].str()) << layout;
}

struct Layout {
  int ranks;
  const char* flags;
};

}  // namespace

TEST(Deterministic, EveryDpSizeAndStrategyGivesOneProcesssBits) {
  TempDir t;
  const Value one = train(1, "--deterministic", t.file("one.json"));
  ASSERT_EQ(one["weights_sha256"].str().size(), 64u);
  for (const Layout& l : {Layout{2, "--dp 2"}, Layout{4, "--dp 4 --zero 1"}, Layout{8, "--dp 8 --zero 3"},
                          Layout{4, "--dp 2 --pp 2 --zero 2"}, Layout{4, "--dp 2 --pp 2 --schedule gpipe --zero 3"},
                          Layout{2, "--dp 2 --zero 1 --backend gloo"}}) {
    expect_same_bits(train(l.ranks, std::string("--deterministic ") + l.flags, t.file("m.json")), one, l.flags);
  }
  const Value bf16 = train(1, "--deterministic --precision bf16-mixed", t.file("bf16.json"));
  for (const Layout& l : {Layout{4, "--dp 4 --zero 3"}, Layout{4, "--dp 2 --pp 2"}}) {
    expect_same_bits(train(l.ranks, std::string("--deterministic --precision bf16-mixed ") + l.flags,
                           t.file("m.json")),
                     bf16, std::string("bf16-mixed ") + l.flags);
  }
  // What the mode changes: the same micro-batches without it are summed in
  // the layout's order, and the weights' bits differ.
  const Value plain_one = train(1, "--micro-batch 4", t.file("p1.json"));
  const Value plain_four = train(4, "--dp 4 --micro-batch 4", t.file("p4.json"));
  EXPECT_NE(plain_four["weights_sha256"].str(), plain_one["weights_sha256"].str());
}

TEST(Deterministic, RefusesWhatItCannotMakeExactOnEveryRankBeforeTraining) {
  Shell r = sh(kMeshrun + "--nproc-per-node 2 -- " + kBin + "/meshtrain" + kTiny + "--deterministic --tp 2");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--deterministic with --tp 2: tensor parallelism adds")) << r.output;
  EXPECT_FALSE(contains(r.output, "step ")) << "a step ran:\n" << r.output;
  r = sh(kMeshrun + "--nproc-per-node 3 -- " + kBin + "/meshtrain" + kTiny + "--global-batch 48 --deterministic");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--deterministic with dp 3")) << r.output;
  EXPECT_FALSE(contains(r.output, "step ")) << "a step ran:\n" << r.output;
}
