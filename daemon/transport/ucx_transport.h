#pragma once

// The UCX (UCP) backend of Transport: one ucp_context with FEATURE_RMA and one worker
// (UCS_THREAD_MODE_SERIALIZED: the caller serializes, see transport.h). UCX chooses the
// transports itself and honours UCX_TLS / UCX_NET_DEVICES from the environment.
//
// What UCX 1.13 (Debian, verbs + CMA, no CUDA) does with it, found by trying:
//   UCX_TLS=tcp (+ UCX_NET_DEVICES)  works everywhere. TCP has no hardware GET, so UCX emulates
//                  it with active messages served by the TARGET's worker: the target daemon must
//                  keep polling (transport.h, "Progress"). PUT is native (put_zcopy).
//   rc/dc/ud (verbs)  InfiniBand/RoCE hosts; they support peer-failure handling.
//   shared memory (posix, sysv, self): refused for endpoints with peer-failure handling
//                  ("no peer failure handler") unless UCX_POSIX_ERROR_HANDLING=y and
//                  UCX_SYSV_ERROR_HANDLING=y (the operator's choice; without them two daemons on
//                  one host talk TCP over loopback). With them, a dead peer is detected, but a
//                  peer killed while it writes into this worker's shared receive FIFO (replies
//                  to gets of memory UCX did not allocate) can leave the FIFO stuck, and then
//                  neither that peer's ops nor other peers' complete (seen in about half the
//                  runs of the conformance case "a peer killed mid-transfer ..."). Gets of
//                  AllocateMemory memory don't use the FIFO (they are memcpy, below), which is
//                  what refitd reads on a host without a GPU. cma has no active messages and
//                  UCP 1.13 doesn't use it for RMA.
//   Known bug: UCX 1.13 aborts the process (an assertion) when a worker is destroyed while a
//                  connection-setup reply to a peer is still queued (fixed upstream by
//                  openucx/ucx#8175). ~UcxTransport flushes the worker first, bounded by
//                  close_timeout, which is enough while peers keep polling.
//
// Mapping of the interface onto UCP:
//   LocalAddress   ucp_worker_get_address, framed by wire.h.
//   RegisterMemory ucp_mem_map once + ucp_rkey_pack; the descriptor carries address, length and
//                  the packed rkey.
//   AllocateMemory ucp_mem_map with UCP_MEM_MAP_ALLOCATE: with shared-memory transports enabled
//                  UCX allocates POSIX shared memory, which a peer on the same host can map.
//   Connect        ucp_ep_create from the worker address, UCP_ERR_HANDLING_MODE_PEER and an
//                  error handler; doesn't wait for the peer.
//   ImportRemote   ucp_ep_rkey_unpack on the endpoint (after wire.h validated the bytes), then
//                  ucp_rkey_ptr: when the peer's memory is UCX-allocated shared memory on this
//                  host, UCX maps it into this process.
//   PostGet        ucp_get_nbx; its callback means the bytes have arrived. When the remote is
//                  mapped and the local memory is host memory, a memcpy on the CopyEngine's
//                  threads instead: UCX 1.13 moves such gets at ~5 GB/s on one core, a memcpy on
//                  two cores at ~19 GB/s (measured on the 2-core dev machine).
//   PostGetSpans   from a mapped slot: one CopyEngine job copying every span; otherwise one
//                  ucp_get_nbx per span, counted by a Group that reports once when all are done.
//   PostPut        ucp_put_nbx + ucp_ep_flush_nbx; the flush's callback means the bytes are in
//                  the remote buffer (a put's own callback only frees the local buffer).
//   Poll           ucp_worker_progress until idle (bounded), then hands out completions; an op
//                  UCX finished inside the post call is reported here too.
//   Cancel         marks the endpoint's outstanding ops cancelled; each reports CANCELLED when
//                  UCX is done with it. UCX 1.13 can't abort one RMA op, and closing the ep with
//                  FORCE would also reset the PEER's endpoints to us (they share the transport
//                  connection), so bytes already posted still move.
//   ~Endpoint      cancels as above, then ucp_ep_close_nbx: a flushing close when idle; FORCE
//                  when failed (as UCX requires) or when ops are outstanding, which aborts them
//                  at once (CANCELLED) but also resets the peer's connections to us. The close
//                  finishes in later Polls (or in ~UcxTransport, bounded by close_timeout).
//
// Peer failure. With UCP_ERR_HANDLING_MODE_PEER, UCX reports a dead peer through the ep's error
// handler and completes its requests with an error; the endpoint turns failed (UNAVAILABLE) and
// every outstanding op reports UNAVAILABLE. A killed process's TCP connections are reset by its
// kernel at once; a silent peer (host down, cable pulled) is found by UCX keepalive
// (UCX_KEEPALIVE_INTERVAL, UCX default 20 s; DefaultConfig() sets 1 s unless the environment
// sets it) and TCP's own timeouts (UCX_TCP_KEEPIDLE, UCX_TCP_KEEPINTVL).
//
// Tuning. DefaultConfig() also sets tcp's send segment to 64 KiB (UCX_TCP_TX_SEG_SIZE, UCX
// default 8 KiB) unless the environment sets it: gets over tcp run ~1.6x faster.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/transport/copy_engine.h"
#include "daemon/transport/transport.h"
#include "daemon/transport/ucx_utils.h"

namespace refit::transport {

class UcxTransport final : public Transport {
 public:
  struct Options {
    // UCX settings given without the "UCX_" prefix, e.g. {"KEEPALIVE_INTERVAL", "1s"}. Each
    // applies only when the environment doesn't set UCX_<name>, so an operator always wins.
    std::vector<std::pair<std::string, std::string>> config = DefaultConfig();
    // How long ~UcxTransport keeps progressing to finish closing endpoints.
    std::chrono::milliseconds close_timeout{2000};
    // UCP_ERR_HANDLING_MODE_PEER on every endpoint: a dead peer fails ops with UNAVAILABLE.
    // false (UCP_ERR_HANDLING_MODE_NONE) lets UCX use transports without peer-failure support
    // (UCX 1.13's shared memory) and breaks the failure contract: a dead peer may go unnoticed
    // and its ops may never complete. Tests and benchmarks only.
    bool peer_failure_handling = true;
    // Threads that copy to and from mapped peer memory; 0 means CopyEngine::DefaultThreads().
    int copy_threads = 0;

    static std::vector<std::pair<std::string, std::string>> DefaultConfig();
  };

  // INVALID_ARGUMENT for a bad Options::config value; FAILED_PRECONDITION when UCX finds no
  // usable transport.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create() { return Create(Options()); }
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(const Options& options);
  ~UcxTransport() override;  // aborts if an object it created is still alive

  const Capabilities& capabilities() const override { return capabilities_; }
  const std::string& LocalAddress() const override { return address_; }
  absl::StatusOr<std::unique_ptr<LocalMemory>> RegisterMemory(void* address, uint64_t length,
                                                              MemoryKind kind) override;
  absl::StatusOr<std::unique_ptr<LocalMemory>> AllocateMemory(uint64_t length) override;
  absl::StatusOr<std::unique_ptr<Endpoint>> Connect(std::string_view peer_address) override;
  size_t Poll(std::vector<Completion>* out) override;
  uint64_t outstanding() const override { return outstanding_; }
  uint64_t activity() const override { return activity_; }

  // Implementation types, public only so that the .cc file's UCX callbacks can name them.
  struct MemHolder;
  struct RkeyHolder;
  struct EpState;
  struct Group;
  struct Op;
  void OnOpDone(Op* op, ucs_status_t status);
  void OnEpError(EpState* ep, ucs_status_t status);

 private:
  class UcxLocalMemory;
  class UcxRemoteMemory;
  class UcxEndpoint;
  // An op UCX has finished (or that finished inside its post call), awaiting Poll.
  struct Done {
    std::shared_ptr<EpState> ep;
    uint64_t cookie;
    uint64_t epoch;
    ucs_status_t status;
    bool hashed = false;  // a CopyEngine get: xxh3 is the digest of its bytes (or span_xxh3
    uint64_t xxh3 = 0;    // of each span's)
    std::vector<uint64_t> span_xxh3{};
  };
  struct PendingClose {
    void* request;
    std::shared_ptr<EpState> ep;
  };

  UcxTransport() = default;
  absl::Status Init(const Options& options);
  void CloseEp(const std::shared_ptr<EpState>& ep);
  void ReapCloses();
  absl::Status Post(bool get, UcxEndpoint* endpoint, const LocalMemory& local,
                    uint64_t local_offset, const RemoteMemory& remote, uint64_t remote_offset,
                    uint64_t length, uint64_t cookie);
  absl::Status PostSpans(UcxEndpoint* endpoint, const LocalMemory& local,
                         const RemoteMemory& remote, std::vector<Span> spans, uint64_t cookie);
  void FinishOp(Op* op, ucs_status_t status);  // reports op (or its group) into done_
  // INVALID_ARGUMENT unless `local` is this transport's and `remote` was imported on `endpoint`.
  absl::Status CheckHandles(const UcxEndpoint& endpoint, const LocalMemory& local,
                            const RemoteMemory& remote, const UcxLocalMemory** local_memory,
                            const UcxRemoteMemory** remote_memory) const;
  absl::Status Resolve(const Done& done);
  void DrainCopier();  // finished CopyEngine ops -> done_
  // Wraps a fresh registration (owned: AllocateMemory's, which may outlive this transport).
  absl::StatusOr<std::unique_ptr<LocalMemory>> MakeLocalMemory(void* address, uint64_t length,
                                                               MemoryKind kind, ucp_mem_h memh,
                                                               bool owned);

  // Declaration order matters: the worker must go before the context. Memory from
  // AllocateMemory shares the context, which therefore lives until the last such memory goes.
  std::shared_ptr<ucp_context> context_;
  ucx::WorkerPtr worker_;
  std::unique_ptr<CopyEngine> copier_;
  Capabilities capabilities_;
  std::string address_;
  uint64_t identity_ = 0;
  std::chrono::milliseconds close_timeout_{0};
  bool peer_failure_handling_ = true;

  std::vector<Done> done_;  // filled by UCX callbacks during progress, drained by Poll
  std::vector<std::shared_ptr<EpState>> newly_failed_;
  std::vector<PendingClose> pending_closes_;
  uint64_t outstanding_ = 0;  // posted, not yet returned by Poll
  uint64_t in_ucx_ = 0;       // UCX requests whose callback hasn't run
  uint64_t in_copier_ = 0;    // ops handed to copier_ and not yet drained
  uint64_t activity_ = 0;     // events ucp_worker_progress reported
  std::vector<CopyEngine::Finished> copied_;
  uint64_t live_objects_ = 0;
};

}  // namespace refit::transport
