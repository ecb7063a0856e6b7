// The engine for every layout on the (dp, pp, tp) mesh: model chunks for this
// rank's pipeline stages, each with its data-parallel wrapper (chunk.h), run
// by the pipeline executor (pp > 1) or a plain micro-batch loop (pp == 1).
//
// Note [Tied embeddings across pipeline stages]
// When the GPT's LM head is tied to the token embedding and the two sit on
// different pipeline stages, only the first stage owns the weight (and its
// optimizer state). After its first forward of a step it sends the weight's
// value to the last stage, whose head uses it as a leaf for every micro-batch;
// after its last backward the last stage sends the accumulated gradient back,
// and the first stage adds it to the embedding's gradient before its own last
// backward, so the data-parallel reduction sees the sum of both uses. The
// weights are therefore identical by construction.

#include <ATen/ATen.h>

#include "chunk.h"
#include "engine.h"
#include "meshtrain/mesh/mesh.h"
#include "meshtrain/models/checkpointing.h"
#include "meshtrain/pp/executor.h"
#include "meshtrain/tp/layers.h"
#include "meshtrain/train/optim.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/tensor_io.h"

namespace meshtrain {
namespace train {

namespace {

constexpr int kTieWeightTag = 1, kTieGradTag = 2;

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
    for (int chunk = 0; chunk < c.virtual_stages; ++chunk) {
      const int s = chunk * c.pp + me.pp;
      models::Stage stage = models::build_stage(c.model, bounds[s], bounds[s + 1], ctx_);
      models::apply_checkpointing(*stage, c.model, c.activation_checkpointing, bounds[s]);
      // A tied embedding stays gathered (ZeRO-3) for the step: the head uses its
      // weight, on this stage or, through a copy sent after the first forward, on the last.
      const bool keep = gpt_tied && s == 0;
      chunks_[s] = make_chunk_trainer(c, stage, chunk_dp(chunk), keep);
    }
    first_ = chunks_.count(0) > 0;
    last_ = chunks_.count(S - 1) > 0;
    tied_across_ = gpt_tied && S > 1;
    if (tied_across_ && first_ && last_) {
      // Both ends on this rank (pp = 1 with virtual stages): a true tie.
      head()->set_tied(embedding_weight());
      tied_across_ = false;
    }
    if (c.pp > 1 || c.virtual_stages > 1) {
      std::vector<pp::StageFn> fns;
      for (auto& kv : chunks_) {
        ChunkTrainer* chunk = kv.second.get();
        fns.push_back({kv.first, [chunk](const at::Tensor& x, int) { return chunk->forward(x); }});
      }
      executor_ = std::make_unique<pp::PipelineExecutor>(
          mesh_.pp(), pp::ScheduleSpec{c.schedule, c.pp, c.microbatches, c.virtual_stages}, std::move(fns));
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
    if (!executor_) {
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
      std::vector<at::Tensor> inputs, targets;
      for (int64_t j = 0; j < M; ++j) {
        Batch b = (first_ || last_) ? data_->samples(first + j * m, m) : Batch{};
        inputs.push_back(b.inputs);
        targets.push_back(b.targets);
      }
      pp::StepResult r = executor_->run(inputs, targets,
                                        [&](const at::Tensor& out, const at::Tensor& t, int) { return loss(out, t); },
                                        hooks(static_cast<int>(M)));
      loss_sum = r.loss_sum;
      trace_ = std::move(r.events);
      max_in_flight_ = std::max(max_in_flight_, r.max_in_flight);
    }
    for (auto& w : tie_sends_) w->wait();  // received within this step (see the Note)
    tie_sends_.clear();
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
  std::vector<pp::TraceEvent> last_trace() const override { return trace_; }

  RankState checkpoint_state() override {
    RankState out;
    for (auto& kv : chunks_) kv.second->add_to_checkpoint(out, place(*kv.second));
    return out;
  }
  void load_checkpoint(CheckpointReader& reader) override {
    for (auto& kv : chunks_) kv.second->load_checkpoint(reader, place(*kv.second));
  }
  int max_activations_in_flight() const override { return max_in_flight_; }

 private:
  std::shared_ptr<models::GptHeadImpl> head() {
    const int S = c_.pp * c_.virtual_stages;
    auto& stage = chunks_.at(S - 1)->stage();
    return std::dynamic_pointer_cast<models::GptHeadImpl>(stage->piece(stage->num_pieces() - 1));
  }
  at::Tensor embedding_weight() {
    auto& stage = chunks_.at(0)->stage();
    return std::dynamic_pointer_cast<models::GptEmbeddingImpl>(stage->piece(0))->tok->weight;
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

  pp::PipelineHooks hooks(int M) {
    const int S = c_.pp * c_.virtual_stages;
    const int first_rank = pp::rank_of_stage(0, c_.pp), last_rank = pp::rank_of_stage(S - 1, c_.pp);
    pp::PipelineHooks h;
    h.before_backward = [this, M, S, last_rank](int stage, int mb) {
      if (tied_across_ && stage == 0 && mb == M - 1) {  // the head's share of the tied gradient
        at::Tensor g = mesh_.pp()->recv_any(last_rank, pp::user_tag(kTieGradTag));
        at::Tensor w = embedding_weight();
        if (w.grad().defined()) w.mutable_grad().add_(g); else w.mutable_grad() = g;
      }
      chunks_.at(stage)->begin_backward(mb == M - 1);
    };
    h.after_backward = [this, M, S, first_rank](int stage, int mb) {
      chunks_.at(stage)->end_backward();
      if (tied_across_ && stage == S - 1 && mb == M - 1) {
        tie_sends_.push_back(mesh_.pp()->isend(head()->out_weight().grad(), first_rank, pp::user_tag(kTieGradTag)));
        head()->set_tied(at::Tensor());
      }
    };
    h.after_forward = [this, S, last_rank](int stage, int mb) {
      if (tied_across_ && stage == 0 && mb == 0) {
        tie_sends_.push_back(mesh_.pp()->isend(embedding_weight().detach().clone(), last_rank, pp::user_tag(kTieWeightTag)));
      }
    };
    h.before_forward = [this, S, first_rank](int stage, int mb) {
      if (tied_across_ && stage == S - 1 && mb == 0) {
        head()->set_tied(mesh_.pp()->recv_any(first_rank, pp::user_tag(kTieWeightTag)).requires_grad_(true));
      }
    };
    return h;
  }

  TrainConfig c_;
  mesh::DeviceMesh mesh_;
  std::unique_ptr<Dataset> data_;
  models::BuildContext ctx_;
  std::vector<comm::CommPtr> chunk_dps_;  // ZeRO-3 under virtual stages: chunks after the first
  std::map<int, std::unique_ptr<ChunkTrainer>> chunks_;  // by stage
  std::unique_ptr<pp::PipelineExecutor> executor_;
  bool first_ = false, last_ = false, tied_across_ = false;
  std::vector<comm::WorkPtr> tie_sends_;
  std::vector<pp::TraceEvent> trace_;
  int max_in_flight_ = 0;
  double grad_norm_ = 0;
};

}  // namespace

std::unique_ptr<Engine> make_mesh_engine(const TrainConfig& c, comm::CommPtr world) {
  return std::make_unique<MeshEngine>(c, std::move(world));
}

}  // namespace train
}  // namespace meshtrain
