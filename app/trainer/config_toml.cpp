#include "app/trainer/config_toml.h"

#include <nlohmann/json.hpp>

#include <map>
#include <sstream>
#include <vector>

namespace meshtrain {
namespace train {

namespace {

// The section of each top-level key of to_json(c); a key not named here goes
// to [training], so a new field is printed before anyone files it.
const std::map<std::string, std::string>& section_of() {
  static const std::map<std::string, std::string> sections = [] {
    std::map<std::string, std::string> m;
    for (const char* k : {"dp", "pp", "tp", "cp", "ep", "strategy", "zero", "schedule", "microbatches", "virtual_stages",
                          "stage_boundaries", "sequence_parallel", "deterministic", "grains", "deterministic_threads"})
      m[k] = "parallelism";
    for (const char* k : {"optimizer", "lr", "lr_schedule", "warmup_steps", "weight_decay", "momentum", "adam_eps"})
      m[k] = "optimizer";
    for (const char* k : {"data", "shuffle", "val_data", "val_batches"}) m[k] = "data";
    for (const char* k : {"bucket_cap_mb", "overlap", "backend"}) m[k] = "comm";
    return m;
  }();
  return sections;
}

// A JSON value as TOML: strings, numbers, booleans and arrays of them are
// written alike (JSON's string escapes are TOML's basic-string ones).
std::string value_of(const nlohmann::ordered_json& v) { return v.dump(); }

void write_section(std::ostringstream& out, const std::string& name, const std::vector<std::string>& lines) {
  if (lines.empty()) return;
  if (out.tellp() > 0) out << "\n";
  out << "[" << name << "]\n";
  for (const std::string& line : lines) out << line << "\n";
}

}  // namespace

std::string to_toml(const TrainConfig& c) {
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(to_json(c));  // in to_json's order
  std::map<std::string, std::vector<std::string>> sections;
  for (const auto& item : j.items()) {
    if (item.value().is_object()) {  // the model
      for (const auto& field : item.value().items())
        sections[item.key()].push_back(field.key() + " = " + value_of(field.value()));
      continue;
    }
    const auto it = section_of().find(item.key());
    sections[it == section_of().end() ? "training" : it->second].push_back(item.key() + " = " + value_of(item.value()));
  }
  std::ostringstream out;
  for (const char* name : {"model", "parallelism", "training", "optimizer", "data", "comm"}) {
    write_section(out, name, sections[name]);
    sections.erase(name);
  }
  for (const auto& rest : sections) write_section(out, rest.first, rest.second);
  return out.str();
}

}  // namespace train
}  // namespace meshtrain
