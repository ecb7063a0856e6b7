#pragma once
// A training checkpoint (of any layout) as a whole model: `meshtrain export`
// writes it in a published format (meshtrain/io.h), and `meshtrain generate
// --resume` loads it.

#include <ATen/core/Tensor.h>

#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "meshtrain/models.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace train {

// The model of a trainer configuration's JSON (to_json's "model" object).
models::ModelConfig model_config_from_json(const json::Value& model);

struct CheckpointModel {
  models::ModelConfig config;
  std::map<std::string, at::Tensor> parameters;  // the whole model's, float32, by its names
  std::string step_dir;                          // the checkpoint read
};
// The newest complete checkpoint of `save_dir` (or the step directory given),
// every tensor assembled from the shards of whichever layout saved it.
CheckpointModel load_checkpoint_model(const std::string& save_dir_or_step);

// `meshtrain export --resume SAVE_DIR --out PATH [--format hf|llmc] [--dtype
// float32|bfloat16]`; returns the exit code.
int run_export_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace train
}  // namespace meshtrain
