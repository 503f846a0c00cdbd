#pragma once

// The store's value types (daemon/store/store.h): what its methods take and return, what a pull
// is made of (PullJob), what other nodes' pieces look like (SourceLayout, RemotePieceRef), and
// the listener interface of its events (StoreEvents). Plain data and one interface, no store:
// packages that only pass these around (the data plane, the pull and peer planes' headers)
// depend on //daemon/store:types, not on the whole store.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/common/types.h"
#include "daemon/memory/checksum.h"
#include "daemon/memory/region.h"

namespace refit {

struct PublishResult {
  uint64_t version = 0;
  uint64_t bytes = 0;  // bytes snapshotted
};

struct ApplyResult {
  uint64_t version = 0;
  uint64_t bytes_written = 0;
  uint64_t undo_bytes = 0;  // saved in the undo journal before writing (atomic Apply)
  bool sparse = false;      // only the changed elements were written (sparse Apply)
  bool prepared = false;    // ... with the writes collected as the version completed
};

struct BufferInfo {
  std::string id;
  Role role = Role::kUnspecified;
  std::string client;
  uint64_t bytes = 0;
  uint32_t tensors = 0;
  uint64_t last_published = 0;
  MemoryKind memory = MemoryKind::kHost;
  // A DESTINATION buffer whose layout disagrees with the model's SOURCE buffers (which
  // registered after it): why Apply refuses it. Empty: usable.
  std::string error;
  // DESTINATION buffers: the version the buffer holds entirely (its last Apply, verified; or,
  // after a refitd killed inside an Apply restarted, the version the journal put back); 0: none
  // known.
  uint64_t applied_version = 0;
};

struct ModelInfo {
  std::string name;
  uint64_t latest_version = 0;
  std::vector<uint64_t> versions;  // complete versions held, oldest first
  uint32_t source_buffers = 0;
  uint32_t destination_buffers = 0;
  uint64_t version_bytes = 0;  // bytes of the newest held version's snapshot
  std::vector<BufferInfo> buffers;
  uint64_t abandoned_version = 0;  // newer than latest_version and given up on; 0: none
  std::string abandoned_error;
  // Inf/NaN source values in the blocks quantized for fp8 destinations of latest_version.
  uint64_t latest_nonfinite_values = 0;
  // The newest version another node announced that this node did not take (its number was
  // not newer than the one held here, from another run of that node), and why; 0: none.
  uint64_t skipped_version = 0;
  std::string skipped_reason;
  // Host version slots of the model on this node (GPU slots are not counted here).
  // held: the complete versions kept (--retain) and the local snapshots other nodes read;
  // spare: released slots kept for the model's next versions; in_flight: the version being
  // published or pulled, a delta encoder's base, and dropped versions a reader still holds.
  // budget: (retain + 1) x share, where share is the bytes of one version's slots here (local
  // SOURCE buffers' spans, plus the other nodes' pieces when this node has DESTINATION buffers).
  uint64_t held_bytes = 0;
  uint64_t spare_bytes = 0;
  uint64_t in_flight_bytes = 0;
  uint64_t share_bytes = 0;
  uint64_t budget_bytes = 0;
  // Non-empty when the model's next version would not fit under --max-slot-memory (said before
  // a Publish or a pull fails), or its (retain + 1) versions never can.
  std::string memory_warning;
  // --delta-base for the model: "held" or "destination"; with destination, the version whose
  // held copy was released because the DESTINATION buffers hold it (0: none), or why the held
  // copy is kept (e.g. a GPU destination).
  std::string delta_base = "held";
  uint64_t destination_base_version = 0;
  std::string delta_base_note;
  // Runs (store_versions.cc): the trainer's current run of the model, and the runs it left.
  std::string run;
  std::vector<std::string> past_runs;
  // Rollback: the version the model is held back to on this node (0: none).
  uint64_t rollback_version = 0;
};

// What Watch delivers (store_versions.cc): a version that became the engine's target.
struct VersionTarget {
  uint64_t version = 0;
  bool rollback = false;  // an older, retained version (Rollback); newer ones are held back
  std::string run;        // the trainer's run of `version`
};

// What Verify found in one DESTINATION buffer.
struct VerifyResult {
  std::string buffer_id;
  uint64_t version = 0;                    // the version its last Apply installed; 0: none to check
  bool checked = false;                    // its bytes were compared (else `note` says why not)
  std::vector<std::string> stale_tensors;  // tensors whose bytes differ from `version`'s
  std::string note;
};

// What DropModel released.
struct DropResult {
  std::vector<uint64_t> released_versions;  // complete versions that were held
};

// One SOURCE buffer's snapshot layout: slices relative to the snapshot's first byte.
struct SourceLayout {
  std::string buffer_id;
  std::shared_ptr<const std::vector<TensorSlice>> slices;
  uint64_t bytes = 0;
};

// Sparse Apply: byte runs [begin, end) of a piece that differ from the same piece of an earlier
// version, sorted and disjoint, each from the first to the last differing byte of an 8-byte
// word (runs of neighbouring words merged).
using ChangeRuns = std::vector<std::pair<uint64_t, uint64_t>>;

// A piece's change list: its ChangeRuns and, carried with them, the new version's bytes of each
// run's 8-byte words ([run begin rounded down to 8, run end rounded up to 8, at most the piece's
// size)), back to back in run order, so that a sparse Apply reads the new values sequentially
// and only the destination is scattered (store_sparse.cc).
struct ChangeList {
  ChangeRuns runs;
  std::vector<uint64_t> values_at;  // runs.size() + 1 entries: where each run's words start
  std::vector<uint8_t> values;
  uint64_t changed_bytes = 0;  // sum of the runs' lengths

  // The new bytes [at, at + n) of the piece, when they lie in run `run`'s words; else null.
  const uint8_t* Values(size_t run, uint64_t at, uint64_t n) const {
    const uint64_t lo = runs[run].first & ~uint64_t{7};
    if (at < lo) return nullptr;
    const uint64_t from = values_at[run] + (at - lo);
    return from + n <= values_at[run + 1] ? values.data() + from : nullptr;
  }
};

// A version's snapshot of this node's SOURCE buffers: what other nodes read.
struct LocalSnapshot {
  std::string model;
  uint64_t version = 0;
  std::string run;  // the trainer's run of `version` (PublishRequest.run)
  struct Piece {
    std::string buffer_id;
    std::shared_ptr<Region> slot;
    // XXH3-64 of each kChecksumChunkBytes chunk of `slot` (checksum.h), computed at Publish.
    std::shared_ptr<const std::vector<uint64_t>> xxh3;
    // Digests of ranges off that grid that peers asked for before (NoteChecksumRanges), also
    // computed at Publish; null when none.
    std::shared_ptr<const RangeSums> range_xxh3;
  };
  std::vector<Piece> pieces;
};

// A version piece held by another node, as that node announced it.
struct RemotePieceRef {
  std::string buffer_id;
  std::string remote_key;  // the transport's remote descriptor
  uint64_t bytes = 0;
};

// A delta of a piece held by another node: base_version's bytes -> version's bytes.
struct RemoteDeltaRef {
  std::string buffer_id;
  uint64_t base_version = 0;
  uint64_t version = 0;
  std::string remote_key;
  uint64_t bytes = 0;
};

// What the data plane must fetch so that `version` of `model` is complete here.
struct PullJob {
  std::string model;
  uint64_t version = 0;
  std::string run;  // the trainer's run of `version`: a pull of a run since left is dropped
  struct Fetch {
    std::string node;
    std::string buffer_id;
    std::string remote_key;
    uint64_t bytes = 0;  // the piece's size (the staging slot's size)
    std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [begin, end), sorted, disjoint
    // Delta sync: when `base` is set this node holds `ranges` of the piece's `base_version`
    // there (verified), and applying `deltas` in order turns them into `version`'s. The
    // fetcher may still pull the ranges in full (a delta too big, or failing).
    std::shared_ptr<Region> base;
    uint64_t base_version = 0;
    std::vector<RemoteDeltaRef> deltas;
    // --delta-base=destination: instead of `base`, this node's DESTINATION buffers hold
    // base_version (its held copy was released); Store::BaseFromDestinations rebuilds it.
    bool destination_base = false;
  };
  std::vector<Fetch> fetches;
  uint64_t Bytes() const;
};

// The store's events: what the rest of the daemon hears about (docs/architecture.md, "Store
// events"). A listener overrides the events it cares about; the others do nothing. Registered
// with Store::AddListener (refitd: daemon/wiring.cc), called in the order they were added.
//
// Called with the store's lock held, on the thread whose call caused the event (a Publish,
// RegisterBuffer or ReleaseBuffer caller, a peer's announcement, the pull worker's FinishPull,
// the bucket importer, or the store's quantizer thread): a listener must only queue work or set
// a flag, and never call back into the store.
class StoreEvents {
 public:
  virtual ~StoreEvents() = default;

  // Every local SOURCE buffer of `model` has published `version`; its snapshot is held
  // (GetLocalSnapshot) when a listener WantsLocalSnapshots.
  virtual void OnLocalVersionReady(const std::string& /*model*/, uint64_t /*version*/) {}
  // `model` started the trainer's run `run` here: the previous run's versions were let go
  // (versions may restart below theirs), or the rollback target changed (Rollback, Resume).
  virtual void OnRunStarted(const std::string& /*model*/, const std::string& /*run*/) {}
  virtual void OnHoldChanged(const std::string& /*model*/, uint64_t /*version*/) {}
  // The local SOURCE layout of `model` changed (a source registered or released).
  virtual void OnLayoutChanged(const std::string& /*model*/) {}
  // Other nodes' sources announced a version this node should take: start fetching `job`'s
  // pieces and answer with Store::FinishPull (one listener takes pulls: refitd's PeerManager).
  virtual void OnPullNeeded(const PullJob& /*job*/) {}
  // `version` of `model` became complete on this node (visible to WaitForVersion and Apply).
  virtual void OnVersionComplete(const std::string& /*model*/, uint64_t /*version*/) {}
  // `version` of `model` was quantized for this node's fp8 destinations, in `seconds` (just
  // before it completes).
  virtual void OnVersionQuantized(const std::string& /*model*/, uint64_t /*version*/,
                                  double /*seconds*/) {}

  // True when the listener reads local versions' snapshots (other nodes pull them, deltas
  // are encoded from them, the bucket exports them): the store keeps the newest --retain
  // snapshots of each model's local versions only while some listener wants them.
  virtual bool WantsLocalSnapshots() const { return false; }
};

// Checks whether the caller has gone away (e.g. a cancelled RPC).
using CancelledFn = std::function<bool()>;
using Clock = std::chrono::steady_clock;

}  // namespace refit
