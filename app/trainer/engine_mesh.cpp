// The engine for every layout on the (dp, pp, tp, cp) mesh: this rank's
// pipeline stages of the built-in model, built whole and given every axis
// from outside with the calls a user's model takes (tp::parallelize with
// models::tp_plan, cp::parallelize, ep::parallelize, activation
// checkpointing), trained by the public train::Trainer (module_trainer.h,
// which adds ZeRO / fully_shard) with the options the flags give.
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

#include "engine.h"
#include "meshtrain/cp.h"
#include "dp/grain_tree.h"
#include "meshtrain/ep.h"
#include "meshtrain/mesh.h"
#include "meshtrain/models.h"
#include "meshtrain/pp.h"
#include "meshtrain/tp.h"
#include "meshtrain/train.h"
#include "app/trainer/optimizer.h"
#include "train/optim.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace train {

namespace {

std::vector<int64_t> piece_costs(const models::ModelConfig& m) {
  // Balance by parameter count; a tied head costs what its weight costs.
  // Only the shapes count: computing the values cost GPT-2 124M 5 s.
  const SkipRandomInit shapes_only;
  std::vector<int64_t> costs;
  for (int64_t i = 0; i < models::num_pieces(m); ++i) {
    int64_t n = 0;
    for (const auto& p : models::build_stage(m, i, i + 1)->parameters()) n += p.numel();
    if (models::is_language_model(m) && m.tie_embeddings && i == models::num_pieces(m) - 1) n += models::padded_vocab(m) * m.hidden;
    costs.push_back(n);
  }
  return costs;
}

// The trainer's options from the flags.
TrainerOptions trainer_options(const TrainConfig& c, bool tied_across_ranks) {
  const int S = c.pp * c.virtual_stages;
  const bool mixed = c.precision == "bf16-mixed";
  auto pipeline = pp::PipelineOptions().schedule(c.schedule).virtual_stages(c.virtual_stages)
                      .microbatches(S > 1 ? c.microbatches : c.global_batch / c.dp / c.micro_batch);
  if (tied_across_ranks) pipeline.tied({{{0, "embed.tok.weight"}, {S - 1, "head.out.weight"}}});
  auto ddp = dp::DistributedDataParallelOptions().bucket_cap_mb(c.bucket_cap_mb).overlap(c.overlap)
                 .rebuild_buckets(false);  // bucket boundaries never depend on when the run started (exact resume)
  if (mixed && c.reduce_dtype == "fp32") ddp.reduce_dtype(at::kFloat);
  auto options = TrainerOptions().zero(c.zero).pipeline(pipeline).ddp(ddp)
                     .zero_options(zero::ZeroOptions().bucket_cap_mb(c.bucket_cap_mb).overlap(c.overlap))
                     .clip_grad_norm(c.clip_grad_norm).measure_grad_norm(true)
                     .deterministic(c.deterministic).grains(c.grains).deterministic_threads(c.deterministic_threads)
                     .aux_loss_scope(models::parse_aux_loss_scope(c.aux_loss_scope));
  if (mixed) options.param_dtype(at::kBFloat16);
  // A tied embedding stays gathered (ZeRO-3) for the step: the head uses its
  // weight, on this stage or, through the copy the pipeline sends, on the last.
  if (c.zero == 3 && models::is_language_model(c.model) && c.model.tie_embeddings) options.keep_gathered({"embed"});
  return options;
}

class MeshEngine : public Engine {
 public:
  MeshEngine(const TrainConfig& c, comm::CommPtr world)
      : c_(c),
        mesh_(world, mesh::MeshLayout(world->size(), mesh::MeshDims().dp(c.dp).pp(c.pp).tp(c.tp).cp(c.cp))),
        data_(make_dataset(c)) {
    const mesh::Coord me = mesh_.coord();
    comm::CommPtr experts;  // the ep group: consecutive ranks of dp x cp (train/experts.h)
    if (c.ep > 1) {
      const comm::CommPtr& replicas = mesh_.dp_cp();
      experts = replicas->split(replicas->rank() / c.ep, replicas->rank(), "ep");
    }
    const int S = c.pp * c.virtual_stages;
    const std::vector<int64_t> bounds =
        c.stage_boundaries.empty() ? pp::partition_balanced(piece_costs(c.model), S)
                                   : pp::partition_explicit(c.stage_boundaries, models::num_pieces(c.model), S);
    const bool gpt_tied = models::is_language_model(c.model) && c.model.tie_embeddings;
    first_ = me.pp == 0;  // stage 0 is chunk 0 of pp rank 0
    last_ = me.pp == c.pp - 1;
    const bool tied = gpt_tied && S > 1;
    const StartingWeights weights(c);
    std::vector<pp::StageModule> mine;
    for (int chunk = 0; chunk < c.virtual_stages; ++chunk) {
      const int s = chunk * c.pp + me.pp;
      models::BuildContext ctx = weights.context();
      ctx.tied_head_copy = tied && s == S - 1 && !first_;  // Note [Tied embeddings across pipeline stages]
      models::Stage stage = models::build_stage(c.model, bounds[s], bounds[s + 1], ctx);
      if (c.tp > 1)  // Megatron's cut (and sequence parallelism), the same values on every tp rank
        tp::parallelize(*stage, mesh_.tp(), models::tp_plan(c.model, *stage, c.tp, c.sequence_parallel),
                        {c.sequence_parallel});
      cp::parallelize(*stage, mesh_.cp());  // ring attention, the chunks' positions (cp 1: nothing)
      ep::parallelize(*stage, experts);     // this rank's slice of every MoE's experts (ep 1: nothing)
      models::apply_checkpointing(*stage, c.model, c.activation_checkpointing, bounds[s]);
      stages_.emplace(s, stage);
      mine.push_back(pp::stage_module(stages_.at(s)));
    }
    if (tied && first_ && last_) head()->set_tied(embedding_weight());  // both ends on this rank: a true tie
    auto loss = [model_loss = train::model_loss(c.model, mesh_.tp())](const at::Tensor& out, const at::Tensor& targets) {
      return model_loss(out.to(at::kFloat), targets);  // bf16-mixed: the loss in fp32
    };
    auto optimizer = [this](std::vector<at::Tensor> params) { return make_optimizer(c_, std::move(params)); };
    trainer_ = std::make_unique<Trainer>(std::move(mine), mesh_, loss, optimizer,
                                         trainer_options(c, tied && !(first_ && last_)));
  }

  // The trainer returns the global-batch loss on every rank; rank 0 contributes it.
  double step(int64_t step) override {
    const Batch b = my_samples(*data_, step * c_.global_batch, c_.global_batch);
    const double loss = trainer_->step(b.inputs, b.targets);
    return mesh_.world()->rank() == 0 ? loss : 0.0;
  }

  double evaluate(const Dataset& data, int64_t first, int64_t count) override {
    const Batch b = my_samples(data, first, count, /*by_grain=*/false);  // a mean: any split of the samples
    const double loss = trainer_->evaluate(b.inputs, b.targets);
    return mesh_.world()->rank() == 0 ? loss : 0.0;
  }

  void set_learning_rate(double lr) override { trainer_->set_learning_rate(lr); }
  double last_grad_norm() const override { return trainer_->last_grad_norm(); }
  std::map<std::string, at::Tensor> full_parameters() override { return trainer_->full_parameters(); }
  StateBytes state_bytes() const override { return trainer_->held_bytes(); }
  comm::Traffic traffic() const override {
    comm::Traffic t;
    for (const auto& kv : trainer_->traffic_by_axis()) t = t + kv.second;
    return t;
  }
  std::map<std::string, comm::Traffic> traffic_by_axis() const override { return trainer_->traffic_by_axis(); }
  void reset_traffic() override { trainer_->reset_traffic(); }
  std::vector<pp::TraceEvent> last_trace() const override { return trainer_->last_trace(); }
  int max_activations_in_flight() const override { return trainer_->max_activations_in_flight(); }
  at::Tensor take_router_load() override {
    if (c_.model.experts == 0) return at::Tensor();
    at::Tensor load = at::zeros({c_.model.layers, c_.model.experts + 1}, at::kDouble);
    for (const auto& stage : stages_) {
      for (const auto& m : stage.second->named_modules()) {
        auto* moe = dynamic_cast<models::MoEImpl*>(m.value().get());
        if (!moe) continue;
        const models::MoELoad l = moe->take_load();  // "blocks.<layer>.moe"
        if (mesh_.coord().tp != 0) continue;
        const int64_t layer = std::stoll(m.key().substr(m.key().find('.') + 1));
        load[layer].narrow(0, 0, c_.model.experts).add_(l.tokens_per_expert.to(at::kDouble));
        load[layer][c_.model.experts] += static_cast<double>(l.dropped);
      }
    }
    return load;
  }
  RankState checkpoint_state() override { return trainer_->checkpoint_state(); }
  void load_checkpoint(CheckpointReader& reader) override { trainer_->load_checkpoint(reader); }

 private:
  // This dp rank's slice of global samples [first, first + count); a
  // pipeline reads the inputs on its first stage and the targets on its last.
  // Under context parallelism each cp rank takes its two chunks of every sequence.
  // Deterministic mode: micro-batch j is grain j x dp + this dp rank (Note [Deterministic training]).
  Batch my_samples(const Dataset& data, int64_t first, int64_t count, bool by_grain = true) const {
    const int64_t local = count / c_.dp;
    const bool pipelined = c_.pp * c_.virtual_stages > 1;
    if (pipelined && !first_ && !last_) return Batch{};
    if (!c_.deterministic || !by_grain) return my_chunks(data.samples(first + mesh_.coord().dp * local, local));
    const int64_t grain = count / c_.grains;
    std::vector<at::Tensor> inputs, targets;
    for (int64_t j = 0; j < c_.grains / c_.dp; ++j) {
      Batch b = data.samples(first + dp::grain_index(j, mesh_.coord().dp, c_.dp) * grain, grain);
      inputs.push_back(b.inputs);
      targets.push_back(b.targets);
    }
    return Batch{at::cat(inputs), at::cat(targets)};
  }

  // This cp rank's two chunks of every sequence (the batch itself without cp;
  // deterministic mode, which reads by grain, refuses cp).
  Batch my_chunks(const Batch& b) const {
    if (c_.cp == 1) return b;
    const int cp = c_.cp, r = mesh_.coord().cp;
    return Batch{cp::shard_sequence(b.inputs, 1, cp, r), cp::shard_sequence(b.targets, 1, cp, r)};
  }

  std::shared_ptr<models::LmHeadImpl> head() {
    const models::Stage& stage = stages_.at(c_.pp * c_.virtual_stages - 1);
    return std::dynamic_pointer_cast<models::LmHeadImpl>(stage->piece(stage->num_pieces() - 1));
  }
  at::Tensor embedding_weight() {
    return std::dynamic_pointer_cast<models::TokenEmbeddingImpl>(stages_.at(0)->piece(0))->tok->weight;
  }

  TrainConfig c_;
  mesh::DeviceMesh mesh_;
  std::unique_ptr<Dataset> data_;
  std::map<int, models::Stage> stages_;  // this rank's, by stage
  std::unique_ptr<Trainer> trainer_;
  bool first_ = false, last_ = false;
};

}  // namespace

std::unique_ptr<Engine> make_mesh_engine(const TrainConfig& c, comm::CommPtr world) {
  return std::make_unique<MeshEngine>(c, std::move(world));
}

}  // namespace train
}  // namespace meshtrain
