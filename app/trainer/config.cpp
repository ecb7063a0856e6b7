#include "app/trainer/config.h"

#include "app/trainer/config_file.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <functional>
#include <map>
#include <type_traits>

#include "meshtrain/io.h"
#include "meshtrain/models.h"
#include "meshtrain/moe.h"
#include "meshtrain/pp.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "util/files.h"
#include "util/flags.h"
#include "util/strings.h"
#include "resolve_data.h"

namespace meshtrain {
namespace train {

namespace {

using flags::Flag;
using flags::store;
using flags::turn;

// The trainer's model and layout flags, setting fields of `c`.
std::vector<flags::Group> model_and_layout_flags(TrainConfig& c) {
  models::ModelConfig& m = c.model;
  auto vocab = [&c](const std::string& f, const std::string& v) {
    c.model.vocab = flags::to_int64(f, v);
    c.vocab_given = true;
  };
  auto boundaries = [&c](const std::string& f, const std::string& v) {
    c.stage_boundaries.clear();
    for (const std::string& b : split(v, ',')) c.stage_boundaries.push_back(flags::to_int64(f, b));
  };
  return {
      {"model",
       {store("--model", "gpt|gpt2|llama|mlp", "the built-in model: a small GPT, GPT-2 (as llm.c), Llama (as Hugging "
              "Face's), an MLP (default gpt)", m.kind),
        store("--layers", "N", "blocks (language models) / layers (mlp)", m.layers),
        store("--hidden", "H", "hidden size", m.hidden),
        store("--heads", "A", "attention heads", m.heads),
        store("--kv-heads", "K", "llama: key/value heads, grouped-query attention (default: --heads)", m.kv_heads),
        store("--ffn-hidden", "F", "the MLP's inner size (default: 4 x hidden; llama: 8/3 x hidden rounded up to 32)",
              m.ffn_hidden),
        Flag{"--vocab", "V", "vocabulary (default: what the token shards' header records, else 128)", vocab},
        store("--seq-len", "T", "tokens per sample", m.seq_len),
        store("--max-positions", "P", "positions the model takes (default: --seq-len)", m.max_positions),
        Flag{"--attention", "auto|eager|flash",
             "the attention kernel: flash keeps one log-sum-exp per row instead of the T x T softmax (activations "
             "linear in T); auto: flash from " + std::to_string(nn::kFlashFromSeqLen) + " positions (default auto)",
             [&m](const std::string&, const std::string& v) { m.attention = nn::parse_attention_kernel(v); }},
        store("--experts", "E", "mixture of experts: every block's MLP becomes E expert MLPs and a router "
              "(default 0: dense)", m.experts),
        store("--top-k", "K", "with --experts: experts each token is computed by (default 2)", m.top_k),
        store("--capacity-factor", "CF", "with --experts: each expert computes at most CF x tokens x top-k / experts "
              "routes, the rest dropped (default 0: dropless)", m.capacity_factor),
        store("--aux-loss-coef", "C", "with --experts: the load-balancing loss's coefficient (default 0.01; 0: none)",
              m.aux_loss_coef),
        store("--aux-loss-scope", "global|micro", "with --experts: the balance loss over the step's whole batch, "
              "alike on every layout, or over each micro-batch of each rank (Megatron-LM's and DeepSpeed's) "
              "(default global)", c.aux_loss_scope),
        store("--rope-theta", "R", "llama: rotary base (Llama 2: 10000, Llama 3: 500000)", m.rope_theta),
        store("--features", "F", "input features (mlp)", m.features),
        store("--classes", "C", "classes (mlp)", m.classes),
        Flag{"--untied", "", "the LM head gets its own weight (default for llama)",
             [&c](const std::string&, const std::string&) { c.tie = "untied"; }},
        Flag{"--tied", "", "the LM head is the token embedding (default for gpt and gpt2)",
             [&c](const std::string&, const std::string&) { c.tie = "tied"; }},
        store("--init-from", "PATH", "start from published weights: an llm.c GPT-2 checkpoint (.bin) or a Hugging "
              "Face directory (gpt2, llama); the shape comes from them", c.init_from)}},
      {"layout",
       {store("--dp", "D", "data-parallel degree (default: world / (pp x tp))", c.dp),
        store("--pp", "P", "pipeline stages (default 1)", c.pp),
        store("--tp", "T", "tensor-parallel degree (default 1)", c.tp),
        store("--cp", "C", "context-parallel degree: each sequence split over C ranks, ring attention (default 1)",
              c.cp),
        store("--ep", "E", "expert-parallel degree: each MoE layer's experts split over E ranks of dp x cp "
              "(default 1)", c.ep),
        store("--strategy", "ddp|dp", "data axis: DDP, or the article's master DP (default ddp)", c.strategy),
        store("--zero", "0|1|2|3", "ZeRO stage on the data axis (default 0: plain DDP)", c.zero),
        store("--schedule", "naive|gpipe|1f1b|interleaved", "pipeline schedule (default 1f1b; gpipe with "
              "--experts under --aux-loss-scope global)", c.schedule),
        store("--microbatches", "M", "pipeline micro-batches (default: derived)", c.microbatches),
        store("--virtual-stages", "V", "model chunks per pipeline rank (interleaved; default 1)", c.virtual_stages),
        Flag{"--stage-boundaries", "B1,B2,...", "first piece of each later stage (default: balanced)", boundaries},
        turn("--sequence-parallel", "shard layer norms' activations along the sequence over tp", c.sequence_parallel),
        store("--elastic-layouts", "W:dpAxppBxtpC,...", "under meshrun --nnodes MIN:MAX, the layout of each world "
              "size W (default: these flags' layout where it fits, else the planner's)", c.elastic_layouts)}},
  };
}

// Each model flag also records that it was given (TrainConfig::model_flags).
void record_model_flags(flags::Group& model, TrainConfig& c) {
  for (flags::Flag& f : model.flags) {
    auto set = f.set;
    f.set = [set, &c](const std::string& flag, const std::string& value) {
      set(flag, value);
      c.model_flags.insert(flag);
    };
  }
}

// The flags that set something other than one field say their value too
// (`meshtrain config --dump`).
void give_values(std::vector<flags::Group>& groups, TrainConfig& c) {
  const std::map<std::string, std::function<std::string()>> values = {
      {"--vocab", [&c] { return c.vocab_given ? std::to_string(c.model.vocab) : std::string(); }},
      {"--attention", [&c] { return nn::attention_kernel_name(c.model.attention); }},
      {"--untied", [&c] { return c.tie == "untied" ? std::string("true") : std::string(); }},
      {"--tied", [&c] { return c.tie == "tied" ? std::string("true") : std::string(); }},
      {"--seed", [&c] { return std::to_string(c.seed); }},
      {"--stage-boundaries", [&c] {
         std::vector<std::string> b;
         for (int64_t x : c.stage_boundaries) b.push_back(std::to_string(x));
         return join(b, ",");
       }},
  };
  for (flags::Group& g : groups)
    for (flags::Flag& f : g.flags)
      if (values.count(f.name)) f.get = values.at(f.name), f.text = f.name != "--vocab" && f.name != "--seed";
}

// The trainer's flags, setting fields of `c`. The usage text is generated from this table.
std::vector<flags::Group> train_flags(TrainConfig& c) {
  auto seed = [&c](const std::string& f, const std::string& v) { c.model.seed = c.seed = flags::to_integer<uint64_t>(f, v); };
  std::vector<flags::Group> groups = model_and_layout_flags(c);
  record_model_flags(groups.front(), c);
  std::vector<flags::Group> rest = {
      {"optimization",
       {store("--global-batch", "G", "samples per step (default 24)", c.global_batch),
        store("--micro-batch", "B", "samples per forward (default: global batch / dp, no accumulation)", c.micro_batch),
        store("--steps", "S", "optimizer steps (default 20)", c.steps),
        store("--optimizer", "sgd|adam|adamw", "default adamw", c.optimizer),
        store("--lr", "LR", "learning rate (default 2e-3)", c.lr),
        store("--lr-schedule", "constant|cosine", "cosine: to lr/10 at the last step (default constant)", c.lr_schedule),
        store("--warmup-steps", "N", "linear warm-up from 0 (default 0)", c.warmup_steps),
        store("--weight-decay", "W", "default 0", c.weight_decay),
        store("--momentum", "M", "SGD momentum (default 0)", c.momentum),
        store("--adam-eps", "E", "Adam/AdamW eps (default 1e-8)", c.adam_eps),
        store("--precision", "fp32|bf16-mixed", "bf16-mixed: bf16 compute, fp32 master weights (default fp32)",
              c.precision),
        store("--reduce-dtype", "bf16|fp32", "bf16-mixed: dtype gradients are reduced in (default bf16)", c.reduce_dtype),
        store("--peak-tflops", "X", "one host's peak at the run's precision, MFU's denominator (default: "
              "MESHTRAIN_PEAK_TFLOPS, else measured at start)", c.peak_tflops),
        store("--clip-grad-norm", "X", "clip the global L2 norm over every layout (default 0: measured, not clipped)",
              c.clip_grad_norm),
        turn("--deterministic", "the same bits on every dp size: losses and weights as one process's (docs/dp.md)",
             c.deterministic),
        store("--grains", "G", "--deterministic: micro-batches of the global batch, a power of two (default: the "
              "largest dividing the global batch, up to 8)", c.grains),
        store("--deterministic-threads", "N", "--deterministic: intra-op threads of every rank (default 1)",
              c.deterministic_threads),
        store("--activation-checkpointing", "none|blocks|every-N", "recompute blocks in backward (default none)",
              c.activation_checkpointing),
        Flag{"--seed", "S", "model and data seed (default 1234)", seed}}},
      {"data and output",
       {store("--config", "FILE.toml", "a run's flags as TOML (sections like torchtitan's; a key is a flag without "
              "its dashes: layers = 4); flags given here override it (meshtrain config --dump writes one)",
              c.config_file),
        store("--data", "FILE|GLOB",
              "a text file (byte tokens) or llm.c token shards, e.g. 'dir/*.bin' (default: the built-in a+b= task)",
              c.data),
        store("--digits", "D", "operand digits of the built-in task (default 1)", c.digits),
        store("--eval-problems", "N", "held-out problems for the final accuracy (0: skip)", c.eval_problems),
        store("--log-every", "N", "progress line every N steps (default 1)", c.log_every),
        turn("--no-shuffle", "token shards in file order (default: a seeded permutation of all windows per epoch)",
             c.shuffle, false),
        store("--eval-every", "N", "held-out loss every N steps and at the end (default 0: never; token shards "
              "need --val-data)", c.eval_every),
        store("--val-data", "FILE|GLOB", "held-out token shards (or a text file, with a text --data) for "
              "--eval-every, read in file order", c.val_data),
        store("--val-batches", "B", "global batches of --val-data per held-out loss", c.val_batches),
        store("--metrics-out", "FILE", "JSON at the end: losses, times, memory and traffic per rank; each step as a JSON "
              "line in FILE.steps.jsonl as it ends", c.metrics_out),
        store("--tensorboard", "DIR", "each step's loss, lr, grad norm, tokens/s, MFU and held-out loss as TensorBoard "
              "event files in DIR (tensorboard --logdir DIR)", c.tensorboard),
        store("--plot", "FILE.svg", "the loss curve", c.plot),
        store("--trace", "FILE", "the last step's pipeline timeline (Chrome trace JSON + SVG)", c.trace)}},
      {"checkpoints",
       {store("--save-dir", "DIR", "where checkpoints go (none by default)", c.save_dir),
        store("--save-every", "N", "save every N steps (default 0: never)", c.save_every),
        turn("--resume", "continue from the checkpoint 'latest' names in --save-dir", c.resume),
        turn("--resume-fallback", "--resume: when the newest checkpoint is corrupt or incomplete (or 'latest' is "
             "missing), the newest intact one, every shard verified", c.resume_fallback),
        turn("--allow-config-change", "--resume: also from a checkpoint of another model or optimizer "
             "configuration (the shapes must still match)", c.allow_config_change),
        store("--keep-last", "N", "keep the newest N checkpoints, removing older ones after each commit "
              "(default 0: keep all)", c.keep_last),
        turn("--async-save", "snapshot each checkpoint at the step boundary and write it in the background",
             c.async_save),
        turn("--overwrite", "without --resume: replace the checkpoints another run left in --save-dir (refused "
             "otherwise)", c.overwrite)}},
      {"communication",
       {store("--backend", "auto|shm|gloo|mpi",
              "default: MESHTRAIN_BACKEND, else auto (shared memory inside a host, hierarchical across hosts, MPI "
              "under mpirun)",
              c.backend),
        store("--comm-timeout", "S",
              "seconds a rank waits for a peer before naming it stuck (default: MESHTRAIN_COMM_TIMEOUT, else 300)",
              c.comm_timeout),
        store("--bucket-cap-mb", "MB", "DDP bucket size (default 25)", c.bucket_cap_mb),
        turn("--no-overlap", "DDP: all-reduce after backward instead of during it", c.overlap, false)}},
  };
  groups.insert(groups.end(), rest.begin(), rest.end());
  give_values(groups, c);
  return groups;
}

}  // namespace

flags::Parser train_parser(TrainConfig& c) {
  return flags::Parser("meshtrain",
                       "usage: meshtrain [flags]             train a model (the flags below)\n"
                       "       meshtrain plan [flags]        which layouts fit and which runs fastest\n"
                       "       meshtrain data [flags]        text to llm.c token shards; train a tokenizer\n"
                       "       meshtrain export [flags]      a checkpoint as Hugging Face or llm.c weights\n"
                       "       meshtrain generate [flags]    text from a checkpoint or weights\n"
                       "       meshtrain config --dump [flags]  the run those flags describe, as TOML for --config\n"
                       "       (meshtrain COMMAND --help: the command's flags)\n",
                       train_flags(c),
                       "Run under meshrun: meshrun --nproc-per-node 4 -- meshtrain --model gpt --dp 2 --tp 2\n");
}

std::string train_usage() {
  TrainConfig unused;
  return train_parser(unused).usage();
}

bool asks_for_help(const std::vector<std::string>& args) {
  TrainConfig unused;
  return train_parser(unused).asks_for_help(args);
}

TrainConfig parse_train_args(const std::vector<std::string>& args) {
  TrainConfig c;
  c.model.seed = c.seed;
  const flags::Parser parser = train_parser(c);
  parser.parse(with_config_file(args, parser));
  return c;
}

namespace {

// Each flag's value on its own: known names, ranges.
void check_values(const TrainConfig& c) {
  const auto& m = c.model;
  MESHTRAIN_CHECK(m.kind == "gpt" || m.kind == "gpt2" || m.kind == "llama" || m.kind == "mlp", "--model '", m.kind,
                  "' is unknown; use gpt, gpt2, llama or mlp");
  MESHTRAIN_CHECK(c.strategy == "ddp" || c.strategy == "dp", "--strategy '", c.strategy,
                  "' is unknown; use ddp (DistributedDataParallel) or dp (the article's master DP)");
  MESHTRAIN_CHECK(c.zero >= 0 && c.zero <= 3, "--zero ", c.zero, " must be 0, 1, 2 or 3");
  MESHTRAIN_CHECK(c.optimizer == "sgd" || c.optimizer == "adam" || c.optimizer == "adamw", "--optimizer '",
                  c.optimizer, "' is unknown; use sgd, adam or adamw");
  MESHTRAIN_CHECK(c.pp >= 1 && c.tp >= 1 && c.cp >= 1 && c.dp >= 0, "--dp, --pp, --tp and --cp must be positive "
                  "(got dp ", c.dp, ", pp ", c.pp, ", tp ", c.tp, ", cp ", c.cp, ")");
  MESHTRAIN_CHECK(c.steps >= 1, "--steps ", c.steps, " must be at least 1");
  MESHTRAIN_CHECK(c.lr > 0, "--lr ", c.lr, " must be positive");
  MESHTRAIN_CHECK(c.adam_eps > 0, "--adam-eps ", c.adam_eps, " must be positive");
  MESHTRAIN_CHECK(std::isfinite(c.clip_grad_norm) && c.clip_grad_norm >= 0, "--clip-grad-norm ", c.clip_grad_norm,
                  " must be a finite number >= 0 (0: no clipping)");
  models::checkpointing_period(c.activation_checkpointing);  // throws ConfigError naming the value
  MESHTRAIN_CHECK(c.precision == "fp32" || c.precision == "bf16-mixed", "--precision '", c.precision,
                  "' is unknown; use fp32 or bf16-mixed");
  MESHTRAIN_CHECK(std::isfinite(c.peak_tflops) && c.peak_tflops >= 0, "--peak-tflops ", c.peak_tflops,
                  " must be a positive number (one host's peak TFLOP/s; leave it out to measure it)");
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
  MESHTRAIN_CHECK(c.resume || (!c.resume_fallback && !c.allow_config_change),
                  c.resume_fallback ? "--resume-fallback" : "--allow-config-change", " applies to --resume; add it");
  MESHTRAIN_CHECK(c.keep_last >= 0, "--keep-last ", c.keep_last, " must be >= 0 (0: keep every checkpoint)");
  MESHTRAIN_CHECK(c.keep_last == 0 || !c.save_dir.empty(), "--keep-last needs --save-dir");
  MESHTRAIN_CHECK(!c.overwrite || !c.resume, "--overwrite replaces the checkpoints in --save-dir and --resume "
                  "continues them; give one of the two");
  MESHTRAIN_CHECK(c.digits >= 1 && c.digits <= 6, "--digits ", c.digits, " must be in [1, 6]");
  MESHTRAIN_CHECK(c.momentum >= 0 && c.momentum < 1, "--momentum ", c.momentum, " must be in [0, 1) (e.g. 0.9)");
  MESHTRAIN_CHECK(c.weight_decay >= 0, "--weight-decay ", c.weight_decay, " must be >= 0");
  MESHTRAIN_CHECK(c.comm_timeout >= 0 && c.comm_timeout <= 86400, "--comm-timeout ", c.comm_timeout,
                  " must be in (0, 86400] seconds (0: MESHTRAIN_COMM_TIMEOUT, else 300)");
  MESHTRAIN_CHECK(c.bucket_cap_mb > 0, "--bucket-cap-mb ", c.bucket_cap_mb, " must be positive (default 25)");
  MESHTRAIN_CHECK(c.eval_problems >= 0, "--eval-problems ", c.eval_problems, " must be >= 0 (0: no evaluation)");
  MESHTRAIN_CHECK(c.log_every >= 1, "--log-every ", c.log_every, " must be at least 1");
  MESHTRAIN_CHECK(c.eval_every >= 0, "--eval-every ", c.eval_every, " must be >= 0 (0: no held-out loss)");
  MESHTRAIN_CHECK(c.backend.empty() || c.backend == "auto" || c.backend == "shm" || c.backend == "gloo" ||
                      c.backend == "tcp" || c.backend == "mpi",
                  "--backend '", c.backend, "' is not a backend; use auto, shm, gloo (also called tcp) or mpi");
}

// --cp: what context parallelism needs of the model and the other flags.
void check_context_parallel(const TrainConfig& c) {
  if (c.cp == 1) return;
  MESHTRAIN_CHECK(models::is_language_model(c.model), "--cp ", c.cp, " splits sequences; --model ", c.model.kind,
                  " has none (use gpt, gpt2 or llama, or --cp 1)");
  MESHTRAIN_CHECK(c.strategy == "ddp", "--cp with --strategy dp: the master DP runs the whole model on every rank; "
                  "use --strategy ddp");
  const int64_t T = c.model.seq_len;
  MESHTRAIN_CHECK(T % (2 * c.cp) == 0, "--cp ", c.cp, " cuts each sequence into 2 x cp = ", 2 * c.cp, " chunks (two "
                  "per rank, for the causal mask's balance) and does not divide --seq-len ", T,
                  "; choose a --seq-len divisible by ", 2 * c.cp, " or another --cp");
  MESHTRAIN_CHECK(!c.sequence_parallel || (T / c.cp) % c.tp == 0, "--sequence-parallel with --cp ", c.cp,
                  " splits each rank's ", T / c.cp, " positions over tp ", c.tp, ", which does not divide them; "
                  "choose a --seq-len divisible by ", 2 * c.cp * c.tp);
  MESHTRAIN_CHECK(!c.deterministic, "--deterministic with --cp ", c.cp, ": ring attention merges each query's keys "
                  "in ring order, an order one process does not have; use --cp 1 (dp and pp compose)");
}

// --experts and --ep: what mixtures of experts need of the other flags.
void check_experts(const TrainConfig& c) {
  MESHTRAIN_CHECK(c.ep >= 1, "--ep ", c.ep, " must be at least 1");
  MESHTRAIN_CHECK(c.model.experts > 0 || c.ep == 1, "--ep ", c.ep, " splits the experts of mixture-of-experts "
                  "layers; the model has none: add --experts E (a multiple of ", c.ep, ")");
  models::parse_aux_loss_scope(c.aux_loss_scope);  // throws ConfigError naming the value
  MESHTRAIN_CHECK(c.model.experts > 0 || c.aux_loss_scope == "global", "--aux-loss-scope ", c.aux_loss_scope,
                  " applies to mixtures of experts; add --experts E or drop it");
  if (c.model.experts == 0) return;
  MESHTRAIN_CHECK(c.strategy == "ddp", "--experts with --strategy dp: the master DP is for dense models; use "
                  "--strategy ddp");
  if (c.ep == 1) return;
  MESHTRAIN_CHECK(c.model.experts % c.ep == 0, "--ep ", c.ep, " does not divide --experts ", c.model.experts,
                  " (each ep rank holds experts / ep of them); choose --ep dividing ", c.model.experts);
  MESHTRAIN_CHECK((c.dp * c.cp) % c.ep == 0, "--ep ", c.ep, " groups ranks of dp x cp = ", c.dp * c.cp, ", which "
                  "it does not divide; choose --ep dividing ", c.dp * c.cp, " (expert parallelism uses the "
                  "data-parallel ranks, as Megatron and torchtitan do)");
  MESHTRAIN_CHECK(!c.deterministic, "--deterministic with --ep ", c.ep, ": the experts' gradients are reduced over "
                  "their replicas outside the grain tree; use --ep 1");
  MESHTRAIN_CHECK(c.precision == "fp32", "--precision ", c.precision, " with --ep ", c.ep, " is not supported yet "
                  "(the experts held apart keep float32); use --precision fp32 or --ep 1");
}

// The mesh degrees against the world size, and which strategies combine.
void resolve_layout(TrainConfig& c, int world) {
  const std::string with_cp = c.cp > 1 ? str_cat(" x cp ", c.cp) : "";
  if (c.dp == 0) {
    MESHTRAIN_CHECK(world % (c.pp * c.tp * c.cp) == 0, "the world size ", world, " is not divisible by pp x tp",
                    c.cp > 1 ? " x cp" : "", " = ", c.pp, " x ", c.tp, with_cp, "; choose degrees whose product divides ",
                    world);
    c.dp = world / (c.pp * c.tp * c.cp);
  }
  const int ranks = c.dp * c.pp * c.tp * c.cp;
  MESHTRAIN_CHECK(ranks == world, "the layout dp ", c.dp, " x pp ", c.pp, " x tp ", c.tp, with_cp, " = ", ranks,
                  " ranks does not match the world size ", world, "; run with --nproc-per-node ", ranks,
                  " or change the degrees");
  check_context_parallel(c);
  check_experts(c);
  MESHTRAIN_CHECK(c.strategy == "ddp" || c.zero == 0, "--strategy dp (master DP) cannot be combined with --zero ",
                  c.zero, "; ZeRO partitions DDP's state: use --strategy ddp");
  MESHTRAIN_CHECK(!c.sequence_parallel || c.tp > 1, "--sequence-parallel needs --tp > 1 (it splits the sequence over the tensor-parallel ranks)");
  MESHTRAIN_CHECK(c.strategy == "ddp" || (c.pp == 1 && c.tp == 1), "--strategy dp (the article's master DP) runs the "
                  "whole model on every rank and computes the loss on rank 0; it cannot be combined with --pp ", c.pp,
                  " or --tp ", c.tp, ". Use --strategy ddp (optionally with --zero) for the data axis of a mesh");
  MESHTRAIN_CHECK(c.global_batch >= 1 && c.global_batch % c.dp == 0, "--global-batch ", c.global_batch,
                  " must be a positive multiple of the data-parallel degree ", c.dp);
}

bool power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// --deterministic: the grains, which fix the micro-batches (Note
// [Deterministic training]); what the mode cannot make exact is refused.
void resolve_grains(TrainConfig& c) {
  if (!c.deterministic) {
    MESHTRAIN_CHECK(c.grains == 0, "--grains applies to --deterministic; add it or drop --grains");
    return;
  }
  MESHTRAIN_CHECK(c.strategy == "ddp", "--deterministic with --strategy dp: the master DP sums the workers' "
                  "gradients in arrival order; use --strategy ddp (with --zero 0 to 3)");
  MESHTRAIN_CHECK(c.tp == 1, "--deterministic with --tp ", c.tp, ": tensor parallelism adds each matmul's partial "
                  "products over the tp ranks, an order one process does not have; use --tp 1 (dp and pp compose)");
  MESHTRAIN_CHECK(power_of_two(c.dp), "--deterministic with dp ", c.dp, ": the grain tree splits over a power of two "
                  "of data-parallel ranks; use dp 1, 2, 4, 8, ...");
  MESHTRAIN_CHECK(c.precision == "fp32" || c.reduce_dtype == "bf16", "--deterministic with --reduce-dtype fp32: the "
                  "grain tree sums in the gradients' dtype on every level; use --reduce-dtype bf16");
  MESHTRAIN_CHECK(c.deterministic_threads >= 1, "--deterministic-threads ", c.deterministic_threads,
                  " must be at least 1 (the same on every layout)");
  if (c.grains == 0) {
    c.grains = 1;
    while (c.global_batch % (c.grains * 2) == 0 && c.grains * 2 <= 8) c.grains *= 2;  // not by dp: the bits follow G
  }
  MESHTRAIN_CHECK(power_of_two(c.grains) && c.global_batch % c.grains == 0 && c.grains % c.dp == 0, "--grains ",
                  c.grains, " must be a power of two dividing --global-batch ", c.global_batch,
                  " and divisible by dp ", c.dp, " (e.g. --global-batch 32 --grains 8; runs compare bit for bit "
                  "when their grains are equal)");
  const int64_t per_rank = c.grains / c.dp, grain = c.global_batch / c.grains;
  MESHTRAIN_CHECK(c.micro_batch == 0 || c.micro_batch == grain, "--deterministic: a micro-batch is one grain, ",
                  grain, " samples (--global-batch / --grains); --micro-batch ", c.micro_batch, " differs");
  MESHTRAIN_CHECK(c.microbatches == 0 || c.microbatches == per_rank, "--deterministic: each rank runs grains / dp = ",
                  per_rank, " micro-batches; --microbatches ", c.microbatches, " differs");
  c.micro_batch = grain;
  if (c.pp > 1 || c.virtual_stages > 1) c.microbatches = static_cast<int>(per_rank);
}

// A mixture of experts whose balance loss covers the step's whole batch
// needs every forward of the step before its first backward (Note
// [Global-batch balance loss] in meshtrain/moe.h).
bool balance_needs_forwards_first(const TrainConfig& c) {
  return c.model.experts > 0 && c.model.aux_loss_coef > 0 && c.aux_loss_scope == "global";
}

// The pipeline's schedule: the given one, or 1f1b; gpipe for a global balance
// loss, which refuses a schedule running a backward before its last forward.
void resolve_schedule(TrainConfig& c) {
  const bool forwards_first = balance_needs_forwards_first(c);
  if (c.schedule.empty()) c.schedule = forwards_first && c.pp * c.virtual_stages > 1 ? "gpipe" : "1f1b";
  const pp::ScheduleSpec spec{c.schedule, c.pp, c.microbatches, c.virtual_stages};
  pp::validate(spec);
  MESHTRAIN_CHECK(!forwards_first || pp::forwards_before_backwards(spec), "--schedule ", c.schedule, " with --experts ",
                  c.model.experts, ": the balance loss over the step's whole batch (--aux-loss-scope global, the "
                  "default) needs every forward of a step before its first backward, and ", c.schedule, " with ",
                  c.microbatches, " micro-batches runs a backward first; use --schedule gpipe (it holds the ",
                  c.microbatches, " micro-batches' activations at once) or --aux-loss-scope micro (each "
                  "micro-batch's own balance loss, which then depends on the layout)");
}

// Micro-batches: gradient accumulation, or the pipeline's micro-batches.
void resolve_batches(TrainConfig& c) {
  const auto& m = c.model;
  const int64_t local = c.global_batch / c.dp;
  if (c.schedule.empty() && c.pp * c.virtual_stages == 1) c.schedule = "1f1b";  // no pipeline: unused
  if (c.pp > 1 || c.virtual_stages > 1) {
    // Pipeline micro-batches: --microbatches M, or derived from --micro-batch, or pp.
    if (c.microbatches == 0) c.microbatches = c.micro_batch > 0 ? static_cast<int>(local / c.micro_batch) : c.pp;
    MESHTRAIN_CHECK(c.microbatches >= 1 && local % c.microbatches == 0, "each data-parallel rank gets ", local,
                    " samples per step (--global-batch ", c.global_batch, " / dp ", c.dp, "), which --microbatches ",
                    c.microbatches, " does not divide; choose a divisor of ", local);
    MESHTRAIN_CHECK(c.micro_batch == 0 || c.micro_batch * c.microbatches == local, "--micro-batch ", c.micro_batch,
                    " x --microbatches ", c.microbatches, " must equal the samples per data-parallel rank, ", local);
    c.micro_batch = local / c.microbatches;
    resolve_schedule(c);
    if (!c.stage_boundaries.empty()) pp::partition_explicit(c.stage_boundaries, models::num_pieces(m), c.pp * c.virtual_stages);
    MESHTRAIN_CHECK(models::num_pieces(m) >= c.pp * c.virtual_stages, "the model has ", models::num_pieces(m),
                    " pieces (", models::is_language_model(m) ? "embedding, blocks, head" : "layers", "), fewer than pp x virtual "
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
}

// --init-from: the weights' shape, with the shape flags the user gave on top
// (refused where they differ from the weights'); --seq-len may be shorter.
models::ModelConfig shape_from_weights(const TrainConfig& c) {
  const io::LoadedWeights w = io::load_weights(c.init_from);
  models::ModelConfig wanted = w.config;
  const models::ModelConfig& given = c.model;
  const std::map<std::string, std::function<void()>> take = {
      {"--model", [&] { wanted.kind = given.kind; }},
      {"--layers", [&] { wanted.layers = given.layers; }},
      {"--hidden", [&] { wanted.hidden = given.hidden; }},
      {"--heads", [&] { wanted.heads = given.heads; }},
      {"--kv-heads", [&] { wanted.kv_heads = given.kv_heads; }},
      {"--ffn-hidden", [&] { wanted.ffn_hidden = given.ffn_hidden; }},
      {"--vocab", [&] { wanted.vocab = given.vocab; }},
      {"--max-positions", [&] { wanted.max_positions = given.max_positions; }},
      {"--rope-theta", [&] { wanted.rope_theta = given.rope_theta; }},
      {"--tied", [&] { wanted.tie_embeddings = c.tie == "tied"; }},
      {"--untied", [&] { wanted.tie_embeddings = c.tie == "tied"; }}};
  for (const std::string& flag : c.model_flags) {
    if (take.count(flag)) take.at(flag)();
  }
  io::check_matches(wanted, w);
  wanted.seed = given.seed;
  wanted.max_positions = models::max_positions(w.config);
  wanted.seq_len = c.model_flags.count("--seq-len") ? given.seq_len : wanted.max_positions;
  return wanted;
}

// The model against the layout, and the data.
void resolve_model(TrainConfig& c) {
  MESHTRAIN_CHECK(c.model.experts == 0 || c.init_from.empty(), "--experts ", c.model.experts, " with --init-from ",
                  c.init_from, ": the published weights it reads are dense (no MoE layers); drop one of the two");
  MESHTRAIN_CHECK(c.tie.empty() || models::is_language_model(c.model), "--", c.tie, " is for language models "
                  "(--model gpt, gpt2 or llama)");
  if (c.init_from.empty()) {
    c.model.tie_embeddings = c.tie.empty() ? c.model.kind != "llama" : c.tie == "tied";
  } else {
    c.model = shape_from_weights(c);
    c.vocab_given = true;  // the weights' vocabulary: the data's ids must fit it
  }
  resolve_data(c);
  // The built-in task's text is ASCII digits, '+', '=' and newlines: byte tokens below 64.
  MESHTRAIN_CHECK(!c.data.empty() || !models::is_language_model(c.model) || c.model.vocab >= 64, "--vocab ", c.model.vocab,
                  " is too small for the built-in task's byte tokens (up to 63); give --vocab 64 or more");
  c.model.seed = c.seed;
  models::validate(c.model, c.tp, c.sequence_parallel);
}

}  // namespace

TrainConfig resolve(TrainConfig c, int world) {
  check_values(c);
  resolve_layout(c, world);
  resolve_grains(c);
  resolve_batches(c);
  resolve_model(c);
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
  if (models::is_language_model(c.model)) {
    const models::ModelConfig& m = c.model;
    model.integer("heads", m.heads).integer("kv_heads", models::kv_heads(m)).integer("ffn_hidden", models::ffn_hidden(m))
        .integer("vocab", m.vocab).integer("seq_len", m.seq_len).integer("max_positions", models::max_positions(m))
        .boolean("tie_embeddings", m.tie_embeddings).num("norm_eps", m.norm_eps)
        .str("attention", nn::attention_kernel_name(nn::resolve_attention_kernel(m.attention, m.seq_len)));
    if (m.kind == "llama") model.num("rope_theta", m.rope_theta);
    if (m.experts > 0) {
      model.integer("experts", m.experts).integer("top_k", m.top_k).num("capacity_factor", m.capacity_factor)
          .num("aux_loss_coef", m.aux_loss_coef).str("aux_loss_scope", c.aux_loss_scope)
          .integer("active_parameters", models::active_parameter_count(m));
    }
  } else {
    model.integer("features", c.model.features).integer("classes", c.model.classes);
  }
  model.integer("parameters", models::parameter_count(c.model));
  json::Object o;
  o.raw("model", model.str())
      .integer("dp", c.dp).integer("pp", c.pp).integer("tp", c.tp).integer("cp", c.cp).integer("ep", c.ep)
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
      .str("init_from", c.init_from)
      .integer("seed", static_cast<long long>(c.seed)).str("data", c.data.empty() ? "arithmetic, " + std::to_string(c.digits) + "-digit operands" : c.data)
      .num("bucket_cap_mb", c.bucket_cap_mb).boolean("overlap", c.overlap).integer("eval_every", c.eval_every)
      .boolean("deterministic", c.deterministic).integer("grains", c.grains)
      .integer("deterministic_threads", c.deterministic_threads)
      .boolean("shuffle", c.shuffle).str("val_data", c.val_data).integer("val_batches", c.val_batches)
      .str("backend", c.backend.empty() ? "auto" : c.backend);
  return o.str();
}

}  // namespace train
}  // namespace meshtrain

namespace meshtrain {
namespace train {

namespace {

// "lr" -> "--lr", "model.seq_len" -> "--seq-len": the flag a field comes from.
std::string flag_of(const std::string& key) {
  std::string f = "--" + key.substr(key.rfind('.') == std::string::npos ? 0 : key.rfind('.') + 1);
  std::replace(f.begin(), f.end(), '_', '-');
  return f;
}

// The fields (nested ones as "model.x") whose values differ between two configurations.
void differing_fields(const nlohmann::json& a, const nlohmann::json& b, const std::string& prefix,
                      std::vector<std::string>& out) {
  for (auto it = a.begin(); it != a.end(); ++it) {
    const auto other = b.find(it.key());
    if (other == b.end()) {
      out.push_back(prefix + it.key());
    } else if (it->is_object() && other->is_object()) {
      differing_fields(*it, *other, prefix + it.key() + ".", out);
    } else if (*it != *other) {
      out.push_back(prefix + it.key());
    }
  }
}

}  // namespace

std::string config_differences(const std::string& a_json, const std::string& b_json, const std::string& a_name,
                               const std::string& b_name, const std::vector<std::string>& sections) {
  nlohmann::json a = nlohmann::json::parse(a_json), b = nlohmann::json::parse(b_json);
  if (!sections.empty()) {
    nlohmann::json a_part = nlohmann::json::object(), b_part = nlohmann::json::object();
    for (const std::string& k : sections) {
      if (a.contains(k)) a_part[k] = a[k];
      if (b.contains(k)) b_part[k] = b[k];
    }
    a = a_part, b = b_part;
  }
  std::vector<std::string> fields;
  differing_fields(a, b, "", fields);
  std::string what;
  for (const std::string& f : fields) {
    std::string path = "/" + f;
    std::replace(path.begin(), path.end(), '.', '/');
    const nlohmann::json::json_pointer p(path);
    what += str_cat(what.empty() ? "" : "; ", flag_of(f), " is ", a.contains(p) ? a[p].dump() : "unset", " ", a_name,
                    " but ", b.contains(p) ? b[p].dump() : "unset", " ", b_name);
  }
  return what;
}

namespace {

// What every rank must agree on beyond the training configuration: how it
// checkpoints (a rank resuming alone, or saving elsewhere or at other steps,
// would destroy the checkpoints or hang in a save the others never start).
std::string startup_json(const TrainConfig& c) {
  nlohmann::json j = nlohmann::json::parse(to_json(c));
  j["checkpoints"] = {{"save_dir", c.save_dir.empty() ? "" : files::absolute_path(c.save_dir)},
                      {"save_every", c.save_every}, {"resume", c.resume}, {"resume_fallback", c.resume_fallback},
                      {"allow_config_change", c.allow_config_change}, {"overwrite", c.overwrite},
                      {"async_save", c.async_save}, {"keep_last", c.keep_last}};
  // What else every rank must share: the final accuracy is a collective over
  // eval_problems, and a rank that gives up waiting sooner than the others
  // blames them for its own impatience.
  j["run"] = {{"eval_problems", c.eval_problems}, {"comm_timeout", c.comm_timeout},
              {"elastic_layouts", c.elastic_layouts}};
  return j.dump();
}

}  // namespace

void check_same_config(const TrainConfig& c, comm::Communicator& world) {
  const std::vector<std::string> all = comm::all_gather_strings(world, startup_json(c));
  for (int r = 1; r < static_cast<int>(all.size()); ++r) {
    if (all[r] == all[0]) continue;
    throw ConfigError(str_cat("the ranks were started with different training configurations: ",
                              config_differences(all[0], all[r], "on rank 0", "on rank " + std::to_string(r), {}),
                              ". Every rank must get the same flags (and the same data)"));
  }
}

}  // namespace train
}  // namespace meshtrain
