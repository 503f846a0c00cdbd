#pragma once

// A sparse Apply's writes collected ahead of the writing (internal to daemon/store): per
// destination, the byte runs it writes with their new bytes in the destination's dtype and the
// base's bytes where the writes are checked (RunList), collected by the walk of sparse_walk.h
// (CollectRuns). What the run-list sparse Apply hands a cuda::RunWriter (store_sparse_runs.cc),
// and what a prepared sparse Apply (store_sparse_prepared.cc) builds as a version completes, so
// that the engine's pause is the writing alone. docs/architecture.md, "Sparse Apply".

#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/byte_run.h"
#include "daemon/plan/plan.h"
#include "daemon/store/sparse_walk.h"

namespace refit::sparse {

// One destination's writes: byte runs, their new bytes (packed in run order), which op's runs
// start where (the first run of each stretch of one op's runs, with the op: NotLanded names its
// tensors), and the writes checked against the base: [offset, offset + bytes) of `values`
// (sorted, disjoint), with the base's bytes there back to back in `expected`.
struct RunList {
  uint32_t dest = 0;  // the destination location (the plan's) the runs are in
  std::vector<cuda::ByteRun> runs;
  std::vector<std::pair<uint64_t, uint32_t>> ops;
  std::vector<uint8_t> values;
  std::vector<std::pair<uint64_t, uint64_t>> checks;
  std::vector<uint8_t> expected;
};

// The run lists of `dests` destination locations: the plan's work items cut into chunks (four
// per thread), collected on `threads` threads; `merged`: one list per destination, the chunks'
// appended in item order (what a RunWriter takes); else the chunks' lists as they are, in item
// order, the empty ones left out (what the host writer takes: no copy). Reads the change lists,
// the new version's bytes (where the change list does not carry them) and the base's bytes (at
// the checked writes); writes nothing but the lists. `recycle`: lists of an earlier collection,
// emptied and filled again (their memory is already mapped: a fresh 100 MB of lists costs its
// page faults and zeroing, as much as the walk).
std::vector<RunList> CollectRuns(const plan::Plan& plan, const Sources& sources, size_t dests,
                                 unsigned threads, bool merged = true,
                                 std::vector<RunList>* recycle = nullptr);

// The host sparse Apply's share of one thread: runs [begin, end) of RunList `list`, with where its
// cursors start: `check` (the first check that ends past the first run's values), `expected` (that
// check's bytes in `expected`), `op` (the stretch of `ops` the first run is in).
struct Segment {
  uint32_t list = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
  size_t check = 0;
  uint64_t expected = 0;
  size_t op = 0;
};
// Every run of `lists` cut into `threads` contiguous shares of about equal runs; per share its
// segments, the undo record's capacity its runs take (ApplyJournal's sparse records) and its runs.
struct HostCuts {
  std::vector<std::vector<Segment>> workers;
  std::vector<uint64_t> capacities;
  std::vector<uint64_t> runs;
};
HostCuts CutRuns(const std::vector<RunList>& lists, unsigned threads);

// Threads for `runs` changed runs: `wanted` when it is not 0, else one (under kParallelRuns) or
// one per core up to kMaxThreads.
unsigned ThreadsFor(uint64_t runs, unsigned wanted);

}  // namespace refit::sparse
