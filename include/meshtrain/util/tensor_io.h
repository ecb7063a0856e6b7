#pragma once
// Named tensors to and from a file, in a small format of our own: a magic
// word, then per tensor its name, dtype, shape and raw bytes, all in the host's
// byte order, which must be little endian (tensor_io.cpp refuses to build on a
// big-endian host rather than write files no other machine could read).
// Used by tests to hand results between processes and by checkpoints.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace meshtrain {

void save_tensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors);
std::map<std::string, at::Tensor> load_tensors(const std::string& path);
// The same format in memory.
std::string serialize_tensors(const std::map<std::string, at::Tensor>& tensors);
std::map<std::string, at::Tensor> deserialize_tensors(const std::string& bytes, const std::string& what);

}  // namespace meshtrain
