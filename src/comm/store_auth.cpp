#include "store_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdlib>

#include "meshtrain/comm.h"
#include "comm/store.h"
#include "meshtrain/util.h"
#include "store_protocol.h"

namespace meshtrain {
namespace comm {

std::string rdzv_token_from_env() {
  const char* token = std::getenv("MESHTRAIN_RDZV_TOKEN");
  return token ? token : "";
}

std::string generate_rdzv_token() {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : store_auth::random_bytes(32)) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

namespace store_auth {

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  MESHTRAIN_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(&out[0]), static_cast<int>(n)) == 1,
                  "OpenSSL's random generator failed");
  return out;
}

std::string mac(const std::string& token, const std::string& nonce) {
  const std::string message = "meshtrain-store/1" + nonce;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), out, &size);
  return std::string(reinterpret_cast<const char*>(out), size);
}

bool same_mac(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

bool prove(int fd, const std::string& token, net::Clock::time_point deadline, const std::string& where,
           const std::string& token_origin) {
  std::string frame;
  MESHTRAIN_CHECK(net::read_frame(fd, &frame, deadline), where, " closed the connection before greeting: is it a ",
                  "meshtrain store (MASTER_ADDR/MASTER_PORT), and of this version?");
  net::Reader greeting(frame);
  MESHTRAIN_CHECK(greeting.u8() == store_protocol::kGreeting, where, " did not greet as a meshtrain store");
  const std::string nonce = greeting.str();
  if (nonce.empty()) return false;  // a store without a token
  if (token.empty()) {
    net::write_frame(fd, net::Writer().u8(store_protocol::kDecline).bytes());
    throw ConfigError(str_cat(where, " requires a rendezvous token and this process has none: set ",
                              "MESHTRAIN_RDZV_TOKEN (meshrun sets it for the ranks it starts; with several nodes give "
                              "every node's meshrun the same --rdzv-token-file)"));
  }
  std::string reply;
  const bool answered = net::write_frame(fd, net::Writer().u8(store_protocol::kAuth).str(mac(token, nonce)).bytes()) &&
                        net::read_frame(fd, &reply, deadline);
  MESHTRAIN_CHECK(answered && !reply.empty() && static_cast<uint8_t>(reply[0]) == store_protocol::kOk, where,
                  " refused this process's rendezvous token (", token_origin, "): it is not the job's; give every "
                  "node the same token (the same --rdzv-token-file, or MESHTRAIN_RDZV_TOKEN)");
  return true;
}

}  // namespace store_auth
}  // namespace comm
}  // namespace meshtrain
