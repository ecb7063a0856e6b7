// The equivalence matrix: every layout dp x pp x tp of 2, 4 and 8 ranks, times
// ZeRO stages, pipeline schedules and sequence parallelism, and the built-in
// language models (the small GPT; GPT-2 with a padded vocabulary, tied head;
// Llama with grouped-query attention, rotary positions, untied head), trains
// like one process, with gradient clipping active on every step (the global norm must
// count every element once) and activation checkpointing rotating over the
// cases (none, blocks, every-2) against a reference that keeps activations. Built twice: into dist_tests with a representative sample (every
// layout once, the other dimensions rotating), and into matrix_full_tests
// (MESHTRAIN_FULL_MATRIX) with the full product (ctest -L full).

#include <gtest/gtest.h>

#include "equivalence.h"

using meshtrain::testing::expect_trains_like_one_process;

namespace {

struct Case {
  int dp, pp, tp, zero;
  std::string schedule;
  int virtual_stages;
  bool sp;
  std::string checkpointing = "none";
  std::string model = "gpt";
  int world() const { return dp * pp * tp; }
};

meshtrain::train::TrainConfig matrix_gpt() {
  auto c = meshtrain::testing::tiny_gpt();
  c.model.heads = 8;  // tp up to 8
  c.model.layers = 6;  // 8 pieces: pp up to 8
  c.global_batch = 48;
  c.steps = 3;
  c.bucket_cap_mb = 0.02;
  // Its gradient norms in one process are 6.49, 1.64, 1.44: this clips every step.
  c.clip_grad_norm = 1.0;
  c.eval_every = 2;  // the held-out loss after steps 2 and 3, forward only, against one process's
  return c;
}

// The same shapes as GPT-2 (a vocabulary of 200 padded to 256: the padded
// logits are masked on the last tp ranks) or Llama (4 key/value heads for 8
// query heads, 8 where tp is 8, which must divide them).
meshtrain::train::TrainConfig matrix_model(const std::string& kind, int tp) {
  auto c = matrix_gpt();
  c.model.kind = kind;
  if (kind == "gpt2") c.model.vocab = 200;
  if (kind == "llama") c.model.kv_heads = tp == 8 ? 8 : 4;
  return c;
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (int world : {2, 4, 8}) {
    for (int dp = 1; dp <= world; dp *= 2) {
      for (int pp = 1; dp * pp <= world; pp *= 2) {
        const int tp = world / (dp * pp);
        std::vector<std::pair<std::string, int>> schedules = {{"1f1b", 1}};
        if (pp > 1) {
          schedules = {{"naive", 1}, {"gpipe", 1}, {"1f1b", 1}};
          if (2 * pp <= 8) schedules.push_back({"interleaved", 2});  // 8 pieces: V = 2 needs pp <= 4
        }
        // ZeRO shards over the data axis: with dp 1 every stage is plain training.
        for (int zero = 0; zero <= (dp > 1 ? 3 : 0); ++zero)
          for (const auto& s : schedules)
            for (bool sp : tp > 1 ? std::vector<bool>{false, true} : std::vector<bool>{false})
              out.push_back({dp, pp, tp, zero, s.first, s.second, sp});
      }
    }
  }
  return out;
}

std::vector<Case> with_checkpointing_rotating(std::vector<Case> cases) {
  const char* policies[] = {"none", "blocks", "every-2"};
  for (size_t i = 0; i < cases.size(); ++i) cases[i].checkpointing = policies[i % 3];
  return cases;
}

// Every layout once more for each of GPT-2 and Llama, the other dimensions rotating.
[[maybe_unused]] std::vector<Case> every_layout_with_each_model(const std::vector<Case>& all) {
  std::vector<Case> out;
  for (const char* model : {"gpt2", "llama"}) {
    int index = 0;
    for (const auto& c : all) {
      bool seen = false;
      for (const auto& o : out) seen = seen || (o.model == model && o.dp == c.dp && o.pp == c.pp && o.tp == c.tp);
      if (seen) continue;
      std::vector<Case> variants;
      for (const auto& v : all)
        if (v.dp == c.dp && v.pp == c.pp && v.tp == c.tp) variants.push_back(v);
      Case pick = variants[(index * 7 + (model[0] == 'l' ? 3 : 0)) % variants.size()];
      pick.model = model;
      out.push_back(pick);
      ++index;
    }
  }
  return out;
}

std::vector<Case> cases() {
  std::vector<Case> all = all_cases();
#ifdef MESHTRAIN_FULL_MATRIX
  std::vector<Case> full = with_checkpointing_rotating(all);
  for (const Case& c : with_checkpointing_rotating(every_layout_with_each_model(all))) full.push_back(c);
  return full;
#else
  // Every layout once; ZeRO stage, schedule and SP rotate with the layout's index.
  std::vector<Case> sample;
  int index = 0;
  for (const auto& c : all) {
    bool seen = false;
    for (const auto& s : sample) seen = seen || (s.dp == c.dp && s.pp == c.pp && s.tp == c.tp);
    if (seen) continue;
    std::vector<Case> variants;
    for (const auto& v : all)
      if (v.dp == c.dp && v.pp == c.pp && v.tp == c.tp) variants.push_back(v);
    sample.push_back(variants[(index * 5) % variants.size()]);
    ++index;
  }
  // The layout the README and docs/composition.md show: dp 2 x pp 2 x tp 2, ZeRO-1, 1F1B.
  for (auto& s : sample)
    if (s.dp == 2 && s.pp == 2 && s.tp == 2) s = Case{2, 2, 2, 1, "1f1b", 1, false};
  // The models rotate too: each trains on a third of the layouts here, on all in the full matrix.
  const char* models[] = {"gpt", "gpt2", "llama"};
  for (size_t i = 0; i < sample.size(); ++i) sample[i].model = models[(i / 2) % 3];  // not in step with checkpointing
  return with_checkpointing_rotating(sample);
#endif
}

class EquivalenceMatrix : public ::testing::TestWithParam<Case> {};

TEST_P(EquivalenceMatrix, TrainsLikeOneProcess) {
  const Case& p = GetParam();
  auto c = matrix_model(p.model, p.tp);
  c.dp = p.dp;
  c.pp = p.pp;
  c.tp = p.tp;
  c.zero = p.zero;
  c.schedule = p.schedule;
  c.virtual_stages = p.virtual_stages;
  c.sequence_parallel = p.sp;
  c.activation_checkpointing = p.checkpointing;
  if (p.pp > 1) c.microbatches = p.schedule == "naive" ? 1 : 2 * p.pp;
  expect_trains_like_one_process(c, p.world());
}

INSTANTIATE_TEST_SUITE_P(Layouts, EquivalenceMatrix, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  std::string name = (c.model == "gpt" ? "" : c.model + "_") + "dp" + std::to_string(c.dp) + "_pp" + std::to_string(c.pp) + "_tp" + std::to_string(c.tp) +
                     "_zero" + std::to_string(c.zero);
  if (c.pp > 1) name += "_" + c.schedule + (c.virtual_stages > 1 ? "_v" + std::to_string(c.virtual_stages) : "");
  if (c.sp) name += "_sp";
  if (c.checkpointing != "none") name += "_ac_" + (c.checkpointing == "blocks" ? std::string("blocks") : "every2");
  return name;
});

}  // namespace
