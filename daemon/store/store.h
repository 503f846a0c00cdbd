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
// Apply executes a transfer plan (daemon/plan) from the version's pieces into DESTINATION
// buffers; plans are cached per (source pieces, destination buffers) and dropped whenever a
// registration changes.
//
// Thread-safety: every public method may be called from any thread concurrently. Blocking
// waits end at their deadline, when `cancelled` returns true, or at Shutdown.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/types.h"
#include "daemon/memory/region.h"
#include "daemon/memory/slot_pool.h"
#include "daemon/metrics/metrics.h"

namespace refit {

struct StoreOptions {
  uint32_t retain = 2;                          // complete versions kept per model (>= 1)
  uint64_t max_spare_slot_bytes = 4ull << 30;  // released slots kept for reuse
  std::string node = "node";                    // used in buffer ids
};

struct PublishResult {
  uint64_t version = 0;
  uint64_t bytes = 0;  // bytes snapshotted
};

struct ApplyResult {
  uint64_t version = 0;
  uint64_t bytes_written = 0;
};

struct BufferInfo {
  std::string id;
  Role role = Role::kUnspecified;
  std::string client;
  uint64_t bytes = 0;
  uint32_t tensors = 0;
  uint64_t last_published = 0;
  MemoryKind memory = MemoryKind::kHost;
};

struct ModelInfo {
  std::string name;
  uint64_t latest_version = 0;
  std::vector<uint64_t> versions;  // complete versions held, oldest first
  uint32_t source_buffers = 0;
  uint32_t destination_buffers = 0;
  uint64_t version_bytes = 0;  // bytes of the newest held version's snapshot
  std::vector<BufferInfo> buffers;
};

// Checks whether the caller has gone away (e.g. a cancelled RPC).
using CancelledFn = std::function<bool()>;
using Clock = std::chrono::steady_clock;

class Store {
 public:
  Store(StoreOptions options, Metrics* metrics);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Lends the store `region` holding `slices` of `model`'s tensors. Slices are normalized and
  // validated against the region and against the model's other buffers (INVALID_ARGUMENT).
  // Returns the new buffer's id.
  absl::StatusOr<std::string> RegisterBuffer(const std::string& model, Role role,
                                             std::unique_ptr<Region> region,
                                             std::vector<TensorSlice> slices,
                                             const std::string& client);

  // Stops using a buffer. In-flight Publish/Apply calls on it finish first (they hold it).
  absl::Status ReleaseBuffer(const std::string& buffer_id);

  // Snapshots the listed SOURCE buffers as `version` of `model`.
  absl::StatusOr<PublishResult> Publish(const std::string& model, uint64_t version,
                                        const std::vector<std::string>& buffer_ids);

  // Blocks until a version >= min_version of `model` is complete, then returns the newest.
  // DEADLINE_EXCEEDED past `deadline`; CANCELLED when `cancelled()`; UNAVAILABLE at Shutdown.
  absl::StatusOr<uint64_t> WaitForVersion(const std::string& model, uint64_t min_version,
                                          Clock::time_point deadline, const CancelledFn& cancelled);

  // Writes `version` (0: newest complete) into the listed DESTINATION buffers.
  absl::StatusOr<ApplyResult> Apply(const std::string& model, uint64_t version,
                                    const std::vector<std::string>& buffer_ids);

  // Blocks until versions newer than `after_version` have completed, and returns them in
  // order (versions completed before the call are included while they are still remembered).
  // Same ending conditions as WaitForVersion.
  absl::StatusOr<std::vector<uint64_t>> WaitForCompletions(const std::string& model,
                                                           uint64_t after_version,
                                                           Clock::time_point deadline,
                                                           const CancelledFn& cancelled);

  // Newest complete version of `model`, 0 if none (or no such model).
  uint64_t LatestVersion(const std::string& model) const;

  std::vector<ModelInfo> Models() const;

  // Wakes every waiter; they and all later waits return UNAVAILABLE.
  void Shutdown();

 private:
  struct Buffer;
  struct Piece;
  struct Version;
  struct Model;
  struct CachedPlan;

  Model* FindModel(const std::string& name);
  const Model* FindModel(const std::string& name) const;
  absl::Status CheckAgainstModel(const Model& model, Role role,
                                 const std::vector<TensorSlice>& slices) const;
  absl::StatusOr<std::vector<std::shared_ptr<Buffer>>> LookUpBuffers(
      const std::string& model, Role role, const std::vector<std::string>& ids) const;
  void TryComplete(Model& model);
  void CompleteVersion(Model& model, uint64_t version);
  absl::StatusOr<std::shared_ptr<const CachedPlan>> PlanFor(
      Model& model, const Version& version, const std::vector<std::shared_ptr<Buffer>>& dests);
  template <typename Ready>
  absl::Status WaitUntil(std::unique_lock<std::mutex>& lock, Clock::time_point deadline,
                         const CancelledFn& cancelled, Ready ready);

  const StoreOptions options_;
  Metrics* const metrics_;
  std::shared_ptr<SlotPool> pool_;

  mutable std::mutex mu_;
  std::condition_variable changed_;  // a version completed, or Shutdown
  bool shutdown_ = false;
  uint64_t next_buffer_ = 1;
  std::map<std::string, std::unique_ptr<Model>> models_;
  std::map<std::string, std::shared_ptr<Buffer>> buffers_;  // by id
};

}  // namespace refit
