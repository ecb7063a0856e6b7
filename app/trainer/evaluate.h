#pragma once
// Task accuracy of a trained dense (unsharded) model: for the GPT on the
// arithmetic task, exact answers by greedy decoding of held-out problems
// ("17+25=" -> "42"); for the MLP, classification accuracy on held-out samples.
// NaN for tasks without an accuracy (a text file).

#include "meshtrain/models.h"
#include "app/trainer/config.h"

namespace meshtrain {
namespace train {

double evaluate_accuracy(const TrainConfig& config, models::StageImpl& dense_model, int problems);

}  // namespace train
}  // namespace meshtrain
