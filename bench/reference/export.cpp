// Exports what an independent implementation needs to retrain meshtrain's GPT:
// the initial parameters (raw float32, row-major) and the token batches of
// every step, for the trainer flags given. bench/reference/torch_gpt.py
// rebuilds the model in PyTorch (Python), trains it on the same batches and
// compares its losses with meshtrain's.
//   bench_reference_export OUT_DIR [meshtrain flags]
#include <torch/torch.h>

#include <fstream>
#include <iostream>

#include "meshtrain/models.h"
#include "app/trainer/config.h"
#include "meshtrain/train.h"
#include "meshtrain/util.h"

using namespace meshtrain;

void write_raw(const std::string& path, const torch::Tensor& t) {
  const torch::Tensor c = t.detach().contiguous();
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

std::string shape_of(const torch::Tensor& t) {
  std::vector<double> dims(t.sizes().begin(), t.sizes().end());
  return json::numbers(dims);
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: bench_reference_export OUT_DIR [meshtrain flags]\n";
    return 2;
  }
  const std::string out = argv[1];
  const train::TrainConfig c = train::resolve(train::parse_train_args({argv + 2, argv + argc}), 1);
  if (c.model.kind != "gpt" || !c.data.empty()) {
    std::cerr << "bench_reference_export: the GPT on the built-in task only\n";
    return 2;
  }
  auto model = models::build_stage(c.model, 0, models::num_pieces(c.model));
  std::vector<std::string> params;
  for (const auto& kv : model->named_parameters()) {
    write_raw(out + "/" + kv.key() + ".bin", kv.value());
    params.push_back(json::Object().str("name", kv.key()).raw("shape", shape_of(kv.value())).str());
  }
  auto data = train::make_arithmetic_dataset(c.seed, c.model.seq_len, c.digits);
  const auto all = data->samples(0, c.global_batch * c.steps);
  write_raw(out + "/inputs.bin", all.inputs);
  write_raw(out + "/targets.bin", all.targets);
  std::ofstream(out + "/index.json") << json::Object()
                                            .raw("config", train::to_json(c))
                                            .raw("parameters", json::array(params))
                                            .raw("batch_shape", shape_of(all.inputs))
                                            .str()
                                     << "\n";
  std::cout << "exported " << params.size() << " parameters and " << c.steps << " batches of " << c.global_batch
            << " to " << out << "\n";
}
