// The backend-independent Transport cases between two processes: a forked PeerProcess serves
// memory and is killed or stopped to test peer failure; see transport_conformance.h.

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/transport/testing/conformance_testing.h"
#include "daemon/transport/testing/transport_conformance.h"

namespace refit::transport::testing {
namespace {

TEST_CASE("two processes: get is bit-exact up to 256 MiB in chunks",
          "[transport][conformance][process]") {
  if (!TestBackend().cross_process) return;
  const uint64_t size = 256 * kMiB;
  PeerLink link(size, 21);  // before this process makes its transport
  auto& [peer, t, buffer, memory, endpoint, remote] = link;
  REQUIRE(remote->length() == size);
  struct Case {
    uint64_t offset, length, chunk;
    size_t window;
  };
  const Case cases[] = {{0, 1, 1, 1},
                        {12345, 4095, 4095, 1},
                        {kMiB - 7, kMiB + 1, 64 * 1024, 16},
                        {3, 64 * kMiB - 3, kMiB, 32},
                        {0, size, 4 * kMiB, 16}};
  for (const Case& c : cases) {
    INFO("offset " << c.offset << " length " << c.length << " chunk " << c.chunk << " window "
                   << c.window);
    std::memset(buffer.data() + c.offset, 0, c.length);
    auto start = Clock::now();
    absl::Status s = Transfer(true, *t, {}, *endpoint, *memory, c.offset, *remote, c.offset,
                              c.length, c.chunk, c.window);
    double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    INFO(s.ToString());
    REQUIRE(s.ok());
    CHECK(FindPatternMismatch(buffer.data() + c.offset, c.length, 21, c.offset) == -1);
    if (c.length == size) {
      WARN(TestBackend().name << ": 256 MiB get in " << seconds << " s = " << size / seconds / 1e9
                              << " GB/s");
    }
  }
  remote.reset();
  endpoint.reset();
  memory.reset();
}

TEST_CASE("two processes: get and put on memory the peer's transport allocated",
          "[transport][conformance][process]") {
  if (!TestBackend().cross_process) return;
  const uint64_t size = 64 * kMiB + 4097;  // not a whole number of pages or chunks
  PeerLink link(size, 33, /*allocate=*/true);
  auto& [peer, t, buffer, memory, endpoint, remote] = link;
  REQUIRE(remote->length() == size);
  // Shared memory must take the mapped path; anything else must not claim to.
  CHECK(remote->mapped() == TestBackend().maps_peer_memory);
  std::memset(buffer.data(), 0, size);
  absl::Status s = Transfer(true, *t, {}, *endpoint, *memory, 0, *remote, 0, size, 4 * kMiB, 16);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(buffer.data(), size, 33, 0) == -1);
  // Short reads at odd offsets, many in flight.
  std::memset(buffer.data(), 0, size);
  s = Transfer(true, *t, {}, *endpoint, *memory, 12345, *remote, 12345, 8 * kMiB + 3, 8191, 64);
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(buffer.data() + 12345, 8 * kMiB + 3, 33, 12345) == -1);
  // A put lands in the peer's memory (where the backend allows puts at all): write a window of
  // another pattern, then hash it there.
  if (t->capabilities().rma_put) {
    FillPattern(buffer.data(), size, 34, 0);
    s = Transfer(false, *t, {}, *endpoint, *memory, kMiB, *remote, kMiB, 2 * kMiB, kMiB, 4);
    REQUIRE(s.ok());
    auto hash = peer->Hash(kMiB, 2 * kMiB);
    REQUIRE(hash.ok());
    CHECK(*hash == HashBytes(buffer.data() + kMiB, 2 * kMiB));
  }
  remote.reset();
  endpoint.reset();
  memory.reset();
}

TEST_CASE("two processes: PostGetSpans moves many short ranges as one op",
          "[transport][conformance][process]") {
  if (!TestBackend().cross_process) return;
  const uint64_t size = 8 * kMiB;
  // Registered memory and memory the peer's transport allocated (mapped over shared memory);
  // both peers start before this process makes a transport.
  std::unique_ptr<PeerProcess> peers[] = {StartPeer(size, 41, false), StartPeer(size, 41, true)};
  for (auto& peer : peers) {
    auto t = MakeTransport();
    Buffer buffer(size);
    auto memory = Register(*t, buffer);
    auto endpoint = ConnectTo(*t, peer->address());
    auto remote = Import(*endpoint, peer->descriptor());
    CheckColumnSpans(*t, {}, *endpoint, *memory, buffer, *remote, 41);
    remote.reset();
    endpoint.reset();
    memory.reset();
  }
}

TEST_CASE("two processes: put is bit-exact", "[transport][conformance][process]") {
  if (!TestBackend().cross_process) return;
  const uint64_t size = 64 * kMiB;
  PeerLink link(size, 5);
  auto& [peer, t, buffer, memory, endpoint, remote] = link;
  if (!t->capabilities().rma_put) {  // checked reads: no peer writes, the bytes stay the peer's
    CHECK(endpoint->PostPut(*memory, 0, *remote, 0, 4096, 1).code() ==
          absl::StatusCode::kUnimplemented);
    std::vector<uint8_t> own(4096);
    FillPattern(own.data(), own.size(), 5, 0);
    auto hash = peer->Hash(0, own.size());
    REQUIRE(hash.ok());
    CHECK(*hash == HashBytes(own.data(), own.size()));
    remote.reset();
    endpoint.reset();
    memory.reset();
    return;
  }
  FillPattern(buffer.data(), size, 77, 0);
  const uint64_t offset = 12345, length = size - 2 * offset;
  absl::Status s =
      Transfer(false, *t, {}, *endpoint, *memory, offset, *remote, offset, length, kMiB, 16);
  INFO(s.ToString());
  REQUIRE(s.ok());
  auto hash = peer->Hash(offset, length);
  REQUIRE(hash.ok());
  CHECK(*hash == HashBytes(buffer.data() + offset, length));
  // The bytes around the window kept the peer's own pattern.
  std::vector<uint8_t> head(offset);
  FillPattern(head.data(), offset, 5, 0);
  auto head_hash = peer->Hash(0, offset);
  REQUIRE(head_hash.ok());
  CHECK(*head_hash == HashBytes(head.data(), offset));
  remote.reset();
  endpoint.reset();
  memory.reset();
}

TEST_CASE(
    "two processes: a peer killed mid-transfer fails its ops with UNAVAILABLE; the "
    "survivor keeps working with another peer",
    "[transport][conformance][process][failure]") {
  if (!TestBackend().cross_process) return;
  if (!TestBackend().detects_peer_failure) {
    WARN(TestBackend().name << " does not detect peer failure: skipped");
    return;
  }
  if (!TestBackend().survives_killed_writer) {
    WARN(TestBackend().name << ": a peer killed mid-transfer can leave the shared receive "
                               "queue stuck (ucx_transport.h): skipped");
    return;
  }
  const uint64_t size = 256 * kMiB, chunk = kMiB;
  auto victim = StartPeer(size, 31);
  auto other = StartPeer(16 * kMiB, 32);
  auto t = MakeTransport();
  Buffer buffer(size);
  auto memory = Register(*t, buffer);
  auto endpoint = ConnectTo(*t, victim->address());
  auto remote = Import(*endpoint, victim->descriptor());
  auto other_endpoint = ConnectTo(*t, other->address());
  auto other_remote = Import(*other_endpoint, other->descriptor());

  int handler_calls = 0;
  endpoint->SetFailureHandler([&](const absl::Status& s) {
    ++handler_calls;
    CHECK(absl::IsUnavailable(s));
  });

  Results results;
  std::vector<uint64_t> after_kill;  // cookies of ops posted once the victim was dead
  size_t posted = 0, refused = 0;
  uint64_t next = 0;
  bool killed = false;
  Clock::time_point killed_at;
  std::vector<Completion> completions;
  auto deadline = Clock::now() + std::chrono::seconds(60);
  while ((next < size || results.size() < posted) && Clock::now() < deadline) {
    while (next < size && posted - results.size() < 64) {
      uint64_t cookie = NextCookie();
      // Every other chunk as 256 short spans (PostGetSpans: UCX over tcp gathers them).
      absl::Status s =
          (next / chunk) % 2 == 1
              ? endpoint->PostGetSpans(*memory, *remote, SplitRange(next, chunk, 256), cookie)
              : endpoint->PostGet(*memory, next, *remote, next, chunk, cookie);
      next += chunk;
      if (!s.ok()) {
        INFO(s.ToString());
        CHECK(absl::IsUnavailable(s));
        CHECK(killed);
        ++refused;
        continue;
      }
      ++posted;
      if (killed) after_kill.push_back(cookie);
    }
    completions.clear();
    t->Poll(&completions);
    for (auto& c : completions) {
      REQUIRE(results.count(c.cookie) == 0);
      results[c.cookie] = c.status;
    }
    if (!killed && results.size() >= 8) {
      victim->Kill();  // SIGKILL and reaped: gone for sure
      killed = true;
      killed_at = Clock::now();
    }
  }
  REQUIRE(killed);
  REQUIRE(results.size() == posted);
  double detect_s = std::chrono::duration<double>(Clock::now() - killed_at).count();
  size_t ok = 0, unavailable = refused;
  for (const auto& [cookie, status] : results) {
    INFO(status.ToString());
    CHECK((status.ok() || absl::IsUnavailable(status)));
    ok += status.ok() ? 1 : 0;
    unavailable += absl::IsUnavailable(status) ? 1 : 0;
  }
  for (uint64_t cookie : after_kill) CHECK_FALSE(results[cookie].ok());
  WARN(TestBackend().name << ": " << ok << " ops OK, " << unavailable << " UNAVAILABLE (" << refused
                          << " refused at post); all done " << detect_s << " s after the kill");
  CHECK(unavailable > 0);
  CHECK(detect_s < 10.0);

  // Let the failure handler run if the failure was only seen through completions.
  auto handler_deadline = Clock::now() + std::chrono::seconds(10);
  while (handler_calls == 0 && Clock::now() < handler_deadline) t->Poll(&completions);
  CHECK(handler_calls == 1);
  CHECK(absl::IsUnavailable(endpoint->status()));
  CHECK(absl::IsUnavailable(endpoint->PostGet(*memory, 0, *remote, 0, 4096, NextCookie())));
  if (t->capabilities().rma_put) {
    CHECK(absl::IsUnavailable(endpoint->PostPut(*memory, 0, *remote, 0, 4096, NextCookie())));
  }
  CHECK(absl::IsUnavailable(endpoint->ImportRemote(victim->descriptor()).status()));
  CHECK(endpoint->outstanding() == 0);

  // The survivor: another peer still serves bit-exact bytes.
  std::memset(buffer.data(), 0, 16 * kMiB);
  absl::Status s =
      Transfer(true, *t, {}, *other_endpoint, *memory, 0, *other_remote, 0, 16 * kMiB, kMiB, 16);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(buffer.data(), 16 * kMiB, 32, 0) == -1);
  CHECK(other_endpoint->status().ok());

  remote.reset();
  endpoint.reset();
  other_remote.reset();
  other_endpoint.reset();
  memory.reset();
}

TEST_CASE("two processes: an idle peer's death is noticed", "[transport][conformance][process]") {
  if (!TestBackend().cross_process) return;
  if (!TestBackend().detects_peer_failure) {
    WARN(TestBackend().name << " does not detect peer failure: skipped");
    return;
  }
  PeerLink link(kMiB, 41);
  auto& [peer, t, buffer, memory, endpoint, remote] = link;
  REQUIRE(Transfer(true, *t, {}, *endpoint, *memory, 0, *remote, 0, kMiB, kMiB, 1).ok());
  int handler_calls = 0;
  endpoint->SetFailureHandler([&](const absl::Status&) { ++handler_calls; });
  peer->Kill();
  auto start = Clock::now();
  std::vector<Completion> completions;
  while (handler_calls == 0 && Clock::now() - start < std::chrono::seconds(15)) {
    t->Poll(&completions);
  }
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  WARN(TestBackend().name << ": idle peer death noticed after " << seconds << " s");
  CHECK(handler_calls == 1);
  CHECK(absl::IsUnavailable(endpoint->status()));
  CHECK(completions.empty());
  remote.reset();
  endpoint.reset();
  memory.reset();
}

TEST_CASE("two processes: ops stuck on an unresponsive peer end when the endpoint is destroyed",
          "[transport][conformance][process][failure]") {
  if (!TestBackend().cross_process) return;
  if (!TestBackend().detects_peer_failure) {
    WARN(TestBackend().name << " can't abort ops: skipped");
    return;
  }
  PeerLink link(16 * kMiB, 61);
  auto& [peer, t, buffer, memory, endpoint, remote] = link;
  REQUIRE(Transfer(true, *t, {}, *endpoint, *memory, 0, *remote, 0, kMiB, kMiB, 1).ok());
  peer->Stop();  // alive, its kernel still ACKs TCP, but it never serves anything
  std::vector<uint64_t> cookies;
  for (uint64_t off = 0; off < 16 * kMiB; off += kMiB) {
    cookies.push_back(NextCookie());
    REQUIRE(endpoint->PostGet(*memory, off, *remote, off, kMiB, cookies.back()).ok());
    cookies.push_back(NextCookie());
    REQUIRE(
        endpoint->PostGetSpans(*memory, *remote, SplitRange(off, kMiB, 128), cookies.back()).ok());
  }
  endpoint->Cancel();
  Results results;
  std::vector<Completion> completions;
  auto start = Clock::now();
  while (Clock::now() - start < std::chrono::milliseconds(300)) {
    completions.clear();
    t->Poll(&completions);
    for (auto& c : completions) results[c.cookie] = c.status;
  }
  WARN(TestBackend().name << ": " << results.size() << " of " << cookies.size()
                          << " ops on a stopped peer ended after Cancel + 300 ms");
  remote.reset();
  endpoint.reset();  // aborts whatever is left
  start = Clock::now();
  PollUntil(*t, {}, &results, cookies.size(), std::chrono::seconds(5));
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  CHECK(seconds < 2.0);
  for (uint64_t cookie : cookies) {
    INFO(results[cookie].ToString());
    CHECK((absl::IsCancelled(results[cookie]) || absl::IsUnavailable(results[cookie])));
  }
  CHECK(t->outstanding() == 0);
  peer->Kill();
  memory.reset();
}

TEST_CASE("two processes: a truncated or corrupted descriptor is INVALID_ARGUMENT",
          "[transport][conformance][process]") {
  if (!TestBackend().cross_process) return;
  auto peer = StartPeer(kMiB, 51);
  auto t = MakeTransport();
  auto endpoint = ConnectTo(*t, peer->address());
  const std::string& descriptor = peer->descriptor();
  for (size_t n = 0; n < descriptor.size(); ++n) {
    CHECK(endpoint->ImportRemote(descriptor.substr(0, n)).status().code() ==
          absl::StatusCode::kInvalidArgument);
  }
  for (size_t i = 0; i < descriptor.size(); ++i) {
    std::string bad = descriptor;
    bad[i] = static_cast<char>(bad[i] + 1);
    CHECK(endpoint->ImportRemote(bad).status().code() == absl::StatusCode::kInvalidArgument);
  }
  auto remote = Import(*endpoint, descriptor);
  CHECK(remote->length() == kMiB);
  Buffer buffer(4096);
  auto memory = Register(*t, buffer);
  REQUIRE(Transfer(true, *t, {}, *endpoint, *memory, 0, *remote, 0, 4096, 4096, 1).ok());
  CHECK(FindPatternMismatch(buffer.data(), 4096, 51, 0) == -1);
  remote.reset();
  endpoint.reset();
  memory.reset();
}

}  // namespace
}  // namespace refit::transport::testing
