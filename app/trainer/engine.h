#pragma once
// One training step for one layout (internal to the trainer). Each strategy
// (DDP, master DP; ZeRO, pipeline and tensor parallel compose here) provides an
// Engine; the trainer loop is the same for all.

#include <map>
#include <memory>
#include <string>

#include "meshtrain/comm.h"
#include "meshtrain/io.h"
#include "meshtrain/pp.h"
#include "meshtrain/train.h"
#include "app/trainer/config.h"

namespace meshtrain {
namespace train {

class Engine {
 public:
  virtual ~Engine() = default;
  // One optimizer step on the global batch of `step`. Returns this rank's
  // contribution to the global-batch loss (the trainer sums contributions).
  virtual double step(int64_t step) = 0;
  // The loss of global samples [first, first + count) of `data` (the
  // training data or a held-out set) without training (this rank's
  // contribution, summed by the trainer as step's).
  virtual double evaluate(const Dataset& data, int64_t first, int64_t count) = 0;
  // Every optimizer of this rank uses `lr` from the next step on.
  virtual void set_learning_rate(double lr) = 0;
  // The global gradient norm of the last step, before clipping (--clip-grad-norm).
  virtual double last_grad_norm() const = 0;
  // Full parameters under the single-process model's names, on rank 0.
  virtual std::map<std::string, at::Tensor> full_parameters() = 0;
  virtual StateBytes state_bytes() const = 0;
  // Traffic of the training communicators of this rank.
  virtual comm::Traffic traffic() const = 0;
  // The same, per mesh axis ("dp", "pp", "tp").
  virtual std::map<std::string, comm::Traffic> traffic_by_axis() const { return {}; }
  virtual void reset_traffic() = 0;
  // The last step's pipeline timeline on this rank (empty without a pipeline).
  virtual std::vector<pp::TraceEvent> last_trace() const { return {}; }
  virtual int max_activations_in_flight() const { return 0; }
  // Mixtures of experts: the routes each layer's experts computed since the
  // last call (the training micro-batches), as this rank's share of
  // [layers, experts + 1] (the last column: routes dropped for capacity), to
  // be summed over the world: every tp rank computes the same routes, so tp
  // rank 0 alone counts them. Undefined without experts.
  virtual at::Tensor take_router_load() { return at::Tensor(); }
  // Checkpoints: this rank's share of the training state, and loading it back
  // (under any layout: see checkpoint.h).
  virtual RankState checkpoint_state() = 0;
  virtual void load_checkpoint(CheckpointReader& reader) = 0;
};

// --init-from: the weights, read (memory-mapped) while the engine builds its
// model, and dropped after; the build context points at them.
class StartingWeights {
 public:
  explicit StartingWeights(const TrainConfig& config);
  models::BuildContext context(models::BuildContext ctx = {}) const;

 private:
  std::unique_ptr<io::LoadedWeights> loaded_;
};

std::unique_ptr<Engine> make_engine(const TrainConfig& config, comm::CommPtr world);
std::unique_ptr<Engine> make_mesh_engine(const TrainConfig& config, comm::CommPtr world);
std::unique_ptr<Dataset> make_dataset(const TrainConfig& config);

}  // namespace train
}  // namespace meshtrain
