// The command that runs a plan: meshrun's flags for the cluster, the
// trainer's for the model and the layout (see command.h).
#include "plan/command.h"

#include <sstream>

#include "meshtrain/util.h"

namespace meshtrain {
namespace plan {

namespace {

void add(std::vector<std::string>& args, const std::string& flag, int64_t value) {
  args.push_back(flag);
  args.push_back(std::to_string(value));
}

// The shape, whole: a default the trainer might change must not change the model.
void shape_args(const DecoderShape& s, std::vector<std::string>& args) {
  const bool llama = s.kind == ModelKind::kLlama;
  args.insert(args.end(), {"--model", model_kind_name(s.kind)});
  add(args, "--layers", s.layers);
  add(args, "--hidden", s.hidden);
  add(args, "--heads", s.heads);
  if (llama) add(args, "--kv-heads", kv_heads_of(s));
  if (llama || ffn_hidden_of(s) != 4 * s.hidden) add(args, "--ffn-hidden", ffn_hidden_of(s));
  add(args, "--vocab", s.vocab);
  add(args, "--seq-len", s.seq_len);
  if (max_positions_of(s) != s.seq_len) add(args, "--max-positions", max_positions_of(s));
  if (s.experts > 0) {
    add(args, "--experts", s.experts);
    add(args, "--top-k", s.top_k);
  }
  const bool tied_by_default = !llama;  // the trainer's default (train::resolve)
  if (s.tie_embeddings != tied_by_default) args.push_back(s.tie_embeddings ? "--tied" : "--untied");
}

// The training flags that differ from the trainer's defaults, and the batch.
void training_args(const PlanInput& in, const Estimate& e, std::vector<std::string>& args) {
  if (e.layout.pp > 1) {
    // The schedule whose bubble the prediction assumed (the memory is 1F1B's).
    args.insert(args.end(), {"--schedule", e.virtual_stages > 1 ? "interleaved" : "1f1b"});
    add(args, "--microbatches", e.microbatches);
    if (e.virtual_stages > 1) add(args, "--virtual-stages", e.virtual_stages);
    // A mixture of experts' default balance loss (the step's whole batch)
    // needs GPipe's order, whose memory this plan did not count: the
    // per-micro-batch loss runs under the planned schedule.
    if (in.shape && in.shape->experts > 0) args.insert(args.end(), {"--aux-loss-scope", "micro"});
  }
  if (!in.grad_overlap) args.push_back("--no-overlap");
  // The attention whose activations the plan counted (the trainer's auto would pick by --seq-len).
  if (in.shape) args.insert(args.end(), {"--attention", attention_name(in.attention)});
  if (in.activation_checkpointing) args.insert(args.end(), {"--activation-checkpointing", "blocks"});
  args.insert(args.end(), {"--precision", precision_name(in.precision)});
  if (in.optimizer == OptimizerKind::kSgd) {
    args.insert(args.end(), {"--optimizer", "sgd"});
    if (in.momentum > 0) {
      std::ostringstream m;
      m << in.momentum;
      args.insert(args.end(), {"--momentum", m.str()});
    }
  }
  add(args, "--global-batch", global_batch_of(in));
  add(args, "--micro-batch", in.micro_batch);
}

}  // namespace

std::string command_problem(const PlanInput& in) {
  if (!in.shape)
    return "with --params the planner knows no shape, and meshtrain's trainer builds its model from one; give the "
           "shape (--model, --layers, --hidden, --heads, --vocab, --seq-len) instead of --params for a command";
  if (in.precision == Precision::kFp16Mixed)
    return "meshtrain's trainer runs fp32 and bf16-mixed, not fp16-mixed; plan with --precision bf16-mixed for a "
           "command";
  return "";
}

std::vector<std::string> trainer_args(const PlanInput& in, const Estimate& e) {
  const std::string problem = command_problem(in);
  MESHTRAIN_CHECK(problem.empty(), "no command: ", problem);
  std::vector<std::string> args;
  shape_args(*in.shape, args);
  add(args, "--dp", e.layout.dp);
  add(args, "--pp", e.layout.pp);
  add(args, "--tp", e.layout.tp);
  if (e.layout.cp > 1) add(args, "--cp", e.layout.cp);
  if (e.layout.ep > 1) add(args, "--ep", e.layout.ep);
  add(args, "--zero", e.layout.zero);
  training_args(in, e, args);
  return args;
}

std::string launcher_command(const PlanInput& in) {
  const int per_node = devices_per_node_of(in), nodes = in.devices / per_node;
  if (nodes == 1) return str_cat("meshrun --nproc-per-node ", in.devices, " --");
  return str_cat("meshrun --nproc-per-node ", per_node, " --nnodes ", nodes,
                 " --node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port ", kMasterPort, " --");
}

std::string train_command(const PlanInput& in, const Estimate& e) {
  std::string line = launcher_command(in) + " meshtrain";
  for (const std::string& word : trainer_args(in, e)) line += " " + word;
  return line;
}

}  // namespace plan
}  // namespace meshtrain
