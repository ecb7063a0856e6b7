#pragma once
// SHA-256 (FIPS 180-4), for checkpoint checksums, through OpenSSL's libcrypto
// (its EVP interface uses the CPU's SHA extensions: ~1.8 GB/s here, against
// ~0.28 GB/s for the portable implementation meshtrain had; bench_checkpoint_hash).

#include <cstddef>
#include <cstdint>
#include <string>

namespace meshtrain {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t size);
  std::string hex_digest();  // finishes; call once

 private:
  void* ctx_;  // EVP_MD_CTX
};

std::string sha256_hex(const std::string& bytes);

}  // namespace meshtrain
