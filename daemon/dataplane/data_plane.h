#pragma once

// The data plane: one thread that owns the Transport (UCX in refitd) and makes every call on it
// — registering version slots for other nodes to read, connecting to peers, and pulling the
// byte ranges of a PullJob into staging slots in chunks, several in flight. It never sees
// gRPC; it sees models and versions only as the PullJob it was handed.
//
// Thread-safety: every public method may be called from any thread; work is handed to the
// data-plane thread through a queue. Blocking methods wait for that thread.

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/liveness.h"
#include "daemon/common/mutex.h"
#include "daemon/dataplane/progress_policy.h"
#include "daemon/memory/region.h"
#include "daemon/metrics/metrics.h"
#include "daemon/store/store_types.h"
#include "daemon/transport/transport.h"

namespace refit {

inline constexpr Counter kDataBytesReceived{
    "refit_data_bytes_received_total",
    "Bytes that arrived over the data plane (refetches count again)."};

}  // namespace refit

namespace refit::dataplane {

// chunk_bytes and inflight are refitd's --chunk-bytes and --inflight, set from DaemonOptions
// (daemon/component_options.h), where their defaults live; unset (0) they abort DataPlane's
// constructor. Tests take theirs from TestDataPlaneOptions (data_plane_testing.h).
struct DataPlaneOptions {
  uint64_t chunk_bytes = 0;  // largest single get, > 0
  // Gets in flight per pull, in chunk-sized units: at most inflight x chunk_bytes bytes are in
  // flight, so shorter gets (resharded ranges) may be more of them. >= 1.
  int inflight = 0;
  // Largest single get of a stripe this node relays to others (Read with ReadGrain::kRelayed;
  // refitd's --relay-chunk-bytes): what lands here is served on at that grain, so readers
  // downstream start a relayed read's time after the bytes left the origin, not a
  // --chunk-bytes read's. 0: --chunk-bytes.
  uint64_t relay_chunk_bytes = 0;
  // Told of each turn of the data plane's loop (null: nobody watches it): the watchdog's view
  // of this thread (daemon/common/liveness.h).
  Liveness::Worker* liveness = nullptr;
};

class DataPlane {
 public:
  // Takes ownership of `transport` (null: no data plane; pulls fail UNAVAILABLE). `progress`:
  // when the loop polls on and when it blocks while bytes are in flight (progress_policy.h;
  // tests change it).
  DataPlane(std::unique_ptr<transport::Transport> transport, DataPlaneOptions options,
            Metrics* metrics, ProgressOptions progress = {});
  ~DataPlane();  // stops the thread; outstanding pulls fail CANCELLED

  // The address peers connect to ("" without a transport).
  std::string LocalAddress() const;
  std::string TransportName() const;

  // A host slot of `size` bytes from the transport's own allocator (Transport::AllocateMemory),
  // faulted in, so that peers on this host map it instead of copying through UCX; plain
  // AllocateHost memory without a transport. Any thread. The slot may outlive the data plane.
  absl::StatusOr<std::unique_ptr<Region>> AllocateSlot(uint64_t size);

  // The remote descriptor of `slot` for peer `node`, registering the slot once (cached while the
  // slot lives), and the grant that lets `node` read it (transport.h, "Grants"): its reads are
  // served while `grant` lives. The descriptor carries `node`'s session token, made at random
  // the first time this daemon speaks of `node`: send it to `node` only, over its authenticated
  // channel. Announcing a version drops the grant; a pin (and a relay stream) keeps it.
  struct Exposed {
    std::string descriptor;
    std::shared_ptr<void> grant;  // may be null (a backend without checked reads)
  };
  absl::StatusOr<Exposed> Expose(const std::shared_ptr<Region>& slot, const std::string& node);

  // (Re)connects to `node` at its transport address; replaces an earlier endpoint.
  void Connect(const std::string& node, const std::string& address);
  void Disconnect(const std::string& node);

  // Fetches every range of `job` into fresh staging slots (from `acquire`). The result comes
  // back through the future: OK with one slot per fetch, or the first error (UNAVAILABLE when a
  // peer failed).
  using Acquire = std::function<absl::StatusOr<std::shared_ptr<Region>>(uint64_t)>;
  // Per fetch: offset of a read -> {its length, XXH3-64 of the bytes it brought}. Each read is
  // hashed as it completes, while its bytes are still in cache, so that verifying the pull
  // against the source's checksums needs no second pass over memory. Reads start at each
  // range's begin and step by --chunk-bytes, which is the checksum grid when --chunk-bytes is
  // kChecksumChunkBytes (the default).
  using ReadHashes = std::vector<std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>>>;
  // `hashes` (optional) is filled before the future is ready.
  std::future<absl::StatusOr<std::vector<std::shared_ptr<Region>>>> Pull(
      const PullJob& job, Acquire acquire, std::shared_ptr<ReadHashes> hashes = nullptr);

  // Called on the data-plane thread as each read of Read lands: [offset, offset + length) of
  // the slot holds the source's bytes now. Must only note it (a lock and a notify).
  using Landed = std::function<void(uint64_t offset, uint64_t length)>;
  // Reads `ranges` of the piece `from` names (node, remote key, size) into `slot`, at the same
  // offsets, --inflight chunks at a time; `landed` (optional) hears of each read as it
  // completes. The future says OK once every range is in, or the first error.
  // `hashes` (optional, one entry) gets each read's digest as Pull's do. `grain`: kRelayed reads
  // in --relay-chunk-bytes steps instead (bytes other nodes wait to read from here: they are
  // served as each read lands); their digests then miss the checksum grid, and Verify hashes
  // those chunks once more.
  enum class ReadGrain { kChunk, kRelayed };
  std::future<absl::Status> Read(const PullJob::Fetch& from,
                                 std::vector<std::pair<uint64_t, uint64_t>> ranges,
                                 std::shared_ptr<Region> slot, Landed landed = nullptr,
                                 std::shared_ptr<ReadHashes> hashes = nullptr,
                                 ReadGrain grain = ReadGrain::kChunk);

  // Refetches `ranges` of fetch `fetch` of `job` into `slot` (after a checksum mismatch).
  std::future<absl::Status> Refetch(const PullJob& job, size_t fetch,
                                    std::vector<std::pair<uint64_t, uint64_t>> ranges,
                                    std::shared_ptr<Region> slot);

 private:
  struct Transfer;
  void Run();
  void Post(std::function<void()> work);
  transport::LocalMemory* Registration(const std::shared_ptr<Region>& region);
  // Sets up `fetch`'s endpoint, remote memory and local registration in `transfer`.
  absl::Status Prepare(Transfer& transfer, const PullJob::Fetch& fetch,
                       std::shared_ptr<Region> slot);
  void Pump(const std::shared_ptr<Transfer>& transfer);
  void Fail(Transfer& transfer, absl::Status status);

  // Set at construction; reset by the data-plane thread as it stops, under alloc_mu_ (which
  // AllocateSlot holds while it uses the transport from another thread).
  std::unique_ptr<transport::Transport> transport_;
  common::Mutex alloc_mu_;
  // Each peer node's session token (Transport::kTokenBytes bytes): a keyed hash of its name
  // under token_key_, so that no table of names grows.
  std::string SessionToken(const std::string& node);
  const std::string token_key_;  // 32 random bytes, made at construction
  const DataPlaneOptions options_;
  Metrics* const metrics_;
  const CounterHandle data_bytes_received_;  // kDataBytesReceived, per completion

  using Clock = std::chrono::steady_clock;
  // Wakes the loop: an eventfd it sleeps on beside the transport's (Sleep).
  void Wake();
  // After a turn with nothing in flight of its own: blocks until work is posted, the
  // transport has events, or the loop's next deadline (a sweep, an eviction, a liveness turn);
  // while the transport has something in flight (Transport::PrepareToSleep), as progress_
  // says: naps briefly, or blocks until its next event, briefly.
  void Sleep(Clock::time_point active_at);
  // With own reads in flight after a turn that completed nothing, as progress_ says: yields,
  // or blocks until the transport's next event or posted work, briefly (kBusyWait; kBusyNap
  // where the transport can't arm).
  void WaitInFlight(Clock::time_point active_at);
  // Blocks in ppoll until posted work (true), `transport_fd` (-1: none) turns readable, or
  // `until` (max: no deadline).
  bool Wait(int transport_fd, Clock::time_point until);
  // progress_'s view of this turn: the bytes moved so far, own reads and served.
  ProgressPolicy::Sample Progress(Clock::time_point now, Clock::time_point active_at) const;
  int wake_fd_ = -1;

  common::Mutex mu_;
  std::deque<std::function<void()>> work_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Data-plane thread only:
  // A slot registered with the transport (one that AllocateSlot didn't make). The registration
  // holds the slot: peers may read registered memory at any time (transport.h), so it is
  // deregistered (memory first) by SweepRegistrations once nobody else holds the slot, and only
  // then can the slot go back to its pool or be unmapped.
  struct Registered {
    std::shared_ptr<Region> region;
    std::unique_ptr<transport::LocalMemory> memory;  // destroyed before `region` is let go
  };
  void SweepRegistrations();
  std::map<const uint8_t*, Registered> registrations_;
  std::map<std::string, std::unique_ptr<transport::Endpoint>> endpoints_;  // by node
  // Peers' slots imported on their endpoint, by node and descriptor, kept between pulls: a
  // version slot comes back from the source's pool with the same descriptor, and importing it
  // again would map a shared-memory slot again (and fault every page in again). Entries unused
  // for kRemoteIdle are dropped, so a slot the source freed is unmapped here too.
  struct Imported {
    std::shared_ptr<transport::RemoteMemory> memory;
    std::chrono::steady_clock::time_point used;
  };
  std::map<std::string, std::map<std::string, Imported>> imported_;
  void EvictImports(std::chrono::steady_clock::time_point now);
  std::chrono::steady_clock::time_point last_eviction_{};
  std::chrono::steady_clock::time_point next_sweep_{};
  std::shared_ptr<transport::RemoteMemory> Import(transport::Endpoint& endpoint,
                                                  const std::string& node,
                                                  const std::string& descriptor,
                                                  absl::Status* status);
  struct InFlight {
    std::shared_ptr<Transfer> transfer;
    size_t fetch = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
    size_t first_op = 0;  // Transfer::ops index of its (first) read
    size_t count = 1;     // > 1: a PostGetSpans of ops [first_op, first_op + count)
    int reads = 1;        // what it counts against kMaxReadsInFlight
  };
  // Notes the digest of each read of `done` in the transfer's ReadHashes.
  // `rehash`: hash the landed bytes even where the transport hashed them on the way.
  void RecordHashes(Transfer& t, const InFlight& done, const transport::Completion& c, bool rehash);
  // Whether a batch of short reads of fetch `fetch` is one transport op or a few messages
  // (RemoteMemory::BatchesSpans) rather than one op per span.
  bool OneRead(const Transfer& t, size_t fetch) const;

  std::unordered_map<uint64_t, InFlight> by_cookie_;
  uint64_t next_cookie_ = 1;
  ProgressPolicy progress_;
  uint64_t bytes_read_ = 0;  // own reads completed OK, for progress_
  std::thread thread_;
};

}  // namespace refit::dataplane
