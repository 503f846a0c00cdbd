#pragma once

// What refitd gives each component, from its options. DaemonOptions (daemon/options.h) holds
// the only default of every refitd option, and daemon/config's option table prints them; the
// components' option structs (StoreOptions, PeerManagerOptions, DataPlaneOptions, ...) hold
// neutral values for those fields (0 or off, or a value their component refuses), so that a
// value refitd runs with comes from here or nowhere. Daemon::Start (daemon.cc) calls these;
// component_options_test holds them to the table's defaults.

#include "absl/status/statusor.h"
#include "daemon/bucket/exporter.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/options.h"
#include "daemon/peer/delta_source.h"
#include "daemon/peer/peer_manager.h"
#include "daemon/peer/peer_service.h"
#include "daemon/store/store.h"

namespace refit {

// --retain, --node, --slot-memory and --slot-device, --max-slot-memory, --max-gpu-slot-memory,
// --delta-base, --state-dir (the undo journal). INVALID_ARGUMENT for a bad --delta-base or
// --slot-memory; FAILED_PRECONDITION for --slot-memory=cuda without that device. The host slot
// allocator is the caller's (the data plane's, MakeDataPlane).
absl::StatusOr<StoreOptions> StoreOptionsFrom(const DaemonOptions& options);

// --chunk-bytes, --inflight. The caller adds the liveness worker.
dataplane::DataPlaneOptions DataPlaneOptionsFrom(const DaemonOptions& options);

// --delta-threshold, --delta-chain.
peer::DeltaSourceOptions DeltaSourceOptionsFrom(const DaemonOptions& options);

// --bucket-full-every, --retain (the newest versions kept reconstructible in the bucket).
bucket::ExporterOptions ExporterOptionsFrom(const DaemonOptions& options);

// --relay, --max-peer-connections (incoming relay readers); `tls`: the peer plane has mutual TLS.
peer::PeerServiceOptions PeerServiceOptionsFrom(const DaemonOptions& options, bool tls);

// --node, --delta-threshold, --relay, --max-peer-connections, --site. The caller adds the
// instance id, the TLS files and the RL parts.
peer::PeerManagerOptions PeerManagerOptionsFrom(const DaemonOptions& options);

}  // namespace refit
