#pragma once
// Header: a fixed-size description of one rank's arguments to a collective
// (kind, dtype, shape, root, reduce op, sizes), which every backend exchanges
// or publishes so that ranks passing different arguments get a MismatchError
// naming the difference instead of a crash or a hang. Pure functions here;
// how the headers travel is each backend's business.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/comm.h"

namespace meshtrain {
namespace comm {

struct Header {
  uint32_t magic = 0x6d657368;  // "mesh"
  int32_t kind = 0;
  int32_t dtype = 0;
  int32_t op = 0;
  int32_t root = 0;
  int32_t ndim = 0;
  int64_t numel = 0;
  int64_t aux = 0;  // operation-specific (output size, hash of per-rank sizes)
  int64_t shape[8] = {0};
  int64_t inline_bytes = 0;  // payload bytes that follow this header (in the same message, but for inline_after)
  int32_t inlined = 0;       // 1: this rank sends its data inline (small-message path)
  int32_t inline_after = 0;  // of inline_bytes, those that follow in a second message (MPI: Note [MPI header round])
};

// The header describing `t` (undefined: a header with no data) for operation `kind`.
Header header_of(const at::Tensor& t, OpKind kind, ReduceOp op = ReduceOp::kSum, int root = 0);
// "Float[2, 3]".
std::string describe(const Header& h);
// The shape a header carries.
std::vector<int64_t> shape_of(const Header& h);
// A contiguous view of `shape` at element `offset` of a contiguous flat
// tensor (one dispatcher call, where narrow + view are two).
at::Tensor view_at(const at::Tensor& flat, int64_t offset, const std::vector<int64_t>& shape);
// FNV-1a over a list of sizes: lets ranks compare per-rank size lists in one field.
int64_t hash_sizes(const std::vector<int64_t>& sizes);
// Compares every rank's header with rank 0's: the first difference as a
// sentence ("rank 1 passed Double[4] but rank 0 passed Float[4]; ..."), or ""
// when they agree. `same_shape`: shapes must match too (not for uneven gathers).
// `global`: the communicator's global ranks, named beside its own where they differ.
// `known` (empty: all): compares only those headers, with the first known as the reference.
std::string header_mismatch(const std::vector<Header>& all, bool same_shape, const std::vector<int>& global = {},
                            const std::vector<bool>& known = {});

// dtypes every backend moves and reduces.
bool supported_dtype(at::ScalarType t);

}  // namespace comm
}  // namespace meshtrain
