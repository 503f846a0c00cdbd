#include "daemon/transport/testing/conformance_testing.h"

#include <algorithm>

#include "catch2/catch.hpp"
#include "daemon/common/xxh3.h"

namespace refit::transport::testing {

std::unique_ptr<Transport> MakeTransport() {
  auto transport = TestBackend().make();
  INFO(transport.status().ToString());
  REQUIRE(transport.ok());
  return *std::move(transport);
}

std::unique_ptr<LocalMemory> Register(Transport& transport, const Buffer& buffer) {
  auto memory = transport.RegisterMemory(buffer.data(), buffer.size, MemoryKind::kHost);
  INFO(memory.status().ToString());
  REQUIRE(memory.ok());
  return *std::move(memory);
}

std::unique_ptr<Endpoint> ConnectTo(Transport& self, const std::string& address) {
  auto endpoint = self.Connect(address);
  INFO(endpoint.status().ToString());
  REQUIRE(endpoint.ok());
  return *std::move(endpoint);
}

std::unique_ptr<RemoteMemory> Import(Endpoint& endpoint, const std::string& descriptor) {
  auto remote = endpoint.ImportRemote(descriptor);
  INFO(remote.status().ToString());
  REQUIRE(remote.ok());
  return *std::move(remote);
}

PeerLink::PeerLink(uint64_t size, uint64_t seed, bool allocate)
    : peer(StartPeer(size, seed, allocate)),
      t(MakeTransport()),
      buffer(size),
      memory(Register(*t, buffer)),
      endpoint(ConnectTo(*t, peer->address())),
      remote(Import(*endpoint, peer->descriptor())) {}

std::vector<Span> SplitRange(uint64_t offset, uint64_t length, uint64_t count) {
  std::vector<Span> spans;
  const uint64_t each = length / count;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t at = offset + i * each;
    spans.push_back({at, at, i + 1 == count ? length - i * each : each});
  }
  return spans;
}

uint64_t NextCookie() {
  static uint64_t cookie = 1000;
  return ++cookie;
}

void PollUntil(Transport& self, const std::vector<Transport*>& others, Results* results,
               size_t expected, std::chrono::seconds timeout,
               std::map<uint64_t, std::vector<uint64_t>>* span_sums) {
  auto deadline = Clock::now() + timeout;
  std::vector<Completion> completions;
  while (results->size() < expected && Clock::now() < deadline) {
    completions.clear();
    self.Poll(&completions);
    for (auto& c : completions) {
      INFO("cookie " << c.cookie);
      REQUIRE(results->count(c.cookie) == 0);
      (*results)[c.cookie] = c.status;
      if (span_sums) (*span_sums)[c.cookie] = c.span_xxh3;
    }
    std::vector<Completion> ignored;
    for (Transport* other : others) other->Poll(&ignored);
  }
  REQUIRE(results->size() == expected);
}

absl::Status Transfer(bool get, Transport& self, const std::vector<Transport*>& others,
                      Endpoint& endpoint, const LocalMemory& local, uint64_t local_base,
                      const RemoteMemory& remote, uint64_t remote_base, uint64_t length,
                      uint64_t chunk, size_t window) {
  Results results;
  size_t posted = 0;
  uint64_t next = 0;
  absl::Status first_error;
  std::vector<Completion> completions;
  auto deadline = Clock::now() + std::chrono::seconds(120);
  while ((next < length || results.size() < posted) && Clock::now() < deadline) {
    while (next < length && posted - results.size() < window) {
      uint64_t n = std::min(chunk, length - next);
      uint64_t cookie = NextCookie();
      absl::Status s =
          get ? endpoint.PostGet(local, local_base + next, remote, remote_base + next, n, cookie)
              : endpoint.PostPut(local, local_base + next, remote, remote_base + next, n, cookie);
      if (!s.ok()) return s;
      ++posted;
      next += n;
    }
    completions.clear();
    self.Poll(&completions);
    for (auto& c : completions) {
      REQUIRE(results.count(c.cookie) == 0);
      if (!c.status.ok() && first_error.ok()) first_error = c.status;
      results[c.cookie] = c.status;
    }
    std::vector<Completion> ignored;
    for (Transport* other : others) other->Poll(&ignored);
  }
  REQUIRE(results.size() == posted);
  REQUIRE(next == length);
  return first_error;
}

void CheckColumnSpans(Transport& self, const std::vector<Transport*>& others, Endpoint& endpoint,
                      const LocalMemory& local, Buffer& buffer, const RemoteMemory& remote,
                      uint64_t seed) {
  constexpr uint64_t kRow = 4096, kHalf = kRow / 2;
  const uint64_t rows = std::min(buffer.size, remote.length()) / kRow;
  std::memset(buffer.data(), 0, buffer.size);
  std::vector<std::vector<Span>> batches(1);
  for (uint64_t row = 0; row < rows; ++row) {
    if (batches.back().size() == 256) batches.emplace_back();
    batches.back().push_back({row * kRow + kHalf, row * kRow + kHalf, kHalf});
  }
  std::map<uint64_t, const std::vector<Span>*> posted;
  for (auto& spans : batches) {
    const uint64_t cookie = NextCookie();
    REQUIRE(endpoint.PostGetSpans(local, remote, spans, cookie).ok());
    posted[cookie] = &spans;
  }
  Results done;
  std::map<uint64_t, std::vector<uint64_t>> sums;
  PollUntil(self, others, &done, posted.size(), std::chrono::seconds(60), &sums);
  REQUIRE(done.size() == batches.size());  // one completion per batch
  for (const auto& [cookie, status] : done) {
    REQUIRE(posted.count(cookie) == 1);
    CHECK(status.ok());
  }
  for (uint64_t row = 0; row < rows; ++row) {
    CHECK(FindPatternMismatch(buffer.data() + row * kRow + kHalf, kHalf, seed,
                              row * kRow + kHalf) == -1);
    CHECK(std::all_of(buffer.data() + row * kRow, buffer.data() + row * kRow + kHalf,
                      [](uint8_t b) { return b == 0; }));
  }
  // Per-span digests, where the backend gives them (a copy from mapped peer memory and a
  // gathering transport must): one per span, in order, each the XXH3-64 of the bytes that
  // landed.
  for (const auto& [cookie, spans] : posted) {
    const std::vector<uint64_t>& got = sums.at(cookie);
    if (remote.mapped() || self.capabilities().gathers_spans) CHECK(!got.empty());
    if (got.empty()) continue;
    REQUIRE(got.size() == spans->size());
    for (size_t i = 0; i < got.size(); ++i) {
      const Span& span = (*spans)[i];
      CHECK(got[i] == XXH3_64bits(buffer.data() + span.local_offset, span.length));
    }
  }
  const uint64_t end = remote.length();
  CHECK(endpoint.PostGetSpans(local, remote, {{0, 0, 16}, {end - 8, end - 8, 16}}, NextCookie())
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(endpoint.PostGetSpans(local, remote, {}, NextCookie()).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(endpoint.outstanding() == 0);
}

void WireUp(Transport& self, Transport& peer, Endpoint& endpoint, const LocalMemory& local,
            const RemoteMemory& remote) {
  absl::Status s = Transfer(true, self, {&peer}, endpoint, local, 0, remote, 0, 1, 1, 1);
  INFO(s.ToString());
  REQUIRE(s.ok());
}

void Settle(const std::vector<Transport*>& transports) {
  std::vector<Completion> ignored;
  auto until = Clock::now() + std::chrono::milliseconds(20);
  while (Clock::now() < until) {
    for (Transport* t : transports) t->Poll(&ignored);
  }
}

std::unique_ptr<PeerProcess> StartPeer(uint64_t size, uint64_t seed, bool allocate) {
  auto peer = PeerProcess::Start(TestBackend().make, size, seed, allocate);
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());
  return *std::move(peer);
}

}  // namespace refit::transport::testing
