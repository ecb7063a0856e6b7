#include "meshtrain/plan/input.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <set>

#include "meshtrain/plan/units.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace plan {

namespace {

// The flags as parsed, before they are assembled into a PlanInput.
struct Draft {
  PlanInput input;
  GptShape shape;
  std::vector<std::string> shape_flags;  // the GPT-shape flags given, in order
  bool params_given = false;
};

using Setter = std::function<void(Draft&, const std::string& flag, const std::string& value)>;

struct FlagSpec {
  const char* name;
  bool takes_value;
  Setter set;
};

Setter shape_field(int64_t GptShape::*field) {
  return [field](Draft& d, const std::string& flag, const std::string& value) {
    d.shape.*field = parse_positive_int(flag, value);
    d.shape_flags.push_back(flag);
  };
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
bool parse_momentum(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  const double m = std::strtod(value.c_str(), &end);
  MESHTRAIN_CHECK(!value.empty() && *end == '\0' && m >= 0 && m < 1, flag, " ", value,
                  ": expected the momentum factor in [0, 1), as the trainer takes (e.g. 0.9)");
  return m > 0;
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
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  MESHTRAIN_CHECK(!value.empty() && end == value.c_str() + value.size() && v > 0 && v < 1e6, flag, " '", value,
                  "': expected the achieved TFLOP/s of one device, e.g. ", flag, " 100");
  return v * 1e12;
}

const std::vector<FlagSpec>& flag_specs() {
  static const std::vector<FlagSpec> specs = {
      {"--layers", true, shape_field(&GptShape::layers)},
      {"--hidden", true, shape_field(&GptShape::hidden)},
      {"--heads", true, shape_field(&GptShape::heads)},
      {"--vocab", true, shape_field(&GptShape::vocab)},
      {"--seq-len", true, shape_field(&GptShape::seq_len)},
      {"--untied", false, [](Draft& d, auto&, auto&) { d.shape.tie_embeddings = false; }},
      {"--params", true,
       [](Draft& d, auto& f, auto& v) {
         d.input.params = parse_count(f, v);
         d.params_given = true;
       }},
      {"--micro-batch", true, [](Draft& d, auto& f, auto& v) { d.input.micro_batch = parse_positive_int(f, v); }},
      {"--global-batch", true, [](Draft& d, auto& f, auto& v) { d.input.global_batch = parse_positive_int(f, v); }},
      {"--precision", true, [](Draft& d, auto&, auto& v) { d.input.precision = parse_precision(v); }},
      {"--optimizer", true, [](Draft& d, auto&, auto& v) { d.input.optimizer = parse_optimizer(v); }},
      {"--momentum", true, [](Draft& d, auto& f, auto& v) { d.input.momentum = parse_momentum(f, v); }},
      {"--activation-checkpointing", true,
       [](Draft& d, auto& f, auto& v) { d.input.activation_checkpointing = parse_checkpointing(f, v); }},
      {"--devices", true, [](Draft& d, auto& f, auto& v) { d.input.devices = as_int(f, v); }},
      {"--device-memory", true, [](Draft& d, auto& f, auto& v) { d.input.device_memory = parse_bytes(f, v); }},
      {"--devices-per-node", true, [](Draft& d, auto& f, auto& v) { d.input.devices_per_node = as_int(f, v); }},
      {"--intra-node-bandwidth", true,
       [](Draft& d, auto& f, auto& v) { d.input.intra_node_bandwidth = parse_bandwidth(f, v); }},
      {"--inter-node-bandwidth", true,
       [](Draft& d, auto& f, auto& v) { d.input.inter_node_bandwidth = parse_bandwidth(f, v); }},
      {"--device-tflops", true, [](Draft& d, auto& f, auto& v) { d.input.device_flops = parse_tflops(f, v); }},
      {"--margin", true, [](Draft& d, auto&, auto& v) { d.input.memory_margin = parse_margin(v); }},
      {"--json", false, [](Draft& d, auto&, auto&) { d.input.json = true; }},
  };
  return specs;
}

const FlagSpec& find_flag(const std::string& name) {
  for (const auto& spec : flag_specs())
    if (name == spec.name) return spec;
  throw ConfigError(str_cat("unknown flag '", name, "'; see `meshtrain plan --help` for the flags"));
}

// Turns the flags into a PlanInput: a GPT shape needs all five of its sizes.
PlanInput assemble(const Draft& d) {
  PlanInput in = d.input;
  MESHTRAIN_CHECK(!(d.params_given && !d.shape_flags.empty()),
                  "give either --params or the GPT shape, not both (got --params and ", d.shape_flags.front(), ")");
  if (!d.shape_flags.empty()) {
    const std::pair<const char*, int64_t> sizes[] = {{"--layers", d.shape.layers},
                                                     {"--hidden", d.shape.hidden},
                                                     {"--heads", d.shape.heads},
                                                     {"--vocab", d.shape.vocab},
                                                     {"--seq-len", d.shape.seq_len}};
    for (const auto& size : sizes)
      MESHTRAIN_CHECK(size.second > 0, size.first, " is missing: the GPT shape needs --layers, --hidden, --heads, ",
                      "--vocab and --seq-len (or give --params instead)");
    check_gpt_shape(d.shape);
    in.gpt = d.shape;
    in.params = gpt_parameter_count(d.shape);
  }
  MESHTRAIN_CHECK(d.shape.tie_embeddings || in.gpt, "--untied describes the GPT shape; give the shape or drop it");
  return in;
}

}  // namespace

PlanInput parse_plan_args(const std::vector<std::string>& args) {
  Draft draft;
  std::set<std::string> seen;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    MESHTRAIN_CHECK(arg.rfind("--", 0) == 0, "unexpected argument '", arg, "'; flags look like --devices 8");
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    const FlagSpec& spec = find_flag(name);
    MESHTRAIN_CHECK(seen.insert(name).second, name, " is given twice; give it once");
    std::string value;
    if (spec.takes_value) {
      MESHTRAIN_CHECK(eq != std::string::npos || i + 1 < args.size(), name, " needs a value, e.g. ", name, " 8");
      value = eq != std::string::npos ? arg.substr(eq + 1) : args[++i];
    } else {
      MESHTRAIN_CHECK(eq == std::string::npos, name, " takes no value; write just ", name);
    }
    spec.set(draft, name, value);
  }
  PlanInput input = assemble(draft);
  check_plan_input(input);
  return input;
}

void check_plan_input(const PlanInput& in) {
  MESHTRAIN_CHECK(in.params > 0, "no model given: pass the GPT shape (--layers --hidden --heads --vocab --seq-len) ",
                  "or a parameter count (--params 7.5B)");
  MESHTRAIN_CHECK(in.devices > 0, "--devices is missing: how many devices (GPUs) the cluster has, e.g. --devices 8");
  MESHTRAIN_CHECK(in.device_memory > 0,
                  "--device-memory is missing: the memory of one device, e.g. --device-memory 80GB");
  const int per_node = devices_per_node_of(in);
  MESHTRAIN_CHECK(in.devices % per_node == 0, "--devices ", in.devices, " is not a multiple of --devices-per-node ",
                  per_node, "; use whole nodes, e.g. --devices ", std::max(per_node, in.devices / per_node * per_node));
  MESHTRAIN_CHECK(in.global_batch == 0 || in.global_batch % in.micro_batch == 0, "--global-batch ", in.global_batch,
                  " is not a multiple of --micro-batch ", in.micro_batch, "; e.g. --global-batch ",
                  std::max(in.micro_batch, in.global_batch / in.micro_batch * in.micro_batch));
  MESHTRAIN_CHECK(!in.momentum || in.optimizer == OptimizerKind::kSgd,
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

}  // namespace plan
}  // namespace meshtrain
