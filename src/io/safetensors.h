#pragma once
// Hugging Face's safetensors format: 8 bytes (little-endian u64) N, N bytes of
// JSON header {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {...}}, then the tensors' raw little-endian bytes, offsets
// relative to the end of the header.
//
// Reading maps the file and returns tensors that alias the mapping (no copy;
// the mapping lives as long as the last tensor over it): see Note [Tensors over
// a mapped file] in src/io/file_io.h. Every tensor is validated before any is
// returned; errors (ConfigError) name the file and the tensor.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace meshtrain {
namespace io {

// Every tensor of a .safetensors file, as stored: its dtype (F32, BF16, F16;
// also F64, I64, I32, I16, I8, U8, BOOL) and shape, in name order. Refuses,
// naming the file (and the tensor): a header length beyond the file, a header
// that is not a JSON object, an unknown dtype, data offsets out of the file
// (truncated), overlapping another tensor's, or not matching dtype x shape.
std::map<std::string, at::Tensor> load_safetensors(const std::string& path);

// Writes `tensors` (any of the dtypes above; made contiguous on the CPU) as a
// .safetensors file, in name order, header padded with spaces to a multiple of
// 8 bytes (the data starts 8-byte aligned, so in a file of one dtype every
// tensor is aligned for direct use), metadata {"format": "pt"}
// (what transformers expects). Atomic: a temporary file renamed over `path`.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors);

// `t` as float32: itself when it already is, else a converted copy (exact
// for BF16 and F16). Refuses a non-floating tensor, naming `what`.
at::Tensor to_float32(const at::Tensor& t, const std::string& what = "tensor");

}  // namespace io
}  // namespace meshtrain
