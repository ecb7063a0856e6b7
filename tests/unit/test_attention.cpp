// Flash attention (meshtrain/nn.h) against the eager softmax attention:
// outputs and gradients, grouped-query heads, tiles that do not divide the
// sequence, decoding offsets, partial results merged by log-sum-exp, and the
// bytes it keeps for backward, measured.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "meshtrain/nn.h"
#include "meshtrain/models.h"
#include "util/memory.h"

namespace meshtrain {
namespace models {
namespace {

using namespace ::meshtrain::nn;

struct Inputs {
  at::Tensor q, k, v, dout;
};

Inputs random_inputs(int64_t B, int64_t H, int64_t KV, int64_t Tq, int64_t Tk, int64_t d, at::ScalarType type,
                     uint64_t seed) {
  at::manual_seed(seed);
  const auto o = at::TensorOptions().dtype(at::kDouble);
  Inputs in;
  // Scaled up so that the softmax is far from uniform (large score differences).
  in.q = (at::randn({B, H, Tq, d}, o) * 2).to(type).requires_grad_();
  in.k = (at::randn({B, KV, Tk, d}, o) * 2).to(type).requires_grad_();
  in.v = at::randn({B, KV, Tk, d}, o).to(type).requires_grad_();
  in.dout = at::randn({B, H, Tq, d}, o).to(type);
  return in;
}

struct Result {
  at::Tensor out, dq, dk, dv;
};

template <typename Attention>
Result run(const Inputs& in, Attention attention) {
  const at::Tensor q = in.q.detach().requires_grad_(), k = in.k.detach().requires_grad_(),
                   v = in.v.detach().requires_grad_();
  const at::Tensor out = attention(q, k, v);
  out.backward(in.dout);
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

double max_error(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

void expect_close(const Result& got, const Result& want, double tolerance, const std::string& what) {
  EXPECT_LE(max_error(got.out, want.out), tolerance) << what << ": output";
  EXPECT_LE(max_error(got.dq, want.dq), tolerance) << what << ": dq";
  EXPECT_LE(max_error(got.dk, want.dk), tolerance) << what << ": dk";
  EXPECT_LE(max_error(got.dv, want.dv), tolerance) << what << ": dv";
}

Result eager(const Inputs& in) {
  return run(in, [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) { return causal_attention(q, k, v); });
}

Result flash(const Inputs& in, FlashOptions options) {
  return run(in, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return flash_attention(q, k, v, options);
  });
}

struct Shape {
  int64_t B, H, KV, Tq, Tk, d, query_block, key_block;
};

// fp64: the two computations differ only by reassociation, far below 1e-10.
TEST(FlashAttention, MatchesEagerInFp64OnEveryShape) {
  const std::vector<Shape> shapes = {
      {2, 4, 4, 37, 37, 8, 8, 16},    // tiles that do not divide T, query tile != key tile
      {1, 6, 2, 40, 40, 16, 16, 8},   // grouped-query: 3 query heads per key head
      {2, 4, 1, 33, 33, 8, 128, 128}, // one tile; multi-query
      {1, 4, 2, 5, 29, 8, 4, 8},      // decoding: 5 queries at positions 24..28
      {1, 2, 2, 1, 17, 8, 1, 4},      // one query over a cache
  };
  for (const Shape& s : shapes) {
    const Inputs in = random_inputs(s.B, s.H, s.KV, s.Tq, s.Tk, s.d, at::kDouble, 7);
    expect_close(flash(in, {s.query_block, s.key_block}), eager(in), 1e-10,
                 "B " + std::to_string(s.B) + " H " + std::to_string(s.H) + " KV " + std::to_string(s.KV) + " Tq " +
                     std::to_string(s.Tq) + " Tk " + std::to_string(s.Tk));
  }
}

TEST(FlashAttention, MatchesEagerInFp32AndBf16) {
  const Inputs in = random_inputs(2, 4, 2, 70, 70, 16, at::kDouble, 11);
  const Result exact = eager(in);
  auto cast = [](const Inputs& i, at::ScalarType t) {
    return Inputs{i.q.detach().to(t), i.k.detach().to(t), i.v.detach().to(t), i.dout.to(t)};
  };
  // fp32: float rounding of sums over <= 70 terms of O(10) magnitude.
  expect_close(flash(cast(in, at::kFloat), {32, 16}), exact, 2e-4, "fp32");
  // bf16 inputs, fp32 statistics: the flash result is no further from the
  // exact one than eager attention run in bf16 is (plus bf16's own rounding).
  const Result eager16 = eager(cast(in, at::kBFloat16)), flash16 = flash(cast(in, at::kBFloat16), {32, 16});
  EXPECT_LE(max_error(flash16.out, exact.out), max_error(eager16.out, exact.out) + 0.02);
  EXPECT_LE(max_error(flash16.dq, exact.dq), max_error(eager16.dq, exact.dq) + 0.1);
  EXPECT_EQ(flash16.out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(flash16.dq.scalar_type(), at::kBFloat16);
}

// Context parallelism's contract: attention over the keys split in two
// parts, merged by log-sum-exp, is the attention over all of them; the
// backward of each part with the merged output gives the part's dk and dv
// and dq contributions that add up to the whole dq.
TEST(FlashAttention, PartsMergeByLogSumExpForwardAndBackward) {
  const int64_t B = 2, KV = 2, G = 2, T = 24, d = 8, cut = 10;
  at::manual_seed(3);
  const auto o = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::randn({B, KV, T, G, d}, o), k = at::randn({B, KV, T, d}, o), v = at::randn({B, KV, T, d}, o);
  const at::Tensor dout = at::randn({B, KV, T, G, d}, o);
  const FlashOptions tiles{4, 4};
  const AttentionPart whole = flash_forward(q, k, v, 0, 0, tiles);
  const AttentionPart first = flash_forward(q, k.narrow(2, 0, cut), v.narrow(2, 0, cut), 0, 0, tiles);
  const AttentionPart second = flash_forward(q, k.narrow(2, cut, T - cut), v.narrow(2, cut, T - cut), 0, cut, tiles);
  // Queries before position `cut` see no key of the second part.
  EXPECT_TRUE(at::isinf(second.lse.narrow(2, 0, cut)).all().item<bool>());
  EXPECT_EQ(second.out.narrow(2, 0, cut).abs().max().item<double>(), 0.0);
  const AttentionPart merged = merge_attention(first, second);
  EXPECT_LE(max_error(merged.out, whole.out), 1e-12);
  EXPECT_LE(max_error(merged.lse, whole.lse), 1e-12);

  const AttentionGrads all = flash_backward(q, k, v, whole.out, whole.lse, dout, 0, 0, tiles);
  const AttentionGrads a = flash_backward(q, k.narrow(2, 0, cut), v.narrow(2, 0, cut), merged.out, merged.lse, dout,
                                          0, 0, tiles);
  const AttentionGrads b = flash_backward(q, k.narrow(2, cut, T - cut), v.narrow(2, cut, T - cut), merged.out,
                                          merged.lse, dout, 0, cut, tiles);
  EXPECT_LE(max_error(a.dq + b.dq, all.dq), 1e-12);
  EXPECT_LE(max_error(at::cat({a.dk, b.dk}, 2), all.dk), 1e-12);
  EXPECT_LE(max_error(at::cat({a.dv, b.dv}, 2), all.dv), 1e-12);
}

TEST(FlashAttention, KernelChoiceAndBadInput) {
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, kFlashFromSeqLen - 1), AttentionKernel::kEager);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, kFlashFromSeqLen), AttentionKernel::kFlash);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kEager, 1 << 20), AttentionKernel::kEager);
  EXPECT_EQ(parse_attention_kernel("flash"), AttentionKernel::kFlash);
  try {
    parse_attention_kernel("sdpa");
    FAIL() << "sdpa accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--attention sdpa"), std::string::npos) << e.what();
  }
  const at::Tensor q = at::zeros({1, 3, 4, 8}), k = at::zeros({1, 2, 4, 8});
  EXPECT_THROW(flash_attention(q, k, k), std::exception);  // 2 key heads do not divide 3 query heads
}

// What the graph keeps after a forward: heap in use with the output alive
// minus before (the inputs exist before).
int64_t kept_bytes(const Inputs& in, bool use_flash) {
  const at::Tensor q = in.q.detach().requires_grad_(), k = in.k.detach().requires_grad_(),
                   v = in.v.detach().requires_grad_();
  const int64_t before = heap_bytes_in_use();
  at::Tensor out = use_flash ? flash_attention(q, k, v) : causal_attention(q, k, v);
  const int64_t kept = heap_bytes_in_use() - before;
  out.backward(in.dout);  // the graph is whole: it still runs
  return kept;
}

// With contiguous inputs and one query head per key head the kernel copies
// none of q, k, v: it keeps its output and the fp32 log-sum-exp, B T H d +
// B H T values, linear in T (plus autograd's bookkeeping, a few KiB); eager
// keeps the B H T^2 softmax.
TEST(FlashAttention, KeepsBytesLinearInSequenceLength) {
  const int64_t B = 1, H = 4, d = 16;
  for (const int64_t T : {512, 1024}) {
    const Inputs in = random_inputs(B, H, H, T, T, d, at::kFloat, 5);
    kept_bytes(in, true);  // warm up: thread pools and caches first
    kept_bytes(in, false);
    const int64_t want_flash = 4 * (B * T * H * d + B * H * T);
    const int64_t got_flash = kept_bytes(in, true), got_eager = kept_bytes(in, false);
    EXPECT_NEAR(static_cast<double>(got_flash), static_cast<double>(want_flash), 8192.0) << "T " << T;
    EXPECT_GE(got_eager, 4 * B * H * T * T) << "T " << T;  // eager stores the T x T softmax
  }
}

// The whole model: GPT and Llama (grouped-query) with flash attention give
// eager's loss and every parameter's gradient up to float reassociation.
TEST(FlashAttention, ModelsTrainAsWithEagerAttention) {
  for (const std::string kind : {"gpt", "llama"}) {
    ModelConfig c;
    c.kind = kind;
    c.seq_len = 45, c.hidden = 32, c.heads = 4, c.kv_heads = kind == "llama" ? 2 : 0, c.layers = 2;
    c.tie_embeddings = kind != "llama";
    const at::Tensor tokens = at::randint(c.vocab, {3, c.seq_len + 1}, at::kLong);
    std::vector<std::pair<double, std::vector<at::Tensor>>> results;
    for (const auto kernel : {AttentionKernel::kEager, AttentionKernel::kFlash}) {
      c.attention = kernel;
      Stage model = build_stage(c, 0, num_pieces(c));
      at::Tensor l = loss(c, model->forward(tokens.narrow(1, 0, c.seq_len)), tokens.narrow(1, 1, c.seq_len));
      l.backward();
      std::vector<at::Tensor> grads;
      for (const at::Tensor& p : model->parameters()) grads.push_back(p.grad().clone());
      results.push_back({l.item<double>(), grads});
    }
    EXPECT_NEAR(results[1].first, results[0].first, 1e-5) << kind;
    for (size_t i = 0; i < results[0].second.size(); ++i) {
      const at::Tensor &e = results[0].second[i], &f = results[1].second[i];
      EXPECT_LE(max_error(f, e), 1e-5 * (1 + e.abs().max().item<double>())) << kind << " parameter " << i;
    }
  }
}

}  // namespace
}  // namespace models
}  // namespace meshtrain
