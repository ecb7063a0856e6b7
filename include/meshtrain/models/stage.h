#pragma once
// A model as a sequence of pieces (MLP: its layers; GPT: embedding, blocks,
// head). A Stage holds a contiguous run of pieces — the whole model, or one
// pipeline stage — as one Module whose parameters keep the full model's names
// ("blocks.3.attn.q.weight" whichever stage holds block 3), so checkpoints and
// comparisons line up across layouts.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/pimpl.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

namespace meshtrain {
namespace models {

class StageImpl : public torch::nn::Module {
 public:
  // Appends a piece. `group` nests it ("blocks" + key "3" -> "blocks.3"); an
  // empty group registers it at the top ("embed").
  template <typename ModuleHolder>
  void append(const std::string& group, const std::string& key, ModuleHolder piece) {
    if (group.empty()) {
      register_module(key, piece.ptr());
    } else {
      dict(group)->update({{key, piece.ptr()}});
    }
    pieces_.emplace_back(piece);
    checkpointed_.emplace_back();
  }
  // Applies the pieces in order.
  at::Tensor forward(at::Tensor x);
  // Applies pieces [first, last) only (pipeline virtual stages, tests).
  at::Tensor forward_range(at::Tensor x, size_t first, size_t last);
  size_t num_pieces() const { return pieces_.size(); }
  std::shared_ptr<torch::nn::Module> piece(size_t i) const { return pieces_.at(i).ptr(); }
  // Piece i recomputes its activations in backward (models/checkpointing.h).
  // The recompute's gradients go to the parameters the piece has now: set it
  // before zero::fully_shard, which replaces them in the piece's parameter
  // list by its shard (the layers keep computing with them).
  void set_checkpointed(size_t i, bool on);
  bool checkpointed(size_t i) const { return checkpointed_.at(i).has_value(); }

 private:
  torch::nn::ModuleDict dict(const std::string& group);
  std::vector<torch::nn::AnyModule> pieces_;
  std::vector<c10::optional<std::vector<at::Tensor>>> checkpointed_;  // the parameters, when checkpointed
};
TORCH_MODULE(Stage);

}  // namespace models
}  // namespace meshtrain
