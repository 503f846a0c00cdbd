#include "daemon/pull/stream_watchdog.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"

namespace refit::pull {

StreamWatchdog::StreamWatchdog(grpc::ClientContext* context, StreamLimits limits)
    : context_(context), limits_(limits) {
  {
    common::MutexLock lock(mu_);
    last_message_ = Clock::now();
    last_news_ = last_message_;
  }
  thread_ = std::thread(&StreamWatchdog::Run, this);
}

StreamWatchdog::~StreamWatchdog() { Stop(); }

void StreamWatchdog::Stop() {
  {
    common::MutexLock lock(mu_);
    stopping_ = true;
  }
  changed_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

void StreamWatchdog::Heard(bool news) {
  common::MutexLock lock(mu_);
  last_message_ = Clock::now();
  if (news) last_news_ = last_message_;
}

bool StreamWatchdog::Fired() const {
  common::MutexLock lock(mu_);
  return !why_.empty();
}

std::string StreamWatchdog::Why() const {
  common::MutexLock lock(mu_);
  return why_;
}

void StreamWatchdog::Run() {
  {
    common::UniqueLock lock(mu_);
    while (true) {
      if (stopping_) return;
      const Clock::time_point silent_at = last_message_ + limits_.silence;
      const Clock::time_point stalled_at = last_news_ + limits_.stall;
      const Clock::time_point now = Clock::now();
      if (now >= silent_at) {
        why_ = absl::StrCat(
            "it sent nothing for ",
            std::chrono::duration_cast<std::chrono::milliseconds>(now - last_message_).count(),
            " ms");
        break;
      }
      if (now >= stalled_at) {
        why_ = "it stalled";
        break;
      }
      changed_.WaitUntil(lock, std::min(silent_at, stalled_at));
    }
  }
  context_->TryCancel();  // the reader's blocking Read returns false
}

}  // namespace refit::pull
