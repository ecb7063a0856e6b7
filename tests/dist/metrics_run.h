#pragma once
// One training run through the CLI, read back from its metrics file: the
// end-to-end tests' way to compare layouts.

#include <gtest/gtest.h>

#include <string>

#include "util/files.h"
#include "meshtrain/util.h"
#include "shell.h"

namespace meshtrain {
namespace testing {

// meshrun --nproc-per-node ranks -- meshtrain FLAGS --metrics-out FILE; the
// parsed metrics, or an empty Value after a failure (reported to the test).
inline json::Value train_metrics(int ranks, const std::string& flags, const std::string& metrics) {
  Shell r = sh(kMeshrun + "--nproc-per-node " + std::to_string(ranks) + " -- " + kBin + "/meshtrain" + flags +
               " --metrics-out " + metrics);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return json::Value();
  return json::parse(files::read_all(metrics));
}

}  // namespace testing
}  // namespace meshtrain
