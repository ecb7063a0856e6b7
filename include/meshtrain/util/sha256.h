#pragma once
// SHA-256 (FIPS 180-4), for checkpoint checksums: no crypto library needed.

#include <cstddef>
#include <cstdint>
#include <string>

namespace meshtrain {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  std::string hex_digest();  // finishes; call once

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t length_ = 0;
};

std::string sha256_hex(const std::string& bytes);

}  // namespace meshtrain
