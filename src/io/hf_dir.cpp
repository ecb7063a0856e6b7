// Hugging Face model directories: config.json and one or several safetensors files.
#include <ATen/ATen.h>
#include <sys/stat.h>

#include <set>
#include <vector>

#include "io/file_io.h"
#include "io/hf.h"
#include "io/safetensors.h"
#include "meshtrain/util.h"
#include "util/files.h"

namespace meshtrain {
namespace io {

namespace {

const char* const kConfigFile = "config.json";
const char* const kSingleFile = "model.safetensors";
const char* const kIndexFile = "model.safetensors.index.json";

bool is_directory(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string without_trailing_slash(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

HfTensors read_single(const std::string& file) {
  HfTensors out;
  out.tensors = load_safetensors(file);
  for (const auto& named : out.tensors) out.file_of[named.first] = file;
  return out;
}

// The index's weight_map: tensor name -> shard file name.
std::map<std::string, std::string> weight_map_of(const std::string& index_path) {
  const json::Value index = json::parse_file(index_path);
  MESHTRAIN_CHECK(index.type == json::Value::Type::kObject && index.has("weight_map") &&
                      index["weight_map"].type == json::Value::Type::kObject,
                  index_path, ": no \"weight_map\" object (tensor name -> shard file)");
  std::map<std::string, std::string> map;
  for (const auto& entry : index["weight_map"].fields) {
    MESHTRAIN_CHECK(entry.second.type == json::Value::Type::kString, index_path, ": weight_map['", entry.first,
                    "'] is not a shard file name");
    map[entry.first] = entry.second.string;
  }
  return map;
}

// One shard's tensors, after checking it holds exactly those the index puts there.
void read_shard(const std::string& dir, const std::string& shard, const std::vector<std::string>& names,
                HfTensors& out) {
  const std::string path = dir + "/" + shard;
  MESHTRAIN_CHECK(files::exists(path), dir, "/", kIndexFile, " places tensor '", names.front(), "'",
                  names.size() > 1 ? str_cat(" (and ", names.size() - 1, " more)") : "", " in shard ", shard,
                  ", but ", path, " does not exist (an incomplete download?)");
  std::map<std::string, at::Tensor> tensors = load_safetensors(path);
  for (const std::string& name : names) {
    MESHTRAIN_CHECK(tensors.count(name), path, ": tensor '", name, "' is missing from this shard (", kIndexFile,
                    " places it here)");
    out.tensors[name] = tensors[name];
    out.file_of[name] = path;
  }
  const std::set<std::string> placed_here(names.begin(), names.end());
  for (const auto& named : tensors) {
    MESHTRAIN_CHECK(placed_here.count(named.first), path, ": tensor '",
                    named.first, "' is in this shard but ", kIndexFile, " does not place it here (a stale shard?)");
  }
}

HfTensors read_sharded(const std::string& dir) {
  std::map<std::string, std::vector<std::string>> names_of_shard;
  for (const auto& entry : weight_map_of(dir + "/" + kIndexFile)) names_of_shard[entry.second].push_back(entry.first);
  HfTensors out;
  for (const auto& shard : names_of_shard) read_shard(dir, shard.first, shard.second, out);
  return out;
}

// The config beside the weights: refused, naming it, when absent.
models::ModelConfig config_in(const std::string& dir, const std::string& what) {
  const std::string path = dir + "/" + kConfigFile;
  MESHTRAIN_CHECK(files::exists(path), what, ": ", path, " does not exist; a Hugging Face model needs its config.json");
  return read_hf_config(path);
}

}  // namespace

HfTensors read_hf_tensors(const std::string& directory) {
  const std::string dir = without_trailing_slash(directory);
  if (files::exists(dir + "/" + kSingleFile)) return read_single(dir + "/" + kSingleFile);
  if (files::exists(dir + "/" + kIndexFile)) return read_sharded(dir);
  throw ConfigError(str_cat("Hugging Face directory ", dir, ": neither ", kSingleFile, " nor ", kIndexFile,
                            " is there (meshtrain reads safetensors weights; convert a pytorch_model.bin with "
                            "transformers' save_pretrained(safe_serialization=True))"));
}

LoadedWeights load_hf(const std::string& path_given) {
  const std::string path = without_trailing_slash(path_given);
  LoadedWeights out;
  HfTensors hf;
  if (is_directory(path)) {
    out.source = "Hugging Face directory " + path;
    out.config = config_in(path, out.source);
    hf = read_hf_tensors(path);
  } else {
    out.source = "Hugging Face file " + path;
    out.config = config_in(files::directory_of(path), out.source);
    hf = read_single(path);
  }
  out.tensors = from_hf(out.config, hf.tensors, out.source, hf.file_of);
  return out;
}

void save_hf(const std::string& directory, const models::ModelConfig& config,
             const std::map<std::string, at::Tensor>& ours, const HfConfigOptions& options) {
  const std::string dir = without_trailing_slash(directory);
  const std::string config_text = hf_config_json(config, options);  // refuses a dtype it cannot name
  std::map<std::string, at::Tensor> hf = to_hf(config, ours);
  for (auto& named : hf) named.second = named.second.to(options.dtype());
  files::make_directories(dir);
  save_safetensors(dir + "/" + kSingleFile, hf);
  detail::AtomicFile out(dir + "/" + kConfigFile);
  out.write(config_text);
  out.commit();
}

}  // namespace io
}  // namespace meshtrain
