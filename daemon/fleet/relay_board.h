#pragma once

// What this node can serve to other nodes pulling the same version: for every piece it is
// pulling (or pulled last), the staging slot and the byte ranges that have landed in it so far.
// The pull writes here as reads complete; the Peer.Relay handler reads from here and streams
// the landed ranges to a downstream puller, which reads them from the slot over the data plane
// while the rest is still arriving (pipelined, chunk by chunk).
//
// Nothing here is trusted by the reader: it verifies every relayed byte against the origin's
// checksums and refetches from the origin what fails.
//
// Thread-safety: every method may be called from any thread (Landed from the data-plane
// thread: it only appends under a mutex and notifies).

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"
#include "daemon/memory/region.h"

namespace refit::fleet {

using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;  // [begin, end)

struct RelayKey {
  std::string model;
  uint64_t version = 0;
  std::string origin;     // the node that published the piece
  std::string buffer_id;  // the piece
  bool operator<(const RelayKey& o) const {
    return std::tie(model, version, origin, buffer_id) <
           std::tie(o.model, o.version, o.origin, o.buffer_id);
  }
};

enum class RelayState { kPulling, kComplete, kFailed };

// A reader's view of one piece: what is there now.
struct RelayView {
  std::shared_ptr<Region> slot;  // keeps the slot alive while the reader holds the view
  uint64_t bytes = 0;            // the piece's size
  Ranges planned;                // every range this node will hold of the piece
  Ranges landed;                 // landed since the cursor the caller passed
  size_t cursor = 0;             // pass back to get only what landed after this view
  RelayState state = RelayState::kPulling;
};

class RelayBoard {
 public:
  // Pieces of versions older than the newest this many per model are forgotten (a reader
  // still streaming one holds its slot until it is done).
  static constexpr int kVersionsKept = 1;

  // This node is pulling `key` into `slot`; it will hold `planned` of it (sorted, disjoint).
  void Begin(const RelayKey& key, std::shared_ptr<Region> slot, uint64_t bytes, Ranges planned);
  // [offset, offset + length) of `key` landed in its slot.
  void Landed(const RelayKey& key, uint64_t offset, uint64_t length);
  // The pull of `model` `version` ended: complete (its bytes verified) or failed.
  void End(const std::string& model, uint64_t version, bool complete);
  // A pull of `model` `version` is about to take its staging slots: the board lets go of the
  // pieces of older versions, so that their slots (if nothing else holds them) go back to the
  // pool before the new pull asks it for slots. Readers still streaming one keep its slot.
  // Without this, a node that stages one version at a time (--delta-base=destination) found the
  // previous version's slot still held here and allocated (faulted in) a second one in its
  // second version, while its readers waited for it (issue 36: version 2 at 2-4x the others).
  void Retire(const std::string& model, uint64_t version);

  // Waits until `key` is on the board and something landed past `cursor` or its state is not
  // kPulling, or `deadline`. NOT_FOUND when `key` never appeared by then.
  absl::StatusOr<RelayView> Wait(const RelayKey& key, size_t cursor,
                                 std::chrono::steady_clock::time_point deadline);

 private:
  struct Entry {
    std::shared_ptr<Region> slot;
    uint64_t bytes = 0;
    Ranges planned;
    Ranges landed;  // in the order reads completed
    RelayState state = RelayState::kPulling;
  };
  common::Mutex mu_;
  common::CondVar changed_;
  std::map<RelayKey, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::fleet
