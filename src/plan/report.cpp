// How a Plan is shown: a table for people, one JSON object for programs, and
// `meshtrain plan`'s entry point.
#include <algorithm>
#include <cstdio>
#include <ostream>
#include <sstream>

#include "meshtrain/plan.h"
#include "plan/units.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace plan {

namespace {

bool same_layout(const Layout& a, const Layout& b) {
  return a.dp == b.dp && a.pp == b.pp && a.tp == b.tp && a.zero == b.zero && a.cp == b.cp && a.ep == b.ep;
}

std::string model_line(const PlanInput& in) {
  if (!in.shape) return str_cat(with_commas(in.params), " parameters (--params)");
  const DecoderShape& s = *in.shape;
  const char* names[] = {"GPT", "GPT-2", "Llama"};
  const bool llama = s.kind == ModelKind::kLlama;
  const std::string kv = llama ? str_cat(" (", kv_heads_of(s), " key/value)") : "";
  const std::string ffn = llama || ffn_hidden_of(s) != 4 * s.hidden
                              ? str_cat(", ", llama ? "SwiGLU " : "MLP ", with_commas(ffn_hidden_of(s)))
                              : "";
  const std::string rows =
      embedding_rows(s) != s.vocab ? str_cat(" (", with_commas(embedding_rows(s)), " rows)") : "";
  const std::string experts = s.experts > 0 ? str_cat(" x ", s.experts, " experts, top-", s.top_k) : "";
  return str_cat(names[static_cast<int>(s.kind)], ", ", s.layers, " layers, hidden ", with_commas(s.hidden), ", ",
                 s.heads, " heads", kv, ffn, experts, ", vocab ", with_commas(s.vocab), rows, ", seq-len ",
                 with_commas(s.seq_len), s.tie_embeddings ? ", tied" : ", untied", " head: ", with_commas(in.params),
                 " parameters");
}

std::string header(const PlanInput& in) {
  const StateBytesPerParam b = state_bytes_per_param(in.precision, in.optimizer, in.momentum > 0);
  const int per_node = devices_per_node_of(in);
  std::ostringstream os;
  os << "model     " << model_line(in) << "\n"
     << "training  " << precision_name(in.precision) << " " << optimizer_name(in.optimizer)
     << (in.momentum > 0 ? " with momentum" : "") << " (" << b.parameters << " + " << b.gradients << " + "
     << b.optimizer
     << " bytes per parameter), micro-batch " << in.micro_batch << ", global batch " << global_batch_of(in)
     << ", activation checkpointing " << (in.activation_checkpointing ? "on" : "off")
     << (in.shape ? ", " + attention_name(in.attention) + " attention" : "") << "\n"
     << "cluster   " << in.devices << " devices in " << in.devices / per_node << " node(s) of " << per_node << ", "
     << gigabytes(static_cast<double>(in.device_memory)) << " GB each (" << gigabytes(usable_memory(in))
     << " GB usable, margin " << in.memory_margin * 100 << "%); links " << gigabytes(in.intra_node_bandwidth)
     << " GB/s + " << in.intra_node_latency * 1e6 << " us in a node, " << gigabytes(in.inter_node_bandwidth)
     << " GB/s + " << in.inter_node_latency * 1e6 << " us between nodes; " << in.device_flops / 1e12
     << " TFLOP/s per device\n"
     << "schedule  " << schedule_name(in.schedule)
     << (in.schedule == Schedule::kInterleaved ? str_cat(" (", in.virtual_stages, " chunks per rank)") : "")
     << " for pipelines; dp gradients reduced " << (in.grad_overlap ? "during" : "after") << " backward\n";
  return os.str();
}

// The optional layout columns: cp (with --max-cp), ep (with --max-ep).
struct Columns {
  bool cp = false, ep = false;
};

// The layout columns: dp pp tp (cp) (ep) zero.
std::string layout_cells(const Layout& l, bool recommended, Columns show) {
  auto cell = [](int value) {
    char buf[16];
    std::snprintf(buf, sizeof buf, " %4d", value);
    return std::string(buf);
  };
  std::string out = std::string(recommended ? "*" : " ") + " " + cell(l.dp) + cell(l.pp) + cell(l.tp);
  if (show.cp) out += cell(l.cp);
  if (show.ep) out += cell(l.ep);
  return out + cell(l.zero);
}

std::string table_row(const Estimate& e, int devices, bool recommended, Columns show) {
  auto gb = [](int64_t bytes) { return gigabytes(static_cast<double>(bytes), 2); };
  const MemoryBytes& m = e.memory;
  const double exposed = e.seconds.tp + e.seconds.pp + e.seconds.cp + e.seconds.ep + e.dp_exposed_seconds;
  char buf[320];
  std::snprintf(buf, sizeof buf, "%s | %8s %8s %8s %8s %8s %9s  %-4s | %10s %9s %9s %9s %11s %8s\n",
                layout_cells(e.layout, recommended, show).c_str(), gb(m.parameters).c_str(),
                gb(m.gradients).c_str(), gb(m.optimizer).c_str(), gb(m.activations).c_str(), gb(m.buffers).c_str(),
                gb(m.total()).c_str(), e.fits ? "yes" : "no", gb(e.comm.total()).c_str(), seconds_text(exposed).c_str(),
                seconds_text(e.bubble_seconds).c_str(), seconds_text(e.step_seconds()).c_str(),
                e.tokens > 0 ? with_commas(std::llround(e.tokens_per_second())).c_str() : "-",
                e.tokens > 0 ? tflops_text(e.flops_per_device(devices)).c_str() : "-");
  return buf;
}

std::string table(const Plan& plan) {
  // Widths follow table_row: 23 characters of layout (5 more per optional column), 61 of memory.
  const Columns show{plan.input.max_cp > 1, plan.input.max_ep > 1};
  const int layout_width = 23 + (show.cp ? 5 : 0) + (show.ep ? 5 : 0);
  std::string out = std::string(layout_width, ' ') + "| memory per device, GB" + std::string(61 - 21, ' ') +
                    str_cat("| per step, predicted (comm s: tp + pp", show.cp ? " + cp" : "", show.ep ? " + ep" : "",
                            " + exposed dp)\n") +
                    "     dp   pp   tp" + (show.cp ? "   cp" : "") + (show.ep ? "   ep" : "") + " zero" +
                    " |   params    grads    optim    activ  buffers     total  fits |    comm GB"
                    "    comm s  bubble s    step s    tokens/s  TFLOP/s\n";
  for (const Estimate& e : plan.candidates) {
    const bool chosen = plan.recommendation && same_layout(plan.recommendation->estimate.layout, e.layout);
    out += table_row(e, plan.input.devices, chosen, show);
  }
  return out;
}

std::string memory_json(const MemoryBytes& m) {
  return json::Object()
      .integer("parameters", m.parameters)
      .integer("gradients", m.gradients)
      .integer("optimizer", m.optimizer)
      .integer("activations", m.activations)
      .integer("buffers", m.buffers)
      .integer("total", m.total())
      .str();
}

std::string layout_json(const Layout& l) {
  return json::Object().integer("dp", l.dp).integer("pp", l.pp).integer("tp", l.tp).integer("cp", l.cp)
      .integer("ep", l.ep).integer("zero", l.zero).str();
}

std::string estimate_json(const Estimate& e, int devices) {
  return json::Object()
      .raw("layout", layout_json(e.layout))
      .integer("microbatches", e.microbatches)
      .integer("memory_stage", e.memory_stage)
      .raw("memory_bytes", memory_json(e.memory))
      .boolean("fits", e.fits)
      .integer("comm_stage", e.comm_stage)
      .raw("comm_bytes", json::Object()
                             .integer("dp", e.comm.dp)
                             .integer("pp", e.comm.pp)
                             .integer("tp", e.comm.tp)
                             .integer("cp", e.comm.cp)
                             .integer("ep", e.comm.ep)
                             .integer("total", e.comm.total())
                             .str())
      .raw("comm_seconds", json::Object()
                               .num("dp", e.seconds.dp)
                               .num("pp", e.seconds.pp)
                               .num("tp", e.seconds.tp)
                               .num("cp", e.seconds.cp)
                               .num("ep", e.seconds.ep)
                               .num("total", e.seconds.total())
                               .num("dp_exposed", e.dp_exposed_seconds)
                               .str())
      .num("compute_seconds", e.compute_seconds)
      .num("bubble_seconds", e.bubble_seconds)
      .integer("virtual_stages", e.virtual_stages)
      .num("step_seconds", e.step_seconds())
      .num("tokens_per_second", e.tokens_per_second())
      .num("model_flops_per_step", e.model_flops)
      .num("flops_per_device", e.flops_per_device(devices))
      .boolean("tp_in_node", e.tp_in_node)
      .str();
}

std::string input_json(const PlanInput& in) {
  json::Object o;
  if (in.shape) {
    const DecoderShape& s = *in.shape;
    o.raw("model", json::Object()
                       .str("kind", model_kind_name(s.kind))
                       .integer("layers", s.layers)
                       .integer("hidden", s.hidden)
                       .integer("heads", s.heads)
                       .integer("kv_heads", kv_heads_of(s))
                       .integer("ffn_hidden", ffn_hidden_of(s))
                       .integer("vocab", s.vocab)
                       .integer("embedding_rows", embedding_rows(s))
                       .integer("seq_len", s.seq_len)
                       .integer("max_positions", max_positions_of(s))
                       .boolean("tied", s.tie_embeddings)
                       .str());
    o.str("attention", attention_name(in.attention));
  }
  return o.integer("parameters", in.params)
      .str("precision", precision_name(in.precision))
      .str("optimizer", optimizer_name(in.optimizer))
      .num("momentum", in.momentum)
      .integer("micro_batch", in.micro_batch)
      .integer("global_batch", global_batch_of(in))
      .boolean("activation_checkpointing", in.activation_checkpointing)
      .integer("devices", in.devices)
      .integer("devices_per_node", devices_per_node_of(in))
      .integer("device_memory_bytes", in.device_memory)
      .num("usable_memory_bytes", usable_memory(in))
      .num("intra_node_bandwidth", in.intra_node_bandwidth)
      .num("inter_node_bandwidth", in.inter_node_bandwidth)
      .num("intra_node_latency", in.intra_node_latency)
      .num("inter_node_latency", in.inter_node_latency)
      .str("schedule", schedule_name(in.schedule))
      .integer("virtual_stages", in.virtual_stages)
      .boolean("grad_overlap", in.grad_overlap)
      .num("device_flops", in.device_flops)
      .str();
}

// The recommended layout's activations with eager and with flash attention.
std::string attention_lines(const Plan& plan) {
  const Recommendation& r = *plan.recommendation;
  const auto gb = [](int64_t bytes) { return gigabytes(static_cast<double>(bytes), 2) + " GB"; };
  const auto planned = [&](Attention a) { return plan.input.attention == a ? " (planned)" : ""; };
  char eager[64], flash[64];
  std::snprintf(eager, sizeof eager, "  eager %9s  ", gb(r.eager_activation_bytes).c_str());
  std::snprintf(flash, sizeof flash, "  flash %9s  ", gb(r.flash_activation_bytes).c_str());
  return str_cat("attention: activations of the busiest device in this layout at seq-len ",
                 with_commas(plan.input.shape->seq_len), "\n", eager,
                 "the T x T softmax kept", planned(Attention::kEager), "\n", flash,
                 "a log-sum-exp per row, linear in T", planned(Attention::kFlash), ": saves ",
                 gb(r.eager_activation_bytes - r.flash_activation_bytes), "\n");
}

}  // namespace

std::string format_plan_text(const Plan& plan) {
  std::string out = header(plan.input) + "\nscenario " + std::to_string(plan.scenario.number) + ": " +
                    plan.scenario.reason + "\n\n" + table(plan) + "\n";
  if (plan.recommendation) out += "recommended (*): " + plan.recommendation->reason + "\n";
  if (plan.recommendation && plan.input.shape) out += "\n" + attention_lines(plan) + "\n";
  if (plan.command) out += "command:\n  " + *plan.command + "\n  (" + plan.command_note + ")\n";
  if (!plan.command && !plan.command_note.empty()) out += "\n" + plan.command_note + "\n";
  if (!plan.no_fit_message.empty()) out += plan.no_fit_message + "\n";
  out += "\nnotes:\n";
  for (const std::string& note : plan.notes) out += "  - " + note + "\n";
  return out;
}

std::string format_plan_json(const Plan& plan) {
  std::vector<std::string> candidates, notes;
  for (const Estimate& e : plan.candidates) candidates.push_back(estimate_json(e, plan.input.devices));
  for (const std::string& n : plan.notes) notes.push_back(json::quote(n));
  json::Object o;
  o.raw("input", input_json(plan.input))
      .raw("scenario", json::Object().integer("number", plan.scenario.number).str("reason", plan.scenario.reason).str())
      .raw("candidates", json::array(candidates));
  if (plan.recommendation) {
    const Recommendation& r = *plan.recommendation;
    json::Object rec;
    rec.raw("estimate", estimate_json(r.estimate, plan.input.devices)).str("reason", r.reason);
    if (plan.input.shape) {
      rec.integer("eager_activation_bytes", r.eager_activation_bytes)
          .integer("flash_activation_bytes", r.flash_activation_bytes);
    }
    o.raw("recommendation", rec.str());
  } else {
    o.raw("recommendation", "null");
  }
  o.raw("command", plan.command ? json::quote(*plan.command) : "null").str("command_note", plan.command_note);
  if (plan.smallest_cluster) {
    const ClusterSize& c = *plan.smallest_cluster;
    o.raw("smallest_cluster", json::Object()
                                  .integer("devices", c.devices)
                                  .integer("nodes", c.nodes)
                                  .raw("estimate", estimate_json(c.estimate, c.devices))
                                  .str());
  }
  if (!plan.no_fit_message.empty()) o.str("error", plan.no_fit_message);
  return o.raw("notes", json::array(notes)).str() + "\n";
}

int run_plan(const std::vector<std::string>& args, std::ostream& out) {
  const bool json_output = std::find(args.begin(), args.end(), "--json") != args.end();
  if (std::find(args.begin(), args.end(), "--help") != args.end() ||
      std::find(args.begin(), args.end(), "-h") != args.end()) {
    out << plan_usage();
    return 0;
  }
  try {
    const Plan plan = make_plan(parse_plan_args(args));
    out << (json_output ? format_plan_json(plan) : format_plan_text(plan));
    return plan.recommendation ? 0 : 2;
  } catch (const ConfigError& e) {
    if (json_output) {
      out << json::Object().str("error", e.what()).str() << "\n";
    } else {
      out << "meshtrain plan: " << e.what() << "\n";
    }
    return 2;
  }
}

}  // namespace plan
}  // namespace meshtrain
