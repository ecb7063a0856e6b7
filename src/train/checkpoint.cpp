#include "meshtrain/train.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "meshtrain/util.h"
#include "util/files.h"
#include "util/sha256.h"
#include "util/tensor_io.h"

namespace meshtrain {
namespace train {

// Note [Atomic checkpoints]
// A crash (kill -9 of any rank at any moment) must never leave a checkpoint
// that loads as complete. The protocol:
//   1. every rank writes its shard to rank-RRRRR.bin.tmp, fsyncs, renames it to
//      rank-RRRRR.bin and fsyncs the directory;
//   2. all ranks exchange their outcome, size and SHA-256 (an all-gather): if
//      any failed, every rank raises and nothing is committed;
//   3. rank 0 writes manifest.json.tmp (layout, step, every shard's size and
//      checksum and chunk index), fsyncs, renames it to manifest.json, fsyncs
//      the directory: from here on the checkpoint is complete;
//   4. rank 0 writes latest.tmp naming the step directory, fsyncs, renames it
//      to latest, fsyncs the checkpoint directory.
// A crash before 3 leaves no manifest (the step directory is ignored); a crash
// between 3 and 4 leaves `latest` at the previous complete checkpoint. Loading
// checks every shard's size and SHA-256 against the manifest and names the
// file that does not match.

namespace {

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string shard_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.bin", rank);
  return buf;
}

std::string shape_json(const std::vector<int64_t>& shape) {
  std::vector<std::string> dims;
  for (int64_t d : shape) dims.push_back(std::to_string(d));  // integers, read back exactly
  return json::array(dims);
}

// This rank's shard file and the JSON describing its chunks.
std::pair<std::string, std::string> encode(const RankState& mine) {
  std::map<std::string, at::Tensor> tensors;
  std::vector<std::string> index;
  for (size_t i = 0; i < mine.chunks.size(); ++i) {
    const StateChunk& c = mine.chunks[i];
    const std::string key = "c" + std::to_string(i);
    tensors[key] = c.data.detach().contiguous().view(-1);
    index.push_back(json::Object()
                        .str("key", key)
                        .str("param", c.param)
                        .str("kind", c.kind)
                        .raw("shape", shape_json(c.full_shape))
                        .integer("tp_dim", c.tp_dim)
                        .integer("tp_index", c.tp_index)
                        .integer("tp_size", c.tp_size)
                        .integer("offset", c.offset)
                        .integer("numel", c.data.numel())
                        .str());
  }
  json::Object steps;
  for (const auto& kv : mine.steps) steps.integer(kv.first, kv.second);
  if (mine.rng_state.defined()) tensors["rng"] = mine.rng_state.contiguous();
  return {torch_save_bytes(tensors), json::Object()
                                          .raw("chunks", json::array(index))
                                          .raw("steps", steps.str())
                                          .boolean("rng", mine.rng_state.defined())
                                          .str()};
}

}  // namespace

// What a failed save wrote (the other ranks are past writing: the outcomes were exchanged).
static void remove_failed_save(const std::string& step_dir) {
  try {
    files::remove_tree(step_dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint: %s\n", e.what());  // the save's own error is the one to raise
  }
}

// Rank 0's part of Note [Atomic checkpoints]: the manifest, then `latest`. A
// failure (a full disk) leaves neither a temporary file nor a step directory
// without its manifest; `latest` keeps naming the previous checkpoint.
static void commit_manifest(const std::string& dir, int64_t step, const std::string& manifest) {
  const std::string step_dir = dir + "/" + step_name(step);
  bool committed = false;
  try {
    files::write_durable(step_dir + "/manifest.json.tmp", manifest);
    crash_point("manifest-written", 0, step);
    files::rename_durable(step_dir + "/manifest.json.tmp", step_dir + "/manifest.json");
    committed = true;
    crash_point("manifest-renamed", 0, step);
    files::write_durable(dir + "/latest.tmp", step_name(step) + "\n");
    crash_point("latest-written", 0, step);
    files::rename_durable(dir + "/latest.tmp", dir + "/latest");
  } catch (...) {
    std::remove((dir + "/latest.tmp").c_str());
    if (!committed) remove_failed_save(step_dir);
    throw;
  }
}

void crash_point(const char* stage, int rank, int64_t step) {
  const char* at = std::getenv("MESHTRAIN_CHECKPOINT_CRASH_AT");
  if (!at || std::strcmp(at, stage) != 0) return;
  const char* only = std::getenv("MESHTRAIN_CRASH_ONLY_AT_STEP");
  if (only && std::atoll(only) != step) return;
  const char* who = std::getenv("MESHTRAIN_CHECKPOINT_CRASH_RANK");
  if ((who ? std::atoi(who) : 0) != rank) return;
  std::fprintf(stderr, "checkpoint test hook: rank %d kills itself at '%s'\n", rank, stage);
  std::fflush(stderr);
  kill(getpid(), SIGKILL);
}

const RankState& StateSnapshot::take(const RankState& live) {
  if (copy_.chunks.size() != live.chunks.size()) copy_.chunks.assign(live.chunks.size(), StateChunk());
  for (size_t i = 0; i < live.chunks.size(); ++i) {
    const StateChunk& from = live.chunks[i];
    at::Tensor buffer = std::move(copy_.chunks[i].data);
    copy_.chunks[i] = from;
    const bool reusable = buffer.defined() && buffer.numel() == from.data.numel() &&
                          buffer.scalar_type() == from.data.scalar_type();
    copy_.chunks[i].data = reusable ? buffer.copy_(from.data) : from.data.detach().clone();
  }
  copy_.steps = live.steps;
  copy_.rng_state = live.rng_state.defined() ? live.rng_state.clone() : at::Tensor();
  return copy_;
}

SaveStats save_checkpoint(const std::string& dir, int64_t step, const RankState& mine, comm::Communicator& comm,
                          const std::string& config_json) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::pair<std::string, std::string> shard = encode(mine);  // bytes, index
  const int rank = comm.rank();
  const std::string step_dir = dir + "/" + step_name(step);
  SaveStats stats;
  std::string outcome;  // "ok <bytes> <sha256> <index json>" or "error <message>"
  try {
    files::make_directories(step_dir);
    const std::string path = step_dir + "/" + shard_name(rank);
    files::write_durable(path + ".tmp", shard.first);
    crash_point("shard-written", rank, step);
    files::rename_durable(path + ".tmp", path);
    crash_point("shard-renamed", rank, step);
    stats.bytes = static_cast<int64_t>(shard.first.size());
    outcome = "ok " + std::to_string(stats.bytes) + " " + sha256_hex(shard.first) + " " + shard.second;
  } catch (const std::exception& e) {
    outcome = std::string("error ") + e.what();
  }
  // Every rank learns every rank's outcome: all commit, or all raise.
  const std::vector<std::string> all = comm::all_gather_strings(comm, outcome);
  std::vector<std::string> shards;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    const std::string& o = all[r];
    if (o.rfind("ok ", 0) != 0) {
      if (rank == 0) remove_failed_save(step_dir);
      throw std::runtime_error(str_cat("checkpoint of step ", step, " failed on rank ", r, ": ", o.substr(6),
                                       "; nothing was committed"));
    }
    size_t a = 3, b = o.find(' ', a), c = o.find(' ', b + 1);
    shards.push_back(json::Object()
                         .integer("rank", r)
                         .str("file", shard_name(r))
                         .integer("bytes", std::stoll(o.substr(a, b - a)))
                         .str("sha256", o.substr(b + 1, c - b - 1))
                         .raw("content", o.substr(c + 1))
                         .str());
  }
  std::string commit_error;  // rank 0's, said to every rank
  if (rank == 0) {
    try {
      for (int r = 0; r < comm.size(); ++r) {  // a rank writing to a directory rank 0 does not see
        const std::string path = step_dir + "/" + shard_name(r);
        MESHTRAIN_CHECK(files::exists(path), "rank ", r, " wrote its shard but rank 0 does not find ", path,
                        ": --save-dir must be one directory every node sees (a shared file system)");
      }
      commit_manifest(dir, step, json::Object()
                                     .str("format", "meshtrain-checkpoint/1")
                                     .integer("step", step)
                                     .integer("world_size", comm.size())
                                     .raw("config", config_json)
                                     .raw("shards", json::array(shards))
                                     .str());
    } catch (const std::exception& e) {
      commit_error = e.what();
    }
  }
  // Committed everywhere before training goes on, or failed everywhere.
  const std::string error = comm::all_gather_strings(comm, commit_error)[0];
  if (!error.empty()) {
    throw std::runtime_error(str_cat("checkpoint of step ", step, " failed on rank 0: ", error,
                                     "; 'latest' still names the previous checkpoint"));
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

// The step directories of `dir` (step-NNNNNNNN) with a manifest (committed) or without, newest first.
static std::vector<std::string> step_directories(const std::string& dir, bool committed) {
  std::vector<std::string> steps;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name, path = dir + "/" + name;
      if (name.size() == 13 && name.rfind("step-", 0) == 0 && files::exists(path + "/manifest.json") == committed)
        steps.push_back(path);
    }
    closedir(d);
  }
  std::sort(steps.rbegin(), steps.rend());  // zero-padded: newest first
  return steps;
}

std::vector<std::string> complete_checkpoints(const std::string& dir) { return step_directories(dir, true); }

static std::vector<std::string> uncommitted_steps(const std::string& dir) { return step_directories(dir, false); }

std::vector<std::string> remove_unfinished_saves(const std::string& dir) {
  const std::vector<std::string> found = uncommitted_steps(dir);
  for (const std::string& path : found) files::remove_tree(path);
  return found;
}

std::vector<std::string> prune_checkpoints(const std::string& dir, int keep_last) {
  const std::vector<std::string> committed = complete_checkpoints(dir);
  if (committed.empty()) return {};
  std::string latest;
  try {
    latest = latest_checkpoint(dir);
  } catch (const ConfigError&) {  // an altered `latest` prunes nothing it might name
    return {};
  }
  std::vector<std::string> removed;
  for (size_t i = keep_last; keep_last > 0 && i < committed.size(); ++i)
    if (committed[i] != latest) removed.push_back(committed[i]);
  for (const std::string& path : uncommitted_steps(dir))
    if (path < committed.front()) removed.push_back(path);
  for (const std::string& path : removed) files::remove_tree(path);
  return removed;
}

std::string latest_checkpoint(const std::string& dir) {
  const std::string latest = dir + "/latest";
  if (!files::exists(latest)) return "";
  std::string name = files::read_all(latest);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  MESHTRAIN_CHECK(name.size() == 13 && name.rfind("step-", 0) == 0 &&
                      name.find_first_not_of("0123456789", 5) == std::string::npos,
                  "checkpoint directory ", dir, ": 'latest' holds '", name, "', not a step directory name "
                  "(step-NNNNNNNN)");
  const std::string step_dir = dir + "/" + name;
  MESHTRAIN_CHECK(files::exists(step_dir + "/manifest.json"), "checkpoint ", step_dir,
                  " named by 'latest' has no manifest.json: the directory was altered after it was committed");
  return step_dir;
}

namespace {

// Every field the reader will use, checked once, so that a damaged or edited
// manifest is an error naming it, never a wild read, a path outside the step
// directory or an unbounded allocation. Throws ConfigError (without the path).
void check_manifest(const json::Value& m) {
  MESHTRAIN_CHECK(m["format"].str() == "meshtrain-checkpoint/1", "unknown checkpoint format");
  m["step"].i64();
  const int64_t world = m["world_size"].i64();
  const json::Value& shards = m["shards"];
  MESHTRAIN_CHECK(world >= 1 && shards.type == json::Value::Type::kArray && static_cast<int64_t>(shards.size()) == world,
                  "'shards' does not list world_size (", world, ") shards");
  int64_t total_bytes = 0;
  for (size_t r = 0; r < shards.size(); ++r) {
    const json::Value& s = shards[r];
    MESHTRAIN_CHECK(s["file"].str() == shard_name(static_cast<int>(r)), "shard ", r, " is named '", s["file"].str(),
                    "', not ", shard_name(static_cast<int>(r)));
    MESHTRAIN_CHECK(s["bytes"].i64() >= 0 && s["sha256"].str().size() == 64, "shard ", r, ": bad size or checksum");
    total_bytes += s["bytes"].i64();
  }
  for (size_t r = 0; r < shards.size(); ++r) {
    const json::Value& content = shards[r]["content"];
    for (const auto& kv : content["steps"].fields) kv.second.i64();
    for (const json::Value& c : content["chunks"].items) {
      c["key"].str(), c["param"].str(), c["kind"].str();
      int64_t elements = 1;
      for (const json::Value& d : c["shape"].items) {
        MESHTRAIN_CHECK(d.i64() >= 0 && (d.i64() == 0 || elements <= total_bytes / d.i64()), "chunk '",
                        c["key"].str(), "' of shard ", r, ": its shape holds more elements than the shards have bytes");
        elements *= d.i64();
      }
      const int64_t dims = static_cast<int64_t>(c["shape"].size()), tp_dim = c["tp_dim"].i64();
      const int64_t tp_size = c["tp_size"].i64(), tp_index = c["tp_index"].i64();
      const int64_t offset = c["offset"].i64(), numel = c["numel"].i64();
      MESHTRAIN_CHECK(tp_dim >= -1 && tp_dim < dims && tp_size >= 1 && tp_index >= 0 && tp_index < tp_size &&
                          (tp_dim >= 0 || tp_size == 1) && offset >= 0 && numel >= 0 && offset <= elements &&
                          numel <= elements - offset,
                      "chunk '", c["key"].str(), "' of shard ", r, ": its coordinates lie outside its tensor");
    }
  }
}

}  // namespace

CheckpointReader::CheckpointReader(const std::string& step_dir) : dir_(step_dir) {
  const std::string path = step_dir + "/manifest.json";
  MESHTRAIN_CHECK(files::exists(path), "checkpoint ", step_dir, " has no manifest.json: it was never completed");
  manifest_ = json::parse_file(path);
  try {
    check_manifest(manifest_);
  } catch (const ConfigError& e) {
    throw ConfigError(str_cat(path, ": ", e.what(), " (the manifest is damaged or was edited)"));
  }
  step_ = manifest_["step"].i64();
  const std::string base = step_dir.substr(step_dir.find_last_of('/') + 1);
  MESHTRAIN_CHECK(base.rfind("step-", 0) != 0 || base == step_name(step_), path, " says step ", step_,
                  " but lives in ", base, ": the manifest was altered after it was committed");
  for (size_t s = 0; s < manifest_["shards"].size(); ++s) {
    const json::Value& steps = manifest_["shards"][s]["content"]["steps"];
    for (const auto& kv : steps.fields) steps_[kv.first] = kv.second.i64();
  }
}

void CheckpointReader::verify() const {
  for (const auto& s : manifest_["shards"].items) {
    const std::string path = dir_ + "/" + s["file"].str();
    std::ifstream in(path, std::ios::binary);
    MESHTRAIN_CHECK(in.good(), "checkpoint shard ", path, " is missing");
    Sha256 sha;
    std::vector<char> buf(1 << 20);
    int64_t bytes = 0;
    while (in.read(buf.data(), buf.size()) || in.gcount() > 0) {
      sha.update(buf.data(), static_cast<size_t>(in.gcount()));
      bytes += in.gcount();
    }
    MESHTRAIN_CHECK(bytes == s["bytes"].i64(), "checkpoint shard ", path, " is truncated or padded: ", bytes,
                    " bytes, the manifest says ", s["bytes"].i64());
    const std::string digest = sha.hex_digest();
    MESHTRAIN_CHECK(digest == s["sha256"].str(), "checkpoint shard ", path, " is corrupt: SHA-256 ", digest,
                    " does not match the manifest's ", s["sha256"].str());
  }
}

const std::map<std::string, at::Tensor>& CheckpointReader::shard(size_t index) {
  auto it = loaded_.find(index);
  if (it != loaded_.end()) return it->second;
  const json::Value& s = manifest_["shards"][index];
  const std::string path = dir_ + "/" + s["file"].str();
  MESHTRAIN_CHECK(files::exists(path), "checkpoint shard ", path, " is missing");
  const std::string bytes = files::read_all(path);
  const int64_t want = s["bytes"].i64();
  MESHTRAIN_CHECK(static_cast<int64_t>(bytes.size()) == want, "checkpoint shard ", path, " is truncated or padded: ",
                  bytes.size(), " bytes, the manifest says ", want);
  const std::string sha = sha256_hex(bytes);
  MESHTRAIN_CHECK(sha == s["sha256"].str(), "checkpoint shard ", path, " is corrupt: SHA-256 ", sha,
                  " does not match the manifest's ", s["sha256"].str());
  return loaded_[index] = torch_load_bytes(bytes, path);
}

at::Tensor CheckpointReader::rng_state(int rank) {
  MESHTRAIN_CHECK(rank >= 0 && rank < static_cast<int>(manifest_["shards"].size()), "checkpoint ", dir_, " has no shard of rank ", rank);
  const json::Value& content = manifest_["shards"][rank]["content"];
  if (!content.has("rng") || !content["rng"].boolean) return {};
  const auto& tensors = shard(rank);
  MESHTRAIN_CHECK(tensors.count("rng"), "checkpoint ", dir_, ": shard ", rank, " has no 'rng' tensor though its ",
                  "manifest says so");
  return tensors.at("rng");
}

bool CheckpointReader::has(const std::string& param) const {
  for (const auto& s : manifest_["shards"].items)
    for (const auto& c : s["content"]["chunks"].items)
      if (c["param"].str() == param) return true;
  return false;
}

std::optional<int64_t> CheckpointReader::optimizer_step(const std::string& param) const {
  auto it = steps_.find(param);
  if (it == steps_.end()) return std::nullopt;
  return it->second;
}

at::Tensor CheckpointReader::full(const std::string& param, const std::string& kind) {
  at::Tensor full;
  std::map<int, at::Tensor> slabs;  // tp index -> contiguous slab
  int64_t tp_dim = -1;
  int tp_size = 1;
  for (size_t s = 0; s < manifest_["shards"].size(); ++s) {
    for (const auto& c : manifest_["shards"][s]["content"]["chunks"].items) {
      if (c["param"].str() != param || c["kind"].str() != kind) continue;
      std::vector<int64_t> shape;
      for (const auto& d : c["shape"].items) shape.push_back(d.i64());
      const bool first = !full.defined();
      MESHTRAIN_CHECK(first || (full.sizes().vec() == shape && tp_dim == c["tp_dim"].i64() &&
                                tp_size == c["tp_size"].i64()),
                      "checkpoint ", dir_, ": the chunks of '", param, "' (", kind, ") disagree on its shape or cut");
      tp_dim = c["tp_dim"].i64();
      tp_size = static_cast<int>(c["tp_size"].i64());
      const int index = static_cast<int>(c["tp_index"].i64());
      if (first) full = at::zeros(shape, at::kFloat);
      MESHTRAIN_CHECK(tp_dim < 0 || index < static_cast<int>(full.chunk(tp_size, tp_dim).size()), "checkpoint ", dir_,
                      ": '", param, "' has no tp slab ", index, " of ", tp_size, " along dimension ", tp_dim);
      at::Tensor& slab = slabs[index];
      if (!slab.defined()) slab = (tp_dim < 0 ? full : full.chunk(tp_size, tp_dim)[index]).contiguous();
      const auto& tensors = shard(s);
      const auto found = tensors.find(c["key"].str());
      MESHTRAIN_CHECK(found != tensors.end() && found->second.numel() == c["numel"].i64() &&
                          c["offset"].i64() + found->second.numel() <= slab.numel(),
                      "checkpoint ", dir_, ": shard ", s, "'s tensor '", c["key"].str(),
                      "' is missing or does not match the manifest's coordinates");
      slab.view(-1).narrow(0, c["offset"].i64(), found->second.numel()).copy_(found->second.view(-1));
    }
  }
  for (auto& kv : slabs) {
    if (tp_dim < 0) full = kv.second;
    else full.chunk(tp_size, tp_dim)[kv.first].copy_(kv.second);
  }
  return full;
}

}  // namespace train
}  // namespace meshtrain
