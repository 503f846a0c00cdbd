#pragma once

// Helpers the benchmark programs in tests/bench share: timing, medians, and reading a running
// daemon's state through the client library. Free functions; each call blocks the calling
// thread only (a Client is thread-safe).

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/refit_client.h"

namespace refit::bench {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: comparable across processes

double Seconds(Clock::time_point a, Clock::time_point b);

// The median (the mean of the middle two for an even count); 0 for none.
double Median(std::vector<double> values);

// The metric `name` from the daemon's Status (0 when the daemon does not list it).
absl::StatusOr<double> Metric(client::Client& client, const std::string& name);

// Until the daemon reports at least `peers` connected peers; false after `timeout`.
bool WaitConnected(client::Client& client, int peers, std::chrono::milliseconds timeout);

}  // namespace refit::bench
