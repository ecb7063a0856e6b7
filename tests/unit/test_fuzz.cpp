// Bounded random-input tests (clang's libFuzzer is not in this toolchain: GCC
// only): the flag parsers, the checkpoint manifest and shard reader, the token
// shard reader and the store's wire protocol, fed thousands of random or
// mutated inputs each, with a fixed seed (a failure reproduces). Every input
// must give a result or a ConfigError naming what is wrong: no other exception,
// no crash, no hang, no unbounded allocation. Inputs that once broke something
// are kept as regression cases beside them.

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/torch.h>

#include <fstream>
#include <random>

#include "comm/socket.h"
#include "comm/store_protocol.h"
#include "meshtrain/comm.h"
#include "comm/store.h"
#include "app/launch/launcher.h"
#include "meshtrain/plan.h"
#include "meshtrain/train.h"
#include "app/trainer/config.h"
#include "meshtrain/util.h"
#include "util/files.h"

using namespace meshtrain;

namespace {

// Runs `f`; true when it returned or raised ConfigError, false (with the message) otherwise.
template <typename F>
::testing::AssertionResult only_config_errors(F&& f, const std::string& input) {
  try {
    f();
  } catch (const ConfigError&) {
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "input " << input << ": " << typeid(e).name() << ": " << e.what();
  }
  return ::testing::AssertionSuccess();
}

std::string random_bytes(std::mt19937& rng, size_t max_size) {
  std::string s(rng() % (max_size + 1), '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

std::vector<std::string> random_args(std::mt19937& rng, const std::vector<std::string>& flags) {
  static const std::vector<std::string> values = {
      "", "0", "1", "-1", "2", "3", "8", "24", "1e309", "nan", "inf", "-inf", "4294967297", "9223372036854775808",
      "0x10", "1.5", "abc", "=", "--", "-", "gpt", "mlp", "ddp", "dp", "1f1b", "interleaved", "bf16-mixed", "adamw",
      "blocks", "every-2", "every-0", "80GB", "10%", "1,2", ",", "auto", "/nonexistent/*.bin", "/dev/zero", "/tmp"};
  std::vector<std::string> args;
  const int n = static_cast<int>(rng() % 9);
  for (int i = 0; i < n; ++i) {
    const std::string& flag = flags[rng() % flags.size()];
    switch (rng() % 4) {
      case 0: args.push_back(flag); break;
      case 1: args.push_back(flag + "=" + values[rng() % values.size()]); break;
      case 2: args.push_back(random_bytes(rng, 6)); break;
      default:
        args.push_back(flag);
        args.push_back(values[rng() % values.size()]);
    }
  }
  return args;
}

std::string joined(const std::vector<std::string>& args) {
  std::string s;
  for (const auto& a : args) s += "[" + a + "] ";
  return s;
}

}  // namespace

TEST(Fuzz, FlagParsersGiveAConfigOrAConfigError) {
  std::mt19937 rng(20261204);
  const std::vector<std::string> train_flags = {
      "--model", "--layers", "--hidden", "--heads", "--vocab", "--seq-len", "--dp", "--pp", "--tp", "--zero",
      "--schedule", "--microbatches", "--virtual-stages", "--stage-boundaries", "--global-batch", "--micro-batch",
      "--steps", "--lr", "--momentum", "--precision", "--activation-checkpointing", "--data", "--seed",
      "--keep-last", "--resume", "--untied", "--bogus", "-h"};
  const std::vector<std::string> plan_flags = {"--layers", "--hidden", "--heads", "--vocab", "--seq-len", "--params",
                                               "--devices", "--device-memory", "--margin", "--json", "--precision",
                                               "--global-batch", "--micro-batch", "--device-tflops", "--momentum",
                                               "--model", "--kv-heads", "--ffn-hidden", "--attention", "--tied"};
  const std::vector<std::string> launch_flags = {"--nproc-per-node", "--nnodes", "--node-rank", "--master-port",
                                                 "--rdzv-endpoint", "--standalone", "--grace-seconds", "--",
                                                 "--max-restarts", "--rdzv-timeout", "--quiet", "prog"};
  for (int i = 0; i < 3000; ++i) {
    const auto t = random_args(rng, train_flags);
    ASSERT_TRUE(only_config_errors([&] { train::resolve(train::parse_train_args(t), 1 + static_cast<int>(rng() % 8)); },
                                   joined(t)));
    const auto p = random_args(rng, plan_flags);
    ASSERT_TRUE(only_config_errors([&] { plan::parse_plan_args(p); }, joined(p)));
    const auto l = random_args(rng, launch_flags);
    ASSERT_TRUE(only_config_errors([&] { launch::parse_launch_args(l); }, joined(l)));
  }
}

namespace {

// A one-rank checkpoint of two tensors (one tp-cut as if by 2 ranks) in `dir`.
std::string small_checkpoint(const std::string& dir) {
  auto world = comm::make_single_process_world();
  train::RankState state;
  state.chunks.push_back({"w", "value", {4, 3}, -1, 0, 1, 0, torch::arange(12, torch::kFloat)});
  state.chunks.push_back({"b", "value", {4}, 0, 1, 2, 0, torch::arange(2, torch::kFloat)});
  state.steps["w"] = 7;
  state.rng_state = torch::zeros({8}, torch::kByte);
  train::save_checkpoint(dir, 1, state, *world, "{}");
  return dir + "/step-00000001";
}

void read_everything(const std::string& step_dir) {
  train::CheckpointReader reader(step_dir);
  reader.verify();
  reader.full("w", "value");
  reader.full("b", "value");
  reader.rng_state(0);
  reader.optimizer_step("w");
}

}  // namespace

// Manifests with bytes flipped, cut short, or fields replaced by hostile
// values (huge shapes, other files, offsets past the end); shards likewise.
TEST(Fuzz, DamagedCheckpointsAreConfigErrorsNamingTheFile) {
  char tmpl[] = "/tmp/meshtrain-fuzz-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string step = small_checkpoint(dir);
  ASSERT_TRUE(only_config_errors([&] { read_everything(step); }, "the intact checkpoint"));
  const std::string manifest = files::read_all(step + "/manifest.json");
  const std::string shard = files::read_all(step + "/rank-00000.bin");
  const std::vector<std::pair<std::string, std::string>> hostile = {
      {"\"shape\": [4, 3]", "\"shape\": [4000000000000, 3000000]"},
      {"\"shape\": [4, 3]", "\"shape\": [-4, 3]"},
      {"\"file\": \"rank-00000.bin\"", "\"file\": \"../../../etc/passwd\""},
      {"\"offset\": 0", "\"offset\": 99999999999"},
      {"\"numel\": 12", "\"numel\": 13"},
      {"\"tp_index\": 1", "\"tp_index\": 5"},
      {"\"tp_dim\": 0", "\"tp_dim\": 3"},
      {"\"world_size\": 1", "\"world_size\": 1000000000"},
      {"\"key\": \"c0\"", "\"key\": \"nope\""},
      {"\"rng\": true", "\"rng\": 1"},
  };
  std::mt19937 rng(7);
  for (int i = 0; i < 1500; ++i) {
    std::string m = manifest;
    if (i < static_cast<int>(hostile.size())) {
      const auto& h = hostile[i];
      const size_t at = m.find(h.first);
      ASSERT_NE(at, std::string::npos) << h.first << " in " << m;
      m.replace(at, h.first.size(), h.second);
    } else if (i % 3 == 0) {
      m.resize(rng() % m.size());
    } else {
      for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k) m[rng() % m.size()] = static_cast<char>(rng());
    }
    std::ofstream(step + "/manifest.json", std::ios::trunc) << m;
    std::string s = shard;
    if (i % 5 == 0) s[rng() % s.size()] = static_cast<char>(rng());
    std::ofstream(step + "/rank-00000.bin", std::ios::trunc | std::ios::binary) << s;
    ASSERT_TRUE(only_config_errors([&] { read_everything(step); }, "manifest variant " + std::to_string(i)));
  }
  std::system(("rm -rf " + dir).c_str());
}

// llm.c token shards with random headers and lengths, through the trainer's
// own check (resolve, before any rank joins).
TEST(Fuzz, DamagedTokenShardsAreConfigErrors) {
  char tmpl[] = "/tmp/meshtrain-fuzz-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  std::mt19937 rng(11);
  for (int i = 0; i < 500; ++i) {
    std::vector<int32_t> header(256, 0);
    header[0] = rng() % 4 ? 20240520 : static_cast<int32_t>(rng());
    header[1] = rng() % 4 ? 1 : static_cast<int32_t>(rng());
    header[2] = static_cast<int32_t>(rng() % 4 ? rng() % 200 : rng());
    std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
    const size_t tokens = rng() % 3 ? header[2] & 0xFFFF : rng() % 300;
    for (size_t t = 0; t < tokens; ++t) {
      const uint16_t token = static_cast<uint16_t>(rng() % 10 ? rng() % 64 : rng());
      bytes.append(reinterpret_cast<const char*>(&token), 2);
    }
    if (rng() % 5 == 0) bytes.resize(rng() % (bytes.size() + 1));
    std::ofstream(dir + "/shard.bin", std::ios::trunc | std::ios::binary) << bytes;
    ASSERT_TRUE(only_config_errors(
        [&] {
          train::resolve(train::parse_train_args({"--data", dir + "/shard.bin", "--vocab", "64", "--seq-len", "8"}), 1);
        },
        "token shard variant " + std::to_string(i)));
  }
  std::system(("rm -rf " + dir).c_str());
}

// Random frames and bytes from many connections, with and without a token:
// the store answers or closes them, never stops serving the job's client.
TEST(Fuzz, TheStoreSurvivesRandomTraffic) {
  std::mt19937 rng(13);
  for (const std::string token : {"", "a token of this job, long enough"}) {
    comm::StoreServer server("127.0.0.1", 0, token);
    comm::TcpStore member("127.0.0.1", server.port(), std::chrono::seconds(5), token);
    for (int i = 0; i < 300; ++i) {
      const int fd = comm::net::connect_to("127.0.0.1", server.port(),
                                           comm::net::Clock::now() + std::chrono::seconds(5), "the store");
      std::string traffic;
      for (int f = 0; f < 1 + static_cast<int>(rng() % 4); ++f) {
        std::string body = random_bytes(rng, 64);
        if (!body.empty() && rng() % 2) body[0] = static_cast<char>(1 + rng() % 10);  // a real command, bad fields
        if (rng() % 3) traffic += comm::net::frame_of(body);
        else traffic += random_bytes(rng, 16);  // not even a frame
      }
      comm::net::write_all(fd, traffic.data(), traffic.size());
      ::close(fd);
      if (i % 50 == 0) {
        member.set("k" + std::to_string(i), "v");
        ASSERT_EQ(member.get("k" + std::to_string(i)), "v") << "token '" << token << "', after " << i << " strangers";
      }
    }
    member.set("last", "ok");
    EXPECT_EQ(member.get("last"), "ok");
  }
}
