#pragma once
// The communication layer's other environment settings, read in tuning.cpp
// beside CommTuning::from_env() (the one place that reads MESHTRAIN_* tunings).

#include <chrono>
#include <string>

namespace meshtrain {
namespace comm {

// MESHTRAIN_BACKEND, or "" when unset (backend.cpp parses it).
std::string backend_from_env();
// MESHTRAIN_LINK_TIMEOUT_S: how long a silent store link lives (Note [Silent
// links] in socket.h), 8 s when unset; ConfigError outside 2..3600.
std::chrono::seconds link_timeout_from_env();

}  // namespace comm
}  // namespace meshtrain
