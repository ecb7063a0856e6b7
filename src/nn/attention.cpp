// Memory-efficient causal attention: see the header for the math. Tiles are
// plain ATen matmuls over [B, KV] batches; a tile of queries is
// query_block x G rows (every query head that reads the same key head), so
// grouped-query attention needs no copy of k and v and its key/value
// gradients sum over the group inside the matmul.
#include "meshtrain/nn.h"

#include <torch/autograd.h>

#include <cmath>
#include <limits>

#include "meshtrain/util.h"

namespace meshtrain {
namespace nn {

AttentionKernel parse_attention_kernel(const std::string& value) {
  if (value == "auto") return AttentionKernel::kAuto;
  if (value == "eager") return AttentionKernel::kEager;
  if (value == "flash") return AttentionKernel::kFlash;
  throw ConfigError("--attention " + value + " is not a kernel; choose auto (flash from " +
                    std::to_string(kFlashFromSeqLen) + " positions), eager or flash");
}

std::string attention_kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::kAuto: return "auto";
    case AttentionKernel::kEager: return "eager";
    case AttentionKernel::kFlash: return "flash";
  }
  return "?";
}

AttentionKernel resolve_attention_kernel(AttentionKernel kernel, int64_t key_length) {
  if (kernel != AttentionKernel::kAuto) return kernel;
  return key_length >= kFlashFromSeqLen ? AttentionKernel::kFlash : AttentionKernel::kEager;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Statistics and accumulators: fp32 for 16-bit inputs (as FlashAttention), fp64 for fp64.
at::ScalarType compute_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Which of a tile's scores lie in the future: row r is the query at position
// q_pos + r / groups, column c the key at k_pos + c.
at::Tensor future_mask(int64_t queries, int64_t groups, int64_t keys, int64_t q_pos, int64_t k_pos) {
  const auto longs = at::TensorOptions().dtype(at::kLong);
  const at::Tensor query_pos = at::arange(queries, longs).repeat_interleave(groups).add_(q_pos).unsqueeze(1);
  const at::Tensor key_pos = at::arange(keys, longs).add_(k_pos).unsqueeze(0);
  return key_pos > query_pos;
}

// Scaled scores of a tile, [B, KV, rows, keys], future entries -inf.
at::Tensor tile_scores(const at::Tensor& q_rows, const at::Tensor& k_tile, double scale, int64_t queries,
                       int64_t groups, int64_t q_pos, int64_t k_pos) {
  at::Tensor s = at::matmul(q_rows, k_tile.transpose(-2, -1)).mul_(scale);
  const int64_t keys = k_tile.size(2);
  if (k_pos + keys - 1 > q_pos) s.masked_fill_(future_mask(queries, groups, keys, q_pos, k_pos), -kInf);
  return s;
}

// A tile of queries as one matrix per [B, KV]: [B, KV, n * G, d] (a view: t is contiguous).
at::Tensor query_rows(const at::Tensor& t, int64_t first, int64_t n) {
  return t.narrow(2, first, n).view({t.size(0), t.size(1), n * t.size(3), t.size(4)});
}

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), Tq = q.size(2), Tk = k.size(2), d = q.size(3);
  MESHTRAIN_CHECK(heads % kv_heads == 0 && Tq <= Tk, "causal_attention: ", heads, " query heads over ", kv_heads,
                  " key/value heads, ", Tq, " queries over ", Tk, " keys");
  at::Tensor keys = k, values = v;
  if (kv_heads != heads) {  // each key/value head serves heads / kv_heads consecutive query heads
    keys = k.repeat_interleave(heads / kv_heads, 1);
    values = v.repeat_interleave(heads / kv_heads, 1);
  }
  at::Tensor scores = at::matmul(q, keys.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
  // Query i sits at position Tk - Tq + i and sees keys up to it.
  const at::Tensor future = at::ones({Tq, Tk}, at::TensorOptions().dtype(at::kBool)).triu(Tk - Tq + 1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  return at::matmul(at::softmax(scores, -1), values);
}

AttentionPart flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
                            int64_t k_start, const FlashOptions& options) {
  const int64_t B = q.size(0), KV = q.size(1), Tq = q.size(2), G = q.size(3), d = q.size(4), Tk = k.size(2);
  const at::ScalarType type = compute_type(q);
  const at::Tensor qc = q.to(type).contiguous(), kc = k.to(type).contiguous(), vc = v.to(type).contiguous();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  at::Tensor out = at::empty({B, KV, Tq, G, d}, qc.options());
  at::Tensor lse = at::empty({B, KV, Tq, G}, qc.options());
  for (int64_t qs = 0; qs < Tq; qs += options.query_block) {
    const int64_t n = std::min(options.query_block, Tq - qs), q_pos = q_start + qs;
    const at::Tensor rows = query_rows(qc, qs, n);
    at::Tensor m = at::full({B, KV, n * G, 1}, -kInf, qc.options());
    at::Tensor l = at::zeros({B, KV, n * G, 1}, qc.options());
    at::Tensor acc = at::zeros({B, KV, n * G, d}, qc.options());
    for (int64_t ks = 0; ks < Tk && k_start + ks <= q_pos + n - 1; ks += options.key_block) {
      const int64_t nk = std::min(options.key_block, Tk - ks);
      at::Tensor p = tile_scores(rows, kc.narrow(2, ks, nk), scale, n, G, q_pos, k_start + ks);
      const at::Tensor m_new = at::maximum(m, p.amax(-1, /*keepdim=*/true));
      const at::Tensor shift = m_new.masked_fill(m_new == -kInf, 0);  // rows that have seen no key yet
      p.sub_(shift).exp_();
      const at::Tensor rescale = (m - shift).exp_();
      l.mul_(rescale).add_(p.sum(-1, /*keepdim=*/true));
      acc.mul_(rescale).add_(at::matmul(p, vc.narrow(2, ks, nk)));
      m = m_new;
    }
    out.narrow(2, qs, n).copy_(acc.div_(l.masked_fill(l == 0, 1)).view({B, KV, n, G, d}));
    lse.narrow(2, qs, n).copy_(m.add_(l.log()).view({B, KV, n, G}));
  }
  return {out, lse};
}

AttentionGrads flash_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                              const at::Tensor& lse, const at::Tensor& dout, int64_t q_start, int64_t k_start,
                              const FlashOptions& options) {
  const int64_t Tq = q.size(2), G = q.size(3), d = q.size(4), Tk = k.size(2);
  const at::ScalarType type = compute_type(q);
  const at::Tensor qc = q.to(type).contiguous(), kc = k.to(type).contiguous(), vc = v.to(type).contiguous();
  const at::Tensor dc = dout.to(type).contiguous();
  // D_i = sum_j P_ij dP_ij = dout_i . out_i (FlashAttention's backward, eq. 4).
  const at::Tensor delta = (dc * out.to(type)).sum(-1).unsqueeze(-1).contiguous();   // [B, KV, Tq, G, 1]
  const at::Tensor lse_c = lse.to(type).masked_fill(lse == -kInf, kInf).unsqueeze(-1).contiguous();  // p = 0
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  at::Tensor dq = at::zeros_like(qc), dk = at::zeros_like(kc), dv = at::zeros_like(vc);
  for (int64_t ks = 0; ks < Tk; ks += options.key_block) {
    const int64_t nk = std::min(options.key_block, Tk - ks);
    const at::Tensor k_tile = kc.narrow(2, ks, nk), v_tile = vc.narrow(2, ks, nk);
    at::Tensor dk_tile = dk.narrow(2, ks, nk), dv_tile = dv.narrow(2, ks, nk);
    for (int64_t qs = 0; qs < Tq; qs += options.query_block) {
      const int64_t n = std::min(options.query_block, Tq - qs), q_pos = q_start + qs;
      if (k_start + ks > q_pos + n - 1) continue;  // every key of the tile is after every query
      const at::Tensor rows = query_rows(qc, qs, n), d_rows = query_rows(dc, qs, n);
      at::Tensor p = tile_scores(rows, k_tile, scale, n, G, q_pos, k_start + ks);
      p.sub_(query_rows(lse_c, qs, n)).exp_();
      dv_tile.add_(at::matmul(p.transpose(-2, -1), d_rows));
      at::Tensor ds = at::matmul(d_rows, v_tile.transpose(-2, -1)).sub_(query_rows(delta, qs, n)).mul_(p);
      query_rows(dq, qs, n).add_(at::matmul(ds, k_tile), scale);
      dk_tile.add_(at::matmul(ds.transpose(-2, -1), rows), scale);
    }
  }
  return {dq, dk, dv};
}

AttentionPart merge_attention(const AttentionPart& a, const AttentionPart& b) {
  const at::Tensor top = at::maximum(a.lse, b.lse);
  const at::Tensor shift = top.masked_fill(top == -kInf, 0);
  const at::Tensor wa = (a.lse - shift).exp_(), wb = (b.lse - shift).exp_();
  const at::Tensor sum = wa + wb;
  const at::Tensor lse = sum.log().add_(shift);
  const at::Tensor safe = sum.masked_fill(sum == 0, 1);
  const at::Tensor out = (a.out * (wa / safe).unsqueeze(-1)).add_(b.out * (wb / safe).unsqueeze(-1));
  return {out, lse};
}

at::Tensor to_kernel_layout(const at::Tensor& t, int64_t kv_heads) {
  const int64_t B = t.size(0), H = t.size(1), T = t.size(2), d = t.size(3);
  return t.reshape({B, kv_heads, H / kv_heads, T, d}).transpose(2, 3).contiguous();
}

at::Tensor from_kernel_layout(const at::Tensor& t) {
  const int64_t B = t.size(0), KV = t.size(1), T = t.size(2), G = t.size(3), d = t.size(4);
  return t.transpose(2, 3).reshape({B, KV * G, T, d});
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Keeps q, k, v (k and v at KV heads), the output and the log-sum-exp. The
// output is kept as [B, T, H, d], the layout the models' output projection
// reads (y.transpose(1, 2).reshape(B, T, H d) is then a view), so that the
// projection's saved input and this function's saved output are one tensor.
struct FlashAttentionFunction : torch::autograd::Function<FlashAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t query_block, int64_t key_block) {
    const FlashOptions options{query_block, key_block};
    const at::Tensor q5 = to_kernel_layout(q, k.size(1)), kc = k.contiguous(), vc = v.contiguous();
    const int64_t q_start = k.size(2) - q.size(2);
    AttentionPart part = flash_forward(q5, kc, vc, q_start, 0, options);
    const at::Tensor out_bthd = part.out.to(q.scalar_type()).permute({0, 2, 1, 3, 4}).contiguous();
    ctx->save_for_backward({q5, kc, vc, out_bthd, part.lse});
    ctx->saved_data["query_block"] = query_block;
    ctx->saved_data["key_block"] = key_block;
    return out_bthd.view({q.size(0), q.size(2), q.size(1), q.size(3)}).transpose(1, 2);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q5 = saved[0], &k = saved[1], &v = saved[2], &out_bthd = saved[3], &lse = saved[4];
    const FlashOptions options{ctx->saved_data["query_block"].toInt(), ctx->saved_data["key_block"].toInt()};
    const at::Tensor out = out_bthd.view({q5.size(0), q5.size(2), q5.size(1), q5.size(3), q5.size(4)})
                               .permute({0, 2, 1, 3, 4});
    const at::Tensor dout = to_kernel_layout(grads[0], k.size(1));
    AttentionGrads g = flash_backward(q5, k, v, out, lse, dout, k.size(2) - q5.size(2), 0, options);
    return {from_kernel_layout(g.dq).to(q5.scalar_type()), g.dk.to(k.scalar_type()), g.dv.to(v.scalar_type()),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const FlashOptions& options) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), Tq = q.size(2), Tk = k.size(2);
  MESHTRAIN_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && heads % kv_heads == 0 && Tq <= Tk &&
                      q.size(3) == k.size(3) && q.size(0) == k.size(0),
                  "flash_attention: q ", q.sizes(), " over k ", k.sizes(), " and v ", v.sizes(),
                  "; expected q [B, H, Tq, d], k and v [B, KV, Tk, d], KV dividing H, Tq <= Tk");
  MESHTRAIN_CHECK(options.query_block > 0 && options.key_block > 0, "flash_attention: blocks of ",
                  options.query_block, " queries and ", options.key_block, " keys; both must be positive");
  return FlashAttentionFunction::apply(q, k, v, options.query_block, options.key_block);
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, AttentionKernel kernel) {
  if (resolve_attention_kernel(kernel, k.size(2)) == AttentionKernel::kFlash) return flash_attention(q, k, v);
  return causal_attention(q, k, v);
}

}  // namespace nn
}  // namespace meshtrain
