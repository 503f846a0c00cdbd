#pragma once

// The receiving side of delta sync. For the fetches of a PullJob that offer a base (a verified
// older version of the piece held here) and a chain of deltas, FetchDeltas reads each delta's
// header from the source, works out which chunks cover the byte ranges this node needs (a
// resharded destination needs only part of each source buffer), reads just those chunks,
// copies the needed ranges of the base into a fresh staging slot and applies the chain in
// order. The pull worker then verifies the staging slot against the source's checksums exactly
// as after a full pull, so a delta can never make a wrong version visible.
//
// A fetch falls back to the full bytes (its slot comes back null) when the deltas it would
// read exceed `threshold` × the bytes it needs, or when anything about them fails; the reason
// is logged. Thread-safety: call from one thread at a time (the pull worker).

#include <cstdint>
#include <memory>
#include <vector>

#include "daemon/memory/region.h"
#include "daemon/pull/pull_metrics.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/store/store.h"

namespace refit::pull {

using dataplane::DataPlane;

struct DeltaResult {
  std::vector<std::shared_ptr<Region>> staging;  // per fetch: built from deltas, or null
  std::vector<uint64_t> wire;                    // per fetch: delta bytes read for it
  // Per fetch: every needed byte lies in whole delta chunks, so applying them checked each
  // chunk's target checksum and the source need not hash anything for it.
  std::vector<bool> verified;
};

// Brings the fetches of `job` that offer a base and deltas up to date (see above).
DeltaResult FetchDeltas(const PullJob& job, DataPlane* data_plane, Store* store,
                        double threshold, Metrics* metrics);

}  // namespace refit::pull
