#pragma once

// What this node's SOURCE versions look like to the readers of them (issue 38: the store split
// along its seams): the peer server (Subscribe, Checksum, Pin), the delta encoder and the bucket
// exporter read local snapshots through this interface, not through the store. Store
// implements it; they depend on //daemon/store:local_snapshots, not on the store.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/memory/checksum.h"
#include "daemon/store/store_types.h"

namespace refit {

class LocalSnapshots {
 public:
  virtual ~LocalSnapshots() = default;

  // Models with SOURCE buffers on this node, and their layouts.
  virtual std::map<std::string, std::vector<SourceLayout>> LocalSourceLayouts() const = 0;
  // The newest version every local SOURCE buffer of `model` has published (0: none held).
  virtual uint64_t LatestLocalSnapshot(const std::string& model) const = 0;
  // The local snapshot of `version`, kept alive as long as the caller holds it. NOT_FOUND when
  // it is no longer held.
  virtual absl::StatusOr<std::shared_ptr<const LocalSnapshot>> GetLocalSnapshot(
      const std::string& model, uint64_t version) const = 0;
  // The model's current run ("" when none was named).
  virtual std::string RunOf(const std::string& model) const = 0;

  // A peer asked for the checksums of `ranges` ([begin, end) of a piece) of SOURCE buffer
  // `buffer_id`, off the Publish-time grid. The next Publishes of the buffer hash these ranges
  // too, while each block is in cache, so the next such request is answered from a table (a
  // resharded pull asks for the same ranges every version). Runs are kept by offset (a later
  // one replaces an earlier one there, unless it is only that run's first ranges, as a reader
  // asking again about chunks that failed would send); a run not asked for again during 4
  // Publishes is dropped. Kept per buffer: at most ChecksumHints::kMaxRanges ranges, of at most
  // kCopyBlockBytes each (longer ones are never hashed at Publish), and twice `piece_bytes` in
  // all.
  virtual void NoteChecksumRanges(const std::string& buffer_id, uint64_t piece_bytes,
                                  const std::vector<RangeRun>& runs) = 0;
};

}  // namespace refit
