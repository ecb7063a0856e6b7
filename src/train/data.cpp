#include "meshtrain/train.h"

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "meshtrain/util.h"

namespace meshtrain {
namespace train {

namespace {

// Operands of up to `digits` digits.
std::string arithmetic_line(uint64_t key, uint64_t counter, int digits) {
  const double range = std::pow(10.0, digits);
  const int a = static_cast<int>(hash_uniform(key, 2 * counter) * range);
  const int b = static_cast<int>(hash_uniform(key, 2 * counter + 1) * range);
  return std::to_string(a) + "+" + std::to_string(b) + "=" + std::to_string(a + b) + "\n";
}

Batch next_token_batch(const std::vector<std::string>& texts, int64_t seq_len) {
  const int64_t n = static_cast<int64_t>(texts.size());
  at::Tensor tokens = at::empty({n, seq_len + 1}, at::kLong);
  auto acc = tokens.accessor<int64_t, 2>();
  for (int64_t s = 0; s < n; ++s)
    for (int64_t t = 0; t <= seq_len; ++t) acc[s][t] = static_cast<unsigned char>(texts[s][t]);
  return {tokens.narrow(1, 0, seq_len).contiguous(), tokens.narrow(1, 1, seq_len).contiguous()};
}

class ArithmeticDataset : public Dataset {
 public:
  ArithmeticDataset(uint64_t seed, int64_t seq_len, int digits) : seed_(seed), seq_len_(seq_len), digits_(digits) {}
  Batch samples(int64_t first, int64_t count) const override {
    std::vector<std::string> texts;
    for (int64_t i = first; i < first + count; ++i) texts.push_back(arithmetic_text(seed_, i, seq_len_ + 1, digits_));
    return next_token_batch(texts, seq_len_);
  }
  int64_t tokens_per_sample() const override { return seq_len_; }
  std::string describe() const override { return "arithmetic lines (a+b=c), byte tokens"; }

 private:
  uint64_t seed_;
  int64_t seq_len_;
  int digits_;
};

class TextDataset : public Dataset {
 public:
  TextDataset(const std::string& path, uint64_t seed, int64_t seq_len) : path_(path), seed_(seed), seq_len_(seq_len) {
    std::ifstream in(path, std::ios::binary);
    MESHTRAIN_CHECK(in.good(), "--data ", path, ": cannot open the file");
    std::stringstream ss;
    ss << in.rdbuf();
    text_ = ss.str();
    MESHTRAIN_CHECK(static_cast<int64_t>(text_.size()) > seq_len + 1, "--data ", path, " has ", text_.size(),
                    " bytes; it needs more than --seq-len + 1 = ", seq_len + 1);
  }
  Batch samples(int64_t first, int64_t count) const override {
    const uint64_t key = hash_key(seed_, "text-windows");
    const int64_t positions = static_cast<int64_t>(text_.size()) - seq_len_ - 1;
    std::vector<std::string> texts;
    for (int64_t i = first; i < first + count; ++i) {
      const int64_t start = static_cast<int64_t>(hash_uniform(key, i) * positions);
      texts.push_back(text_.substr(start, seq_len_ + 1));
    }
    return next_token_batch(texts, seq_len_);
  }
  int64_t tokens_per_sample() const override { return seq_len_; }
  std::string describe() const override { return "byte windows of " + path_; }

 private:
  std::string path_, text_;
  uint64_t seed_;
  int64_t seq_len_;
};

class ClassificationDataset : public Dataset {
 public:
  ClassificationDataset(uint64_t seed, int64_t features, int64_t classes)
      : seed_(seed), features_(features), classes_(classes) {
    teacher_ = init_full(seed, "data.teacher", InitSpec::normal(0, 1), {classes, features});
  }
  Batch samples(int64_t first, int64_t count) const override {
    at::Tensor x = at::empty({count, features_}, at::kFloat);
    for (int64_t i = 0; i < count; ++i) {
      x[i].copy_(init_full(seed_, "data.x." + std::to_string(first + i), InitSpec::normal(0, 1), {features_}));
    }
    return {x, at::matmul(x, teacher_.t()).argmax(1)};
  }
  int64_t tokens_per_sample() const override { return 1; }
  std::string describe() const override { return "Gaussian features, labels from a linear teacher"; }

 private:
  uint64_t seed_;
  int64_t features_, classes_;
  at::Tensor teacher_;
};

}  // namespace

std::string arithmetic_text(uint64_t seed, int64_t sample, int64_t length, int digits) {
  const uint64_t key = hash_key(seed, "arithmetic");
  std::string text;
  for (uint64_t line = 0; static_cast<int64_t>(text.size()) < length; ++line) {
    text += arithmetic_line(key, static_cast<uint64_t>(sample) * 64 + line, digits);
  }
  return text.substr(0, length);
}

std::vector<ArithmeticProblem> arithmetic_eval_problems(uint64_t seed, int count, int digits) {
  // A key of its own: evaluation problems are not training windows.
  const uint64_t key = hash_key(seed, "arithmetic-eval");
  std::vector<ArithmeticProblem> problems;
  for (int i = 0; i < count; ++i) {
    const std::string line = arithmetic_line(key, i, digits);
    const size_t eq = line.find('=');
    problems.push_back({line.substr(0, eq + 1), line.substr(eq + 1, line.size() - eq - 2)});
  }
  return problems;
}

std::unique_ptr<Dataset> make_arithmetic_dataset(uint64_t seed, int64_t seq_len, int digits) {
  MESHTRAIN_CHECK(digits >= 1 && digits <= 6, "--digits ", digits, " must be in [1, 6]");
  return std::make_unique<ArithmeticDataset>(seed, seq_len, digits);
}

std::unique_ptr<Dataset> make_text_dataset(const std::string& path, uint64_t seed, int64_t seq_len) {
  return std::make_unique<TextDataset>(path, seed, seq_len);
}

std::unique_ptr<Dataset> make_classification_dataset(uint64_t seed, int64_t features, int64_t classes) {
  return std::make_unique<ClassificationDataset>(seed, features, classes);
}

}  // namespace train
}  // namespace meshtrain
