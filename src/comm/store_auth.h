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
// its challenge; returns whether the store takes a token (false: it serves any
// client). ConfigError naming `where` and `token_origin` (where this process's
// token came from) when the store wants a token this process lacks (the store
// is told, kDecline) or refuses the one it has.
bool prove(int fd, const std::string& token, net::Clock::time_point deadline, const std::string& where,
           const std::string& token_origin);

}  // namespace store_auth
}  // namespace comm
}  // namespace meshtrain
