#include "daemon/tls/grpc_log.h"

#include <chrono>
#include <map>
#include <string>

#include "daemon/common/logging.h"
#include "daemon/common/mutex.h"
#include "grpc/support/log.h"

namespace refit::tls {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kRepeatEvery = std::chrono::seconds(60);

struct Repeats {
  common::Mutex mu;
  struct Seen {
    Clock::time_point said;
    uint64_t since = 0;  // occurrences not said since `said`
  };
  std::map<std::string, Seen> by_reason ABSL_GUARDED_BY(mu);
};

Repeats& TheRepeats() {
  static Repeats* repeats = new Repeats();  // lives as long as gRPC's threads may log
  return *repeats;
}

bool Contains(const std::string& text, const char* part) {
  return text.find(part) != std::string::npos;
}

// Whether to say `reason` now; `*unsaid` is how many were not said since it last was.
bool SayNow(const std::string& reason, uint64_t* unsaid) {
  Repeats& repeats = TheRepeats();
  common::MutexLock lock(repeats.mu);
  const Clock::time_point now = Clock::now();
  auto [it, first] = repeats.by_reason.try_emplace(reason);
  if (!first && now - it->second.said < kRepeatEvery) {
    ++it->second.since;
    return false;
  }
  *unsaid = it->second.since;
  it->second = {now, 0};
  if (repeats.by_reason.size() > 256) repeats.by_reason.clear();  // bounded
  return true;
}

void Route(gpr_log_func_args* args) {
  const std::string message = args->message ? args->message : "";
  auto logger = Logger("grpc");
  if (Contains(message, "No match found for server name")) {
    // Peers are dialled by address: gRPC says so for every TLS connection.
    logger->debug("{}", message);
    return;
  }
  if (Contains(message, "Handshake failed")) {
    uint64_t unsaid = 0;
    if (!SayNow(message, &unsaid)) return;
    std::string hint;
    if (Contains(message, "wrong version number") || Contains(message, "http request")) {
      hint = "a peer without TLS (plaintext) dialled the peer port";
    } else if (Contains(message, "certificate verify failed") || Contains(message, "certificate") ||
               Contains(message, "unknown ca")) {
      hint =
          "a certificate was refused: the peer's is expired or not issued by this node's "
          "--tls-ca, or the peer refused this node's";
    } else {
      hint = "a peer's TLS handshake failed";
    }
    logger->warn("TLS handshake failed on a peer connection: {} ({}){}", hint, message,
                 unsaid > 0 ? " (" + std::to_string(unsaid) + " more like it in the last minute)"
                            : "; said at most once a minute from now on");
    return;
  }
  switch (args->severity) {
    case GPR_LOG_SEVERITY_DEBUG:
      logger->debug("{} ({}:{})", message, args->file ? args->file : "", args->line);
      break;
    case GPR_LOG_SEVERITY_INFO:
      logger->info("{} ({}:{})", message, args->file ? args->file : "", args->line);
      break;
    default:
      logger->error("{} ({}:{})", message, args->file ? args->file : "", args->line);
      break;
  }
}

}  // namespace

void RouteGrpcLogs() { gpr_set_log_function(Route); }

}  // namespace refit::tls
