#pragma once

// An in-process Transport: memcpy between InprocTransport instances of one process, for unit and
// integration tests of the packages above the transport (several "daemons" in one test binary).
//
// It behaves like the UCX backend where callers can tell: addresses and descriptors are opaque,
// checksummed bytes; a Post never completes synchronously (the copy happens in a later Poll of
// the POSTING transport); completions carry the same statuses; connecting to a transport that
// doesn't exist succeeds and the endpoint then fails. Deliberate differences: the target never
// needs to poll; Cancel drops ops not yet executed (UCX lets them finish), and closing an
// endpoint never disturbs the peer's own endpoints; ops on a region its owner has deregistered
// complete with FAILED_PRECONDITION (UCX would read stale memory).
//
// Fault injection: FailEndpoint() breaks one connection; SimulateCrash() makes this transport
// behave like a process killed with SIGKILL (every endpoint to it, and each of its own, fails at
// its transport's next Poll: outstanding ops complete with UNAVAILABLE, later posts are refused).
// set_max_ops_per_poll() slows transfers down so tests can observe ops in flight.
//
// Threads: the rules of transport.h apply to each instance. Different instances may be used from
// different threads at the same time (each "daemon" on its own data-plane thread); they share a
// process-wide registry guarded by a mutex, and a copy holds the target's lock, so a target's
// RegisterMemory / deregistration never races with a peer's copy.

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "daemon/transport/transport.h"

namespace refit::transport {

class InprocTransport final : public Transport {
 public:
  struct Options {
    // Ops executed per Poll, 0 for no limit. Cancelled and failed ops never count.
    size_t max_ops_per_poll = 0;
  };

  static std::unique_ptr<InprocTransport> Create() { return Create(Options()); }
  static std::unique_ptr<InprocTransport> Create(const Options& options);
  ~InprocTransport() override;  // aborts if an object it created is still alive

  const Capabilities& capabilities() const override { return capabilities_; }
  const std::string& LocalAddress() const override { return address_; }
  absl::StatusOr<std::unique_ptr<LocalMemory>> RegisterMemory(void* address, uint64_t length,
                                                              MemoryKind kind) override;
  // Plain aligned heap memory (a peer in this process reads it like any other).
  absl::StatusOr<std::unique_ptr<LocalMemory>> AllocateMemory(uint64_t length) override;
  absl::StatusOr<std::unique_ptr<Endpoint>> Connect(std::string_view peer_address) override;
  size_t Poll(std::vector<Completion>* out) override;
  uint64_t outstanding() const override { return queue_.size(); }
  // What peers' gets copied out of this transport's memory (they copy it, on their threads).
  uint64_t bytes_served() const override;

  // Fault injection. `endpoint` must have been created by this transport.
  void FailEndpoint(Endpoint& endpoint);
  void SimulateCrash();
  void set_max_ops_per_poll(size_t n) { max_ops_per_poll_ = n; }

  // Implementation types, public only so that the .cc file's helpers can name them.
  struct Node;
  struct EpState;
  // One posted op, queued until a Poll executes it.
  struct Op {
    std::shared_ptr<EpState> ep;
    bool get;
    uint8_t* local;
    uint64_t region_id;
    uint64_t remote_address;  // base of the region, from the descriptor
    uint64_t remote_offset;
    uint64_t length;
    uint64_t cookie;
    uint64_t epoch;
    // A PostGetSpans: `local` and the remote region are bases; each span is copied.
    std::shared_ptr<const std::vector<Span>> spans;
  };

 private:
  class InprocLocalMemory;
  class InprocRemoteMemory;
  class InprocEndpoint;

  explicit InprocTransport(const Options& options);
  absl::Status Post(bool get, const std::shared_ptr<EpState>& state, const LocalMemory& local,
                    uint64_t local_offset, const RemoteMemory& remote, uint64_t remote_offset,
                    uint64_t length, uint64_t cookie);
  absl::Status PostSpans(const std::shared_ptr<EpState>& state, const LocalMemory& local,
                         const RemoteMemory& remote, std::vector<Span> spans, uint64_t cookie);
  // INVALID_ARGUMENT unless `local` is this transport's and `remote` was imported on `state`.
  absl::Status CheckHandles(const std::shared_ptr<EpState>& state, const LocalMemory& local,
                            const RemoteMemory& remote) const;
  void Fail(const std::shared_ptr<EpState>& state, absl::Status status);
  absl::Status Execute(const Op& op);
  std::unique_ptr<LocalMemory> Register(void* address, uint64_t length, MemoryKind kind,
                                        bool owned);

  Capabilities capabilities_;
  std::string address_;
  uint64_t identity_;
  std::shared_ptr<Node> node_;
  size_t max_ops_per_poll_;
  std::deque<Op> queue_;
  std::vector<std::weak_ptr<EpState>> endpoints_;
  std::vector<std::shared_ptr<EpState>> newly_failed_;
  uint64_t live_objects_ = 0;
};

}  // namespace refit::transport
