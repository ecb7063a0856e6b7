#pragma once
// MpiCommunicator: Communicator over OpenMPI (a job started by mpirun), each
// collective one non-blocking MPI call (MPI_Iallreduce, MPI_Ibcast,
// MPI_Ireduce_scatter, MPI_Iallgatherv, ...) on an MPI_Comm of its own, so
// OpenMPI picks the algorithm and the transport (shared memory, TCP, the
// cluster's interconnect); small ones travel in the header round instead
// (Note [MPI header round]). Sub-communicators come from MPI_Comm_split.
//
// Waiting: the running operation polls its requests with MPI_Testall, back to
// back for 200 us, then sleeping with a growing backoff (Backoff in
// runtime.h), and
// raises TimeoutError naming the operation and the communicator after
// CommOptions::timeout. MPI cannot cancel a collective, so the communicator is
// unusable afterwards (QueuedCommunicator), the buffers of the pending request
// are kept alive for the rest of the process, and the process will not call
// MPI_Finalize (see Note [Leaving MPI] in runtime.cpp). A dead rank ends the
// whole job (mpirun's doing, see docs/comm.md): there is no PeerFailure here.
//
// Verification (CommOptions::verify, on by default): each collective starts
// with a round of every rank's Header (120 bytes each), compared on every
// rank, so mismatched arguments raise the same MismatchError everywhere
// instead of MPI's undefined behaviour: point to point in groups of up to
// kDirectRoundMax ranks, where the data of a small all_reduce, broadcast,
// all_gather or reduce_scatter rides in it (Note [MPI header round] in
// collectives.cpp), else one MPI_Iallgather. Operations
// whose sizes differ by rank (all_gather, gather, scatter, all_to_all)
// exchange headers regardless.
//
// Reductions: Note [MPI reductions] in runtime.cpp (bfloat16 and float16
// through MPI user operations running meshtrain's reduce_into).
//
// Traffic (Note [MPI traffic]): MPI's algorithm is invisible, so a rank counts
// the bytes it hands to MPI for other ranks and the bytes MPI hands back from
// them, each byte once however many times MPI moves it:
//   all_reduce       S sent, S received (the buffer once each way)
//   reduce           non-root: S sent; root: S received
//   broadcast        root: S sent; others: S received
//   all_gather       own input sent; the other ranks' inputs received
//   reduce_scatter   the other ranks' shards sent; own shard received
//   gather, scatter  the pieces that leave their owner / arrive at theirs
//   all_to_all       the pieces for other ranks sent; theirs received
//   send, recv       the payload; verify: own header sent, others' received
// Nothing is counted for one rank alone.

#include <mpi.h>

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../header.h"
#include "../queued.h"

namespace meshtrain {
namespace comm {
namespace mpi_backend {

struct RecvOp;
struct SendOp;
class RecvWork;
class SendWork;

class MpiCommunicator final : public QueuedCommunicator {
 public:
  // Takes ownership of `comm`, a communicator of its own (duplicated or split),
  // and of `round_comm`, its duplicate for the header round (MPI_COMM_NULL
  // alone or beyond kDirectRoundMax ranks); this process is global_ranks[rank of comm].
  MpiCommunicator(MPI_Comm comm, MPI_Comm round_comm, std::vector<int> global_ranks, CommOptions options);
  // Groups up to this size exchange headers point to point (Note [MPI header round]).
  static constexpr int kDirectRoundMax = 16;
  ~MpiCommunicator() override;

  std::string backend() const override { return "mpi"; }

  std::shared_ptr<Communicator> split(int color, int key, const std::string& label) override;

 protected:
  WorkPtr start_send(const at::Tensor& tensor, int dst, int tag) override;
  WorkPtr start_recv(at::Tensor tensor, int src, int tag) override;
  WorkPtr start_recv_any(int src, int tag) override;

  WorkPtr start_broadcast(at::Tensor tensor, int root) override;
  WorkPtr start_all_reduce(at::Tensor tensor, ReduceOp op) override;
  WorkPtr start_reduce(at::Tensor tensor, int root, ReduceOp op) override;
  WorkPtr start_all_gather(const at::Tensor& input, at::Tensor output) override;
  WorkPtr start_reduce_scatter(const at::Tensor& input, ReduceOp op, at::Tensor output,
                               std::vector<int64_t> counts) override;
  WorkPtr start_gather(const at::Tensor& input, int root) override;
  WorkPtr start_scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root) override;
  WorkPtr start_all_to_all(std::vector<at::Tensor> inputs) override;
  WorkPtr start_barrier() override;

 private:
  friend class RecvWork;
  friend class SendWork;

  // ---- MPI calls and waiting (communicator.cpp)
  // CommError naming the call and the operation when `code` is an MPI error.
  void check(int code, const char* op, const char* call);
  // Waits for `requests` of operation `op`. On timeout, `buffers` (what the
  // requests read or write) are kept alive for good, and TimeoutError names
  // `op`, this communicator and `waiting_for`.
  void wait(std::vector<MPI_Request>& requests, const char* op, std::vector<at::Tensor> buffers,
            const std::string& waiting_for);
  // A non-blocking collective's single request.
  void wait(MPI_Request request, const char* op, std::vector<at::Tensor> buffers);

  // ---- verification and the collectives' shared steps (collectives.cpp)
  // Every rank's header, in rank order (Note [MPI header round]).
  std::vector<Header> exchange_headers(const Header& mine, const char* op);
  // The round's headers, and each peer's inline payload (nullptr where it sent
  // none): `payload_for(p)` rides with this rank's header to peer p (it must
  // fit CommOptions::inline_bytes; groups of up to kDirectRoundMax ranks only).
  struct Round {
    std::vector<Header> headers;
    std::vector<const uint8_t*> payload;
  };
  using PayloadFor = std::function<const at::Tensor*(int)>;
  Round header_round(const Header& mine, const char* op, const PayloadFor& payload_for);
  void post_round_messages(const Header& mine, const char* op, const PayloadFor& payload_for,
                           std::vector<MPI_Request>& first, std::vector<MPI_Request>& second);
  void read_round_headers(Round& round, const char* op, std::vector<MPI_Request>& second);
  std::vector<Header> allgather_headers(const Header& mine, const char* op);
  bool fits_round(int64_t bytes) const { return size() > 1 && direct_round() && bytes <= options_.inline_bytes; }
  // The largest message a peer may send: a header and inline_bytes of payload.
  int64_t message_capacity() const { return static_cast<int64_t>(sizeof(Header)) + options_.inline_bytes; }
  // out := every rank's piece in rank order: `mine`, and the peers' from `round`.
  void reduce_round(const at::Tensor& out, const at::Tensor& mine, const Round& round, ReduceOp op);
  // Collectives whose data fits the round: the round is the collective.
  void small_all_reduce(at::Tensor data, ReduceOp op);
  void small_broadcast(at::Tensor data, int root);
  void small_reduce_scatter(const at::Tensor& flat, at::Tensor out, const std::vector<int64_t>& counts, ReduceOp op);
  bool direct_round() const { return round_comm_ != MPI_COMM_NULL; }
  void verify(const std::vector<Header>& all, const char* op, bool same_shape) const;
  // all_gather's body, also split's exchange of (color, key): `splitting`
  // marks the headers, so a rank splitting while another gathers is a MismatchError.
  void gather_flat(const at::Tensor& input, const at::Tensor& output, bool splitting,
                   std::vector<at::Tensor>& result);
  // all_gather's result from `flat` (every rank's input at its offset), and its traffic.
  void finish_gather(const at::Tensor& input, const at::Tensor& output, const at::Tensor& flat,
                     const std::vector<Header>& all, const std::vector<int64_t>& counts,
                     std::vector<at::Tensor>& result);
  // Counts traffic by Note [MPI traffic] (nothing for one rank alone).
  void add_traffic(OpKind kind, int64_t sent, int64_t received);
  // `numel` as an MPI count (an int); ConfigError beyond.
  int mpi_count(int64_t numel, const char* op) const;

  // ---- point to point (p2p.cpp)
  struct Channel;
  // Posts the header receive of a message from `src` (irecv: into `target`).
  WorkPtr post_recv(int src, int tag, at::Tensor target);
  // Advances the receives posted on `ch` (holding its mutex), in post order;
  // see Note [MPI messages].
  void advance(Channel& ch, int src, int tag);
  // Forgets completed sends (their buffers are no longer MPI's).
  void sweep_sends();
  // Cancels or abandons what is still pending (destructor).
  void drain_p2p();

  MPI_Comm comm_ = MPI_COMM_NULL;
  int spin_us_ = 0;
  // A request that will never complete may use comm_: never free it.
  std::atomic<bool> abandoned_{false};
  at::Tensor headers_;  // the verification round's buffer: size() headers, reused
  // The direct header round's messages travel on a duplicate of comm_, apart
  // from point-to-point tags; its buffers (header + inline payload) are reused.
  MPI_Comm round_comm_ = MPI_COMM_NULL;
  at::Tensor round_send_, round_recv_;
  // A message's bytes (header and inline payload, of the round or point to
  // point) that travel in its first MPI message: what OpenMPI sends eagerly,
  // less its own headers; the rest follows in a second (Note [MPI header round]).
  int64_t first_message_bytes_ = 0;
  // Of a message of `total` bytes, those sent first: all of it, unless it
  // exceeds first_message_bytes_ and the rest fits that too (two eager
  // messages; a rest that would go by rendezvous gains nothing over one).
  int64_t first_part(int64_t total) const {
    return total > first_message_bytes_ && total <= 2 * first_message_bytes_ ? first_message_bytes_ : total;
  }

  // Point-to-point state: the receives posted per (source, tag).
  struct Channel {
    std::mutex mutex;
    std::deque<std::shared_ptr<RecvOp>> posted;  // in post order
    std::string broken;  // a malformed message came: later ones cannot be told apart
  };
  std::mutex channels_mutex_;
  std::map<std::pair<int, int>, std::unique_ptr<Channel>> channels_;  // by (src, tag)
  Channel& channel(int src, int tag);
  std::mutex post_mutex_;   // a message's two parts are posted back to back
  std::mutex sends_mutex_;
  std::vector<std::shared_ptr<SendOp>> sends_;  // not yet known complete
};

}  // namespace mpi_backend
}  // namespace comm
}  // namespace meshtrain
