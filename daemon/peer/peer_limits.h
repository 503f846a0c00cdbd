#pragma once

// What one peer may hold on this daemon (issue 37, "hold under attack"): names checked where
// they arrive, peer text made safe for logs and Status, and the long-lived peer streams
// (Subscribe, Relay) bounded per source and in all.
//
// A source is who a stream comes from: with --tls-* the node its certificate authenticates;
// without TLS, the host it called from (its IP address: a node name is a claim anyone can make).
// Each source may hold kMaxStreamsPerSource streams; all together kMaxStreams (the peer port's
// gRPC has 512 threads, and each stream holds one: what is left serves Hello, Pin, Checksum,
// Report and health). When all are taken, a newcomer from a source holding fewer streams than
// the largest holder takes the place of that holder's oldest stream (it ends
// RESOURCE_EXHAUSTED); otherwise the newcomer is refused RESOURCE_EXHAUSTED. So streams from
// one host or identity, however many, never lock out another: every source keeps at least
// min(kMaxStreamsPerSource, kMaxStreams / sources).
//
// Thread-safety: StreamLimiter's methods may be called from any thread; a Ticket from any.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"

namespace refit::peer {

inline constexpr size_t kMaxNodeName = 255;    // as --node
inline constexpr size_t kMaxModelName = 1024;  // as the client API's model names
inline constexpr size_t kMaxListen = 1024;     // a --listen address a peer gives
inline constexpr size_t kMaxStreams = 384;
inline constexpr size_t kMaxStreamsPerSource = 128;

// INVALID_ARGUMENT unless 1 <= name.size() <= kMaxNodeName ("node name" in the message is
// `what`).
absl::Status CheckNodeName(std::string_view name, std::string_view what = "node name");
absl::Status CheckModelName(std::string_view name);

// Peer-supplied text for a log line or a Status message: printable ASCII kept, anything else
// as \xNN, at most `max` bytes of it, then "...(N bytes)".
std::string Printable(std::string_view text, size_t max = 96);

// a == b without stopping at the first difference (tokens).
bool SameBytes(std::string_view a, std::string_view b);

// The host of a gRPC peer string ("ipv4:10.0.0.2:41234" -> "10.0.0.2", "ipv6:[fd00::2]:1" ->
// "[fd00::2]"); the whole string for anything else.
std::string PeerHost(std::string_view peer);

// Memory a refused large request leaves in malloc's arenas (its parsed strings, freed in the
// middle of a gRPC thread's arena) goes back to the system: NoteLargeRequest marks one (any
// thread), TrimAfterLargeRequests (called on a stream's quiet tick) trims once it has been
// freed, at most once a second.
void NoteLargeRequest(size_t bytes);
void TrimAfterLargeRequests();

class StreamLimiter {
 public:
  StreamLimiter(size_t total = kMaxStreams, size_t per_source = kMaxStreamsPerSource);

  // A stream admitted; it gives its place back when destroyed.
  class Ticket {
   public:
    ~Ticket();
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    // True once a newcomer took this stream's place: end it (RESOURCE_EXHAUSTED).
    bool evicted() const { return evicted_->load(); }

   private:
    friend class StreamLimiter;
    Ticket(StreamLimiter* limiter, std::string source, uint64_t id,
           std::shared_ptr<std::atomic<bool>> evicted)
        : limiter_(limiter), source_(std::move(source)), id_(id), evicted_(std::move(evicted)) {}
    StreamLimiter* limiter_;
    std::string source_;
    uint64_t id_;
    std::shared_ptr<std::atomic<bool>> evicted_;
  };

  // Admits a stream from `source`, or RESOURCE_EXHAUSTED saying why (`what`: "Subscribe").
  absl::StatusOr<std::unique_ptr<Ticket>> Admit(const std::string& source, std::string_view what);

  size_t open() const;
  size_t evictions() const;
  size_t refusals() const;

 private:
  void Leave(const std::string& source, uint64_t id);

  const size_t total_;
  const size_t per_source_;
  mutable common::Mutex mu_;
  struct Entry {
    uint64_t id;
    std::shared_ptr<std::atomic<bool>> evicted;
  };
  // Per source, its streams oldest first (evicted ones are gone from here already).
  std::map<std::string, std::list<Entry>> sources_ ABSL_GUARDED_BY(mu_);
  size_t open_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  size_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  size_t refusals_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace refit::peer
