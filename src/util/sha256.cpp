#include "util/sha256.h"

#include <openssl/evp.h>

#include <cstdio>

#include "meshtrain/util.h"

namespace meshtrain {

namespace {

EVP_MD_CTX* ctx_of(void* p) { return static_cast<EVP_MD_CTX*>(p); }

}  // namespace

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  MESHTRAIN_CHECK(ctx_ && EVP_DigestInit_ex(ctx_of(ctx_), EVP_sha256(), nullptr) == 1,
                  "SHA-256: OpenSSL could not start a digest");
}

Sha256::~Sha256() { EVP_MD_CTX_free(ctx_of(ctx_)); }

void Sha256::update(const void* data, size_t size) {
  MESHTRAIN_CHECK(EVP_DigestUpdate(ctx_of(ctx_), data, size) == 1, "SHA-256: OpenSSL digest update failed");
}

std::string Sha256::hex_digest() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  MESHTRAIN_CHECK(EVP_DigestFinal_ex(ctx_of(ctx_), digest, &n) == 1 && n == 32, "SHA-256: OpenSSL digest failed");
  char hex[65];
  for (unsigned i = 0; i < 32; ++i) std::snprintf(hex + 2 * i, 3, "%02x", digest[i]);
  return std::string(hex, 64);
}

std::string sha256_hex(const std::string& bytes) {
  Sha256 s;
  s.update(bytes.data(), bytes.size());
  return s.hex_digest();
}

}  // namespace meshtrain
