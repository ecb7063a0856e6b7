#include "app/trainer/config_file.h"

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <ostream>
#include <sstream>

#include "app/trainer/config.h"
#include "meshtrain/util.h"
#include "util/strings.h"

namespace meshtrain {
namespace train {

// Note [A run in a TOML file]
// A key is a flag without its dashes (layers = 4 is --layers 4; '-' and '_'
// both); sections group keys as torchtitan's files do ([model],
// [parallelism], [training], [data], [checkpoint], [comm]) and any section
// may hold any key. A switch is true (given) or false (not given). The file's
// flags go before the command line's, so a flag given there wins. `config
// --dump` writes the flags whose values differ from the defaults, in those
// sections, so that --config reads back the same run.

namespace {

// The dump's section for each group of the trainer's flags.
std::string section_of(const std::string& group) {
  if (group == "layout") return "parallelism";
  if (group == "optimization") return "training";
  if (group == "data and output") return "data";
  if (group == "checkpoints") return "checkpoint";
  if (group == "communication") return "comm";
  std::string s = group;
  for (char& ch : s) ch = ch == ' ' ? '_' : ch;
  return s;
}

std::string flag_of_key(const std::string& key) {
  std::string flag = "--" + key;
  for (char& ch : flag) ch = ch == '_' ? '-' : ch;
  return flag;
}

// A TOML value as the flag's text: strings as written, numbers as C++
// prints them back exactly, arrays joined by commas.
std::string text_of(const toml::node& v, const std::string& where) {
  if (auto s = v.as_string()) return s->get();
  if (auto i = v.as_integer()) return std::to_string(i->get());
  if (auto f = v.as_floating_point()) return flags::shortest_text(f->get());
  if (auto a = v.as_array()) {
    std::vector<std::string> parts;
    for (const toml::node& e : *a) parts.push_back(text_of(e, where));
    return join(parts, ",");
  }
  throw ConfigError(str_cat(where, ": a string, a number or an array of them"));
}

void add_flags_of_table(const toml::table& table, const std::string& section, const std::string& file,
                        const flags::Parser& parser, std::vector<std::string>& out) {
  for (const auto& [key_node, value] : table) {
    const std::string key(key_node.str());
    const std::string where = str_cat("--config ", file, ": line ", key_node.source().begin.line, ": ",
                                      section.empty() ? "" : "[" + section + "] ", key);
    if (auto sub = value.as_table()) {
      MESHTRAIN_CHECK(section.empty(), where, ": sections do not nest; put the keys in [", section, "]");
      add_flags_of_table(*sub, key, file, parser, out);
      continue;
    }
    const std::string flag = flag_of_key(key);
    const flags::Flag* f = parser.find(flag);
    MESHTRAIN_CHECK(f && flag != "--config", where, " is no flag of meshtrain (a key is a flag without its dashes: ",
                    "layers = 4 for --layers 4; meshtrain --help lists them)");
    if (f->value.empty()) {  // a switch
      const auto on = value.as_boolean();
      MESHTRAIN_CHECK(on, where, " is a switch: true or false");
      if (on->get()) out.push_back(flag);
      continue;
    }
    MESHTRAIN_CHECK(!value.is_boolean(), where, " takes a value (", f->value, "), not true or false");
    out.push_back(flag);
    out.push_back(text_of(value, where));
  }
}

}  // namespace

std::vector<std::string> with_config_file(const std::vector<std::string>& args, const flags::Parser& parser) {
  std::string file;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) file = args[i + 1];
    if (args[i].rfind("--config=", 0) == 0) file = args[i].substr(9);
  }
  if (file.empty()) return args;
  toml::table table;
  try {
    table = toml::parse_file(file);
  } catch (const toml::parse_error& e) {
    throw ConfigError(str_cat("--config ", file, ": line ", e.source().begin.line, ": ", e.description(),
                              " (the file must exist and be TOML: meshtrain config --dump writes one)"));
  }
  std::vector<std::string> out;
  add_flags_of_table(table, "", file, parser, out);
  out.insert(out.end(), args.begin(), args.end());
  return out;
}

std::string dump_toml(const flags::Parser& now, const flags::Parser& defaults) {
  std::ostringstream out;
  for (size_t g = 0; g < now.groups().size(); ++g) {
    std::vector<std::string> lines;
    for (size_t i = 0; i < now.groups()[g].flags.size(); ++i) {
      const flags::Flag& f = now.groups()[g].flags[i];
      if (!f.get || f.name == "--config") continue;
      const std::string value = f.get(), before = defaults.groups()[g].flags[i].get();
      if (value == before || value.empty()) continue;
      std::string key = f.name.substr(2);
      for (char& ch : key) ch = ch == '-' ? '_' : ch;
      lines.push_back(key + " = " + (f.value.empty() ? "true" : f.text ? nlohmann::json(value).dump() : value));
    }
    if (lines.empty()) continue;
    if (out.tellp() > 0) out << "\n";
    out << "[" << section_of(now.groups()[g].title) << "]\n";
    for (const std::string& line : lines) out << line << "\n";
  }
  return out.str();
}

int run_config_command(const std::vector<std::string>& args, std::ostream& out) {
  MESHTRAIN_CHECK(!args.empty() && args[0] == "--dump", "meshtrain config: usage: meshtrain config --dump [flags] ",
                  "(the run those flags describe, as TOML for --config)");
  TrainConfig given = parse_train_args(std::vector<std::string>(args.begin() + 1, args.end())), defaults;
  out << dump_toml(train_parser(given), train_parser(defaults));
  return 0;
}

}  // namespace train
}  // namespace meshtrain
