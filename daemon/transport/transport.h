#pragma once

// The data-plane transport: moves bytes between daemons with one-sided RMA (get and put). It
// never sees models, versions or plans; its callers (the daemon's data plane) decide what to move.
//
// Shape (the contract of nixl's backend engine, gloo's transport hierarchy):
//
//   Transport        one per daemon: a UCX context + worker, or an in-process fake.
//     LocalMemory    a registered local buffer (register ONCE, reuse for many transfers). Its
//                    descriptor() is the public bytes a peer needs to read or write it.
//     Endpoint       a connection to one peer, made from the peer's LocalAddress() bytes.
//       RemoteMemory a peer's buffer, imported from its descriptor on one endpoint.
//   PostGet/PostPut  start a transfer; never block and never complete synchronously.
//   Poll             drives progress and hands back completions {cookie, status}.
//
// Completion contract. A Post* that returns OK yields exactly one Completion, from a later Poll,
// carrying the caller's cookie: OK, UNAVAILABLE (the peer died or the link broke), CANCELLED
// (Endpoint::Cancel or the endpoint was destroyed), or INVALID_ARGUMENT (the peer refused a read
// of ranges outside the memory it has registered, a descriptor of memory since released, or
// answered it malformed); after
// anything but OK the bytes of the destination range are unspecified. A Post* that returns an error
// yields no completion: INVALID_ARGUMENT for a range outside a region or a handle from another
// transport/endpoint, UNAVAILABLE when the endpoint has already failed. Many ops may be in flight
// at once; a large transfer is chunked by the caller. The order in which completions arrive is
// unspecified.
//
// Peer failure. An endpoint fails when the peer process dies or becomes unreachable; from then on
// status() is UNAVAILABLE, every outstanding op completes with UNAVAILABLE, new posts are refused
// with UNAVAILABLE, and the failure handler (if set) runs once, from Poll. A failed endpoint
// stays failed: destroy it and Connect() again when the peer is back. A peer that is alive but
// unresponsive (a stopped process, a hung host whose kernel still answers TCP) is NOT detected:
// its ops just don't finish. The caller bounds transfers with its own deadlines and then
// destroys the endpoint, which aborts them.
//
// Bad input from the network (addresses and descriptors arrive over gRPC from other daemons) is
// answered with INVALID_ARGUMENT and never reaches the backend unchecked: both carry a magic, a
// version, the issuing transport's identity and a checksum. That catches truncation, corruption
// and mix-ups (a descriptor of another peer), not forgery.
//
// Grants (issue 17: "the data plane grants, it does not expose"). A descriptor is a capability:
// it carries a token, and a backend with checked reads (UCX unless Options::rma) serves a peer's
// read only if that token holds a grant covering the range, checked by the target on every read
// (ucx_gather.cc); no peer can write into this transport's memory at all (PostPut is refused
// unless capabilities().rma_put). LocalMemory::descriptor() grants its memory to its own
// random token for as long as it is registered (tests, and memory a caller hands out itself).
// GrantRead makes a descriptor of the same memory under a session's token and grants it only
// while the returned hold lives: the daemon gives each authenticated peer its own token, hands
// out only those descriptors, and holds a grant per pin. Same-host peers that map a slot
// (RemoteMemory::mapped) read it with memcpy, unchecked: mapping it needs the operating
// system's consent (the daemon's uid), see docs/security.md.
//
// Registered memory is readable through a live grant for as long as it is registered: keep its
// bytes mapped until its LocalMemory is destroyed (a peer's read that arrives late, after its
// pin, is refused or served from them).
//
// Ownership. The Transport owns its backend; every LocalMemory, Endpoint and RemoteMemory it
// hands out is owned by the caller and MUST be destroyed before the Transport (the Transport
// aborts otherwise). Destroying a LocalMemory or RemoteMemory with ops in flight is safe (the
// registration lives until those ops complete), but the bytes a LocalMemory describes must stay
// mapped until every op using them has completed. Destroying an Endpoint aborts its outstanding
// ops; their CANCELLED completions still come from Poll.
//
// Threads. A Transport and everything it created is thread-compatible, not thread-safe: all
// calls (including destructors) must be serialized by the caller. The daemon makes every call
// from its one data-plane thread, which also runs Poll in a loop; another thread that needs to
// register memory hands the work to that thread (or the caller wraps all calls in one mutex).
// Exceptions, safe from any thread at any time: capabilities(), LocalAddress(), and the
// accessors of LocalMemory / RemoteMemory (immutable after creation). No callback is ever
// invoked from a backend thread: failure handlers run inside Poll, on the calling thread.
//
// Progress. A backend may need Poll on BOTH sides of a transfer: UCX over TCP has no hardware
// get, so a GET is served by the target's worker when the target polls. A daemon must therefore
// keep polling while any peer may read its memory, not only while it has ops of its own.
//
// Sleeping. Polling an idle transport in a loop burns a core; a backend that can tell when it
// has something to do lets its caller block instead (Transport::PrepareToSleep and WakeFd):
// after a Poll, PrepareToSleep() true means nothing is in flight and nothing arrived, and the
// caller may block in poll(2) until WakeFd() turns readable (a peer's message, a peer's death);
// then it Polls again. false: keep polling (ops or replies in flight, events already pending).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/memory/region.h"

namespace refit::transport {

// What a backend can do; fixed when the transport is created.
struct Capabilities {
  std::string name;          // "ucx", "inproc"
  bool rma_get = false;      // PostGet works
  bool rma_put = false;      // PostPut works (never with checked reads: no peer writes here)
  bool cuda_memory = false;  // RegisterMemory accepts MemoryKind::kCuda (else stage via host)
  // PostGetSpans into host memory moves all its spans as a few messages, not one op per span
  // (UCX: gathers), so a caller may post large batches without holding a request per span.
  bool gathers_spans = false;
  std::string detail;  // backend specifics for logs, e.g. the UCX version and memory types
};

// One range of a PostGetSpans: local[local_offset, +length) <- remote[remote_offset, +length).
struct Span {
  uint64_t local_offset = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
};

// The outcome of one posted op.
struct Completion {
  uint64_t cookie = 0;
  absl::Status status;
  // XXH3-64 of the bytes an OK get brought, when the backend computed it on the way (UCX gets
  // from mapped peer memory hash each block right after copying it, while it is in cache);
  // otherwise has_xxh3 is false and the caller hashes the bytes itself if it needs to.
  bool has_xxh3 = false;
  uint64_t xxh3 = 0;
  // For an OK PostGetSpans: XXH3-64 of each span's bytes, in the order posted, when the backend
  // computed them on the way (UCX copies from mapped peer memory hash each span right after
  // copying it; UCX gathers hash each span as they scatter it); empty otherwise.
  std::vector<uint64_t> span_xxh3{};
};

// A registered local buffer [address, address + length). Created by Transport::RegisterMemory;
// deregistered when destroyed.
class LocalMemory {
 public:
  virtual ~LocalMemory() = default;
  LocalMemory(const LocalMemory&) = delete;
  LocalMemory& operator=(const LocalMemory&) = delete;

  void* address() const { return address_; }
  uint64_t length() const { return length_; }
  MemoryKind kind() const { return kind_; }
  // Serialized public descriptor (address, length, packed remote key, issuer identity); send it
  // to a peer, which passes it to Endpoint::ImportRemote on its endpoint to this transport.
  const std::string& descriptor() const { return descriptor_; }

 protected:
  LocalMemory(void* address, uint64_t length, MemoryKind kind)
      : address_(address), length_(length), kind_(kind) {}
  void set_descriptor(std::string descriptor) { descriptor_ = std::move(descriptor); }

 private:
  void* address_;
  uint64_t length_;
  MemoryKind kind_;
  std::string descriptor_;
};

// A peer's registered buffer as seen through one Endpoint (the one that imported it).
class RemoteMemory {
 public:
  virtual ~RemoteMemory() = default;
  RemoteMemory(const RemoteMemory&) = delete;
  RemoteMemory& operator=(const RemoteMemory&) = delete;

  uint64_t remote_address() const { return remote_address_; }
  uint64_t length() const { return length_; }
  // True when the backend mapped the peer's bytes into this process (a peer on this host whose
  // memory came from AllocateMemory, with UCX shared memory): gets and puts are then memcpy.
  virtual bool mapped() const { return false; }
  // True when a PostGetSpans from this memory into local memory of `local` kind moves all its
  // spans as one op or a few messages (a copy job from a mapped slot, UCX gathers), not one op
  // per span: a caller may then post large batches without holding a request per span.
  virtual bool BatchesSpans(MemoryKind /*local*/) const { return false; }

 protected:
  RemoteMemory(uint64_t remote_address, uint64_t length)
      : remote_address_(remote_address), length_(length) {}

 private:
  uint64_t remote_address_;
  uint64_t length_;
};

// A connection to one peer transport.
class Endpoint {
 public:
  // Closes the connection without blocking. Outstanding ops are aborted at once and report
  // CANCELLED from Poll; this is the way out of ops stuck on an unresponsive peer (Cancel waits
  // for them). With UCX, closing an endpoint that has ops outstanding resets the transport
  // connection, so the peer's own endpoints to this transport fail (UNAVAILABLE) and it must
  // reconnect; closing an idle endpoint is quiet.
  virtual ~Endpoint() = default;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // Parses a peer's LocalMemory::descriptor(). INVALID_ARGUMENT for malformed or truncated bytes
  // or a descriptor issued by a transport other than this endpoint's peer; UNAVAILABLE when the
  // endpoint has failed.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(
      std::string_view descriptor) = 0;

  // Copies remote[remote_offset, +length) into local[local_offset, +length). Never blocks.
  [[nodiscard]] virtual absl::Status PostGet(const LocalMemory& local, uint64_t local_offset,
                                             const RemoteMemory& remote, uint64_t remote_offset,
                                             uint64_t length, uint64_t cookie) = 0;
  // Many short gets as ONE op with one completion (OK once every span arrived; else the first
  // error, and the bytes of every span are unspecified): a resharded pull reads one short range
  // per row, and per-op costs would dominate. Backends that can move the spans as one operation
  // do (UCX from mapped peer memory: one copy job); others post each span and count. Every span
  // is checked before anything is posted (INVALID_ARGUMENT, no completion, as for PostGet; also
  // for no spans). Never blocks. A backend that copied or scattered the spans itself may give a
  // digest per span (Completion::span_xxh3).
  [[nodiscard]] virtual absl::Status PostGetSpans(const LocalMemory& local,
                                                  const RemoteMemory& remote,
                                                  std::vector<Span> spans, uint64_t cookie) = 0;
  // Copies local[local_offset, +length) into remote[remote_offset, +length). Never blocks. The
  // completion means the bytes have been delivered to the remote buffer.
  [[nodiscard]] virtual absl::Status PostPut(const LocalMemory& local, uint64_t local_offset,
                                             const RemoteMemory& remote, uint64_t remote_offset,
                                             uint64_t length, uint64_t cookie) = 0;

  // Cancels every op of this endpoint whose completion Poll hasn't returned yet: each reports
  // CANCELLED (UNAVAILABLE if the peer fails meanwhile), and only once the backend no longer
  // touches its buffers, so after the last one the caller may reuse them. Bytes already posted
  // may still land: UCX can't abort a posted RMA op (forcing its endpoint closed would also
  // reset the peer's connections to us), so its CANCELLED arrives when the op ends; the inproc
  // backend drops ops it hasn't executed. The endpoint stays usable: later posts are unaffected.
  // Never blocks.
  virtual void Cancel() = 0;

  // OK while usable; UNAVAILABLE once the peer has failed.
  virtual absl::Status status() const = 0;
  // Ops posted on this endpoint whose completion Poll has not yet returned.
  virtual uint64_t outstanding() const = 0;
  // Called once, from Poll, when the endpoint fails (with the UNAVAILABLE status). The handler
  // may destroy the endpoint. Replaces any previous handler.
  virtual void SetFailureHandler(std::function<void(const absl::Status&)> handler) = 0;

 protected:
  Endpoint() = default;
};

// A daemon-owned slot in memory from Transport::AllocateMemory: a Region whose LocalMemory is
// already registered (register it again and peers lose the zero-copy path).
class TransportRegion final : public Region {
 public:
  explicit TransportRegion(std::unique_ptr<LocalMemory> memory)
      : Region(MemoryKind::kHost, -1, static_cast<uint8_t*>(memory->address()), memory->length()),
        memory_(std::move(memory)) {}
  LocalMemory* memory() const { return memory_.get(); }
  std::string Describe() const override {
    return "transport-allocated host [0, " + std::to_string(size()) + ")";
  }

 private:
  std::unique_ptr<LocalMemory> memory_;
};

class Transport {
 public:
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  virtual const Capabilities& capabilities() const = 0;

  // The bytes a peer passes to Connect() to reach this transport (the UCX worker address).
  virtual const std::string& LocalAddress() const = 0;

  // Registers [address, address + length) of memory of `kind`. INVALID_ARGUMENT for a null
  // address or zero length; UNIMPLEMENTED for CUDA memory when !capabilities().cuda_memory.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<LocalMemory>> RegisterMemory(
      void* address, uint64_t length, MemoryKind kind) = 0;

  // `length` bytes of host memory, page-aligned, owned and registered by the returned LocalMemory
  // (freed with it), that the backend shares with peers where it can: with UCX's shared-memory
  // transports a peer on this host maps it and reads it with memcpy instead of a protocol.
  // Exceptions to the rules above: callable from any thread, and the LocalMemory may outlive
  // the Transport (it may be destroyed from any thread, at any time after its ops completed).
  // INVALID_ARGUMENT for length 0; RESOURCE_EXHAUSTED when the memory can't be had.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<LocalMemory>> AllocateMemory(
      uint64_t length) = 0;

  // Connects to the peer whose LocalAddress() is `peer_address`. Never blocks on the network:
  // a peer that isn't there shows up as a failed endpoint (UNAVAILABLE completions), not here.
  // INVALID_ARGUMENT for malformed bytes or an address of another backend; UNAVAILABLE when the
  // backend has no way at all to reach that peer (UCX: no common transport).
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<Endpoint>> Connect(
      std::string_view peer_address) = 0;

  // Drives progress and appends every completion available now to `out`; returns how many it
  // appended. Never blocks. Also runs failure handlers of endpoints that failed meanwhile.
  virtual size_t Poll(std::vector<Completion>* out) = 0;

  // Ops posted and not yet returned by Poll, over all endpoints.
  virtual uint64_t outstanding() const = 0;

  // A descriptor of `memory` for the peer whose session token is `token` (kTokenBytes random
  // bytes the caller made for that peer and sends only over its authenticated channel), and the
  // grant that lets that peer read `memory` through it: reads are served while `hold` lives (and
  // the memory is registered). Any thread; the hold may outlive the transport. INVALID_ARGUMENT
  // for a token of another length or memory of another transport. Backends without checked reads
  // answer memory.descriptor() and no hold.
  struct Grant {
    std::string descriptor;
    std::shared_ptr<void> hold;
  };
  static constexpr size_t kTokenBytes = 16;
  [[nodiscard]] virtual absl::StatusOr<Grant> GrantRead(const LocalMemory& memory,
                                                        std::string_view token) {
    if (token.size() != kTokenBytes) return absl::InvalidArgumentError("a token is 16 bytes");
    return Grant{memory.descriptor(), nullptr};
  }

  // Grows whenever Poll got anything done, including serving peers' reads of this transport's
  // memory (which completes nothing here). A caller that naps between Polls when idle naps only
  // while this stands still, so a peer's pull isn't served one nap at a time.
  virtual uint64_t activity() const { return 0; }

  // Bytes of this transport's memory it has served to peers' reads since it was created (the
  // replies it sent them), so that a caller judging how fast bytes flow through it counts a
  // relay's serving too, not only its own reads. Reads it takes no part in are not counted: a
  // peer's memcpy from memory it mapped, a hardware RDMA get (UCX Options::rma). 0: a backend
  // that can't tell. Same thread rules as Poll.
  virtual uint64_t bytes_served() const { return 0; }

  // See "Sleeping" above. Call on the polling thread right after a Poll, just before blocking:
  // true when the caller may block until WakeFd() is readable (or until it has work of its own);
  // false when it must Poll again soon. A backend that can't tell (the default) answers false.
  [[nodiscard]] virtual bool PrepareToSleep() { return false; }
  // Like PrepareToSleep, but also while this transport's own ops (or replies) are in flight:
  // kArmed when WakeFd() will turn readable at the next network event (data from a peer, a
  // socket that can take more of a send); kPending: events arrived since the last Poll (Poll
  // again now); kCannot: the backend can't tell (or work is on threads that signal no event).
  // A caller that blocks after kArmed blocks with a short timeout all the same.
  enum class Armed { kArmed, kPending, kCannot };
  [[nodiscard]] virtual Armed ArmWhileBusy() { return Armed::kCannot; }
  // The descriptor to wait on (readable: Poll) after PrepareToSleep() said true; -1 when nothing
  // but the caller's own calls makes work for this backend. Fixed for the transport's life.
  virtual int WakeFd() const { return -1; }

 protected:
  Transport() = default;
};

}  // namespace refit::transport
