// The engine for every layout on the (dp, pp, tp) mesh: model chunks for this
// rank's pipeline stages, each with its data-parallel wrapper (chunk.h), run
// by pp::Pipeline over the stages this rank builds (pp > 1 or virtual stages)
// or a plain micro-batch loop.
//
// Note [Tied embeddings across pipeline stages]
// When the GPT's LM head is tied to the token embedding and the two sit on
// different pipeline ranks, the last stage's head is built with a copy of the
// weight ("head.out.weight", cut over tp like the embedding) and the pipeline is told the two are one
// parameter (PipelineOptions::tied): the first stage owns it, the copy takes
// its value as each step starts and its gradient joins the owner's before the
// owner's last backward (Note [Tied parameters across stages] in
// src/pp/pipeline.cpp). On one rank (pp 1 with virtual stages) the head simply
// uses the embedding's weight.

#include <ATen/ATen.h>

#include "chunk.h"
#include "engine.h"
#include "meshtrain/mesh/mesh.h"
#include "meshtrain/models/checkpointing.h"
#include "meshtrain/pp/pipeline.h"
#include "meshtrain/tp/layers.h"
#include "meshtrain/train/optim.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/tensor_io.h"

namespace meshtrain {
namespace train {

namespace {

std::vector<int64_t> piece_costs(const models::ModelConfig& m) {
  // Balance by parameter count; a tied head costs what its weight costs.
  std::vector<int64_t> costs;
  for (int64_t i = 0; i < models::num_pieces(m); ++i) {
    int64_t n = 0;
    for (const auto& p : models::build_stage(m, i, i + 1)->parameters()) n += p.numel();
    if (m.kind == "gpt" && m.tie_embeddings && i == models::num_pieces(m) - 1) n += m.vocab * m.hidden;
    costs.push_back(n);
  }
  return costs;
}

class MeshEngine : public Engine {
 public:
  MeshEngine(const TrainConfig& c, comm::CommPtr world)
      : c_(c), mesh_(world, mesh::MeshLayout(world->size(), c.dp, c.pp, c.tp)), data_(make_dataset(c)) {
    const mesh::Coord me = mesh_.coord();
    ctx_.tp = c.tp > 1 ? mesh_.tp() : nullptr;
    ctx_.sequence_parallel = c.sequence_parallel;
    const int S = c.pp * c.virtual_stages;
    const std::vector<int64_t> bounds =
        c.stage_boundaries.empty() ? pp::partition_balanced(piece_costs(c.model), S)
                                   : pp::partition_explicit(c.stage_boundaries, models::num_pieces(c.model), S);
    const bool gpt_tied = c.model.kind == "gpt" && c.model.tie_embeddings;
    first_ = me.pp == 0;  // stage 0 is chunk 0 of pp rank 0
    last_ = me.pp == c.pp - 1;
    const bool tied = gpt_tied && S > 1;
    for (int chunk = 0; chunk < c.virtual_stages; ++chunk) {
      const int s = chunk * c.pp + me.pp;
      models::BuildContext ctx = ctx_;
      ctx.tied_head_copy = tied && s == S - 1 && !first_;  // Note [Tied embeddings across pipeline stages]
      stages_.emplace(s, models::build_stage(c.model, bounds[s], bounds[s + 1], ctx));
      models::apply_checkpointing(*stages_.at(s), c.model, c.activation_checkpointing, bounds[s]);
    }
    if (tied && first_ && last_) head()->set_tied(embedding_weight());  // both ends on this rank: a true tie
    if (c.pp > 1 || c.virtual_stages > 1) pipeline_ = make_pipeline(tied && !(first_ && last_), S);
    for (int chunk = 0; chunk < c.virtual_stages; ++chunk) {
      const int s = chunk * c.pp + me.pp;
      // A tied embedding stays gathered (ZeRO-3) for the step: the head uses its
      // weight, on this stage or, through the copy the pipeline sends, on the last.
      chunks_[s] = make_chunk_trainer(c, stages_.at(s), chunk_dp(chunk), gpt_tied && s == 0);
    }
  }

  double step(int64_t step) override {
    const int64_t local = c_.global_batch / c_.dp, m = c_.micro_batch, M = local / m;
    const int64_t first = step * c_.global_batch + mesh_.coord().dp * local;
    for (auto& kv : chunks_) kv.second->zero_grad();
    double loss_sum = 0;
    const double scale = 1.0 / static_cast<double>(M);  // micro-batch means -> this replica's mean
    auto loss = [&](const at::Tensor& out, const at::Tensor& targets) {
      return models::loss(c_.model, out.to(at::kFloat), targets, ctx_) * scale;  // bf16-mixed: the loss in fp32
    };
    if (!pipeline_) {
      ChunkTrainer& chunk = *chunks_.begin()->second;
      for (int64_t j = 0; j < M; ++j) {
        Batch b = data_->samples(first + j * m, m);
        at::Tensor l = loss(chunk.forward(b.inputs), b.targets);
        chunk.begin_backward(j + 1 == M);
        l.backward();
        chunk.end_backward();
        loss_sum += l.item<double>();
      }
    } else {
      Batch b = (first_ || last_) ? data_->samples(first, local) : Batch{};
      loss_sum = pipeline_->step(b.inputs, b.targets);
    }
    std::vector<GradPart> parts;
    for (auto& kv : chunks_) kv.second->finish_gradients();
    for (auto& kv : chunks_) {
      std::vector<GradPart> mine = kv.second->gradient_parts(place(*kv.second));
      parts.insert(parts.end(), mine.begin(), mine.end());
    }
    grad_norm_ = clip_grad_norm(parts, c_.clip_grad_norm, *mesh_.world());
    for (auto& kv : chunks_) kv.second->step();
    // Only the last stage computed the loss; tp ranks computed it alike.
    return last_ && mesh_.coord().tp == 0 ? loss_sum / c_.dp : 0.0;
  }

  void set_learning_rate(double lr) override {
    for (auto& kv : chunks_) train::set_learning_rate(kv.second->optimizer(), lr);
  }

  double last_grad_norm() const override { return grad_norm_; }

  std::map<std::string, at::Tensor> full_parameters() override {
    std::map<std::string, at::Tensor> mine;
    const mesh::Coord me = mesh_.coord();
    for (auto& kv : chunks_) {
      std::map<std::string, at::Tensor> part = kv.second->parameters_on_dp_root();
      // Full tensors from the tp shards (a collective within this dp-root's tp group).
      if (c_.tp > 1 && me.dp == 0) part = tp::unshard(part, tp::shard_dims(*kv.second->stage()), *mesh_.tp());
      for (auto& p : part) mine[p.first] = p.second;
    }
    // Every stage's dp-root, tp rank 0, sends its parameters to world rank 0.
    const bool sender = me.dp == 0 && me.tp == 0;
    std::map<std::string, at::Tensor> full;
    for (const auto& part : comm::gather_strings(*mesh_.world(), sender ? serialize_tensors(mine) : std::string(), 0)) {
      if (part.empty()) continue;
      for (auto& kv : deserialize_tensors(part, "stage parameters")) full[kv.first] = kv.second;
    }
    return full;
  }

  StateBytes state_bytes() const override {
    StateBytes s;
    for (const auto& kv : chunks_) {
      const StateBytes h = kv.second->held();
      s.parameters += h.parameters;
      s.gradients += h.gradients;
      s.optimizer += h.optimizer;
      s.buffers += h.buffers;  // ZeRO-3: each chunk's units over its own communicator (chunk_dp)
    }
    return s;
  }

  comm::Traffic traffic() const override { return dp_traffic() + mesh_.pp()->traffic() + mesh_.tp()->traffic(); }
  std::map<std::string, comm::Traffic> traffic_by_axis() const override {
    return {{"dp", dp_traffic()}, {"pp", mesh_.pp()->traffic()}, {"tp", mesh_.tp()->traffic()}};
  }
  void reset_traffic() override {
    for (auto axis : {mesh::Axis::kDp, mesh::Axis::kPp, mesh::Axis::kTp}) mesh_.axis(axis)->reset_traffic();
    for (auto& dp : chunk_dps_) dp->reset_traffic();
  }
  std::vector<pp::TraceEvent> last_trace() const override {
    return pipeline_ ? pipeline_->last_trace() : std::vector<pp::TraceEvent>{};
  }

  RankState checkpoint_state() override {
    RankState out;
    for (auto& kv : chunks_) kv.second->add_to_checkpoint(out, place(*kv.second));
    return out;
  }
  void load_checkpoint(CheckpointReader& reader) override {
    for (auto& kv : chunks_) kv.second->load_checkpoint(reader, place(*kv.second));
  }
  int max_activations_in_flight() const override { return pipeline_ ? pipeline_->max_activations_in_flight() : 0; }

 private:
  std::shared_ptr<models::GptHeadImpl> head() {
    const models::Stage& stage = stages_.at(c_.pp * c_.virtual_stages - 1);
    return std::dynamic_pointer_cast<models::GptHeadImpl>(stage->piece(stage->num_pieces() - 1));
  }
  at::Tensor embedding_weight() {
    return std::dynamic_pointer_cast<models::GptEmbeddingImpl>(stages_.at(0)->piece(0))->tok->weight;
  }

  // This rank's stages in a pp::Pipeline; each runs through its chunk's
  // wrapper (made after: the pipeline first takes the tied copy out of the
  // head's parameters). ZeRO-2/3 reduce every micro-batch, as DeepSpeed does.
  std::unique_ptr<pp::Pipeline> make_pipeline(bool tied_across_ranks, int S) {
    std::vector<pp::StageModule> mine;
    for (const auto& kv : stages_) {
      const int s = kv.first;
      mine.push_back({kv.second.ptr(), [this, s](const at::Tensor& x) { return chunks_.at(s)->forward(x); }});
    }
    auto options = pp::PipelineOptions().schedule(c_.schedule).microbatches(c_.microbatches)
                       .virtual_stages(c_.virtual_stages).reduce_every_microbatch(c_.zero >= 2);
    if (tied_across_ranks) options.tied({{{0, "embed.tok.weight"}, {S - 1, "head.out.weight"}}});
    auto loss = [this](const at::Tensor& out, const at::Tensor& targets) {
      return models::loss(c_.model, out.to(at::kFloat), targets, ctx_);  // bf16-mixed: the loss in fp32
    };
    return std::make_unique<pp::Pipeline>(std::move(mine), mesh_.pp(), loss, options);
  }

  // ZeRO-3 settles every unit over a communicator at the end of each backward
  // (a unit that got no gradient reduces zeros, so the ranks stay in step);
  // under virtual stages each chunk's backward runs apart, so each further
  // chunk gets its own communicator over the same dp ranks, or every backward
  // would also reduce the other chunk's units (a third more bytes on dp 2 x pp 2).
  comm::CommPtr chunk_dp(int chunk) {
    if (chunk == 0 || c_.zero != 3) return mesh_.dp();
    chunk_dps_.push_back(mesh_.dp()->split(0, mesh_.dp()->rank(), "dp-chunk" + std::to_string(chunk)));
    return chunk_dps_.back();
  }
  comm::Traffic dp_traffic() const {
    comm::Traffic t = mesh_.dp()->traffic();
    for (const auto& dp : chunk_dps_) t = t + dp->traffic();
    return t;
  }

  ShardPlace place(ChunkTrainer& chunk) const {
    ShardPlace p;
    p.tp_dims = tp::shard_dims(*chunk.stage());
    p.tp_index = mesh_.coord().tp;
    p.tp_size = c_.tp;
    p.dp_rank = mesh_.coord().dp;
    p.dp_size = mesh_.dp()->size();
    return p;
  }

  TrainConfig c_;
  mesh::DeviceMesh mesh_;
  std::unique_ptr<Dataset> data_;
  models::BuildContext ctx_;
  std::vector<comm::CommPtr> chunk_dps_;  // ZeRO-3 under virtual stages: chunks after the first
  std::map<int, models::Stage> stages_;  // this rank's, by stage
  std::map<int, std::unique_ptr<ChunkTrainer>> chunks_;  // by stage
  std::unique_ptr<pp::Pipeline> pipeline_;
  bool first_ = false, last_ = false;
  double grad_norm_ = 0;
};

}  // namespace

std::unique_ptr<Engine> make_mesh_engine(const TrainConfig& c, comm::CommPtr world) {
  return std::make_unique<MeshEngine>(c, std::move(world));
}

}  // namespace train
}  // namespace meshtrain
