// refitd: the per-node refit daemon. Reads flags and the optional config file, starts the
// Daemon, tells systemd it is ready, pings the watchdog, and stops on SIGTERM/SIGINT.
#include <malloc.h>
#include <signal.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <iostream>

#include "CLI/CLI.hpp"
#include "absl/strings/str_join.h"
#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/config/cli.h"
#include "daemon/config/config.h"
#include "daemon/daemon.h"
#include "daemon/tls/grpc_log.h"
#include "daemon/tls/peer_tls.h"
#include "daemon/version.h"

namespace {

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

}  // namespace

int main(int argc, char** argv) {
  // Large requests (a peer's or a client's message of up to a few MiB, accepted or refused) are
  // mapped and unmapped, never kept in malloc's arenas: glibc's default raises its mmap
  // threshold after the first such free, and then one gRPC thread's arena keeps each MiB a
  // hostile peer made it allocate (issue 37: resident memory back where it started after an
  // attack). Version slots are mapped by refitd itself either way.
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  mallopt(M_TRIM_THRESHOLD, 1 << 20);
  refit::DaemonOptions options;
  const char* env_socket = std::getenv("REFIT_SOCKET");
  if (env_socket && *env_socket) options.socket_path = env_socket;
  options.node = HostName();
  // systemd's StateDirectory= (several directories are separated by ':'; the first is ours).
  if (const char* state = std::getenv("STATE_DIRECTORY"); state && *state) {
    options.state_dir = std::string(state).substr(0, std::string(state).find(':'));
  }

  std::string config_path;
  bool version = false;
  CLI::App app{"refitd: moves policy weights from trainers to inference engines"};
  app.add_option("--config", config_path, "TOML config file (flags override it)");
  refit::config::CommandLine command_line(&app);
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
  command_line.ApplyGiven(&options);
  // Certificates as systemd credentials (the unit's LoadCredential=, from /etc/refit/tls/),
  // unless the config file or flags name TLS files.
  if (const char* credentials = std::getenv("CREDENTIALS_DIRECTORY");
      credentials && *credentials && options.tls_cert.empty() && options.tls_key.empty() &&
      options.tls_ca.empty()) {
    auto files = refit::tls::FromCredentials(credentials);
    if (!files.ok()) {
      std::cerr << "refitd: " << files.status().message() << "\n";
      return 2;
    }
    options.tls_cert = files->cert;
    options.tls_key = files->key;
    options.tls_ca = files->ca;
  }
  // Peers tell pieces apart by node name; an empty one would read as this node's own.
  if (options.node.empty() || options.node.size() > 255) {
    std::cerr << "refitd: --node must be 1 to 255 bytes (default: the host name)\n";
    return 2;
  }
  if (options.site.size() > 255) {
    std::cerr << "refitd: --site must be at most 255 bytes\n";
    return 2;
  }
  refit::SetLogLevel(options.log_level);
  refit::tls::RouteGrpcLogs();  // gRPC's own lines in refit's format, TLS failures explained

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
