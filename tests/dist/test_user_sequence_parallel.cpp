// tp::parallelize with sequence parallelism on a user's own GPT-like module
// (plain Embedding, LayerNorm and Linear layers, a head tied to the
// embedding): between the cut layers each tp rank holds its part of the
// sequence, and the model trains like one process; what it cannot do is
// refused, naming the fix.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "meshtrain/dp.h"
#include "meshtrain/tp.h"
#include "meshtrain/util.h"

using meshtrain::comm::CommPtr;
using meshtrain::comm::Communicator;
using meshtrain::testing::run_ranks;
namespace tp = meshtrain::tp;

namespace {

constexpr int64_t kVocab = 16, kHidden = 16, kHeadDim = 2, kBlocks = 2, kBatch = 4, kSeq = 8;
constexpr int kSteps = 3;

CommPtr borrowed(Communicator& c) { return CommPtr(&c, [](Communicator*) {}); }

// Token and position embeddings. Under sequence parallelism the token
// embedding's output holds this rank's positions: it adds those rows of the
// table (the one line a user writes for it).
struct Embed : torch::nn::Module {
  Embed() {
    tok = register_module("tok", torch::nn::Embedding(kVocab, kHidden));
    pos = register_parameter("pos", torch::randn({kSeq, kHidden}) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    torch::Tensor x = tok(ids);
    const int64_t part = x.size(1);
    if (!tp) return x + pos.narrow(0, 0, part);
    return x + tp::copy_to_tp(pos, tp).narrow(0, part * tp->rank(), part);
  }
  torch::nn::Embedding tok{nullptr};
  torch::Tensor pos;
  CommPtr tp;  // set when sequence-parallel
};

// Pre-LayerNorm attention and MLP; sizes read from q's output (the whole
// sequence, this rank's heads).
struct Block : torch::nn::Module {
  Block() {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    for (const char* name : {"q", "k", "v", "out"}) layers.emplace(name, register_module(name, torch::nn::Linear(kHidden, kHidden)));
    fc1 = register_module("fc1", torch::nn::Linear(kHidden, 2 * kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(2 * kHidden, kHidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor a = ln1(x), q = layers.at("q")(a);
    const int64_t B = q.size(0), T = q.size(1);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, T, -1, kHeadDim}).transpose(1, 2); };
    auto scores = torch::softmax(torch::matmul(heads(q), heads(layers.at("k")(a)).transpose(-2, -1)), -1);
    auto h = x + layers.at("out")(torch::matmul(scores, heads(layers.at("v")(a))).transpose(1, 2).reshape({B, T, -1}));
    return h + fc2(torch::gelu(fc1(ln2(h))));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  std::map<std::string, torch::nn::Linear> layers;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct Head : torch::nn::Module {
  explicit Head(const torch::Tensor& shared) : weight(register_parameter("weight", shared)) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(ln(x), weight.t()); }
  torch::nn::LayerNorm ln{nullptr};
  torch::Tensor weight;
};

struct Model {
  torch::nn::Sequential seq;
  std::shared_ptr<Embed> embed;
};

Model user_gpt() {
  torch::manual_seed(5);
  Model m{torch::nn::Sequential(), std::make_shared<Embed>()};
  m.seq->push_back(m.embed);
  for (int b = 0; b < kBlocks; ++b) m.seq->push_back(std::make_shared<Block>());
  m.seq->push_back(std::make_shared<Head>(m.embed->tok->weight));
  return m;
}

std::map<std::string, tp::Style> plan() {
  std::map<std::string, tp::Style> p{{"0.tok", tp::Style::kVocabParallel}, {"3.ln", tp::Style::kSequenceParallel}};
  for (int b = 1; b <= kBlocks; ++b) {
    const std::string s = std::to_string(b) + ".";
    for (const char* col : {"q", "k", "v", "fc1"}) p[s + col] = tp::Style::kColwise;
    for (const char* row : {"out", "fc2"}) p[s + row] = tp::Style::kRowwise;
    for (const char* norm : {"ln1", "ln2"}) p[s + norm] = tp::Style::kSequenceParallel;
  }
  return p;
}

// The slice of a one-process parameter tp rank r of n holds under plan().
torch::Tensor tp_slice(const std::string& name, const torch::Tensor& full, int r, int n) {
  auto ends = [&](const char* s) { return name.size() >= strlen(s) && name.compare(name.size() - strlen(s), strlen(s), s) == 0; };
  if (name == "0.tok.weight" || name == "3.weight") return full.chunk(n, 0)[r];
  for (const char* col : {".q.", ".k.", ".v.", ".fc1."})
    if (name.find(col) != std::string::npos) return full.chunk(n, 0)[r];
  if ((name.find(".out.") != std::string::npos || name.find(".fc2.") != std::string::npos) && ends(".weight"))
    return full.chunk(n, 1)[r];
  return full;
}

torch::Tensor tokens(int step) {
  torch::manual_seed(700 + step);
  return torch::randint(0, kVocab, {kBatch, kSeq}, torch::kLong);
}

std::unique_ptr<torch::optim::SGD> sgd(const torch::nn::Module& m) {
  std::vector<torch::Tensor> once;  // the tied weight once
  for (const auto& p : meshtrain::dp::unique_parameters(m)) once.push_back(p.tensor);
  return std::make_unique<torch::optim::SGD>(once, torch::optim::SGDOptions(0.1).momentum(0.9));
}

struct Trained {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
};

// `tp` null: one process.
Trained train(const CommPtr& tp) {
  Model m = user_gpt();
  if (tp) {
    tp::parallelize(*m.seq, tp, plan(), {/*sequence_parallel=*/true});
    m.embed->tp = tp;
  }
  auto opt = sgd(*m.seq);
  Trained r;
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    const torch::Tensor x = tokens(step), targets = (x * 3 + 1) % kVocab;
    const torch::Tensor logits = m.seq->forward(x);
    const torch::Tensor loss =
        tp ? tp::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), tp)
           : torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
    loss.backward();
    opt->step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& kv : m.seq->named_parameters()) r.params[kv.key()] = kv.value().detach().clone();
  return r;
}

}  // namespace

TEST(SequenceParallel, UserModelTrainsLikeOneProcess) {
  const Trained ref = train(nullptr);
  for (int n : {2, 4}) {
    run_ranks(n, [&](Communicator& comm) {
      const Trained got = train(borrowed(comm));
      const std::string where = "tp " + std::to_string(n) + ", rank " + std::to_string(comm.rank());
      for (int s = 0; s < kSteps; ++s) EXPECT_NEAR(got.losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where << " step " << s;
      ASSERT_EQ(got.params.size(), ref.params.size()) << where;
      for (const auto& kv : got.params) {
        EXPECT_TRUE(torch::allclose(kv.second, tp_slice(kv.first, ref.params.at(kv.first), comm.rank(), n), 1e-4, 1e-6))
            << where << " parameter " << kv.first;
      }
    });
  }
}

// Plans that would train wrong are refused before anything changes; a use of a
// cut weight the kernels do not cover, when it runs.
TEST(SequenceParallel, WhatItCannotDoIsRefusedNamingTheFix) {
  run_ranks(2, [&](Communicator& comm) {
    auto refused = [&](const std::map<std::string, tp::Style>& p, bool sp, const std::string& says) {
      Model m = user_gpt();
      try {
        tp::parallelize(*m.seq, borrowed(comm), p, {sp});
        ADD_FAILURE() << "accepted: " << says;
      } catch (const meshtrain::ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      }
    };
    refused(plan(), false, "'1.ln1' is planned kSequenceParallel, which needs ParallelizeOptions{.sequence_parallel = true}");
    auto without_norm = plan();
    without_norm.erase("3.ln");
    refused(without_norm, true, "the LayerNorms [3.ln] see a part of the sequence each; plan them kSequenceParallel");
    refused({{"1", tp::Style::kSequenceParallel}}, true, "applies to a module without children whose parameters are replicated");


    {  // one layer at two paths, or parallelized twice, would be cut twice
      Model m = user_gpt();
      auto* block = dynamic_cast<Block*>(m.seq->ptr(1).get());
      block->register_module("fc1_again", block->fc1);
      try {
        tp::parallelize(*m.seq, borrowed(comm), {{"1.fc1", tp::Style::kColwise}, {"1.fc1_again", tp::Style::kColwise}});
        ADD_FAILURE() << "a layer planned at two paths was accepted";
      } catch (const meshtrain::ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("are one layer (or share their weight): plan it once"), std::string::npos) << e.what();
      }
      tp::parallelize(*m.seq, borrowed(comm), {{"1.fc1", tp::Style::kColwise}});
      try {
        tp::parallelize(*m.seq, borrowed(comm), {{"1.fc1", tp::Style::kColwise}});
        ADD_FAILURE() << "a second parallelize of one layer was accepted";
      } catch (const meshtrain::ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("'1.fc1' is already cut"), std::string::npos) << e.what();
      }
    }
    // A contraction of a cut weight other than x W^T is refused when it runs, with or without gradients.
    Model m = user_gpt();
    tp::parallelize(*m.seq, borrowed(comm), {{"1.fc1", tp::Style::kColwise}, {"1.fc2", tp::Style::kRowwise}});
    auto* block = dynamic_cast<Block*>(m.seq->ptr(1).get());
    const torch::Tensor x = torch::randn({3, kHidden});
    for (bool grad : {true, false}) {
      torch::AutoGradMode mode(grad);
      try {
        (void)torch::mm(x, block->fc1->weight.t());
        ADD_FAILURE() << "mm on a cut weight was accepted";
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find("aten::mm on a cut weight is not supported"), std::string::npos) << e.what();
      }
    }
    // Through the layer it computes the dense layer's slice.
    EXPECT_EQ(block->fc1(x).size(1), kHidden);  // 2 * kHidden / 2
  });
}

// Megatron's count of communications for one training step of the model
// above on tp 2, which q, k and v sharing one communication of their input
// gives (each of them communicating apart would add 2 per block):
//   without SP: per block 2 all-reduces forward (out, fc2) and 2 backward (the
//     inputs of q/k/v and of fc1); the embedding's and the head input's; the
//     loss's 3 (max, sum of exponentials, target logit): 4 x 2 + 2 + 3 = 13
//   with SP: per block 2 all-gathers and 2 reduce-scatters forward, as many
//     backward; the embedding's reduce-scatter and the head's all-gather, each
//     with its conjugate in backward: 10 of each; all-reduces: the norms'
//     weights and biases (4 per block, 2 in the head), the row-parallel
//     biases (2 per block), the position table, the loss's 3: 18.
TEST(SequenceParallel, LayersReadingOneInputShareItsCommunication) {
  for (bool sp : {false, true}) {
    run_ranks(2, [&](Communicator& comm) {
      Model m = user_gpt();
      auto p = plan();
      if (!sp) {
        for (auto it = p.begin(); it != p.end();) it = it->second == tp::Style::kSequenceParallel ? p.erase(it) : std::next(it);
      }
      tp::parallelize(*m.seq, borrowed(comm), p, {sp});
      if (sp) m.embed->tp = borrowed(comm);
      comm.reset_traffic();
      const torch::Tensor x = tokens(0), logits = m.seq->forward(x);
      tp::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), ((x * 3 + 1) % kVocab).reshape({-1}),
                                       borrowed(comm)).backward();
      const auto t = comm.traffic();
      using meshtrain::comm::OpKind;
      EXPECT_EQ(t[OpKind::kAllReduce].calls, sp ? 18 : 13) << (sp ? "SP" : "no SP");
      EXPECT_EQ(t[OpKind::kAllGather].calls, sp ? 10 : 0) << (sp ? "SP" : "no SP");
      EXPECT_EQ(t[OpKind::kReduceScatter].calls, sp ? 10 : 0) << (sp ? "SP" : "no SP");
    });
  }
}
