// safetensors (io/safetensors.h): round trips of every weight dtype, files
// from an independent (Python) writer, and each kind of damaged file refused
// with a message naming the file and the tensor.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstring>

#include "config_error.h"
#include "io_test_util.h"
#include "io/safetensors.h"
#include "meshtrain/util.h"

using namespace meshtrain;
using meshtrain::testing::config_error_of;
using meshtrain::testing::ScratchDir;
namespace mtest = meshtrain::testing;

namespace {

std::map<std::string, at::Tensor> mixed_tensors() {
  torch::manual_seed(7);
  return {{"a.f32", torch::randn({3, 5})},
          {"b.bf16", torch::randn({7}).to(at::kBFloat16)},
          {"c.f16", torch::randn({2, 3}).to(at::kHalf)},
          {"d.i64", torch::arange(5, at::kLong)},
          {"e.empty", torch::zeros({0, 4})},
          {"f.scalar", torch::tensor(2.5f).reshape({})}};
}

std::string length_prefix(uint64_t n) { return std::string(reinterpret_cast<const char*>(&n), 8); }

// A file of the given header JSON text followed by `data` bytes.
std::string file_bytes(const std::string& header, const std::string& data) {
  return length_prefix(header.size()) + header + data;
}

std::string load_error(const ScratchDir& dir, const std::string& bytes) {
  mtest::write_bytes(dir / "bad.safetensors", bytes);
  return config_error_of([&] { io::load_safetensors(dir / "bad.safetensors"); });
}

}  // namespace

TEST(Safetensors, RoundTripKeepsDtypesShapesAndBits) {
  ScratchDir dir;
  const auto tensors = mixed_tensors();
  io::save_safetensors(dir / "m.safetensors", tensors);
  mtest::expect_bitwise_equal(tensors, io::load_safetensors(dir / "m.safetensors"), "round trip");

  const std::string bytes = mtest::read_bytes(dir / "m.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "the header is padded to 8 bytes";
  const json::Value header = json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["__metadata__"]["format"].str(), "pt");
  EXPECT_EQ(header["b.bf16"]["dtype"].str(), "BF16");
  EXPECT_EQ(header["c.f16"]["dtype"].str(), "F16");
  int64_t previous_end = 0;  // the data in name order, back to back
  for (const auto& named : tensors) {
    EXPECT_EQ(header[named.first]["data_offsets"][0].i64(), previous_end) << named.first;
    previous_end = header[named.first]["data_offsets"][1].i64();
  }
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), 8 + static_cast<int64_t>(n) + previous_end);
  EXPECT_FALSE(files::exists(dir / "m.safetensors.tmp." + std::to_string(::getpid())));
}

TEST(Safetensors, TensorsAliasTheMappingSafely) {
  ScratchDir dir;
  const at::Tensor original = torch::arange(16, at::kFloat);
  io::save_safetensors(dir / "m.safetensors", {{"x", original}});
  at::Tensor x;
  {
    auto loaded = io::load_safetensors(dir / "m.safetensors");
    x = loaded.at("x");
  }  // the map is gone; the tensor keeps the mapping alive
  EXPECT_TRUE(at::equal(x, original));
  x.mul_(2);  // copy on write: the tensor changes, the file does not
  EXPECT_TRUE(at::equal(x, original * 2));
  EXPECT_TRUE(at::equal(io::load_safetensors(dir / "m.safetensors").at("x"), original));
}

TEST(Safetensors, ReadsFilesOfAnIndependentPythonWriter) {
  ScratchDir dir;
  const std::string script = R"PY(
import json, struct, sys
def f32(vals): return b"".join(struct.pack("<f", v) for v in vals)
def bf16(vals): return b"".join(struct.pack("<f", v)[2:] for v in vals)  # the upper half of each float32
def f16(vals): return b"".join(struct.pack("<e", v) for v in vals)
def write(path, tensors, aligned):
    header, blobs, offset = {}, [], 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    if aligned: h += b" " * ((8 - len(h) % 8) % 8)
    elif len(h) % 2 == 0: h += b" "  # odd: every tensor lands misaligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
tensors = [("w.f32", "F32", [2, 3], f32([0.5, -1.25, 3.0, 0.001, -7.5, 100.0])),
           ("w.bf16", "BF16", [2, 2], bf16([1.5, -2.0, 3.140625, 0.0078125])),
           ("w.f16", "F16", [3], f16([0.5, -65504.0, 0.000244140625]))]
write(sys.argv[1] + "/aligned.safetensors", tensors, True)
write(sys.argv[1] + "/odd.safetensors", tensors, False)
)PY";
  ASSERT_EQ(mtest::run_python(dir, script, dir.path), 0) << "the Python writer failed";
  for (const char* name : {"aligned.safetensors", "odd.safetensors"}) {
    const auto t = io::load_safetensors(dir / name);
    ASSERT_EQ(t.size(), 3u) << name;
    EXPECT_EQ(t.at("w.bf16").scalar_type(), at::kBFloat16) << name << ": returned as stored";
    EXPECT_EQ(t.at("w.f16").scalar_type(), at::kHalf) << name;
    EXPECT_TRUE(at::equal(t.at("w.f32"), torch::tensor({0.5f, -1.25f, 3.0f, 0.001f, -7.5f, 100.0f}).reshape({2, 3})))
        << name;
    EXPECT_TRUE(at::equal(io::to_float32(t.at("w.bf16")), torch::tensor({1.5f, -2.0f, 3.140625f, 0.0078125f}).reshape({2, 2})))
        << name;
    EXPECT_TRUE(at::equal(io::to_float32(t.at("w.f16")), torch::tensor({0.5f, -65504.0f, 0.000244140625f}))) << name;
  }
}

TEST(Safetensors, RefusesDamagedFilesNamingTheFileAndTensor) {
  ScratchDir dir;
  const std::string file = dir / "bad.safetensors";
  const std::string entry = R"("dtype":"F32","shape":[2,2],"data_offsets":)";
  const std::string data(16, '\0');
  struct Case {
    std::string bytes;
    std::vector<std::string> expected;
  };
  const Case cases[] = {
      {"abc", {file, "shorter than the 8-byte header length"}},
      {length_prefix(1000) + "{}", {file, "header length 1000 reaches beyond the file's 10 bytes"}},
      {file_bytes(R"({"w": {)" + entry + "[0,16]}", data), {file, "not valid JSON"}},
      {file_bytes("[1, 2]", ""), {file, "not a JSON object"}},
      {file_bytes(R"({"w": {"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", "xx"),
       {file, "tensor 'w'", "unknown dtype F8_E4M3"}},
      {file_bytes(R"({"w": {)" + entry + "[0,16]}}", data.substr(0, 10)), {file, "tensor 'w'", "truncated"}},
      {file_bytes(R"({"w": {)" + entry + R"([0,16]}, "v": {)" + entry + "[8,24]}}", data + data),
       {file, "tensor 'v'", "overlap tensor 'w'"}},
      {file_bytes(R"({"w": {)" + entry + "[0,12]}}", data), {file, "tensor 'w'", "span 12 bytes", "needs 16"}},
      {file_bytes(R"({"w": {)" + entry + "[16,0]}}", data), {file, "tensor 'w'", "end before they begin"}},
      {file_bytes(R"({"w": {"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", data), {file, "tensor 'w'", "shape"}},
      {file_bytes(R"({"w": {"dtype":"F32","shape":[1]}})", data), {file, "tensor 'w'", "data_offsets"}},
  };
  for (const Case& c : cases) {
    const std::string error = load_error(dir, c.bytes);
    ASSERT_FALSE(error.empty()) << "accepted: " << c.expected.back();
    for (const std::string& part : c.expected) EXPECT_NE(error.find(part), std::string::npos) << error;
  }
}

TEST(Safetensors, RefusesATruncatedFileNamingTheLastTensor) {
  ScratchDir dir;
  io::save_safetensors(dir / "m.safetensors", {{"a", torch::ones({4})}, {"z", torch::ones({64})}});
  const std::string bytes = mtest::read_bytes(dir / "m.safetensors");
  mtest::write_bytes(dir / "m.safetensors", bytes.substr(0, bytes.size() - 5));
  const std::string error = config_error_of([&] { io::load_safetensors(dir / "m.safetensors"); });
  EXPECT_NE(error.find(dir / "m.safetensors"), std::string::npos) << error;
  EXPECT_NE(error.find("tensor 'z'"), std::string::npos) << error;
  EXPECT_NE(error.find("truncated"), std::string::npos) << error;
}

TEST(Safetensors, ToFloat32ConvertsFloatsExactlyAndRefusesIntegers) {
  const at::Tensor bf = torch::tensor({1.5f, -0.375f}).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(io::to_float32(bf), torch::tensor({1.5f, -0.375f})));
  const at::Tensor f = torch::ones({2});
  EXPECT_TRUE(io::to_float32(f).is_same(f)) << "float32 is returned as it is";
  EXPECT_NE(config_error_of([] { io::to_float32(torch::arange(3), "ids"); }).find("ids has dtype Long"),
            std::string::npos);
}
