// cp::parallelize: see the header. The modules it changes are nn's; the
// functions it sets hold the communicator.
#include "meshtrain/cp.h"

#include <string>

#include "meshtrain/nn.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace cp {

void parallelize(torch::nn::Module& model, const comm::CommPtr& cp) {
  if (!cp || cp->size() == 1) return;
  const auto modules = model.named_modules();
  int attentions = 0;
  for (const auto& item : modules) {  // all checked before anything changes
    const std::string where = item.key().empty() ? "the model" : "'" + item.key() + "'";
    if (auto* a = item.value()->as<nn::CausalAttentionImpl>()) {
      MESHTRAIN_CHECK(a->has_default_attention(), "cp::parallelize: ", where, " already has an attention function "
                      "set from outside; parallelize a model once");
      ++attentions;
    }
    if (auto* p = item.value()->as<nn::PositionsImpl>()) {
      MESHTRAIN_CHECK(p->is_default(), "cp::parallelize: ", where, " already has positions set from outside; "
                      "parallelize a model once");
    }
  }
  MESHTRAIN_CHECK(attentions > 0, "cp::parallelize: the model has no nn::CausalAttention, whose attention function "
                  "becomes ring attention over the cp ranks; without one each rank would attend within its own "
                  "chunks only. Build the model's attention as an nn::CausalAttention (meshtrain/nn.h)");
  const int size = cp->size(), rank = cp->rank();
  for (const auto& item : modules) {
    if (auto* a = item.value()->as<nn::CausalAttentionImpl>()) {
      a->set_attention([cp](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
        return ring_attention(q, k, v, cp);
      });
    }
    if (auto* p = item.value()->as<nn::PositionsImpl>()) {
      p->set([size, rank](int64_t length) { return local_positions(length * size, size, rank); });
    }
    if (auto* s = dynamic_cast<nn::TokenStatistics*>(item.value().get())) {
      s->set_token_group([cp](at::Tensor& t) { cp->all_reduce(t); }, size);
    }
  }
}

}  // namespace cp
}  // namespace meshtrain
