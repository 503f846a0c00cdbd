#pragma once

// Where a pull lands (issue 38: the store split along its seams): what daemon/pull needs of the
// store, and nothing more. Store implements it; pull/ depends on this target
// (//daemon/store:landing), not on the store.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/memory/region.h"
#include "daemon/store/store_types.h"

namespace refit {

class PullLanding {
 public:
  virtual ~PullLanding() = default;

  // A slot of `size` bytes for staging pulled bytes, counted against the budget of the model
  // being pulled with a piece of that size (Store::AcquireSlot).
  virtual absl::StatusOr<std::shared_ptr<Region>> AcquireSlot(uint64_t size) = 0;

  // True when a pulled version of `model` is quantized as its bytes land
  // (Store::QuantizesWhilePulling).
  virtual bool QuantizesWhilePulling(const std::string& model) const = 0;
  // Quantizes what the pull of `job` has landed so far (Store::QuantizeLanded); true when it
  // left runnable tasks for the next call.
  virtual bool QuantizeLanded(
      const PullJob& job, const std::vector<std::shared_ptr<Region>>& staging,
      const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& landed,
      const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& refetched,
      size_t max_tasks = 1) = 0;

  // --delta-base=destination: the base of `fetch` rebuilt from this node's DESTINATION buffers
  // into a fresh staging slot (Store::BaseFromDestinations).
  virtual absl::StatusOr<std::shared_ptr<Region>> BaseFromDestinations(
      const std::string& model, const PullJob::Fetch& fetch) = 0;

  // The staging of job.fetches[fetch] was built from deltas from fetch.base_version, and
  // `changes` is what they changed (runs of the elements they wrote, with the new words,
  // gathered as the deltas were applied): the store's sparse Apply then needs no diff of the
  // piece (Store::NoteDeltaChanges). Before FinishPull; a landing that does not diff ignores it.
  virtual void NoteDeltaChanges(const PullJob& job, size_t fetch,
                                std::shared_ptr<const ChangeList> changes) {
    (void)job, (void)fetch, (void)changes;
  }

  // The pull of `job` ended: on success `staging[i]` holds job.fetches[i].ranges
  // (Store::FinishPull).
  virtual void FinishPull(const PullJob& job, absl::Status result,
                          std::vector<std::shared_ptr<Region>> staging) = 0;
};

}  // namespace refit
