#include "daemon/config/config.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "toml++/toml.h"

namespace refit {
namespace {

absl::Status Bad(const std::string& origin, const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(origin, ": key '", key, "' ", what));
}

absl::Status ReadString(const toml::node& node, const std::string& origin, const std::string& key,
                        std::string* out) {
  auto value = node.value<std::string>();
  if (!node.is_string() || !value) return Bad(origin, key, "must be a string");
  *out = *value;
  return absl::OkStatus();
}

// A number of bytes, 0 meaning no limit (max_slot_memory, max_gpu_slot_memory).
absl::Status ReadByteLimit(const toml::node& node, const std::string& origin,
                           const std::string& key, uint64_t* out) {
  auto value = node.value<int64_t>();
  if (!node.is_integer() || !value || *value < 0) {
    return Bad(origin, key, "must be a number of bytes (0: no limit)");
  }
  *out = static_cast<uint64_t>(*value);
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseConfig(const std::string& text, const std::string& origin,
                         DaemonOptions* options) {
  toml::table table;
  try {
    table = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    std::ostringstream where;
    where << e.source().begin;
    return absl::InvalidArgumentError(absl::StrCat(origin, ": not valid TOML at ", where.str(),
                                                   ": ", std::string(e.description())));
  }
  DaemonOptions parsed = *options;
  for (const auto& [key_view, node] : table) {
    const std::string key(key_view.str());
    absl::Status status;
    if (key == "socket") {
      status = ReadString(node, origin, key, &parsed.socket_path);
    } else if (key == "listen") {
      status = ReadString(node, origin, key, &parsed.listen);
    } else if (key == "node") {
      status = ReadString(node, origin, key, &parsed.node);
      if (status.ok() && parsed.node.empty()) parsed.node = options->node;  // "": the default
    } else if (key == "metrics_listen") {
      status = ReadString(node, origin, key, &parsed.metrics_listen);
    } else if (key == "health_listen") {
      status = ReadString(node, origin, key, &parsed.health_listen);
    } else if (key == "log_level") {
      status = ReadString(node, origin, key, &parsed.log_level);
      if (status.ok() && parsed.log_level != "trace" && parsed.log_level != "debug" &&
          parsed.log_level != "info" && parsed.log_level != "warn" && parsed.log_level != "error") {
        status = Bad(origin, key, "must be one of trace, debug, info, warn, error");
      }
    } else if (key == "retain") {
      auto value = node.value<int64_t>();
      if (!node.is_integer() || !value || *value < 1 || *value > 1000000) {
        status = Bad(origin, key, "must be an integer from 1 to 1000000");
      } else {
        parsed.retain = static_cast<uint32_t>(*value);
      }
    } else if (key == "chunk_bytes") {
      auto value = node.value<int64_t>();
      if (!node.is_integer() || !value || *value < 4096 || *value > (int64_t{1} << 30)) {
        status = Bad(origin, key, "must be an integer from 4096 to 1073741824");
      } else {
        parsed.chunk_bytes = static_cast<uint64_t>(*value);
      }
    } else if (key == "max_slot_memory") {
      status = ReadByteLimit(node, origin, key, &parsed.max_slot_memory);
    } else if (key == "max_gpu_slot_memory") {
      status = ReadByteLimit(node, origin, key, &parsed.max_gpu_slot_memory);
    } else if (key == "inflight") {
      auto value = node.value<int64_t>();
      if (!node.is_integer() || !value || *value < 1 || *value > 1024) {
        status = Bad(origin, key, "must be an integer from 1 to 1024");
      } else {
        parsed.inflight = static_cast<uint32_t>(*value);
      }
    } else if (key == "delta_threshold") {
      auto value = node.value<double>();
      if (!(node.is_floating_point() || node.is_integer()) || !value || *value < 0 || *value > 1) {
        status = Bad(origin, key, "must be a number from 0 to 1");
      } else {
        parsed.delta_threshold = *value;
      }
    } else if (key == "delta_chain") {
      auto value = node.value<int64_t>();
      if (!node.is_integer() || !value || *value < 1 || *value > 1000) {
        status = Bad(origin, key, "must be an integer from 1 to 1000");
      } else {
        parsed.delta_chain = static_cast<uint32_t>(*value);
      }
    } else if (key == "bucket_export") {
      status = ReadString(node, origin, key, &parsed.bucket_export);
    } else if (key == "bucket_import") {
      status = ReadString(node, origin, key, &parsed.bucket_import);
    } else if (key == "state_dir") {
      status = ReadString(node, origin, key, &parsed.state_dir);
    } else if (key == "data_ports") {
      status = ReadString(node, origin, key, &parsed.data_ports);
    } else if (key == "bucket_full_every") {
      auto value = node.value<int64_t>();
      if (!node.is_integer() || !value || *value < 1 || *value > 1000000) {
        status = Bad(origin, key, "must be an integer from 1 to 1000000");
      } else {
        parsed.bucket_full_every = static_cast<uint32_t>(*value);
      }
    } else if (key == "slot_memory") {
      status = ReadString(node, origin, key, &parsed.slot_memory);
      if (status.ok() && parsed.slot_memory != "host" && parsed.slot_memory != "cuda") {
        status = Bad(origin, key, "must be \"host\" or \"cuda\"");
      }
    } else if (key == "slot_device") {
      auto value = node.value<int64_t>();
      if (!node.is_integer() || !value || *value < 0 || *value > 1023) {
        status = Bad(origin, key, "must be an integer from 0 to 1023");
      } else {
        parsed.slot_device = static_cast<int>(*value);
      }
    } else if (key == "allow_uids" || key == "allow_gids") {
      std::vector<uint32_t>& ids = key == "allow_uids" ? parsed.allow_uids : parsed.allow_gids;
      ids.clear();
      const toml::array* array = node.as_array();
      if (!array) status = Bad(origin, key, "must be an array of integer ids");
      for (size_t i = 0; array && i < array->size(); ++i) {
        auto value = (*array)[i].value<int64_t>();
        if (!(*array)[i].is_integer() || !value || *value < 0 || *value > 4294967294) {
          status = Bad(origin, key, "must be an array of integer ids");
          break;
        }
        ids.push_back(static_cast<uint32_t>(*value));
      }
    } else if (key == "tls_cert") {
      status = ReadString(node, origin, key, &parsed.tls_cert);
    } else if (key == "tls_key") {
      status = ReadString(node, origin, key, &parsed.tls_key);
    } else if (key == "tls_ca") {
      status = ReadString(node, origin, key, &parsed.tls_ca);
    } else if (key == "relay") {
      auto value = node.value<bool>();
      if (!node.is_boolean() || !value) {
        status = Bad(origin, key, "must be true or false");
      } else {
        parsed.relay = *value;
      }
    } else if (key == "max_peer_connections") {
      auto value = node.value<int64_t>();
      if (!node.is_integer() || !value || *value < 1 || *value > 65536) {
        status = Bad(origin, key, "must be an integer from 1 to 65536");
      } else {
        parsed.max_peer_connections = static_cast<uint32_t>(*value);
      }
    } else if (key == "peers") {
      parsed.peers.clear();
      if (node.is_string()) {
        for (auto& p : absl::StrSplit(*node.value<std::string>(), ',', absl::SkipWhitespace())) {
          parsed.peers.emplace_back(p);
        }
      } else if (const toml::array* array = node.as_array()) {
        for (const toml::node& item : *array) {
          auto value = item.value<std::string>();
          if (!item.is_string() || !value) {
            status = Bad(origin, key, "must be an array of \"HOST:PORT\" strings");
            break;
          }
          parsed.peers.push_back(*value);
        }
      } else {
        status = Bad(origin, key, "must be an array of \"HOST:PORT\" strings");
      }
    } else {
      status = Bad(origin, key,
                   "is unknown (known: socket, listen, peers, node, retain, log_level, "
                   "metrics_listen, health_listen, chunk_bytes, inflight, delta_threshold, "
                   "delta_chain, bucket_export, bucket_import, bucket_full_every, slot_memory, "
                   "slot_device, max_slot_memory, max_gpu_slot_memory, relay, "
                   "max_peer_connections, state_dir, data_ports, allow_uids, allow_gids, tls_cert, "
                   "tls_key, tls_ca)");
    }
    if (!status.ok()) return status;
  }
  *options = std::move(parsed);
  return absl::OkStatus();
}

absl::Status LoadConfigFile(const std::string& path, DaemonOptions* options) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::stringstream text;
  text << in.rdbuf();
  return ParseConfig(text.str(), path, options);
}

}  // namespace refit
