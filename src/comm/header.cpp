#include "header.h"

#include <algorithm>

#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {

Header header_of(const at::Tensor& t, OpKind kind, ReduceOp op, int root) {
  Header h;
  h.kind = static_cast<int32_t>(kind);
  h.dtype = static_cast<int32_t>(t.defined() ? t.scalar_type() : at::kByte);
  h.op = static_cast<int32_t>(op);
  h.root = root;
  if (t.defined()) {
    h.ndim = static_cast<int32_t>(t.dim());
    h.numel = t.numel();
    for (int64_t d = 0; d < t.dim() && d < 8; ++d) h.shape[d] = t.size(d);
  }
  return h;
}

std::string describe(const Header& h) {
  std::string s = str_cat(c10::toString(static_cast<at::ScalarType>(h.dtype)), "[");
  for (int d = 0; d < h.ndim && d < 8; ++d) s += str_cat(d ? ", " : "", h.shape[d]);
  return s + "]";
}

std::vector<int64_t> shape_of(const Header& h) {
  return std::vector<int64_t>(h.shape, h.shape + std::min(std::max(h.ndim, 0), 8));
}

at::Tensor view_at(const at::Tensor& flat, int64_t offset, const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  return flat.as_strided(shape, strides, flat.storage_offset() + offset);
}

int64_t hash_sizes(const std::vector<int64_t>& sizes) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : sizes) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 1);
}

// "rank 1", or "rank 1 (global rank 3)" on a communicator that is not the world.
std::string rank_name(size_t r, const std::vector<int>& global) {
  if (r < global.size() && global[r] != static_cast<int>(r)) return str_cat("rank ", r, " (global rank ", global[r], ")");
  return str_cat("rank ", r);
}

namespace {

// How `h` (of `rank`) differs from `ref` (of `rank0`) by the comparison's
// rules, or "" when it does not.
std::string difference(const Header& h, const Header& ref, bool same_shape, const std::string& rank,
                       const std::string& rank0) {
  if (h.kind != ref.kind) {
    return str_cat(rank, " called ", op_name(static_cast<OpKind>(h.kind)), " while ", rank0, " called ",
                   op_name(static_cast<OpKind>(ref.kind)), " (every rank must call collectives in the same order)");
  }
  if (h.dtype != ref.dtype || (same_shape && (h.numel != ref.numel || h.ndim != ref.ndim ||
                                              !std::equal(h.shape, h.shape + 8, ref.shape)))) {
    return str_cat(rank, " passed ", describe(h), " but ", rank0, " passed ", describe(ref),
                   "; every rank must pass the same dtype", same_shape ? " and shape" : "");
  }
  if (h.root != ref.root) return str_cat(rank, " passed root ", h.root, " but ", rank0, " passed root ", ref.root);
  if (h.op != ref.op) {
    return str_cat(rank, " passed reduce op ", reduce_op_name(static_cast<ReduceOp>(h.op)), " but ", rank0,
                   " passed ", reduce_op_name(static_cast<ReduceOp>(ref.op)));
  }
  if (h.aux != ref.aux) return str_cat(rank, " and ", rank0, " passed different shard sizes");
  if (h.inlined != ref.inlined) return str_cat(rank, " and ", rank0, " use different CommOptions::inline_bytes");
  return "";
}

}  // namespace

// The ranks' names are built only for a mismatch: this runs at every step of
// every collective's header round, where building two names per rank through
// an ostringstream was a tenth of a 4-rank 64 KiB reduce_scatter's time over TCP.
std::string header_mismatch(const std::vector<Header>& all, bool same_shape, const std::vector<int>& global,
                            const std::vector<bool>& known) {
  auto is_known = [&](size_t r) { return known.empty() || (r < known.size() && known[r]); };
  size_t first = 0;
  while (first < all.size() && !is_known(first)) ++first;
  if (first == all.size()) return "";
  const std::string unnamed;
  for (size_t r = first + 1; r < all.size(); ++r) {
    if (!is_known(r) || difference(all[r], all[first], same_shape, unnamed, unnamed).empty()) continue;
    return difference(all[r], all[first], same_shape, rank_name(r, global), rank_name(first, global));
  }
  return "";
}

bool supported_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf:
    case at::kInt: case at::kLong: case at::kByte: case at::kChar:
      return true;
    default:
      return false;
  }
}

}  // namespace comm
}  // namespace meshtrain
