// The UCX backend asleep (Transport::PrepareToSleep, WakeFd): a target that only progresses when
// its worker's event fd says so still serves a peer's reads, over tcp and over shared memory,
// and it refuses to sleep while it has work in flight of its own.

#include <poll.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/transport/ucx/ucx_transport.h"

namespace refit::transport {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kSize = 8ull << 20;

std::unique_ptr<UcxTransport> Make(const std::string& tls) {
  UcxTransport::Options options;
  options.config.push_back({"TLS", tls});
  // UCX 1.13's shared-memory transports refuse peer-failure handling (ucx_transport.h).
  options.peer_failure_handling = tls == "tcp";
  auto t = UcxTransport::Create(options);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  return std::move(*t);
}

// Whether `fd` turns readable within `timeout`.
bool Readable(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, static_cast<int>(timeout.count())) > 0 && (p.revents & POLLIN);
}

TEST_CASE("a sleeping target wakes for a peer's reads and serves them", "[transport][ucx]") {
  const std::string tls = GENERATE(std::string("tcp"), std::string("sm"));
  INFO("UCX_TLS " << tls);
  auto reader = Make(tls);
  auto target = Make(tls);
  REQUIRE(target->WakeFd() >= 0);
  std::vector<uint8_t> source(kSize), sink(kSize, 0);
  for (uint64_t i = 0; i < kSize; ++i) source[i] = static_cast<uint8_t>(i * 13 + i / 509);
  auto served = target->RegisterMemory(source.data(), kSize, MemoryKind::kHost);
  auto landing = reader->RegisterMemory(sink.data(), kSize, MemoryKind::kHost);
  REQUIRE(served.ok());
  REQUIRE(landing.ok());
  auto endpoint = reader->Connect(target->LocalAddress());
  REQUIRE(endpoint.ok());
  auto remote = (*endpoint)->ImportRemote((*served)->descriptor());
  REQUIRE(remote.ok());

  // Once connected and quiet, the target may sleep, and then stays asleep: its fd is quiet for
  // 50 ms. A late wire-up or keepalive message may wake it once more before that (UCX's tcp
  // transport sends a few after connecting); the target then polls and goes back to sleep.
  std::vector<Completion> got, none;
  bool quiet = false;
  for (auto until = Clock::now() + std::chrono::seconds(5); !quiet && Clock::now() < until;) {
    reader->Poll(&got);
    target->Poll(&none);
    quiet = target->PrepareToSleep() && !Readable(target->WakeFd(), std::chrono::milliseconds(50));
  }
  REQUIRE(quiet);

  // Two reads of 4 MiB: the target's fd turns readable (the reader only polls itself).
  REQUIRE((*endpoint)->PostGet(**landing, 0, **remote, 0, kSize / 2, 1).ok());
  REQUIRE((*endpoint)->PostGet(**landing, kSize / 2, **remote, kSize / 2, kSize / 2, 2).ok());
  CHECK_FALSE(reader->PrepareToSleep());  // its own reads are in flight
  bool woken = false;
  for (auto until = Clock::now() + std::chrono::seconds(5); !woken && Clock::now() < until;) {
    reader->Poll(&got);
    woken = Readable(target->WakeFd(), std::chrono::milliseconds(1));
  }
  CHECK(woken);
  CHECK(got.empty());  // nothing is served while the target sleeps

  // From here the target polls only when it can't sleep (a reply still being sent, events
  // pending) or after its fd turned readable; the reader polls all the time.
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (got.size() < 2 && Clock::now() < deadline) {
    reader->Poll(&got);
    if (target->PrepareToSleep() && !Readable(target->WakeFd(), std::chrono::milliseconds(1))) {
      continue;
    }
    target->Poll(&none);
  }
  REQUIRE(got.size() == 2);
  for (const Completion& c : got) {
    INFO(c.status.ToString());
    CHECK(c.status.ok());
  }
  CHECK(none.empty());
  CHECK(std::memcmp(sink.data(), source.data(), kSize) == 0);
}

}  // namespace
}  // namespace refit::transport
