// Ring attention over a cp group: see the header for the layout and the
// ring. The tiles are nn::flash_forward / flash_backward with global
// positions; only keys and values (forward) and keys, values and their
// gradients (backward) travel.
#include "meshtrain/cp.h"

#include <torch/autograd.h>

#include "meshtrain/util.h"

namespace meshtrain {
namespace cp {

ChunkLayout chunk_layout(int64_t seq_len, int cp_size, int cp_rank) {
  MESHTRAIN_CHECK(cp_size >= 1 && seq_len % (2 * cp_size) == 0, "--cp ", cp_size, " cuts each sequence into 2 x ",
                  cp_size, " = ", 2 * cp_size, " chunks, which does not divide --seq-len ", seq_len,
                  "; choose a sequence length that is a multiple of ", 2 * cp_size);
  const int64_t chunk = seq_len / (2 * cp_size);
  return {chunk, cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk};
}

at::Tensor local_positions(int64_t seq_len, int cp_size, int cp_rank) {
  const ChunkLayout l = chunk_layout(seq_len, cp_size, cp_rank);
  const auto longs = at::TensorOptions().dtype(at::kLong);
  return at::cat({at::arange(l.first, l.first + l.chunk, longs), at::arange(l.second, l.second + l.chunk, longs)});
}

at::Tensor shard_sequence(const at::Tensor& x, int64_t dim, int cp_size, int cp_rank) {
  const ChunkLayout l = chunk_layout(x.size(dim), cp_size, cp_rank);
  return at::cat({x.narrow(dim, l.first, l.chunk), x.narrow(dim, l.second, l.chunk)}, dim);
}

at::Tensor unshard_sequence(const std::vector<at::Tensor>& parts, int64_t dim) {
  const int n = static_cast<int>(parts.size());
  const int64_t chunk = parts.at(0).size(dim) / 2;
  std::vector<at::Tensor> chunks(2 * n);
  for (int r = 0; r < n; ++r) {
    chunks[r] = parts[r].narrow(dim, 0, chunk);
    chunks[2 * n - 1 - r] = parts[r].narrow(dim, chunk, chunk);
  }
  return at::cat(chunks, dim);
}

namespace {

using nn::AttentionPart;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Tags of the two kinds of message on the cp group (pairs arrive in order).
constexpr int kKeyValueTag = 1, kGradientTag = 2;

// Calls f(query chunk a, its position, key chunk b, its position) for the
// pairs of this rank's chunks and `keys`'s where some key is visible.
template <typename F>
void for_visible_pairs(const ChunkLayout& queries, const ChunkLayout& keys, F f) {
  const int64_t q_pos[2] = {queries.first, queries.second}, k_pos[2] = {keys.first, keys.second};
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      if (k_pos[b] <= q_pos[a] + queries.chunk - 1) f(a, q_pos[a], b, k_pos[b]);
}

// One hop of the ring, started: `t` goes to the next rank while the
// previous rank's tensor of the same shape arrives in `incoming`.
struct Hop {
  comm::WorkPtr send, recv;
  at::Tensor incoming;
  Hop(comm::Communicator& c, const at::Tensor& t, int tag) : incoming(at::empty_like(t)) {
    const int n = c.size(), r = c.rank();
    recv = c.irecv(incoming, (r + n - 1) % n, tag);
    send = c.isend(t, (r + 1) % n, tag);
  }
  at::Tensor finish() {
    recv->wait();
    send->wait();
    return incoming;
  }
};

comm::Communicator& comm_of(AutogradContext* ctx) {
  return *reinterpret_cast<comm::Communicator*>(ctx->saved_data["comm"].toInt());
}

// Keeps q (kernel layout), this rank's keys and values, the output ([B, T, H, d]) and the log-sum-exp.
struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t comm_handle, int64_t query_block, int64_t key_block) {
    comm::Communicator& c = *reinterpret_cast<comm::Communicator*>(comm_handle);
    const nn::FlashOptions options{query_block, key_block};
    const int n = c.size(), r = c.rank();
    const at::Tensor q5 = nn::to_kernel_layout(q, k.size(1));
    const ChunkLayout mine = chunk_layout(q.size(2) * n, n, r);
    const int64_t chunk = mine.chunk;
    at::Tensor kv = at::stack({k, v});  // one message per hop
    const at::Tensor own_kv = kv;
    AttentionPart acc[2];
    for (int i = 0; i < n; ++i) {
      std::unique_ptr<Hop> hop = i + 1 < n ? std::make_unique<Hop>(c, kv, kKeyValueTag) : nullptr;
      const ChunkLayout theirs = chunk_layout(q.size(2) * n, n, (r + n - i) % n);
      for_visible_pairs(mine, theirs, [&](int a, int64_t q_pos, int b, int64_t k_pos) {
        AttentionPart part = nn::flash_forward(q5.narrow(2, a * chunk, chunk), kv[0].narrow(2, b * chunk, chunk),
                                                   kv[1].narrow(2, b * chunk, chunk), q_pos, k_pos, options);
        acc[a] = acc[a].out.defined() ? nn::merge_attention(acc[a], part) : part;
      });
      if (hop) kv = hop->finish();
    }
    // Every query chunk saw its own (diagonal) chunk at step 0: both are defined.
    // The output is kept as [B, T, KV, G, d], the layout the models' output
    // projection reads (as flash_attention keeps it): the projection's input is
    // then a view of it, not a second copy.
    const at::Tensor out_bthd =
        at::cat({acc[0].out, acc[1].out}, 2).to(q.scalar_type()).permute({0, 2, 1, 3, 4}).contiguous();
    const at::Tensor lse = at::cat({acc[0].lse, acc[1].lse}, 2);
    ctx->save_for_backward({q5, own_kv, out_bthd, lse});
    ctx->saved_data["comm"] = comm_handle;
    ctx->saved_data["query_block"] = query_block;
    ctx->saved_data["key_block"] = key_block;
    return out_bthd.view({q.size(0), q.size(2), q.size(1), q.size(3)}).transpose(1, 2);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::Communicator& c = comm_of(ctx);
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q5 = saved[0], &lse = saved[3];
    const at::Tensor out = saved[2].permute({0, 2, 1, 3, 4});  // [B, KV, T, G, d], the kernel's layout
    at::Tensor kv = saved[1];
    const nn::FlashOptions options{ctx->saved_data["query_block"].toInt(), ctx->saved_data["key_block"].toInt()};
    const int n = c.size(), r = c.rank();
    const int64_t seq_len = q5.size(2) * n;
    const ChunkLayout mine = chunk_layout(seq_len, n, r);
    const int64_t chunk = mine.chunk;
    const at::Tensor dout = nn::to_kernel_layout(grads[0], kv.size(2));
    at::Tensor dq = at::zeros(q5.sizes(), out.options().dtype(lse.scalar_type()));
    at::Tensor dkv = at::zeros(kv.sizes(), dq.options());  // the gradient of the keys and values held now
    for (int i = 0; i < n; ++i) {
      std::unique_ptr<Hop> hop = i + 1 < n ? std::make_unique<Hop>(c, kv, kKeyValueTag) : nullptr;
      const ChunkLayout theirs = chunk_layout(seq_len, n, (r + n - i) % n);
      for_visible_pairs(mine, theirs, [&](int a, int64_t q_pos, int b, int64_t k_pos) {
        auto q_part = [&](const at::Tensor& t) { return t.narrow(2, a * chunk, chunk); };
        auto k_part = [&](const at::Tensor& t) { return t.narrow(2, b * chunk, chunk); };
        const nn::AttentionGrads g = nn::flash_backward(
            q_part(q5), k_part(kv[0]), k_part(kv[1]), q_part(out), q_part(lse), q_part(dout), q_pos, k_pos, options);
        q_part(dq).add_(g.dq);
        k_part(dkv[0]).add_(g.dk);
        k_part(dkv[1]).add_(g.dv);
      });
      // The gradient follows its keys and values: after n hops it is back with their owner.
      if (n > 1) dkv = Hop(c, dkv, kGradientTag).finish();
      if (hop) kv = hop->finish();
    }
    return {nn::from_kernel_layout(dq).to(q5.scalar_type()), dkv[0].to(kv.scalar_type()),
            dkv[1].to(kv.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const comm::CommPtr& cp,
                          const nn::FlashOptions& options) {
  if (!cp || cp->size() == 1) return nn::flash_attention(q, k, v, options);
  MESHTRAIN_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(1) % k.size(1) == 0 &&
                      q.size(2) == k.size(2) && q.size(2) % 2 == 0 && q.size(0) == k.size(0) &&
                      q.size(3) == k.size(3),
                  "ring_attention: q ", q.sizes(), " over k ", k.sizes(), " and v ", v.sizes(),
                  "; expected this rank's two chunks: q [B, H, 2c, d], k and v [B, KV, 2c, d], KV dividing H");
  return RingAttentionFunction::apply(q, k, v, reinterpret_cast<int64_t>(cp.get()), options.query_block,
                                      options.key_block);
}

}  // namespace cp
}  // namespace meshtrain
