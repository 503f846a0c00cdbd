#pragma once

// The store: models, their registered buffers, and their versions. The heart of the daemon and
// free of I/O: it never sees protobuf, sockets or the network. Regions arrive already mapped.
//
// Versions. Publish snapshots SOURCE buffers into daemon-owned slots ("pieces") before it
// returns. Version N of a model becomes complete once every SOURCE buffer registered for the
// model has published N; then it is visible to WaitForVersion, Watch and Apply all at once, so
// no reader ever sees part of a version. The newest `retain` complete versions are kept; an
// older version's slots are freed when the last Apply reading them finishes.
//
// Memory. A model's version slots on this node (its share: one version's slots here) are
// budgeted at (retain + 1) x share: the versions kept and the one being published or pulled,
// whose slot becomes a held one. Released slots are kept for reuse only within that budget;
// a model one version of which can't fit under --max-slot-memory is refused at RegisterBuffer,
// and a pull that can't is refused before it starts (store_memory.cc). Models() reports the
// figures (ModelInfo::held_bytes ...).
//
// Apply executes a transfer plan (daemon/plan) from the version's pieces into DESTINATION
// buffers; plans are cached per (source pieces, destination buffers) and dropped whenever a
// registration changes.
//
// Thread-safety: every public method may be called from any thread concurrently. Blocking
// waits end at their deadline, when `cancelled` returns true, or at Shutdown.

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"
#include "daemon/common/types.h"
#include "daemon/common/worker_loop.h"
#include "daemon/memory/checksum.h"
#include "daemon/memory/region.h"
#include "daemon/memory/slot_pool.h"
#include "daemon/store/apply_journal.h"
#include "daemon/store/checksum_hints.h"
#include "daemon/store/client_store.h"
#include "daemon/store/delta_base_mode.h"
#include "daemon/store/peer_store.h"
#include "daemon/store/quant_queue.h"
#include "daemon/store/remote_view.h"
#include "daemon/store/slot_budget.h"
#include "daemon/store/store_metrics.h"
#include "daemon/store/store_types.h"
#include "daemon/store/version_imports.h"

namespace refit::cuda {
class RunWriter;
class RunWriters;
}  // namespace refit::cuda

namespace refit::sparse {
struct Sources;
struct RunList;
}  // namespace refit::sparse

namespace refit::plan {
struct Plan;
struct PlacedSlice;
struct PlanOptions;
}  // namespace refit::plan

namespace refit {

struct QuantJob;
class QuantBatch;
class SourceIndex;
class DestinationIndex;
class ApplyJournal;
struct UndoTarget;

// The fields named after a refitd flag are set by refitd from DaemonOptions (StoreOptionsFrom,
// daemon/component_options.h), where their defaults live (daemon/config's option table prints
// them). Here they hold neutral values, never a second default: 0 or "off", the plain mode of
// an enum, and a retain and node that the Store refuses (CheckStoreOptions). Tests start from
// testing::TestStoreOptions (store_testing.h).
struct StoreOptions {
  uint32_t retain = 0;                         // --retain: complete versions kept per model, >= 1
  uint64_t max_spare_slot_bytes = 4ull << 30;  // released slots kept for reuse
  std::string node;                            // --node: used in buffer ids; not empty
  // --slot-memory, --slot-device: where version slots live: host memory (pinned when CUDA is
  // compiled in and a GPU is seen, so GPU buffers copy at PCIe speed) or GPU memory on
  // `slot_device`. GPU slots keep a pinned host mirror, made at Publish, for what other nodes
  // read (UCX here has no CUDA support).
  MemoryKind slot_memory = MemoryKind::kHost;
  int slot_device = 0;
  // Makes host slots; null means pinned memory (cuda::AllocatePinnedHost). refitd passes the
  // data plane's allocator when no GPU is seen, so that peers on this host map its slots.
  SlotPool::Allocator host_slot_allocator;
  // --max-slot-memory: most bytes of host slots held (in use and spare); 0: no limit.
  uint64_t max_slot_bytes = 0;
  // --max-gpu-slot-memory: the same for GPU slots (slot_memory kCuda), counted apart.
  uint64_t max_gpu_slot_bytes = 0;
  // --delta-base: for every model, and per model (ParseDeltaBase); kHeld: the held copy.
  DeltaBase delta_base = DeltaBase::kHeld;
  std::map<std::string, DeltaBase> delta_base_models;
  // --state-dir: where Apply keeps its undo journal (apply_journal.h), so that an Apply cut
  // short by a kill is undone after the restart; empty: memory (errors are undone, a kill is
  // not).
  std::string journal_dir;
  // Sparse Apply's cost model: one changed run costs about as much as copying this many bytes in
  // a full Apply (scattered runs are bound by memory latency; fitted on bench-apply.sh, where
  // the break-even measured 250-340 bytes per run with the new bytes carried in the change
  // list: docs/benchmarks.md, "Third run"); a sparse Apply runs only when runs x this < the
  // bytes a full Apply writes. 0: whenever it applies (tests; REFIT_TEST_SPARSE_ALWAYS).
  uint64_t sparse_bytes_per_run = 384;
  // Threads of a sparse Apply: 0 picks (one per core, at most 8, from 16,384 changed runs);
  // N > 0 takes N whenever the work cuts into as many items (tests: the undo record in parts;
  // the test build's REFIT_TEST_SPARSE_THREADS sets it in refitd).
  unsigned sparse_threads = 0;
  // The same cost model for the run-list sparse Apply (GPU destinations): one changed run costs
  // about as much as a full Apply's copy of this many bytes over the bus. A run costs its
  // collection on the host (measured 50-90 ns of CPU per run at 0.4 % of 1 GiB, 2.1 M runs, on
  // a loaded 2-core dev machine: sparse_apply_bench) plus its ByteRun (24 bytes) and values (up,
  // saved, read back) over the bus; a full copy moves the destination's bytes at about 50 GB/s
  // (the H200's 21.7 ms per GiB from host slots), so a run costs about 3.5-4.5 KB of full copy.
  // Not yet measured on a GPU (sparse_apply_bench --destination=gpu, the GPU bundle's
  // sparse-bench step, will). 0: whenever it applies.
  uint64_t gpu_sparse_bytes_per_run = 4096;
  // A prepared sparse Apply (docs/architecture.md, "Sparse Apply"): as a version completes, for
  // each set of DESTINATION buffers applied together before whose buffers hold a version it was
  // diffed against, the writes of its sparse Apply are collected on a thread of the store's
  // (the walk of the change lists, the conversion, the base's bytes at the checked writes), so
  // that the engine's Apply is the writing alone. false: collected inside Apply (tests, bench).
  bool prepare_sparse = true;
  // The cost model when the writes were prepared: one changed run costs about as much as a full
  // Apply's copy of this many bytes (host: the scattered save, write and check of a run, fitted
  // on sparse_apply_bench, docs/benchmarks.md; GPU: its ByteRun and values over the bus, 24 +
  // 3 x its bytes, and the scattered device writes: derived, not yet measured on a GPU). 0:
  // whenever it applies.
  uint64_t sparse_prepared_bytes_per_run = 160;
  uint64_t gpu_sparse_prepared_bytes_per_run = 64;
  // Test seam: when set, host DESTINATION buffers take the run-list sparse Apply (GPU ones'),
  // with writers opened here instead of cuda::OpenRunWriter, so that it runs without a GPU.
  cuda::RunWriters* sparse_run_writers = nullptr;
};

// INVALID_ARGUMENT naming the field when `options` lacks what refitd always sets: retain >= 1
// and a node name. The Store's constructor aborts with this message (a caller's bug, not input).
absl::Status CheckStoreOptions(const StoreOptions& options);

// The narrow interfaces other packages are given instead of the store (issue 38): PeerStore
// (peer_store.h: LocalSnapshots, RemoteSources, VersionHolds, ModelCatalog, PullLanding) for
// daemon/peer and daemon/pull, VersionImports (version_imports.h) for daemon/bucket,
// ClientStore (client_store.h: BufferRegistry, VersionPublishing, VersionWaits, Installer,
// FleetControl, VersionHolds, ModelCatalog) for daemon/server. Their
// methods are documented there.
class Store : public PeerStore, public ClientStore, public VersionImports {
 public:
  Store(StoreOptions options, Metrics* metrics);
  ~Store() override;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // --max-slot-memory (0: none): RegisterBuffer's caller checks a SOURCE against it before it
  // maps the client's memory.
  uint64_t max_slot_bytes() const override { return options_.max_slot_bytes; }

  // Lends the store `region` holding `slices` of `model`'s tensors. Slices are normalized and
  // validated against the region and against the model's other buffers (INVALID_ARGUMENT).
  // Returns the new buffer's id. `owner` names the registering caller (e.g. "uid:pid").
  // Idempotent for the same memory (Region::Identity): the same owner registering it again for
  // the same model, role and slices gets the existing buffer's id back (nothing changes);
  // another owner, model, role or layout on it is ALREADY_EXISTS naming that buffer, and
  // nothing changes either.
  absl::StatusOr<std::string> RegisterBuffer(const std::string& model, Role role,
                                             std::unique_ptr<Region> region,
                                             std::vector<TensorSlice> slices,
                                             const std::string& client,
                                             const std::string& owner = "") override;

  // Stops using a buffer. In-flight Publish/Apply calls on it finish first (they hold it).
  // Releasing a SOURCE buffer abandons the versions in flight that other sources published but
  // it did not (they can't be whole); its published versions stay. `why` says why it goes
  // (e.g. "its process exited"), for logs and the abandoned version's message.
  absl::Status ReleaseBuffer(const std::string& buffer_id, const std::string& why = "") override;

  // Snapshots the listed SOURCE buffers as `version` of `model`. `run`: the trainer's run
  // (empty: the model's current one); another run than the current one starts it here
  // (StartRun): its versions may restart below the old run's. FAILED_PRECONDITION for a run
  // the model left before.
  absl::StatusOr<PublishResult> Publish(const std::string& model, uint64_t version,
                                        const std::vector<std::string>& buffer_ids,
                                        const std::string& run = "") override;

  // ---- Runs and rollback (store_versions.cc) ----
  // The model's current run ("" when none was named) (LocalSnapshots).
  std::string RunOf(const std::string& model) const override;
  // Seeds the model's current run and the runs it left (refitd: from --state-dir at the
  // model's first Publish) without letting anything go.
  void SeedRun(const std::string& model, const std::string& run,
               const std::vector<std::string>& past_runs) override;
  // Holds `model` back to `version` here (VersionHolds: version_holds.h).
  absl::StatusOr<uint64_t> Rollback(const std::string& model, uint64_t version) override;
  // What Rollback would answer, changing nothing: OK when `version` is retained here.
  absl::Status CheckRollback(const std::string& model, uint64_t version) const override;
  // The other nodes with SOURCE buffers of `model` (where a Rollback asked here is forwarded).
  std::vector<std::string> SourceNodes(const std::string& model) const override;
  // Waits until the model's hold is `version` (0: none), up to `deadline`; false past it.
  bool WaitForHold(const std::string& model, uint64_t version, Clock::time_point deadline) override;
  // Ends the hold (VersionHolds).
  absl::Status Resume(const std::string& model) override;
  // The version `model` is held back to here; 0: none (VersionHolds).
  uint64_t HoldOf(const std::string& model) const override;
  // Models held back from the start (refitd: the holds --state-dir kept across a restart): each
  // is held back to its version as if Rollback had been called (Watch delivers it as a rollback
  // event; newer versions are held back until Resume), also when the model is made here later
  // (a buffer registers, a peer announces it). The version itself need not be retained here (it
  // is the one the engines hold).
  void SeedHolds(const std::map<std::string, uint64_t>& holds);
  // Blocks until the model's target (the hold, else its newest complete version) is >=
  // min_version, or its run differs from `run` (non-empty) or from the run at the call's start,
  // or the model is held back to another version than `applied` (non-zero); returns it.
  absl::StatusOr<VersionTarget> WaitForTarget(const std::string& model, uint64_t min_version,
                                              const std::string& run, Clock::time_point deadline,
                                              const CancelledFn& cancelled,
                                              uint64_t applied = 0) override;
  // Watch: where a watch of `model` starts. after_version 0: live events only (a hold in force
  // is delivered first); otherwise the retained complete versions of the current run newer than
  // after_version are replayed first.
  uint64_t WatchCursor(const std::string& model, uint64_t after_version) const override;
  // Blocks until events after `*cursor` exist, returns them and moves the cursor past them.
  absl::StatusOr<std::vector<VersionTarget>> WaitForEvents(const std::string& model,
                                                           uint64_t* cursor,
                                                           Clock::time_point deadline,
                                                           const CancelledFn& cancelled) override;

  // Blocks until a version >= min_version of `model` is complete, then returns the newest.
  // DEADLINE_EXCEEDED past `deadline`; CANCELLED when `cancelled()`; UNAVAILABLE at Shutdown.
  absl::StatusOr<uint64_t> WaitForVersion(const std::string& model, uint64_t min_version,
                                          Clock::time_point deadline, const CancelledFn& cancelled);

  // Blocks until every sparse Apply of `model`'s `version` being prepared (StoreOptions::
  // prepare_sparse) is ready; how many are ready for it (usable or not). For tests and
  // benchmarks that stand for an engine generating while the store prepares. DEADLINE_EXCEEDED
  // past `deadline`.
  absl::StatusOr<size_t> WaitForSparsePrepared(const std::string& model, uint64_t version,
                                               Clock::time_point deadline);

  // Writes `version` (0: newest complete) into the listed DESTINATION buffers.
  absl::StatusOr<ApplyResult> Apply(const std::string& model, uint64_t version,
                                    const std::vector<std::string>& buffer_ids) override;

  // Verified install, after the fact: compares the bytes of each DESTINATION buffer of `model`
  // with the version its last Apply installed (what that Apply would write now). DATA_LOSS
  // naming the buffers and tensors that differ; NOT_FOUND for an unknown model.
  absl::StatusOr<std::vector<VerifyResult>> Verify(const std::string& model) override;

  // Blocks until versions newer than `after_version` have completed, and returns them in
  // order (versions completed before the call are included while they are still remembered).
  // Same ending conditions as WaitForVersion.
  absl::StatusOr<std::vector<uint64_t>> WaitForCompletions(const std::string& model,
                                                           uint64_t after_version,
                                                           Clock::time_point deadline,
                                                           const CancelledFn& cancelled);

  // Newest complete version of `model`, 0 if none (or no such model).
  uint64_t LatestVersion(const std::string& model) const override;

  // Every model this node knows (ModelCatalog).
  std::vector<ModelInfo> Models() const override;

  // Releases every version of `model` held here and forgets it (a record of other nodes'
  // sources for it stays, so their next versions are taken again). FAILED_PRECONDITION naming
  // the buffers while any buffer of it is registered here; NOT_FOUND for a model this node
  // does not know.
  absl::StatusOr<DropResult> DropModel(const std::string& model) override;

  // Every model this node knows (for messages about a name it does not).
  std::vector<std::string> ModelNames() const;

  // ---- Several nodes (driven by daemon/peer) ----

  // Adds `listener` to those told of the store's events (StoreEvents); not owned, it must
  // outlive the store's last event (refitd stops the store's callers first).
  void AddListener(StoreEvents* listener);

  // ---- LocalSnapshots (local_snapshots.h): this node's SOURCE versions, for their readers ----
  std::map<std::string, std::vector<SourceLayout>> LocalSourceLayouts() const override;
  uint64_t LatestLocalSnapshot(const std::string& model) const override;
  absl::StatusOr<std::shared_ptr<const LocalSnapshot>> GetLocalSnapshot(
      const std::string& model, uint64_t version) const override;
  void NoteChecksumRanges(const std::string& buffer_id, uint64_t piece_bytes,
                          const std::vector<RangeRun>& runs) override;
  static constexpr size_t kMaxChecksumHints = ChecksumHints::kMaxRanges;

  // ---- RemoteSources (remote_sources.h): other nodes' sources and versions ----
  void ReserveStaging(const std::string& model) override;
  void SetRemoteSources(const std::string& node, const std::string& model,
                        std::vector<SourceLayout> sources) override;
  void AnnounceRemoteVersion(const std::string& node, const std::string& model, uint64_t version,
                             std::vector<RemotePieceRef> pieces,
                             std::vector<RemoteDeltaRef> deltas = {}, const std::string& run = "",
                             const std::string& trainer_run = "") override;
  void FollowHold(const std::string& node, const std::string& model, uint64_t version) override;
  void ForgetRemoteVersions(const std::string& node) override;

  // ---- VersionImports (version_imports.h): a version handed over whole (a bucket) ----
  void ImportVersion(const std::string& node, const std::string& model, uint64_t version,
                     std::vector<SourceLayout> layouts,
                     std::vector<std::shared_ptr<Region>> slots) override;

  // ---- PullLanding (pull_landing.h): where a pull lands ----
  // The data plane finished `job`: on success `staging[i]` holds job.fetches[i].ranges.
  void FinishPull(const PullJob& job, absl::Status result,
                  std::vector<std::shared_ptr<Region>> staging) override;
  // A fetch of the pull of `job` built from deltas, and their change list: FinishPull takes it
  // for the sparse Apply instead of diffing the piece.
  void NoteDeltaChanges(const PullJob& job, size_t fetch,
                        std::shared_ptr<const ChangeList> changes) override;

  // A slot of `size` bytes for staging pulled (or imported) bytes (PullLanding and
  // VersionImports). It counts against the budget of the
  // model being pulled with a piece of that size (ModelInfo::in_flight_bytes until FinishPull
  // makes it a held version's slot).
  absl::StatusOr<std::shared_ptr<Region>> AcquireSlot(uint64_t size) override;

  // Quantizing a pulled version as its bytes land (fp8 destinations with block scales): true
  // when `model` has some and its sources are on other nodes.
  bool QuantizesWhilePulling(const std::string& model) const override;
  // The pull of `job` (in progress: Model::pulling) has landed `landed[f]` of fetch f in
  // `staging[f]` (null: not staged yet): quantizes, on the calling thread, the blocks whose
  // source bytes are all there and not quantized yet, into the version's derived slot (it stays
  // invisible until FinishPull completes it and the quantizer finishes the rest). `refetched[f]`
  // (may be empty): ranges fetched again since (their checksums failed): the blocks read from
  // them are quantized again. Does nothing for a job no longer pulled.
  // Bounded, so as not to take cores from the pull it overlaps: one thread (the caller's) and at
  // most `max_tasks` tasks (~4 MiB of source each) per call; returns true when it left runnable
  // tasks for the next call.
  bool QuantizeLanded(const PullJob& job, const std::vector<std::shared_ptr<Region>>& staging,
                      const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& landed,
                      const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& refetched,
                      size_t max_tasks = 1) override;

  // --delta-base=destination: `fetch.ranges` of the piece as version fetch.base_version held
  // them, rebuilt from this node's DESTINATION buffers (what its last Apply installed) into a
  // fresh staging slot of the model (the slot the new version is then built in, in place), and
  // checked against the XXH3 digests taken of the held copy before it was released.
  // FAILED_PRECONDITION naming the buffers and tensors when a destination no longer holds that
  // version (written by someone else since, a failed Apply, a new buffer): pull in full then.
  // Takes each destination's io lock while it reads (never during an Apply); writes nothing
  // the engine sees.
  absl::StatusOr<std::shared_ptr<Region>> BaseFromDestinations(
      const std::string& model, const PullJob::Fetch& fetch) override;

  // Wakes every waiter; they and all later waits return UNAVAILABLE.
  void Shutdown();
  // Takes and releases the store's lock: the watchdog's probe of the store (a caller wedged
  // while holding it makes the probe block). Test build: wedges here on REFIT_TEST_WEDGE=store.
  void Probe();

 private:
  struct Buffer;
  struct Piece;
  struct Version;
  struct Model;
  struct CachedPlan;
  struct DestinationBase;
  struct SparseInputs;    // what a sparse Apply reads (store_internal.h)
  struct PreparedSparse;  // a sparse Apply's writes collected as its version completed
  struct PrepareJob;      // one of those, waiting for prepare_loop_

  Model* FindModel(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when `again` registers `existing`'s memory the same way (same owner, model, role,
  // slices); ALREADY_EXISTS naming `existing` and what differs otherwise.
  static absl::Status SameRegistration(const Buffer& existing, const Buffer& again);
  const Model* FindModel(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckAgainstModel(const Model& model, Role role,
                                 const std::vector<TensorSlice>& slices) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The model's SOURCE slices by tensor (Model::source_index), rebuilt first when a local
  // source was released or other nodes' layouts changed since it was built.
  const SourceIndex& SourcesOf(const Model& model) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The model's DESTINATION slices by tensor (`slices`) and scaled slices by scale tensor
  // (`scaled`), the parts asked for built first where they are not.
  const DestinationIndex& DestinationsOf(const Model& model, bool slices, bool scaled) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the model's DESTINATION buffers whose layout disagrees with its SOURCE buffers (here
  // and on other nodes) as refused, and clears the mark of those that agree again.
  void RecheckDestinations(Model& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops `model` from models_ when nothing is left of it: no buffers, versions, pulls or other
  // nodes' sources.
  void EraseIfEmpty(const std::string& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether another node has SOURCE buffers of the model (remotes_).
  bool HasRemoteSources(const Model& model) const;
  absl::StatusOr<std::vector<std::shared_ptr<Buffer>>> LookUpBuffers(
      const std::string& model, Role role, const std::vector<std::string>& ids) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TryComplete(Model& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pending versions `buffer` (a SOURCE being released) did not publish: abandoned.
  void AbandonUnpublished(Model& model, const Buffer& buffer, const std::string& why);
  void TryCompleteWithRemotes(Model& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ---- Slot memory per model (store_memory.cc) ----
  // The bytes of one version's slots of `model` here (ModelInfo::share_bytes), counting
  // `more_source` bytes of SOURCE buffers more and, with `destination`, a DESTINATION buffer.
  uint64_t ShareOf(const Model& model, uint64_t more_source = 0, bool destination = false) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Recomputes the model's share and tells the slot pools its budget, (retain + 1) x share
  // (0 once it is forgotten): spare slots are kept only within it.
  void UpdateBudget(Model& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED, with the numbers, when one version of `share` bytes of `model` cannot
  // fit under --max-slot-memory beside the other models' slots in use. `what` names the step.
  absl::Status CheckVersionFits(const Model& model, uint64_t share, const std::string& what) const;
  // RESOURCE_EXHAUSTED, with the numbers, when staging `bytes` for `version` of `model` would
  // take the slots in use past --max-slot-memory (checked before a pull starts).
  absl::Status CheckPullFits(const Model& model, uint64_t version, uint64_t bytes) const;
  // Fills the memory fields of `info` (mu_ held).
  void FillMemory(const Model& model, ModelInfo* info) const;
  // Sets fetch->base (or ->destination_base) and ->deltas when this node can catch up by
  // applying deltas.
  void OfferDelta(const Model& model, uint64_t version, PullJob::Fetch* fetch) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ---- --delta-base=destination (store_delta_base.cc) ----
  DeltaBase DeltaBaseOf(const std::string& model) const;
  // For OfferDelta, a piece of the newest version whose held copy was released: true when the
  // destinations can stand in for it (they held it at the release and cover `fetch->ranges`);
  // otherwise counts a fallback (refit_delta_base_fallbacks_total) and logs why.
  bool CanUseDestinationBase(const Model& model, const Piece& piece,
                             const PullJob::Fetch& fetch) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After an Apply of `version`: once every DESTINATION buffer of the model holds it (verified),
  // releases the held copy of its pulled pieces, keeping their digests (destination mode only).
  void ReleaseApplied(const std::string& model, const std::shared_ptr<const Version>& version);
  void NoteLocalReady(Model& model);
  // Starts the trainer's run `run` for `model` (store_versions.cc): lets the previous run's
  // versions, pulls and snapshots go, so that the new run's numbers may restart below them.
  void StartRun(Model& model, const std::string& run, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when `version` of `model` is retained (complete) here; NOT_FOUND naming the oldest.
  absl::Status RetainedForRollback(const Model& model, uint64_t version) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records an event for Watch (store_versions.cc).
  void AddEvent(Model& model, uint64_t version, bool rollback) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A model just made here: held back when SeedHolds says so.
  void SeedHold(Model& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The version Apply(0) and WaitForVersion answer: the hold, else the newest complete.
  static uint64_t TargetOf(const Model& model);
  // FAILED_PRECONDITION for a buffer whose memory went away (Region::Broken), logged.
  static absl::Status MemoryWentAway(const Buffer& buffer, const std::string& more);
  // Seconds spent in each part of one Publish (its debug log line: where the time goes),
  // summed over its buffers (several may be snapshotted at once).
  struct PublishTimes {
    double acquire = 0;  // slots from the pool (a new one is an allocation)
    double copy = 0;     // the client's bytes into the slots (hashed too, host to host)
    double mirror = 0;   // GPU slots' pinned host mirrors
    double hash = 0;     // chunk checksums of what peers read, where not hashed while copied
    double diff = 0;     // the change list against the engines' version (sparse Apply)
  };
  // Publish's copies: a slot per buffer, filled and hashed (no store lock held); small buffers
  // several at once. The first buffer's error in their order, after all were tried.
  absl::Status SnapshotBuffers(const std::vector<std::shared_ptr<Buffer>>& buffers,
                               std::vector<Piece>* pieces, uint64_t* bytes, PublishTimes* times);
  // One buffer's slot(s), copy and chunk checksums into `piece`.
  absl::Status SnapshotBuffer(Buffer& buffer, Piece* piece, PublishTimes* times);
  // A version whose pieces are all here: it completes now, or once the quantizer thread has
  // quantized it for the model's fp8 destinations (Model::finishing meanwhile).
  void CompleteVersion(Model& model, uint64_t version, std::vector<Piece> pieces)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishVersion(Model& model, std::shared_ptr<const Version> version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One job of the quantizer's queue (quant_queue.h), on its thread: a version quantized before
  // it completes, or a pending version's published pieces (QuantizeEarly).
  void RunQuantJob(QuantQueue<Version>::Job job);
  // The derived slot of `plan`'s jobs for `version` (no store lock held): one region, or none
  // when the plan has no jobs.
  absl::StatusOr<std::vector<std::shared_ptr<Region>>> QuantizedSlots(const Version& version,
                                                                      const CachedPlan& plan);
  // Runs `batch` for `version` (no store lock held); `partial`: QuantCache::Run; `landed`: per
  // piece, the bytes a pull has landed so far (null: all).
  // `threads` 0: one per core; `max_tasks`, `runnable_left`: QuantCache::Run.
  absl::StatusOr<std::shared_ptr<Region>> RunQuantBatch(
      const Version& version, const std::shared_ptr<const QuantBatch>& batch, bool partial,
      const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>* landed = nullptr,
      unsigned threads = 0, size_t max_tasks = SIZE_MAX, size_t* runnable_left = nullptr);
  // The two plans of destinations with fp8 scaled slices (mu_ held): the copy from the version's
  // pieces and the derived slot (`cached.jobs`, at location version.pieces.size()), and what
  // that needs held of the pieces.
  absl::StatusOr<std::pair<plan::Plan, plan::Plan>> QuantPlans(
      const Model& model, const Version& version, const std::vector<plan::PlacedSlice>& sources,
      const std::vector<plan::PlacedSlice>& destinations, const CachedPlan& cached,
      const plan::PlanOptions& options) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The model's batch for a source layout (mu_ held): every DESTINATION buffer's jobs.
  std::shared_ptr<const QuantBatch> QuantBatchFor(
      Model& model, const std::string& layout_key,
      const std::vector<const std::vector<TensorSlice>*>& pieces)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A local SOURCE buffer published `version`, which still waits for others: quantize what its
  // pieces so far hold, on the quantizer thread (mu_ held).
  void QuantizeEarly(Model& model, uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckHeld(const Version& version, const plan::Plan& plan) const;
  // DATA_LOSS for an Apply of `version` whose ops `bad` did not land in `dests` (their
  // tensors named; those buffers marked stale).
  // `restored`: the undo journal put every destination back as it was before the call.
  absl::Status NotLanded(const Version& version, const plan::Plan& plan,
                         const std::vector<size_t>& bad,
                         const std::vector<std::shared_ptr<Buffer>>& dests, bool restored);
  // ---- Sparse Apply (store_sparse.cc) ----
  // The newest complete version of `model` to diff an arriving version's pieces against, when
  // this node has DESTINATION buffers for it; null otherwise.
  std::shared_ptr<const Version> DiffBaseFor(const Model& model) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fills `pieces[i].changes` (against `base`'s piece of the same node and buffer, where its
  // bytes over `pieces[i]`'s valid ranges are held) on up to 8 cores; no store lock held.
  // Counts the bytes compared (refit_diff_bytes_total).
  void DiffPieces(std::vector<Piece*> pieces, const Version& base);
  // A pulled piece built by deltas from `base`, with the change list they gathered
  // (NoteDeltaChanges): taken as its changes when DiffPieces would have diffed it and every run
  // lies in its valid ranges; false otherwise (then it is diffed).
  static bool TakeGatheredChanges(Piece* piece, const std::shared_ptr<const ChangeList>& changes,
                                  const Version& base);
  // fp8 destinations with scales: once the quantizer finished `version`'s derived slot of
  // `batch`, its change list against `base`'s slot of the same batch (quantized again with
  // `batch` where a registration made a new batch since), in host memory, kept in
  // version.quant (QuantCache::Changes); no store lock held. A block whose scale did not change
  // gives only its changed fp8 bytes; one whose amax changed, its block and its scale.
  void DiffDerived(const Version& version, const Version& base,
                   const std::shared_ptr<const QuantBatch>& batch);
  // Sparse Apply of `version` into `dests`, which hold its change map's base entirely: writes
  // only the destination elements whose source bytes changed, undo-journaled and verified.
  // nullopt when the sparse path does not apply (then the full Apply runs); an error after the
  // journal put every byte back.
  // `base`: the version the destinations hold (null: not held here, no sparse Apply); the bytes
  // about to be overwritten are checked against it first, so an engine that wrote there since
  // gets the full copy.
  // How the threads of a host sparse Apply ended: the op of a write that found the destination
  // not holding the base (or a full undo record), and the ops whose bytes did not land.
  struct SparseEnd {
    std::optional<uint32_t> not_base_op;
    std::vector<size_t> bad;
  };
  // The end of a host sparse Apply into `dests` with undo record `undo`: not holding the base:
  // everything put back and nullopt (the full copy runs); bytes that did not land or memory gone:
  // put back, and the error; otherwise the record committed, OK.
  std::optional<absl::Status> EndSparse(const Version& version, uint64_t base,
                                        const plan::Plan& plan,
                                        const std::vector<std::shared_ptr<Buffer>>& dests,
                                        ApplyJournal::Entry& undo, SparseEnd end);
  // `prepared`: the writes collected as the version completed (null: none), used when it matches.
  std::optional<absl::StatusOr<ApplyResult>> ApplySparse(
      const Version& version, const std::shared_ptr<const Version>& base, const CachedPlan& cached,
      const std::vector<std::shared_ptr<Buffer>>& dests,
      const std::vector<std::shared_ptr<Region>>& derived, const PreparedSparse* prepared);
  // The sparse Apply for GPU destinations (store_sparse_runs.cc; host ones too with
  // StoreOptions::sparse_run_writers): the writes collected per destination as byte runs with
  // their new bytes, then through a cuda::RunWriter each: upload, the old bytes saved (the undo
  // record, kept in memory) and checked against `base`, scatter, read back and compared. nullopt
  // before anything is written when it does not apply (then the full copy runs); an error after
  // the saved bytes were scattered back.
  // `lists`: per destination (sparse_runs.h), collected inside the Apply or prepared; `how`:
  // which, for the debug line; `uploaded`: per destination, a writer that already holds its list
  // (null entries: opened and uploaded here).
  std::optional<absl::StatusOr<ApplyResult>> ApplySparseRuns(
      const Version& version, uint64_t base, const plan::Plan& plan,
      const std::vector<sparse::RunList>& lists, const std::string& how,
      const std::vector<std::shared_ptr<Buffer>>& dests,
      std::vector<std::unique_ptr<cuda::RunWriter>>* uploaded = nullptr);
  // A prepared run-list sparse Apply's writers, opened and uploaded as the version completed
  // where the device memory they take is small against the destination (PreparedSparse::writers).
  void UploadAhead(const std::vector<std::shared_ptr<Buffer>>& dests, PreparedSparse* out);
  // ---- Prepared sparse Apply (store_sparse_prepared.cc) ----
  // What a sparse Apply of `version` into `dests` (holding `held`) reads, where it may run:
  // every location the plan reads diffed against `held`, host slots; nullopt otherwise.
  // The key of a set of DESTINATION buffers applied together: their ids, in order.
  static std::string GroupKey(const std::vector<std::shared_ptr<Buffer>>& dests);
  // `dests`: how many destination locations the plan writes.
  std::optional<SparseInputs> SparseInputsFor(const Version& version, const Version& held,
                                              const CachedPlan& cached, size_t dests,
                                              const std::vector<std::shared_ptr<Region>>& derived);
  // The DESTINATION buffers `dests` of `model` were applied together: remembered, and when a
  // newer complete version than theirs is here, its sparse Apply into them is prepared (mu_
  // held; the collection runs on prepare_loop_).
  void RememberApplyGroup(Model& model, const std::vector<std::shared_ptr<Buffer>>& dests)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // For each remembered group of `model` whose buffers all hold a complete version older than
  // the newest: a PreparedSparse of the newest into them, queued (mu_ held).
  void QueuePrepares(Model& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Apply's PreparedSparse of `source` into `dests` (holding `held`), waited for while its
  // collection runs (`lock`, on mu_, let go meanwhile: `model` may be gone after, the caller
  // must not use it); null when there is none, it was taken back, or the store shuts down.
  std::shared_ptr<const PreparedSparse> AwaitPrepared(
      Model& model, common::UniqueLock& lock, const std::shared_ptr<const Version>& source,
      const std::shared_ptr<const Version>& held, const std::vector<std::shared_ptr<Buffer>>& dests)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // prepare_loop_'s step: collects the queued prepares, no store lock held while it works.
  void RunPrepares();
  // A sparse Apply from a PreparedSparse that matches (the same version and base objects, plan
  // and buffers, each holding the base); nullopt when it does not apply (the Apply goes on without
  // it), with `full_copy` set when it found a destination that does not hold the base (the full
  // copy runs).
  std::optional<absl::StatusOr<ApplyResult>> ApplyPrepared(
      const Version& version, const Version& held, const CachedPlan& cached,
      const std::vector<std::shared_ptr<Buffer>>& dests, const PreparedSparse& prepared,
      bool* full_copy);
  // Verify of a version whose held copy --delta-base=destination released: the destinations
  // against the digests taken of it (BaseFromDestinations per released piece). DATA_LOSS naming
  // the buffers and tensors that differ; FAILED_PRECONDITION where there is nothing to compare.
  absl::Status VerifyReleased(const std::string& model, const Version& version);
  // A successful Apply of `source` into `dests` (their io locks held): applied versions,
  // metrics, --delta-base=destination's release.
  ApplyResult Applied(const std::string& model_name, const std::shared_ptr<const Version>& source,
                      const std::vector<std::shared_ptr<Buffer>>& dests, ApplyResult result,
                      Clock::time_point started);
  // What Apply saves before it writes `version` into `dests` with `cached` (apply_journal.h).
  static std::vector<UndoTarget> UndoTargets(const CachedPlan& cached,
                                             const std::vector<std::shared_ptr<Buffer>>& dests,
                                             uint64_t version);
  // The tensors of `dests` that the ops `bad` of `plan` write, by buffer id.
  static std::map<std::string, std::vector<std::string>> TensorsOfOps(
      const plan::Plan& plan, const std::vector<size_t>& bad,
      const std::vector<std::shared_ptr<Buffer>>& dests);
  absl::StatusOr<std::shared_ptr<const CachedPlan>> PlanFor(
      Model& model, const Version& version, const std::vector<std::shared_ptr<Buffer>>& dests)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  template <typename Ready>
  absl::Status WaitUntil(common::UniqueLock& lock, Clock::time_point deadline,
                         const CancelledFn& cancelled, Ready ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StoreOptions options_;
  const DeltaBaseModes delta_base_;  // --delta-base per model (delta_base_mode.h; fixed)
  Metrics* const metrics_;
  // The store's counters and histograms, resolved once (Metrics::Declare lists them at 0).
  struct Counters {
    explicit Counters(Metrics* metrics);
    CounterHandle versions_completed, apply_bytes, apply_undo_bytes, apply_sparse,
        apply_sparse_prepared, diff_bytes, publish_bytes, publishes, applies, versions_dropped,
        versions_abandoned, apply_verify_failures, delta_base_fallbacks, quantized_values,
        quantized_gpu_values, nonfinite_values;
    GaugeHandle sparse_prepared_bytes;
    HistogramHandle publish_seconds, apply_seconds, plan_seconds, quantize_seconds;
  };
  const Counters counters_;
  // The slot pools and each model's budget (slot_budget.h; its own lock, taken after mu_).
  SlotBudget budget_;
  // What other nodes told of each model (remote_view.h; its own lock, taken after mu_ or alone).
  RemoteView remotes_;

  mutable common::Mutex mu_;
  common::CondVar changed_;  // a version completed, or Shutdown
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_buffer_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_event_ ABSL_GUARDED_BY(mu_) = 1;  // Watch events' sequence numbers
  std::map<std::string, std::unique_ptr<Model>> models_ ABSL_GUARDED_BY(mu_);
  // SeedHolds: models held back once they are made here (until Rollback, Resume or a drop).
  std::map<std::string, uint64_t> seeded_holds_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Buffer>> buffers_ ABSL_GUARDED_BY(mu_);  // by id
  std::map<std::string, std::string> by_memory_
      ABSL_GUARDED_BY(mu_);              // buffer ids by Region::Identity()
  std::vector<StoreEvents*> listeners_;  // in the order added
  // The quantizer's queue and thread (quant_queue.h: its own lock, taken after mu_); each job
  // runs in RunQuantJob.
  class QuantWorker : public QuantQueue<Version>::Worker {
   public:
    explicit QuantWorker(Store* store) : store_(store) {}
    void Quantize(QuantQueue<Version>::Job job) override { store_->RunQuantJob(std::move(job)); }

   private:
    Store* const store_;
  };
  QuantWorker quant_worker_{this};
  QuantQueue<Version> quant_queue_{&quant_worker_};
  std::unique_ptr<ApplyJournal> journal_;  // Apply's undo record (atomic Apply)
  // Prepared sparse Applies waiting for prepare_loop_ (QueuePrepares, RunPrepares).
  std::deque<PrepareJob> prepare_jobs_ ABSL_GUARDED_BY(mu_);
  WorkerLoop prepare_loop_{"sparse-prepare"};  // started by the constructor
};

}  // namespace refit
