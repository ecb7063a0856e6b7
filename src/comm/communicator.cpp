#include "meshtrain/comm.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "meshtrain/util.h"
#include "checks.h"
#include "queued.h"

namespace meshtrain {
namespace comm {

namespace {

at::Tensor bytes_of(const std::string& s) {
  at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

std::vector<std::string> strings_of(const std::vector<at::Tensor>& all) {
  std::vector<std::string> out;
  for (const auto& t : all) out.emplace_back(static_cast<const char*>(t.data_ptr()), t.numel());
  return out;
}

}  // namespace

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  return strings_of(comm.all_gather(bytes_of(mine)));
}

std::vector<std::string> gather_strings(Communicator& comm, const std::string& mine, int root) {
  return strings_of(comm.gather(bytes_of(mine), root));
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kProduct: return "product";
  }
  return "?";
}

std::shared_ptr<Communicator> Communicator::split(const std::vector<int>& ranks,
                                                  const std::string& label) {
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  MESHTRAIN_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                  "split: rank list has duplicates");
  MESHTRAIN_CHECK(!ranks.empty() && sorted.front() >= 0 && sorted.back() < size(),
                  "split: ranks must be in [0, ", size(), ") of communicator '", this->label(),
                  "'");
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  const bool member = it != ranks.end();
  const int key = member ? static_cast<int>(it - ranks.begin()) : 0;
  return split(member ? 0 : -1, key, label);
}

// ---- the operations: the arguments checked once, here, for every backend (checks.h)

WorkPtr Communicator::isend(const at::Tensor& tensor, int dst, int tag) {
  check_p2p(*this, tensor, dst, tag, "send");
  return start_send(tensor, dst, tag);
}

WorkPtr Communicator::irecv(at::Tensor tensor, int src, int tag) {
  check_p2p(*this, tensor, src, tag, "recv");
  return start_recv(std::move(tensor), src, tag);
}

WorkPtr Communicator::irecv_any(int src, int tag) {
  check_peer(*this, src, "recv");
  return start_recv_any(src, tag);
}

WorkPtr Communicator::broadcast_async(at::Tensor tensor, int root) {
  check_tensor(*this, tensor, "broadcast", "tensor");
  check_root(*this, root, "broadcast");
  return start_broadcast(std::move(tensor), root);
}

WorkPtr Communicator::all_reduce_async(at::Tensor tensor, ReduceOp op) {
  check_tensor(*this, tensor, "all_reduce", "tensor");
  check_reduce_op(*this, op, tensor, "all_reduce");
  return start_all_reduce(std::move(tensor), op);
}

WorkPtr Communicator::reduce_async(at::Tensor tensor, int root, ReduceOp op) {
  check_tensor(*this, tensor, "reduce", "tensor");
  check_root(*this, root, "reduce");
  check_reduce_op(*this, op, tensor, "reduce");
  return start_reduce(std::move(tensor), root, op);
}

WorkPtr Communicator::all_gather_async(const at::Tensor& input, at::Tensor output) {
  check_all_gather(*this, input, output);
  return start_all_gather(input, std::move(output));
}

WorkPtr Communicator::reduce_scatter_async(const at::Tensor& input, ReduceOp op, at::Tensor output,
                                           std::vector<int64_t> counts) {
  check_reduce_scatter(*this, input, output, counts);
  check_reduce_op(*this, op, input, "reduce_scatter");
  return start_reduce_scatter(input, op, std::move(output), std::move(counts));
}

WorkPtr Communicator::gather_async(const at::Tensor& input, int root) {
  check_tensor(*this, input, "gather", "input");
  check_root(*this, root, "gather");
  return start_gather(input, root);
}

WorkPtr Communicator::scatter_async(at::Tensor output, std::vector<at::Tensor> inputs, int root) {
  check_scatter(*this, output, inputs, root);
  return start_scatter(std::move(output), std::move(inputs), root);
}

WorkPtr Communicator::all_to_all_async(std::vector<at::Tensor> inputs) {
  check_all_to_all(*this, inputs);
  return start_all_to_all(std::move(inputs));
}

WorkPtr Communicator::barrier_async() { return start_barrier(); }

// ---- synchronous helpers

void Communicator::send(const at::Tensor& tensor, int dst, int tag) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  isend(tensor, dst, tag)->wait();
}

void Communicator::recv(at::Tensor tensor, int src, int tag) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  irecv(std::move(tensor), src, tag)->wait();
}

at::Tensor Communicator::recv_any(int src, int tag) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  auto work = irecv_any(src, tag);
  work->wait();
  return work->result().at(0);
}

void Communicator::broadcast(at::Tensor tensor, int root) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  broadcast_async(std::move(tensor), root)->wait();
}

void Communicator::all_reduce(at::Tensor tensor, ReduceOp op) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  all_reduce_async(std::move(tensor), op)->wait();
}

void Communicator::reduce(at::Tensor tensor, int root, ReduceOp op) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  reduce_async(std::move(tensor), root, op)->wait();
}

std::vector<at::Tensor> Communicator::all_gather(const at::Tensor& input) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  auto work = all_gather_async(input);
  work->wait();
  const auto& r = work->result();
  return std::vector<at::Tensor>(r.begin() + 1, r.end());
}

void Communicator::all_gather_into(at::Tensor output, const at::Tensor& input) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  MESHTRAIN_CHECK(output.numel() == input.numel() * size(), "all_gather_into on '", label(),
                  "': output has ", output.numel(), " elements, expected size() * input = ",
                  size(), " * ", input.numel());
  all_gather_async(input, std::move(output))->wait();
}

at::Tensor Communicator::all_gather_flat(const at::Tensor& input) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  auto work = all_gather_async(input);
  work->wait();
  return work->result().at(0);
}

at::Tensor Communicator::reduce_scatter(const at::Tensor& input, ReduceOp op,
                                        std::vector<int64_t> counts) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  auto work = reduce_scatter_async(input, op, at::Tensor(), std::move(counts));
  work->wait();
  return work->result().at(0);
}

void Communicator::reduce_scatter_into(at::Tensor output, const at::Tensor& input, ReduceOp op) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  MESHTRAIN_CHECK(input.numel() == output.numel() * size(), "reduce_scatter_into on '", label(),
                  "': input has ", input.numel(), " elements, expected size() * output = ",
                  size(), " * ", output.numel());
  std::vector<int64_t> counts(size(), output.numel());
  reduce_scatter_async(input, op, std::move(output), std::move(counts))->wait();
}

std::vector<at::Tensor> Communicator::gather(const at::Tensor& input, int root) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  auto work = gather_async(input, root);
  work->wait();
  return work->result();
}

void Communicator::scatter(at::Tensor output, const std::vector<at::Tensor>& inputs, int root) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  scatter_async(std::move(output), inputs, root)->wait();
}

std::vector<at::Tensor> Communicator::all_to_all(const std::vector<at::Tensor>& inputs) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  auto work = all_to_all_async(inputs);
  work->wait();
  return work->result();
}

void Communicator::all_to_all_single(at::Tensor output, const at::Tensor& input) {
  SyncCall sync;  // See Note [Synchronous calls] in queued.h
  const int n = size();
  MESHTRAIN_CHECK(input.dim() > 0 && input.size(0) % n == 0, "all_to_all_single on '", label(),
                  "': input dim 0 (", input.dim() > 0 ? input.size(0) : 0,
                  ") must divide by the communicator size ", n);
  MESHTRAIN_CHECK(output.sizes() == input.sizes() && output.scalar_type() == input.scalar_type(),
                  "all_to_all_single on '", label(),
                  "': output must have the input's shape and dtype");
  auto results = all_to_all(input.chunk(n, 0));
  for (int r = 0; r < n; ++r) output.narrow(0, r * (input.size(0) / n), input.size(0) / n).copy_(results[r]);
}

void Communicator::barrier() { barrier_async()->wait(); }
  SyncCall sync;  // See Note [Synchronous calls] in queued.h

}  // namespace comm
}  // namespace meshtrain
