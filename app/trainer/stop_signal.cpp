// Note [SIGTERM stops at a step's end]
// A scheduler that preempts a job (Slurm, Kubernetes, a spot instance), or a
// user stopping meshrun, sends SIGTERM and SIGKILL a grace period later
// (meshrun --grace-seconds, Slurm's KillWait). torchrun users catch it and
// save. Here a rank that trains with --save-dir finishes the step it is in;
// the ranks agree at the step's end (the vote rides on the loss's all-reduce,
// so a SIGTERM that reached some ranks only still stops all of them at the
// same step), save that step's checkpoint and exit with 128 + SIGTERM: the
// job is unfinished, and --resume continues it. The grace period must cover
// the rest of a step and a save.
//
// The signal is blocked in every thread (main() blocks it before any thread
// starts; threads inherit the mask) and taken by one thread with sigwait, so
// that no poll or read in the communication layer is ever interrupted by it.
// Outside the training loop (start-up, the final report) and at a second
// SIGTERM, that thread restores the default action and raises the signal
// again: the process ends as it did before.
#include "stop_signal.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "app/trainer/run_training.h"

namespace meshtrain {
namespace train {

namespace {

std::mutex g_mutex;
int g_scopes = 0;  // StopScopes alive
std::atomic<bool> g_requested{false};
bool g_installed = false;

[[noreturn]] void die_of_sigterm(const sigset_t& set) {
  ::signal(SIGTERM, SIG_DFL);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(SIGTERM);
  for (;;) ::pause();  // not reached: the default action ends the process
}

}  // namespace

void stop_at_step_end_on_sigterm() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_installed) return;
  g_installed = true;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    for (;;) {
      int sig = 0;
      if (::sigwait(&set, &sig) != 0) continue;
      std::lock_guard<std::mutex> lock(g_mutex);
      if (g_scopes == 0 || g_requested.load()) die_of_sigterm(set);
      g_requested.store(true);
    }
  }).detach();
}

StopScope::StopScope() {
  std::lock_guard<std::mutex> lock(g_mutex);
  ++g_scopes;
}

StopScope::~StopScope() {
  std::lock_guard<std::mutex> lock(g_mutex);
  --g_scopes;
}

bool StopScope::requested() { return g_requested.load(); }

}  // namespace train
}  // namespace meshtrain
