#include "meshtrain/dp.h"

#include <ATen/ATen.h>

#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "meshtrain/util.h"

namespace meshtrain {
namespace dp {

namespace {

std::string describe(const NamedParam& p) {
  std::ostringstream os;
  os << p.name << " " << p.tensor.scalar_type() << p.tensor.sizes();
  return os.str();
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  std::string line;
  while (std::getline(is, line)) out.push_back(line);
  return out;
}

}  // namespace

std::vector<NamedParam> unique_parameters(const torch::nn::Module& module) {
  std::vector<NamedParam> out;
  std::set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    out.push_back({item.key(), item.value()});
  }
  return out;
}

std::vector<NamedParam> unique_buffers(const torch::nn::Module& module) {
  std::vector<NamedParam> out;
  std::set<const void*> seen;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    out.push_back({item.key(), item.value()});
  }
  return out;
}

void verify_same_parameters(comm::Communicator& comm, const std::vector<NamedParam>& params,
                            const std::string& who) {
  std::string mine;
  for (const auto& p : params) mine += describe(p) + "\n";
  // Every rank learns every rank's list (sizes may differ), then all compare
  // the same data and reach the same verdict: no rank waits for another.
  std::vector<std::vector<std::string>> lists;
  for (const auto& s : comm::all_gather_strings(comm, mine)) lists.push_back(split_lines(s));
  std::vector<int> identity(lists.size());
  std::iota(identity.begin(), identity.end(), 0);
  for (size_t i = 0;; ++i) {
    std::map<std::string, std::vector<int>> variants;  // description -> ranks
    bool any = false;
    for (int r = 0; r < static_cast<int>(lists.size()); ++r) {
      const bool has = i < lists[r].size();
      any = any || has;
      variants[has ? lists[r][i] : "(no parameter)"].push_back(r);
    }
    if (!any) return;
    if (variants.size() == 1) continue;
    std::ostringstream msg;
    msg << who << ": ranks hold different parameters; parameter #" << i << " is";
    bool first = true;
    for (const auto& v : variants) {
      msg << (first ? " " : "; ") << "'" << v.first << "' on ranks [";
      for (size_t k = 0; k < v.second.size(); ++k) msg << (k ? ", " : "") << v.second[k];
      msg << "]";
      if (comm.global_ranks() != identity) {  // a group of a larger mesh: its ranks are not the job's
        msg << " (global ranks [";
        for (size_t k = 0; k < v.second.size(); ++k) msg << (k ? ", " : "") << comm.global_ranks()[v.second[k]];
        msg << "])";
      }
      first = false;
    }
    msg << ". Every rank must build the same model.";
    throw ConfigError(msg.str());
  }
}

void broadcast_coalesced(comm::Communicator& comm, const std::vector<at::Tensor>& tensors, int root) {
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);
  for (auto& group : by_dtype) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : group.second) flat_parts.push_back(t.detach().reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    comm.broadcast(flat, root);
    int64_t offset = 0;
    at::NoGradGuard no_grad;
    for (auto& t : group.second) {
      t.copy_(flat.narrow(0, offset, t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

int64_t total_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors)
    if (t.defined()) n += t.nbytes();
  return n;
}

}  // namespace dp
}  // namespace meshtrain
