#pragma once
// Datasets as deterministic functions of a global sample index: sample i has
// the same value on every rank, whatever the layout, so the global batch of
// step k is samples [k*G, (k+1)*G) everywhere and each data-parallel rank takes
// its contiguous slice ("data order is global, then split").

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

namespace meshtrain {
namespace train {

struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Samples [first, first + count).
  virtual Batch samples(int64_t first, int64_t count) const = 0;
  // Tokens per sample (sequence length for language models, 1 otherwise).
  virtual int64_t tokens_per_sample() const = 0;
  virtual std::string describe() const = 0;
};

// Lines of arithmetic ("17+25=42\n" with digits = 2) as byte tokens; sample i
// is a window of seq_len + 1 bytes starting at a line. Learnable: the answers
// follow the prompt. Operands have up to `digits` digits.
std::unique_ptr<Dataset> make_arithmetic_dataset(uint64_t seed, int64_t seq_len, int digits = 1);
// Windows of seq_len + 1 bytes of a text file at positions drawn from (seed, i).
std::unique_ptr<Dataset> make_text_dataset(const std::string& path, uint64_t seed, int64_t seq_len);
// Gaussian features; the label is the argmax of a fixed random linear teacher.
std::unique_ptr<Dataset> make_classification_dataset(uint64_t seed, int64_t features, int64_t classes);

// An arithmetic problem for evaluation: the prompt "a+b=" and the answer "c".
struct ArithmeticProblem {
  std::string prompt;
  std::string answer;
};
std::vector<ArithmeticProblem> arithmetic_eval_problems(uint64_t seed, int count, int digits = 1);
// The byte text of arithmetic sample i (for tests and examples).
std::string arithmetic_text(uint64_t seed, int64_t sample, int64_t length, int digits = 1);

}  // namespace train
}  // namespace meshtrain
