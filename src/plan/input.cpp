#include "meshtrain/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>

#include "plan/units.h"
#include "meshtrain/util.h"
#include "util/flags.h"

namespace meshtrain {
namespace plan {

namespace {

// The flags as parsed, before they are assembled into a PlanInput.
struct Draft {
  PlanInput input;
  DecoderShape shape;
  std::string tie;                       // "tied", "untied", or "" (the model's default)
  std::vector<std::string> shape_flags;  // the shape flags given, in order
  bool params_given = false;
  bool virtual_stages_given = false;
};

using Setter = std::function<void(const std::string& flag, const std::string& value)>;

Setter shape_field(Draft& d, int64_t DecoderShape::*field) {
  return [&d, field](const std::string& flag, const std::string& value) {
    d.shape.*field = parse_positive_int(flag, value);
    d.shape_flags.push_back(flag);
  };
}

// The trainer's --model, less the MLP (no sequence: nothing to plan but its parameters).
ModelKind parse_model_kind(const std::string& flag, const std::string& value) {
  if (value == "gpt") return ModelKind::kGpt;
  if (value == "gpt2") return ModelKind::kGpt2;
  if (value == "llama") return ModelKind::kLlama;
  MESHTRAIN_CHECK(value != "mlp", flag, " mlp: the planner models the language models (gpt, gpt2, llama); for "
                  "the MLP give its parameter count, --params COUNT");
  throw ConfigError(str_cat(flag, " '", value, "': expected gpt, gpt2 or llama, as the trainer takes"));
}

// The model flags: --model, the sizes, the head's tie; each marks the shape as given.
Setter kind_field(Draft& d) {
  return [&d](const std::string& flag, const std::string& value) {
    d.shape.kind = parse_model_kind(flag, value);
    d.shape_flags.push_back(flag);
  };
}

Setter tie_field(Draft& d, const std::string& tie) {
  return [&d, tie](const std::string& flag, const std::string&) {
    d.tie = tie;
    d.shape_flags.push_back(flag);
  };
}

Attention parse_attention(const std::string& flag, const std::string& value) {
  if (value == "eager") return Attention::kEager;
  if (value == "flash") return Attention::kFlash;
  throw ConfigError(str_cat(flag, " '", value, "': expected eager (the T x T softmax kept, as meshtrain's models ",
                            "run) or flash (memory-efficient: linear in T)"));
}

int as_int(const std::string& flag, const std::string& value) {
  const int64_t n = parse_positive_int(flag, value);
  MESHTRAIN_CHECK(n <= 1 << 24, flag, " ", value, " is too large; expected at most ", 1 << 24);
  return static_cast<int>(n);
}

Precision parse_precision(const std::string& value) {
  if (value == "fp32") return Precision::kFp32;
  if (value == "bf16-mixed") return Precision::kBf16Mixed;
  if (value == "fp16-mixed") return Precision::kFp16Mixed;
  throw ConfigError(str_cat("--precision '", value, "': expected fp32, bf16-mixed or fp16-mixed"));
}

// The trainer's names; AdamW keeps Adam's state.
OptimizerKind parse_optimizer(const std::string& value) {
  if (value == "adam" || value == "adamw") return OptimizerKind::kAdam;
  if (value == "sgd") return OptimizerKind::kSgd;
  throw ConfigError(str_cat("--optimizer '", value, "': expected adamw, adam or sgd, as the trainer takes"));
}

// The trainer's --momentum M: a buffer is kept when M > 0.
double parse_momentum(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  const double m = std::strtod(value.c_str(), &end);
  MESHTRAIN_CHECK(!value.empty() && *end == '\0' && m >= 0 && m < 1, flag, " ", value,
                  ": expected the momentum factor in [0, 1), as the trainer takes (e.g. 0.9)");
  return m;
}

// The trainer's policies: none, blocks, every-N. The planner models none and
// blocks (every block checkpointed); every-N lies between the two.
bool parse_checkpointing(const std::string& flag, const std::string& value) {
  if (value == "none") return false;
  if (value == "blocks") return true;
  MESHTRAIN_CHECK(value.rfind("every-", 0) != 0, flag, " ", value, ": the planner estimates none and blocks; every-N ",
                  "keeps between the two (plan with blocks for a lower bound, none for an upper)");
  throw ConfigError(str_cat(flag, " '", value, "': expected none or blocks (the trainer also takes every-N)"));
}

// "10%" or "0.1".
double parse_margin(const std::string& value) {
  const bool percent = !value.empty() && value.back() == '%';
  char* end = nullptr;
  const std::string number = percent ? value.substr(0, value.size() - 1) : value;
  double v = std::strtod(number.c_str(), &end);
  MESHTRAIN_CHECK(!number.empty() && end == number.c_str() + number.size(), "--margin '", value,
                  "': expected a fraction of device memory to keep free, e.g. 0.1 or 10%");
  v = percent ? v / 100 : v;
  MESHTRAIN_CHECK(v >= 0 && v < 0.9, "--margin '", value, "' must be in [0, 0.9), e.g. 10%");
  return v;
}

// "100" -> 1e14 FLOP/s.
double parse_tflops(const std::string& flag, const std::string& value) {
  MESHTRAIN_CHECK(value != "measure", flag, " measure: the meshtrain command times a matmul and passes the rate on; ",
                  "this parser (the library's run_plan) takes a number of TFLOP/s, e.g. ", flag, " 100");
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  MESHTRAIN_CHECK(!value.empty() && end == value.c_str() + value.size() && v > 0 && v < 1e6, flag, " '", value,
                  "': expected the achieved TFLOP/s of one device, e.g. ", flag, " 100");
  return v * 1e12;
}

// "3us", "8 us", "0.5ms", "2e-6s": seconds per message.
double parse_latency(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  std::string unit(end == nullptr ? "" : end);
  unit.erase(0, unit.find_first_not_of(' '));
  const double scale = unit == "ns" ? 1e-9 : unit == "us" ? 1e-6 : unit == "ms" ? 1e-3 : unit == "s" ? 1.0 : -1.0;
  MESHTRAIN_CHECK(end != value.c_str() && scale > 0 && v >= 0 && v * scale < 1, flag, " '", value,
                  "': expected a latency per message with its unit (ns, us, ms, s), e.g. ", flag, " 5us");
  return v * scale;
}

Schedule parse_schedule(const std::string& flag, const std::string& value) {
  if (value == "1f1b") return Schedule::k1F1B;
  if (value == "interleaved") return Schedule::kInterleaved;
  throw ConfigError(str_cat(flag, " '", value, "': the planner models 1f1b and interleaved (the trainer also runs ",
                            "naive and gpipe, whose bubble and memory are larger)"));
}

// The model's flags: the trainer's names, each marking the shape as given; or --params.
flags::Group model_flags(Draft& d) {
  auto params = [&d](const std::string& f, const std::string& v) {
    d.input.params = parse_count(f, v);
    d.params_given = true;
  };
  return {"model (the shape of one of meshtrain's models, as the trainer's flags, or a parameter count)",
          {{"--model", "gpt|gpt2|llama", "the trainer's built-in model (default gpt)", kind_field(d)},
           {"--layers", "N", "transformer blocks", shape_field(d, &DecoderShape::layers)},
           {"--hidden", "H", "hidden size", shape_field(d, &DecoderShape::hidden)},
           {"--heads", "A", "attention heads", shape_field(d, &DecoderShape::heads)},
           {"--kv-heads", "K", "llama: key/value heads, grouped-query attention (default: --heads)",
            shape_field(d, &DecoderShape::kv_heads)},
           {"--ffn-hidden", "F", "the MLP's inner size (default: 4 x hidden; llama: 8/3 x hidden rounded up to 32)",
            shape_field(d, &DecoderShape::ffn_hidden)},
           {"--experts", "E", "a mixture of experts: every block's MLP becomes E expert MLPs and a router (default 0: "
            "dense)", shape_field(d, &DecoderShape::experts)},
           {"--top-k", "K", "with --experts: experts each token is computed by (default 2)",
            shape_field(d, &DecoderShape::top_k)},
           {"--vocab", "V", "vocabulary", shape_field(d, &DecoderShape::vocab)},
           {"--seq-len", "T", "sequence length", shape_field(d, &DecoderShape::seq_len)},
           {"--max-positions", "P", "positions the model takes (default: --seq-len)",
            shape_field(d, &DecoderShape::max_positions)},
           {"--untied", "", "the LM head has its own weight (default for llama)", tie_field(d, "untied")},
           {"--tied", "", "the LM head is the token embedding (default for gpt and gpt2)", tie_field(d, "tied")},
           {"--params", "COUNT", "instead of a shape: 7.5e9, 7.5B, 350M (data parallel only, no command)", params}}};
}

// The planner's flags, setting fields of `d`; the usage is generated from them.
flags::Parser plan_parser(Draft& d) {
  PlanInput& in = d.input;
  auto set = [](auto& field, auto parse) {
    return [&field, parse](const std::string& f, const std::string& v) { field = parse(f, v); };
  };
  std::vector<flags::Group> groups = {
      model_flags(d),
      {"training",
       {{"--micro-batch", "B", "sequences per micro-batch (default 1)", set(in.micro_batch, parse_positive_int)},
        {"--global-batch", "G", "sequences per step (default: micro-batch x devices)",
         set(in.global_batch, parse_positive_int)},
        {"--precision", "fp32|bf16-mixed|fp16-mixed", "default fp32",
         set(in.precision, [](auto&, auto& v) { return parse_precision(v); })},
        {"--optimizer", "adamw|adam|sgd", "as the trainer's (adamw and adam keep the same state; default adam)",
         set(in.optimizer, [](auto&, auto& v) { return parse_optimizer(v); })},
        {"--momentum", "M", "sgd's momentum factor, as the trainer's; > 0 keeps a buffer (default 0)",
         set(in.momentum, parse_momentum)},
        {"--activation-checkpointing", "none|blocks",
         "blocks: keep only each block's input, recompute the rest (default none)",
         set(in.activation_checkpointing, parse_checkpointing)},
        {"--schedule", "1f1b|interleaved", "the pipeline schedule, as the trainer's (default 1f1b)",
         set(in.schedule, parse_schedule)},
        {"--virtual-stages", "V", "chunks per pipeline rank with --schedule interleaved (default 2)",
         [&d](const std::string& f, const std::string& v) {
           d.input.virtual_stages = as_int(f, v);
           d.virtual_stages_given = true;
         }},
        flags::turn("--no-overlap", "DDP reduces gradients after backward, as the trainer's --no-overlap",
                    in.grad_overlap, false),
        {"--max-cp", "C", "also consider context parallelism, each sequence split over up to C ranks (ring "
         "attention; for long sequences; default 1: none)", set(in.max_cp, as_int)},
        {"--max-ep", "E", "with --experts: also consider expert parallelism, each block's experts split over up "
         "to E ranks of dp x cp (default 1: none)", set(in.max_ep, as_int)},
        {"--attention", "eager|flash",
         "eager keeps the T x T softmax; flash only a log-sum-exp per row (default eager); the command passes it to the trainer",
         set(in.attention, parse_attention)}}},
      {"cluster",
       {{"--devices", "N", "number of devices (required)", set(in.devices, as_int)},
        {"--device-memory", "SIZE", "memory per device, e.g. 80GB or 80GiB (required)",
         set(in.device_memory, parse_bytes)},
        {"--devices-per-node", "M", "default: all devices in one node", set(in.devices_per_node, as_int)},
        {"--intra-node-bandwidth", "BW", "per device (default 300GB/s)", set(in.intra_node_bandwidth, parse_bandwidth)},
        {"--inter-node-bandwidth", "BW", "per device (default 25GB/s)", set(in.inter_node_bandwidth, parse_bandwidth)},
        {"--intra-node-latency", "T", "per message inside a node, e.g. 3us (default 3us, NVLink-class)",
         set(in.intra_node_latency, parse_latency)},
        {"--inter-node-latency", "T", "per message between nodes (default 8us, InfiniBand-class)",
         set(in.inter_node_latency, parse_latency)},
        {"--device-tflops", "F",
         "achieved TFLOP/s per device, for compute and bubble time (default 100; the meshtrain command also "
         "takes 'measure': a matmul timed on this machine)",
         set(in.device_flops, parse_tflops)},
        {"--margin", "F", "device memory kept free, 0.1 or 10% (default 10%)",
         set(in.memory_margin, [](auto&, auto& v) { return parse_margin(v); })}}},
      {"output", {flags::turn("--json", "one JSON object instead of the table", in.json)}}};
  return flags::Parser("",
                       "usage: meshtrain plan MODEL CLUSTER [TRAINING] [--json]\n\n"
                       "Estimates per-device memory and communication for every layout dp x pp x tp\n"
                       "(with ZeRO 0-3 on dp) of a cluster, names the article's scenario (1: data\n"
                       "parallel, 2: pipeline/tensor parallel, 3: tensor parallel) and recommends a layout.\n",
                       std::move(groups),
                       "sizes: B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024);\n"
                       "bandwidths: the same followed by /s. See docs/plan.md for the formulas.\n");
}

// Turns the flags into a PlanInput: a shape needs all five of its sizes; the
// head is tied as the trainer ties it by default (untied for llama).
PlanInput assemble(const Draft& d) {
  PlanInput in = d.input;
  MESHTRAIN_CHECK(!d.virtual_stages_given || in.schedule == Schedule::kInterleaved, "--virtual-stages ",
                  in.virtual_stages, " applies to --schedule interleaved; add it, or drop --virtual-stages");
  MESHTRAIN_CHECK(in.schedule == Schedule::k1F1B || in.virtual_stages >= 2, "--virtual-stages ", in.virtual_stages,
                  ": the interleaved schedule needs at least 2 chunks per rank (1 is --schedule 1f1b)");
  MESHTRAIN_CHECK(!(d.params_given && !d.shape_flags.empty()), "give either --params or the model's shape, not both ",
                  "(got --params and ", d.shape_flags.front(), ")");
  if (d.shape_flags.empty()) return in;
  const std::pair<const char*, int64_t> sizes[] = {{"--layers", d.shape.layers},
                                                   {"--hidden", d.shape.hidden},
                                                   {"--heads", d.shape.heads},
                                                   {"--vocab", d.shape.vocab},
                                                   {"--seq-len", d.shape.seq_len}};
  for (const auto& size : sizes)
    MESHTRAIN_CHECK(size.second > 0, size.first, " is missing: the model's shape needs --layers, --hidden, --heads, ",
                    "--vocab and --seq-len (or give --params instead)");
  DecoderShape shape = d.shape;
  shape.tie_embeddings = d.tie.empty() ? shape.kind != ModelKind::kLlama : d.tie == "tied";
  check_shape(shape);
  in.shape = shape;
  in.params = parameter_count(shape);
  return in;
}

}  // namespace

PlanInput parse_plan_args(const std::vector<std::string>& args) {
  Draft draft;
  plan_parser(draft).parse(args);
  PlanInput input = assemble(draft);
  check_plan_input(input);
  return input;
}

std::string plan_usage() {
  Draft unused;
  return plan_parser(unused).usage();
}

void check_plan_input(const PlanInput& in) {
  MESHTRAIN_CHECK(in.params > 0, "no model given: pass the model's shape (--model gpt|gpt2|llama --layers --hidden ",
                  "--heads --vocab --seq-len) or a parameter count (--params 7.5B)");
  MESHTRAIN_CHECK(in.devices > 0, "--devices is missing: how many devices (GPUs) the cluster has, e.g. --devices 8");
  MESHTRAIN_CHECK(in.max_cp >= 1, "--max-cp ", in.max_cp, " must be at least 1 (1: no context parallelism)");
  MESHTRAIN_CHECK(in.max_cp == 1 || in.shape, "--max-cp ", in.max_cp, " splits sequences, and with --params the "
                  "planner knows none; give the model's shape (--model, --seq-len, ...)");
  MESHTRAIN_CHECK(in.max_ep >= 1, "--max-ep ", in.max_ep, " must be at least 1 (1: no expert parallelism)");
  MESHTRAIN_CHECK(in.max_ep == 1 || (in.shape && in.shape->experts > 0), "--max-ep ", in.max_ep, " splits the "
                  "experts of a mixture of experts; the model has none: give --experts E");
  MESHTRAIN_CHECK(!in.shape || (in.shape->experts >= 0 && (in.shape->experts == 0 || (in.shape->top_k >= 1 &&
                  in.shape->top_k <= in.shape->experts))), "--top-k must be between 1 and --experts");
  MESHTRAIN_CHECK(in.device_memory > 0,
                  "--device-memory is missing: the memory of one device, e.g. --device-memory 80GB");
  const int per_node = devices_per_node_of(in);
  MESHTRAIN_CHECK(in.devices % per_node == 0, "--devices ", in.devices, " is not a multiple of --devices-per-node ",
                  per_node, "; use whole nodes, e.g. --devices ", std::max(per_node, in.devices / per_node * per_node));
  MESHTRAIN_CHECK(in.global_batch == 0 || in.global_batch % in.micro_batch == 0, "--global-batch ", in.global_batch,
                  " is not a multiple of --micro-batch ", in.micro_batch, "; e.g. --global-batch ",
                  std::max(in.micro_batch, in.global_batch / in.micro_batch * in.micro_batch));
  MESHTRAIN_CHECK(in.momentum == 0 || in.optimizer == OptimizerKind::kSgd,
                  "--momentum applies to --optimizer sgd (Adam always keeps two moments)");
}

int64_t global_batch_of(const PlanInput& in) {
  return in.global_batch > 0 ? in.global_batch : in.micro_batch * in.devices;
}

int devices_per_node_of(const PlanInput& in) { return in.devices_per_node > 0 ? in.devices_per_node : in.devices; }

double usable_memory(const PlanInput& in) { return static_cast<double>(in.device_memory) * (1 - in.memory_margin); }

std::string precision_name(Precision p) {
  return p == Precision::kFp32 ? "fp32" : p == Precision::kBf16Mixed ? "bf16-mixed" : "fp16-mixed";
}

std::string optimizer_name(OptimizerKind o) { return o == OptimizerKind::kAdam ? "adam" : "sgd"; }

std::string attention_name(Attention a) { return a == Attention::kEager ? "eager" : "flash"; }

std::string schedule_name(Schedule s) { return s == Schedule::k1F1B ? "1f1b" : "interleaved"; }

}  // namespace plan
}  // namespace meshtrain
