#include "app/commands/export.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include "meshtrain/io.h"
#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/files.h"
#include "util/flags.h"

namespace meshtrain {
namespace train {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A step directory: the one given, or the newest complete one of a save directory.
std::string step_directory(const std::string& path) {
  MESHTRAIN_CHECK(files::exists(path), "--resume ", path, ": no such directory; give the trainer's --save-dir");
  if (files::exists(path + "/manifest.json")) return path;
  const std::vector<std::string> complete = complete_checkpoints(path);
  MESHTRAIN_CHECK(!complete.empty(), "--resume ", path, ": no complete checkpoint in it (a step-NNNNNNNN directory "
                  "with a manifest); train with --save-dir ", path, " --save-every N first");
  const std::string latest = latest_checkpoint(path);
  return latest.empty() ? complete.front() : latest;
}

// Note [Export never replaces what it did not write]
// `export --out` used to replace an existing file (a user's file became a
// model) and to write into non-empty directories; a failed export (a full
// disk) left an empty directory. Now an existing output is refused unless
// --overwrite (and a file is never replaced by a directory or a directory by
// a file, even then), and a failure removes what this export created: the
// directory when it made it, the files it added to an empty one. Each file
// is written atomically (a temporary renamed into place), so a failure under
// --overwrite leaves each file old or new, never cut.
class ExportTarget {
 public:
  ExportTarget(const std::string& path, const std::string& format, bool overwrite) : path_(path), hf_(format == "hf") {
    struct stat st {};
    const bool exists = ::lstat(path.c_str(), &st) == 0;
    const bool is_dir = exists && S_ISDIR(st.st_mode);
    MESHTRAIN_CHECK(!exists || is_dir == hf_, "--out ", path, " is ", is_dir ? "a directory" : "a file", ", and --format ",
                    format, " writes ", hf_ ? "a directory" : "a file", "; give another --out");
    MESHTRAIN_CHECK(!exists || overwrite || (is_dir && empty_directory(path)), "--out ", path, " already exists",
                    is_dir ? " and is not empty" : "", "; add --overwrite to replace ", is_dir ? "the model in it" : "it",
                    ", or give another --out");
    made_directory_ = hf_ && !exists;
    if (made_directory_) files::make_directories(path);
    was_empty_ = hf_ && !made_directory_ && empty_directory(path);
  }
  // After a failure: what this export created goes.
  void undo() const {
    if (made_directory_) {
      files::remove_tree(path_);
    } else if (was_empty_) {
      for (const char* name : {"config.json", "model.safetensors"}) ::unlink((path_ + "/" + name).c_str());
    }
  }

 private:
  static bool empty_directory(const std::string& dir) {
    DIR* d = ::opendir(dir.c_str());
    if (!d) return false;
    bool empty = true;
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") empty = false;
    }
    ::closedir(d);
    return empty;
  }

  std::string path_;
  bool hf_;
  bool made_directory_ = false, was_empty_ = false;
};

}  // namespace

models::ModelConfig model_config_from_json(const json::Value& m) {
  models::ModelConfig c;
  c.kind = m["kind"].str();
  c.layers = m["layers"].i64();
  c.hidden = m["hidden"].i64();
  if (!models::is_language_model(c)) {
    c.features = m["features"].i64();
    c.classes = m["classes"].i64();
    return c;
  }
  c.heads = m["heads"].i64();
  c.vocab = m["vocab"].i64();
  c.seq_len = m["seq_len"].i64();
  c.tie_embeddings = m["tie_embeddings"].boolean;
  // Written since GPT-2 and Llama (older checkpoints: the small GPT's defaults).
  if (m.has("kv_heads")) c.kv_heads = m["kv_heads"].i64();
  if (m.has("ffn_hidden")) c.ffn_hidden = m["ffn_hidden"].i64();
  if (m.has("max_positions")) c.max_positions = m["max_positions"].i64();
  if (m.has("norm_eps")) c.norm_eps = m["norm_eps"].num();
  if (m.has("rope_theta")) c.rope_theta = m["rope_theta"].num();
  if (m.has("experts")) {  // a mixture of experts (written with --experts)
    c.experts = m["experts"].i64();
    c.top_k = m["top_k"].i64();
    c.capacity_factor = m["capacity_factor"].num();
    c.aux_loss_coef = m["aux_loss_coef"].num();
  }
  return c;
}

CheckpointModel load_checkpoint_model(const std::string& path) {
  CheckpointModel out;
  out.step_dir = step_directory(path);
  CheckpointReader reader(out.step_dir);
  out.config = model_config_from_json(reader.config()["model"]);
  // The names and shapes of the whole model, from the model itself (not its values).
  const SkipRandomInit shapes_only;
  models::Stage shape = models::build_stage(out.config, 0, models::num_pieces(out.config));
  for (const auto& p : shape->named_parameters()) {
    const at::Tensor full = reader.full(p.key(), "value");
    MESHTRAIN_CHECK(full.defined(), "checkpoint ", out.step_dir, " has no value of '", p.key(), "'");
    MESHTRAIN_CHECK(full.numel() == p.value().numel(), "checkpoint ", out.step_dir, ": '", p.key(), "' holds ",
                    full.numel(), " values, the model's ", p.value().sizes(), " needs ", p.value().numel());
    out.parameters[p.key()] = full.to(at::kFloat).reshape(p.value().sizes());
  }
  return out;
}

int run_export_command(const std::vector<std::string>& args, std::ostream& out) {
  std::string resume, target, format, dtype = "float32";
  bool overwrite = false;
  flags::Parser parser(
      "meshtrain export",
      "usage: meshtrain export --resume SAVE_DIR --out PATH [--format hf|llmc] [--dtype float32|bfloat16] [--overwrite]\n"
      "Writes the model of a training checkpoint (saved on any layout) in a published format: a Hugging Face\n"
      "directory (config.json + model.safetensors; gpt2, llama) or an llm.c GPT-2 checkpoint (.bin).\n",
      {{"", {flags::store("--resume", "SAVE_DIR", "the trainer's --save-dir (its newest checkpoint) or a step "
                          "directory", resume),
             flags::store("--out", "PATH", "a directory (hf) or a file (llmc)", target),
             flags::store("--format", "hf|llmc", "default: llmc for a PATH ending in .bin, else hf", format),
             flags::store("--dtype", "float32|bfloat16", "the stored values (llm.c's CPU trainer reads float32)",
                          dtype),
             flags::turn("--overwrite", "replace an existing --out (refused without it)", overwrite)}}});
  if (parser.asks_for_help(args)) {
    out << parser.usage();
    return 0;
  }
  parser.parse(args);
  MESHTRAIN_CHECK(!resume.empty() && !target.empty(), "meshtrain export: give --resume SAVE_DIR and --out PATH\n",
                  parser.usage());
  MESHTRAIN_CHECK(dtype == "float32" || dtype == "bfloat16", "--dtype '", dtype, "' is unknown; use float32 or bfloat16");
  if (format.empty()) format = ends_with(target, ".bin") ? "llmc" : "hf";
  MESHTRAIN_CHECK(format == "hf" || format == "llmc", "--format '", format,
                  "' is unknown; use hf (a Hugging Face directory) or llmc (an llm.c GPT-2 checkpoint)");
  const CheckpointModel model = load_checkpoint_model(resume);
  MESHTRAIN_CHECK(model.config.kind == "gpt2" || model.config.kind == "llama", "meshtrain export: ", model.step_dir,
                  " holds a --model ", model.config.kind, ", which no published format describes; export gpt2 or "
                  "llama models");
  MESHTRAIN_CHECK(model.config.experts == 0, "meshtrain export: ", model.step_dir, " holds a mixture of experts "
                  "(--experts ", model.config.experts, "), which meshtrain's gpt2 and llama formats do not describe; "
                  "generate from the checkpoint with meshtrain generate --resume ", resume);
  const ExportTarget claimed(target, format, overwrite);
  try {
    io::save_weights(target, format, model.config, model.parameters, dtype == "float32" ? at::kFloat : at::kBFloat16);
  } catch (...) {
    claimed.undo();
    throw;
  }
  out << "wrote " << target << " (" << (format == "hf" ? "Hugging Face directory" : "llm.c checkpoint") << ", "
      << dtype << ") from " << model.step_dir << ": " << model.config.kind << ", "
      << models::parameter_count(model.config) << " parameters\n";
  return 0;
}

}  // namespace train
}  // namespace meshtrain
