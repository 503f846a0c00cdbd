#pragma once

// The metrics the local API counts (docs/api.md).

#include <array>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/metrics/metrics.h"

namespace refit::server {

// One series per status code, e.g. refit_request_errors_total{code="NOT_FOUND"}.
inline constexpr Counter kRequestErrors{"refit_request_errors_total",
                                        "Failed calls on the local API, by status code."};
inline constexpr Counter kOwnerExitReleases{
    "refit_owner_exit_releases_total",
    "Buffers released because the process that registered them exited (or stopped renewing "
    "its lease)."};

// kRequestErrors' series, one per status code, resolved once (each is listed from its first
// error, as before).
class RequestErrors {
 public:
  explicit RequestErrors(Metrics* metrics) : metrics_(metrics) {  // null: counts nothing
    if (!metrics_) return;
    metrics_->DeclareLabelled(kRequestErrors);
    for (int code = 0; code < kCodes; ++code) {
      by_code_[code] =
          metrics_->Series(kRequestErrors, Labels(static_cast<absl::StatusCode>(code)));
    }
  }
  void Add(absl::StatusCode code) const {
    const int index = static_cast<int>(code);
    if (index >= 0 && index < kCodes) {
      by_code_[index].Add(1);
    } else if (metrics_) {
      metrics_->Add(kRequestErrors, Labels(code), 1);
    }
  }

 private:
  static constexpr int kCodes = 17;  // OK .. UNAUTHENTICATED
  static std::string Labels(absl::StatusCode code) {
    return absl::StrCat("code=\"", absl::StatusCodeToString(code), "\"");
  }
  Metrics* const metrics_;
  std::array<CounterHandle, kCodes> by_code_;
};

}  // namespace refit::server
