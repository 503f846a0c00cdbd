#pragma once

// The metrics the peer plane counts (docs/api.md): PeerService declares what it serves,
// PeerManager what it keeps and pulls, DeltaSource what it encodes.

#include "daemon/metrics/metrics.h"

namespace refit {

inline constexpr Counter kDataBytesSent{
    "refit_data_bytes_sent_total",
    "Bytes this daemon sent over the data plane, as its readers reported them."};
inline constexpr Counter kRelayBytesSent{
    "refit_relay_bytes_sent_total",
    "Data-plane bytes this node sent from versions it pulled rather than published."};
inline constexpr Counter kChecksumBytesHashed{
    "refit_checksum_bytes_hashed_total", "On a source: bytes the Checksum RPC hashed on demand."};
inline constexpr Gauge kPeersConnected{"refit_peers_connected",
                                       "Daemons this one pulls from that are connected now."};
inline constexpr Gauge kPeerChannelsOpen{
    "refit_peer_channels_open",
    "Control channels open to other daemons: --peers connected, plus relay channels opened on "
    "demand (at most --max-peer-connections)."};
inline constexpr Gauge kRelayReaders{
    "refit_relay_readers",
    "Nodes reading relayed stripes from this node now (Relay streams, by node; at most "
    "--max-peer-connections)."};
inline constexpr Counter kRelayReadersRefused{
    "refit_relay_readers_refused_total",
    "Relay streams refused because --max-peer-connections other nodes were reading relayed "
    "stripes here (the reader takes those stripes from the origin)."};
inline constexpr Counter kSiteEntryConflicts{
    "refit_site_entry_conflicts_total",
    "Relay streams from a node of another site asking for bytes another node of that site "
    "asked for already (two entries into one site: those bytes cross twice; warned, naming "
    "both)."};
inline constexpr Histogram kTransferSeconds{
    "refit_transfer_seconds",
    "Time a pull took, from its start to the version complete, in seconds."};
inline constexpr Counter kDeltaEncodedBytes{"refit_delta_encoded_bytes_total",
                                            "On a source: bytes of deltas encoded."};
inline constexpr Histogram kDeltaEncodeSeconds{
    "refit_delta_encode_seconds", "On a source: time to encode one delta, in seconds."};

}  // namespace refit
