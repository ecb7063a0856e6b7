#include "communicator.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>

#include "../backend.h"
#include "../tcp/communicator.h"
#include "../header.h"
#include "../process.h"
#include "../shm/communicator.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "util/shard.h"

namespace meshtrain {
namespace comm {
namespace hier_backend {

Placement place(const std::vector<std::string>& member_hosts) {
  Placement p;
  std::map<std::string, int> host_index, seen;
  for (const auto& h : member_hosts) {
    auto it = host_index.find(h);
    if (it == host_index.end()) it = host_index.emplace(h, p.hosts++).first;
    p.host.push_back(it->second);
    p.local.push_back(seen[h]++);
  }
  return p;
}

std::vector<int> by_local_index(const Placement& p) {
  std::vector<int> order;
  const int per_host = p.hosts == 0 ? 0 : static_cast<int>(p.host.size()) / p.hosts;
  for (int l = 0; l < per_host; ++l)
    for (int h = 0; h < p.hosts; ++h)
      for (size_t q = 0; q < p.host.size(); ++q)
        if (p.host[q] == h && p.local[q] == l) order.push_back(static_cast<int>(q));
  return order;
}

HierCommunicator::HierCommunicator(std::shared_ptr<Process> process, std::vector<int> global_ranks, int rank,
                                   const std::string& prefix, CommOptions options)
    : QueuedCommunicator(std::move(global_ranks), rank, std::move(options)),
      process_(std::move(process)),
      prefix_(prefix),
      min_bytes_(options_.tuning.hier.min_bytes) {
  std::vector<std::string> hosts;
  for (int g : global_ranks_) hosts.push_back(process_->host_of(g));
  placement_ = place(hosts);
  by_local_ = by_local_index(placement_);
  const int my_host = placement_.host[rank_], my_local = placement_.local[rank_];
  std::vector<int> local, cross(placement_.hosts, -1);
  for (int q = 0; q < size(); ++q) {
    if (placement_.host[q] == my_host) local.push_back(global_ranks_[q]);
    if (placement_.local[q] == my_local) cross[placement_.host[q]] = global_ranks_[q];
  }
  // Every member builds its parts in the same order (each blocks until its group has arrived).
  CommOptions o = options_;
  o.label = options_.label + "/host";
  o.backend = "shm";
  local_ = std::make_shared<shm_backend::ShmCommunicator>(process_, std::move(local), my_local,
                                                          str_cat(prefix, "/local", my_host), o);
  o.label = options_.label + "/across";
  o.verify = false;  // every hierarchical all_reduce verifies its arguments on flat_ first
  cross_ = std::make_shared<gloo_backend::TcpCommunicator>(process_, std::move(cross), my_host,
                                                            str_cat(prefix, "/cross", my_local), o);
  o.label = options_.label;
  o.verify = options_.verify;
  flat_ = std::make_shared<gloo_backend::TcpCommunicator>(process_, global_ranks_, rank_, prefix + "/flat", o);
}

HierCommunicator::~HierCommunicator() { stop_worker(); }

// ---- traffic

Traffic HierCommunicator::parts_traffic() const { return local_->traffic() + cross_->traffic() + flat_->traffic(); }

Traffic HierCommunicator::traffic() const {
  Traffic t = counter_.snapshot();
  const Traffic parts = parts_traffic();
  for (OpKind k : {OpKind::kSend, OpKind::kRecv}) t[k] = parts[k];  // point-to-point goes to the parts directly
  return t;
}

void HierCommunicator::reset_traffic() {
  counter_.reset();
  local_->reset_traffic();
  cross_->reset_traffic();
  flat_->reset_traffic();
}

WorkPtr HierCommunicator::run_on_parts(OpKind kind, const char* name,
                                       std::function<void(std::vector<at::Tensor>&)> body) {
  return enqueue(kind, name, [this, kind, body](std::vector<at::Tensor>& result) {
    const Traffic before = parts_traffic();
    verified_ = OpTraffic();
    body(result);
    const Traffic moved = parts_traffic() - before;
    Traffic mine;
    mine[kind] -= verified_;
    mine[OpKind::kVerify] += verified_;
    for (int k = 0; k < kNumOpKinds; ++k) {
      const OpKind part = static_cast<OpKind>(k);
      if (part == OpKind::kSend || part == OpKind::kRecv) continue;  // concurrent point-to-point, not this op
      OpTraffic bytes = moved.ops[k];
      bytes.calls = 0;
      mine[part == OpKind::kVerify ? OpKind::kVerify : kind] += bytes;
    }
    counter_.add(mine);
  });
}

// ---- all_reduce

std::vector<Header> HierCommunicator::headers_on_flat(const Header& mine, const char* op, bool same_shape) {
  at::Tensor bytes = at::empty({static_cast<int64_t>(sizeof(Header))}, at::kByte);
  std::memcpy(bytes.data_ptr(), &mine, sizeof(Header));
  const Traffic before = flat_->traffic();
  const at::Tensor all = flat_->all_gather_flat(bytes);
  verified_ = (flat_->traffic() - before)[OpKind::kAllGather];
  verified_.calls = 0;
  std::vector<Header> headers(size());
  std::memcpy(headers.data(), all.data_ptr(), sizeof(Header) * size());
  const std::string problem = header_mismatch(headers, same_shape, global_ranks());
  if (!problem.empty()) throw MismatchError(str_cat(where(op), ": ", problem));
  return headers;
}

void HierCommunicator::hierarchical_all_reduce(at::Tensor& flat, ReduceOp op) {
  // One small round on the flat group, so that mismatched arguments raise
  // MismatchError on every rank (the parts only see their own members).
  if (options_.verify) headers_on_flat(header_of(flat, OpKind::kAllReduce, op), "all_reduce", true);
  const ReduceOp part_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const auto counts = shard_sizes(flat.numel(), local_->size());
  at::Tensor slice = at::empty({counts[local_->rank()]}, flat.options());
  local_->reduce_scatter_async(flat, part_op, slice, counts)->wait();
  cross_->all_reduce(slice, part_op);
  local_->all_gather_async(slice, flat)->wait();  // uneven slices land in place: shard order
  if (op == ReduceOp::kAvg) flat.div_(size());
}

void HierCommunicator::in_place(const at::Tensor& tensor, const std::function<void()>& on_flat,
                                const std::function<void(at::Tensor&)>& nested) {
  if (static_cast<int64_t>(tensor.nbytes()) < min_bytes_) {
    on_flat();
    return;
  }
  at::Tensor flat = tensor.contiguous().view(-1);
  nested(flat);
  if (!tensor.is_contiguous()) tensor.copy_(flat.view(tensor.sizes()));
}

WorkPtr HierCommunicator::start_all_reduce(at::Tensor tensor, ReduceOp op) {
  return run_on_parts(OpKind::kAllReduce, "all_reduce", [this, tensor, op](std::vector<at::Tensor>& result) {
    in_place(
        tensor, [&] { flat_->all_reduce(tensor, op); }, [&](at::Tensor& flat) { hierarchical_all_reduce(flat, op); });
    result = {tensor};
  });
}

// ---- broadcast, reduce_scatter, all_gather

// Note [Nested reduce-scatter and all-gather]
// n members, H hosts of L. Member q owns segment q of the buffer (counts[q]
// elements). Lay the segments out by local index (by_local_index): local
// rank l's slice is then the segments of the H members of local index l, one
// per host, contiguous.
//   reduce_scatter: reduce-scatter the re-laid buffer inside the host (local
//     rank l gets its host's sum of slice l), then reduce-scatter slice l
//     across the hosts among the members of local index l: each ends with
//     its own segment summed over every host. Across hosts: (H-1)/H of each
//     slice per host, (H-1) S in all; flat Gloo sends each member's segment
//     from every member of the other hosts, (n-L) S.
//   all_gather: all-gather across the hosts among the members of local index
//     l (slice l), then inside the host (every slice), then undo the layout.
//     (H-1) S across hosts in all, against (n-L) S flat.
//   broadcast: the root's local index crosses (one copy per host), then each
//     host broadcasts inside from its member of that local index: (H-1) S
//     against flat Gloo's (n-L) S.
// The all_gather's sizes are learned from a header round on the flat group
// (it also verifies the arguments, as Gloo's own round does).

void HierCommunicator::hierarchical_broadcast(at::Tensor& flat, int root) {
  if (options_.verify) headers_on_flat(header_of(flat, OpKind::kBroadcast, ReduceOp::kSum, root), "broadcast", true);
  const int root_local = placement_.local[root];
  if (placement_.local[rank_] == root_local) cross_->broadcast(flat, placement_.host[root]);
  local_->broadcast(flat, root_local);
}

namespace {

// The segments of `counts` in `order`: their offsets in the re-laid buffer,
// and each local index's slice (its group's segments) as one count.
struct Relaid {
  std::vector<int64_t> offsets;  // offsets[q]: where member q's segment starts in the re-laid buffer
  std::vector<int64_t> slices;   // slices[l]: elements of local index l's slice
};

Relaid relay(const std::vector<int>& order, const std::vector<int64_t>& counts, const Placement& p) {
  Relaid r;
  r.offsets.assign(counts.size(), 0);
  r.slices.assign(p.host.size() / p.hosts, 0);
  int64_t at = 0;
  for (int q : order) {
    r.offsets[q] = at;
    at += counts[q];
    r.slices[p.local[q]] += counts[q];
  }
  return r;
}

// Copies each member's segment between the rank-ordered buffer and the re-laid one.
void copy_segments(const at::Tensor& from, at::Tensor& to, const std::vector<int64_t>& counts,
                   const std::vector<int64_t>& relaid_offsets, bool into_relaid) {
  const auto offsets = offsets_of(counts);
  for (size_t q = 0; q < counts.size(); ++q) {
    if (counts[q] == 0) continue;
    const int64_t src = into_relaid ? offsets[q] : relaid_offsets[q], dst = into_relaid ? relaid_offsets[q] : offsets[q];
    to.narrow(0, dst, counts[q]).copy_(from.narrow(0, src, counts[q]));
  }
}

}  // namespace

at::Tensor HierCommunicator::hierarchical_reduce_scatter(const at::Tensor& flat, ReduceOp op, at::Tensor out,
                                                         const std::vector<int64_t>& counts) {
  if (options_.verify) {
    Header mine = header_of(flat, OpKind::kReduceScatter, op);
    mine.aux = hash_sizes(counts);
    headers_on_flat(mine, "reduce_scatter", true);
  }
  const ReduceOp part_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const Relaid r = relay(by_local_, counts, placement_);
  at::Tensor relaid = at::empty_like(flat);
  copy_segments(flat, relaid, counts, r.offsets, true);
  at::Tensor slice = at::empty({r.slices[local_->rank()]}, flat.options());
  local_->reduce_scatter_async(relaid, part_op, slice, r.slices)->wait();
  std::vector<int64_t> across(placement_.hosts);
  for (int q = 0; q < size(); ++q)
    if (placement_.local[q] == placement_.local[rank_]) across[placement_.host[q]] = counts[q];
  cross_->reduce_scatter_async(slice, part_op, out, across)->wait();
  if (op == ReduceOp::kAvg) out.div_(size());
  return out;
}

std::vector<at::Tensor> HierCommunicator::hierarchical_all_gather(const at::Tensor& input, at::Tensor output) {
  Header mine = header_of(input, OpKind::kAllGather);
  mine.aux = output.numel();
  std::vector<Header> headers = headers_on_flat(mine, "all_gather", false);
  std::vector<int64_t> counts(size());
  for (int q = 0; q < size(); ++q) counts[q] = headers[q].numel;
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  for (int q = 0; q < size(); ++q) {
    if (headers[q].aux != total) {
      throw MismatchError(str_cat(where("all_gather"), ": rank ", q, " passed an output of ", headers[q].aux,
                                  " elements but the inputs total ", total));
    }
  }
  const Relaid r = relay(by_local_, counts, placement_);
  at::Tensor slice = at::empty({r.slices[local_->rank()]}, input.options());
  cross_->all_gather_async(input.contiguous().view(-1), slice)->wait();
  at::Tensor relaid = at::empty({total}, input.options());
  local_->all_gather_async(slice, relaid)->wait();
  at::Tensor flat = output.is_contiguous() ? output.view(-1) : at::empty({total}, input.options());
  copy_segments(relaid, flat, counts, r.offsets, false);
  if (!output.is_contiguous()) output.copy_(flat.view(output.sizes()));
  std::vector<at::Tensor> result = {output};
  const auto offsets = offsets_of(counts);
  for (int q = 0; q < size(); ++q) result.push_back(view_at(flat, offsets[q], shape_of(headers[q])));
  return result;
}

WorkPtr HierCommunicator::start_broadcast(at::Tensor tensor, int root) {
  return run_on_parts(OpKind::kBroadcast, "broadcast", [this, tensor, root](std::vector<at::Tensor>& result) {
    in_place(
        tensor, [&] { flat_->broadcast(tensor, root); }, [&](at::Tensor& flat) { hierarchical_broadcast(flat, root); });
    result = {tensor};
  });
}

// ---- everything else: the flat communicator

WorkPtr HierCommunicator::start_reduce(at::Tensor tensor, int root, ReduceOp op) {
  return run_on_parts(OpKind::kReduce, "reduce", [this, tensor, root, op](std::vector<at::Tensor>& result) {
    flat_->reduce(tensor, root, op);
    result = {tensor};
  });
}

WorkPtr HierCommunicator::start_all_gather(const at::Tensor& input, at::Tensor output) {
  return run_on_parts(OpKind::kAllGather, "all_gather", [this, input, output](std::vector<at::Tensor>& result) {
    // Nested only where every rank knows the total without asking (the
    // output it passed: ZeRO's gathers), and it is large enough.
    if (output.defined() && static_cast<int64_t>(output.nbytes()) >= min_bytes_) {
      result = hierarchical_all_gather(input, output);
      return;
    }
    auto work = flat_->all_gather_async(input, output);
    work->wait();
    result = work->result();
  });
}

WorkPtr HierCommunicator::start_reduce_scatter(const at::Tensor& input, ReduceOp op, at::Tensor output,
                                               std::vector<int64_t> counts) {
  return run_on_parts(OpKind::kReduceScatter, "reduce_scatter",
                      [this, input, op, output, counts](std::vector<at::Tensor>& result) {
    if (static_cast<int64_t>(input.nbytes()) < min_bytes_) {
      auto work = flat_->reduce_scatter_async(input, op, output, counts);
      work->wait();
      result = work->result();
      return;
    }
    const std::vector<int64_t> sizes = counts.empty() ? shard_sizes(input.numel(), size()) : counts;
    at::Tensor out = output.defined() && output.is_contiguous() ? output.view(-1)
                                                                 : at::empty({sizes[rank_]}, input.options());
    hierarchical_reduce_scatter(input.contiguous().view(-1), op, out, sizes);
    if (output.defined() && !output.is_contiguous()) output.copy_(out.view(output.sizes()));
    result = {output.defined() ? output : out};
  });
}

WorkPtr HierCommunicator::start_gather(const at::Tensor& input, int root) {
  return run_on_parts(OpKind::kGather, "gather", [this, input, root](std::vector<at::Tensor>& result) {
    result = flat_->gather(input, root);
  });
}

WorkPtr HierCommunicator::start_scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root) {
  return run_on_parts(OpKind::kScatter, "scatter", [this, output, inputs, root](std::vector<at::Tensor>& result) {
    flat_->scatter(output, inputs, root);
    result = {output};
  });
}

WorkPtr HierCommunicator::start_all_to_all(std::vector<at::Tensor> inputs) {
  return run_on_parts(OpKind::kAllToAll, "all_to_all", [this, inputs](std::vector<at::Tensor>& result) {
    result = flat_->all_to_all(inputs);
  });
}

WorkPtr HierCommunicator::start_barrier() {
  return run_on_parts(OpKind::kBarrier, "barrier", [this](std::vector<at::Tensor>&) { flat_->barrier(); });
}

// ---- point to point: shared memory to a peer on this host

int HierCommunicator::local_rank_of(int peer) const {
  return placement_.host[peer] == placement_.host[rank_] ? placement_.local[peer] : -1;
}

WorkPtr HierCommunicator::start_send(const at::Tensor& tensor, int dst, int tag) {
  const int l = local_rank_of(dst);
  return l >= 0 ? local_->isend(tensor, l, tag) : flat_->isend(tensor, dst, tag);
}

WorkPtr HierCommunicator::start_recv(at::Tensor tensor, int src, int tag) {
  const int l = local_rank_of(src);
  return l >= 0 ? local_->irecv(tensor, l, tag) : flat_->irecv(tensor, src, tag);
}

WorkPtr HierCommunicator::start_recv_any(int src, int tag) {
  const int l = local_rank_of(src);
  return l >= 0 ? local_->irecv_any(l, tag) : flat_->irecv_any(src, tag);
}

std::shared_ptr<Communicator> HierCommunicator::split(int color, int key, const std::string& label) {
  return split_communicator(*this, process_, prefix_, splits_++, color, key, label);
}

}  // namespace hier_backend
}  // namespace comm
}  // namespace meshtrain
