#pragma once

// refitd's configuration file (TOML, read with toml++). Keys are the flag names with '-' → '_':
//   socket, listen, peers, node, retain, log_level, metrics_listen, health_listen, chunk_bytes,
//   inflight, delta_threshold, delta_chain, bucket_export, bucket_import, bucket_full_every,
//   slot_memory, slot_device, max_slot_memory, max_gpu_slot_memory, relay, max_peer_connections, state_dir,
//   data_ports, allow_uids, allow_gids, tls_cert, tls_key, tls_ca
// Flags given on the command line override the file. Unknown keys and bad values are rejected
// with a message naming the key. See deploy/refitd.toml for a documented sample.

#include <string>

#include "absl/status/status.h"
#include "daemon/options.h"

namespace refit {

// Reads `path` into `options` (only the keys present change). INVALID_ARGUMENT naming the key
// for an unknown key or a bad value, NOT_FOUND when the file can't be read.
absl::Status LoadConfigFile(const std::string& path, DaemonOptions* options);

// Same, from TOML text (`origin` names it in messages).
absl::Status ParseConfig(const std::string& text, const std::string& origin,
                         DaemonOptions* options);

}  // namespace refit
