#include "app/trainer/evaluate.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <limits>

#include "meshtrain/models.h"
#include "meshtrain/train.h"

namespace meshtrain {
namespace train {

namespace {

std::string greedy_answer(const models::ModelConfig& c, models::StageImpl& model, const std::string& prompt,
                          int64_t max_len, int max_new) {
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  std::string answer;
  for (int step = 0; step < max_new && static_cast<int64_t>(ids.size()) < max_len; ++step) {
    at::Tensor tokens = at::tensor(ids, at::kLong).view({1, -1});
    at::Tensor logits = models::predicted_logits(c, model.forward(tokens));
    const int64_t next = logits[0][-1].argmax().item<int64_t>();
    if (next == '\n') break;
    answer.push_back(static_cast<char>(next));
    ids.push_back(next);
  }
  return answer;
}

}  // namespace

double evaluate_accuracy(const TrainConfig& c, models::StageImpl& model, int problems) {
  if (problems <= 0 || !c.data.empty()) return std::numeric_limits<double>::quiet_NaN();
  torch::autograd::GradMode::set_enabled(false);
  int correct = 0;
  if (models::is_language_model(c.model)) {
    for (const auto& p : arithmetic_eval_problems(c.seed, problems, c.digits)) {
      correct += greedy_answer(c.model, model, p.prompt, c.model.seq_len, 4) == p.answer;
    }
  } else {
    auto data = make_classification_dataset(c.seed, c.model.features, c.model.classes);
    const Batch held_out = data->samples(int64_t{1} << 40, problems);  // far from any training index
    correct = model.forward(held_out.inputs).argmax(1).eq(held_out.targets).sum().item<int>();
  }
  torch::autograd::GradMode::set_enabled(true);
  return static_cast<double>(correct) / problems;
}

}  // namespace train
}  // namespace meshtrain
