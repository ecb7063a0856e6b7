// The one place where the communication layer reads its MESHTRAIN_* settings
// from the environment (include/meshtrain/comm.h; docs/comm.md,
// "Tuning"). The rendezvous' own variables (MASTER_ADDR, RANK, the token, the
// host identity, the bind address) are the rendezvous' business
// (rendezvous.cpp, process.cpp, store_auth.cpp), not tunings.

#include "meshtrain/comm.h"

#include <cmath>
#include <cstdlib>
#include <string>

#include "meshtrain/util.h"
#include "tuning_env.h"

namespace meshtrain {
namespace comm {

namespace {

constexpr int64_t kNoMax = INT64_MAX >> 10;

const char* set_value(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// The variable `name` as an integer in [min, max], or nullopt when unset;
// ConfigError naming it, its value and the range otherwise.
std::optional<int64_t> env_integer(const char* name, int64_t min, int64_t max, const char* what) {
  const char* v = set_value(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  const std::string range = max == kNoMax ? str_cat(min, " or more") : str_cat("between ", min, " and ", max);
  MESHTRAIN_CHECK(end && *end == '\0' && x >= min && x <= max, name, "='", v, "' must be ", what, " (", range, ")");
  return x;
}

// A size in KiB, as bytes.
std::optional<int64_t> env_kib(const char* name, int64_t min_kb, int64_t max_kb = kNoMax) {
  const auto kb = env_integer(name, min_kb, max_kb, "a size in KiB");
  return kb ? std::optional<int64_t>(*kb << 10) : std::nullopt;
}

// A wait budget, 0 to 1 s.
std::optional<std::chrono::microseconds> env_us(const char* name) {
  const auto us = env_integer(name, 0, 1000000, "a time in microseconds");
  return us ? std::optional<std::chrono::microseconds>(*us) : std::nullopt;
}

// A two-way switch: true when unset or `preferred`, false when `other`.
bool env_choice(const char* name, const char* preferred, const char* other, const char* what, const char* see) {
  const char* v = set_value(name);
  const std::string value = v ? v : "";
  if (value.empty() || value == preferred) return true;
  if (value == other) return false;
  throw ConfigError(str_cat(name, "='", value, "' is not ", what, ": use ", preferred, " (the default) or ", other, " (",
                            see, ")"));
}

ShmTuning shm_from_env() {
  ShmTuning t;
  t.buffer_bytes = env_kib("MESHTRAIN_SHM_BUFFER_KB", 1, 1 << 20).value_or(t.buffer_bytes);
  t.channel_bytes = env_kib("MESHTRAIN_SHM_CHANNEL_KB", 1, 1 << 20).value_or(t.channel_bytes);
  t.one_step_bytes = env_kib("MESHTRAIN_SHM_SMALL_KB", 0, 1 << 20);
  t.spin = env_us("MESHTRAIN_SHM_SPIN_US");
  t.yield = env_us("MESHTRAIN_SHM_YIELD_US");
  return t;
}

TcpTuning tcp_from_env() {
  TcpTuning t;
  t.spin = env_us("MESHTRAIN_TCP_SPIN_US");
  t.yield = env_us("MESHTRAIN_TCP_YIELD_US");
  t.buffer_bytes = env_kib("MESHTRAIN_TCP_BUFFER_KB", 0, 1 << 20);
  t.ring_bytes = env_kib("MESHTRAIN_GLOO_RING_KB", 0).value_or(t.ring_bytes);
  t.chain_bytes = env_kib("MESHTRAIN_GLOO_CHAIN_KB", 0).value_or(t.chain_bytes);
  t.piece_bytes = env_kib("MESHTRAIN_GLOO_PIECE_KB", 0).value_or(t.piece_bytes);
  t.doubling_round =
      env_choice("MESHTRAIN_GLOO_ROUND", "doubling", "direct", "a header round", "Note [Doubling round]");
  // libgloo's transport is gone (Note [Gloo transports]): saying so beats running on another than asked for.
  const char* transport = set_value("MESHTRAIN_GLOO_TRANSPORT");
  MESHTRAIN_CHECK(!transport || std::string(transport) == "links", "MESHTRAIN_GLOO_TRANSPORT='", transport,
                  "': libgloo's transport was removed, measured slower than meshtrain's TCP links "
                  "(docs/comm.md, \"Transports\"); unset it");
  return t;
}

MpiTuning mpi_from_env() {
  MpiTuning t;
  t.spin = env_us("MESHTRAIN_MPI_SPIN_US").value_or(t.spin);
  t.eager_bytes = env_integer("MESHTRAIN_MPI_EAGER_BYTES", 0, kNoMax, "a size in bytes");
  return t;
}

}  // namespace

CommTuning CommTuning::from_env() {
  CommTuning t;
  t.shm = shm_from_env();
  t.tcp = tcp_from_env();
  t.hier.min_bytes = env_kib("MESHTRAIN_HIER_MIN_KB", 0).value_or(t.hier.min_bytes);
  t.mpi = mpi_from_env();
  return t;
}

std::chrono::milliseconds default_comm_timeout() {
  const char* env = set_value("MESHTRAIN_COMM_TIMEOUT");
  if (!env) return std::chrono::minutes(5);
  char* end = nullptr;
  const double s = std::strtod(env, &end);
  MESHTRAIN_CHECK(*end == '\0' && std::isfinite(s) && s > 0 && s <= 86400, "MESHTRAIN_COMM_TIMEOUT='", env,
                  "' must be a number of seconds in (0, 86400]");
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

std::string backend_from_env() {
  const char* env = set_value("MESHTRAIN_BACKEND");
  return env ? env : "";
}

std::chrono::seconds link_timeout_from_env() {
  const char* v = set_value("MESHTRAIN_LINK_TIMEOUT_S");
  if (!v) return std::chrono::seconds(8);
  char* end = nullptr;
  const long s = std::strtol(v, &end, 10);
  MESHTRAIN_CHECK(end && *end == '\0' && s >= 2 && s <= 3600, "MESHTRAIN_LINK_TIMEOUT_S='", v,
                  "' must be a whole number of seconds between 2 and 3600");
  return std::chrono::seconds(s);
}

}  // namespace comm
}  // namespace meshtrain
