#pragma once

// Private to daemon/store: the records behind Store, shared by store.cc (one node) and
// cluster.cc (versions spanning several nodes). Guarded by Store::mu_ unless noted.

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/run_writer.h"
#include "daemon/common/mutex.h"
#include "daemon/plan/plan.h"
#include "daemon/store/quantized_slots.h"
#include "daemon/store/sparse_runs.h"
#include "daemon/store/store.h"
#include "daemon/store/tensor_index.h"

namespace refit {

struct Store::Buffer {
  std::string id;
  std::string model;
  std::string client;
  std::string owner;   // who registered it (RegisterBuffer's `owner`)
  std::string memory;  // region->Identity(); empty: none
  Role role = Role::kUnspecified;
  std::shared_ptr<Region> region;
  std::vector<TensorSlice> slices;  // normalized; offsets from the region start
  // SOURCE buffers: the byte span a snapshot copies, and the slices relative to it.
  uint64_t span_begin = 0;
  uint64_t span_end = 0;
  std::shared_ptr<const std::vector<TensorSlice>> snapshot_slices;
  bool scaled = false;          // holds fp8 slices with block scales (DESTINATION)
  uint64_t last_published = 0;  // guarded by Store::mu_
  // DESTINATION buffers: non-empty when its layout disagrees with the model's sources (set by
  // RecheckDestinations); such a buffer is left out of plans and Apply refuses it.
  std::string refused;  // guarded by Store::mu_
  common::Mutex io_mu;  // one snapshot or one Apply at a time on this memory
  // DESTINATION buffers: the version the last Apply installed and verified here; 0: none, or
  // what landed is stale (a failed or unverified Apply). Written under io_mu.
  std::atomic<uint64_t> applied{0};
  ChecksumHints hints;  // SOURCE buffers (checksum_hints.h: its own lock)
};

struct Store::Piece {
  std::string buffer_id;
  std::shared_ptr<const std::vector<TensorSlice>> slices;
  std::shared_ptr<Region> slot;  // null: held by another node and not pulled here
  // A host copy of a GPU slot (--slot-memory=cuda): what other nodes, deltas and checksums
  // read. Null when `slot` is host memory.
  std::shared_ptr<Region> host;
  // Byte ranges of `slot` that hold the version's bytes; null: all of it (a local snapshot).
  std::shared_ptr<const std::vector<std::pair<uint64_t, uint64_t>>> valid;
  std::string node;        // empty: this node
  std::string remote_key;  // for pieces of other nodes
  // XXH3-64 per kChecksumChunkBytes chunk of what other nodes read (`host` or else `slot`),
  // computed at Publish; null for pieces of other nodes. `range_xxh3`: the ranges off that
  // grid peers asked for before (LocalSnapshot::Piece).
  std::shared_ptr<const std::vector<uint64_t>> xxh3;
  std::shared_ptr<const RangeSums> range_xxh3;
  // --delta-base=destination: `slot` was let go once every DESTINATION buffer held the
  // version; they are its copy now (Model::destination_base).
  bool released = false;
  // Sparse Apply (store_sparse.cc): what differs from version `changes_base`'s piece of the
  // same buffer, found as the piece arrived (Publish, FinishPull); null: not diffed.
  std::shared_ptr<const ChangeList> changes;
  uint64_t changes_base = 0;
  uint64_t compared_bytes = 0;  // of the piece, diffed
};

struct Store::Version {
  uint64_t number = 0;
  std::string run;            // the trainer's run it belongs to (Model::run when it completed)
  std::vector<Piece> pieces;  // sorted by buffer id
  std::string layout_key;     // the piece buffer ids: equal keys mean equal source layouts
  uint64_t bytes = 0;
  // The fp8 destinations' derived slots (quantize.h); filled before the version completes
  // here (partly while its pieces arrive), or by the first Apply into destinations registered
  // later.
  std::shared_ptr<QuantCache> quant = std::make_shared<QuantCache>();
};

struct Store::CachedPlan {
  // What Apply runs: locations 0 .. pieces-1 are the version's pieces, then one more (the
  // batch's derived slot), from which the scaled fp8 slices and their scale tensors are copied.
  plan::Plan plan;
  std::vector<const QuantJob*> jobs;  // of `batch`, whose slot is one location of the plan
  // The model's batch for the source layout (every DESTINATION buffer's jobs): what the
  // quantizer fills for each version, and Apply copies from. A CachedPlan kept in `plans`
  // under a name of its own holds only this (so that whatever drops the plans drops it too).
  std::shared_ptr<const QuantBatch> batch;
  // Where there are jobs: the source bytes the destinations need (the scaled slices as if
  // converted from their sources), for pulls and CheckHeld. Otherwise `plan` says it.
  plan::Plan reads;
  const plan::Plan& Reads() const { return jobs.empty() ? plan : reads; }
  // Per destination location: the byte ranges `plan` may write there, merged (what an Apply
  // saves in its undo journal before it writes).
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> dst_extents;
};

// --delta-base=destination: a version whose pulled pieces' held copy was released because every
// DESTINATION buffer of the model held it (verified Apply). What rebuilds and checks it.
struct Store::DestinationBase {
  uint64_t version = 0;
  std::shared_ptr<const Version> source;       // the version as kept (released pieces: no slot)
  std::shared_ptr<const CachedPlan> plan;      // the plan that filled `dests` from `source`
  std::vector<std::shared_ptr<Buffer>> dests;  // plan locations, in order
  struct Digests {
    std::vector<std::pair<uint64_t, uint64_t>>
        segments;                // the piece's valid ranges cut at the checksum grid
    std::vector<uint64_t> xxh3;  // of each segment, taken before the slot was released
  };
  std::map<size_t, Digests> pieces;  // by index into source->pieces: the released ones
};

struct Store::Model {
  std::string name;
  std::set<std::string> sources;
  std::set<std::string> destinations;
  std::map<uint64_t, std::map<std::string, Piece>> pending;  // version -> buffer id -> piece
  std::map<uint64_t, std::shared_ptr<const Version>> complete;
  uint64_t latest = 0;
  std::deque<uint64_t> history;  // completed versions, oldest first
  std::map<std::string, std::shared_ptr<const CachedPlan>> plans;
  // DESTINATION buffers with scaled fp8 slices. Non-zero: versions are quantized before they
  // complete here.
  int scaled_buffers = 0;
  bool HasScales() const { return scaled_buffers > 0; }
  // Tensors by name (tensor_index.h), for RegisterBuffer's checks: the SOURCE slices here and
  // on other nodes (kept as local sources register; rebuilt by Store::SourcesOf after a release
  // or when other nodes' layouts changed), and the DESTINATION slices (Store::DestinationsOf:
  // built when first needed, then kept as destinations register; cleared by a release).
  // Guarded by Store::mu_.
  mutable SourceIndex source_index;
  mutable DestinationIndex destination_index;
  uint64_t finishing = 0;  // version being quantized before it completes; 0: none
  // Pending versions whose local pieces are quantized as they are published (QuantizeEarly):
  // their derived slots, handed to the version when it completes.
  std::map<uint64_t, std::shared_ptr<QuantCache>> early_quant;

  // Several nodes (what they told of the model: Store::remotes_, remote_view.h).
  uint64_t local_ready = 0;  // newest version all local sources published
  std::map<uint64_t, std::shared_ptr<const LocalSnapshot>> snapshots;  // for other nodes
  uint64_t pulling = 0;               // version being pulled; 0: none
  std::vector<Piece> pulling_pieces;  // its pieces, remote ones not yet staged
  // Per fetch of that pull built from deltas: the version they were applied to and what they
  // changed, as a change list (NoteDeltaChanges).
  std::map<size_t, std::pair<uint64_t, std::shared_ptr<const ChangeList>>> pulling_changed;
  uint64_t failed = 0;           // newest version whose pull failed
  absl::Status failed_status;    // why (OK when it couldn't be planned)
  std::string staging_reserved;  // the remote layout staging slots were reserved for
  // The run of each other node whose pieces the newest complete version came from.
  std::map<std::string, std::string> latest_runs;
  uint64_t skipped = 0;  // newest announced version not taken
  std::string skipped_reason;
  // --delta-base=destination: the version the destinations stand in for (null: none), and why
  // the held copy is kept instead (said once in the log, and in Status).
  std::shared_ptr<const DestinationBase> destination_base;
  std::string delta_base_note;

  // Runs and rollback (store_versions.cc).
  std::string run;                    // the trainer's current run ("" : none named)
  std::deque<std::string> past_runs;  // runs left, oldest first (at most kMaxPastRuns)
  uint64_t hold = 0;                  // rollback target; 0: none
  struct Event {
    uint64_t seq = 0;
    VersionTarget target;
  };
  std::deque<Event> events;  // what Watch delivers, oldest first (bounded)

  // Prepared sparse Apply (store_sparse_prepared.cc): the sets of DESTINATION buffers applied
  // together (by their ids, joined with ","; at most kMaxApplyGroups, the oldest forgotten), and
  // the newest version's writes prepared for each set.
  std::map<std::string, std::vector<std::weak_ptr<Buffer>>> apply_groups;
  std::deque<std::string> apply_group_order;  // oldest first
  std::map<std::string, std::shared_ptr<PreparedSparse>> prepared;
};

// Sparse Apply's threads as asked: StoreOptions::sparse_threads, or the test build's
// REFIT_TEST_SPARSE_THREADS (0: sparse::ThreadsFor picks).
unsigned SparseThreadsWanted(const StoreOptions& options);
// Test build, REFIT_FAULT_APPLY_FLIP=N: true for the first N sparse Applies (a byte of the
// destination changes under their first write: the verified write must catch it).
bool TakeSparseFlip();
// CPU seconds of this process so far (the run-list collection's debug line).
double ProcessCpuSeconds();

// What a sparse Apply reads, per source location of its plan (the version's pieces, then the
// derived slot of fp8 destinations with scales), where every location the plan reads was diffed
// against the version the destinations hold, in host memory (Store::SparseInputsFor).
struct Store::SparseInputs {
  std::vector<const ChangeList*> changes;
  std::vector<const uint8_t*> base;  // the held version's bytes
  std::vector<const uint8_t*> src;   // the new version's bytes
  uint64_t runs = 0;                 // change runs of the locations the plan reads
  uint64_t changed = 0;              // their changed bytes
  uint64_t compared = 0;             // their bytes compared
  // What keeps the derived slot's list and the held version's derived slot alive.
  std::shared_ptr<const ChangeList> derived_changes;
  std::shared_ptr<Region> held_derived;
  sparse::Sources sources() const { return sparse::Sources{changes, base, src, runs}; }
};

// A sparse Apply of `version` into `dests` (holding `base`) with `plan`, its writes collected as
// the version completed (RunPrepares), so that Apply only writes. Filled by prepare_loop_'s
// thread, then `ready` set under Store::mu_; read by Apply only once it saw `ready`.
struct Store::PreparedSparse {
  PreparedSparse() = default;
  PreparedSparse(const PreparedSparse&) = delete;
  PreparedSparse& operator=(const PreparedSparse&) = delete;
  ~PreparedSparse() { gauge.Add(-static_cast<double>(counted)); }
  // refit_sparse_prepared_bytes moved to the lists' bytes as they are now (their capacity).
  void Account() {
    uint64_t bytes = 0;
    for (const sparse::RunList& list : lists) {
      bytes += list.runs.capacity() * sizeof(cuda::ByteRun) + list.values.capacity() +
               list.ops.capacity() * sizeof(list.ops[0]) +
               list.checks.capacity() * sizeof(list.checks[0]) + list.expected.capacity();
    }
    gauge.Add(static_cast<double>(bytes) - static_cast<double>(counted));
    counted = bytes;
  }
  GaugeHandle gauge;  // refit_sparse_prepared_bytes
  uint64_t counted = 0;
  uint64_t version = 0;
  uint64_t base = 0;
  // The very versions (a new run reuses numbers): matched by identity, not kept alive.
  std::weak_ptr<const Version> source, held;
  std::shared_ptr<const CachedPlan> plan;
  std::vector<const Buffer*> dests;  // plan locations, in order
  // Guarded by Store::mu_: the collection started (an Apply waits for it), or finished.
  bool started = false;
  bool ready = false;
  bool usable = false;  // the lists were collected (else: why not)
  std::string why;
  std::vector<sparse::RunList> lists;  // per destination
  sparse::HostCuts cuts;               // the host writer's share of each thread
  // GPU destinations (RunWriter path): per destination, a writer whose Upload of the runs and
  // their new bytes was done as the version completed (null: the Apply uploads), and the region
  // it writes (kept alive as long as the writer). Used by the Apply that holds the destinations'
  // io_mu (one at a time), hence mutable.
  std::vector<std::shared_ptr<Region>> regions;
  mutable std::vector<std::unique_ptr<cuda::RunWriter>> writers;
  uint64_t runs = 0;      // change runs
  double collect_ms = 0;  // wall time of the collection
};

// One PreparedSparse to fill, with what it reads (kept alive until it is done).
struct Store::PrepareJob {
  std::string model;
  std::string key;  // the set's (Model::prepared)
  std::shared_ptr<PreparedSparse> out;
  std::shared_ptr<const Version> version, held;
  std::vector<std::shared_ptr<Buffer>> dests;
  std::vector<sparse::RunList> recycle;  // the lists of the set's previous PreparedSparse
};

}  // namespace refit

namespace refit {

using ByteRanges = std::vector<std::pair<uint64_t, uint64_t>>;

// Past this share of changed bytes a sparse Apply is not worth it: the full copy runs (and a
// diff that finds more stops: store_diff.cc).
inline constexpr uint64_t kDenseShareInverse = 8;  // 12.5 %

// The source byte runs `op` reads, one per row: [begin, end).
void AppendSourceRuns(const plan::CopyOp& op, ByteRanges* out);
// Sorts and merges overlapping or touching ranges.
void MergeRanges(ByteRanges* ranges);
// True when every byte `op` reads from its source lies in `valid` (sorted, merged).
bool RangesCover(const ByteRanges& valid, const plan::CopyOp& op);
// Per destination location of `plan` (`locations` of them): the byte extents its ops write,
// merged.
std::vector<ByteRanges> DestinationExtents(const plan::Plan& plan, size_t locations);

}  // namespace refit

namespace refit {

// RegisterBuffer's checks of fp8 slices with scales against the model (store_quant.cc): a
// scaled slice's scale tensor is registered (earlier, or in `slices`) as FP32 DESTINATION slices
// of the scale shape and is no source tensor here; a new slice of a scale tensor fits the tensors
// it scales; a source never provides a scale tensor. INVALID_ARGUMENT.
// `request`: the first of `slices` of each tensor (by name); `first_of[i]`: that first slice's
// index for slices[i]. `destinations`: the model's DESTINATION buffers registered before (null
// where there are none). For a DESTINATION request, `is_scale` gets one entry per slice: 1 for a
// slice of a scale tensor that an fp8 slice (of the request or registered before) names; those
// were checked here and are not source tensors, so the caller need not look them up among the
// sources again.
absl::Status CheckScaleLayout(const std::string& model, Role role,
                              const std::vector<TensorSlice>& slices, const NameTable& request,
                              const std::vector<uint32_t>& first_of, const SourceIndex& sources,
                              const DestinationIndex* destinations, std::vector<char>* is_scale);

}  // namespace refit
