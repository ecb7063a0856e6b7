// The command-line parser the three tools share (util/flags.h).
#include <gtest/gtest.h>

#include "util/flags.h"

namespace meshtrain {
namespace flags {
namespace {

struct Options {
  int steps = 20;
  double lr = 2e-3;
  std::string name = "gpt";
  bool quiet = false;
  uint8_t small = 0;
};

Parser parser_of(Options& o) {
  return Parser("tool", "usage: tool [flags]\n",
                {{"main",
                  {store("--steps", "S", "optimizer steps (default 20)", o.steps),
                   store("--lr", "LR", "learning rate (default 2e-3)", o.lr),
                   store("--name", "NAME", "a name (default gpt)", o.name),
                   store("--small", "N", "0 to 255", o.small),
                   turn("--quiet", "say less", o.quiet)}}});
}

std::string error_of(const std::vector<std::string>& args) {
  Options o;
  try {
    parser_of(o).parse(args);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Flags, ValuesBySpaceOrEqualsAndTheLastOneWins) {
  Options o;
  const auto rest = parser_of(o).parse({"--steps", "7", "--lr=0.5", "--name", "mlp", "--quiet", "--steps=9"});
  EXPECT_TRUE(rest.empty());
  EXPECT_EQ(o.steps, 9);
  EXPECT_EQ(o.lr, 0.5);
  EXPECT_EQ(o.name, "mlp");
  EXPECT_TRUE(o.quiet);
}

TEST(Flags, BadInputIsNamedWithTheTool) {
  EXPECT_EQ(error_of({"--steps", "4294967297"}), "tool: --steps 4294967297 is out of range (-2147483648 to 2147483647)");
  EXPECT_EQ(error_of({"--small", "256"}), "tool: --small 256 is out of range (0 to 255)");
  EXPECT_EQ(error_of({"--steps", "12abc"}), "tool: --steps '12abc' is not an integer");
  EXPECT_EQ(error_of({"--lr", "inf"}), "tool: --lr 'inf' is not a finite number");
  EXPECT_EQ(error_of({"--lr", "nan"}), "tool: --lr 'nan' is not a finite number");
  EXPECT_EQ(error_of({"--quiet=yes"}), "tool: --quiet takes no value; write just --quiet");
  EXPECT_EQ(error_of({"--steps"}), "tool: --steps needs a value, e.g. --steps S");
  EXPECT_EQ(error_of({"--name", "--steps", "3"}), "tool: --name needs a value before the next flag --steps, e.g. --name NAME");
  EXPECT_EQ(error_of({"stray"}).rfind("tool: unexpected argument 'stray'", 0), 0u);
  const std::string unknown = error_of({"--bogus", "1"});
  EXPECT_EQ(unknown.rfind("tool: unknown flag '--bogus'\nusage: tool [flags]", 0), 0u) << unknown;
}

TEST(Flags, UsageListsEveryFlagWithItsHelp) {
  Options o;
  const std::string usage = parser_of(o).usage();
  for (const char* line : {"  --steps S", "optimizer steps (default 20)", "  --quiet", "say less", "  --help"})
    EXPECT_NE(usage.find(line), std::string::npos) << line << "\n" << usage;
  EXPECT_EQ(usage.rfind("usage: tool [flags]\n\nmain:\n", 0), 0u) << usage;
}

// meshrun: its flags end at "--" or at the program; the program's --help is its own.
TEST(Flags, ACommandEndsTheFlags) {
  Options o;
  Parser p = parser_of(o);
  p.rest_is_a_command().underscores_as_dashes();
  using V = std::vector<std::string>;
  EXPECT_EQ(p.parse({"--steps", "3", "prog", "--steps", "x"}), (V{"prog", "--steps", "x"}));
  EXPECT_EQ(o.steps, 3);
  EXPECT_EQ(p.parse({"--quiet", "--", "--prog"}), (V{"--prog"}));
  EXPECT_TRUE(p.asks_for_help({"--steps", "3", "--help"}));
  EXPECT_TRUE(p.asks_for_help({"-h"}));
  EXPECT_FALSE(p.asks_for_help({"--steps", "3", "prog", "--help"}));
  EXPECT_FALSE(p.asks_for_help({"--", "prog", "-h"}));
}

TEST(Flags, UnderscoresSpellDashes) {
  int nproc = 1;
  Parser p("meshrun", "", {{"", {store("--nproc-per-node", "N", "ranks", nproc)}}});
  p.underscores_as_dashes();
  p.parse({"--nproc_per_node=4"});
  EXPECT_EQ(nproc, 4);
}

// meshtrain data: files anywhere among the flags.
TEST(Flags, OperandsAnywhere) {
  Options o;
  Parser p = parser_of(o);
  p.takes_operands();
  EXPECT_EQ(p.parse({"a.txt", "--name", "x", "b.txt", "--", "--c.txt"}),
            (std::vector<std::string>{"a.txt", "b.txt", "--c.txt"}));
  EXPECT_EQ(o.name, "x");
}

}  // namespace
}  // namespace flags
}  // namespace meshtrain
