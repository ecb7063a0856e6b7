// Gradient clipping's counting rule and one-process norm, and activation
// checkpointing's policy and gradients (no communication: a world of one).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

#include "meshtrain/comm.h"
#include "meshtrain/models.h"
#include "meshtrain/train.h"
#include "app/trainer/config.h"
#include "app/trainer/memory_check.h"
#include "app/trainer/run_training.h"
#include "meshtrain/util.h"
#include "meshtrain/zero.h"
#include "util/intercept.h"

using namespace meshtrain;

namespace {

std::vector<bool> counted(const std::vector<train::GradPart>& parts) {
  std::vector<bool> out;
  for (const auto& p : parts) out.push_back(p.counted);
  return out;
}

}  // namespace

TEST(ClipGradNorm, CountsReplicasOnceAndSlicesEverywhere) {
  const train::NamedGrads grads = {{"w_col", at::ones({2})}, {"ln", at::ones({2})}, {"w_row", at::ones({2})}};
  const std::map<std::string, int64_t> dims = {{"w_col", 0}, {"ln", -1}, {"w_row", 1}};
  // DDP replicas: dp rank 0 counts; tp slices on every tp rank, replicated ln on tp rank 0.
  EXPECT_EQ(counted(train::count_once(grads, dims, true, {0, 0, 0})), (std::vector<bool>{true, true, true}));
  EXPECT_EQ(counted(train::count_once(grads, dims, true, {0, 0, 1})), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(counted(train::count_once(grads, dims, true, {1, 0, 0})), (std::vector<bool>{false, false, false}));
  // ZeRO shards differ per dp rank: every dp rank counts its own.
  EXPECT_EQ(counted(train::count_once(grads, dims, false, {1, 0, 1})), (std::vector<bool>{true, false, true}));
  // A parameter missing from the tp map is replicated.
  EXPECT_EQ(counted(train::count_once({{"other", at::ones({1})}}, dims, false, {0, 0, 1})), (std::vector<bool>{false}));
}

TEST(ClipGradNorm, MatchesTorchsClipGradNormInOneProcess) {
  torch::manual_seed(3);
  std::vector<at::Tensor> a = {torch::randn({5, 3}), torch::randn({7})}, b;
  for (const auto& t : a) b.push_back(t.clone());
  // The same values as .grad of leaves for torch's reference.
  std::vector<at::Tensor> leaves;
  for (const auto& t : b) {
    at::Tensor p = torch::zeros_like(t).requires_grad_(true);
    p.mutable_grad() = t;
    leaves.push_back(p);
  }
  const double want = torch::nn::utils::clip_grad_norm_(leaves, 0.5);
  std::vector<train::GradPart> parts;
  for (const auto& t : a) parts.push_back({t, true});
  auto world = comm::make_single_process_world();
  const double got = train::clip_grad_norm(parts, 0.5, *world);
  EXPECT_NEAR(got, want, 1e-5 * want);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::allclose(a[i], leaves[i].grad(), 1e-6, 1e-7));
  // Uncounted parts are scaled but not summed; max_norm 0 only measures.
  std::vector<train::GradPart> half = {{a[0], true}, {a[1], false}};
  const double norm0 = a[0].norm().item<double>();
  EXPECT_NEAR(train::clip_grad_norm(half, 0, *world), norm0, 1e-5 * norm0);
  EXPECT_NEAR(a[0].norm().item<double>(), norm0, 1e-6);
}

// The digest of the float32 bytes in name order ("a" before "b"; doubles and
// views converted and made contiguous first), against Python's hashlib:
//   sha256(struct.pack('<3f', 1.0, -2.5, 0.0) + struct.pack('<2f', 0.5, 3.0))
TEST(WeightsSha256, HashesFloat32BytesInNameOrder) {
  std::map<std::string, at::Tensor> params;
  params["b"] = torch::tensor({0.0f, 0.5f, 7.0f, 3.0f}).slice(0, 1, 4, 2);  // a strided view: 0.5, 3.0
  params["a"] = torch::tensor({1.0, -2.5, 0.0}, torch::kDouble);
  EXPECT_EQ(meshtrain::train::weights_sha256(params), "38cc92849cc494d6a10fa18c1d0441bda96337497e03fc6401b7e0917dfe12f6");
  params["a"][2] = -0.0;  // one bit
  EXPECT_NE(meshtrain::train::weights_sha256(params), "38cc92849cc494d6a10fa18c1d0441bda96337497e03fc6401b7e0917dfe12f6");
}

TEST(ActivationCheckpointing, PoliciesNameTheirBlocks) {
  models::ModelConfig gpt;
  gpt.layers = 4;  // pieces: embed, 4 blocks, head
  std::vector<bool> blocks, every2;
  for (int64_t i = 0; i < models::num_pieces(gpt); ++i) {
    blocks.push_back(models::is_checkpointed_piece(gpt, "blocks", i));
    every2.push_back(models::is_checkpointed_piece(gpt, "every-2", i));
    EXPECT_FALSE(models::is_checkpointed_piece(gpt, "none", i));
  }
  EXPECT_EQ(blocks, (std::vector<bool>{false, true, true, true, true, false}));
  EXPECT_EQ(every2, (std::vector<bool>{false, true, false, true, false, false}));
  for (const char* bad : {"all", "every-0", "every-", "every-x", "every--1", "Blocks"}) {
    EXPECT_THROW(models::checkpointing_period(bad), ConfigError) << bad;
  }
  try {
    models::checkpointing_period("every-0");
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'every-0'"), std::string::npos) << e.what();
  }
}

TEST(ActivationCheckpointing, GradientsEqualKeepingActivationsAndDropoutReplays) {
  torch::manual_seed(7);
  torch::nn::Linear a(6, 8), b(8, 4);
  auto block = [&](const at::Tensor& x) { return b(torch::dropout(torch::relu(a(x)), 0.3, true)); };
  std::vector<at::Tensor> params;
  for (auto& p : a->parameters()) params.push_back(p);
  for (auto& p : b->parameters()) params.push_back(p);
  const at::Tensor input = torch::randn({5, 6});

  auto run = [&](bool checkpointed) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    at::Tensor x = input.clone().requires_grad_(true);
    torch::manual_seed(11);  // the dropout mask
    at::Tensor y = checkpointed ? models::checkpoint(block, x, params) : block(x);
    torch::manual_seed(99);  // backward must replay the forward's mask, not this state
    (y * y).sum().backward();
    std::vector<at::Tensor> grads = {y.detach(), x.grad()};
    for (auto& p : params) grads.push_back(p.grad().clone());
    return grads;
  };
  const auto kept = run(false), recomputed = run(true);
  ASSERT_EQ(kept.size(), recomputed.size());
  for (size_t i = 0; i < kept.size(); ++i) EXPECT_TRUE(torch::equal(kept[i], recomputed[i])) << "tensor " << i;
}

TEST(ActivationCheckpointing, AnInputModifiedInPlaceIsAnError) {
  torch::nn::Linear a(3, 3);
  at::Tensor x = torch::randn({2, 3});
  at::Tensor y = models::checkpoint(a, x);
  x.add_(1);
  try {
    y.sum().backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("modified in place"), std::string::npos) << e.what();
  }
}

TEST(TrainingOptionFlags, BadValuesNameTheFlagBeforeAnyCommunication) {
  auto expect_error = [](const std::vector<std::string>& args, const std::string& needle, int world = 1) {
    try {
      train::resolve(train::parse_train_args(args), world);
      ADD_FAILURE() << "accepted: " << args.back();
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({"--clip-grad-norm", "-1"}, "--clip-grad-norm -1");
  expect_error({"--clip-grad-norm", "nan"}, "--clip-grad-norm 'nan' is not a finite number");
  expect_error({"--activation-checkpointing", "all"}, "'all'");
  expect_error({"--model", "mlp", "--hidden", "30", "--tp", "4"}, "--hidden 30", 4);
  const auto c = train::resolve(train::parse_train_args({"--clip-grad-norm", "0.5", "--activation-checkpointing",
                                                         "every-3"}), 1);
  EXPECT_EQ(c.clip_grad_norm, 0.5);
  EXPECT_EQ(c.activation_checkpointing, "every-3");
}

// Units outlive the module they were sharded from: a backward after the
// module is gone still reduces into the shards (no use-after-free), and the
// gradient is the dense one's.
TEST(FullyShard, BackwardAfterTheModuleIsGoneReducesIntoTheShards) {
  torch::manual_seed(3);
  torch::nn::Sequential dense(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
  dense->forward(torch::ones({3, 4})).sum().backward();
  std::vector<at::Tensor> want;
  for (const auto& p : dense->parameters()) want.push_back(p.grad().reshape({-1}));
  at::Tensor y;
  std::vector<at::Tensor> shards;
  {
    torch::manual_seed(3);
    torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
    const auto world = comm::make_single_process_world();
    zero::fully_shard(*model[0], world);
    zero::fully_shard(*model[1], world);
    shards = zero::sharded_parameters(*model);
    y = model->forward(torch::ones({3, 4}));
  }
  y.sum().backward();
  ASSERT_EQ(shards.size(), 2u);
  ASSERT_TRUE(shards[0].grad().defined() && shards[1].grad().defined());
  EXPECT_TRUE(torch::allclose(shards[0].grad(), torch::cat({want[0], want[1]})));
  EXPECT_TRUE(torch::allclose(shards[1].grad(), torch::cat({want[2], want[3]})));
}

// param_dtype bf16: the layers compute in bf16 (the output is the bf16 twin's,
// bit for bit), the optimizer steps the float32 shard, whose gradient is the
// twin's bf16 gradient, and an SGD step changes the float32 values.
TEST(FullyShard, Bf16ParamDtypeComputesInBf16AndStepsFloat32Shards) {
  torch::manual_seed(4);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  torch::nn::Sequential twin(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i) twin->parameters()[i].copy_(model->parameters()[i]);
  }
  const std::vector<at::Tensor> before = twin->parameters();
  std::vector<at::Tensor> masters;
  for (const auto& p : before) masters.push_back(p.detach().reshape({-1}).clone());
  twin->to(torch::kBFloat16);
  const auto world = comm::make_single_process_world();
  zero::fully_shard(*model, world, zero::FullyShardOptions().param_dtype(at::kBFloat16));
  const at::Tensor shard = zero::sharded_parameters(*model).at(0);
  EXPECT_EQ(shard.scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(shard.detach(), torch::cat(masters)));  // the float32 values, not rounded
  const at::Tensor x = torch::randn({5, 8}).to(torch::kBFloat16);
  const at::Tensor y = model->forward(x), y_twin = twin->forward(x);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(torch::equal(y, y_twin));
  y.to(torch::kFloat).pow(2).sum().backward();
  y_twin.to(torch::kFloat).pow(2).sum().backward();
  std::vector<at::Tensor> twin_grads;
  for (const auto& p : twin->parameters()) twin_grads.push_back(p.grad().reshape({-1}).to(torch::kFloat));
  ASSERT_TRUE(shard.grad().defined());
  EXPECT_EQ(shard.grad().scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(shard.grad(), torch::cat(twin_grads)));
  torch::optim::SGD sgd(model->parameters(), 1e-3);
  sgd.step();
  EXPECT_TRUE(torch::allclose(shard.detach(), torch::cat(masters) - 1e-3 * torch::cat(twin_grads)));
}

// Two tensors marked on one storage (ZeRO-1/2 lay parameters end to end in a
// flat buffer, tp::parallelize marks some of them): an operation sees the
// roles of the spans its operands reach, not every role on the storage.
TEST(Intercept, RolesApplyToTheSpanTheyWereMarkedOn) {
  struct Counting : meshtrain::intercept::Role {
    int seen = 0;
    void before(const std::vector<meshtrain::intercept::Role*>&) override { ++seen; }
  };
  const at::Tensor flat = torch::zeros({10});
  const at::Tensor a = flat.narrow(0, 0, 4).view({2, 2}), b = flat.narrow(0, 4, 6);
  auto role_a = std::make_shared<Counting>(), role_b = std::make_shared<Counting>();
  meshtrain::intercept::mark(a, role_a);
  meshtrain::intercept::mark(b, role_b);
  (void)(a.t() * 2);  // a view of a, then a product: two operations on a
  EXPECT_EQ(role_a->seen, 2);
  EXPECT_EQ(role_b->seen, 0);
  (void)(b.narrow(0, 1, 2) + 1);
  EXPECT_EQ(role_a->seen, 2);
  EXPECT_EQ(role_b->seen, 2);
  (void)(flat + 1);  // the buffer itself carries no dispatch key: not intercepted
  EXPECT_EQ(role_a->seen + role_b->seen, 4);
  EXPECT_EQ(meshtrain::intercept::marks_of(flat.narrow(0, 3, 2)).size(), 2u);  // a span reaching both
  EXPECT_EQ(meshtrain::intercept::marks_of(flat.narrow(0, 5, 5)).size(), 1u);
  // A parameter moved onto other storage (ZeRO's flat buffer, a bf16 cast) keeps its role there, and only there.
  const at::Tensor param = torch::zeros({3});
  const at::Tensor old_storage_view = param.detach();  // before the mark: not an intercepted operation
  auto role_p = std::make_shared<Counting>();
  meshtrain::intercept::mark(param, role_p);
  EXPECT_EQ(meshtrain::intercept::marks_of(old_storage_view).size(), 1u);
  meshtrain::intercept::set_data_keeping_marks(param, torch::ones({3}, torch::kBFloat16));
  EXPECT_EQ(param.scalar_type(), at::kBFloat16);
  (void)(param * 2);
  EXPECT_EQ(role_p->seen, 1);
  EXPECT_TRUE(meshtrain::intercept::marks_of(old_storage_view).empty());
}

// The MLP has no shape the planner knows: its model state is estimated for the
// dp ranks of the whole model, then shared by the stages and tp slices. It was
// estimated as a dp x 1 x 1 layout of dp x pp x tp devices, a refusal of every
// --tp or --pp MLP run ("layout dp=2 pp=1 tp=1 does not fit 4 devices").
TEST(MemoryCheck, TheMlpWithPipelineOrTensorParallelismIsEstimated) {
  using meshtrain::train::estimated_rank_bytes;
  auto parse = [](const std::vector<std::string>& args, int world) {
    return meshtrain::train::resolve(meshtrain::train::parse_train_args(args), world);
  };
  const auto whole = parse({"--model", "mlp", "--dp", "2"}, 2);
  const auto tp = parse({"--model", "mlp", "--dp", "2", "--tp", "2"}, 4);
  const auto pp = parse({"--model", "mlp", "--dp", "2", "--pp", "2"}, 4);
  const int64_t per_rank = estimated_rank_bytes(whole);
  EXPECT_GT(per_rank, 0);
  EXPECT_EQ(estimated_rank_bytes(tp), per_rank / 2);
  EXPECT_EQ(estimated_rank_bytes(pp), per_rank / 2);
}

// The trainer consults the planner before allocating: a model that cannot fit
// the machine is refused with the estimate and a layout that would fit.
TEST(MemoryCheck, RefusesWithTheEstimateAndALayoutThatFits) {
  using meshtrain::train::check_memory_fits;
  using meshtrain::train::estimated_rank_bytes;
  auto parse = [](const std::vector<std::string>& args, int world) {
    return meshtrain::train::resolve(meshtrain::train::parse_train_args(args), world);
  };
  const std::vector<std::string> big = {"--hidden", "1024", "--layers", "24", "--heads", "16", "--vocab", "256"};
  std::vector<std::string> ddp = big, zero3 = big;
  zero3.insert(zero3.end(), {"--zero", "3"});
  const auto c_ddp = parse(ddp, 4), c_zero3 = parse(zero3, 4);
  const int64_t need_ddp = estimated_rank_bytes(c_ddp), need_zero3 = estimated_rank_bytes(c_zero3);
  // Adam in fp32: 16 bytes per parameter under DDP, a quarter of that state per rank under ZeRO-3.
  const int64_t params = meshtrain::models::parameter_count(c_ddp.model);
  EXPECT_GE(need_ddp, 16 * params);
  EXPECT_LT(need_zero3, need_ddp / 2);
  EXPECT_NO_THROW(check_memory_fits(c_ddp, 4, 4, 4 * need_ddp));
  const int64_t between = 4 * (need_zero3 + (need_ddp - need_zero3) / 2);  // ZeRO-3 fits, DDP does not
  try {
    check_memory_fits(c_ddp, 4, 4, between);
    ADD_FAILURE() << "DDP needs " << 4 * need_ddp << " bytes, " << between << " available";
  } catch (const meshtrain::ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("4 ranks on this machine"), std::string::npos) << m;
    const size_t at = m.find("the planner suggests ");
    ASSERT_NE(at, std::string::npos) << m;
    // The suggested layout, checked independently: it fits where DDP did not.
    std::vector<std::string> suggested = big;
    std::istringstream flags(m.substr(at + 21, m.find(" (about", at) - at - 21));
    for (std::string word; flags >> word;) suggested.push_back(word);
    const auto c_suggested = parse(suggested, 4);
    EXPECT_LE(4 * estimated_rank_bytes(c_suggested), between) << m;
    EXPECT_FALSE(c_suggested.dp == 4 && c_suggested.zero == 0) << m;
  }
  try {
    check_memory_fits(c_ddp, 1, 1, need_zero3 / 8);
    ADD_FAILURE();
  } catch (const meshtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no layout of 1 rank fits"), std::string::npos) << e.what();
  }
}
