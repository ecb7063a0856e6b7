// Pure logic of data parallelism and the trainer: bucket assignment, flag
// parsing and validation, layout-independent initialization, global data order.

#include <gtest/gtest.h>

#include "meshtrain/comm.h"
#include <torch/torch.h>

#include "dp/buckets.h"
#include "dp/grain_tree.h"
#include "meshtrain/models.h"
#include "app/trainer/config.h"
#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/sha256.h"
#include "util/tensor_io.h"
#include "config_error.h"
#include "io_test_util.h"

using namespace meshtrain;

// Note [Grain tree]: 64 grains whose sums reassociate visibly (magnitudes
// from 1e-4 to 1e4), summed in one process and by n = 2 .. 64 ranks each
// holding a contiguous block: the same bits, where a plain running sum and a
// per-rank running sum differ.
TEST(GrainTree, AnyPowerOfTwoOfRanksGivesOneProcesssBits) {
  torch::manual_seed(7);
  std::vector<at::Tensor> grains;
  for (int i = 0; i < 64; ++i) grains.push_back(torch::randn({1000}) * std::pow(10.0, (i * 7) % 9 - 4));
  dp::TreeAccumulator one;
  size_t most = 0;
  for (const auto& g : grains) {
    one.add(g.clone());
    most = std::max(most, one.partials());
  }
  const at::Tensor root = one.root();
  EXPECT_LE(most, 7u);  // log2(64) + 1 partial sums, never one per grain
  for (int n = 2; n <= 64; n *= 2) {
    std::vector<at::Tensor> roots;
    for (int r = 0; r < n; ++r) {
      dp::TreeAccumulator mine;
      for (int i = r * 64 / n; i < (r + 1) * 64 / n; ++i) mine.add(grains[i].clone());
      roots.push_back(mine.root());
    }
    EXPECT_TRUE(torch::equal(dp::combine_in_tree_order(roots), root)) << n << " ranks";
  }
  // What the tree prevents: the same grains summed in other orders give other bits.
  at::Tensor running = torch::zeros({1000});
  for (const auto& g : grains) running += g;
  EXPECT_FALSE(torch::equal(running, root));
  EXPECT_TRUE(torch::allclose(running, root, 1e-4, 1e-2));  // the same sum, up to reassociation
  at::Tensor halves = torch::zeros({1000}), second = torch::zeros({1000});
  for (int i = 0; i < 32; ++i) halves += grains[i];
  for (int i = 32; i < 64; ++i) second += grains[i];
  EXPECT_FALSE(torch::equal(halves + second, running));  // two ranks' running sums: the layout shows
}

TEST(GrainTree, RefusesCountsThatAreNotPowersOfTwo) {
  dp::TreeAccumulator acc;
  for (int i = 0; i < 3; ++i) acc.add(torch::ones({2}));
  EXPECT_THROW(acc.root(), std::exception);
  EXPECT_THROW(dp::combine_in_tree_order({torch::ones({2}), torch::ones({2}), torch::ones({2})}), std::exception);
  EXPECT_TRUE(dp::is_power_of_two(1));
  EXPECT_FALSE(dp::is_power_of_two(0));
  EXPECT_FALSE(dp::is_power_of_two(12));
}

TEST(Buckets, FollowTheReadyOrderAndRespectCaps) {
  // Five float parameters of 40, 40, 100, 10, 10 bytes; one double of 8.
  std::vector<dp::BucketParam> p = {{40, 0}, {40, 0}, {100, 0}, {10, 0}, {10, 0}, {8, 1}};
  std::vector<size_t> reverse = {5, 4, 3, 2, 1, 0};
  auto b = dp::assign_buckets(p, reverse, /*first_cap=*/20, /*cap=*/90);
  // dtype 1 alone; the first float bucket closes at 20 bytes: {4, 3}; 100 >= cap alone; then {1, 0}.
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0], (std::vector<size_t>{5}));
  EXPECT_EQ(b[1], (std::vector<size_t>{4, 3}));
  EXPECT_EQ(b[2], (std::vector<size_t>{2}));
  EXPECT_EQ(b[3], (std::vector<size_t>{1, 0}));
  // One cap larger than everything: one bucket per dtype.
  EXPECT_EQ(dp::assign_buckets(p, reverse, 1 << 20, 1 << 20).size(), 2u);
  // A cap of one byte: one bucket per parameter.
  EXPECT_EQ(dp::assign_buckets(p, reverse, 1, 1).size(), 6u);
  EXPECT_THROW(dp::assign_buckets(p, {0, 1}, 1, 1), ConfigError);
  // PyTorch's rule: a bucket closes once it reaches its cap, so the last
  // layer's weight (larger than the first cap) joins its bias in the first
  // bucket, whose all-reduce then overlaps the backward of the layers before.
  std::vector<dp::BucketParam> mlp = {{400, 0}, {4, 0}, {400, 0}, {4, 0}};  // w1 b1 w2 b2
  auto two = dp::assign_buckets(mlp, {3, 2, 1, 0}, /*first_cap=*/100, /*cap=*/1000);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0], (std::vector<size_t>{3, 2}));
  EXPECT_EQ(two[1], (std::vector<size_t>{1, 0}));
}

TEST(TrainConfig, ParsesFlagsInBothSpellings) {
  auto c = train::parse_train_args({"--model", "mlp", "--layers=5", "--global-batch", "48", "--micro-batch=4",
                                    "--optimizer", "sgd", "--lr", "0.1", "--no-overlap", "--seed", "9"});
  EXPECT_EQ(c.model.kind, "mlp");
  EXPECT_EQ(c.model.layers, 5);
  EXPECT_EQ(c.global_batch, 48);
  EXPECT_EQ(c.micro_batch, 4);
  EXPECT_EQ(c.optimizer, "sgd");
  EXPECT_DOUBLE_EQ(c.lr, 0.1);
  EXPECT_FALSE(c.overlap);
  EXPECT_EQ(c.model.seed, 9u);
  EXPECT_THROW(train::parse_train_args({"--bogus", "1"}), ConfigError);
  EXPECT_THROW(train::parse_train_args({"--steps", "ten"}), ConfigError);
  EXPECT_THROW(train::parse_train_args({"--steps"}), ConfigError);
}

namespace {

// The message resolve() rejects these flags with ("" when it accepts them).
std::string error_of(const std::vector<std::string>& args, int world) {
  return meshtrain::testing::config_error_of([&] { train::resolve(train::parse_train_args(args), world); });
}

}  // namespace

TEST(TrainConfig, ResolveDerivesTheLayoutAndRejectsImpossibleOnes) {
  auto c = train::resolve(train::parse_train_args({"--global-batch", "24"}), 3);
  EXPECT_EQ(c.dp, 3);
  EXPECT_EQ(c.micro_batch, 8);
  EXPECT_EQ(train::accumulation_steps(c), 1);
  c = train::resolve(train::parse_train_args({"--global-batch", "24", "--micro-batch", "2"}), 3);
  EXPECT_EQ(train::accumulation_steps(c), 4);
  EXPECT_NE(error_of({"--global-batch", "10"}, 3).find("--global-batch 10"), std::string::npos);
  EXPECT_NE(error_of({"--global-batch", "24", "--micro-batch", "5"}, 3).find("dp x micro-batch = 3 x 5"), std::string::npos);
  EXPECT_NE(error_of({"--dp", "2"}, 3).find("does not match the world size 3"), std::string::npos);
  EXPECT_NE(error_of({"--strategy", "fsdp"}, 1).find("--strategy 'fsdp'"), std::string::npos);
  EXPECT_NE(error_of({"--optimizer", "lamb"}, 1).find("--optimizer 'lamb'"), std::string::npos);
  EXPECT_NE(error_of({"--strategy", "dp", "--zero", "1"}, 2).find("cannot be combined with --zero"), std::string::npos);
  // The article's master DP computes the loss of the whole model on rank 0: no pipeline, no tensor parallelism.
  EXPECT_NE(error_of({"--strategy", "dp", "--pp", "2"}, 2).find("cannot be combined with --pp 2"), std::string::npos);
  EXPECT_NE(error_of({"--strategy", "dp", "--tp", "2"}, 2).find("or --tp 2"), std::string::npos);
  EXPECT_NE(error_of({"--adam-eps", "0"}, 1).find("--adam-eps 0"), std::string::npos);
  // Explicit pipeline cuts: the first piece of each later stage (the default GPT has 4 pieces).
  c = train::resolve(train::parse_train_args({"--pp", "2", "--stage-boundaries", "3"}), 2);
  EXPECT_EQ(c.stage_boundaries, (std::vector<int64_t>{3}));
  EXPECT_NE(error_of({"--pp", "3", "--stage-boundaries", "2"}, 3).find("gives 1 boundaries for 3 stages"), std::string::npos);
  EXPECT_NE(error_of({"--pp", "3", "--stage-boundaries", "2,2"}, 3).find("2 must be in (2, 4)"), std::string::npos);
  EXPECT_NE(error_of({"--pp", "2", "--stage-boundaries", "4"}, 2).find("4 must be in (0, 4)"), std::string::npos);
  EXPECT_NE(error_of({"--stage-boundaries", "1"}, 1).find("is for pipelines"), std::string::npos);
}

// Model sizes that a layout cannot split are rejected by resolve, which the
// trainer calls before it joins the group, naming the valid choices.
TEST(TrainConfig, ResolveRejectsModelShapesBeforeAnyCommunication) {
  EXPECT_NE(error_of({"--tp", "3", "--heads", "4", "--hidden", "48", "--vocab", "96"}, 3).find("choose tp in {1, 2, 4}"),
            std::string::npos);
  EXPECT_NE(error_of({"--tp", "2", "--vocab", "65"}, 2).find("does not divide --vocab 65"), std::string::npos);
  EXPECT_NE(error_of({"--tp", "2", "--sequence-parallel", "--seq-len", "15"}, 2).find("--seq-len 15"),
            std::string::npos);
  EXPECT_NE(error_of({"--hidden", "30", "--heads", "4"}, 1).find("--hidden 30 must be a positive multiple of --heads 4"),
            std::string::npos);
  EXPECT_NE(error_of({"--data", "/nonexistent/corpus.txt"}, 1).find("--data /nonexistent/corpus.txt: no such file"),
            std::string::npos);
}

// Values that used to wrap around, train to nan or end in a libtorch stack
// trace: each is refused by name before anything starts.
TEST(TrainConfig, OutOfRangeAndNonFiniteValuesAreRefusedByName) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--steps", "4294967297"}, "--steps 4294967297 is out of range"},
      {{"--zero", "4294967297"}, "--zero 4294967297 is out of range"},
      {{"--lr", "inf"}, "--lr 'inf' is not a finite number"},
      {{"--weight-decay", "nan"}, "--weight-decay 'nan' is not a finite number"},
      {{"--weight-decay", "-1"}, "--weight-decay -1 must be >= 0"},
      {{"--momentum", "-5"}, "--momentum -5 must be in [0, 1)"},
      {{"--bucket-cap-mb", "0"}, "--bucket-cap-mb 0 must be positive"},
      {{"--eval-problems", "-1"}, "--eval-problems -1 must be >= 0"},
      {{"--vocab", "5"}, "--vocab 5 is too small for the built-in task"},
      {{"--data", "/dev/zero"}, "--data /dev/zero is not a regular file"},
      {{"--data", "/tmp"}, "--data /tmp is not a regular file"},
  };
  for (const auto& c : cases) EXPECT_NE(error_of(c.first, 1).find(c.second), std::string::npos) << error_of(c.first, 1);
}

// The collective timeout: MESHTRAIN_COMM_TIMEOUT (seconds) sets the default,
// --comm-timeout the trainer's; bad values are named.
TEST(TrainConfig, CommTimeoutFromTheFlagAndTheEnvironment) {
  EXPECT_EQ(comm::CommOptions().timeout, std::chrono::minutes(5));
  setenv("MESHTRAIN_COMM_TIMEOUT", "7.5", 1);
  EXPECT_EQ(comm::CommOptions().timeout, std::chrono::milliseconds(7500));
  setenv("MESHTRAIN_COMM_TIMEOUT", "soon", 1);
  try {
    comm::CommOptions o;
    ADD_FAILURE() << "accepted " << o.timeout.count();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("MESHTRAIN_COMM_TIMEOUT='soon'"), std::string::npos) << e.what();
  }
  unsetenv("MESHTRAIN_COMM_TIMEOUT");
  EXPECT_EQ(train::parse_train_args({"--comm-timeout", "3"}).comm_timeout, 3.0);
  EXPECT_NE(error_of({"--comm-timeout", "-1"}, 1).find("--comm-timeout -1 must be in (0, 86400]"), std::string::npos);
}

TEST(Init, AnySliceEqualsTheSliceOfTheFullTensor) {
  const std::vector<int64_t> shape = {6, 10};
  auto full = init_full(7, "w", InitSpec::normal(0, 1), shape);
  EXPECT_NEAR(full.mean().item<double>(), 0.0, 0.5);
  EXPECT_TRUE(torch::equal(init_slice(7, "w", InitSpec::normal(0, 1), shape, 0, 2, 3), full.slice(0, 2, 5)));
  EXPECT_TRUE(torch::equal(init_slice(7, "w", InitSpec::normal(0, 1), shape, 1, 4, 5), full.slice(1, 4, 9)));
  // Other names or seeds give other values.
  EXPECT_FALSE(torch::equal(init_full(7, "v", InitSpec::normal(0, 1), shape), full));
  EXPECT_FALSE(torch::equal(init_full(8, "w", InitSpec::normal(0, 1), shape), full));
  auto u = init_full(1, "u", InitSpec::uniform(-2, 3), {1000});
  EXPECT_GE(u.min().item<float>(), -2.0f);
  EXPECT_LT(u.max().item<float>(), 3.0f);
}

TEST(Init, SkippedRandomValuesAreNaNOnlyWhileTheGuardLives) {
  const auto computed = init_full(7, "w", InitSpec::normal(0, 1), {4, 5});
  {
    SkipRandomInit skip;
    {
      SkipRandomInit nested;
    }
    EXPECT_TRUE(init_full(7, "w", InitSpec::normal(0, 1), {4, 5}).isnan().all().item<bool>());  // still skipped
    EXPECT_TRUE(init_full(7, "u", InitSpec::uniform(-1, 1), {3}).isnan().all().item<bool>());
    EXPECT_TRUE(torch::equal(init_full(7, "c", InitSpec::constant(2), {3}), torch::full({3}, 2.0f)));  // constants still set
  }
  EXPECT_TRUE(torch::equal(init_full(7, "w", InitSpec::normal(0, 1), {4, 5}), computed));
}

// --init-from: the model built with weights holds them, and nothing of a skipped init.
TEST(Init, AModelBuiltFromWeightsHoldsThemEverywhere) {
  const models::ModelConfig c = meshtrain::testing::tiny_gpt2();
  auto reference = models::build_stage(c, 0, models::num_pieces(c));
  std::map<std::string, at::Tensor> weights;
  for (const auto& kv : reference->named_parameters()) weights[kv.key()] = kv.value().detach() * 3 + 1;
  models::BuildContext ctx;
  ctx.weights = &weights;
  auto loaded = models::build_stage(c, 0, models::num_pieces(c), ctx);
  for (const auto& kv : loaded->named_parameters()) {
    EXPECT_TRUE(torch::equal(kv.value(), weights.at(kv.key()))) << kv.key();
  }
  for (const auto& b : loaded->named_buffers()) EXPECT_FALSE(b.value().isnan().any().item<bool>()) << b.key();
  // The guard ended with the build: a model built after it is computed again.
  auto again = models::build_stage(c, 0, models::num_pieces(c));
  for (const auto& kv : again->named_parameters()) {
    EXPECT_TRUE(torch::equal(kv.value(), reference->named_parameters()[kv.key()])) << kv.key();
  }
}

TEST(Init, ModelsStartFromTheSameWeightsWhateverTheStageSplit) {
  models::ModelConfig c;
  c.layers = 3;
  auto whole = models::build_stage(c, 0, models::num_pieces(c));
  auto first = models::build_stage(c, 0, 2), second = models::build_stage(c, 2, models::num_pieces(c));
  auto all = whole->named_parameters();
  for (auto* part : {&first, &second}) {
    for (const auto& kv : (*part)->named_parameters()) {
      ASSERT_TRUE(all.contains(kv.key())) << kv.key();  // a tied head on its own stage has no weight of its own
      EXPECT_TRUE(torch::equal(kv.value(), all[kv.key()])) << kv.key();
    }
  }
  EXPECT_EQ(models::parameter_count(c), [&] {
    int64_t n = 0;
    for (const auto& p : whole->parameters()) n += p.numel();
    return n;
  }());
}

TEST(Data, GlobalOrderDoesNotDependOnHowItIsSplit) {
  auto d = train::make_arithmetic_dataset(3, 16);
  auto all = d->samples(10, 6);
  auto a = d->samples(10, 2), b = d->samples(12, 4);
  EXPECT_TRUE(torch::equal(all.inputs, torch::cat({a.inputs, b.inputs})));
  EXPECT_TRUE(torch::equal(all.targets.slice(1, 0, 15), all.inputs.slice(1, 1, 16)));  // next-token targets
  const std::string text = train::arithmetic_text(3, 10, 17);
  EXPECT_EQ(text.size(), 17u);
  EXPECT_EQ(all.inputs[0][0].item<int64_t>(), static_cast<unsigned char>(text[0]));
  for (const auto& p : train::arithmetic_eval_problems(3, 20)) {
    const auto plus = p.prompt.find('+');
    EXPECT_EQ(std::stoi(p.prompt.substr(0, plus)) + std::stoi(p.prompt.substr(plus + 1)), std::stoi(p.answer));
  }
  auto m = train::make_classification_dataset(3, 8, 4);
  EXPECT_TRUE(torch::equal(m->samples(0, 4).inputs.slice(0, 2, 4), m->samples(2, 2).inputs));
}

TEST(TensorIo, RoundTripsAndNamesTheProblemWhenCorrupt) {
  std::map<std::string, at::Tensor> t = {{"a.b", torch::arange(6, torch::kFloat).view({2, 3})},
                                         {"c", torch::tensor({1, 2}, torch::kLong)}};
  auto back = deserialize_tensors(serialize_tensors(t), "mem");
  EXPECT_TRUE(torch::equal(back["a.b"], t["a.b"]));
  EXPECT_TRUE(torch::equal(back["c"], t["c"]));
  std::string bytes = serialize_tensors(t);
  EXPECT_THROW(deserialize_tensors(bytes.substr(0, bytes.size() - 3), "x"), ConfigError);
  EXPECT_THROW(deserialize_tensors("garbage-garbage-garbage", "x"), ConfigError);
}

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(meshtrain::sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(meshtrain::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(meshtrain::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // Fed in pieces of every size, the digest is the same.
  std::string million(1000000, 'a');
  meshtrain::Sha256 s;
  for (size_t i = 0, n = 1; i < million.size(); i += n, n = n % 97 + 1) s.update(million.data() + i, std::min(n, million.size() - i));
  EXPECT_EQ(s.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}
