#include "meshtrain/train/config.h"

#include <functional>
#include <cmath>
#include <map>

#include "meshtrain/models/checkpointing.h"
#include "meshtrain/pp/schedule.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/files.h"
#include "meshtrain/util/json.h"
#include "meshtrain/util/strings.h"

namespace meshtrain {
namespace train {

namespace {

int64_t to_int(const std::string& flag, const std::string& v) {
  try {
    size_t pos = 0;
    const long long x = std::stoll(v, &pos);
    if (pos == v.size()) return x;
  } catch (const std::exception&) {
  }
  throw ConfigError(str_cat("meshtrain: ", flag, " '", v, "' is not an integer"));
}

double to_double(const std::string& flag, const std::string& v) {
  try {
    size_t pos = 0;
    const double x = std::stod(v, &pos);
    if (pos == v.size()) return x;
  } catch (const std::exception&) {
  }
  throw ConfigError(str_cat("meshtrain: ", flag, " '", v, "' is not a number"));
}

using Setter = std::function<void(TrainConfig&, const std::string&, const std::string&)>;

const std::map<std::string, Setter>& value_flags() {
  static const std::map<std::string, Setter> flags = {
      {"--model", [](TrainConfig& c, const std::string&, const std::string& v) { c.model.kind = v; }},
      {"--layers", [](TrainConfig& c, const std::string& f, const std::string& v) { c.model.layers = to_int(f, v); }},
      {"--hidden", [](TrainConfig& c, const std::string& f, const std::string& v) { c.model.hidden = to_int(f, v); }},
      {"--heads", [](TrainConfig& c, const std::string& f, const std::string& v) { c.model.heads = to_int(f, v); }},
      {"--vocab", [](TrainConfig& c, const std::string& f, const std::string& v) { c.model.vocab = to_int(f, v); }},
      {"--seq-len", [](TrainConfig& c, const std::string& f, const std::string& v) { c.model.seq_len = to_int(f, v); }},
      {"--features", [](TrainConfig& c, const std::string& f, const std::string& v) { c.model.features = to_int(f, v); }},
      {"--classes", [](TrainConfig& c, const std::string& f, const std::string& v) { c.model.classes = to_int(f, v); }},
      {"--strategy", [](TrainConfig& c, const std::string&, const std::string& v) { c.strategy = v; }},
      {"--zero", [](TrainConfig& c, const std::string& f, const std::string& v) { c.zero = static_cast<int>(to_int(f, v)); }},
      {"--dp", [](TrainConfig& c, const std::string& f, const std::string& v) { c.dp = static_cast<int>(to_int(f, v)); }},
      {"--pp", [](TrainConfig& c, const std::string& f, const std::string& v) { c.pp = static_cast<int>(to_int(f, v)); }},
      {"--tp", [](TrainConfig& c, const std::string& f, const std::string& v) { c.tp = static_cast<int>(to_int(f, v)); }},
      {"--schedule", [](TrainConfig& c, const std::string&, const std::string& v) { c.schedule = v; }},
      {"--microbatches", [](TrainConfig& c, const std::string& f, const std::string& v) { c.microbatches = static_cast<int>(to_int(f, v)); }},
      {"--virtual-stages", [](TrainConfig& c, const std::string& f, const std::string& v) { c.virtual_stages = static_cast<int>(to_int(f, v)); }},
      {"--stage-boundaries", [](TrainConfig& c, const std::string& f, const std::string& v) {
         c.stage_boundaries.clear();
         for (const std::string& b : split(v, ',')) c.stage_boundaries.push_back(to_int(f, b));
       }},
      {"--global-batch", [](TrainConfig& c, const std::string& f, const std::string& v) { c.global_batch = to_int(f, v); }},
      {"--micro-batch", [](TrainConfig& c, const std::string& f, const std::string& v) { c.micro_batch = to_int(f, v); }},
      {"--steps", [](TrainConfig& c, const std::string& f, const std::string& v) { c.steps = static_cast<int>(to_int(f, v)); }},
      {"--optimizer", [](TrainConfig& c, const std::string&, const std::string& v) { c.optimizer = v; }},
      {"--lr", [](TrainConfig& c, const std::string& f, const std::string& v) { c.lr = to_double(f, v); }},
      {"--lr-schedule", [](TrainConfig& c, const std::string&, const std::string& v) { c.lr_schedule = v; }},
      {"--warmup-steps", [](TrainConfig& c, const std::string& f, const std::string& v) { c.warmup_steps = static_cast<int>(to_int(f, v)); }},
      {"--weight-decay", [](TrainConfig& c, const std::string& f, const std::string& v) { c.weight_decay = to_double(f, v); }},
      {"--momentum", [](TrainConfig& c, const std::string& f, const std::string& v) { c.momentum = to_double(f, v); }},
      {"--adam-eps", [](TrainConfig& c, const std::string& f, const std::string& v) { c.adam_eps = to_double(f, v); }},
      {"--precision", [](TrainConfig& c, const std::string&, const std::string& v) { c.precision = v; }},
      {"--reduce-dtype", [](TrainConfig& c, const std::string&, const std::string& v) { c.reduce_dtype = v; }},
      {"--clip-grad-norm", [](TrainConfig& c, const std::string& f, const std::string& v) { c.clip_grad_norm = to_double(f, v); }},
      {"--activation-checkpointing", [](TrainConfig& c, const std::string&, const std::string& v) { c.activation_checkpointing = v; }},
      {"--seed", [](TrainConfig& c, const std::string& f, const std::string& v) {
         c.seed = static_cast<uint64_t>(to_int(f, v));
         c.model.seed = c.seed;
       }},
      {"--log-every", [](TrainConfig& c, const std::string& f, const std::string& v) { c.log_every = static_cast<int>(to_int(f, v)); }},
      {"--data", [](TrainConfig& c, const std::string&, const std::string& v) { c.data = v; }},
      {"--digits", [](TrainConfig& c, const std::string& f, const std::string& v) { c.digits = static_cast<int>(to_int(f, v)); }},
      {"--metrics-out", [](TrainConfig& c, const std::string&, const std::string& v) { c.metrics_out = v; }},
      {"--bucket-cap-mb", [](TrainConfig& c, const std::string& f, const std::string& v) { c.bucket_cap_mb = to_double(f, v); }},
      {"--eval-problems", [](TrainConfig& c, const std::string& f, const std::string& v) { c.eval_problems = static_cast<int>(to_int(f, v)); }},
      {"--plot", [](TrainConfig& c, const std::string&, const std::string& v) { c.plot = v; }},
      {"--save-dir", [](TrainConfig& c, const std::string&, const std::string& v) { c.save_dir = v; }},
      {"--save-every", [](TrainConfig& c, const std::string& f, const std::string& v) { c.save_every = static_cast<int>(to_int(f, v)); }},
      {"--trace", [](TrainConfig& c, const std::string&, const std::string& v) { c.trace = v; }},
      {"--backend", [](TrainConfig& c, const std::string&, const std::string& v) { c.backend = v; }},
  };
  return flags;
}

const std::map<std::string, std::function<void(TrainConfig&)>>& switch_flags() {
  static const std::map<std::string, std::function<void(TrainConfig&)>> flags = {
      {"--sequence-parallel", [](TrainConfig& c) { c.sequence_parallel = true; }},
      {"--no-overlap", [](TrainConfig& c) { c.overlap = false; }},
      {"--untied", [](TrainConfig& c) { c.model.tie_embeddings = false; }},
      {"--resume", [](TrainConfig& c) { c.resume = true; }},
  };
  return flags;
}

}  // namespace

std::string train_usage() {
  return "usage: meshtrain [--model gpt|mlp] [--layers N --hidden H --heads A --vocab V --seq-len T]\n"
         "                 [--features F --classes C]  (mlp)\n"
         "                 [--dp D --pp P --tp T] [--strategy ddp|dp] [--zero 0|1|2|3]\n"
         "                 [--schedule naive|gpipe|1f1b|interleaved --microbatches M --virtual-stages V]\n"
         "                 [--stage-boundaries B1,B2,...]  (first piece of each later stage; default: balanced)\n"
         "                 [--sequence-parallel] [--global-batch G] [--micro-batch B] [--steps S]\n"
         "                 [--optimizer sgd|adam|adamw] [--lr LR] [--lr-schedule constant|cosine]\n"
         "                 [--warmup-steps N] [--weight-decay W] [--momentum M] [--adam-eps E]\n"
         "                 [--precision fp32|bf16-mixed [--reduce-dtype bf16|fp32]]  (bf16 compute, fp32 master weights)\n"
         "                 [--clip-grad-norm X]  (global L2 norm over every layout; default 0: measured, not clipped)\n"
         "                 [--activation-checkpointing none|blocks|every-N]  (recompute blocks in backward)\n"
         "                 [--seed S] [--log-every N] [--data FILE | --digits D] [--metrics-out FILE] [--plot FILE.svg]\n"
         "                 [--bucket-cap-mb MB] [--no-overlap] [--untied] [--eval-problems N]\n"
         "                 [--save-dir DIR --save-every N] [--resume] [--trace FILE]\n"
         "                 [--backend auto|shm|gloo|mpi]  (default: MESHTRAIN_BACKEND, else auto: shared memory\n"
         "                  inside a host, hierarchical across hosts, MPI under mpirun)\n"
         "       meshtrain plan ...   (the planner; meshtrain plan --help)\n"
         "Run under meshrun: meshrun --nproc-per-node 4 -- meshtrain --model gpt --dp 2 --tp 2\n";
}

TrainConfig parse_train_args(const std::vector<std::string>& args) {
  TrainConfig c;
  c.model.seed = c.seed;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], value;
    bool has_inline = false;
    const auto eq = flag.find('=');
    if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_inline = true;
    }
    if (flag == "--help" || flag == "-h") throw ConfigError(train_usage());
    auto sw = switch_flags().find(flag);
    if (sw != switch_flags().end()) {
      sw->second(c);
      continue;
    }
    auto vf = value_flags().find(flag);
    MESHTRAIN_CHECK(vf != value_flags().end(), "meshtrain: unknown flag '", args[i], "'\n", train_usage());
    if (!has_inline) {
      MESHTRAIN_CHECK(i + 1 < args.size(), "meshtrain: ", flag, " needs a value");
      value = args[++i];
    }
    vf->second(c, flag, value);
  }
  return c;
}

TrainConfig resolve(TrainConfig c, int world) {
  auto& m = c.model;
  MESHTRAIN_CHECK(m.kind == "gpt" || m.kind == "mlp", "--model '", m.kind, "' is unknown; use gpt or mlp");
  MESHTRAIN_CHECK(c.strategy == "ddp" || c.strategy == "dp", "--strategy '", c.strategy,
                  "' is unknown; use ddp (DistributedDataParallel) or dp (the article's master DP)");
  MESHTRAIN_CHECK(c.zero >= 0 && c.zero <= 3, "--zero ", c.zero, " must be 0, 1, 2 or 3");
  MESHTRAIN_CHECK(c.optimizer == "sgd" || c.optimizer == "adam" || c.optimizer == "adamw", "--optimizer '",
                  c.optimizer, "' is unknown; use sgd, adam or adamw");
  MESHTRAIN_CHECK(c.pp >= 1 && c.tp >= 1 && c.dp >= 0, "--dp, --pp and --tp must be positive (got dp ", c.dp,
                  ", pp ", c.pp, ", tp ", c.tp, ")");
  MESHTRAIN_CHECK(c.steps >= 1, "--steps ", c.steps, " must be at least 1");
  MESHTRAIN_CHECK(c.lr > 0, "--lr ", c.lr, " must be positive");
  MESHTRAIN_CHECK(c.adam_eps > 0, "--adam-eps ", c.adam_eps, " must be positive");
  MESHTRAIN_CHECK(std::isfinite(c.clip_grad_norm) && c.clip_grad_norm >= 0, "--clip-grad-norm ", c.clip_grad_norm,
                  " must be a finite number >= 0 (0: no clipping)");
  models::checkpointing_period(c.activation_checkpointing);  // throws ConfigError naming the value
  MESHTRAIN_CHECK(c.precision == "fp32" || c.precision == "bf16-mixed", "--precision '", c.precision,
                  "' is unknown; use fp32 or bf16-mixed");
  MESHTRAIN_CHECK(c.reduce_dtype == "bf16" || c.reduce_dtype == "fp32", "--reduce-dtype '", c.reduce_dtype,
                  "' is unknown; use bf16 (half the bytes) or fp32 (sums in fp32)");
  MESHTRAIN_CHECK(c.precision == "fp32" || c.zero == 0 || c.reduce_dtype == "bf16", "--reduce-dtype fp32 with "
                  "--zero ", c.zero, " is not implemented yet (ZeRO reduce-scatters in the parameters' dtype); use "
                  "--reduce-dtype bf16 or --zero 0");
  MESHTRAIN_CHECK(c.lr_schedule == "constant" || c.lr_schedule == "cosine", "--lr-schedule '", c.lr_schedule,
                  "' is unknown; use constant or cosine");
  MESHTRAIN_CHECK(c.warmup_steps >= 0, "--warmup-steps ", c.warmup_steps, " must be >= 0");
  MESHTRAIN_CHECK(c.save_every >= 0, "--save-every ", c.save_every, " must be >= 0");
  MESHTRAIN_CHECK(c.save_every == 0 || !c.save_dir.empty(), "--save-every needs --save-dir");
  MESHTRAIN_CHECK(!c.resume || !c.save_dir.empty(), "--resume needs --save-dir (where the checkpoints are)");
  MESHTRAIN_CHECK(c.digits >= 1 && c.digits <= 6, "--digits ", c.digits, " must be in [1, 6]");
  MESHTRAIN_CHECK(c.log_every >= 1, "--log-every ", c.log_every, " must be at least 1");
  MESHTRAIN_CHECK(c.backend.empty() || c.backend == "auto" || c.backend == "shm" || c.backend == "gloo" ||
                      c.backend == "mpi",
                  "--backend '", c.backend, "' is not a backend; use auto, shm, gloo or mpi");
  if (c.dp == 0) {
    MESHTRAIN_CHECK(world % (c.pp * c.tp) == 0, "the world size ", world, " is not divisible by pp x tp = ", c.pp,
                    " x ", c.tp, "; choose pp and tp whose product divides ", world);
    c.dp = world / (c.pp * c.tp);
  }
  MESHTRAIN_CHECK(c.dp * c.pp * c.tp == world, "the layout dp ", c.dp, " x pp ", c.pp, " x tp ", c.tp, " = ",
                  c.dp * c.pp * c.tp, " ranks does not match the world size ", world,
                  "; run with --nproc-per-node ", c.dp * c.pp * c.tp, " or change the degrees");
  MESHTRAIN_CHECK(c.strategy == "ddp" || c.zero == 0, "--strategy dp (master DP) cannot be combined with --zero ",
                  c.zero, "; ZeRO partitions DDP's state: use --strategy ddp");
  MESHTRAIN_CHECK(!c.sequence_parallel || c.tp > 1, "--sequence-parallel needs --tp > 1 (it splits the sequence over the tensor-parallel ranks)");
  MESHTRAIN_CHECK(c.strategy == "ddp" || (c.pp == 1 && c.tp == 1), "--strategy dp (the article's master DP) runs the "
                  "whole model on every rank and computes the loss on rank 0; it cannot be combined with --pp ", c.pp,
                  " or --tp ", c.tp, ". Use --strategy ddp (optionally with --zero) for the data axis of a mesh");
  MESHTRAIN_CHECK(c.global_batch >= 1 && c.global_batch % c.dp == 0, "--global-batch ", c.global_batch,
                  " must be a positive multiple of the data-parallel degree ", c.dp);
  const int64_t local = c.global_batch / c.dp;
  if (c.pp > 1 || c.virtual_stages > 1) {
    // Pipeline micro-batches: --microbatches M, or derived from --micro-batch, or pp.
    if (c.microbatches == 0) c.microbatches = c.micro_batch > 0 ? static_cast<int>(local / c.micro_batch) : c.pp;
    MESHTRAIN_CHECK(c.microbatches >= 1 && local % c.microbatches == 0, "each data-parallel rank gets ", local,
                    " samples per step (--global-batch ", c.global_batch, " / dp ", c.dp, "), which --microbatches ",
                    c.microbatches, " does not divide; choose a divisor of ", local);
    MESHTRAIN_CHECK(c.micro_batch == 0 || c.micro_batch * c.microbatches == local, "--micro-batch ", c.micro_batch,
                    " x --microbatches ", c.microbatches, " must equal the samples per data-parallel rank, ", local);
    c.micro_batch = local / c.microbatches;
    pp::validate(pp::ScheduleSpec{c.schedule, c.pp, c.microbatches, c.virtual_stages});
    if (!c.stage_boundaries.empty()) pp::partition_explicit(c.stage_boundaries, models::num_pieces(m), c.pp * c.virtual_stages);
    MESHTRAIN_CHECK(models::num_pieces(m) >= c.pp * c.virtual_stages, "the model has ", models::num_pieces(m),
                    " pieces (", m.kind == "gpt" ? "embedding, blocks, head" : "layers", "), fewer than pp x virtual "
                    "stages = ", c.pp * c.virtual_stages, "; use more --layers or fewer stages");
  } else {
    if (c.micro_batch == 0) c.micro_batch = local;
    MESHTRAIN_CHECK(c.microbatches == 0, "--microbatches is for pipelines (--pp > 1); use --micro-batch for "
                    "gradient accumulation");
    MESHTRAIN_CHECK(c.stage_boundaries.empty(), "--stage-boundaries is for pipelines (--pp > 1)");
  }
  MESHTRAIN_CHECK(c.micro_batch >= 1 && local % c.micro_batch == 0, "--global-batch ", c.global_batch,
                  " is not divisible by dp x micro-batch = ", c.dp, " x ", c.micro_batch,
                  "; each data-parallel rank gets ", local, " samples per step, to be split into micro-batches of ",
                  c.micro_batch);
  if (!c.data.empty() && m.kind == "gpt") m.vocab = std::max<int64_t>(m.vocab, 256);  // byte tokens
  m.seed = c.seed;
  models::validate(m, c.tp, c.sequence_parallel);
  MESHTRAIN_CHECK(c.data.empty() || files::exists(c.data), "--data ", c.data,
                  ": no such file; give a text file to train on, or leave --data out for the built-in task");
  return c;
}

double learning_rate(const TrainConfig& c, int64_t step) {
  if (step < c.warmup_steps) return c.lr * static_cast<double>(step + 1) / c.warmup_steps;
  if (c.lr_schedule == "constant") return c.lr;
  const double span = std::max<int64_t>(1, c.steps - c.warmup_steps - 1);
  const double progress = std::min(1.0, (step - c.warmup_steps) / span);
  return c.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

int64_t accumulation_steps(const TrainConfig& c) { return c.global_batch / c.dp / c.micro_batch; }

std::string to_json(const TrainConfig& c) {
  json::Object model;
  model.str("kind", c.model.kind).integer("layers", c.model.layers).integer("hidden", c.model.hidden);
  if (c.model.kind == "gpt") {
    model.integer("heads", c.model.heads).integer("vocab", c.model.vocab).integer("seq_len", c.model.seq_len)
        .boolean("tie_embeddings", c.model.tie_embeddings);
  } else {
    model.integer("features", c.model.features).integer("classes", c.model.classes);
  }
  model.integer("parameters", models::parameter_count(c.model));
  json::Object o;
  o.raw("model", model.str())
      .integer("dp", c.dp).integer("pp", c.pp).integer("tp", c.tp)
      .str("strategy", c.strategy).integer("zero", c.zero)
      .str("schedule", c.schedule).integer("microbatches", c.microbatches).integer("virtual_stages", c.virtual_stages)
      .raw("stage_boundaries", json::numbers(std::vector<double>(c.stage_boundaries.begin(), c.stage_boundaries.end())))
      .boolean("sequence_parallel", c.sequence_parallel)
      .integer("global_batch", c.global_batch).integer("micro_batch", c.micro_batch)
      .integer("accumulation_steps", accumulation_steps(c)).integer("steps", c.steps)
      .str("optimizer", c.optimizer).num("lr", c.lr).str("lr_schedule", c.lr_schedule).integer("warmup_steps", c.warmup_steps).num("weight_decay", c.weight_decay).num("momentum", c.momentum).num("adam_eps", c.adam_eps)
      .str("precision", c.precision)
      .str("reduce_dtype", c.precision == "fp32" ? "fp32" : c.reduce_dtype)
      .num("clip_grad_norm", c.clip_grad_norm).str("activation_checkpointing", c.activation_checkpointing)
      .integer("seed", static_cast<long long>(c.seed)).str("data", c.data.empty() ? "arithmetic, " + std::to_string(c.digits) + "-digit operands" : c.data)
      .num("bucket_cap_mb", c.bucket_cap_mb).boolean("overlap", c.overlap)
      .str("backend", c.backend.empty() ? "auto" : c.backend);
  return o.str();
}

}  // namespace train
}  // namespace meshtrain
