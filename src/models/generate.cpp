#include "meshtrain/models.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <chrono>

#include "meshtrain/util.h"

namespace meshtrain {
namespace models {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Puts the model in eval mode (no dropout) for the call, and back after.
class EvalMode {
 public:
  explicit EvalMode(torch::nn::Module& m) : m_(m), was_training_(m.is_training()) { m_.eval(); }
  ~EvalMode() { m_.train(was_training_); }

 private:
  torch::nn::Module& m_;
  bool was_training_;
};

// The model's pieces as a decoder: embedding, blocks with caches, head.
class Decoder {
 public:
  Decoder(const ModelConfig& c, StageImpl& model) : model_(model) {
    MESHTRAIN_CHECK(is_language_model(c), "generate: --model ", c.kind, " does not generate text");
    MESHTRAIN_CHECK(static_cast<int64_t>(model.num_pieces()) == num_pieces(c), "generate: the model must be whole (",
                    num_pieces(c), " pieces: embedding, blocks, head); this one has ", model.num_pieces());
    embed_ = std::dynamic_pointer_cast<TokenEmbeddingImpl>(model.piece(0));
    head_ = std::dynamic_pointer_cast<LmHeadImpl>(model.piece(model.num_pieces() - 1));
    for (size_t i = 1; i + 1 < model.num_pieces(); ++i) {
      blocks_.push_back(dynamic_cast<CachedBlock*>(model.piece(i).get()));
      MESHTRAIN_CHECK(blocks_.back(), "generate: piece ", i, " is not a decoder block");
    }
    MESHTRAIN_CHECK(embed_ && head_, "generate: the model's first piece must be its embedding and the last its head");
    caches_.resize(blocks_.size());
  }

  // The logits after the last of `new_ids`, which follow the `start` tokens
  // already in the caches.
  at::Tensor next_logits(const std::vector<int64_t>& new_ids, int64_t start) {
    at::Tensor x = embed_->forward_at(tokens(new_ids), start);
    for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_[i]->forward_cached(x, caches_[i]);
    return head_->forward(x.narrow(1, x.size(1) - 1, 1))[0][0];
  }
  // The same without caches: the whole sequence through the model.
  at::Tensor next_logits_uncached(const std::vector<int64_t>& all_ids) { return model_.forward(tokens(all_ids))[0][-1]; }

 private:
  static at::Tensor tokens(const std::vector<int64_t>& ids) { return at::tensor(ids, at::kLong).view({1, -1}); }
  StageImpl& model_;
  std::shared_ptr<TokenEmbeddingImpl> embed_;
  std::shared_ptr<LmHeadImpl> head_;
  std::vector<CachedBlock*> blocks_;
  std::vector<nn::KVCache> caches_;
};

void check_prompt(const ModelConfig& c, const std::vector<int64_t>& prompt) {
  MESHTRAIN_CHECK(!prompt.empty(), "generate: the prompt is empty; give at least one token (e.g. the tokenizer's BOS)");
  for (int64_t id : prompt) {
    MESHTRAIN_CHECK(id >= 0 && id < c.vocab, "generate: prompt token ", id, " is outside the model's vocabulary [0, ",
                    c.vocab, ")");
  }
  MESHTRAIN_CHECK(static_cast<int64_t>(prompt.size()) <= max_positions(c), "generate: the prompt's ", prompt.size(),
                  " tokens exceed the model's ", max_positions(c), " positions");
}

// Keeps the options' top-k and nucleus of `probs` (sorted descending in
// `order`), zeroing the rest.
at::Tensor truncated(const at::Tensor& probs, const GenerateOptions& o) {
  at::Tensor sorted, order;
  std::tie(sorted, order) = probs.sort(/*dim=*/0, /*descending=*/true);
  int64_t keep = probs.size(0);
  if (o.top_k() > 0) keep = std::min(keep, o.top_k());
  if (o.top_p() < 1.0) {
    const at::Tensor before = sorted.cumsum(0) - sorted;  // mass of the more likely tokens
    keep = std::min(keep, std::max<int64_t>(1, before.lt(o.top_p()).sum().item<int64_t>()));
  }
  at::Tensor out = at::zeros_like(probs);
  out.scatter_(0, order.narrow(0, 0, keep), sorted.narrow(0, 0, keep));
  return out / out.sum();
}

}  // namespace

void check_generate_options(const GenerateOptions& o) {
  MESHTRAIN_CHECK(o.max_new_tokens() >= 1, "generate: --max-new-tokens ", o.max_new_tokens(),
                  " generates nothing; give 1 or more");
  MESHTRAIN_CHECK(std::isfinite(o.temperature()) && o.temperature() >= 0, "generate: --temperature ", o.temperature(),
                  " must be a number >= 0 (0: greedy)");
  MESHTRAIN_CHECK(o.top_k() >= 0, "generate: --top-k ", o.top_k(), " must be >= 0 (0: every token)");
  MESHTRAIN_CHECK(o.top_p() > 0 && o.top_p() <= 1, "generate: --top-p ", o.top_p(), " must be in (0, 1] (1: every token)");
}

void check_finite_weights(const std::map<std::string, at::Tensor>& parameters, const std::string& source) {
  for (const auto& named : parameters) {
    const at::Tensor bad = at::logical_not(at::isfinite(named.second));
    const int64_t count = bad.sum().item<int64_t>();
    MESHTRAIN_CHECK(count == 0, "generate: ", source, ": '", named.first, "' holds ", count, " non-finite values (NaN "
                    "or infinity) of ", named.second.numel(), ": damaged weights, or the training that wrote them diverged. Generate from "
                    "an earlier checkpoint (--resume SAVE_DIR/step-NNNNNNNN), or retrain with a lower --lr or "
                    "--clip-grad-norm");
  }
}

int64_t sample_next(const at::Tensor& logits, const GenerateOptions& o, int64_t step) {
  check_generate_options(o);
  if (o.temperature() == 0) return logits.argmax().item<int64_t>();
  const at::Tensor probs = truncated(at::softmax(logits.to(at::kDouble) / o.temperature(), 0), o);
  const double u = hash_uniform(hash_key(o.seed(), "generate"), static_cast<uint64_t>(step));
  const at::Tensor cdf = probs.cumsum(0);
  const int64_t i = cdf.lt(u).sum().item<int64_t>();  // the first index whose cumulative mass exceeds u
  return std::min(i, probs.size(0) - 1);
}

Generation generate(const ModelConfig& c, StageImpl& model, const std::vector<int64_t>& prompt,
                    const GenerateOptions& o) {
  check_generate_options(o);
  check_prompt(c, prompt);
  at::NoGradGuard no_grad;
  EvalMode eval(model);
  Decoder decoder(c, model);
  Generation g;
  std::vector<int64_t> seq = prompt;
  auto t0 = Clock::now();
  at::Tensor logits = o.use_cache() ? decoder.next_logits(seq, 0) : decoder.next_logits_uncached(seq);
  g.prefill_seconds = seconds_since(t0);
  t0 = Clock::now();
  for (int64_t step = 0; step < o.max_new_tokens(); ++step) {
    const int64_t next = sample_next(predicted_logits(c, logits.unsqueeze(0))[0].to(at::kFloat), o, step);
    g.ids.push_back(next);
    seq.push_back(next);
    const auto& stops = o.stop_ids();
    if (std::find(stops.begin(), stops.end(), next) != stops.end()) {
      g.stopped = true;
      break;
    }
    if (step + 1 == o.max_new_tokens()) break;
    if (static_cast<int64_t>(seq.size()) > max_positions(c)) {  // the new token would sit past the last position
      g.hit_max_positions = true;
      break;
    }
    logits = o.use_cache() ? decoder.next_logits({next}, static_cast<int64_t>(seq.size()) - 1)
                           : decoder.next_logits_uncached(seq);
  }
  g.decode_seconds = seconds_since(t0);
  return g;
}

}  // namespace models
}  // namespace meshtrain
