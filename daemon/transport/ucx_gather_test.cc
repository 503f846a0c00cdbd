// The UCX backend's gathers (ucx_gather.cc), between two transports in this process over tcp:
// what the conformance suite can't see — how many messages went, the fallback to gets, a
// target's refusal, and replies that come after their op was given up.

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/transport/ucx_transport.h"
#include "daemon/transport/wire.h"
#include "xxhash.h"

namespace refit::transport {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMiB = 1ull << 20;

std::unique_ptr<UcxTransport> Tcp(bool serve_gathers = true) {
  UcxTransport::Options options;
  options.config.push_back({"TLS", "tcp"});
  options.serve_gathers = serve_gathers;
  auto t = UcxTransport::Create(options);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  return std::move(*t);
}

// `target` serves `size` bytes (byte i = i * 7 + i / 251); `self` reads them into a zeroed
// buffer of its own. Members go in reverse order.
struct Pair {
  explicit Pair(uint64_t size, bool serve_gathers = true)
      : self(Tcp()), target(Tcp(serve_gathers)), source(size), sink(size, 0) {
    for (uint64_t i = 0; i < size; ++i) source[i] = static_cast<uint8_t>(i * 7 + i / 251);
    auto s = target->RegisterMemory(source.data(), size, MemoryKind::kHost);
    auto d = self->RegisterMemory(sink.data(), size, MemoryKind::kHost);
    REQUIRE(s.ok());
    REQUIRE(d.ok());
    source_memory = std::move(*s);
    sink_memory = std::move(*d);
    auto ep = self->Connect(target->LocalAddress());
    REQUIRE(ep.ok());
    endpoint = std::move(*ep);
    auto r = endpoint->ImportRemote(source_memory->descriptor());
    REQUIRE(r.ok());
    remote = std::move(*r);
  }
  // Polls both until `n` completions arrived on `self` (or 20 s passed).
  std::vector<Completion> Wait(size_t n) {
    std::vector<Completion> got, ignored;
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (got.size() < n && Clock::now() < deadline) {
      self->Poll(&got);
      target->Poll(&ignored);
    }
    REQUIRE(got.size() == n);
    return got;
  }

  std::unique_ptr<UcxTransport> self;
  std::unique_ptr<UcxTransport> target;
  std::vector<uint8_t> source;
  std::vector<uint8_t> sink;
  std::unique_ptr<LocalMemory> source_memory;
  std::unique_ptr<LocalMemory> sink_memory;
  std::unique_ptr<Endpoint> endpoint;
  std::unique_ptr<RemoteMemory> remote;
};

// The second half of each `row`-byte row of the first `rows` rows.
std::vector<Span> Columns(uint64_t rows, uint64_t row) {
  std::vector<Span> spans;
  for (uint64_t r = 0; r < rows; ++r) spans.push_back({r * row + row / 2, r * row + row / 2, row / 2});
  return spans;
}

void CheckLanded(const Pair& p, const std::vector<Span>& spans) {
  for (const Span& s : spans) {
    REQUIRE(std::equal(p.sink.begin() + s.local_offset, p.sink.begin() + s.local_offset + s.length,
                       p.source.begin() + s.remote_offset));
  }
}

TEST_CASE("short spans go as gathers of at most 1 MiB, with a digest per span",
          "[transport][ucx][gather]") {
  Pair p(8 * kMiB);
  // 2,048 spans of 2 KiB: 4 MiB in 4 gathers, one completion.
  const std::vector<Span> spans = Columns(2048, 4096);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 7).ok());
  const std::vector<Completion> done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CHECK(done[0].cookie == 7);
  CheckLanded(p, spans);
  CHECK(std::all_of(p.sink.begin(), p.sink.begin() + 2048, [](uint8_t b) { return b == 0; }));
  CHECK(p.self->gathers_sent() == 4);
  CHECK(p.target->gathers_served() == 4);
  REQUIRE(done[0].span_xxh3.size() == spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    CHECK(done[0].span_xxh3[i] == XXH3_64bits(p.sink.data() + spans[i].local_offset, 2048));
  }
}

TEST_CASE("a target that doesn't serve gathers: the spans come by gets, and later ones too",
          "[transport][ucx][gather]") {
  Pair p(4 * kMiB, /*serve_gathers=*/false);
  const std::vector<Span> spans = Columns(1024, 4096);  // 2 MiB: two gathers
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 1).ok());
  std::vector<Completion> done = p.Wait(1);
  INFO(done[0].status.ToString());
  REQUIRE(done[0].status.ok());
  CheckLanded(p, spans);
  CHECK(done[0].span_xxh3.empty());  // gets carry no digests
  CHECK(p.self->gathers_sent() == 2);
  CHECK(p.target->gathers_served() == 2);  // each answered UNSUPPORTED

  std::fill(p.sink.begin(), p.sink.end(), 0);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 2).ok());
  done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CheckLanded(p, spans);
  CHECK(p.self->gathers_sent() == 2);  // that memory is read with gets from now on
}

TEST_CASE("a gather outside the target's registration fails; the target keeps serving",
          "[transport][ucx][gather]") {
  Pair p(kMiB);
  // A descriptor claiming twice the registered length (a peer's bug, or memory since shrunk):
  // the requester's own range check passes, the target's refuses.
  auto d = DecodeDescriptor(p.source_memory->descriptor(), WireBackend::kUcx);
  REQUIRE(d.ok());
  d->length *= 2;
  auto forged = p.endpoint->ImportRemote(EncodeDescriptor(*d));
  REQUIRE(forged.ok());
  std::vector<Span> beyond = {{0, 0, 4096}, {4096, kMiB + 4096, 4096}};
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, **forged, beyond, 1).ok());
  std::vector<Completion> done = p.Wait(1);
  INFO(done[0].status.ToString());
  CHECK(absl::IsInvalidArgument(done[0].status));
  CHECK(p.endpoint->status().ok());

  const std::vector<Span> spans = Columns(256, 4096);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 2).ok());
  done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CheckLanded(p, spans);
  forged->reset();
}

TEST_CASE("a reply after its endpoint closed is dropped: the op reported CANCELLED, no byte lands",
          "[transport][ucx][gather]") {
  Pair p(4 * kMiB);
  // Wire the connection up first, so the gather goes out at once.
  REQUIRE(p.endpoint->PostGet(*p.sink_memory, 0, *p.remote, 0, 8, 1).ok());
  REQUIRE(p.Wait(1)[0].status.ok());
  std::fill(p.sink.begin(), p.sink.end(), 0);

  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, Columns(512, 4096), 2).ok());
  p.remote.reset();
  p.endpoint.reset();  // the target hasn't polled: its reply is still to come
  std::vector<Completion> got, ignored;
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (got.empty() && Clock::now() < deadline) p.self->Poll(&got);
  REQUIRE(got.size() == 1);
  INFO(got[0].status.ToString());
  CHECK(absl::IsCancelled(got[0].status));
  // Now the target serves it; the reply arrives and must be dropped.
  const uint64_t served = p.target->gathers_served();
  const auto until = Clock::now() + std::chrono::milliseconds(500);
  while (Clock::now() < until) {
    p.target->Poll(&ignored);
    p.self->Poll(&got);
  }
  CHECK(got.size() == 1);
  INFO("served " << p.target->gathers_served() - served << " after the close");
  CHECK(std::all_of(p.sink.begin(), p.sink.end(), [](uint8_t b) { return b == 0; }));
}

}  // namespace
}  // namespace refit::transport
