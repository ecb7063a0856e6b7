#pragma once
// Wire protocol between TcpStore/FailureWatcher and StoreServer. Every message
// is one frame (net::write_frame); the first byte is the command or status.

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

// Replies.
constexpr uint8_t kOk = 100;
constexpr uint8_t kFound = 101;
constexpr uint8_t kMissing = 102;
constexpr uint8_t kFailure = 103;
constexpr uint8_t kError = 104;

}  // namespace store_protocol
}  // namespace comm
}  // namespace meshtrain
