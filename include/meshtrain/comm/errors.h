#pragma once
// Errors raised by communication. Every blocking operation ends in one of these
// instead of hanging: a dead peer gives PeerFailure within seconds, a stuck peer
// gives TimeoutError at the communicator's timeout, and collectives whose
// arguments differ across ranks give MismatchError on every rank.

#include <stdexcept>
#include <string>

namespace meshtrain {
namespace comm {

// Base class of all communication failures. After one of these the communicator
// that raised it is unusable (its peers are in an unknown state).
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what) : std::runtime_error(what) {}
};

// A peer process died (its connection to the store or to this rank closed).
// `rank()` is the peer's global rank, or -1 when it could not be determined.
class PeerFailure : public CommError {
 public:
  PeerFailure(const std::string& what, int rank) : CommError(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

// No progress within the timeout: a peer is alive but stuck, or never called
// the matching operation.
class TimeoutError : public CommError {
 public:
  explicit TimeoutError(const std::string& what) : CommError(what) {}
};

// Ranks called the same collective with different kinds, dtypes, shapes or roots.
class MismatchError : public CommError {
 public:
  explicit MismatchError(const std::string& what) : CommError(what) {}
};

}  // namespace comm
}  // namespace meshtrain
