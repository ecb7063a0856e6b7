// JSON: every escape written and read, numbers that round-trip, integers read
// exactly, strict parsing, and errors that name the file.

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "meshtrain/util.h"

using namespace meshtrain;

TEST(Json, StringsWithEveryEscapeRoundTrip) {
  const std::string s = std::string("a\"b\\c\nd\te\rf") + '\x01' + "g/h \xc3\xa9 \xe2\x82\xac";
  const std::string text = json::Object().str("s", s).str();
  EXPECT_EQ(text.find('\r'), std::string::npos) << text;  // escaped, not raw
  EXPECT_EQ(json::parse(text)["s"].str(), s);
  EXPECT_EQ(json::parse(R"({"u": "\u00e9\u20ac\ud83d\ude00"})")["u"].str(), "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
}

TEST(Json, NumbersRoundTripAndIntegersAreExact) {
  for (double v : {0.1 + 0.2, 1.0 / 3.0, 6.02214076e23, -2.5e-300, 123456789.123456789}) {
    EXPECT_EQ(json::parse(json::number(v)).num(), v) << json::number(v);  // %.9g lost these
  }
  EXPECT_EQ(json::number(std::nan("")), "null");
  const json::Value big = json::parse(json::Object().integer("n", 9007199254740993LL).str());
  EXPECT_EQ(big["n"].i64(), 9007199254740993LL);  // 2^53 + 1: a double would read 2^53
  EXPECT_THROW(json::parse("1.5").i64(), ConfigError);
}

TEST(Json, StrictParsingRejectsWhatJsonIsNot) {
  for (const char* bad : {"nan", "[inf]", "0x10", "{\"a\": 1} trailing", "[1,]", "{'a': 1}", "\"unterminated"}) {
    EXPECT_THROW(json::parse(bad), ConfigError) << bad;
  }
}

TEST(Json, AFileThatIsNotJsonIsNamed) {
  const std::string path = "/tmp/meshtrain-json-" + std::to_string(getpid()) + ".json";
  std::ofstream(path) << "{\"format\": \"x\", \"step\": nan}";
  try {
    json::parse_file(path);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": not valid JSON"), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
  EXPECT_THROW(json::parse_file(path), ConfigError);
}
