#pragma once

// The UCX (UCP) backend of Transport: one ucp_context and one worker (UCS_THREAD_MODE_SERIALIZED:
// the caller serializes, see transport.h). UCX chooses the transports itself and honours UCX_TLS
// / UCX_NET_DEVICES from the environment.
//
// Checked reads (the default; issue 17). The context has FEATURE_AM only, never FEATURE_RMA:
// with RMA on, UCX 1.13 registers its software-RMA handlers (tcp, shared memory, and any
// transport's active messages), which read and write whatever raw address a connected peer
// names, with no range check. Without it UCX drops such messages ("no handler"). Every read of
// a peer that doesn't map our memory is a GATHER (ucx_gather.cc) whose spans the target checks
// against the grants of the token it carries (transport.h, "Grants"); PostGet is a gather of
// one span; PostPut is refused (rma_put false). What stays unchecked: a peer on this host maps
// slots from AllocateMemory (ucp_rkey_ptr still works without RMA) with the operating system's
// consent, see docs/security.md.
//
// Options::rma (RDMA fabrics, opt-in, untested here: no RDMA hardware): FEATURE_RMA on, memory
// registered remote-read only (UCP_MEM_MAP_PROT_REMOTE_READ: the HCA refuses remote writes),
// rkeys only inside descriptors, which the daemon hands out only over the peer's mTLS channel.
// Create refuses it unless UCX_TLS names only transports with hardware RMA (rc*, dc*), so tcp
// and shared memory never run with RMA. Caveats, documented in docs/security.md: the HCA checks
// the rkey, not the pin, so a grant's end doesn't revoke an rkey (the registration's end does);
// and UCX's software-RMA handlers exist once RMA is on and are reachable over rc's active
// messages too, so this mode is for fabrics whose peers are all trusted.
//
// What UCX 1.13 (Debian, verbs + CMA, no CUDA) does with it, found by trying:
//   UCX_TLS=tcp (+ UCX_NET_DEVICES)  works everywhere. TCP has no hardware GET: reads are
//                  gathers (active messages) served by the TARGET's worker, so the target
//                  daemon must keep polling (transport.h, "Progress").
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
//   Known bug: UCX 1.13's tcp transport completes a zero-copy send twice when its socket fails
//                  under it (uct_tcp_ep_sendv, after uct_tcp_ep_handle_send_err has purged it),
//                  and asserts: a peer SIGKILLed while a gather reply to it was half-written
//                  aborted the serving process ("uct_iface.h:884 Assertion `comp->count > 0'
//                  ... status=-80"). DefaultConfig() sets ZCOPY_THRESH=inf where tcp may carry
//                  the data plane (not on an RDMA host whose UCX_TLS doesn't name tcp), so sends
//                  are copied (bcopy) and fail once; ucx_peer_kill_test kills readers mid-stream
//                  round after round.
//   Known bug: UCX 1.13 aborts the process (an assertion) when a worker is destroyed while a
//                  connection-setup reply to a peer is still queued (fixed upstream by
//                  openucx/ucx#8175). ~UcxTransport flushes the worker first, bounded by
//                  close_timeout, which is enough while peers keep polling.
//
// Mapping of the interface onto UCP:
//   LocalAddress   ucp_worker_get_address, framed by wire.h.
//   RegisterMemory ucp_mem_map once + ucp_rkey_pack; the descriptor carries address, length,
//                  the registration's own token and the packed rkey (wire payload: token[16]
//                  then the rkey). With Options::rma, remote-read only.
//   GrantRead      the same descriptor with the session's token, and a grant of the memory to
//                  that token in the registry until the hold goes.
//   AllocateMemory ucp_mem_map with UCP_MEM_MAP_ALLOCATE: with shared-memory transports enabled
//                  UCX allocates POSIX shared memory, which a peer on the same host can map.
//   Connect        ucp_ep_create from the worker address, UCP_ERR_HANDLING_MODE_PEER and an
//                  error handler; doesn't wait for the peer.
//   ImportRemote   ucp_ep_rkey_unpack on the endpoint (after wire.h validated the bytes), then
//                  ucp_rkey_ptr: when the peer's memory is UCX-allocated shared memory on this
//                  host, UCX maps it into this process.
//   PostGet        from a mapped slot into host memory: a memcpy on the CopyEngine's threads
//                  (UCX 1.13 moves such gets at ~5 GB/s on one core, a memcpy on two cores at
//                  ~19 GB/s on the 2-core dev machine). Otherwise a gather of one span (a span
//                  of up to kSpanBytes goes in one gather; longer ones in pieces), its digest
//                  computed as the reply is scattered; with Options::rma, ucp_get_nbx.
//   PostGetSpans   from a mapped slot: one CopyEngine job copying every span. Otherwise, into
//                  host memory, GATHERS (ucx_gather.cc): one active message names the spans
//                  and the token, the target checks them against the token's grants and
//                  answers with one message carrying their bytes packed (a UCX iov over its
//                  registered memory), and the reply handler scatters them into place, hashing
//                  each span on the way. Larger batches go in several gathers of at most
//                  kGatherBytes. Into CUDA memory: UNIMPLEMENTED without Options::rma (stage
//                  through host memory). With Options::rma, a target that can't serve a gather
//                  (its memory is on a GPU, or serve_gathers = false) answers UNSUPPORTED and
//                  the spans go as ucp_get_nbx, one per span, counted by a Group that reports
//                  once when all are done; so do spans into CUDA memory and spans longer than
//                  kGatherBytes. Without Options::rma such a read fails UNIMPLEMENTED.
//   PostPut        refused (UNIMPLEMENTED): nothing in refit writes into a peer's memory.
//   Poll           ucp_worker_progress until idle (bounded), then hands out completions; an op
//                  UCX finished inside the post call is reported here too.
//   PrepareToSleep ucp_worker_arm (the context has UCP_FEATURE_WAKEUP), only when nothing is in
//                  flight: no op outstanding, no reply or request being sent, no endpoint
//                  closing; UCS_ERR_BUSY (events pending) is false. WakeFd: ucp_worker_get_efd.
//   ArmWhileBusy   ucp_worker_arm with ops, replies or closes in flight too (their progress over
//                  tcp comes with socket events); kCannot while copies are on the CopyEngine.
//   Cancel         marks the endpoint's outstanding ops cancelled; each reports CANCELLED when
//                  UCX is done with it. UCX 1.13 can't abort one RMA op, and closing the ep with
//                  FORCE would also reset the PEER's endpoints to us (they share the transport
//                  connection), so bytes already posted still move.
//   ~Endpoint      cancels as above. When idle and healthy the ucp_ep stays open, parked until
//                  ~UcxTransport (at most kMaxParked; then the oldest gets a flushing close):
//                  UCX pairs it with the peer's endpoint to us, whose gathers are answered on
//                  it, and drops them once it is closed. When failed (as UCX requires) or with
//                  ops outstanding, ucp_ep_close_nbx with FORCE, which aborts them at once
//                  (CANCELLED) but also resets the peer's connections to us. The close
//                  finishes in later Polls (or in ~UcxTransport, bounded by close_timeout).
//
// Peer failure. With UCP_ERR_HANDLING_MODE_PEER, UCX reports a dead peer through the ep's error
// handler and completes its requests with an error; the endpoint turns failed (UNAVAILABLE) and
// every outstanding op reports UNAVAILABLE. A killed process's TCP connections are reset by its
// kernel at once; a silent peer (host down, cable pulled) is found by UCX keepalive
// (UCX_KEEPALIVE_INTERVAL, UCX default 20 s; DefaultConfig() sets 1 s unless the environment
// sets it) and TCP's own timeouts (UCX_TCP_KEEPIDLE, UCX_TCP_KEEPINTVL).
//
// Tuning. DefaultConfig() also sets tcp's send and receive segments to 2 MiB
// (UCX_TCP_TX_SEG_SIZE / UCX_TCP_RX_SEG_SIZE, UCX defaults 8 / 64 KiB) unless the environment
// sets either: a gather's reply of up to 1 MiB is then one fragment, handed over in place,
// where UCX reassembled a multi-fragment one in a buffer it mallocs per message (the engine's
// CPU per 256 MiB over tcp: 0.30 -> 0.11 s).
// And no zero-copy sends where tcp may run (ZCOPY_THRESH=inf unless UCX_ZCOPY_THRESH is set):
// see "Known bug" above.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "daemon/transport/copy_engine.h"
#include "daemon/transport/transport.h"
#include "daemon/transport/ucx/ucx_utils.h"

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
    // Answer peers' gathers (PostGetSpans) with packed bytes. false answers UNSUPPORTED, which
    // makes peers fall back to one get per span: tests of that fallback.
    bool serve_gathers = true;
    // UCP_FEATURE_RMA (see above): refused (FAILED_PRECONDITION) unless UCX_TLS names only rc/dc
    // transports, or rma_any_transport (tests of the RMA code paths only).
    bool rma = false;
    bool rma_any_transport = false;

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
  // The data of the gather replies it has sent (counted as each send completes); gets of peers
  // that mapped its memory, and hardware gets (Options::rma), are not seen here.
  uint64_t bytes_served() const override { return bytes_served_; }
  bool PrepareToSleep() override;
  Armed ArmWhileBusy() override;
  int WakeFd() const override { return wake_fd_; }
  absl::StatusOr<Grant> GrantRead(const LocalMemory& memory, std::string_view token) override;

  // The gather protocol's counters since creation (tests and logs): requests sent; requests
  // answered (with bytes or a refusal); requests refused as malformed, outside this
  // transport's memory or not granted to their token; requests dropped unanswered (no id or no
  // way back, or sent to an active-message id refit doesn't use); replies dropped because their op
  // had already ended (cancelled, endpoint closed or failed).
  uint64_t gathers_sent() const { return gathers_sent_; }
  uint64_t gathers_served() const { return gathers_served_; }
  uint64_t gathers_refused() const { return gathers_refused_; }
  uint64_t gathers_dropped() const { return gathers_dropped_; }
  uint64_t replies_dropped() const { return replies_dropped_; }

  // Implementation types, public only so that the .cc file's UCX callbacks can name them.
  struct MemHolder;
  struct RkeyHolder;
  struct EpState;
  struct Group;
  struct Op;
  struct Gather;
  struct Serve;
  struct Registry;
  struct Outgoing;
  void OnOpDone(Op* op, ucs_status_t status);
  void OnEpError(EpState* ep, ucs_status_t status);
  // Active-message handlers of the gather protocol (ucx_gather.cc).
  ucs_status_t OnGatherRequest(const void* header, size_t header_length, const void* data,
                               size_t length, const ucp_am_recv_param_t* param);
  void OnUnknownAm();
  ucs_status_t OnGatherReply(const void* header, size_t header_length, const void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  void OnServeDone(Serve* serve, ucs_status_t status);
  void OnOutgoingDone(Outgoing* outgoing, ucs_status_t status);
  static void DeleteOutgoing(Outgoing* outgoing);

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
  // Closes `ep`'s ucp_ep, or with `park` keeps an idle healthy one open (see the .cc).
  void CloseEp(const std::shared_ptr<EpState>& ep, bool park = true);
  void ReapCloses();
  absl::Status Post(bool get, UcxEndpoint* endpoint, const LocalMemory& local,
                    uint64_t local_offset, const RemoteMemory& remote, uint64_t remote_offset,
                    uint64_t length, uint64_t cookie);
  absl::Status PostSpans(UcxEndpoint* endpoint, const LocalMemory& local,
                         const RemoteMemory& remote, std::vector<Span> spans, uint64_t cookie);
  void FinishOp(Op* op, ucs_status_t status);  // reports op (or its group) into done_
  // Posts one ucp_get_nbx per span of spans[first, last), each an Op of `group` (which counts
  // them already). Returns how many were posted and sets *failure on an error: the spans not
  // posted count as failed and the group completes with it, except that with `refuse_first` a
  // failure of the very first post finishes nothing (the caller refuses the whole call).
  size_t PostSpanGets(const std::shared_ptr<EpState>& ep, const std::shared_ptr<MemHolder>& mem,
                      MemoryKind kind, const std::shared_ptr<RkeyHolder>& rkey, uint8_t* base,
                      uint64_t remote_address, const std::vector<Span>& spans, size_t first,
                      size_t last, uint64_t cookie, uint64_t epoch,
                      const std::shared_ptr<Group>& group, bool refuse_first,
                      ucs_status_t* failure);
  // ucx_gather.cc: registers the two handlers; posts the spans of one PostGetSpans (or with
  // `single`, the one span of a PostGet, whose completion then carries xxh3 rather than
  // span_xxh3) as gathers (INVALID_ARGUMENT / UNAVAILABLE before anything is posted, as
  // PostGetSpans); fails the
  // gathers of an endpoint that failed or closed (their late replies are dropped).
  absl::Status InitGathers();
  absl::Status PostGathers(const std::shared_ptr<EpState>& ep,
                           const std::shared_ptr<MemHolder>& mem,
                           const std::shared_ptr<RkeyHolder>& rkey, uint8_t* base,
                           uint64_t remote_address, std::vector<Span> spans, uint64_t cookie,
                           bool single);
  void AbortGathers(const EpState* ep, ucs_status_t status);
  void FallBackToGets(Gather* gather);
  // Sends a gather's reply (header with `status`, and serve->iov's bytes if any) on `reply_ep`.
  ucs_status_ptr_t SendReply(ucp_ep_h reply_ep, Serve* serve, uint64_t id, ucs_status_t status);
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
  bool rma_ = false;  // Options::rma: ucp_get_nbx allowed; else every unmapped read is a gather

  std::vector<Done> done_;  // filled by UCX callbacks during progress, drained by Poll
  std::vector<std::shared_ptr<EpState>> newly_failed_;
  std::vector<PendingClose> pending_closes_;
  static constexpr size_t kMaxParked = 256;
  std::vector<std::shared_ptr<EpState>> parked_;  // closed Endpoints whose ucp_ep stays open
  uint64_t outstanding_ = 0;                      // posted, not yet returned by Poll
  uint64_t in_ucx_ = 0;                           // UCX requests whose callback hasn't run
  uint64_t in_copier_ = 0;                        // ops handed to copier_ and not yet drained
  uint64_t activity_ = 0;                         // events ucp_worker_progress reported
  int wake_fd_ = -1;                              // ucp_worker_get_efd, -1 without one
  std::vector<CopyEngine::Finished> copied_;
  uint64_t live_objects_ = 0;

  // The gather protocol (ucx_gather.cc). registry_: this transport's registered memory by
  // address, what a peer's gather may read (shared with AllocateMemory's memory, which may
  // outlive the transport and unregisters itself). gathers_: sent, awaiting their reply.
  // serves_: replies UCX is still sending.
  std::shared_ptr<Registry> registry_;
  bool serve_gathers_ = true;
  // Gather ids come from the kernel's random bytes (getrandom, a batch at a time): a reply is
  // matched to its gather by id alone, so ids a peer could guess would let it answer (fail, or
  // turn to gets) another peer's gathers.
  uint64_t NextGatherId();
  std::vector<uint64_t> random_ids_;
  std::unordered_map<uint64_t, Gather*> gathers_;
  std::unordered_set<Serve*> serves_;
  std::unordered_set<Outgoing*> outgoings_;  // requests UCX is still sending
  uint64_t gathers_sent_ = 0;
  uint64_t gathers_served_ = 0;
  uint64_t bytes_served_ = 0;  // bytes_served(): data of the gather replies sent
  uint64_t gathers_refused_ = 0;
  uint64_t gathers_dropped_ = 0;
  uint64_t replies_dropped_ = 0;
};

}  // namespace refit::transport
