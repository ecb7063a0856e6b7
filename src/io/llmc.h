#pragma once
// The file format of llm.c's GPT-2 checkpoints (gpt2_124M.bin), described
// here so meshtrain can read and write it; the reader and writer are our own
// code (src/io/llmc.cpp), checked against what llm.c printed (fixtures under
// tests/fixtures/reference/). A header of 256 int32 {magic 20240326,
// version (3: float32, 5: bfloat16), maxT, V, L, NH, C, Vp, 0...}, then 16
// tensors back to back: wte [Vp, C], wpe [maxT, C], ln1w [L, C], ln1b [L, C],
// qkvw [L, 3C, C], qkvb [L, 3C], attprojw [L, C, C], attprojb [L, C],
// ln2w [L, C], ln2b [L, C], fcw [L, 4C, C], fcb [L, 4C], fcprojw [L, C, 4C],
// fcprojb [L, C], lnfw [C], lnfb [C]. Matrices are [out, in] like
// torch::nn::Linear's; qkvw's rows are q, then k, then v. The head is tied.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>

#include "meshtrain/io.h"

namespace meshtrain {
namespace io {

constexpr int32_t kLlmcMagic = 20240326;
constexpr int32_t kLlmcVersionFloat32 = 3;
constexpr int32_t kLlmcVersionBFloat16 = 5;
constexpr int kLlmcHeaderInts = 256;

// Whether `path` is a file starting with llm.c's checkpoint magic.
bool is_llmc_checkpoint(const std::string& path);

// Reads a checkpoint (version 3 or 5; mapped, float32 tensors alias the file)
// into our names, config kind gpt2 with vocab V, seq_len maxT. The padded
// embedding rows [V, Vp) are kept as the file has them; a Vp other than V
// rounded up to 128 (models::padded_vocab) is accepted when the file's size
// agrees with it, and the rows are then cut or zero-padded to padded_vocab
// (rows at V and beyond never reach a prediction). Refuses, naming the file: a
// wrong magic or version, sizes that are not positive, a size other than the
// header's exactly (naming the expected byte count).
LoadedWeights load_llmc(const std::string& path);

// Writes a gpt2 with a tied head and ffn_hidden 4 x hidden as a checkpoint:
// version 3 for float32, 5 for bfloat16, Vp = padded_vocab(config), padded
// rows as `ours` has them. Streamed tensor by tensor, atomic (temporary file
// renamed). Refuses other models naming the fix (--format hf).
void save_llmc(const std::string& path, const models::ModelConfig& config,
               const std::map<std::string, at::Tensor>& ours, at::ScalarType dtype = at::kFloat);

}  // namespace io
}  // namespace meshtrain
