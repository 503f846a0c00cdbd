// refitd: the per-node refit daemon. Parses flags, starts the Daemon, waits for SIGTERM/SIGINT.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "CLI/CLI.hpp"
#include "absl/strings/str_split.h"
#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/daemon.h"
#include "daemon/version.h"

namespace {

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

}  // namespace

int main(int argc, char** argv) {
  refit::DaemonOptions options;
  const char* env_socket = std::getenv("REFIT_SOCKET");
  options.socket_path = env_socket && *env_socket ? env_socket : "/run/refit/refitd.sock";
  options.node = HostName();
  std::string peers;
  std::string log_level = "info";
  bool version = false;

  CLI::App app{"refitd: moves policy weights from trainers to inference engines"};
  app.add_option("--socket", options.socket_path,
                 "Unix socket for local clients (default $REFIT_SOCKET, else "
                 "/run/refit/refitd.sock)");
  app.add_option("--listen", options.listen, "HOST:PORT for other daemons")
      ->capture_default_str();
  app.add_option("--peers", peers, "the other daemons, HOST:PORT,...");
  app.add_option("--node", options.node, "this node's name (default: host name)");
  app.add_option("--retain", options.retain, "versions kept per model")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1000000u));
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  app.add_flag("--version", version, "print the version and CUDA support, then exit");
  CLI11_PARSE(app, argc, argv);

  if (version) {
    std::cout << "refitd " << refit::kRefitVersion << " (" << refit::cuda::Describe() << ")\n";
    return 0;
  }
  refit::SetLogLevel(log_level);
  for (auto& p : absl::StrSplit(peers, ',', absl::SkipWhitespace())) {
    options.peers.emplace_back(p);
  }

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
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  refit::Logger("daemon")->info("received {}", strsignal(signal_number));
  (*daemon)->Shutdown();
  return 0;
}
