// Tensor parallelism: the conjugate operations, each of tp::parallelize's
// styles against its dense layer (forward, backward, one optimizer step), the
// GPT at tp 2 and 4, with sequence parallelism, dp x tp and pp x tp against
// one process, the article's 128,000 x 8,192 embedding at 1/tp per rank, and
// the errors.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "equivalence.h"
#include "harness.h"
#include "meshtrain/tp.h"
#include "tp/shards.h"
#include "meshtrain/models.h"
#include "meshtrain/util.h"

using meshtrain::comm::Communicator;
using meshtrain::testing::expect_trains_like_one_process;
using meshtrain::testing::run_ranks;
using meshtrain::testing::tiny_gpt;
using meshtrain::testing::tiny_mlp;
namespace tp = meshtrain::tp;

namespace {

meshtrain::comm::CommPtr self(Communicator& c) { return {&c, [](Communicator*) {}}; }

// Each rank's gradient is (rank + 1) * ones: sums are n(n+1)/2.
TEST(TensorParallelOps, ForwardAndBackwardOfEveryConjugatePair) {
  run_ranks(3, [](Communicator& comm) {
    auto t = self(comm);
    const int n = comm.size(), r = comm.rank();
    const double sum = n * (n + 1) / 2.0;
    auto x = torch::full({2, 6, 3}, static_cast<float>(r + 1), torch::requires_grad());
    auto g = torch::full({2, 6, 3}, static_cast<float>(r + 1));

    auto y = tp::copy_to_tp(x, t);  // identity | all-reduce
    EXPECT_TRUE(torch::equal(y, x));
    y.backward(g);
    EXPECT_TRUE(torch::allclose(x.grad(), torch::full_like(g, sum)));
    x.mutable_grad().reset();

    y = tp::reduce_from_tp(x, t);  // all-reduce | identity
    EXPECT_TRUE(torch::allclose(y, torch::full_like(g, sum)));
    y.backward(g);
    EXPECT_TRUE(torch::equal(x.grad(), g));
    x.mutable_grad().reset();

    auto full = torch::arange(2 * 6 * 6, torch::kFloat).view({2, 6, 6}).requires_grad_(true);
    y = tp::scatter_to_tp(full, -1, t);  // split | all-gather
    EXPECT_TRUE(torch::equal(y, full.detach().slice(2, 2 * r, 2 * r + 2)));
    y.backward(torch::full({2, 6, 2}, static_cast<float>(r + 1)));
    for (int p = 0; p < n; ++p) EXPECT_TRUE(torch::equal(full.grad().slice(2, 2 * p, 2 * p + 2), torch::full({2, 6, 2}, p + 1.0f)));

    y = tp::gather_from_tp(x, -1, t);  // all-gather | split
    ASSERT_EQ(y.size(2), 3 * n);
    for (int p = 0; p < n; ++p) EXPECT_TRUE(torch::equal(y.detach().slice(2, 3 * p, 3 * p + 3), torch::full({2, 6, 3}, p + 1.0f)));
    y.backward(torch::arange(2 * 6 * 9, torch::kFloat).view({2, 6, 9}));
    EXPECT_TRUE(torch::equal(x.grad(), torch::arange(2 * 6 * 9, torch::kFloat).view({2, 6, 9}).slice(2, 3 * r, 3 * r + 3)));
    x.mutable_grad().reset();

    // Sequence parallel: dim 1 of [batch, seq, hidden].
    y = tp::gather_from_sp(x, t);  // all-gather seq | reduce-scatter seq
    ASSERT_EQ(y.size(1), 6 * n);
    y.backward(torch::full({2, 6 * n, 3}, static_cast<float>(r + 1)));
    EXPECT_TRUE(torch::allclose(x.grad(), torch::full_like(g, sum)));
    x.mutable_grad().reset();
    y = tp::reduce_scatter_to_sp(x, t);  // reduce-scatter seq | all-gather seq
    ASSERT_EQ(y.size(1), 2);
    EXPECT_TRUE(torch::allclose(y, torch::full({2, 2, 3}, static_cast<float>(sum))));
    y.backward(torch::full({2, 2, 3}, static_cast<float>(r + 1)));
    for (int p = 0; p < n; ++p) EXPECT_TRUE(torch::equal(x.grad().slice(1, 2 * p, 2 * p + 2), torch::full({2, 2, 3}, p + 1.0f)));
  });
}

// A plain layer at path "0" and its dense twin, built from the same seed.
template <typename Layer, typename... Args>
std::pair<torch::nn::Sequential, torch::nn::Sequential> twins(Args... args) {
  torch::manual_seed(1);
  torch::nn::Sequential cut(Layer(args...));
  torch::manual_seed(1);
  torch::nn::Sequential dense(Layer(args...));
  return {cut, dense};
}

torch::nn::LinearImpl& linear(const torch::nn::Sequential& s) { return *s->ptr(0)->as<torch::nn::LinearImpl>(); }

// Each style of tp::parallelize on a plain layer against the same layer
// whole: outputs, the input's gradient, the parameters' gradients (sharded
// slices), and the parameters after one SGD step. The output of a kColwise
// layer gathered (tp::gather_from_tp), and the input of a kRowwise layer
// split by the caller (tp::scatter_to_tp), as Megatron's gather_output and
// input_is_parallel = false do.
TEST(TensorParallelLayers, EachLayerMatchesItsDenseCounterpart) {
  run_ranks(2, [](Communicator& comm) {
    auto t = self(comm);
    const int r = comm.rank();
    torch::manual_seed(1);
    auto x = torch::randn({3, 4, 8});
    for (bool gather : {false, true}) {
      auto [col, dense] = twins<torch::nn::Linear>(8, 6);
      tp::parallelize(*col, t, {{"0", tp::Style::kColwise}});
      auto xi = x.clone().requires_grad_(true), xd = x.clone().requires_grad_(true);
      auto y = col->forward(xi), yd = dense->forward(xd);
      if (gather) y = tp::gather_from_tp(y, -1, t);
      EXPECT_TRUE(torch::allclose(y, gather ? yd : yd.slice(2, 3 * r, 3 * r + 3), 1e-5, 1e-6));
      y.sum().backward();
      (gather ? yd.sum() : yd.slice(2, 0, 6).sum()).backward();
      EXPECT_TRUE(torch::allclose(xi.grad(), xd.grad(), 1e-5, 1e-6)) << "input gradient, gather " << gather;
      EXPECT_TRUE(torch::allclose(linear(col).weight.grad(), linear(dense).weight.grad().slice(0, 3 * r, 3 * r + 3), 1e-5, 1e-6));
      torch::optim::SGD(col->parameters(), 0.1).step();
      torch::optim::SGD(dense->parameters(), 0.1).step();
      EXPECT_TRUE(torch::allclose(linear(col).weight, linear(dense).weight.slice(0, 3 * r, 3 * r + 3), 1e-5, 1e-6));
      EXPECT_TRUE(torch::allclose(linear(col).bias, linear(dense).bias.slice(0, 3 * r, 3 * r + 3), 1e-5, 1e-6));
    }
    for (bool parallel_input : {true, false}) {
      auto [row, dense] = twins<torch::nn::Linear>(8, 5);
      tp::parallelize(*row, t, {{"0", tp::Style::kRowwise}});
      auto xd = x.clone().requires_grad_(true);
      auto xi = (parallel_input ? x.slice(2, 4 * r, 4 * r + 4) : x).clone().requires_grad_(true);
      auto y = row->forward(parallel_input ? xi : tp::scatter_to_tp(xi, -1, t)), yd = dense->forward(xd);
      EXPECT_TRUE(torch::allclose(y, yd, 1e-5, 1e-6));
      y.pow(2).sum().backward();
      yd.pow(2).sum().backward();
      EXPECT_TRUE(torch::allclose(xi.grad(), parallel_input ? xd.grad().slice(2, 4 * r, 4 * r + 4) : xd.grad(), 1e-4, 1e-5));
      EXPECT_TRUE(torch::allclose(linear(row).weight.grad(), linear(dense).weight.grad().slice(1, 4 * r, 4 * r + 4), 1e-4, 1e-5));
      EXPECT_TRUE(torch::allclose(linear(row).bias.grad(), linear(dense).bias.grad(), 1e-4, 1e-5));
      torch::optim::SGD(row->parameters(), 0.1).step();
      torch::optim::SGD(dense->parameters(), 0.1).step();
      EXPECT_TRUE(torch::allclose(linear(row).weight, linear(dense).weight.slice(1, 4 * r, 4 * r + 4), 1e-5, 1e-6));
      EXPECT_TRUE(torch::allclose(linear(row).bias, linear(dense).bias, 1e-5, 1e-6));  // replicated, identical on every rank
    }
    auto [emb, dense] = twins<torch::nn::Embedding>(10, 4);
    tp::parallelize(*emb, t, {{"0", tp::Style::kVocabParallel}});
    auto weight = [](const torch::nn::Sequential& s) { return s->ptr(0)->as<torch::nn::EmbeddingImpl>()->weight; };
    auto ids = torch::tensor({{0, 9, 4, 5}, {7, 2, 2, 1}}, torch::kLong);
    auto y = emb->forward(ids), yd = dense->forward(ids);
    EXPECT_TRUE(torch::allclose(y, yd));
    (y * torch::arange(4, torch::kFloat)).sum().backward();
    (yd * torch::arange(4, torch::kFloat)).sum().backward();
    EXPECT_TRUE(torch::allclose(weight(emb).grad(), weight(dense).grad().slice(0, 5 * r, 5 * r + 5)));
    torch::optim::SGD(emb->parameters(), 0.1).step();
    torch::optim::SGD(dense->parameters(), 0.1).step();
    EXPECT_TRUE(torch::allclose(weight(emb), weight(dense).slice(0, 5 * r, 5 * r + 5)));
    // Vocab-parallel cross-entropy against at::cross_entropy_loss on the gathered logits.
    torch::manual_seed(2);
    auto logits = torch::randn({6, 10});
    auto targets = torch::tensor({0, 9, 4, 5, 7, 3}, torch::kLong);
    auto mine = logits.slice(1, 5 * r, 5 * r + 5).clone().requires_grad_(true);
    auto full = logits.clone().requires_grad_(true);
    auto l = tp::vocab_parallel_cross_entropy(mine, targets, t), ld = at::cross_entropy_loss(full, targets);
    EXPECT_NEAR(l.item<double>(), ld.item<double>(), 1e-6);
    l.backward();
    ld.backward();
    EXPECT_TRUE(torch::allclose(mine.grad(), full.grad().slice(1, 5 * r, 5 * r + 5), 1e-5, 1e-7));
  });
}

TEST(TensorParallel, GptMatchesOneProcessAtTp2And4WithAndWithoutSequenceParallelism) {
  for (int t : {2, 4}) {
    for (bool sp : {false, true}) {
      auto c = tiny_gpt();
      c.tp = t;
      c.sequence_parallel = sp;
      expect_trains_like_one_process(c, t);
    }
  }
  auto c = tiny_gpt();
  c.model.tie_embeddings = false;
  c.tp = 2;
  c.optimizer = "sgd";
  c.momentum = 0.9;
  expect_trains_like_one_process(c, 2);
}

TEST(TensorParallel, DataParallelTimesTensorParallelAndPipelineTimesTensorParallel) {
  auto c = tiny_gpt();
  c.dp = 2;
  c.tp = 2;
  expect_trains_like_one_process(c, 4);
  c.zero = 2;
  expect_trains_like_one_process(c, 4);
  auto p = tiny_gpt();
  p.pp = 2;
  p.tp = 2;
  p.microbatches = 4;
  p.sequence_parallel = true;
  expect_trains_like_one_process(p, 4);
}

// Megatron's MLP: layer pairs column- then row-parallel, an odd last layer
// replicated; alone, with data parallelism (ZeRO-3), across pipeline stages
// (a cut between the column and the row layer sends tp-local activations), and
// with gradient clipping and activation checkpointing.
TEST(TensorParallel, MlpMatchesOneProcessOnEveryAxis) {
  auto c = tiny_mlp();
  c.tp = 2;
  expect_trains_like_one_process(c, 2);
  c.model.layers = 5;  // the last layer stays replicated
  c.tp = 4;
  c.clip_grad_norm = 0.1;
  expect_trains_like_one_process(c, 4);
  auto d = tiny_mlp();
  d.dp = 2;
  d.tp = 2;
  d.zero = 3;
  d.activation_checkpointing = "blocks";
  expect_trains_like_one_process(d, 4);
  auto p = tiny_mlp();
  p.pp = 2;
  p.tp = 2;
  p.microbatches = 4;
  p.stage_boundaries = {1};  // stage 0: the column layer alone
  p.clip_grad_norm = 0.1;
  p.optimizer = "sgd";  // the update is proportional to the clipping coefficient
  expect_trains_like_one_process(p, 4);
}

// The article's scenario-3 tensor: a 128,000 x 8,192 embedding (1.05 B
// parameters) with each of 4 ranks holding 1/4 of it, equal to the matching
// rows of the unsharded tensor's deterministic values. The dense layer tp::
// parallelize cuts is built on uninitialised storage, which the OS commits
// only where written: no rank ever holds more than its quarter. Each rank
// then fills its rows from the full tensor's values (meshtrain/util.h), and a
// look-up of every rank's rows through the cut layer reads them back.
TEST(TensorParallel, TheArticlesEmbeddingAtOneQuarterPerRank) {
  meshtrain::testing::RankOptions options;
  options.time_limit = std::chrono::seconds(300);
  run_ranks(4, [](Communicator& comm) {
    const meshtrain::InitSpec normal = meshtrain::InitSpec::normal(0, 0.02);
    torch::nn::Sequential emb(torch::nn::Embedding(torch::nn::EmbeddingOptions(128000, 8192)._weight(torch::empty({128000, 8192}))));
    tp::parallelize(*emb, self(comm), {{"0", tp::Style::kVocabParallel}});
    torch::Tensor weight = emb->ptr(0)->as<torch::nn::EmbeddingImpl>()->weight;
    ASSERT_EQ(weight.sizes(), (std::vector<int64_t>{32000, 8192}));
    EXPECT_EQ(weight.nbytes(), 32000LL * 8192 * 4);  // 1.05 GB: a quarter of the 4.2 GB tensor
    {
      torch::NoGradGuard no_grad;
      for (int64_t first = 0; first < 32000; first += 4000)
        weight.narrow(0, first, 4000).copy_(meshtrain::init_slice(7, "embed.tok.weight", normal, {128000, 8192}, 0,
                                                                  32000 * comm.rank() + first, 4000));
    }
    const torch::Tensor ids = torch::tensor({{12345, 32000 + 12345, 64000 + 12345, 96000 + 12345}}, torch::kLong);
    const torch::Tensor rows = emb->forward(ids);  // every rank's row, summed over tp
    for (int r = 0; r < 4; ++r) {
      auto want = meshtrain::init_slice(7, "embed.tok.weight", normal, {128000, 8192}, 0, 32000 * r + 12345, 1);
      EXPECT_TRUE(torch::equal(rows[0].slice(0, r, r + 1), want)) << "row of rank " << r;
    }
  }, options);
}

// Dense <-> sharded: the GPT built at tp 2 holds exactly shard() of the dense
// GPT's parameters (the init is the unsharded one, sliced), and unshard()
// of its parameters gives the dense model back.
TEST(TensorParallel, DenseAndShardedGptConvertBothWays) {
  run_ranks(2, [](Communicator& comm) {
    meshtrain::models::ModelConfig m;
    m.heads = 4;
    auto sharded = meshtrain::models::build_stage(m, 0, meshtrain::models::num_pieces(m));
    tp::parallelize(*sharded, self(comm), meshtrain::models::tp_plan(m, *sharded, comm.size(), false));
    auto dense = meshtrain::models::build_stage(m, 0, meshtrain::models::num_pieces(m));
    std::map<std::string, torch::Tensor> full, local;
    for (const auto& kv : dense->named_parameters()) full[kv.key()] = kv.value();
    for (const auto& kv : sharded->named_parameters()) local[kv.key()] = kv.value();
    const auto dims = tp::shard_dims(*sharded);
    int split = 0;
    for (const auto& kv : dims) split += kv.second >= 0;
    EXPECT_GT(split, 0) << "no parameter is split";
    const auto mine = tp::shard(full, dims, comm.rank(), comm.size());
    ASSERT_EQ(mine.size(), local.size());
    for (const auto& kv : local) EXPECT_TRUE(torch::equal(mine.at(kv.first), kv.second)) << kv.first;
    const auto back = tp::unshard(local, dims, comm);
    for (const auto& kv : full) EXPECT_TRUE(torch::equal(back.at(kv.first), kv.second)) << kv.first;
  });
}

// A user's dense module and its tensor-parallel twin (the same module, cut by
// tp::parallelize): equal by construction, and they train alike (three SGD
// steps), at tp 3.
struct DenseNet : torch::nn::Module {
  DenseNet() {
    torch::manual_seed(11);
    embed = register_module("embed", torch::nn::Embedding(12, 6));
    fc1 = register_module("fc1", torch::nn::Linear(6, 9));
    fc2 = register_module("fc2", torch::nn::Linear(9, 4));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return fc2(torch::tanh(fc1(embed(ids)))); }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

TEST(TensorParallelLayers, BuiltFromAUsersDenseLayersTheyTrainLikeThem) {
  run_ranks(3, [](Communicator& comm) {
    auto t = self(comm);
    DenseNet dense;
    auto parallel_ptr = std::make_shared<DenseNet>();
    DenseNet& parallel = *parallel_ptr;
    tp::parallelize(parallel, t, {{"embed", tp::Style::kVocabParallel}, {"fc1", tp::Style::kColwise},
                                  {"fc2", tp::Style::kRowwise}});
    const auto dims = tp::shard_dims(parallel);
    torch::optim::SGD dense_opt(dense.parameters(), 0.2), parallel_opt(parallel.parameters(), 0.2);
    auto ids = torch::tensor({{0, 11, 4, 5}, {7, 2, 8, 1}}, torch::kLong);
    auto target = torch::linspace(-1, 1, 32).view({2, 4, 4});
    for (int step = 0; step < 3; ++step) {
      dense_opt.zero_grad();
      parallel_opt.zero_grad();
      auto yd = dense.forward(ids), y = parallel.forward(ids);
      EXPECT_TRUE(torch::allclose(y, yd, 1e-5, 1e-6)) << "step " << step << " rank " << comm.rank();
      torch::mse_loss(yd, target).backward();
      torch::mse_loss(y, target).backward();
      dense_opt.step();
      parallel_opt.step();
    }
    std::map<std::string, at::Tensor> full;
    for (const auto& kv : dense.named_parameters()) full[kv.key()] = kv.value().detach();
    const auto expected = tp::shard(full, dims, comm.rank(), 3);
    for (const auto& kv : parallel.named_parameters()) {
      EXPECT_TRUE(torch::allclose(kv.value(), expected.at(kv.key()), 1e-5, 1e-6)) << kv.key() << " rank " << comm.rank();
    }
  });
}

// A plan kept as data names its styles; a name that is not one is an error naming the choices.
TEST(TensorParallelLayers, AStyleNameThatIsNoneIsAnErrorNamingTheChoices) {
  EXPECT_EQ(tp::parse_style("colwise"), tp::Style::kColwise);
  EXPECT_EQ(tp::parse_style(tp::style_name(tp::Style::kSequenceParallel)), tp::Style::kSequenceParallel);
  try {
    tp::parse_style("column");
    ADD_FAILURE() << "no error";
  } catch (const meshtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("use colwise, rowwise, vocab_parallel or sequence_parallel"), std::string::npos) << e.what();
  }
}

TEST(TensorParallel, SizesThatDoNotDivideNameTheValidChoices) {
  run_ranks(3, [](Communicator& comm) {
    auto t = self(comm);
    try {
      torch::nn::Sequential q;
      q->push_back("q", torch::nn::Linear(8, 8));
      tp::parallelize(*q, t, {{"q", tp::Style::kColwise}});
      ADD_FAILURE();
    } catch (const meshtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("'q' has 8 output features, which tp 3 does not divide; choose tp in {1, 2, 4, 8}"), std::string::npos) << e.what();
    }
    meshtrain::models::ModelConfig m;  // 4 heads
    try {
      auto stage = meshtrain::models::build_stage(m, 0, meshtrain::models::num_pieces(m));
      tp::parallelize(*stage, t, meshtrain::models::tp_plan(m, *stage, t->size(), false));
      ADD_FAILURE();
    } catch (const meshtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--heads 4"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
