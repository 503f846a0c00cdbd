#pragma once

// The metrics a pull counts (docs/api.md), declared by Puller's constructor.

#include "daemon/metrics/metrics.h"

namespace refit::pull {

inline constexpr Counter kDeltaVersions{
    "refit_delta_versions_total",
    "Versions completed here from deltas (at least one piece brought up to date by deltas)."};
inline constexpr Counter kFullVersions{"refit_full_versions_total",
                                       "Versions completed here from full bytes only."};
inline constexpr Counter kDeltaBytesReceived{
    "refit_delta_bytes_received_total",
    "Delta bytes read (headers and the chunks covering the needed ranges)."};
inline constexpr Counter kDeltaFallbacks{
    "refit_delta_fallbacks_total",
    "Pieces pulled in full although deltas were offered (over the threshold, or a delta "
    "failed)."};
inline constexpr Counter kRelayBytesReceived{
    "refit_relay_bytes_received_total",
    "Bytes this node read from relays instead of the version's origin."};
inline constexpr Counter kRelayChunksRejected{
    "refit_relay_chunks_rejected_total",
    "Chunks a relay served that failed the origin's checksums (read again from the origin)."};
inline constexpr Counter kRelayFailovers{
    "refit_relay_failovers_total",
    "Stripes of a version whose relay failed, stalled or went away while this node read from "
    "it: what it still owed was read from the origin instead."};
inline constexpr Counter kSiteBytesReceived{
    "refit_site_bytes_received_total",
    "Bytes this node read from nodes of another site (--site): from an origin there or from a "
    "relay there (the bytes that crossed into this node's site through it)."};

inline constexpr Counter kChunksRefetched{
    "refit_pull_chunks_refetched_total",
    "Chunks of a pull that failed the source's checksum as they landed (corrupted in transit, a "
    "relay's bad bytes) and were fetched again; none is ever applied."};

}  // namespace refit::pull
