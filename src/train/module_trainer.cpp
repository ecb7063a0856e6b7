#include "meshtrain/train.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <set>
#include <utility>

#include "chunk.h"
#include "experts.h"
#include "meshtrain/comm.h"
#include "comm/tree_order.h"
#include "dp/gradient_sync.h"
#include "dp/grain_tree.h"
#include "meshtrain/moe.h"
#include "meshtrain/pp.h"
#include "tp/shards.h"
#include "train/optim.h"
#include "meshtrain/util.h"
#include "util/tensor_io.h"

namespace meshtrain {
namespace train {

// Note [Deterministic training]
// TrainerOptions::deterministic makes the step's sums follow one tree that no
// layout changes (Note [Grain tree] in dp/grain_tree.h), over G grains of the
// global batch (grain i: samples [i B/G, (i+1) B/G)), for dp = n ranks (a power
// of two dividing G), m = G/n micro-batches each:
//   - rank r's micro-batch j is grain j n + r (dp::grain_index), so the n
//     grains of micro-step j are an aligned block of the tree, and every
//     micro-batch's backward is reduced over dp (the wrappers reduce every
//     micro-batch, the pipeline too: PipelineOptions::after_microbatch_backward)
//     on a comm::tree_order communicator, which adds the ranks' gradients as
//     that block's subtree (Note [Tree-order sums]): node(log2 n, j);
//   - the trainer takes each micro-batch's reduced gradients (the chunk's
//     grain_gradients: whole for DDP and ZeRO-1's shard region, shards for
//     ZeRO-2/3) into a TreeAccumulator per tensor and zeroes them, so the m
//     subtree roots are added as the tree above them: the root, as one
//     process forms it from its G micro-batches. At most log2(m) + 1 partial
//     sums per tensor, of the size the strategy keeps (shards under ZeRO-2/3).
//   - scaling is exact: the loss divided by m and the average over n multiply
//     by powers of two;
//   - the loss: each grain's loss, gathered over dp, summed in the same tree
//     (in double), divided by G; the gradient norm: an exact integer sum of
//     squares (Note [Exact sum of squares]), so clipping scales alike;
//   - what sums in another order is refused: tensor parallelism (a row-parallel
//     matmul adds partial products over tp ranks), a dp size that is not a
//     power of two, a DDP reduce dtype other than the gradients'. Each grain's
//     own forward and backward are the same computation on every layout once
//     the thread count is (BLAS blocks by it): deterministic_threads on every
//     rank, and libtorch's deterministic algorithms on.
// The tree is summed in the dtype the reduction uses (bf16 under bf16-mixed,
// as DDP reduces), so a layout's cross-rank levels and local levels round alike.

namespace {

// The balanced binary tree's sum of a power-of-two count of doubles.
double sum_in_tree_order(std::vector<double> v) {
  const size_t n = v.size();
  for (size_t step = 1; step < n; step *= 2)
    for (size_t i = 0; i + step < n; i += 2 * step) v[i] += v[i + step];
  return n ? v[0] : 0.0;
}

// The split a balanced pipeline would make of the whole, uncut model: the
// same on every tp rank (a vocabulary tp does not divide leaves the ranks'
// slices of unequal size, and so their own balanced splits could differ).
std::vector<int64_t> balanced_split(torch::nn::SequentialImpl& model, int stages) {
  if (static_cast<int64_t>(model.size()) < stages) return {};  // pp::pipeline says why
  const std::vector<int64_t> bounds = pp::partition_balanced(pp::parameter_counts(model), stages);
  return std::vector<int64_t>(bounds.begin() + 1, bounds.end() - 1);
}

// Modules in eval mode for an evaluation, as they were after it.
class EvalMode {
 public:
  explicit EvalMode(std::shared_ptr<torch::nn::Module> m) : module_(std::move(m)), was_training_(module_->is_training()) {
    module_->eval();
  }
  ~EvalMode() { module_->train(was_training_); }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  bool was_training_;
};

// Gradient reduction off for the micro-batches that only accumulate; back on
// however the step ends (untouched when never set).
class SyncOnLast {
 public:
  explicit SyncOnLast(const torch::nn::Module& module) : module_(module) {}
  ~SyncOnLast() {
    if (set_) dp::set_gradient_sync(module_, true);
  }
  void set(bool on) {
    set_ = true;
    dp::set_gradient_sync(module_, on);
  }

 private:
  const torch::nn::Module& module_;
  bool set_ = false;
};

}  // namespace

struct Trainer::State {
  State(const mesh::DeviceMesh& m, Loss l, MakeOptimizer make, const TrainerOptions& o)
      : mesh(m), loss(std::move(l)), make_optimizer(std::move(make)), options(o) {
    MESHTRAIN_CHECK(o.zero() >= 0 && o.zero() <= 3, "train::Trainer: zero ", o.zero(),
                    " is not a ZeRO stage; use 0 (DDP), 1, 2 or 3");
    pipelined = mesh.pp()->size() > 1 || o.pipeline().virtual_stages() > 1;
    pipeline_options = o.pipeline();
    MESHTRAIN_CHECK(!o.zero_options().param_dtype(), "train::Trainer: set TrainerOptions::param_dtype, not "
                    "zero_options().param_dtype: it applies to every ZeRO stage, keeps float32 masters in "
                    "checkpoints and casts float inputs");
    // ZeRO-2/3 keep shards, not full gradients, through the step.
    pipeline_options.reduce_every_microbatch(o.pipeline().reduce_every_microbatch() || o.zero() >= 2);
    const int given = pipeline_options.microbatches();
    microbatches = given > 0 ? given : (pipelined ? mesh.pp()->size() : 1);
    if (o.deterministic()) start_deterministic();
    // The loss's average over dp x cp (each cp rank's loss is the mean of its
    // equal share of the tokens) goes on a communicator of its own: the axes'
    // traffic stays the training's.
    const comm::CommPtr& replicas = mesh.dp_cp();
    loss_dp = replicas->size() > 1 ? replicas->split(0, replicas->rank(), "trainer-loss") : nullptr;
  }

  // Note [Deterministic training]: what the mode cannot make exact is refused
  // before any communication.
  void start_deterministic() {
    const TrainerOptions& o = options;
    const int n = mesh.dp()->size(), G = o.grains();
    MESHTRAIN_CHECK(mesh.cp()->size() == 1, "train::Trainer: deterministic mode with cp ", mesh.cp()->size(),
                    ": ring attention merges each query's keys in ring order, an order one process does not "
                    "have; train with cp 1 (dp and pp compose with the mode)");
    MESHTRAIN_CHECK(mesh.tp()->size() == 1, "train::Trainer: deterministic mode with tp ", mesh.tp()->size(),
                    ": tensor parallelism adds each matmul's partial products over the tp ranks, an order one "
                    "process does not have; train with tp 1 (dp and pp compose with the mode)");
    MESHTRAIN_CHECK(dp::is_power_of_two(G), "train::Trainer: deterministic mode needs grains, a power of two (the "
                    "global batch's grains); got ", G, "; e.g. TrainerOptions().grains(8)");
    MESHTRAIN_CHECK(dp::is_power_of_two(n) && G % n == 0, "train::Trainer: deterministic mode with dp ", n, " and ",
                    G, " grains: dp must be a power of two dividing the grains (1, 2, 4, ... up to ", G, ")");
    MESHTRAIN_CHECK(o.pipeline().microbatches() == 0 || o.pipeline().microbatches() == G / n,
                    "train::Trainer: deterministic mode runs grains / dp = ", G / n, " micro-batches per rank; "
                    "PipelineOptions::microbatches is ", o.pipeline().microbatches(), " (leave it 0)");
    const auto reduce = o.ddp().reduce_dtype();
    MESHTRAIN_CHECK(o.zero() > 0 || !reduce || *reduce == o.param_dtype().value_or(at::kFloat), "train::Trainer: "
                    "deterministic mode sums the grain tree in the gradients' dtype, and DDP's reduce_dtype ",
                    *reduce, " would sum its levels in another; leave reduce_dtype unset");
    MESHTRAIN_CHECK(o.deterministic_threads() >= 1, "train::Trainer: deterministic_threads ",
                    o.deterministic_threads(), "; give at least 1 (the same on every layout)");
    comm::set_compute_threads(o.deterministic_threads());
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
    microbatches = G / n;
    pipeline_options.microbatches(G / n);
    pipeline_options.after_microbatch_backward([this](int chunk, int) { take_grain(chunk); });
  }

  mesh::DeviceMesh mesh;
  Loss loss;
  MakeOptimizer make_optimizer;
  TrainerOptions options;
  pp::PipelineOptions pipeline_options;
  bool pipelined = false;
  int64_t microbatches = 1;
  double grad_norm = 0;
  comm::CommPtr loss_dp;
  // Deterministic mode: each chunk's grain trees, one per grain_gradients()
  // tensor, and this rank's grain losses of the step (micro-batch order).
  std::vector<std::vector<dp::TreeAccumulator>> grain_trees;
  std::vector<double> grain_losses;
  comm::CommPtr tree_dp;  // mesh.dp() in tree order (Note [Tree-order sums])
  std::optional<pp::Pipeline> pipeline;
  std::shared_ptr<torch::nn::Module> root;  // this rank's stage or the whole model
  std::function<at::Tensor(const at::Tensor&)> forward;  // without a pipeline
  std::vector<std::unique_ptr<ChunkTrainer>> chunks;
  std::vector<comm::CommPtr> chunk_dps;  // ZeRO-3: each chunk's communicator over the dp ranks
  // Expert parallelism: the layers' ep group, the ranks holding the same
  // experts, and the chunk training them (the last; -1: none).
  comm::CommPtr ep, expert_replicas;
  int expert_chunk = -1;
  // Mixtures of experts under the global scope: each chunk's balance
  // statistics, summed over a communicator of their own along dp x cp; the
  // first layer with a balance loss (empty: none), whose forwards must all
  // precede the step's first backward (Note [Global-batch balance loss]).
  std::vector<std::shared_ptr<models::BalanceStatistics>> balance;
  comm::CommPtr balance_dp;
  std::string balanced_layer;
  mutable std::map<std::string, comm::Traffic> evaluation_traffic;  // since reset_traffic, by axis

  // The wrappers along dp, one per chunk: the module the pipeline pauses
  // gradient reduction on (each chunk under virtual stages), or the model.
  void wrap_data_axis() {
    std::vector<std::shared_ptr<torch::nn::Module>> units{root};
    if (pipeline && pipeline_options.virtual_stages() > 1) units = pipeline->chunks();
    check_keep_gathered(units);  // collective over pp: before any refusal one rank alone could raise
    refuse_shared_across_chunks(units);
    std::set<const void*> stepped;
    for (size_t k = 0; k < units.size(); ++k) {
      attach_balance_losses(*units[k]);
      chunks.push_back(make_chunk_trainer(options, make_optimizer, units[k], chunk_dp(k), stepped));
    }
    wrap_experts(units);
    check_balance_order();
  }

  // Expert parallelism: the experts the MoE layers hold apart train as one
  // more chunk, over the ranks of dp x cp holding the same experts (train/experts.h).
  void wrap_experts(const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
    const HeldApartExperts held = held_apart_experts(units);
    if (!held.module) return;
    const comm::CommPtr& replicas = mesh.dp_cp();
    MESHTRAIN_CHECK(replicas->size() % held.ep->size() == 0, "train::Trainer: the experts are spread over ep ",
                    held.ep->size(), ", which does not divide dp x cp = ", replicas->size(), "; the ep group must be "
                    "consecutive ranks of dp x cp (an --ep dividing dp x cp)");
    MESHTRAIN_CHECK(!options.deterministic() && !options.param_dtype(), "train::Trainer: expert parallelism with ",
                    options.deterministic() ? "deterministic mode" : "param_dtype (mixed precision)", " is not "
                    "supported; train the experts in float32 and without deterministic mode, or with ep 1");
    ep = held.ep;
    expert_replicas = replicas->split(ep->rank(), replicas->rank(), "expert-replicas");
    expert_chunk = static_cast<int>(chunks.size());
    chunks.push_back(make_expert_chunk_trainer(options, make_optimizer, held.module, expert_replicas));
  }
  bool is_expert_chunk(const ChunkTrainer& chunk) const {
    return expert_chunk >= 0 && &chunk == chunks[expert_chunk].get();
  }

  // Mixtures of experts take the trainer's aux_loss_scope. Micro: each
  // micro-batch's balance loss is scaled as its loss is, by 1 / micro-batches.
  // Global: the chunk's layers share statistics summed over dp x cp (the
  // ranks holding this stage's other tokens; tp ranks hold the same ones),
  // and their pieces add up to the step's loss (Note [Global-batch balance
  // loss] in meshtrain/moe.h).
  void attach_balance_losses(torch::nn::Module& unit) {
    const bool global = options.aux_loss_scope() == models::AuxLossScope::kGlobal;
    std::shared_ptr<models::BalanceStatistics> statistics;
    for (const auto& m : unit.modules()) {
      auto* moe = dynamic_cast<models::MoEImpl*>(m.get());
      if (!moe) continue;
      moe->options.aux_loss_scope(options.aux_loss_scope());
      moe->aux_loss_scale = global ? 1.0 : 1.0 / static_cast<double>(microbatches);
      if (!global) continue;
      if (!statistics) statistics = balance_statistics();
      moe->set_balance_statistics(statistics);
      if (moe->options.aux_loss_coef() > 0 && balanced_layer.empty()) balanced_layer = moe->options.name();
    }
    if (statistics) balance.push_back(statistics);
  }
  std::shared_ptr<models::BalanceStatistics> balance_statistics() {
    const comm::CommPtr& replicas = mesh.dp_cp();
    if (replicas->size() == 1) return std::make_shared<models::BalanceStatistics>();
    if (!balance_dp) balance_dp = replicas->split(0, replicas->rank(), "moe-balance");
    comm::CommPtr group = balance_dp;
    return std::make_shared<models::BalanceStatistics>([group](at::Tensor& t) { group->all_reduce(t); },
                                                       group->size());
  }

  // The global balance loss reads the step's expert counts in its first
  // backward: a pipeline schedule that runs a backward before a stage's last
  // forward would give the earlier micro-batches a partial f (what
  // Megatron-LM's global_aux_loss does) and train unlike one process; it is
  // refused on every pipeline rank alike (one exchange over pp, only for
  // such a schedule), naming both ways out.
  void check_balance_order() const {
    if (!pipeline) return;
    const pp::ScheduleSpec spec{pipeline_options.schedule(), mesh.pp()->size(), static_cast<int>(microbatches),
                                pipeline_options.virtual_stages()};
    if (pp::forwards_before_backwards(spec)) return;
    std::string layer;
    for (const std::string& l : comm::all_gather_strings(*mesh.pp(), balanced_layer))
      if (layer.empty()) layer = l;
    MESHTRAIN_CHECK(layer.empty(), "train::Trainer: the mixture of experts '", layer, "' computes its balance loss "
                    "over the step's whole batch (aux_loss_scope global), which needs every forward of the step "
                    "before its first backward, and schedule ", spec.kind, " with ", spec.microbatches,
                    " micro-batches runs a backward first; use schedule gpipe (--schedule gpipe), or the "
                    "per-micro-batch loss (aux_loss_scope micro, --aux-loss-scope micro)");
  }

  // ZeRO-3 shards each chunk apart: a parameter two of this rank's chunks
  // share (a tied embedding and head with pp 1 and virtual stages) cannot be
  // in both (fully_shard would refuse it, naming a call the user never made).
  // Under the other stages the wrappers each chunk gets (any along dp > 1,
  // ZeRO-1/2 always) would each reduce it (pp::Pipeline refuses it too, at
  // the first step): refused here, when the trainer is made.
  void refuse_shared_across_chunks(const std::vector<std::shared_ptr<torch::nn::Module>>& units) const {
    const bool wrapped = options.zero() > 0 || mesh.dp_cp()->size() > 1;
    if (!wrapped || units.size() < 2) return;
    std::map<const void*, std::pair<size_t, std::string>> first_use;
    for (size_t k = 0; k < units.size(); ++k) {
      for (const auto& p : units[k]->named_parameters()) {
        auto it = first_use.emplace(p.value().unsafeGetTensorImpl(), std::make_pair(k, p.key())).first;
        MESHTRAIN_CHECK(it->second.first == k, "train::Trainer: parameter '", p.key(), "' of chunk ", k, " is '",
                        it->second.second, "' of chunk ", it->second.first, " on the same rank (tied), and the "
                        "data-parallel wrapper of each chunk (ZeRO ", options.zero(), ", dp x cp ", mesh.dp_cp()->size(),
                        ") would each reduce or shard it; place the tied children on different pipeline ranks "
                        "(pp > 1) or train without virtual stages");
      }
    }
  }

  // A keep_gathered path no rank of the pipeline holds is a typo that would
  // quietly re-gather the unit every use: refused on every rank alike (one
  // exchange over pp at construction, only when paths are given).
  void check_keep_gathered(const std::vector<std::shared_ptr<torch::nn::Module>>& units) const {
    if (options.keep_gathered().empty()) return;
    MESHTRAIN_CHECK(options.zero() == 3, "train::Trainer: keep_gathered applies to ZeRO-3 (zero is ",
                    options.zero(), "); leave it empty");
    std::string found;
    for (const std::string& path : options.keep_gathered())
      for (const auto& unit : units) {
        const std::vector<std::string> paths = shard_unit_paths(*unit);
        if (std::count(paths.begin(), paths.end(), path)) found += path + "\n";
      }
    const std::vector<std::string> all = comm::all_gather_strings(*mesh.pp(), found);
    for (const std::string& path : options.keep_gathered()) {
      const bool held = std::any_of(all.begin(), all.end(), [&](const std::string& f) {
        return f.find(path + "\n") == 0 || f.find("\n" + path + "\n") != std::string::npos;
      });
      MESHTRAIN_CHECK(held, "train::Trainer: keep_gathered path '", path, "' is no ZeRO-3 unit of any pipeline "
                      "stage; give the path of a child with parameters in its stage (\"embed\", \"blocks.0\": a "
                      "ModuleDict's or ModuleList's children, not the container)");
    }
  }

  // ZeRO-3 settles every unit over its communicator at the end of each
  // backward (a unit that got no gradient reduces zeros, so the ranks stay in
  // step); under virtual stages each chunk's backward runs apart, so each
  // further chunk gets its own communicator over the same dp ranks, or every
  // backward would also reduce the other chunks' units (a third more bytes on
  // dp 2 x pp 2).
  // Chunk 0's too: fully_shard's registry keeps a unit to the end of the
  // process, so a later trainer on the same mesh would settle this one's.
  // Deterministic mode: the wrappers reduce in tree order. The wrappers span
  // dp x cp: the ranks that hold the same parameters.
  comm::CommPtr chunk_dp(size_t chunk) {
    const bool tree = options.deterministic();
    const comm::CommPtr& replicas = mesh.dp_cp();
    if (options.zero() != 3) {
      if (tree && !tree_dp) tree_dp = comm::tree_order(replicas);
      return tree ? tree_dp : replicas;
    }
    chunk_dps.push_back(replicas->split(0, replicas->rank(), "dp-chunk" + std::to_string(chunk)));
    return tree ? comm::tree_order(chunk_dps.back()) : chunk_dps.back();
  }

  // After a micro-batch's backward on `chunk`: its reduced gradients join the
  // trees, and the chunk starts the next micro-batch from zero.
  void take_grain(size_t chunk) {
    const std::vector<GrainGradient> grads = chunks.at(chunk)->grain_gradients();
    if (grain_trees.size() < chunks.size()) grain_trees.resize(chunks.size());
    std::vector<dp::TreeAccumulator>& trees = grain_trees[chunk];
    if (trees.empty()) trees.resize(grads.size());
    MESHTRAIN_CHECK(trees.size() == grads.size(), "train::Trainer: chunk ", chunk, " reduced ", grads.size(),
                    " gradient tensors in this micro-batch and ", trees.size(), " in the first");
    for (size_t i = 0; i < grads.size(); ++i)
      trees[i].add(grads[i].tensor.to(grads[i].sum_dtype, /*non_blocking=*/false, /*copy=*/true));
    chunks.at(chunk)->zero_grad();
  }

  // After the step's last backward: each chunk's gradients are its trees' roots.
  void put_back_grains() {
    for (size_t k = 0; k < chunks.size(); ++k) {
      const std::vector<GrainGradient> grads = chunks[k]->grain_gradients();
      std::vector<dp::TreeAccumulator>& trees = grain_trees.at(k);
      MESHTRAIN_CHECK(trees.size() == grads.size(), "train::Trainer: chunk ", k, " holds ", grads.size(),
                      " gradient tensors after the step and reduced ", trees.size());
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < grads.size(); ++i) grads[i].tensor.copy_(trees[i].root());
      trees.clear();
    }
  }

  // The global batch's loss from every rank's grain losses, summed in the
  // grain tree (grain j n + r is rank r's micro-batch j).
  double tree_mean_loss(const std::vector<double>& mine) const {
    const int n = loss_dp ? loss_dp->size() : 1;
    std::vector<double> by_grain(mine.size() * n);
    const std::vector<at::Tensor> all = loss_dp ? loss_dp->all_gather(at::tensor(mine, at::kDouble))
                                                : std::vector<at::Tensor>{at::tensor(mine, at::kDouble)};
    for (int r = 0; r < n; ++r)
      for (size_t j = 0; j < mine.size(); ++j)
        by_grain[dp::grain_index(j, r, n)] = all[r].data_ptr<double>()[j];
    return sum_in_tree_order(by_grain) / static_cast<double>(by_grain.size());
  }

  ShardPlace place(const ChunkTrainer& chunk) const {
    if (is_expert_chunk(chunk)) return expert_place(*chunk.module(), *ep, *expert_replicas);
    ShardPlace p;
    p.tp_dims = tp::shard_dims(*chunk.module());
    p.tp_index = mesh.coord().tp;
    p.tp_size = mesh.tp()->size();
    p.dp_rank = mesh.dp_cp()->rank();  // ZeRO's shards: over dp x cp
    p.dp_size = mesh.dp_cp()->size();
    return p;
  }

  // Float inputs enter in the compute dtype (mixed precision).
  at::Tensor in_compute_dtype(const at::Tensor& inputs) const {
    const c10::optional<at::ScalarType> dtype = options.param_dtype();
    return dtype && inputs.defined() && inputs.is_floating_point() ? inputs.to(*dtype) : inputs;
  }

  // Micro-batch j of a batch (undefined stays undefined: a pipeline rank without inputs or targets).
  at::Tensor micro_batch(const at::Tensor& t, int64_t j) const {
    return t.defined() ? t.chunk(microbatches, 0)[j] : t;
  }

  // Without a pipeline: the micro-batches' gradients accumulate, reduced on
  // the last (ZeRO-2/3: every one). Returns the batch's mean loss. A global
  // balance loss runs every forward first (Note [Global-batch balance loss]),
  // holding the micro-batches' activations together as GPipe does.
  double accumulate(const at::Tensor& inputs, const at::Tensor& targets) {
    const int64_t M = microbatches;
    const bool forwards_first = M > 1 && !balanced_layer.empty();
    SyncOnLast sync(*root);
    std::vector<at::Tensor> waiting;  // forwards first: each micro-batch's loss until its backward
    double sum = 0;
    for (int64_t j = 0; j < M; ++j) {
      const at::Tensor grain_loss = loss(forward(micro_batch(inputs, j)), micro_batch(targets, j));
      if (forwards_first) waiting.push_back(grain_loss);
      else sum += backward_micro_batch(grain_loss, j, sync);
    }
    for (size_t j = 0; j < waiting.size(); ++j) sum += backward_micro_batch(std::exchange(waiting[j], {}), j, sync);
    return sum;
  }
  double backward_micro_batch(const at::Tensor& grain_loss, int64_t j, SyncOnLast& sync) {
    const int64_t M = microbatches;
    const bool deterministic = options.deterministic();  // every micro-batch reduced and taken
    if (M > 1 && !deterministic) sync.set(pipeline_options.reduce_every_microbatch() || j + 1 == M);
    at::Tensor l = grain_loss / M;
    l.backward();
    if (deterministic) {
      grain_losses.push_back(grain_loss.item<double>());
      take_grain(0);
    }
    return l.item<double>();
  }

  // Checked before any communication, so a batch the micro-batches do not
  // divide fails on the ranks holding it, never half-way through a pipeline.
  void check_divides(const at::Tensor& inputs, const at::Tensor& targets) const {
    for (const at::Tensor* t : {&inputs, &targets}) {
      MESHTRAIN_CHECK(!t->defined() || (t->dim() >= 1 && t->size(0) % microbatches == 0), "train::Trainer: a batch "
                      "of ", t->dim() >= 1 ? t->size(0) : 0, " samples does not divide into ", microbatches,
                      " micro-batches; pass a multiple of ", microbatches, " per data-parallel rank");
    }
  }

  // The axes' counters, evaluation included; "dp" is the gradients' (over
  // dp x cp), "cp" the ring attention's keys and values (only with cp > 1).
  std::map<std::string, comm::Traffic> raw_traffic() const {
    comm::Traffic dp = mesh.dp_cp()->traffic();
    for (const auto& c : chunk_dps) dp = dp + c->traffic();
    if (expert_replicas) dp = dp + expert_replicas->traffic();  // the experts' gradients
    if (balance_dp) dp = dp + balance_dp->traffic();  // the global balance loss's expert counts
    std::map<std::string, comm::Traffic> out{{"dp", dp}, {"pp", mesh.pp()->traffic()}, {"tp", mesh.tp()->traffic()}};
    if (mesh.cp()->size() > 1) out["cp"] = mesh.cp()->traffic();
    if (ep) out["ep"] = ep->traffic();  // dispatch and combine
    return out;
  }

  double mean_over_dp(double loss) const {
    if (!loss_dp) return loss;
    at::Tensor mean = at::tensor({loss}, at::kDouble);
    loss_dp->all_reduce(mean, comm::ReduceOp::kAvg);
    return mean.item<double>();
  }

  std::vector<GradPart> gradient_parts() {
    std::vector<GradPart> parts;
    for (auto& chunk : chunks) {
      std::vector<GradPart> mine = chunk->gradient_parts(place(*chunk));
      if (is_expert_chunk(*chunk) && mesh.coord().tp != 0)  // every tp rank holds the same experts
        for (GradPart& part : mine) part.counted = false;
      parts.insert(parts.end(), mine.begin(), mine.end());
    }
    return parts;
  }
};

Trainer::Trainer(torch::nn::Sequential model, const mesh::DeviceMesh& mesh, Loss loss, MakeOptimizer make_optimizer,
                 TrainerOptions options)
    : s_(std::make_unique<State>(mesh, loss, std::move(make_optimizer), options)) {
  if (s_->pipelined && s_->pipeline_options.split_points().empty())
    s_->pipeline_options.split_points(balanced_split(*model, mesh.pp()->size() * s_->pipeline_options.virtual_stages()));
  if (mesh.tp()->size() > 1 && !options.tp_plan().empty())
    tp::parallelize(*model, mesh.tp(), options.tp_plan(), options.tp_options());
  if (s_->pipelined) {
    s_->pipeline.emplace(pp::pipeline(model, mesh.pp(), loss, s_->pipeline_options));
    s_->root = s_->pipeline->module();  // this rank keeps its stage only (the caller should drop its handle too)
  } else {
    s_->root = model.ptr();
    s_->forward = pp::stage_module(model).forward;
  }
  s_->wrap_data_axis();
}

Trainer::Trainer(std::vector<pp::StageModule> my_stages, const mesh::DeviceMesh& mesh, Loss loss,
                 MakeOptimizer make_optimizer, TrainerOptions options)
    : s_(std::make_unique<State>(mesh, loss, std::move(make_optimizer), options)) {
  MESHTRAIN_CHECK(options.tp_plan().empty(), "train::Trainer: a tp_plan applies to a whole model; cut the stages you "
                  "build (tp::parallelize on each) and leave tp_plan empty");
  if (s_->pipelined) {
    s_->pipeline.emplace(std::move(my_stages), mesh.pp(), loss, s_->pipeline_options);
    s_->root = s_->pipeline->module();
  } else {
    MESHTRAIN_CHECK(my_stages.size() == 1, "train::Trainer: ", my_stages.size(), " stages on a rank without a "
                    "pipeline (pp 1, one virtual stage); pass the whole model as one stage");
    s_->root = my_stages[0].module;
    s_->forward = my_stages[0].forward;
  }
  s_->wrap_data_axis();
}

Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

double Trainer::step(const at::Tensor& inputs, const at::Tensor& targets) {
  s_->check_divides(inputs, targets);
  const bool deterministic = s_->options.deterministic();  // Note [Deterministic training]
  for (auto& chunk : s_->chunks) chunk->zero_grad();
  for (auto& statistics : s_->balance) statistics->begin_step();
  s_->grain_losses.clear();
  const at::Tensor x = s_->in_compute_dtype(inputs);
  double loss = s_->pipeline ? s_->pipeline->step(x, targets) : s_->accumulate(x, targets);
  if (deterministic) s_->put_back_grains();
  for (auto& chunk : s_->chunks) chunk->finish_gradients();
  if (s_->options.clip_grad_norm() > 0 || s_->options.measure_grad_norm()) {
    const std::vector<GradPart> parts = s_->gradient_parts();
    const double max_norm = s_->options.clip_grad_norm();
    s_->grad_norm = deterministic ? clip_grad_norm_exact(parts, max_norm, *s_->mesh.world())
                                  : clip_grad_norm(parts, max_norm, *s_->mesh.world());
  }
  for (auto& chunk : s_->chunks) chunk->step();
  if (!deterministic) return s_->mean_over_dp(loss);
  return s_->tree_mean_loss(s_->pipeline ? s_->pipeline->microbatch_losses() : s_->grain_losses);
}

double Trainer::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  const int64_t M = s_->microbatches;
  s_->check_divides(inputs, targets);
  const std::map<std::string, comm::Traffic> before = s_->raw_traffic();
  const at::Tensor x = s_->in_compute_dtype(inputs);
  EvalMode eval_mode(s_->root);  // Dropout off, BatchNorm's running statistics read, not updated
  // The micro-batches one at a time, as training holds them (the mean of equal parts' means).
  double loss = 0;
  for (int64_t j = 0; j < M; ++j) {
    const at::Tensor xj = s_->micro_batch(x, j), tj = s_->micro_batch(targets, j);
    if (s_->pipeline) {
      loss += s_->pipeline->evaluate(xj, tj) / M;
    } else {
      at::NoGradGuard no_grad;
      loss += s_->loss(s_->forward(xj), tj).item<double>() / M;
    }
  }
  // Not training traffic: left out of traffic_by_axis.
  for (const auto& kv : s_->raw_traffic()) {
    comm::Traffic& excluded = s_->evaluation_traffic[kv.first];
    excluded = excluded + (kv.second - before.at(kv.first));
  }
  return s_->mean_over_dp(loss);
}

void Trainer::set_learning_rate(double lr) {
  for (auto& chunk : s_->chunks) train::set_learning_rate(chunk->optimizer(), lr);
}

double Trainer::last_grad_norm() const { return s_->grad_norm; }

const std::shared_ptr<torch::nn::Module>& Trainer::module() const { return s_->root; }

std::map<std::string, at::Tensor> Trainer::parameters_over_dp() {
  std::map<std::string, at::Tensor> out;
  for (auto& chunk : s_->chunks)
    for (auto& kv : chunk->parameters_on_dp_root()) out[kv.first] = kv.second;
  return out;
}

std::map<std::string, at::Tensor> Trainer::full_parameters() {
  std::map<std::string, at::Tensor> mine;
  const mesh::Coord me = s_->mesh.coord();
  const bool dp_root = s_->mesh.dp_cp()->rank() == 0;  // the first of the ranks holding these parameters
  for (auto& chunk : s_->chunks) {
    std::map<std::string, at::Tensor> part = chunk->parameters_on_dp_root();
    if (s_->is_expert_chunk(*chunk)) {  // the first replica of each ep rank: one ep group
      if (!part.empty()) part = gather_experts(part, *s_->ep);
    } else if (s_->mesh.tp()->size() > 1 && dp_root)  // full tensors from the tp shards (a collective within this dp-root's tp group)
      part = tp::unshard(part, tp::shard_dims(*chunk->module()), *s_->mesh.tp());
    for (auto& p : part) mine[p.first] = p.second;
  }
  // Every stage's dp-root, tp rank 0, sends its parameters to world rank 0.
  const bool sender = dp_root && me.tp == 0;
  std::map<std::string, at::Tensor> full;
  for (const auto& part : comm::gather_strings(*s_->mesh.world(), sender ? serialize_tensors(mine) : "", 0)) {
    if (part.empty()) continue;
    for (auto& kv : deserialize_tensors(part, "stage parameters")) full[kv.first] = kv.second;
  }
  return full;
}

RankState Trainer::checkpoint_state() {
  RankState out;
  for (auto& chunk : s_->chunks) chunk->add_to_checkpoint(out, s_->place(*chunk));
  return out;
}

void Trainer::load_checkpoint(CheckpointReader& reader) {
  for (auto& chunk : s_->chunks) chunk->load_checkpoint(reader, s_->place(*chunk));
}

StateBytes Trainer::held_bytes() const {
  StateBytes s;
  for (const auto& chunk : s_->chunks) {
    const StateBytes h = chunk->held();
    s.parameters += h.parameters;
    s.gradients += h.gradients;
    s.optimizer += h.optimizer;
    s.buffers += h.buffers;  // ZeRO-3: each chunk's units over its own communicator (chunk_dp)
  }
  return s;
}

std::map<std::string, comm::Traffic> Trainer::traffic_by_axis() const {
  std::map<std::string, comm::Traffic> out = s_->raw_traffic();
  for (auto& kv : out) kv.second = kv.second - s_->evaluation_traffic[kv.first];
  return out;
}

void Trainer::reset_traffic() {
  s_->evaluation_traffic.clear();
  for (auto axis : {mesh::Axis::kDp, mesh::Axis::kPp, mesh::Axis::kTp, mesh::Axis::kCp})
    s_->mesh.axis(axis)->reset_traffic();
  s_->mesh.dp_cp()->reset_traffic();
  for (auto& c : s_->chunk_dps) c->reset_traffic();
  if (s_->ep) s_->ep->reset_traffic();
  if (s_->expert_replicas) s_->expert_replicas->reset_traffic();
  if (s_->balance_dp) s_->balance_dp->reset_traffic();
}

std::vector<pp::TraceEvent> Trainer::last_trace() const {
  return s_->pipeline ? s_->pipeline->last_trace() : std::vector<pp::TraceEvent>{};
}

int Trainer::max_activations_in_flight() const {
  return s_->pipeline ? s_->pipeline->max_activations_in_flight() : 0;
}

}  // namespace train
}  // namespace meshtrain
