#pragma once
// A module's own parameter dictionary (internal). libtorch keeps it protected;
// zero::fully_shard and pp::pipeline take parameters out of it (the module's
// code keeps using the tensors) so that module.parameters(), and so the
// optimizer and data-parallel wrappers built from it, no longer list them.

#include <torch/nn/module.h>

namespace meshtrain {

// A member pointer formed through a derived class reaches the protected member.
struct ParameterDict : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& of(torch::nn::Module& m) {
    torch::OrderedDict<std::string, at::Tensor> torch::nn::Module::*dict = &ParameterDict::parameters_;
    return m.*dict;
  }
};

}  // namespace meshtrain
