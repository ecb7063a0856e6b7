#pragma once
// Comparing what `meshtrain --metrics-out` wrote, for the end-to-end tests.

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "meshtrain/util.h"

namespace meshtrain {
namespace testing {

// Float reassociation across layouts (equivalence.h's Tolerance for losses).
constexpr double kLossRtol = 2e-6, kLossAtol = 1e-6;

// Every step's loss of `got` equals `want`'s (one process's) within the tolerance.
inline void expect_same_losses(const json::Value& got, const json::Value& want, const std::string& what) {
  ASSERT_EQ(got.type, json::Value::Type::kObject) << what << ": no metrics";
  ASSERT_EQ(got["losses"].size(), want["losses"].size()) << what;
  for (size_t s = 0; s < want["losses"].size(); ++s) {
    const double g = got["losses"][s].num(), w = want["losses"][s].num();
    EXPECT_LE(std::abs(g - w), kLossAtol + kLossRtol * std::abs(w)) << what << ": step " << s << " loss " << g
                                                                     << ", one process " << w;
  }
}

}  // namespace testing
}  // namespace meshtrain
