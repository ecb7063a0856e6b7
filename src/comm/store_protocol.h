#pragma once
// Wire protocol between TcpStore/FailureWatcher and StoreServer. Every message
// is one frame (net::write_frame); the first byte is the command or status.
//
// Note [Store authentication]
// On accept the server sends kGreeting with a nonce: 32 random bytes when the
// job has a token (MESHTRAIN_RDZV_TOKEN; meshrun makes one per job), empty
// when it has none. With a nonce, the client's first frame must be kAuth with
// HMAC-SHA256(token, "meshtrain-store/1" + nonce); anything else, a wrong MAC,
// or no answer within a few seconds closes the connection, and the server says
// so on stderr. The token itself never crosses the wire, and a recorded answer
// is useless against the next nonce.
//
// A client without a token greeted with a nonce sends kDecline before it
// closes, so that the store's side learns of the mismatch too. Nothing a
// client sends before it proved the token is acted on: a kDecline, a wrong
// MAC or a request first only closes the connection, is said on stderr, and
// the first few are recorded under kRefusalsKey, which the launchers and ranks
// waiting for the others mention in their waiting lines and time-outs. A
// stranger's five bytes used to stop every node's rendezvous at once (Note
// [Token mismatch] in app/launch/launcher.cpp). The opposite case, a client
// with a token greeted without a nonce, is served (TcpStore::authenticated()
// says so); meshrun and the ranks refuse it themselves.

#include <cstdint>

namespace meshtrain {
namespace comm {
namespace store_protocol {

// Requests.
constexpr uint8_t kSet = 1;     // key, value            -> kOk
constexpr uint8_t kGet = 2;     // key                   -> kFound value | kMissing
constexpr uint8_t kAdd = 3;     // key, delta            -> kOk value
constexpr uint8_t kCheck = 4;   // key                   -> kFound | kMissing
constexpr uint8_t kHello = 6;   // label                 -> kOk
constexpr uint8_t kBye = 7;     //                       -> kOk
constexpr uint8_t kWatch = 8;   // prefix                -> kFailure label reason, pushed
constexpr uint8_t kReport = 9;  // label, reason         -> kOk
constexpr uint8_t kAuth = 10;   // mac                   -> kOk | kError and close
constexpr uint8_t kDecline = 11;  //                     -> close (the client has no token)
constexpr uint8_t kHeartbeat = 12;  // both ways on a watcher's connection, no reply (Note [Heartbeats])

// Replies.
constexpr uint8_t kOk = 100;
constexpr uint8_t kFound = 101;
constexpr uint8_t kMissing = 102;
constexpr uint8_t kFailure = 103;
constexpr uint8_t kError = 104;
constexpr uint8_t kGreeting = 105;  // nonce ("" : the store takes no token), sent by the server on accept

}  // namespace store_protocol
}  // namespace comm
}  // namespace meshtrain
