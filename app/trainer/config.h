#pragma once
// The trainer's configuration: parsed from flags (pure, unit-tested) and
// resolved against the world size before any communication, so that bad flags
// and impossible layouts fail with a message naming the value and the fix.

#include <set>
#include <string>
#include <vector>

#include "meshtrain/models.h"
#include "util/flags.h"

namespace meshtrain {
namespace comm {
class Communicator;
}
namespace train {

struct TrainConfig {
  models::ModelConfig model;
  // The LM head: "tied" to the token embedding, "untied", or "" (the model's
  // default: tied for gpt and gpt2, untied for llama); resolve() sets
  // model.tie_embeddings from it.
  std::string tie;
  // Start from published weights (meshtrain/io.h: an llm.c checkpoint or a
  // Hugging Face directory); the shape comes from them, and a shape flag
  // given with a different value is refused (--seq-len may be shorter).
  std::string init_from;
  // The model flags given on the command line ("--hidden", ...), so that
  // --init-from can tell a given flag from a default.
  std::set<std::string> model_flags;
  // Layout: degrees of the mesh axes (0 = derive dp from the world size).
  // cp: context parallelism, each sequence split over cp ranks (ring attention).
  int dp = 0, pp = 1, tp = 1, cp = 1;
  // Expert parallelism (--experts): each MoE layer's experts split over ep
  // ranks of dp x cp (consecutive ones), tokens sent to them by all-to-all.
  int ep = 1;
  std::string strategy = "ddp";  // data axis: ddp | dp (the article's master DP)
  int zero = 0;                  // ZeRO stage on the data axis (0 = plain DDP)
  // Pipeline: naive | gpipe | 1f1b | interleaved; empty: resolve() picks
  // 1f1b, or gpipe for mixtures of experts under the global aux-loss scope
  // (which need every forward of a step before its first backward).
  std::string schedule;
  int microbatches = 0;          // pipeline micro-batches (0 = derive)
  int virtual_stages = 1;
  // Where the pipeline cuts the model: the first piece of stages 1..S-1 (S =
  // pp x virtual stages); empty: balanced by parameter count.
  std::vector<int64_t> stage_boundaries;
  bool sequence_parallel = false;
  // Under an elastic meshrun: the layout of each world size, "4:dp2xpp2,2:dp2"
  // (app/trainer/elastic.h); a world not listed keeps the flags' layout if it fits,
  // else takes the planner's.
  std::string elastic_layouts;
  // Batches: samples per step over all data-parallel ranks, and per forward.
  int64_t global_batch = 24;
  int64_t micro_batch = 0;  // 0 = global_batch / dp (no accumulation)
  int steps = 20;
  std::string optimizer = "adamw";  // sgd | adam | adamw
  double lr = 2e-3;  // AdamW on the built-in GPT: 3e-3 spikes for some seeds (bench/reference/run.sh --lr 3e-3)
  std::string lr_schedule = "constant";  // constant | cosine (to lr/10 at the last step)
  int warmup_steps = 0;                  // linear warm-up from 0
  double weight_decay = 0.0;
  double momentum = 0.0;
  double adam_eps = 1e-8;   // Adam/AdamW eps (torch's default)
  // fp32 | bf16-mixed: bf16 parameters and gradients for forward and backward,
  // fp32 master weights and optimizer state (train/mixed_precision.h).
  std::string precision = "fp32";
  std::string reduce_dtype = "bf16";  // bf16-mixed: gradients reduced in bf16 | fp32
  // The peak TFLOP/s of one host at the run's precision, MFU's denominator
  // (0: measured at start; Note [An honest MFU] in device_peak.cpp).
  double peak_tflops = 0;
  std::string config_file;  // --config FILE.toml: read into the flags before the command line's
  std::string tensorboard;  // --tensorboard DIR: rank 0's scalars as TensorBoard event files
  double clip_grad_norm = 0;  // clip the global gradient norm to this (0: measure only)
  // Recompute in backward instead of keeping activations: none | blocks (every
  // GPT block / MLP layer) | every-N (every N-th block, from the first).
  std::string activation_checkpointing = "none";
  uint64_t seed = 1234;
  int log_every = 1;
  // The held-out loss every N steps and after the last, forward only (0:
  // never): over the first val_batches global batches of --val-data's
  // windows in file order; without --val-data (text files and the built-in
  // tasks only) over one global batch of samples from index 2^40 on.
  int eval_every = 0;
  std::string data;         // text file (byte tokens) or token shards (a glob); empty: built-in synthetic task
  std::string val_data;     // held-out token shards (or a text file, with a text --data) for eval_every
  int val_batches = 8;      // global batches of val_data per held-out loss
  bool shuffle = true;      // token shards: a seeded permutation of the windows per epoch; off: file order
  // --vocab was given: the token shards' recorded vocabulary then only checks
  // it (a smaller one is refused); otherwise the recorded one is the model's.
  bool vocab_given = false;
  // With --experts: the tokens the balance loss covers, "global" (the step's
  // whole batch: every layout trains alike) or "micro" (each micro-batch's
  // on each rank, Megatron-LM's and DeepSpeed's); meshtrain/moe.h.
  std::string aux_loss_scope = "global";
  int digits = 1;           // operand digits of the built-in arithmetic task
  std::string metrics_out;  // JSON file
  double bucket_cap_mb = 25.0;
  bool overlap = true;      // DDP: all-reduce during backward
  // Bitwise-identical training on every dp size (Note [Deterministic training]
  // in src/train/module_trainer.cpp): the global batch cut into `grains`
  // micro-batches (a power of two; 0: derived), each rank computing with
  // deterministic_threads intra-op threads.
  bool deterministic = false;
  int grains = 0;
  int deterministic_threads = 1;
  std::string backend;      // communication: auto | shm | gloo | mpi (empty: MESHTRAIN_BACKEND, else auto)
  double comm_timeout = 0;  // seconds a rank waits for its peers (0: MESHTRAIN_COMM_TIMEOUT, else 300)
  int eval_problems = 100;  // task accuracy at the end (0: skip)
  std::string plot;         // SVG file of the loss curve (optional)
  // Checkpoints.
  std::string save_dir;
  int save_every = 0;
  bool resume = false;
  bool async_save = false;  // snapshot at the step boundary, write and commit in the background
  int keep_last = 0;        // keep the newest N checkpoints, pruning older ones after each commit (0: all)
  bool resume_fallback = false;      // --resume: past a corrupt or incomplete newest checkpoint to the newest intact one
  bool allow_config_change = false;  // --resume: from a checkpoint of another model or optimizer configuration
  bool overwrite = false;            // without --resume: replace the checkpoints of another run in --save-dir
  std::string trace;        // pipeline timeline (Chrome trace JSON + SVG)
};

// Parses trainer flags ("--name value" or "--name=value"; util/flags.h). Throws ConfigError.
// The trainer's flags, reading into and showing `c` (the usage, --config, config --dump).
flags::Parser train_parser(TrainConfig& c);
TrainConfig parse_train_args(const std::vector<std::string>& args);
std::string train_usage();
// Whether the flags ask for --help / -h.
bool asks_for_help(const std::vector<std::string>& args);

// Collective over `world`: every rank must train the same resolved
// configuration and checkpoint alike (--resume, --save-dir as an absolute
// path, --save-every, --async-save, --keep-last, --overwrite). ConfigError on
// every rank naming each differing flag, its values and the first rank that
// differs from rank 0 (before any training).
void check_same_config(const TrainConfig& config, comm::Communicator& world);

// The flags whose values differ between two configurations (to_json's text),
// as "--lr is 0.01 <a_name> but 0.02 <b_name>; ..." ("" when none), looking
// only at the top-level `sections` when given ("model", "optimizer").
std::string config_differences(const std::string& a_json, const std::string& b_json, const std::string& a_name,
                               const std::string& b_name, const std::vector<std::string>& sections);

// Fills derived values (dp, micro_batch, microbatches) for `world_size` ranks
// and checks every constraint. Throws ConfigError naming the values.
TrainConfig resolve(TrainConfig config, int world_size);

// Gradient-accumulation steps per optimizer step on one data-parallel rank.
int64_t accumulation_steps(const TrainConfig& resolved);

// The learning rate of `step` (0-based) under the schedule.
double learning_rate(const TrainConfig& config, int64_t step);

// The resolved configuration as a JSON object.
std::string to_json(const TrainConfig& config);

}  // namespace train
}  // namespace meshtrain
