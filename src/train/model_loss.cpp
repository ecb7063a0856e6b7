// train::model_loss: a built-in model's loss with its head cut by vocabulary
// (see module_trainer.h).
#include <ATen/ATen.h>

#include "meshtrain/models.h"
#include "meshtrain/tp.h"
#include "meshtrain/train.h"

namespace meshtrain {
namespace train {

Trainer::Loss model_loss(const models::ModelConfig& config, comm::CommPtr tp) {
  if (!tp || tp->size() == 1 || !models::is_language_model(config)) {  // the MLP's output is whole
    return [config](const at::Tensor& output, const at::Tensor& targets) {
      return models::loss(config, output, targets);
    };
  }
  return [config, tp](const at::Tensor& output, const at::Tensor& targets) {
    // This rank's rows [r V/tp, (r + 1) V/tp) of the padded vocabulary (equal cuts: models::validate).
    const at::Tensor logits = models::predicted_logits(config, output, output.size(-1) * tp->rank());
    return tp::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), tp);
  };
}

}  // namespace train
}  // namespace meshtrain
