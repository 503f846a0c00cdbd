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

// CPU seconds process `pid` has used (every thread, finished ones included: /proc/PID/stat's
// utime + stime); -1 without a pid or when it can't be read. On a shared machine a daemon's
// CPU per version is what the other processes' turns on the cores don't blur.
double CpuSeconds(int pid);

// The pid of the process serving the unix socket `path` (SO_PEERCRED); 0 when unknown.
int SocketPeerPid(const std::string& path);

// Resident memory of a process, in bytes (/proc/PID/status, /proc/PID/smaps).
struct ResidentMemory {
  uint64_t rss = 0;     // VmRSS: every page mapped and resident, shared ones included
  uint64_t anon = 0;    // RssAnon
  uint64_t shmem = 0;   // RssShmem (POSIX shared memory: clients' buffers, UCX slots)
  uint64_t mapped = 0;  // Rss of the mappings whose path contains one of `mapped_names`
};
absl::StatusOr<ResidentMemory> ReadResidentMemory(int pid,
                                                  const std::vector<std::string>& mapped_names);

}  // namespace refit::bench
