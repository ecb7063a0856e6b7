#include "meshtrain/models.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include "meshtrain/util.h"

namespace meshtrain {
namespace models {

namespace {

thread_local CheckpointPass current_pass = CheckpointPass::kNone;

// The pass this thread runs while it lives, the enclosing one after.
class InPass {
 public:
  explicit InPass(CheckpointPass pass) : outer_(current_pass) { current_pass = pass; }
  ~InPass() { current_pass = outer_; }

 private:
  CheckpointPass outer_;
};

// Puts the forward's generator state back for the recompute, and the current one after.
class RngReplay {
 public:
  explicit RngReplay(const at::Tensor& forward_state) : now_(cpu_rng_state()) { set_cpu_rng_state(forward_state); }
  ~RngReplay() { set_cpu_rng_state(now_); }

 private:
  at::Tensor now_;
};

class RecomputeBackward : public torch::autograd::Node {
 public:
  RecomputeBackward(BlockFn fn, at::Tensor input, std::vector<at::Tensor> params)
      : fn_(std::move(fn)),
        input_(input.detach()),
        input_version_(input._version()),
        input_requires_grad_(input.requires_grad()),
        params_(std::move(params)),
        rng_(cpu_rng_state()) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    MESHTRAIN_CHECK(input_.defined(), "activation checkpointing: backward ran twice through one checkpointed block");
    MESHTRAIN_CHECK(input_._version() == input_version_, "activation checkpointing: the input of a checkpointed block "
                    "was modified in place after its forward; recomputing from it would give wrong gradients");
    torch::autograd::variable_list out(1 + params_.size());
    if (!grads[0].defined()) return out;
    at::Tensor x = input_.detach().requires_grad_(input_requires_grad_);
    at::Tensor y;
    {
      at::AutoGradMode enable(true);
      RngReplay replay(rng_);
      InPass recompute(CheckpointPass::kRecompute);
      y = fn_(x);
    }
    // Gradients of the tensors that need them; the others stay undefined.
    torch::autograd::variable_list wrt;
    std::vector<size_t> slot;
    if (input_requires_grad_) {
      wrt.push_back(x);
      slot.push_back(0);
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].requires_grad()) continue;
      wrt.push_back(params_[i]);
      slot.push_back(1 + i);
    }
    if (wrt.empty() || !y.requires_grad()) return out;
    torch::autograd::variable_list g = torch::autograd::grad({y}, wrt, {grads[0]}, false, false, /*allow_unused=*/true);
    for (size_t k = 0; k < g.size(); ++k) out[slot[k]] = g[k];
    release_variables();
    return out;
  }
  std::string name() const override { return "meshtrain::ActivationCheckpointBackward"; }
  void release_variables() override { input_ = at::Tensor(); }

 private:
  BlockFn fn_;
  at::Tensor input_;
  uint32_t input_version_;
  bool input_requires_grad_;
  std::vector<at::Tensor> params_;
  at::Tensor rng_;
};

}  // namespace

CheckpointPass checkpoint_pass() { return current_pass; }

at::Tensor checkpoint(BlockFn fn, const at::Tensor& input, std::vector<at::Tensor> params) {
  bool needs_grad = input.requires_grad();
  for (const auto& p : params) needs_grad = needs_grad || p.requires_grad();
  if (!at::GradMode::is_enabled() || !needs_grad) return fn(input);
  auto node = std::shared_ptr<RecomputeBackward>(new RecomputeBackward(fn, input, params),
                                                 torch::autograd::deleteNode);
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    // Nested in an outer block's recompute, this first pass is a recompute too.
    InPass first(current_pass == CheckpointPass::kRecompute ? CheckpointPass::kRecompute : CheckpointPass::kFirst);
    y = fn(input);
    if (y.is_view() || y.is_same(input)) y = y.clone();  // the output must own its autograd history
  }
  torch::autograd::variable_list edges{input};
  edges.insert(edges.end(), params.begin(), params.end());
  node->set_next_edges(torch::autograd::collect_next_edges(edges));
  torch::autograd::create_gradient_edge(y, node);
  return y;
}

int checkpointing_period(const std::string& policy) {
  if (policy == "none") return 0;
  if (policy == "blocks") return 1;
  const std::string prefix = "every-";
  if (policy.rfind(prefix, 0) == 0 && policy.size() > prefix.size() && policy.size() <= prefix.size() + 4 &&
      policy.find_first_not_of("0123456789", prefix.size()) == std::string::npos) {
    const int n = std::stoi(policy.substr(prefix.size()));
    if (n >= 1) return n;
  }
  throw ConfigError(str_cat("--activation-checkpointing '", policy,
                            "' is not a policy; use none, blocks (recompute every block) or every-N (every N-th "
                            "block, N >= 1, e.g. every-2)"));
}

bool is_checkpointed_piece(const ModelConfig& c, const std::string& policy, int64_t piece) {
  const int period = checkpointing_period(policy);
  if (period == 0) return false;
  int64_t block = piece;  // MLP: every layer is a block
  if (is_language_model(c)) {
    if (piece == 0 || piece == num_pieces(c) - 1) return false;  // embedding, head
    block = piece - 1;
  }
  return block % period == 0;
}

void apply_checkpointing(StageImpl& stage, const ModelConfig& c, const std::string& policy, int64_t first_piece) {
  for (size_t i = 0; i < stage.num_pieces(); ++i)
    stage.set_checkpointed(i, is_checkpointed_piece(c, policy, first_piece + static_cast<int64_t>(i)));
}

}  // namespace models
}  // namespace meshtrain
