#pragma once

// Helpers shared by the conformance cases (transport_conformance*.cc): Catch2-checked setup,
// polling loops and a windowed, chunked transfer. Test-only; one thread.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "daemon/transport/testing/peer_process.h"
#include "daemon/transport/testing/transport_conformance.h"
#include "daemon/transport/transport.h"

namespace refit::transport::testing {

using Clock = std::chrono::steady_clock;
using Results = std::map<uint64_t, absl::Status>;  // cookie -> completion status
constexpr uint64_t kMiB = 1 << 20;

// Zero-filled host bytes.
struct Buffer {
  explicit Buffer(uint64_t n) : bytes(new uint8_t[n]), size(n) { std::memset(bytes.get(), 0, n); }
  uint8_t* data() const { return bytes.get(); }
  std::unique_ptr<uint8_t[]> bytes;
  uint64_t size;
};

// TestBackend().make(), REQUIREd to succeed; likewise the next three.
std::unique_ptr<Transport> MakeTransport();
std::unique_ptr<LocalMemory> Register(Transport& transport, const Buffer& buffer);
std::unique_ptr<Endpoint> ConnectTo(Transport& self, const std::string& address);
std::unique_ptr<RemoteMemory> Import(Endpoint& endpoint, const std::string& descriptor);
// A PeerProcess of TestBackend(); call before this process makes a transport.
std::unique_ptr<PeerProcess> StartPeer(uint64_t size, uint64_t seed, bool allocate = false);

// A peer process serving `size` pattern bytes (StartPeer) and, in this process, a transport, a
// registered buffer of `size` bytes, an endpoint to the peer and the peer's memory imported.
// The peer starts first (it forks before this process has a transport). Members go in reverse
// order: imports and endpoints before the transport, the peer last.
struct PeerLink {
  PeerLink(uint64_t size, uint64_t seed, bool allocate = false);
  std::unique_ptr<PeerProcess> peer;
  std::unique_ptr<Transport> t;
  Buffer buffer;
  std::unique_ptr<LocalMemory> memory;
  std::unique_ptr<Endpoint> endpoint;
  std::unique_ptr<RemoteMemory> remote;
};

// [offset, +length) as `count` equal spans (the same offsets on both sides).
std::vector<Span> SplitRange(uint64_t offset, uint64_t length, uint64_t count);

// A cookie never used before in this process.
uint64_t NextCookie();

// Polls `self` (collecting completions, each cookie at most once) and `others` (which may have
// to serve our ops) until `results` holds `expected` entries or `timeout` passes.
// With `span_sums`, each completion's Completion::span_xxh3 is kept there too, by cookie.
void PollUntil(Transport& self, const std::vector<Transport*>& others, Results* results,
               size_t expected, std::chrono::seconds timeout = std::chrono::seconds(60),
               std::map<uint64_t, std::vector<uint64_t>>* span_sums = nullptr);

// Moves `length` bytes between local[local_base, ...) and remote[remote_base, ...) in
// `chunk`-sized ops with up to `window` in flight, polling `self` and `others`. Returns the
// first failure (a refused post or a failed completion).
absl::Status Transfer(bool get, Transport& self, const std::vector<Transport*>& others,
                      Endpoint& endpoint, const LocalMemory& local, uint64_t local_base,
                      const RemoteMemory& remote, uint64_t remote_base, uint64_t length,
                      uint64_t chunk, size_t window);

// Completes a 1-byte get through `endpoint` (from `self` to `peer`), so that the connection's
// setup is over before the test goes on: UCX 1.13 aborts when a worker is destroyed with a
// connection reply still queued (openucx/ucx#8175), which a test that tears down both ends at
// once would otherwise hit at random.
// Reads the column halves of a [rows x 4096 B] matrix from `remote` (the pattern of `seed`;
// rows = its length / 4096) with PostGetSpans, 256 spans to a batch, and checks: one completion
// per batch, every span bit-exact, the other halves untouched (zero), and that a batch with one
// bad span, or none, is refused whole (INVALID_ARGUMENT, no completion).
void CheckColumnSpans(Transport& self, const std::vector<Transport*>& others, Endpoint& endpoint,
                      const LocalMemory& local, Buffer& buffer, const RemoteMemory& remote,
                      uint64_t seed);

void WireUp(Transport& self, Transport& peer, Endpoint& endpoint, const LocalMemory& local,
            const RemoteMemory& remote);

// Polls every transport for a moment, so that endpoint closes that need the peer's answer
// finish while the peer is still there (a daemon always polls; a test must do it for both).
void Settle(const std::vector<Transport*>& transports);

}  // namespace refit::transport::testing
