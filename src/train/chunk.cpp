#include "chunk.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>

#include "meshtrain/dp.h"
#include "train/mixed_precision.h"
#include "train/optim.h"
#include "meshtrain/util.h"
#include "util/shard.h"
#include "zero/optimizer_state.h"
#include "meshtrain/zero.h"

namespace meshtrain {
namespace train {

namespace {

// The full shape of a parameter whose local tensor is this rank's tp slab.
std::vector<int64_t> full_shape(const at::Tensor& local, int64_t tp_dim, int tp_size) {
  std::vector<int64_t> shape = local.sizes().vec();
  if (tp_dim >= 0) shape[tp_dim] *= tp_size;
  return shape;
}

int64_t tp_dim_of(const ShardPlace& place, const std::string& name) {
  auto it = place.tp_dims.find(name);
  return it == place.tp_dims.end() || place.tp_size == 1 ? -1 : it->second;
}

StateChunk make_chunk(const std::string& param, const std::string& kind, const at::Tensor& local_param,
                      const ShardPlace& place, int64_t offset, const at::Tensor& data) {
  const int64_t dim = tp_dim_of(place, param);
  return StateChunk{param, kind, full_shape(local_param, dim, place.tp_size), dim, dim < 0 ? 0 : place.tp_index,
                    dim < 0 ? 1 : place.tp_size, offset, data.detach().reshape({-1})};
}

// This rank's tp slab of a full tensor read from a checkpoint.
at::Tensor local_part(CheckpointReader& reader, const std::string& param, const std::string& kind,
                      const at::Tensor& local_param, const ShardPlace& place) {
  at::Tensor full = reader.full(param, kind);
  if (!full.defined()) return full;
  const int64_t dim = tp_dim_of(place, param);
  MESHTRAIN_CHECK(full.numel() == local_param.numel() * (dim < 0 ? 1 : place.tp_size), "checkpoint: parameter '",
                  param, "' has ", full.numel(), " elements in the checkpoint but the model's needs ",
                  local_param.numel() * (dim < 0 ? 1 : place.tp_size), "; was it saved from another model shape?");
  return (dim < 0 ? full : full.chunk(place.tp_size, dim)[place.tp_index]).contiguous().view_as(local_param);
}

// A tensor every dp rank holds alike: each writes its 1/dp of it, so the
// ranks share the writing (and an asynchronous save's snapshot copy).
void add_replicated(const std::string& param, const std::string& kind, const at::Tensor& local, const at::Tensor& data,
                    const ShardPlace& place, RankState& out) {
  const Range mine = shard_range(data.numel(), place.dp_size, place.dp_rank);
  if (mine.size == 0) return;
  const at::Tensor part = data.reshape({-1}).narrow(0, mine.offset, mine.size);
  out.chunks.push_back(make_chunk(param, kind, local, place, mine.offset, part));
}

// Whole parameters with their optimizer state (plain and DDP chunks).
void add_whole(const std::vector<dp::NamedParam>& params, torch::optim::Optimizer& opt, RankState& out,
               const ShardPlace& place) {
  for (const auto& p : params) {
    add_replicated(p.name, "value", p.tensor, p.tensor, place, out);
    for (const auto& kv : zero::state_of(opt, p.tensor)) {
      if (kv.first == "step") out.steps[p.name] = kv.second.item<int64_t>();
      else add_replicated(p.name, kv.first, p.tensor, kv.second, place, out);
    }
  }
}

void load_whole(const std::vector<dp::NamedParam>& params, torch::optim::Optimizer& opt, CheckpointReader& reader,
                const ShardPlace& place) {
  at::NoGradGuard no_grad;
  for (auto p : params) {
    MESHTRAIN_CHECK(reader.has(p.name), "checkpoint has no parameter '", p.name, "' (saved from another model?)");
    p.tensor.copy_(local_part(reader, p.name, "value", p.tensor, place));
    std::map<std::string, at::Tensor> state;
    for (const char* kind : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}) {
      at::Tensor t = local_part(reader, p.name, kind, p.tensor, place);
      if (t.defined()) state[kind] = t;
    }
    if (auto step = reader.optimizer_step(p.name)) state["step"] = at::scalar_tensor(*step, at::kLong);
    zero::set_state(opt, p.tensor, state);
  }
}

// ZeRO: every dp rank writes its pieces' optimizer state (values too for stage 3).
void add_pieces(const std::vector<dp::NamedParam>& named, std::vector<zero::OwnedPiece> pieces, bool values,
                RankState& out, const ShardPlace& place) {
  std::map<std::string, at::Tensor> params;
  for (const auto& p : named) params[p.name] = p.tensor;
  if (!values) {
    for (const auto& p : params) add_replicated(p.first, "value", p.second, p.second, place, out);
  }
  for (const auto& piece : pieces) {
    const at::Tensor& local = params.at(piece.param);
    if (values) out.chunks.push_back(make_chunk(piece.param, "value", local, place, piece.offset, piece.value));
    for (const auto& kv : piece.state) {
      if (kv.first == "step") out.steps[piece.param] = kv.second.item<int64_t>();
      else out.chunks.push_back(make_chunk(piece.param, kv.first, local, place, piece.offset, kv.second));
    }
  }
}

// ZeRO: the full (tp-local) state of the chunk, for load_state.
zero::FullState full_state(const std::vector<dp::NamedParam>& params, CheckpointReader& reader,
                           const ShardPlace& place) {
  zero::FullState s;
  for (const auto& p : params) {
    MESHTRAIN_CHECK(reader.has(p.name), "checkpoint has no parameter '", p.name, "' (saved from another model?)");
    s.parameters[p.name] = local_part(reader, p.name, "value", p.tensor, place);
    for (const char* kind : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}) {
      at::Tensor t = local_part(reader, p.name, kind, p.tensor, place);
      if (t.defined()) s.optimizer[p.name][kind] = t;
    }
    if (auto step = reader.optimizer_step(p.name)) s.optimizer[p.name]["step"] = at::scalar_tensor(*step, at::kLong);
  }
  return s;
}

std::vector<at::Tensor> tensors(const std::vector<dp::NamedParam>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.tensor);
  return out;
}

mesh::Coord coord_of(const ShardPlace& place) { return mesh::Coord{place.dp_rank, 0, place.tp_index}; }

// Whole parameters on every dp rank: plain training (dp 1) or DDP, in fp32 or
// mixed (parameters in param_dtype, fp32 masters that the optimizer steps and
// checkpoints hold: train/mixed_precision.h).
class WholeChunk : public ChunkTrainer {
 public:
  WholeChunk(const TrainerOptions& o, const Trainer::MakeOptimizer& make_optimizer,
             std::shared_ptr<torch::nn::Module> module, comm::CommPtr dp, std::set<const void*>& stepped_elsewhere)
      : ChunkTrainer(std::move(module)) {
    for (const auto& p : dp::unique_parameters(*module_)) {
      if (stepped_elsewhere.insert(p.tensor.unsafeGetTensorImpl()).second) {
        stepped_.push_back(p);
        own_.push_back(p);
        continue;
      }
      // Each chunk's masters would step their own copy and write it back last-wins.
      MESHTRAIN_CHECK(!o.param_dtype(), "train::Trainer: parameter '", p.name, "' is shared with an earlier "
                           "chunk of this rank (tied), and mixed precision keeps float32 masters per chunk; place "
                           "the tied children on different pipeline ranks (pp > 1) or train without virtual stages");
    }
    if (o.param_dtype()) {
      masters_.emplace(*module_, *o.param_dtype());
      stepped_ = masters_->masters();
    }
    if (dp->size() > 1) {
      reduce_dtype_ = o.ddp().reduce_dtype();
      dp_ = std::move(dp);
      ddp_ = std::make_unique<dp::DistributedDataParallel>(module_, dp_, o.ddp());
    }
    opt_ = make_optimizer(tensors(stepped_));
  }
  void zero_grad() override {
    opt_->zero_grad();
    if (masters_) masters_->zero_model_grad();
  }
  void finish_gradients() override {
    if (masters_) masters_->gradients_to_masters();
  }
  std::vector<GrainGradient> grain_gradients() override {
    std::vector<GrainGradient> out;
    for (const auto& p : own_) {  // a parameter shared with an earlier chunk is that chunk's
      if (!p.tensor.requires_grad()) continue;
      at::Tensor& g = p.tensor.mutable_grad();
      if (!g.defined()) g = at::zeros_like(p.tensor);  // unused this micro-batch: a zero grain
      out.push_back({g, g.scalar_type()});
    }
    return out;
  }
  void step() override {
    opt_->step();
    if (masters_) masters_->masters_to_parameters();
  }
  torch::optim::Optimizer& optimizer() override { return *opt_; }
  std::map<std::string, at::Tensor> parameters_on_dp_root() override {
    if (dp_ && dp_->rank() != 0) return {};
    std::map<std::string, at::Tensor> out;
    for (const auto& p : stepped_) out[p.name] = p.tensor.detach().clone();
    return out;
  }
  StateBytes held() const override {
    StateBytes s;
    for (const auto& p : dp::unique_parameters(*module_)) {
      s.parameters += p.tensor.nbytes();
      if (p.tensor.grad().defined()) s.gradients += p.tensor.grad().nbytes();
      // DDP's buckets mirror the gradients, in the reduce dtype.
      if (ddp_) s.buffers += p.tensor.numel() * (reduce_dtype_ ? c10::elementSize(*reduce_dtype_) : p.tensor.element_size());
    }
    s.optimizer = optimizer_state_bytes(*opt_) + (masters_ ? masters_->master_bytes() : 0);
    return s;
  }
  std::vector<GradPart> gradient_parts(const ShardPlace& place) override {
    NamedGrads grads;
    for (const auto& p : stepped_) grads.emplace_back(p.name, p.tensor.grad());
    return count_once(grads, place.tp_dims, /*replicated_over_dp=*/true, coord_of(place));
  }
  void add_to_checkpoint(RankState& out, const ShardPlace& place) override { add_whole(stepped_, *opt_, out, place); }
  void load_checkpoint(CheckpointReader& r, const ShardPlace& place) override {
    load_whole(stepped_, *opt_, r, place);
    if (masters_) masters_->masters_to_parameters();
  }

 private:
  std::optional<MasterWeights> masters_;
  std::vector<dp::NamedParam> stepped_;  // what the optimizer steps: the parameters, or their fp32 masters
  std::vector<dp::NamedParam> own_;  // the module's parameters that this chunk steps
  comm::CommPtr dp_;
  std::unique_ptr<dp::DistributedDataParallel> ddp_;
  c10::optional<at::ScalarType> reduce_dtype_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
};

class ZeroChunk : public ChunkTrainer {
 public:
  ZeroChunk(const TrainerOptions& o, const Trainer::MakeOptimizer& make_optimizer,
            std::shared_ptr<torch::nn::Module> module, comm::CommPtr dp)
      : ChunkTrainer(std::move(module)), mixed_(o.param_dtype().has_value()) {
    auto options = o.zero_options();
    options.stage(o.zero());
    if (mixed_) options.param_dtype(*o.param_dtype());
    zro_ = std::make_unique<zero::ZeroRedundancyOptimizer>(
        module_, make_optimizer(tensors(dp::unique_parameters(*module_))), std::move(dp), options);
  }
  void zero_grad() override { zro_->zero_grad(); }
  std::vector<GrainGradient> grain_gradients() override {
    std::vector<GrainGradient> out;
    for (const auto& g : zro_->shard_gradients()) out.push_back({g.second, g.second.scalar_type()});
    return out;
  }
  void step() override { zro_->step(); }
  torch::optim::Optimizer& optimizer() override { return zro_->optimizer(); }
  std::map<std::string, at::Tensor> parameters_on_dp_root() override { return zro_->consolidated_state(0).parameters; }
  StateBytes held() const override {
    const zero::HeldBytes h = zro_->held_bytes();
    return StateBytes{h.parameters, h.gradients, h.optimizer, h.buffers};
  }
  std::vector<GradPart> gradient_parts(const ShardPlace& place) override {
    return count_once(zro_->shard_gradients(), place.tp_dims, /*replicated_over_dp=*/false, coord_of(place));
  }
  void add_to_checkpoint(RankState& out, const ShardPlace& place) override {
    // Mixed: each rank writes its float32 masters (the module holds bf16 copies).
    add_pieces(dp::unique_parameters(*module_), zro_->owned_pieces(), /*values=*/mixed_, out, place);
  }
  void load_checkpoint(CheckpointReader& r, const ShardPlace& place) override {
    zro_->load_state(full_state(dp::unique_parameters(*module_), r, place));
  }

 private:
  bool mixed_;
  std::unique_ptr<zero::ZeroRedundancyOptimizer> zro_;
};

bool is_container(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::ModuleDictImpl*>(&m) || dynamic_cast<const torch::nn::ModuleListImpl*>(&m);
}

// ZeRO-3's units: the chunk's children holding parameters, by path; a
// ModuleDict's or ModuleList's children each (a model's blocks).
void collect_units(const torch::nn::Module& parent, const std::string& prefix,
                   std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& out) {
  for (const auto& child : parent.named_children()) {
    if (child.value()->parameters().empty()) continue;
    const std::string path = prefix + child.key();
    if (is_container(*child.value())) collect_units(*child.value(), path + ".", out);
    else out.emplace_back(path, child.value());
  }
}

// Units that share a parameter with another unit of the chunk (a head tied to
// the embedding on the same rank): they stay in the chunk's own unit.
std::set<const torch::nn::Module*> sharing_units(
    const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& units) {
  std::map<const void*, std::set<const torch::nn::Module*>> users;
  for (const auto& unit : units)
    for (const auto& p : unit.second->parameters()) users[p.unsafeGetTensorImpl()].insert(unit.second.get());
  std::set<const torch::nn::Module*> sharing;
  for (const auto& kv : users)
    if (kv.second.size() > 1) sharing.insert(kv.second.begin(), kv.second.end());
  return sharing;
}

// ZeRO-3: zero::fully_shard on each unit, the chunk's forward unchanged; with
// param_dtype it computes and communicates in it and steps the float32 shards.
class FsdpChunk : public ChunkTrainer {
 public:
  FsdpChunk(const TrainerOptions& o, const Trainer::MakeOptimizer& make_optimizer,
            std::shared_ptr<torch::nn::Module> module, comm::CommPtr dp)
      : ChunkTrainer(std::move(module)), dp_(std::move(dp)), compute_(o.param_dtype().value_or(at::kFloat)) {
    auto options = zero::FullyShardOptions().param_dtype(o.param_dtype());
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> units;
    collect_units(*module_, "", units);
    const auto sharing = sharing_units(units);
    for (const auto& unit : units) {
      if (sharing.count(unit.second.get())) continue;
      const bool keep = std::count(o.keep_gathered().begin(), o.keep_gathered().end(), unit.first) > 0;
      zero::fully_shard(*unit.second, dp_, options.reshard_after_forward(!keep));
    }
    // What is left (children sharing a parameter, the chunk's own parameters,
    // a chunk that is one layer) is the chunk's unit, gathered through the step.
    if (!sharing.empty() || !module_->named_parameters(/*recurse=*/false).is_empty())
      zero::fully_shard(*module_, dp_, options.reshard_after_forward(false));
    params_ = zero::original_parameters(*module_);
    opt_ = make_optimizer(zero::sharded_parameters(*module_));
  }
  void zero_grad() override { opt_->zero_grad(); }
  void step() override { opt_->step(); }
  // The shards' gradients: reduced in the compute dtype, held in float32.
  std::vector<GrainGradient> grain_gradients() override {
    std::vector<GrainGradient> out;
    for (const auto& g : zero::shard_gradients(*module_)) out.push_back({g.second, compute_});
    return out;
  }
  torch::optim::Optimizer& optimizer() override { return *opt_; }
  std::map<std::string, at::Tensor> parameters_on_dp_root() override {
    std::map<std::string, at::Tensor> all = zero::full_parameters(*module_);  // collective over dp
    if (dp_->rank() != 0) return {};
    return all;
  }
  StateBytes held() const override {
    StateBytes s;
    for (const at::Tensor& shard : zero::sharded_parameters(*module_)) {
      s.parameters += shard.nbytes();
      if (shard.grad().defined()) s.gradients += shard.grad().nbytes();
    }
    s.optimizer = optimizer_state_bytes(*opt_);
    s.buffers = zero::peak_gathered_bytes(dp_);  // this chunk's units: each chunk has its own communicator
    return s;
  }
  std::vector<GradPart> gradient_parts(const ShardPlace& place) override {
    return count_once(zero::shard_gradients(*module_), place.tp_dims, /*replicated_over_dp=*/false, coord_of(place));
  }
  void add_to_checkpoint(RankState& out, const ShardPlace& place) override {
    add_pieces(params_, zero::owned_pieces(*module_, *opt_), /*values=*/true, out, place);
  }
  void load_checkpoint(CheckpointReader& r, const ShardPlace& place) override {
    zero::load_state(*module_, *opt_, full_state(params_, r, place));
  }

 private:
  comm::CommPtr dp_;
  at::ScalarType compute_;
  std::vector<dp::NamedParam> params_;  // as named before sharding (what checkpoints hold)
  std::unique_ptr<torch::optim::Optimizer> opt_;
};

}  // namespace

std::vector<std::string> shard_unit_paths(const torch::nn::Module& chunk) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> units;
  collect_units(chunk, "", units);
  std::vector<std::string> paths;
  for (const auto& unit : units) paths.push_back(unit.first);
  return paths;
}

std::unique_ptr<ChunkTrainer> make_chunk_trainer(const TrainerOptions& options,
                                                 const Trainer::MakeOptimizer& make_optimizer,
                                                 std::shared_ptr<torch::nn::Module> chunk, comm::CommPtr dp,
                                                 std::set<const void*>& stepped_elsewhere) {
  if (options.zero() == 3) return std::make_unique<FsdpChunk>(options, make_optimizer, std::move(chunk), std::move(dp));
  if (options.zero() > 0) return std::make_unique<ZeroChunk>(options, make_optimizer, std::move(chunk), std::move(dp));
  return std::make_unique<WholeChunk>(options, make_optimizer, std::move(chunk), std::move(dp), stepped_elsewhere);
}

std::unique_ptr<ChunkTrainer> make_expert_chunk_trainer(const TrainerOptions& options,
                                                        const Trainer::MakeOptimizer& make_optimizer,
                                                        std::shared_ptr<torch::nn::Module> experts,
                                                        comm::CommPtr replicas) {
  if (options.zero() > 0) {  // ZeRO-3 keeps them whole (no forward of their own to gather in): stage 2
    TrainerOptions experts_options = options;
    experts_options.zero(std::min(options.zero(), 2));
    return std::make_unique<ZeroChunk>(experts_options, make_optimizer, std::move(experts), std::move(replicas));
  }
  std::set<const void*> stepped;
  return std::make_unique<WholeChunk>(options, make_optimizer, std::move(experts), std::move(replicas), stepped);
}

}  // namespace train
}  // namespace meshtrain
