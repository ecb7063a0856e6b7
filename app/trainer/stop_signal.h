#pragma once
// The training loop's side of stop_at_step_end_on_sigterm (trainer.h).

namespace meshtrain {
namespace train {

// While one lives, a SIGTERM asks the loop to stop at the step's end
// (requested()); without one, SIGTERM ends the process.
class StopScope {
 public:
  StopScope();
  ~StopScope();
  StopScope(const StopScope&) = delete;
  StopScope& operator=(const StopScope&) = delete;
  // A SIGTERM arrived while this scope lived.
  static bool requested();
};

}  // namespace train
}  // namespace meshtrain
