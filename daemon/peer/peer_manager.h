#pragma once

// The other daemons, seen from this one: one connection loop per --peers address (Hello, then a
// Subscribe stream whose events feed the store), reconnecting with backoff; and the pull worker,
// which runs the store's PullJobs: pin the version on its sources, pull through the data plane,
// verify every pulled range against the source's XXH3, and hand the result to the store.
//
// Thread-safety: public methods may be called from any thread. The store's listener hooks
// (OnPull) only queue work.

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/metrics/metrics.h"
#include "daemon/peer/data_plane.h"
#include "daemon/store/store.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::peer {

struct PeerState {
  std::string address;
  std::string node;  // empty until the first Hello
  bool connected = false;
};

// "host:port" -> every "ip:port" the name resolves to now (one entry, unchanged, when it
// doesn't resolve). A headless Kubernetes Service resolves to every daemon.
std::vector<std::string> ResolvePeerAddress(const std::string& address);

class PeerManager {
 public:
  // `delta_threshold`: use a source's deltas when they are at most this fraction of the bytes
  // a pull needs (0: always pull full bytes).
  PeerManager(std::string node, std::vector<std::string> addresses, Store* store,
              DataPlane* data_plane, Metrics* metrics, double delta_threshold = 0.5);
  ~PeerManager();  // Stop()

  void Start();
  void Stop();

  // Queues `job` (called by the store, under its lock).
  void OnPull(PullJob job);

  std::vector<PeerState> Peers() const;

  struct Transfer {
    std::string model;
    uint64_t version = 0;
    uint64_t bytes_total = 0;
    uint64_t bytes_done = 0;
  };
  // The pull in flight, if any.
  std::vector<Transfer> Transfers() const;

 private:
  struct Peer;
  void RunPeer(Peer* peer);
  void RunResolver();
  void AddPeer(const std::string& address);  // with mu_ held
  void RunPulls();
  absl::Status Pull(const PullJob& job);
  // The source's XXH3 of `chunks` of fetch `f` (asked while the bytes are still moving).
  absl::StatusOr<std::vector<uint64_t>> RemoteChecksums(
      const PullJob& job, size_t f, const std::vector<std::pair<uint64_t, uint64_t>>& chunks);
  // One Checksum call, with its deadline.
  static grpc::Status CallChecksum(v1::Peer::Stub* stub, const v1::ChecksumRequest& request,
                                   v1::ChecksumResponse* response);
  // Checks every pulled range against `remote` (skipping fetches `verified` already).
  absl::Status Verify(const PullJob& job, const std::vector<std::shared_ptr<Region>>& staging,
                      const DataPlane::ReadHashes& read_hashes,
                      std::vector<absl::StatusOr<std::vector<uint64_t>>> remote,
                      const std::vector<bool>& verified);
  v1::Peer::Stub* StubFor(const std::string& node);

  const std::string node_;
  Store* const store_;
  DataPlane* const data_plane_;
  Metrics* const metrics_;
  const double delta_threshold_;
  const std::vector<std::string> configured_;    // --peers as given
  const uint32_t pin_lease_ms_;                  // a pull's pins, renewed every quarter of it
  std::vector<std::unique_ptr<Peer>> peers_;     // guarded by mu_ (grows only)
  std::thread resolver_thread_;
  bool started_ = false;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::deque<PullJob> jobs_;
  // The pull in flight: bytes_done = received counter now - at its start.
  std::optional<Transfer> current_;
  double received_at_start_ = 0;
  std::thread pull_thread_;
};

}  // namespace refit::peer
