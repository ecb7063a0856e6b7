#pragma once
// Named tensors to and from a file, in a small format of our own: a magic
// word, then per tensor its name, dtype, shape and raw bytes, all in the host's
// byte order, which must be little endian (tensor_io.cpp refuses to build on a
// big-endian host rather than write files no other machine could read).
// Used by tests to hand results between processes and by the trainer to gather
// stage parameters; checkpoints use PyTorch's format (below).

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace meshtrain {

void save_tensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors);
std::map<std::string, at::Tensor> load_tensors(const std::string& path);
// The same format in memory.
std::string serialize_tensors(const std::map<std::string, at::Tensor>& tensors);
std::map<std::string, at::Tensor> deserialize_tensors(const std::string& bytes, const std::string& what);

// PyTorch's own format (torch::pickle_save: a zip archive holding a pickled
// dict of tensors), which Python's `torch.load` reads: checkpoint shards are
// written this way so a user can open them with PyTorch. Slower than the format
// above (the archive checksums every record with CRC-32), so checkpoints encode
// in the background when saving asynchronously.
std::string torch_save_bytes(const std::map<std::string, at::Tensor>& tensors);
// ConfigError naming `what` when the bytes are not such an archive of a dict of tensors.
std::map<std::string, at::Tensor> torch_load_bytes(const std::string& bytes, const std::string& what);

}  // namespace meshtrain
