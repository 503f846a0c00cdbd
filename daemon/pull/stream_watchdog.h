#pragma once

// A watchdog over one streaming gRPC call this node reads from: it cancels the call when the
// other side has sent nothing for `silence`, or nothing new for `stall` (a stream of heartbeats
// that never announce progress). Without it, a blocking Read on a stream whose peer keeps its
// connection alive but never writes (a wedged or hostile relay) waits for the call's deadline.
//
// The reader tells it of each message (Heard) and asks, after its Read returned false, whether
// it was the watchdog that ended the stream (Fired) and why.
//
// Thread-safety: Heard, Fired and Why may be called from any thread; one thread of its own waits
// for the deadlines and is joined by the destructor.

#include <chrono>
#include <string>
#include <thread>

#include "daemon/common/mutex.h"

namespace grpc {
class ClientContext;
}

namespace refit::pull {

struct StreamLimits {
  // No message at all for this long: the peer is gone or wedged (a live relay writes at least
  // every 500 ms, its first message within 2 s).
  std::chrono::milliseconds silence{10000};
  // Messages, but nothing new in them, for this long: the peer makes no progress.
  std::chrono::milliseconds stall{30000};
};

class StreamWatchdog {
 public:
  // `context` outlives the watchdog.
  StreamWatchdog(grpc::ClientContext* context, StreamLimits limits);
  ~StreamWatchdog();  // Stop()
  StreamWatchdog(const StreamWatchdog&) = delete;
  StreamWatchdog& operator=(const StreamWatchdog&) = delete;

  // A message arrived; `news`: it announced progress.
  void Heard(bool news);
  // From now on it cancels nothing (the reader stopped reading the stream, and keeps it open
  // while it finishes other work). Idempotent.
  void Stop();
  bool Fired() const;
  std::string Why() const;  // "" unless Fired

 private:
  void Run();

  using Clock = std::chrono::steady_clock;
  grpc::ClientContext* const context_;
  const StreamLimits limits_;
  mutable common::Mutex mu_;
  common::CondVar changed_;
  Clock::time_point last_message_ ABSL_GUARDED_BY(mu_);
  Clock::time_point last_news_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string why_ ABSL_GUARDED_BY(mu_);  // set once, when it fires
  std::thread thread_;
};

}  // namespace refit::pull
