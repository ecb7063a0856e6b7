#pragma once
// The argument checks of every operation, written once for every backend:
// Communicator's public calls (isend, all_reduce_async, ...) run them on the
// caller's thread, then hand the backend its start_* call, so that a bad
// argument is a ConfigError naming the value and the fix before any
// communication, whatever the backend, and the communicator stays usable.
// And the labels every error names a rank with.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "meshtrain/comm.h"

namespace meshtrain {
namespace comm {

// "all_reduce on communicator 'tp' (rank 1 of 2, global rank 3)".
std::string where(const Communicator& c, const char* op);
// "rank 1 (global rank 3)".
std::string peer_name(const Communicator& c, int peer);

void check_tensor(const Communicator& c, const at::Tensor& t, const char* op, const char* what);
void check_root(const Communicator& c, int root, const char* op);
void check_peer(const Communicator& c, int peer, const char* op);
void check_reduce_op(const Communicator& c, ReduceOp op, const at::Tensor& t, const char* name);
void check_p2p(const Communicator& c, const at::Tensor& tensor, int peer, int tag, const char* op);
// reduce_scatter's shard sizes and output; fills in the default sizes.
void check_reduce_scatter(const Communicator& c, const at::Tensor& input, const at::Tensor& output,
                          std::vector<int64_t>& counts);
void check_all_gather(const Communicator& c, const at::Tensor& input, const at::Tensor& output);
void check_scatter(const Communicator& c, const at::Tensor& output, const std::vector<at::Tensor>& inputs, int root);
void check_all_to_all(const Communicator& c, const std::vector<at::Tensor>& inputs);

}  // namespace comm
}  // namespace meshtrain
