// meshtrain: the trainer (and, as "meshtrain plan", the planner). Logic lives
// in app/ (the flag-driven trainer and the commands) and the library
// (meshtrain::train, meshtrain::plan).
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <iostream>
#include <map>
#include <thread>

#include "meshtrain/comm.h"
#include "app/launch/elastic.h"
#include "meshtrain/plan.h"
#include "app/trainer/config.h"
#include "app/trainer/elastic.h"
#include "app/commands/export.h"
#include "app/commands/generate.h"
#include "app/commands/measure_flops.h"
#include "app/trainer/memory_check.h"
#include "app/commands/data.h"
#include "app/trainer/config_file.h"
#include "app/trainer/config_toml.h"
#include "meshtrain/train.h"
#include "app/trainer/run_training.h"
#include "meshtrain/util.h"
#include "util/memory.h"
#include "meshtrain/version.h"

using namespace meshtrain;

// The whole line in one write: meshrun may SIGTERM this rank a moment later
// (another rank failed first), and a line cut after its first words names nothing.
static void say_error(const std::string& message) {
  const std::string line = message + "\n";
  if (::write(2, line.data(), line.size()) < 0) {
  }
}

// The subcommands besides training (which takes flags only).
using Command = int (*)(const std::vector<std::string>&, std::ostream&);
// `meshtrain plan`, with --device-tflops measure resolved here (the planner is
// pure arithmetic; the measurement needs libtorch).
static int plan_command(const std::vector<std::string>& args, std::ostream& out) {
  std::string note;
  const std::vector<std::string> resolved = train::resolve_measured_tflops(args, note);
  if (!note.empty()) std::cerr << "meshtrain plan: --device-tflops " << note << "\n";
  return plan::run_plan(resolved, out);
}

static const std::map<std::string, Command> kCommands = {
    {"plan", plan_command},
    {"data", train::run_data_command},
    {"export", train::run_export_command},
    {"generate", train::run_generate_command},
    {"config", train::run_config_command},
};

static int run_command(Command command, const std::vector<std::string>& args) {
  try {
    return command(args, std::cout);
  } catch (const ConfigError& e) {
    say_error(e.what());
    return 2;
  } catch (const c10::Error& e) {
    say_error(std::string("meshtrain: ") + e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    say_error(std::string("meshtrain: ") + e.what());
    return 1;
  }
}

int main(int argc, char** argv) {
  train::stop_at_step_end_on_sigterm();  // before any thread starts: they inherit its signal mask
  keep_freed_memory_for_reuse();  // before libtorch's first large tensors (Note [Freed memory kept for reuse])
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && kCommands.count(args[0])) {
    return run_command(kCommands.at(args[0]), std::vector<std::string>(args.begin() + 1, args.end()));
  }
  if (!args.empty() && args[0].rfind("-", 0) != 0) {
    say_error("meshtrain: unknown command '" + args[0] + "'; meshtrain trains with flags (meshtrain --help), or runs "
              "one of: plan, data, export, generate, config (meshtrain COMMAND --help)");
    return 2;
  }
  if (train::asks_for_help(args)) {
    std::cout << train::train_usage();  // asked for: stdout, success
    return 0;
  }
  if (args.size() == 1 && args[0] == "--version") {
    std::cout << "meshtrain " << meshtrain::version() << " (libtorch " << TORCH_VERSION << ")" << std::endl;
    return 0;
  }
  bool joined = false;  // the world is made: errors from here on are not start-up reports
  try {
    train::TrainConfig config = train::parse_train_args(args);
    // Everything that can be checked is checked before any communication.
    const comm::DistEnv env = comm::dist_env_from_process();
    const bool elastic = std::getenv(launch::kElasticVariable) != nullptr;
    const train::LayoutChoice layout = train::resolve_for_world(
        config, env.world_size, elastic, train::total_memory_bytes() / std::max(1, env.local_world_size));
    config = layout.config;
    if (!std::getenv("MESHTRAIN_SKIP_MEMORY_CHECK")) {
      train::check_memory_fits(config, env.world_size, env.local_world_size, train::available_memory_bytes());
    }
    comm::CommOptions options = comm::CommOptions().set_backend(config.backend);
    if (config.comm_timeout > 0) options.timeout = std::chrono::milliseconds(static_cast<int64_t>(config.comm_timeout * 1000));
    comm::CommPtr world = comm::init_from_env(options);
    joined = true;
    if (world->rank() == 0) {
      if (elastic && (config.save_dir.empty() || config.save_every <= 0 || !config.resume)) {
        std::cout << "meshtrain: warning: an elastic job without --save-dir, --save-every and --resume starts over "
                     "after a lost node, and a returning node waits until the end (it joins at a checkpoint)"
                  << std::endl;
      }
      if (layout.source != "the flags") {
        std::cout << "meshtrain: a world of " << world->size() << " ranks runs dp " << config.dp << " x pp " << config.pp
                  << " x tp " << config.tp << ", ZeRO " << config.zero << " (" << layout.source << ")" << std::endl;
      }
      std::cout << "meshtrain: the run's configuration, resolved (TOML; --metrics-out records it as JSON):\n"
                << train::to_toml(config) << std::flush;
      std::cout << "meshtrain: communication backend " << world->backend() << " (world of " << world->size()
                << (world->size() == 1 ? " rank" : " ranks") << "; --backend or MESHTRAIN_BACKEND to choose)"
                << std::endl;
    }
    const train::TrainResult result = train::run_training(config, world);
    if (result.stopped_by_signal) return 128 + SIGTERM;  // unfinished: a scheduler requeues it
    return result.stopped_for_regroup ? launch::kRegroupExitCode : 0;
  } catch (const ConfigError& e) {
    // Ranks started by hand that wait for this one end now, naming why
    // (Note [Start-up reports] in src/comm/process.cpp).
    if (!joined) comm::report_startup_error(e.what());
    // Every rank checks the same flags: one line per node says why, not one per
    // rank. The other local ranks wait a moment first: when local rank 0 fails
    // the same way, meshrun stops them before they speak; when only they fail,
    // they still say why.
    const char* local_rank = std::getenv("LOCAL_RANK");
    if (local_rank && std::string(local_rank) != "0") std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    say_error(e.what());
    return 2;
  } catch (const comm::CommError& e) {
    say_error(std::string("meshtrain: communication failed: ") + e.what());
    return 1;
  } catch (const c10::Error& e) {  // libtorch's own errors: the message, not 25 frames of stack
    say_error(std::string("meshtrain: ") + e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    say_error(std::string("meshtrain: ") + e.what());
    return 1;
  }
}
