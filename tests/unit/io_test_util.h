#pragma once
// Helpers of the io tests (test_io_*.cpp): a scratch directory, small gpt2 and
// llama shapes with random parameters, bitwise comparison, raw file bytes, and
// running an independent Python writer.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "io/shapes.h"
#include "meshtrain/models.h"
#include "util/files.h"

namespace meshtrain {
namespace testing {

constexpr const char* kPython = "/usr/bin/python3";

// A fresh directory under /tmp, removed with everything in it at the end.
struct ScratchDir {
  ScratchDir() {
    char tmpl[] = "/tmp/meshtrain-io-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~ScratchDir() { files::remove_tree(path); }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

// GPT-2 with a padded vocabulary (200 -> 256) and 2 layers.
inline models::ModelConfig tiny_gpt2(bool tied = true) {
  models::ModelConfig c;
  c.kind = "gpt2";
  c.vocab = 200;
  c.seq_len = 16;
  c.hidden = 32;
  c.heads = 4;
  c.layers = 2;
  c.tie_embeddings = tied;
  return c;
}

// Llama with grouped-query attention (4 heads, 2 kv heads) and 2 layers.
inline models::ModelConfig tiny_llama(bool tied = false) {
  models::ModelConfig c;
  c.kind = "llama";
  c.vocab = 96;
  c.seq_len = 64;
  c.hidden = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn_hidden = 88;
  c.layers = 2;
  c.tie_embeddings = tied;
  c.rope_theta = 500000.0;
  c.norm_eps = 1e-6;
  return c;
}

// Random float32 parameters under our names; bf16_values: rounded to values
// bfloat16 holds exactly (for lossless bfloat16 round trips).
inline std::map<std::string, at::Tensor> random_parameters(const models::ModelConfig& c, uint64_t seed,
                                                           bool bf16_values = false) {
  torch::manual_seed(seed);
  std::map<std::string, at::Tensor> out;
  for (const auto& s : io::parameter_shapes(c)) {
    at::Tensor t = torch::randn(s.second);
    out[s.first] = bf16_values ? t.to(at::kBFloat16).to(at::kFloat) : t;
  }
  return out;
}

// The same tensors bit for bit (names, dtypes, shapes, bytes).
inline void expect_bitwise_equal(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                                 const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& named : a) {
    const auto it = b.find(named.first);
    ASSERT_NE(it, b.end()) << what << ": " << named.first << " missing";
    const at::Tensor x = named.second.contiguous(), y = it->second.contiguous();
    ASSERT_EQ(x.scalar_type(), y.scalar_type()) << what << ": " << named.first;
    ASSERT_EQ(x.sizes(), y.sizes()) << what << ": " << named.first;
    EXPECT_EQ(0, std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size())) << what << ": " << named.first;
  }
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) { return files::read_all(path); }

// Runs `script` (Python 3, standard library only) with `args`; its exit status.
// The tests assert it is 0: a machine without /usr/bin/python3 fails them.
inline int run_python(const ScratchDir& dir, const std::string& script, const std::string& args) {
  if (::access(kPython, X_OK) != 0) {
    ADD_FAILURE() << kPython << " is missing: the independent writer cannot run (install python3)";
    return -1;
  }
  write_bytes(dir / "writer.py", script);
  const std::string command = std::string(kPython) + " " + (dir / "writer.py") + " " + args + " 2>&1";
  return std::system(command.c_str());
}

}  // namespace testing
}  // namespace meshtrain
