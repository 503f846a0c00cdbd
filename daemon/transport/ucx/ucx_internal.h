#pragma once

// The state UcxTransport's source files share (ucx_transport.cc: memory, endpoints, RMA;
// ucx_gather.cc: the gather protocol). Internal to daemon/transport.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/transport/ucx/ucx_transport.h"

namespace refit::transport {

// Whether a UCX_TLS value names only transports with hardware RMA (ucx_options.cc).
bool HardwareRmaOnly(const char* tls);
// Whether this host has RDMA devices (/sys/class/infiniband), where UCX prefers rc/dc to tcp.
bool RdmaDevicesPresent();
// Whether refit's filter of libuct's tcp pending purge is in place (ucx_tcp_purge.cc: UCX 1.13
// aborts when a peer dies mid wire-up), and how many wire-up messages it kept from UCP.
bool TcpPurgeWorkaroundActive();
uint64_t TcpPurgeDroppedWireupMessages();

// A memory registration; ops in flight share it, so it outlives its LocalMemory if need be.
struct UcxTransport::MemHolder {
  std::shared_ptr<ucp_context> context;  // declared first: outlives memh
  ucx::MemPtr memh;
};

// A remote key unpacked on one endpoint; shared with the ops that use it.
struct UcxTransport::RkeyHolder {
  ucx::RkeyPtr rkey;
  // The token of the descriptor it came from (kTokenBytes): every gather on it carries it.
  std::string token;
  // The peer answered a gather on this memory with UNSUPPORTED: use gets from now on (only
  // with Options::rma; without it such a read fails).
  bool no_gather = false;
};

// One ucp_ep and what its ops need even after the Endpoint object is gone.
struct UcxTransport::EpState {
  UcxTransport* owner = nullptr;
  ucp_ep_h ep = nullptr;  // closed through UcxTransport::CloseEp
  uint64_t peer_identity = 0;
  std::weak_ptr<EpState> self;
  absl::Status failure;      // UNAVAILABLE once UCX reported the peer failed
  uint64_t epoch = 0;        // bumped by Cancel: ops of older epochs report CANCELLED
  bool closed = false;       // the Endpoint was destroyed: every op reports CANCELLED
  uint64_t outstanding = 0;  // posted, not yet returned by Poll
  uint64_t in_ucx = 0;       // posted, UCX not done with them
  std::function<void(const absl::Status&)> handler;
  // Ops on the CopyEngine: `abandon` makes queued ones skip their copy (the Endpoint is going),
  // `copying` counts those that may still touch their buffers.
  std::atomic<bool> abandon{false};
  std::atomic<uint64_t> copying{0};
};

// The parts of one PostGetSpans (gets, or gathers): a single completion when the last is done.
struct UcxTransport::Group {
  uint64_t remaining = 0;
  ucs_status_t status = UCS_OK;  // the first error
  // Filled by gathers, one digest per span of the PostGetSpans; reported only if every span
  // came by gather (`hashed` stays true).
  std::vector<uint64_t> span_xxh3{};
  bool hashed = false;
  bool single = false;  // the one span of a PostGet: reported as the op's xxh3
};

struct UcxTransport::Op {
  std::shared_ptr<EpState> ep;
  std::shared_ptr<MemHolder> mem;
  std::shared_ptr<RkeyHolder> rkey;
  uint64_t cookie;
  uint64_t epoch;
  std::shared_ptr<Group> group = nullptr;  // set for the parts of a PostGetSpans
};

// One gather sent and awaiting its reply: spans[first, last) of its PostGetSpans.
struct UcxTransport::Gather {
  Op* op = nullptr;  // owned; finished through FinishOp
  uint64_t id = 0;
  uint8_t* base = nullptr;  // the local (host) memory's first byte
  uint64_t remote_address = 0;
  std::shared_ptr<const std::vector<Span>> spans;
  size_t first = 0;
  size_t last = 0;
  uint64_t bytes = 0;
};

// A reply UCX is sending: an iov over memory UCX allocated (`mem` keeps it), or over `packed`,
// a copy of the spans of memory the caller registered.
struct UcxTransport::Serve {
  UcxTransport* owner = nullptr;
  std::shared_ptr<MemHolder> mem;
  std::vector<uint8_t> packed;
  std::vector<ucp_dt_iov_t> iov;
  std::string header;
  uint64_t bytes = 0;  // the data it carries (bytes_served once sent; 0 for a refusal)
};

// This transport's registered memory, by address, and the grants on it: what a peer's gather
// may read. A gather names a token and a registration's base; it is served only if that token
// holds a grant of [base, base + length) with length reaching its last span, and the memory is
// still registered. Each registration grants itself to its own random token (the one in
// LocalMemory::descriptor()); GrantRead adds grants of a registration to a session's token,
// counted, until its hold goes.
struct UcxTransport::Registry {
  struct Entry {
    uint64_t length = 0;
    MemoryKind kind = MemoryKind::kHost;
    std::weak_ptr<MemHolder> mem;
    bool owned = false;  // AllocateMemory's: the registration owns the bytes
  };
  common::Mutex mu;
  std::multimap<uint64_t, Entry> by_address ABSL_GUARDED_BY(mu);
  // token -> {base, length} -> how many holds grant it.
  std::map<std::string, std::map<std::pair<uint64_t, uint64_t>, uint64_t>> grants
      ABSL_GUARDED_BY(mu);

  void AddGrant(const std::string& token, uint64_t base, uint64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++grants[token][{base, length}];
  }
  void RemoveGrant(const std::string& token, uint64_t base, uint64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = grants.find(token);
    if (it == grants.end()) return;
    auto entry = it->second.find({base, length});
    if (entry != it->second.end() && --entry->second == 0) it->second.erase(entry);
    if (it->second.empty()) grants.erase(it);
  }
  // Whether `token` holds a grant of a registration at `base` at least `end` bytes long.
  bool Allows(const std::string& token, uint64_t base, uint64_t end) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = grants.find(token);
    if (it == grants.end()) return false;
    for (auto entry = it->second.lower_bound({base, 0});
         entry != it->second.end() && entry->first.first == base; ++entry) {
      if (entry->first.second >= end) return true;
    }
    return false;
  }
};

}  // namespace refit::transport
