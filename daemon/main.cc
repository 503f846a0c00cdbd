// refitd: the per-node refit daemon. Reads flags and the optional config file, starts the
// Daemon, tells systemd it is ready, pings the watchdog, and stops on SIGTERM/SIGINT.
#include <signal.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <iostream>

#include "CLI/CLI.hpp"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/config/config.h"
#include "daemon/daemon.h"
#include "daemon/version.h"

namespace {

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

std::vector<std::string> SplitPeers(const std::string& peers) {
  std::vector<std::string> out;
  for (auto& p : absl::StrSplit(peers, ',', absl::SkipWhitespace())) out.emplace_back(p);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  refit::DaemonOptions options;
  const char* env_socket = std::getenv("REFIT_SOCKET");
  if (env_socket && *env_socket) options.socket_path = env_socket;
  options.node = HostName();
  // systemd's StateDirectory= (several directories are separated by ':'; the first is ours).
  if (const char* state = std::getenv("STATE_DIRECTORY"); state && *state) {
    options.state_dir = std::string(state).substr(0, std::string(state).find(':'));
  }

  // Flags land in `flags`; only the ones given override the config file.
  refit::DaemonOptions flags = options;
  std::string config_path, peers;
  bool version = false;
  CLI::App app{"refitd: moves policy weights from trainers to inference engines"};
  app.add_option("--config", config_path, "TOML config file (flags override it)");
  auto* socket_opt = app.add_option(
      "--socket", flags.socket_path,
      "Unix socket for local clients (default $REFIT_SOCKET, else /run/refit/refitd.sock)");
  auto* listen_opt = app.add_option("--listen", flags.listen, "HOST:PORT for other daemons")
                         ->capture_default_str();
  auto* peers_opt = app.add_option("--peers", peers, "the other daemons, HOST:PORT,...");
  auto* node_opt = app.add_option("--node", flags.node, "this node's name (default: host name)");
  auto* retain_opt = app.add_option("--retain", flags.retain, "versions kept per model")
                         ->capture_default_str()
                         ->check(CLI::Range(1u, 1000000u));
  auto* level_opt =
      app.add_option("--log-level", flags.log_level, "trace, debug, info, warn, error")
          ->capture_default_str()
          ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  auto* metrics_opt = app.add_option("--metrics-listen", flags.metrics_listen,
                                     "HOST:PORT serving Prometheus /metrics (default: off)");
  auto* health_opt = app.add_option("--health-listen", flags.health_listen,
                                    "HOST:PORT serving only grpc.health.v1, for probes "
                                    "(default: off)");
  auto* chunk_opt = app.add_option("--chunk-bytes", flags.chunk_bytes,
                                   "largest single RMA read when pulling from another node")
                        ->capture_default_str()
                        ->check(CLI::Range(uint64_t{4096}, uint64_t{1} << 30));
  auto* max_slot_opt =
      app.add_option("--max-slot-memory", flags.max_slot_memory,
                     "most bytes of version slots in host memory, e.g. 64GiB (default 0: no "
                     "limit); past it Publish is RESOURCE_EXHAUSTED")
          ->transform(CLI::AsSizeValue(false));
  auto* max_gpu_slot_opt =
      app.add_option("--max-gpu-slot-memory", flags.max_gpu_slot_memory,
                     "most bytes of version slots in GPU memory (--slot-memory=cuda), e.g. "
                     "40GiB (default 0: no limit); past it Publish is RESOURCE_EXHAUSTED")
          ->transform(CLI::AsSizeValue(false));
  auto* inflight_opt = app.add_option("--inflight", flags.inflight, "RMA reads in flight per pull")
                           ->capture_default_str()
                           ->check(CLI::Range(1u, 1024u));
  auto* threshold_opt =
      app.add_option("--delta-threshold", flags.delta_threshold,
                     "use a delta only when it is at most this fraction of the full bytes "
                     "(0: never)")
          ->capture_default_str()
          ->check(CLI::Range(0.0, 1.0));
  auto* chain_opt = app.add_option("--delta-chain", flags.delta_chain,
                                   "deltas a source keeps per buffer, for receivers behind")
                        ->capture_default_str()
                        ->check(CLI::Range(1u, 1000u));
  auto* export_opt = app.add_option("--bucket-export", flags.bucket_export,
                                    "write versions of local models to this directory");
  auto* import_opt = app.add_option("--bucket-import", flags.bucket_import,
                                    "follow this directory and complete the versions in it");
  auto* full_every_opt =
      app.add_option("--bucket-full-every", flags.bucket_full_every,
                     "write a full base (not a delta) to --bucket-export every K versions")
          ->capture_default_str()
          ->check(CLI::Range(1u, 1000000u));
  auto* slot_memory_opt =
      app.add_option("--slot-memory", flags.slot_memory,
                     "where version slots live: host (pinned when a GPU is seen) or cuda")
          ->capture_default_str()
          ->check(CLI::IsMember({"host", "cuda"}));
  auto* slot_device_opt = app.add_option("--slot-device", flags.slot_device,
                                         "the GPU holding the slots with --slot-memory=cuda")
                              ->capture_default_str()
                              ->check(CLI::Range(0, 1023));
  auto* relay_opt =
      app.add_option("--relay", flags.relay,
                     "serve versions this node pulled to other nodes pulling them, and read "
                     "from them (true, false)")
          ->capture_default_str();
  auto* max_peer_opt =
      app.add_option("--max-peer-connections", flags.max_peer_connections,
                     "the most control channels open to other daemons: --peers, plus relay "
                     "channels opened on demand")
          ->capture_default_str()
          ->check(CLI::Range(1, 65536));
  auto* allow_uids_opt =
      app.add_option("--allow-uids", flags.allow_uids,
                     "local callers (by uid) allowed besides refitd's own uid, e.g. 1000,1001")
          ->delimiter(',');
  auto* allow_gids_opt =
      app.add_option("--allow-gids", flags.allow_gids,
                     "local callers allowed by group (primary or supplementary; default: the "
                     "socket's group)")
          ->delimiter(',');
  auto* tls_cert_opt = app.add_option("--tls-cert", flags.tls_cert,
                                      "PEM certificate of this node (peer plane, mutual TLS)");
  auto* tls_key_opt = app.add_option("--tls-key", flags.tls_key, "PEM private key of --tls-cert");
  auto* tls_ca_opt = app.add_option("--tls-ca", flags.tls_ca,
                                    "PEM CA that every peer's certificate must chain to");
  auto* state_opt = app.add_option(
      "--state-dir", flags.state_dir,
      "where refitd keeps each model's newest published version across restarts (default "
      "$STATE_DIRECTORY, else none)");
  auto* data_ports_opt = app.add_option(
      "--data-ports", flags.data_ports,
      "LOW-HIGH: the TCP ports UCX's data plane listens on (default: any; it listens on "
      "--listen's interface)");
  app.add_flag("--version", version, "print the version and CUDA support, then exit");
  CLI11_PARSE(app, argc, argv);

  if (version) {
    std::cout << "refitd " << refit::kRefitVersion << " (" << refit::cuda::Describe() << ")\n";
    return 0;
  }
  if (!config_path.empty()) {
    absl::Status loaded = refit::LoadConfigFile(config_path, &options);
    if (!loaded.ok()) {
      std::cerr << "refitd: " << loaded.message() << "\n";
      return 2;
    }
  }
  if (*socket_opt) options.socket_path = flags.socket_path;
  if (*listen_opt) options.listen = flags.listen;
  if (*peers_opt) options.peers = SplitPeers(peers);
  if (*node_opt) options.node = flags.node;
  if (*retain_opt) options.retain = flags.retain;
  if (*level_opt) options.log_level = flags.log_level;
  if (*metrics_opt) options.metrics_listen = flags.metrics_listen;
  if (*health_opt) options.health_listen = flags.health_listen;
  if (*chunk_opt) options.chunk_bytes = flags.chunk_bytes;
  if (*inflight_opt) options.inflight = flags.inflight;
  if (*max_slot_opt) options.max_slot_memory = flags.max_slot_memory;
  if (*max_gpu_slot_opt) options.max_gpu_slot_memory = flags.max_gpu_slot_memory;
  if (*threshold_opt) options.delta_threshold = flags.delta_threshold;
  if (*chain_opt) options.delta_chain = flags.delta_chain;
  if (*export_opt) options.bucket_export = flags.bucket_export;
  if (*import_opt) options.bucket_import = flags.bucket_import;
  if (*full_every_opt) options.bucket_full_every = flags.bucket_full_every;
  if (*slot_memory_opt) options.slot_memory = flags.slot_memory;
  if (*slot_device_opt) options.slot_device = flags.slot_device;
  if (*relay_opt) options.relay = flags.relay;
  if (*max_peer_opt) options.max_peer_connections = flags.max_peer_connections;
  if (*allow_uids_opt) options.allow_uids = flags.allow_uids;
  if (*allow_gids_opt) options.allow_gids = flags.allow_gids;
  if (*tls_cert_opt) options.tls_cert = flags.tls_cert;
  if (*tls_key_opt) options.tls_key = flags.tls_key;
  if (*tls_ca_opt) options.tls_ca = flags.tls_ca;
  if (*state_opt) options.state_dir = flags.state_dir;
  if (*data_ports_opt) options.data_ports = flags.data_ports;
  // Peers tell pieces apart by node name; an empty one would read as this node's own.
  if (options.node.empty() || options.node.size() > 255) {
    std::cerr << "refitd: --node must be 1 to 255 bytes (default: the host name)\n";
    return 2;
  }
  refit::SetLogLevel(options.log_level);

  // Block the stop signals in every thread (gRPC's inherit this mask); this thread waits.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto daemon = refit::Daemon::Start(options);
  if (!daemon.ok()) {
    refit::Logger("daemon")->error("cannot start: {}", daemon.status().ToString());
    return 1;
  }
  sd_notifyf(0, "READY=1\nSTATUS=serving %s\nMAINPID=%d", options.socket_path.c_str(),
             static_cast<int>(getpid()));

  // The main loop: wait for a stop signal, pinging systemd's watchdog at half its interval —
  // but only while no worker is stuck (busy without progress for half the interval, at least
  // 2 s) and the local gRPC server answers a health check; otherwise say which in the log and
  // in the unit's status, and let systemd restart the daemon.
  uint64_t watchdog_usec = 0;
  const bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0 && watchdog_usec > 0;
  const uint64_t tick_usec = watchdog ? watchdog_usec / 2 : 3600ull * 1000000;
  timespec tick{static_cast<time_t>(tick_usec / 1000000),
                static_cast<long>((tick_usec % 1000000) * 1000)};
  const auto stall = std::max<std::chrono::milliseconds>(
      std::chrono::milliseconds(tick_usec / 1000), std::chrono::seconds(2));
  int signal_number = 0;
  bool was_stuck = false;
  while (true) {
    if (watchdog) {
      const std::vector<std::string> stuck = (*daemon)->StuckWorkers(stall);
      if (stuck.empty()) {
        sd_notify(0, "WATCHDOG=1");
        if (was_stuck) {
          refit::Logger("daemon")->warn("nothing is stuck any more; pinging the watchdog again");
          sd_notify(0, "STATUS=serving");
        }
      } else {
        const std::string what = absl::StrJoin(stuck, "; ");
        refit::Logger("daemon")->error("not pinging systemd's watchdog: stuck: {}", what);
        sd_notifyf(0, "STATUS=stuck: %s", what.c_str());
      }
      was_stuck = !stuck.empty();
    }
    signal_number = sigtimedwait(&stop_signals, nullptr, &tick);
    if (signal_number > 0) break;
  }
  refit::Logger("daemon")->info("received {}", strsignal(signal_number));
  sd_notify(0, "STOPPING=1");
  (*daemon)->Shutdown();
  return 0;
}
