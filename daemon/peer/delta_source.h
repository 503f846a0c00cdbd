#pragma once

// The sending side of delta sync. Each time every local SOURCE buffer of a model has published
// a new version N, DeltaSource compares N's snapshot with the previous one it saw, bitwise,
// piece by piece, and encodes the changes (daemon/delta). It keeps the newest `chain` deltas
// of each piece, so a receiver a few versions behind applies them in order instead of pulling
// everything. A version is "prepared" once its deltas are encoded (or given up on: no previous
// version with the same layout, or a delta bigger than `threshold` of the piece); PeerService
// announces a version only once it is prepared, so a receiver never starts a full pull of a
// version whose delta is a moment away.
//
// Listens to the store (StoreEvents): OnLocalVersionReady wakes the encoder.
//
// Thread-safety: public methods may be called from any thread. Notify() only sets a flag (the
// store calls it, through OnLocalVersionReady, with its lock held); encoding runs on
// DeltaSource's own thread.

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/common/types.h"
#include "daemon/common/worker_loop.h"
#include "daemon/memory/region.h"
#include "daemon/peer/peer_metrics.h"
#include "daemon/store/local_snapshots.h"
#include "daemon/store/store_types.h"

namespace refit::peer {

// threshold and chain are refitd's --delta-threshold and --delta-chain, set from DaemonOptions
// (daemon/component_options.h), where their defaults live; unset, no delta is encoded.
struct DeltaSourceOptions {
  // A delta bigger than this fraction of its piece is dropped (receivers pull full bytes);
  // 0 turns delta encoding off.
  double threshold = 0;
  uint32_t chain = 0;                           // deltas kept per piece, newest first (0: 1)
  uint64_t chunk_elements = uint64_t{1} << 18;  // a receiver fetches whole chunks
  int threads = 0;                              // encoder threads; 0: one per core
};

// One encoded delta of one piece: base_version's bytes -> version's bytes.
struct EncodedDelta {
  std::string buffer_id;
  uint64_t base_version = 0;
  uint64_t version = 0;
  std::shared_ptr<Region> bytes;  // exactly the delta (daemon/delta format)
};

// The element type a piece's delta is encoded with: the dtype all its slices share when every
// slice starts on an element boundary, else bytes (still exact, just less compact).
DType DeltaDType(const std::vector<TensorSlice>& slices, uint64_t bytes);

class DeltaSource final : public StoreEvents {
 public:
  // `ready` is called (from DeltaSource's thread) whenever a version became prepared.
  DeltaSource(LocalSnapshots* store, DeltaSourceOptions options, Metrics* metrics,
              std::function<void()> ready);
  ~DeltaSource() override;  // Stop()
  DeltaSource(const DeltaSource&) = delete;
  DeltaSource& operator=(const DeltaSource&) = delete;

  // A local version may be ready to encode.
  void Notify();
  void Stop();

  // StoreEvents: a new local version is a version to encode (enabled: it reads its snapshot).
  void OnLocalVersionReady(const std::string& model, uint64_t version) override;
  bool WantsLocalSnapshots() const override { return enabled(); }

  bool enabled() const { return options_.threshold > 0; }
  // The newest version of `model` whose deltas are settled: what may be announced now.
  uint64_t Prepared(const std::string& model) const;
  // The deltas held for `model`, oldest first.
  std::vector<EncodedDelta> Deltas(const std::string& model) const;
  // The snapshot of the prepared `version` of `model` (null if another version is prepared):
  // kept here so that a version can be announced and read even after --retain dropped it from
  // the store while it was being encoded.
  std::shared_ptr<const LocalSnapshot> PreparedSnapshot(const std::string& model,
                                                        uint64_t version) const;

 private:
  void Step();
  void Prepare(const std::string& model, const std::vector<SourceLayout>& layouts);

  LocalSnapshots* const store_;
  const DeltaSourceOptions options_;
  Metrics* const metrics_;
  const std::function<void()> ready_;

  mutable common::Mutex mu_;
  std::map<std::string, uint64_t> prepared_ ABSL_GUARDED_BY(mu_);         // by model
  std::map<std::string, std::string> prepared_run_ ABSL_GUARDED_BY(mu_);  // its trainer's run
  std::map<std::string, std::vector<EncodedDelta>> deltas_
      ABSL_GUARDED_BY(mu_);  // by model, oldest first
  std::map<std::string, std::shared_ptr<const LocalSnapshot>> prepared_snapshot_
      ABSL_GUARDED_BY(mu_);  // by model
  // Deltas no longer offered, kept allocated until receivers can no longer be reading them.
  static constexpr std::chrono::seconds kRetiredGrace{150};
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::shared_ptr<Region>>> retired_
      ABSL_GUARDED_BY(mu_);
  // Encoder thread only: the last snapshot encoded against, per model.
  std::map<std::string, std::shared_ptr<const LocalSnapshot>> last_;  // the worker thread only
  WorkerLoop loop_{"delta encoder"};  // runs Step; started only when enabled()
};

}  // namespace refit::peer
