// Rows through the Communicator's all_to_all, with a backward that sends the
// gradients back (the same exchange with the counts swapped).
#include "ep/all_to_all.h"

#include <torch/autograd.h>

#include "meshtrain/util.h"

namespace meshtrain {
namespace ep {

ExpertSlice expert_slice(int64_t experts, int ep_size, int ep_rank) {
  MESHTRAIN_CHECK(ep_size >= 1 && experts % ep_size == 0, "--ep ", ep_size, " does not divide --experts ", experts,
                  " (each ep rank holds experts / ep of them); choose --ep dividing ", experts);
  const int64_t count = experts / ep_size;
  return {ep_rank * count, count};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Sends rows cut by `send`; returns the received rows and their counts.
Exchanged exchange(comm::Communicator& c, const at::Tensor& rows, const std::vector<int64_t>& send) {
  const std::vector<at::Tensor> received = c.all_to_all(rows.split_with_sizes(send, 0));
  Exchanged out;
  for (const at::Tensor& r : received) out.counts.push_back(r.size(0));
  out.rows = at::cat(received, 0);
  return out;
}

// `received` (not a tensor, so autograd passes it through) gets the counts.
struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows, std::vector<int64_t> send, int64_t handle,
                            std::vector<int64_t>* received) {
    comm::Communicator& c = *reinterpret_cast<comm::Communicator*>(handle);
    Exchanged e = exchange(c, rows.contiguous(), send);
    ctx->saved_data["comm"] = handle;
    ctx->saved_data["received"] = e.counts;
    *received = e.counts;
    return e.rows;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::Communicator& c = *reinterpret_cast<comm::Communicator*>(ctx->saved_data["comm"].toInt());
    const std::vector<int64_t> received = ctx->saved_data["received"].toIntVector();
    return {exchange(c, grads[0].contiguous(), received).rows, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

Exchanged all_to_all_rows(const at::Tensor& rows, const std::vector<int64_t>& send_counts, const comm::CommPtr& ep) {
  MESHTRAIN_CHECK(ep && static_cast<int>(send_counts.size()) == ep->size(), "all_to_all_rows: ", send_counts.size(),
                  " counts for ", ep ? ep->size() : 0, " ranks; give one count per rank of the ep group");
  int64_t total = 0;
  for (int64_t n : send_counts) total += n;
  MESHTRAIN_CHECK(total == rows.size(0), "all_to_all_rows: the counts add to ", total, " rows; rows has ",
                  rows.size(0));
  Exchanged out;
  out.rows = AllToAllRows::apply(rows, send_counts, reinterpret_cast<int64_t>(ep.get()), &out.counts);
  return out;
}

}  // namespace ep
}  // namespace meshtrain
