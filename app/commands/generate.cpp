// `meshtrain generate`: text from a trained or published model, in one process.
#include "app/commands/generate.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <iostream>

#include "meshtrain/data.h"
#include "meshtrain/io.h"
#include "meshtrain/models.h"
#include "app/commands/export.h"
#include "meshtrain/util.h"
#include "util/files.h"
#include "util/flags.h"
#include "util/strings.h"

namespace meshtrain {
namespace train {

namespace {

struct GenerateArgs {
  std::string init_from, resume, tokenizer, prompt, prompt_ids, out;
  models::GenerateOptions options;
  int64_t max_new = 64;
  double temperature = 1.0, top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 1234;
  bool no_cache = false;
};

flags::Parser generate_parser(GenerateArgs& a) {
  using flags::store;
  return flags::Parser(
      "meshtrain generate",
      "usage: meshtrain generate (--init-from PATH | --resume SAVE_DIR) [--tokenizer FILE.model|DIR]\n"
      "                          (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N] [--temperature T]\n"
      "                          [--top-k K] [--top-p P] [--seed S] [--out FILE.json]\n"
      "Generates from a built-in language model in one process, with a cache of keys and values (incremental\n"
      "decoding): greedy with --temperature 0, else sampled; stops at the end-of-text token or the model's last\n"
      "position.\n",
      {{"model", {store("--init-from", "PATH", "published weights: an llm.c GPT-2 checkpoint or a Hugging Face "
                        "directory", a.init_from),
                  store("--resume", "SAVE_DIR", "a training checkpoint (the trainer's --save-dir, any layout)",
                        a.resume)}},
       {"prompt", {store("--tokenizer", "FILE.model|DIR", "the data's tokenizer (meshtrain data --tokenizer): "
                         "encodes --prompt (with its BOS), decodes the output, ends at its end of text (default: "
                         "bytes)", a.tokenizer),
                   store("--prompt", "TEXT", "the prompt as text", a.prompt),
                   store("--prompt-ids", "1,2,3", "the prompt as token ids", a.prompt_ids)}},
       {"sampling", {store("--max-new-tokens", "N", "default 64", a.max_new),
                     store("--temperature", "T", "0: greedy (default 1)", a.temperature),
                     store("--top-k", "K", "sample among the K most likely (default 0: all)", a.top_k),
                     store("--top-p", "P", "nucleus sampling (default 1: all)", a.top_p),
                     store("--seed", "S", "the draws' seed (default 1234)", a.seed),
                     flags::turn("--no-cache", "recompute the whole sequence every step (slower; for comparison)",
                                 a.no_cache)}},
       {"output", {store("--out", "FILE.json", "{\"prompt_ids\", \"generated_ids\", \"text\"}", a.out)}}});
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  for (const std::string& part : split(text, ',')) ids.push_back(flags::to_int64("--prompt-ids", trim(part)));
  return ids;
}

struct LoadedModel {
  models::ModelConfig config;
  std::map<std::string, at::Tensor> parameters;
  std::string source;
};

LoadedModel load_model(const GenerateArgs& a) {
  MESHTRAIN_CHECK(a.init_from.empty() != a.resume.empty(), "meshtrain generate: give --init-from PATH (published "
                  "weights) or --resume SAVE_DIR (a training checkpoint), one of them");
  if (!a.init_from.empty()) {
    io::LoadedWeights w = io::load_weights(a.init_from);
    return {w.config, std::move(w.tensors), w.source};
  }
  CheckpointModel m = load_checkpoint_model(a.resume);
  return {m.config, std::move(m.parameters), "checkpoint " + m.step_dir};
}

// The prompt's ids: --prompt-ids as given, or --prompt encoded, after the
// tokenizer's BOS where it has one (SentencePiece: Llama's documents start so).
std::vector<int64_t> prompt_of(const GenerateArgs& a, const data::Tokenizer& tokenizer) {
  MESHTRAIN_CHECK(a.prompt.empty() != a.prompt_ids.empty(), "meshtrain generate: give --prompt TEXT or --prompt-ids "
                  "1,2,3, one of them");
  if (!a.prompt_ids.empty()) return parse_ids(a.prompt_ids);
  std::vector<int64_t> ids;
  if (tokenizer.bos_id()) ids.push_back(*tokenizer.bos_id());
  for (int32_t id : tokenizer.encode(a.prompt)) ids.push_back(id);
  return ids;
}

// The text of `ids`; the end of text left out, an id the tokenizer does not
// know (a model with a larger vocabulary than the tokenizer) as "<id>".
std::string decoded(const data::Tokenizer& tokenizer, const std::vector<int64_t>& ids) {
  std::string text;
  std::vector<int32_t> run;
  for (int64_t id : ids) {
    if (tokenizer.end_of_text_id() && id == *tokenizer.end_of_text_id()) continue;
    if (id < tokenizer.vocab_size()) {
      run.push_back(static_cast<int32_t>(id));
      continue;
    }
    text += tokenizer.decode(run) + str_cat("<", id, ">");
    run.clear();
  }
  return text + tokenizer.decode(run);
}

void write_result(const std::string& path, const std::vector<int64_t>& prompt, const models::Generation& g,
                  const std::string& text) {
  auto numbers = [](const std::vector<int64_t>& ids) {  // integers, as written: ids, not floats
    std::string out;
    for (int64_t id : ids) out += (out.empty() ? "" : ", ") + std::to_string(id);
    return "[" + out + "]";
  };
  files::write_durable(path, json::Object()
                                 .raw("prompt_ids", numbers(prompt))
                                 .raw("generated_ids", numbers(g.ids))
                                 .str("text", text)
                                 .boolean("stopped_at_end_of_text", g.stopped)
                                 .num("prefill_seconds", g.prefill_seconds)
                                 .num("decode_seconds", g.decode_seconds)
                                 .str() + "\n");
}

}  // namespace

int run_generate_command(const std::vector<std::string>& args, std::ostream& out) {
  GenerateArgs a;
  const flags::Parser parser = generate_parser(a);
  if (parser.asks_for_help(args)) {
    out << parser.usage();
    return 0;
  }
  parser.parse(args);
  auto options = models::GenerateOptions().max_new_tokens(a.max_new).temperature(a.temperature).top_k(a.top_k)
                     .top_p(a.top_p).seed(a.seed).use_cache(!a.no_cache);
  models::check_generate_options(options);  // before anything is loaded
  const std::unique_ptr<data::Tokenizer> tokenizer = data::load_tokenizer(a.tokenizer);
  const std::vector<int64_t> prompt = prompt_of(a, *tokenizer);
  const LoadedModel loaded = load_model(a);
  models::check_finite_weights(loaded.parameters, loaded.source);
  MESHTRAIN_CHECK(tokenizer->vocab_size() <= loaded.config.vocab, "meshtrain generate: the tokenizer (",
                  tokenizer->describe(), ") writes ids up to ", tokenizer->vocab_size() - 1, " but the model predicts ",
                  loaded.config.vocab, " tokens; give the tokenizer its data was written with (--tokenizer)");
  models::BuildContext ctx;
  ctx.weights = &loaded.parameters;
  models::Stage model = models::build_stage(loaded.config, 0, models::num_pieces(loaded.config), ctx);
  if (tokenizer->end_of_text_id()) options.stop_ids({*tokenizer->end_of_text_id()});
  const models::Generation g = models::generate(loaded.config, *model, prompt, options);
  const std::string text = decoded(*tokenizer, g.ids);
  out << decoded(*tokenizer, prompt) << text << std::endl;  // the prompt, then what the model wrote
  std::fprintf(stderr, "meshtrain generate: %zu tokens from %s in %.3f s (%.1f tokens/s; the prompt's %zu tokens in "
               "%.3f s)%s\n", g.ids.size(), loaded.source.c_str(), g.decode_seconds,
               g.ids.size() / std::max(1e-9, g.prefill_seconds + g.decode_seconds), prompt.size(), g.prefill_seconds,
               g.hit_max_positions ? "; stopped at the model's last position" : "");
  if (!a.out.empty()) write_result(a.out, prompt, g, text);
  return 0;
}

}  // namespace train
}  // namespace meshtrain
