// The tree-order communicator (Note [Tree-order sums] in comm/tree_order.h).
#include "comm/tree_order.h"

#include <ATen/ATen.h>

#include "meshtrain/util.h"
#include "util/shard.h"

namespace meshtrain {
namespace comm {

namespace {

bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

class DoneWork : public Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> result) { result_ = std::move(result); }
  void wait() override {}
  bool is_completed() override { return true; }
};

class TreeOrderCommunicator : public Communicator {
 public:
  explicit TreeOrderCommunicator(CommPtr inner) : inner_(std::move(inner)) {
    MESHTRAIN_CHECK(power_of_two(inner_->size()), "comm::tree_order: communicator '", inner_->label(), "' has ",
                    inner_->size(), " ranks; sums in tree order need a power of two (1, 2, 4, 8, ...)");
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::vector<int>& global_ranks() const override { return inner_->global_ranks(); }
  const CommOptions& options() const override { return inner_->options(); }
  std::string backend() const override { return inner_->backend() + "+tree-order"; }

  std::shared_ptr<Communicator> split(int color, int key, const std::string& label) override {
    return inner_->split(color, key, label);
  }
  Traffic traffic() const override { return inner_->traffic(); }
  void reset_traffic() override { inner_->reset_traffic(); }

 protected:
  // The arguments are checked already (Communicator's public calls; checks.h).
  WorkPtr start_send(const at::Tensor& t, int dst, int tag) override { return inner_->isend(t, dst, tag); }
  WorkPtr start_recv(at::Tensor t, int src, int tag) override { return inner_->irecv(std::move(t), src, tag); }
  WorkPtr start_recv_any(int src, int tag) override { return inner_->irecv_any(src, tag); }
  WorkPtr start_broadcast(at::Tensor t, int root) override { return inner_->broadcast_async(std::move(t), root); }
  WorkPtr start_all_gather(const at::Tensor& input, at::Tensor output) override {
    return inner_->all_gather_async(input, std::move(output));
  }
  WorkPtr start_gather(const at::Tensor& input, int root) override { return inner_->gather_async(input, root); }
  WorkPtr start_scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root) override {
    return inner_->scatter_async(std::move(output), std::move(inputs), root);
  }
  WorkPtr start_all_to_all(std::vector<at::Tensor> inputs) override {
    return inner_->all_to_all_async(std::move(inputs));
  }
  WorkPtr start_barrier() override { return inner_->barrier_async(); }

  WorkPtr start_reduce_scatter(const at::Tensor& input, ReduceOp op, at::Tensor output,
                               std::vector<int64_t> counts) override {
    if (!ordered(op, input)) return inner_->reduce_scatter_async(input, op, std::move(output), std::move(counts));
    at::Tensor shard = tree_reduce_scatter(input, op, counts);
    if (output.defined()) {
      output.copy_(shard.view(output.sizes()));
      shard = output;
    }
    return std::make_shared<DoneWork>(std::vector<at::Tensor>{shard});
  }

  WorkPtr start_all_reduce(at::Tensor tensor, ReduceOp op) override {
    if (!ordered(op, tensor)) return inner_->all_reduce_async(std::move(tensor), op);
    const at::Tensor shard = tree_reduce_scatter(tensor, op, {});
    at::Tensor flat = tensor.is_contiguous() ? tensor.view({-1}) : at::empty({tensor.numel()}, tensor.options());
    inner_->all_gather_async(shard, flat)->wait();
    if (!tensor.is_contiguous()) tensor.copy_(flat.view_as(tensor));
    return std::make_shared<DoneWork>(std::vector<at::Tensor>{tensor});
  }

  WorkPtr start_reduce(at::Tensor tensor, int root, ReduceOp op) override {
    if (!ordered(op, tensor)) return inner_->reduce_async(std::move(tensor), root, op);
    at::Tensor sum = tensor.clone();
    start_all_reduce(sum, op);
    if (rank() == root) tensor.copy_(sum);
    return std::make_shared<DoneWork>(std::vector<at::Tensor>{tensor});
  }

 private:
  static bool ordered(ReduceOp op, const at::Tensor& t) {
    return (op == ReduceOp::kSum || op == ReduceOp::kAvg) && t.defined() && t.is_floating_point();
  }

  // This rank's shard of the sum: every rank's piece of it, added in the tree.
  at::Tensor tree_reduce_scatter(const at::Tensor& input, ReduceOp op, std::vector<int64_t> counts) {
    const int n = size();
    if (counts.empty()) counts = shard_sizes(input.numel(), n);  // all_reduce's shards
    const at::Tensor flat = input.contiguous().view({-1});
    std::vector<at::Tensor> pieces;
    int64_t offset = 0;
    for (int64_t c : counts) {
      pieces.push_back(flat.narrow(0, offset, c));
      offset += c;
    }
    std::vector<at::Tensor> got = inner_->all_to_all(pieces);
    for (at::Tensor& g : got)
      if (g.is_alias_of(flat)) g = g.clone();  // this rank's own piece: the input stays as it was
    at::Tensor sum = sum_in_tree_order(std::move(got)).reshape({-1});
    if (sum.is_view()) sum = sum.clone();  // a received piece may view a larger buffer: the shard owns its memory
    if (op == ReduceOp::kAvg) sum.div_(n);  // a power of two: exact
    return sum;
  }

  CommPtr inner_;
};

}  // namespace

at::Tensor sum_in_tree_order(std::vector<at::Tensor> pieces) {
  const int n = static_cast<int>(pieces.size());
  MESHTRAIN_CHECK(power_of_two(n), "sum_in_tree_order: ", n, " pieces; the tree needs a power of two");
  for (int step = 1; step < n; step *= 2)
    for (int i = 0; i + step < n; i += 2 * step) pieces[i].add_(pieces[i + step]);
  return pieces[0];
}

CommPtr tree_order(CommPtr inner) {
  MESHTRAIN_CHECK(inner != nullptr, "comm::tree_order: no communicator");
  return std::make_shared<TreeOrderCommunicator>(std::move(inner));
}

}  // namespace comm
}  // namespace meshtrain
