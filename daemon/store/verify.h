#pragma once

// Verified install, the comparisons (issue 38: the store split along its seams): what a
// DESTINATION buffer holds against what a version's plan writes there, and the names of the
// tensors that differ. Knows nothing of the store: Store::Verify gathers, under its lock, each
// destination's plan and the version's bytes, and hands them here (store_verify.cc); Apply's
// DATA_LOSS (Store::NotLanded) and --delta-base=destination's rebuild name their tensors with
// TensorsOfOps.
//
// Thread-safety: TensorsOfOps is a pure function. A Verifier belongs to one Verify call, on one
// thread; the caller holds each destination's io lock while Compare reads its bytes.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/types.h"
#include "daemon/plan/plan.h"
#include "daemon/store/store_types.h"

namespace refit {

// A DESTINATION buffer as the verifier sees it: its id and its (normalized) slices.
struct VerifyTarget {
  std::string id;
  const std::vector<TensorSlice>* slices = nullptr;
};

// The tensors of `dests` (location i of `plan` is dests[i]) that the ops `bad` of `plan` write,
// by buffer id, each named once in the order found; bytes that no slice holds are named by
// their offset ("bytes at offset N").
std::map<std::string, std::vector<std::string>> TensorsOfOps(
    const plan::Plan& plan, const std::vector<size_t>& bad, const std::vector<VerifyTarget>& dests);

// The checks of one Verify call (refitctl verify) of `model`'s DESTINATION buffers: each
// buffer's result is filled in here, and the differences found are gathered for Finish.
class Verifier {
 public:
  explicit Verifier(std::string model) : model_(std::move(model)) {}

  // Compares `dest`'s bytes (host memory at `bytes`, location 0 of `plan`) with what `plan`
  // writes there from `sources` (host memory, by location): sets result->checked and, for the
  // ops that differ, result->stale_tensors (a failure, named with result->version).
  void Compare(const plan::Plan& plan, const std::vector<const uint8_t*>& sources,
               const VerifyTarget& dest, uint8_t* bytes, VerifyResult* result);
  // The version's held copy is gone (--delta-base=destination released it: `held` says so) and
  // the destinations were checked against the digests taken of it instead: `released` is that
  // check's answer (Store::VerifyReleased; DATA_LOSS: they differ, a failure; another error:
  // nothing compared, `held` is the note).
  void Released(const absl::Status& held, const absl::Status& released, VerifyResult* result);

  // `results`, or DATA_LOSS naming every failure (logged) when some buffer differs.
  absl::StatusOr<std::vector<VerifyResult>> Finish(std::vector<VerifyResult> results) const;

 private:
  const std::string model_;
  std::vector<std::string> failures_;  // one line per buffer that differs
};

}  // namespace refit
