// The attention and position modules a strategy changes from outside: see
// the header.
#include "meshtrain/nn.h"

#include <ATen/ATen.h>

#include "meshtrain/util.h"

namespace meshtrain {
namespace nn {

at::Tensor PositionsImpl::forward(int64_t length, int64_t start) const {
  if (!fn_) return at::arange(start, start + length, at::kLong);
  MESHTRAIN_CHECK(start == 0, "nn::Positions: ", length, " tokens after ", start, " cached ones, but the positions "
                  "were set from outside (context parallelism splits whole sequences); decode without it");
  const at::Tensor p = fn_(length);
  MESHTRAIN_CHECK(p.dim() == 1 && p.size(0) == length && p.scalar_type() == at::kLong, "nn::Positions: the position "
                  "function gave ", p.sizes(), " ", p.scalar_type(), " for ", length, " tokens; it must give [",
                  length, "] int64");
  return p;
}

CausalAttentionImpl::CausalAttentionImpl(const CausalAttentionOptions& o) : options(o) {
  MESHTRAIN_CHECK(o.head_dim() >= 1, "nn::CausalAttention: head_dim ", o.head_dim(), " must be positive");
  if (o.rotary_positions() == 0) return;
  rotary_ = Rotary(o.head_dim(), o.rotary_positions(), o.rotary_theta());
  positions = register_module("positions", Positions());
}

at::Tensor CausalAttentionImpl::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        KVCache* cache) {
  MESHTRAIN_CHECK(!cache || !attention_, "nn::CausalAttention: decoding with a cache runs the local attention; this "
                  "one's attention function was set from outside (context parallelism)");
  const int64_t B = q.size(0), T = q.size(1), d = options.head_dim();
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, t.size(2) / d, d}).transpose(1, 2); };
  at::Tensor qh = heads(q), kh = heads(k), vh = heads(v);
  if (positions) {
    const int64_t start = cache ? cache->length() : 0;
    if (positions->is_default()) {  // whole sequences: the tables' rows from `start` on
      qh = rotary_.apply(qh, start);
      kh = rotary_.apply(kh, start);
    } else {
      const at::Tensor where = positions->forward(T, start);
      qh = rotary_.apply(qh, where);
      kh = rotary_.apply(kh, where);
    }
  }
  if (cache) std::tie(kh, vh) = cache->append(kh, vh);
  const at::Tensor y = attention_ ? attention_(qh, kh, vh) : causal_attention(qh, kh, vh, options.kernel());
  // [B, H, T, d] -> [B, T, H d]: a view of flash attention's saved output,
  // which keeps it in that layout for the output projection.
  return y.transpose(1, 2).reshape({B, T, q.size(2)});
}

}  // namespace nn
}  // namespace meshtrain
