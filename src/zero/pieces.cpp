#include "pieces.h"

#include <ATen/ATen.h>

#include "meshtrain/util.h"
#include "zero/optimizer_state.h"

namespace meshtrain {
namespace zero {

namespace {

const std::vector<std::string>& state_kinds() {
  static const std::vector<std::string> kinds = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                                                 "square_avg", "grad_avg", "sum"};
  return kinds;
}

}  // namespace

void Pieces::attach(torch::optim::Optimizer& optimizer, const std::vector<dp::NamedParam>& params,
                    const std::function<at::Tensor(const ShardPiece&)>& grads) {
  std::vector<at::Tensor> originals;
  for (const auto& p : params) originals.push_back(p.tensor);
  const std::vector<int> group_of_param = group_of_params(optimizer, originals);
  std::vector<int> group_of_piece;
  for (size_t i = 0; i < pieces.size(); ++i) {
    values[i].mutable_grad() = grads(pieces[i]);
    group_of_piece.push_back(group_of_param[pieces[i].param]);
  }
  replace_params(optimizer, values, group_of_piece);
}

int64_t Pieces::optimizer_bytes(torch::optim::Optimizer& optimizer) const {
  int64_t n = 0;
  for (const auto& v : values) {
    for (const auto& kv : state_of(optimizer, v)) {
      if (kv.first != "step") n += kv.second.nbytes();
    }
  }
  return n;
}

std::vector<std::pair<std::string, at::Tensor>> Pieces::gradients(const std::vector<dp::NamedParam>& params) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < pieces.size(); ++i)
    out.emplace_back(params[pieces[i].param].name, low_grads.empty() ? values[i].grad() : low_grads[i]);
  return out;
}

void Pieces::masters_take_gradients() {
  for (size_t i = 0; i < low_grads.size(); ++i) values[i].mutable_grad() = low_grads[i].to(at::kFloat);
}

void Pieces::masters_into(at::Tensor buffer) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < values.size(); ++i) {
    const ShardPiece& p = pieces[i];
    buffer.narrow(0, p.flat_offset, p.numel).copy_(values[i]);
    values[i].mutable_grad() = at::Tensor();
  }
}

at::Tensor Pieces::masters_shard(int64_t shard_numel) const {
  at::Tensor shard = at::empty({shard_numel}, at::kFloat);
  for (size_t i = 0; i < values.size(); ++i) shard.narrow(0, pieces[i].shard_offset, pieces[i].numel).copy_(values[i]);
  return shard;
}

int64_t Pieces::master_bytes() const {
  int64_t n = 0;
  for (const auto& v : values) n += v.nbytes();
  return n;
}

std::vector<at::Tensor> gather_full(comm::Communicator& comm, const Layout& layout, const at::Tensor& my_shard,
                                    const std::vector<dp::NamedParam>& params, int root) {
  std::vector<at::Tensor> shards = comm.gather(my_shard.contiguous(), root);
  if (comm.rank() != root) return {};
  at::Tensor flat = at::empty({layout.total}, my_shard.options());
  for (int r = 0; r < layout.world; ++r) {
    for (size_t b = 0; b < layout.buckets.size(); ++b) {
      const Range dst = layout.buckets[b].shard(r);
      flat.narrow(0, dst.offset, dst.size).copy_(shards[r].narrow(0, layout.shard_offset(r, b), dst.size));
    }
  }
  std::vector<at::Tensor> out(params.size());
  for (const auto& e : layout.entries) {
    out[e.param] = flat.narrow(0, e.offset, e.numel).view_as(params[e.param].tensor).clone();
  }
  return out;
}

std::map<std::string, std::map<std::string, at::Tensor>> consolidate_optimizer(
    comm::Communicator& comm, const Layout& layout, const Pieces& pieces, torch::optim::Optimizer& optimizer,
    const std::vector<dp::NamedParam>& params, int root) {
  const auto& kinds = state_kinds();
  // Which kinds exist, which parameters have state, and their step counts: the
  // union over ranks (a rank may own no piece of a parameter).
  at::Tensor has_kind = at::zeros({static_cast<int64_t>(kinds.size())}, at::kLong);
  at::Tensor steps = at::full({static_cast<int64_t>(params.size())}, -1, at::kLong);
  std::vector<std::map<std::string, at::Tensor>> piece_state(pieces.values.size());
  for (size_t i = 0; i < pieces.values.size(); ++i) {
    piece_state[i] = state_of(optimizer, pieces.values[i]);
    for (size_t k = 0; k < kinds.size(); ++k) has_kind[k] += piece_state[i].count(kinds[k]) ? 1 : 0;
    auto st = piece_state[i].find("step");
    if (st != piece_state[i].end()) steps[pieces.pieces[i].param] = st->second.item<int64_t>();
    else if (!piece_state[i].empty()) steps[pieces.pieces[i].param] = 0;
  }
  comm.all_reduce(has_kind, comm::ReduceOp::kMax);
  comm.all_reduce(steps, comm::ReduceOp::kMax);
  std::map<std::string, std::map<std::string, at::Tensor>> out;
  const int64_t shard_numel = layout.shard_numel(comm.rank());
  for (size_t k = 0; k < kinds.size(); ++k) {
    if (has_kind[k].item<int64_t>() == 0) continue;
    at::Tensor buffer = at::zeros({shard_numel}, at::kFloat);
    for (size_t i = 0; i < pieces.values.size(); ++i) {
      auto it = piece_state[i].find(kinds[k]);
      if (it != piece_state[i].end()) {
        buffer.narrow(0, pieces.pieces[i].shard_offset, pieces.pieces[i].numel).copy_(it->second.reshape({-1}));
      }
    }
    std::vector<at::Tensor> full = gather_full(comm, layout, buffer, params, root);
    for (size_t p = 0; p < full.size(); ++p) {
      if (steps[p].item<int64_t>() >= 0) out[params[p].name][kinds[k]] = full[p];
    }
  }
  if (comm.rank() != root) return {};
  for (size_t p = 0; p < params.size(); ++p) {
    const int64_t s = steps[p].item<int64_t>();
    if (s >= 0) out[params[p].name]["step"] = at::scalar_tensor(s, at::kLong);
  }
  return out;
}

std::vector<OwnedPiece> owned_pieces(const Pieces& pieces, torch::optim::Optimizer& optimizer,
                                     const std::vector<dp::NamedParam>& params) {
  std::vector<OwnedPiece> out;
  for (size_t i = 0; i < pieces.values.size(); ++i) {
    const ShardPiece& p = pieces.pieces[i];
    out.push_back({params[p.param].name, p.param_offset, pieces.values[i], state_of(optimizer, pieces.values[i])});
  }
  return out;
}

void load_pieces(const FullState& state, const Pieces& pieces, torch::optim::Optimizer& optimizer,
                 const std::vector<dp::NamedParam>& params) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < pieces.values.size(); ++i) {
    const ShardPiece& piece = pieces.pieces[i];
    const std::string& name = params[piece.param].name;
    auto value = state.parameters.find(name);
    MESHTRAIN_CHECK(value != state.parameters.end(), "loading ZeRO state: parameter '", name, "' is missing");
    MESHTRAIN_CHECK(value->second.numel() == params[piece.param].tensor.numel(), "loading ZeRO state: parameter '",
                    name, "' has ", value->second.numel(), " elements, the model's has ",
                    params[piece.param].tensor.numel());
    pieces.values[i].copy_(value->second.reshape({-1}).narrow(0, piece.param_offset, piece.numel));
    auto opt = state.optimizer.find(name);
    if (opt == state.optimizer.end()) continue;
    std::map<std::string, at::Tensor> slice;
    for (const auto& kv : opt->second) {
      slice[kv.first] = kv.first == "step" ? kv.second : kv.second.reshape({-1}).narrow(0, piece.param_offset, piece.numel);
    }
    set_state(optimizer, pieces.values[i], slice);
  }
}

}  // namespace zero
}  // namespace meshtrain
