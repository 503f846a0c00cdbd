#pragma once

// The metrics the store counts (docs/api.md), declared by Store's constructor.

#include "daemon/metrics/metrics.h"

namespace refit {

inline constexpr Counter kVersionsCompleted{"refit_versions_completed_total",
                                            "Versions that became complete on this node."};
inline constexpr Counter kApplyBytes{"refit_apply_bytes_total",
                                     "Bytes written into DESTINATION buffers by Apply."};
inline constexpr Counter kApplyUndoBytes{
    "refit_apply_undo_bytes_total",
    "Bytes of DESTINATION buffers saved in the undo journal before Apply wrote them."};
inline constexpr Counter kApplySparse{
    "refit_apply_sparse_total",
    "Applies that wrote only the elements changed since the version the destinations held."};
inline constexpr Counter kApplySparsePrepared{
    "refit_apply_sparse_prepared_total",
    "Sparse Applies whose writes were collected as the version completed, before the call (the "
    "engine paused for the writing alone)."};
inline constexpr Counter kDiffBytes{
    "refit_diff_bytes_total",
    "Bytes of new versions compared against the version this node's engines hold, for a sparse "
    "Apply (a version that changed too much to apply sparsely stops early)."};
inline constexpr Counter kPublishBytes{"refit_publish_bytes_total",
                                       "Bytes snapshotted by Publish."};
inline constexpr Counter kPublishes{"refit_publish_total", "Publish calls that succeeded."};
inline constexpr Counter kApplies{"refit_apply_total", "Apply calls that succeeded."};
inline constexpr Counter kVersionsDropped{"refit_versions_dropped_total",
                                          "Complete versions dropped by --retain."};
inline constexpr Counter kVersionsAbandoned{
    "refit_versions_abandoned_total",
    "Versions given up before they completed here: a failed pull, or a SOURCE buffer released "
    "before it published a version the others had."};
inline constexpr Counter kApplyVerifyFailures{
    "refit_apply_verify_failures_total",
    "Applies whose bytes, checked as they landed, differed from the version's (DATA_LOSS)."};
inline constexpr Counter kDeltaBaseFallbacks{
    "refit_delta_base_fallbacks_total",
    "--delta-base=destination: pulls that could not use the destinations as the delta base "
    "(pulled in full)."};
inline constexpr Gauge kSparsePreparedBytes{
    "refit_sparse_prepared_bytes",
    "Bytes of host memory held by sparse Applies prepared as their versions completed: the run "
    "lists, kept per set of DESTINATION buffers until the next version's collection fills them "
    "again (not counted in --max-slot-memory)."};
inline constexpr Gauge kSlotMemoryBytes{
    "refit_slot_memory_bytes",
    "Bytes of host version slots held: published, pulled, in flight and kept for reuse."};
inline constexpr Gauge kSlotMemoryLimitBytes{"refit_slot_memory_limit_bytes",
                                             "--max-slot-memory in bytes (0: no limit)."};
inline constexpr Counter kQuantizedValues{
    "refit_quantized_values_total",
    "Source values quantized for fp8 destinations with block scales."};
inline constexpr Counter kQuantizedGpuValues{
    "refit_quantized_gpu_values_total",
    "Of the quantized values, those the GPU kernel quantized (versions in GPU slots: "
    "--slot-memory=cuda)."};
inline constexpr Counter kNonfiniteValues{"refit_nonfinite_values_total",
                                          "Of the quantized values, the inf and NaN ones."};
inline constexpr Histogram kPublishSeconds{"refit_publish_seconds",
                                           "Time a Publish took, in seconds."};
inline constexpr Histogram kApplySeconds{"refit_apply_seconds", "Time an Apply took, in seconds."};
inline constexpr Histogram kPlanSeconds{
    "refit_plan_seconds", "Time to plan a version's copies for a destination, in seconds."};
inline constexpr Histogram kQuantizeSeconds{
    "refit_quantize_seconds", "Time to quantize a version for fp8 destinations, in seconds."};

}  // namespace refit
