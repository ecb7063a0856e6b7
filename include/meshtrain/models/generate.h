#pragma once
// Text generation from a built-in language model (gpt, gpt2, llama) held
// whole in one process: the prompt runs through the model once, then one
// token at a time, each step computing attention for the new position only
// against a cache of the earlier keys and values (incremental decoding), or,
// with use_cache off, the whole sequence again (for comparison).
//
//   models::Stage model = models::build_stage(config, 0, models::num_pieces(config));
//   auto out = models::generate(config, *model, {1, 450, 4996}, models::GenerateOptions().max_new_tokens(40));

#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "meshtrain/models/models.h"

namespace meshtrain {
namespace models {

struct GenerateOptions {
  TORCH_ARG(int64_t, max_new_tokens) = 64;
  // 0: greedy (the most likely token, the first of equals); otherwise the
  // logits are divided by it before sampling.
  TORCH_ARG(double, temperature) = 1.0;
  TORCH_ARG(int64_t, top_k) = 0;    // sample among the k most likely tokens only (0: all)
  TORCH_ARG(double, top_p) = 1.0;   // nucleus: the fewest tokens whose probability reaches p (1: all)
  TORCH_ARG(uint64_t, seed) = 1234; // sampling draws from (seed, step): the same text for the same seed
  // Generation stops after producing one of these (the tokenizer's end of text).
  TORCH_ARG(std::vector<int64_t>, stop_ids) = {};
  TORCH_ARG(bool, use_cache) = true;
};

struct Generation {
  std::vector<int64_t> ids;   // the new tokens (a stop token included when one ended it)
  bool stopped = false;       // a stop token ended it
  bool hit_max_positions = false;  // the model's positions ran out first
  double prefill_seconds = 0;  // the prompt's forward
  double decode_seconds = 0;   // every later step
};

// Generates after `prompt` (token ids below config.vocab). The model is the
// whole model (build_stage over every piece, no tensor parallelism), put in
// eval mode for the call.
Generation generate(const ModelConfig& config, StageImpl& model, const std::vector<int64_t>& prompt,
                    const GenerateOptions& options = {});
// ConfigError naming the option when `options` cannot generate (a count
// below 1, a negative or non-finite temperature, top-k below 0, top-p outside
// (0, 1]); generate() checks it first, a command may check before loading.
void check_generate_options(const GenerateOptions& options);
// ConfigError naming the first parameter that holds NaN or infinity, how many
// of its values do, and `source`: such weights generate one token forever.
void check_finite_weights(const std::map<std::string, at::Tensor>& parameters, const std::string& source);

// The next token from the last position's logits [vocab] under the options
// (step numbers the draws).
int64_t sample_next(const at::Tensor& logits, const GenerateOptions& options, int64_t step);

}  // namespace models
}  // namespace meshtrain
