#pragma once
// HierCommunicator: members on several hosts, the same number L >= 2 on each.
//
// all_reduce of S bytes (from CommOptions-independent threshold
// MESHTRAIN_HIER_MIN_KB, default 64 KiB):
//   1. reduce-scatter inside each host (shared memory): local rank l holds slice l of S/L;
//   2. all-reduce of slice l across the hosts, among the ranks of local index l
//      (Gloo over TCP): L streams at once, one per local rank;
//   3. all-gather inside each host (shared memory).
// Each host sends 2(H-1)/H * S across hosts in all (H hosts), where a flat
// ring over all n ranks sends ~2(n-1)/n * S through each host boundary it
// crosses, and every hop of it pays TCP.
//
// reduce_scatter, all_gather and broadcast from the same threshold (ZeRO's
// collectives, the first parameters' broadcast) nest the same way, see Note
// [Nested reduce-scatter and all-gather] in communicator.cpp: across hosts
// (H-1) S in all instead of the flat (n-L) S, L times fewer. Smaller ones and
// the rest run on a flat Gloo communicator of all members; point-to-point
// messages to a peer on the same host go through shared memory.
//
// Traffic: the rows of this communicator add up its parts' bytes, attributed
// to the operation that moved them; inter_host_* are the bytes on the Gloo links.

#include <memory>
#include <string>
#include <vector>

#include "../header.h"
#include "../queued.h"

namespace meshtrain {
namespace comm {

class Process;

namespace hier_backend {

// Where each member sits: host index (hosts in order of their first member)
// and local index among its host's members (in rank order). Pure.
struct Placement {
  std::vector<int> host;
  std::vector<int> local;
  int hosts = 0;
};
Placement place(const std::vector<std::string>& member_hosts);
// The members grouped by local index, each group in host order: the order
// in which the nested reduce-scatter and all-gather lay out the segments, so
// that local rank l's slice (its group's segments) is contiguous. Pure.
std::vector<int> by_local_index(const Placement& p);

class HierCommunicator final : public QueuedCommunicator {
 public:
  HierCommunicator(std::shared_ptr<Process> process, std::vector<int> global_ranks, int rank,
                   const std::string& prefix, CommOptions options);
  ~HierCommunicator() override;

  std::string backend() const override { return "hierarchical"; }
  std::string tuning() const override { return local_ ? local_->tuning() : ""; }

  std::shared_ptr<Communicator> split(int color, int key, const std::string& label) override;

 protected:
  WorkPtr start_send(const at::Tensor& tensor, int dst, int tag) override;
  WorkPtr start_recv(at::Tensor tensor, int src, int tag) override;
  WorkPtr start_recv_any(int src, int tag) override;

  WorkPtr start_broadcast(at::Tensor tensor, int root) override;
  WorkPtr start_all_reduce(at::Tensor tensor, ReduceOp op) override;
  WorkPtr start_reduce(at::Tensor tensor, int root, ReduceOp op) override;
  WorkPtr start_all_gather(const at::Tensor& input, at::Tensor output) override;
  WorkPtr start_reduce_scatter(const at::Tensor& input, ReduceOp op, at::Tensor output,
                               std::vector<int64_t> counts) override;
  WorkPtr start_gather(const at::Tensor& input, int root) override;
  WorkPtr start_scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root) override;
  WorkPtr start_all_to_all(std::vector<at::Tensor> inputs) override;
  WorkPtr start_barrier() override;

  Traffic traffic() const override;
  void reset_traffic() override;

 private:
  // Runs `body` (this op's work on the parts) and counts what the parts moved
  // meanwhile as operation `kind` of this communicator.
  WorkPtr run_on_parts(OpKind kind, const char* name, std::function<void(std::vector<at::Tensor>&)> body);
  Traffic parts_traffic() const;
  // An in-place collective on `tensor`: `on_flat` below MESHTRAIN_HIER_MIN_KB,
  // else `nested` on a contiguous flat copy or view, copied back when needed.
  void in_place(const at::Tensor& tensor, const std::function<void()>& on_flat,
                const std::function<void(at::Tensor&)>& nested);
  void hierarchical_all_reduce(at::Tensor& flat, ReduceOp op);
  void hierarchical_broadcast(at::Tensor& flat, int root);
  at::Tensor hierarchical_reduce_scatter(const at::Tensor& flat, ReduceOp op, at::Tensor out,
                                         const std::vector<int64_t>& counts);
  std::vector<at::Tensor> hierarchical_all_gather(const at::Tensor& input, at::Tensor output);
  // Every member's header for this op, all-gathered on the flat group (counted
  // as verification); raises MismatchError where they disagree.
  std::vector<Header> headers_on_flat(const Header& mine, const char* op, bool same_shape);
  // A peer on this host: its rank in local_, else -1.
  int local_rank_of(int peer) const;

  std::shared_ptr<Process> process_;
  std::string prefix_;
  int splits_ = 0;
  Placement placement_;
  std::vector<int> by_local_;  // by_local_index(placement_): the nested collectives' layout
  int64_t min_bytes_;
  std::shared_ptr<Communicator> local_, cross_, flat_;
  OpTraffic verified_;  // what the running op's argument check moved (counted as verification)
};

}  // namespace hier_backend
}  // namespace comm
}  // namespace meshtrain
