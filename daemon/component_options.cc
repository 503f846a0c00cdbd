#include "daemon/component_options.h"

#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"

namespace refit {

absl::StatusOr<StoreOptions> StoreOptionsFrom(const DaemonOptions& options) {
  StoreOptions store_options;
  store_options.retain = options.retain;
  store_options.node = options.node;
  store_options.max_slot_bytes = options.max_slot_memory;
  store_options.max_gpu_slot_bytes = options.max_gpu_slot_memory;
  store_options.journal_dir = options.state_dir;  // Apply's undo journal outlives a kill
  if (absl::Status parsed = ParseDeltaBase(options.delta_base, &store_options.delta_base,
                                           &store_options.delta_base_models);
      !parsed.ok()) {
    return parsed;
  }
  if (options.slot_memory == "cuda") {
    if (options.slot_device < 0 || options.slot_device >= cuda::DeviceCount()) {
      return absl::FailedPreconditionError(absl::StrCat("--slot-memory=cuda needs CUDA device ",
                                                        options.slot_device, "; this refitd has ",
                                                        cuda::Describe()));
    }
    store_options.slot_memory = MemoryKind::kCuda;
  } else if (options.slot_memory != "host") {
    return absl::InvalidArgumentError("--slot-memory must be host or cuda");
  }
  store_options.slot_device = options.slot_device;  // used by GPU slots only
  return store_options;
}

dataplane::DataPlaneOptions DataPlaneOptionsFrom(const DaemonOptions& options) {
  dataplane::DataPlaneOptions data_plane;
  data_plane.chunk_bytes = options.chunk_bytes;
  data_plane.inflight = static_cast<int>(options.inflight);
  data_plane.relay_chunk_bytes = options.relay_chunk_bytes;
  return data_plane;
}

peer::DeltaSourceOptions DeltaSourceOptionsFrom(const DaemonOptions& options) {
  peer::DeltaSourceOptions deltas;
  deltas.threshold = options.delta_threshold;
  deltas.chain = options.delta_chain;
  return deltas;
}

bucket::ExporterOptions ExporterOptionsFrom(const DaemonOptions& options) {
  bucket::ExporterOptions exporter;
  exporter.full_every = options.bucket_full_every;
  exporter.retain = options.retain;
  return exporter;
}

peer::PeerServiceOptions PeerServiceOptionsFrom(const DaemonOptions& options, bool tls) {
  peer::PeerServiceOptions service;
  service.relay = options.relay;
  service.tls = tls;
  service.max_relay_readers = options.max_peer_connections;
  return service;
}

peer::PeerManagerOptions PeerManagerOptionsFrom(const DaemonOptions& options) {
  peer::PeerManagerOptions peers;
  peers.node = options.node;
  peers.delta_threshold = options.delta_threshold;
  peers.relay = options.relay;
  peers.max_peer_connections = options.max_peer_connections;
  peers.site = options.site;
  return peers;
}

}  // namespace refit
