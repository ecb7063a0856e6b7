#pragma once
// The store's challenge-response (Note [Store authentication] in
// store_protocol.h), through OpenSSL's HMAC and random generator.

#include <string>

#include "socket.h"

namespace meshtrain {
namespace comm {
namespace store_auth {

// n bytes from OpenSSL's CSPRNG.
std::string random_bytes(size_t n);
// HMAC-SHA256(token, "meshtrain-store/1" + nonce).
std::string mac(const std::string& token, const std::string& nonce);
// Constant-time comparison of two MACs.
bool same_mac(const std::string& a, const std::string& b);
// The client's side, right after connecting: reads the greeting and answers
// its challenge. ConfigError naming `where` when the store wants a token this
// process lacks, or refuses the one it has.
void prove(int fd, const std::string& token, net::Clock::time_point deadline, const std::string& where);

}  // namespace store_auth
}  // namespace comm
}  // namespace meshtrain
