// TensorBoard's event files: the TFRecord framing and the few fields of
// tensorflow.Event and tensorflow.Summary a scalar needs, encoded here (a
// protobuf library for three messages would be the larger dependency).
//
//   record  = uint64 length, uint32 masked_crc32c(length), data, uint32 masked_crc32c(data)
//   Event   = { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary = { repeated Value value = 1; }   Value = { string tag = 1; float simple_value = 2; }

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/files.h"

namespace meshtrain {
namespace train {

namespace {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord uses.
uint32_t crc32c(const char* data, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ static_cast<uint8_t>(data[i])) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc(const char* data, size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

void put_fixed(std::string& out, uint64_t v, int bytes) {  // little-endian
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// A length-delimited field (wire type 2).
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

std::string event(double wall_time, int64_t step, const std::string& file_version, const std::string& summary) {
  std::string e;
  put_varint(e, 1 << 3 | 1);  // wall_time: 64-bit
  uint64_t bits;
  std::memcpy(&bits, &wall_time, 8);
  put_fixed(e, bits, 8);
  put_varint(e, 2 << 3 | 0);  // step: varint
  put_varint(e, static_cast<uint64_t>(step));
  if (!file_version.empty()) put_bytes(e, 3, file_version);
  if (!summary.empty()) put_bytes(e, 5, summary);
  return e;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

SummaryWriter::SummaryWriter(const std::string& dir) {
  files::make_directories(dir);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  path_ = str_cat(dir, "/events.out.tfevents.", static_cast<int64_t>(now_seconds()), ".", host, ".", getpid());
  file_ = std::fopen(path_.c_str(), "wb");
  MESHTRAIN_CHECK(file_, "--tensorboard ", dir, ": cannot write ", path_, " (", std::strerror(errno),
                  "); give a directory this process may write");
  write_record(event(now_seconds(), 0, "brain.Event:2", ""));
}

SummaryWriter::~SummaryWriter() {
  if (file_) std::fclose(file_);
}

void SummaryWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  std::string v;
  put_bytes(v, 1, tag);
  put_varint(v, 2 << 3 | 5);  // simple_value: 32-bit float
  const float f = static_cast<float>(value);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  put_fixed(v, bits, 4);
  std::string summary;
  put_bytes(summary, 1, v);
  write_record(event(now_seconds(), step, "", summary));
}

void SummaryWriter::write_record(const std::string& data) {
  std::string header;
  put_fixed(header, data.size(), 8);
  std::string record = header;
  put_fixed(record, masked_crc(header.data(), header.size()), 4);
  record += data;
  put_fixed(record, masked_crc(data.data(), data.size()), 4);
  MESHTRAIN_CHECK(std::fwrite(record.data(), 1, record.size(), file_) == record.size() && std::fflush(file_) == 0,
                  "TensorBoard events: writing ", path_, " failed (", std::strerror(errno), ")");
}

}  // namespace train
}  // namespace meshtrain
