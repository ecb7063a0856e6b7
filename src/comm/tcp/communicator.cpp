// TcpCommunicator: construction, the operation queue, point-to-point messages
// and the transfer/wait primitives every algorithm uses. Collectives are in
// collectives.cpp.

#include "communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "../backend.h"
#include "comm/host_profile.h"
#include "../store_auth.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

namespace {

constexpr uint64_t kCollectiveBit = 1ull << 62;
constexpr uint64_t kP2PBit = 2ull << 62;
constexpr uint64_t kPairProofBit = 3ull << 62;

// Note [Authenticated pairs]
// The store admits only processes that know the job's token (Note [Store
// authentication]), and the ranks' transport addresses travel only through
// it, but a link is a plain TCP connection whose handshake does not
// authenticate: a stranger who reaches a rank's port could take a peer's
// place. So when the job has a token, every pair proves it right after the
// links connect them: each rank sends each peer a fresh 32-byte nonce and answers
// the peer's nonce with HMAC-SHA256(token, "gloo-pair" + nonce + from + to)
// over global ranks (the direction is in the MAC, so a reflected answer does
// not pass). A pair that fails is refused before any collective runs. It costs
// two small messages per pair when a communicator is made. It proves who
// connected, not what travels later: a machine in the network path could
// relay the proof and then alter the traffic (that needs TLS).
std::string pair_proof(const std::string& token, const std::string& nonce, int from, int to) {
  return store_auth::mac(token, str_cat("gloo-pair", nonce, from, "->", to));
}

// Sends `mine[p]` to every peer p and receives `theirs[p]` (same sizes) on `slot`.
using Exchange = std::function<void(const std::vector<std::string>& mine, std::vector<std::string>& theirs,
                                    uint64_t slot)>;

Exchange exchange_on_links(tcp::Links& links, int rank, std::chrono::milliseconds timeout, const std::string& label) {
  return [&links, rank, timeout, label](const std::vector<std::string>& mine, std::vector<std::string>& theirs,
                                        uint64_t slot) {
    std::vector<Posted> requests;
    for (int p = 0; p < static_cast<int>(mine.size()); ++p) {
      if (p == rank) continue;
      requests.emplace_back(&links, links.send(p, slot, mine[p].data(), mine[p].size()));
      requests.emplace_back(&links, links.recv(p, slot, &theirs[p][0], theirs[p].size()));
    }
    for (auto& r : requests) {
      const WaitResult result = links.wait(*r, timeout);
      if (result == WaitResult::kDone && (!r->is_recv || r->received == r->size)) {
        r.reset();
        continue;
      }
      const bool wrong_size = result == WaitResult::kDone || result == WaitResult::kTooLarge;
      const std::string why = result == WaitResult::kTimeout ? str_cat("no reply within ", timeout.count(), " ms")
                              : wrong_size ? str_cat("a reply of ", r->received, " bytes where ", r->size, " were expected")
                                           : links.broken_reason(r->peer);
      throw TimeoutError(str_cat("connecting communicator '", label, "': the proof exchange with rank ",
                                 r->peer, " failed: ", why));
    }
  };
}

// Every peer proves it knows `token` (Note [Authenticated pairs]). ConfigError
// naming the first peer that does not.
void prove_pairs(const Exchange& exchange, int rank, const std::vector<int>& global, const std::string& token,
                 const std::string& label) {
  const int size = static_cast<int>(global.size());
  const std::string nonce = store_auth::random_bytes(32);
  std::vector<std::string> nonces(size, nonce), theirs(size, std::string(32, '\0'));
  exchange(nonces, theirs, kPairProofBit);
  std::vector<std::string> answers(size), proofs(size);
  for (int p = 0; p < size; ++p) {
    answers[p] = pair_proof(token, theirs[p], global[rank], global[p]);
    proofs[p] = std::string(answers[p].size(), '\0');
  }
  exchange(answers, proofs, kPairProofBit | 1);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    MESHTRAIN_CHECK(store_auth::same_mac(proofs[p], pair_proof(token, nonce, global[p], global[rank])),
                    "communicator '", label, "': the connection of rank ", p, " (global rank ", global[p],
                    ") did not prove it knows the job's token; refused (a process that is not this job's rank "
                    "took its place)");
  }
}

uint64_t p2p_slot(int tag, bool data) {
  return kP2PBit | (static_cast<uint64_t>(tag) << 1) | (data ? 1 : 0);
}

}  // namespace

// Note [Gloo transports]
// The Gloo backend's messages travel over meshtrain's TCP links (tcp/links.h:
// progressed by the waiting thread, eager sends; Note [Links: progress on the
// waiting thread]). libgloo's TCP transport, the other choice until
// 2026-12 (MESHTRAIN_GLOO_TRANSPORT=gloo), was removed: measured side by
// side with the links it was slower at all but one size in forty, by up to
// 80x for small messages (docs/comm.md, "Transports"), and a surviving rank
// could die of SIGPIPE inside libgloo when a peer died mid-collective.

TcpCommunicator::TcpCommunicator(std::shared_ptr<Process> process, std::vector<int> global_ranks,
                                   int rank, const std::string& store_prefix, CommOptions options)
    : QueuedCommunicator(std::move(global_ranks), rank, std::move(options)),
      process_(std::move(process)),
      prefix_(store_prefix) {
  connect_links();
  doubling_ = doubling_applies(size()) && options_.tuning.tcp.doubling_round;
  const std::string& mine = process_->host_of(global_ranks_[rank_]);
  for (int g : global_ranks_) remote_.push_back(process_->host_of(g) != mine);
}

TcpCommunicator::~TcpCommunicator() {
  stop_worker();
  links_.reset();
}

// A rank that died while the others connected: the failure watcher names it.
void TcpCommunicator::throw_failed_peer_if_any() const {
  if (auto f = process_->await_failure(std::chrono::milliseconds(500))) {
    const int r = Process::rank_of_label(f->label);
    throw PeerFailure(str_cat("connecting communicator '", options_.label, "': rank ", r, " failed: ", f->reason), r);
  }
}

void TcpCommunicator::connect_links() {
  PrefixStore store(prefix_, process_->store());
  try {
    links_ = std::make_unique<tcp::Links>(store, rank_, size(), process_->config().bind_host, options_.timeout,
                                          options_.label);
    // Spinning only pays when every rank of this host has a core of its own, for
    // as long as this host's wake-up costs (Note [Self-tuned waits]); otherwise
    // waiters yield (Note [Link waits on shared cores]).
    const bool own_core = process_->ranks_on_my_host() <= available_cores();
    const TcpTuning& set = options_.tuning.tcp;
    WaitTuning waits = choose_link_wait(host_profile(), own_core);
    waits.spin = set.spin.value_or(waits.spin);
    if (set.yield) waits.yield = waits.large_yield = *set.yield;  // set: every wait's budget, whatever its size
    links_->set_waits(waits);
    // Bytes in flight to a rank of this host fit its cache (Note [Link buffers sized to the cache]):
    // the peers that send to it at once are this communicator's members on the host.
    const std::string& my_host = process_->host_of(global_ranks_[rank_]);
    const auto peers_here = std::count_if(global_ranks_.begin(), global_ranks_.end(),
                                          [&](int g) { return process_->host_of(g) == my_host; }) - 1;
    const LinkBuffer buffer = choose_link_buffer(host_profile(), static_cast<int>(peers_here));
    links_->set_local_buffer(set.buffer_bytes.value_or(buffer.bytes));
    if (!process_->store()->token().empty()) {
      prove_pairs(exchange_on_links(*links_, rank_, options_.timeout, options_.label), rank_, global_ranks_,
                  process_->store()->token(), options_.label);
    }
  } catch (const TimeoutError&) {
    throw_failed_peer_if_any();  // a rank died while the others connected: named
    throw;
  }
}

// ---- transfers

uint64_t TcpCommunicator::collective_slot(int sub) const {
  return kCollectiveBit | ((op_seq() & ((1ull << 46) - 1)) << 16) | static_cast<uint64_t>(sub & 0xffff);
}

Transfer TcpCommunicator::describe_transfer(int peer, bool is_recv, size_t bytes, OpKind kind) const {
  Transfer t;
  t.peer = peer;
  t.is_recv = is_recv;
  t.bytes = bytes;
  t.kind = kind;
  t.op = kind == OpKind::kVerify ? running_op() : op_name(kind);
  return t;
}

Transfer TcpCommunicator::post_send(const void* ptr, size_t bytes, int peer, uint64_t slot,
                                     OpKind kind, bool hold) {
  Transfer t = describe_transfer(peer, /*is_recv=*/false, bytes, kind);
  t.req = Posted(transport(), transport()->send(peer, slot, ptr, bytes, hold));
  return t;
}

Transfer TcpCommunicator::post_recv(void* ptr, size_t bytes, int peer, uint64_t slot,
                                     OpKind kind) {
  Transfer t = describe_transfer(peer, /*is_recv=*/true, bytes, kind);
  t.req = Posted(transport(), transport()->recv(peer, slot, ptr, bytes));
  return t;
}

void TcpCommunicator::wait(Transfer& t) {
  // A deferred header round first: no collective's data is used unverified.
  // Only a collective's own waits settle it (they run on the thread that
  // deferred it; point-to-point waits run on their callers' threads).
  const bool collective_data = t.kind != OpKind::kSend && t.kind != OpKind::kRecv && t.kind != OpKind::kVerify;
  if (collective_data) settle_round();
  if (!t.req) return;
  // A long wait is recorded for whoever times out on this rank (Note [Naming a stuck rank]).
  Transport* transport = this->transport();
  process_->register_wait(t.req.get(), global_ranks_[t.peer], long_wait(), [transport] { transport->abort(); });
  const WaitResult result = transport->wait(*t.req, options_.timeout);
  process_->unregister_wait(t.req.get(), result == WaitResult::kDone);
  switch (result) {
    case WaitResult::kDone: break;
    case WaitResult::kTimeout: throw_timeout(t);
    case WaitResult::kBroken: throw_broken_connection(t, transport->broken_reason(t.peer));
    case WaitResult::kAborted: throw_aborted(t);
    case WaitResult::kTooLarge:
      throw MismatchError(str_cat(where(t.op), ": ", peer_name(t.peer), " sent ", t.req->received,
                                  " bytes where this rank expected at most ", t.bytes,
                                  " (the ranks passed different sizes)"));
  }
  const int64_t bytes = static_cast<int64_t>(t.bytes);
  count(t.kind, t.peer, t.is_recv ? 0 : bytes, t.is_recv ? bytes : 0);
  t.req.reset();
}

void TcpCommunicator::throw_timeout(const Transfer& t) const {
  const std::string what = str_cat(where(t.op), ": no progress for ", options_.timeout.count(), " ms while ",
                                   t.is_recv ? "receiving from " : "sending to ", peer_name(t.peer));
  process_->raise_stuck(global_ranks_[t.peer], where(t.op), what,  // Note [Naming a stuck rank]
                        str_cat("that rank is stuck, or did not call ", t.op,
                                " (every rank must call collectives in the same order)"));
}

void TcpCommunicator::throw_broken_connection(const Transfer& t, const std::string& what) const {
  // A peer died. The failure watcher usually names it within milliseconds;
  // wait briefly for it rather than guess.
  if (auto f = process_->await_failure(std::chrono::seconds(2))) Process::raise_failure(where(t.op), *f);
  throw PeerFailure(str_cat(where(t.op), ": the connection to ", peer_name(t.peer), " broke: ", what),
                    global_ranks_[t.peer]);
}

// The failure watcher aborted the wait: it knows which rank died.
void TcpCommunicator::throw_aborted(const Transfer& t) const {
  if (auto f = process_->failure()) Process::raise_failure(where(t.op), *f);
  throw PeerFailure(str_cat(where(t.op), ": aborted, with no failure reported"), -1);
}

void TcpCommunicator::wait_all(std::vector<Transfer>& transfers) {
  for (auto& t : transfers) wait(t);
}

void TcpCommunicator::send_and_wait(const at::Tensor& t, int peer, OpKind kind) {
  Transfer transfer = post_send(t.data_ptr(), t.nbytes(), peer, collective_slot(0), kind);
  wait(transfer);
}

void TcpCommunicator::count(OpKind kind, int peer, int64_t sent, int64_t received) {
  if (sent != 0) counter_.add_sent(kind, sent, remote_[peer]);
  if (received != 0) counter_.add_received(kind, received, remote_[peer]);
}

// ---- point to point

namespace {

// A point-to-point operation: posted at once, completed by wait() on the caller's thread.
class P2PWork : public Work {
 public:
  explicit P2PWork(std::function<void(std::vector<at::Tensor>&)> finish)
      : finish_(std::move(finish)) {}
  void wait() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
    done_ = true;
    try {
      finish_(result_);
    } catch (...) {
      error_ = std::current_exception();
    }
    finish_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

 private:
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
  std::function<void(std::vector<at::Tensor>&)> finish_;
};

}  // namespace

// Note [Point-to-point messages]
// A message is a Header (dtype, shape), followed in the same gloo message by
// the payload when it fits CommOptions::inline_bytes, else by a second message.
// The receiver posts a buffer of header + inline_bytes at irecv time, so small
// payloads (pipeline activations of small models) arrive while the receiver
// computes and cost no extra round trip; a payload too large for the buffer is
// announced by its header and received into a tensor of the announced size, so
// a receiver can never be overrun.

WorkPtr TcpCommunicator::start_send(const at::Tensor& tensor, int dst, int tag) {
  counter_.add_call(OpKind::kSend);
  at::Tensor data = tensor.contiguous();
  Header header = header_of(data, OpKind::kSend);
  const bool inline_payload = fits_inline(static_cast<int64_t>(data.nbytes()));
  header.inline_bytes = inline_payload ? static_cast<int64_t>(data.nbytes()) : 0;
  auto message = std::make_shared<at::Tensor>(at::empty({static_cast<int64_t>(sizeof(Header)) + header.inline_bytes}, at::kByte));
  std::memcpy(message->data_ptr(), &header, sizeof(Header));
  if (inline_payload && data.nbytes() > 0) {
    std::memcpy(static_cast<uint8_t*>(message->data_ptr()) + sizeof(Header), data.data_ptr(), data.nbytes());
  }
  auto h = std::make_shared<Transfer>(post_send(message->data_ptr(), message->nbytes(), dst, p2p_slot(tag, false), OpKind::kVerify));
  h->op = "send";
  count(OpKind::kSend, dst, header.inline_bytes, 0);  // the payload part of that message
  count(OpKind::kVerify, dst, -header.inline_bytes, 0);
  auto d = std::make_shared<Transfer>();
  if (!inline_payload && data.numel() > 0) {
    *d = post_send(data.data_ptr(), data.nbytes(), dst, p2p_slot(tag, true), OpKind::kSend);
  }
  return std::make_shared<P2PWork>([this, message, data, h, d](std::vector<at::Tensor>&) {
    wait(*h);
    wait(*d);
  });
}

namespace {

// The receiving side of a point-to-point message (see the Note).
struct Incoming {
  at::Tensor buffer;  // header + inline capacity
  Transfer header;
  const Header& get() const { return *static_cast<const Header*>(buffer.data_ptr()); }
  const uint8_t* payload() const { return static_cast<const uint8_t*>(buffer.data_ptr()) + sizeof(Header); }
};

}  // namespace

WorkPtr TcpCommunicator::start_recv(at::Tensor tensor, int src, int tag) {
  auto work = start_recv_any(src, tag);
  return std::make_shared<P2PWork>([this, work, tensor, src, tag](std::vector<at::Tensor>& out) {
    work->wait();
    const at::Tensor& got = work->result().at(0);
    if (got.scalar_type() != tensor.scalar_type() || got.sizes() != tensor.sizes()) {
      throw MismatchError(str_cat(where("recv"), ": ", peer_name(src), " sent ", describe(header_of(got, OpKind::kSend)),
                                  " with tag ", tag, " but the receiving tensor is ", describe(header_of(tensor, OpKind::kSend))));
    }
    tensor.copy_(got);
    out = {tensor};
  });
}

WorkPtr TcpCommunicator::start_recv_any(int src, int tag) {
  counter_.add_call(OpKind::kRecv);
  auto in = std::make_shared<Incoming>();
  const int64_t capacity = static_cast<int64_t>(sizeof(Header)) + options_.inline_bytes;
  in->buffer = at::empty({capacity}, at::kByte);
  in->header = post_recv(in->buffer.data_ptr(), capacity, src, p2p_slot(tag, false), OpKind::kVerify);
  in->header.op = "recv";
  return std::make_shared<P2PWork>([this, in, capacity, src, tag](std::vector<at::Tensor>& out) {
    wait(in->header);
    const Header& h = in->get();
    if (h.magic != Header().magic || h.ndim < 0 || h.ndim > 8 || h.inline_bytes < 0 || h.inline_bytes > options_.inline_bytes) {
      throw CommError(str_cat(where("recv"), ": malformed message header from ", peer_name(src)));
    }
    // wait() counted the posted capacity: count what arrived, the payload as data.
    count(OpKind::kVerify, src, 0, static_cast<int64_t>(sizeof(Header)) - capacity);
    count(OpKind::kRecv, src, 0, h.inline_bytes);
    at::Tensor t = at::empty(shape_of(h), at::TensorOptions().dtype(static_cast<at::ScalarType>(h.dtype)));
    if (h.inline_bytes > 0) {
      MESHTRAIN_CHECK(static_cast<int64_t>(t.nbytes()) == h.inline_bytes, where("recv"), ": inconsistent header from ", peer_name(src));
      std::memcpy(t.data_ptr(), in->payload(), h.inline_bytes);
    } else if (t.numel() > 0) {
      Transfer d = post_recv(t.data_ptr(), t.nbytes(), src, p2p_slot(tag, true), OpKind::kRecv);
      wait(d);
    }
    in->buffer = at::Tensor();
    out = {t};
  });
}

// ---- split

std::shared_ptr<Communicator> TcpCommunicator::split(int color, int key, const std::string& label) {
  return split_communicator(*this, process_, prefix_, splits_++, color, key, label);
}

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
