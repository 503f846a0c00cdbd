// The backend-independent Transport cases in one process; see transport_conformance.h.

#include "daemon/transport/testing/transport_conformance.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/transport/testing/conformance_testing.h"

namespace refit::transport::testing {
namespace {

// A transport A and a transport B in this process; B serves a pattern-filled buffer, A has an
// endpoint to B and B's buffer imported.
struct Pair {
  explicit Pair(uint64_t size, uint64_t seed = 7)
      : a(MakeTransport()), b(MakeTransport()), a_buffer(size), b_buffer(size) {
    FillPattern(b_buffer.data(), size, seed, 0);
    a_memory = Register(*a, a_buffer);
    b_memory = Register(*b, b_buffer);
    endpoint = ConnectTo(*a, b->LocalAddress());
    remote = Import(*endpoint, b_memory->descriptor());
    WireUp(*a, *b, *endpoint, *a_memory, *remote);
  }
  ~Pair() {
    remote.reset();
    endpoint.reset();
    Settle({a.get(), b.get()});
    a_memory.reset();
    b_memory.reset();
  }
  std::unique_ptr<Transport> a, b;
  Buffer a_buffer, b_buffer;
  std::unique_ptr<LocalMemory> a_memory, b_memory;
  std::unique_ptr<Endpoint> endpoint;
  std::unique_ptr<RemoteMemory> remote;
};

TEST_CASE("transport reports capabilities and a distinct address", "[transport][conformance]") {
  auto a = MakeTransport();
  auto b = MakeTransport();
  INFO(TestBackend().name << ": " << a->capabilities().detail);
  CHECK_FALSE(a->capabilities().name.empty());
  CHECK(a->capabilities().rma_get);
  // rma_put is optional: a backend with checked reads lets no peer write (transport.h).
  CHECK_FALSE(a->LocalAddress().empty());
  CHECK(a->LocalAddress() != b->LocalAddress());
  CHECK(a->outstanding() == 0);
}

TEST_CASE("RegisterMemory validates its input", "[transport][conformance]") {
  auto t = MakeTransport();
  Buffer buffer(4096);
  CHECK(t->RegisterMemory(nullptr, 4096, MemoryKind::kHost).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(t->RegisterMemory(buffer.data(), 0, MemoryKind::kHost).status().code() ==
        absl::StatusCode::kInvalidArgument);
  if (!t->capabilities().cuda_memory) {
    CHECK(t->RegisterMemory(buffer.data(), 4096, MemoryKind::kCuda).status().code() ==
          absl::StatusCode::kUnimplemented);
  }
  auto memory = Register(*t, buffer);
  CHECK(memory->address() == buffer.data());
  CHECK(memory->length() == 4096);
  CHECK(memory->kind() == MemoryKind::kHost);
  CHECK_FALSE(memory->descriptor().empty());
}

TEST_CASE("AllocateMemory gives registered memory that outlives the transport",
          "[transport][conformance]") {
  std::unique_ptr<LocalMemory> kept;
  {
    auto t = MakeTransport();
    CHECK(t->AllocateMemory(0).status().code() == absl::StatusCode::kInvalidArgument);
    auto memory = t->AllocateMemory(3 * kMiB + 5);
    INFO(memory.status().ToString());
    REQUIRE(memory.ok());
    CHECK((*memory)->length() == 3 * kMiB + 5);
    CHECK((*memory)->kind() == MemoryKind::kHost);
    CHECK(!(*memory)->descriptor().empty());
    CHECK(reinterpret_cast<uintptr_t>((*memory)->address()) % 4096 == 0);
    std::memset((*memory)->address(), 0x5a, (*memory)->length());
    kept = std::move(memory).value();
  }
  // The transport is gone; the memory is still there and is freed last.
  CHECK(static_cast<const uint8_t*>(kept->address())[3 * kMiB + 4] == 0x5a);
  kept.reset();
}

TEST_CASE("get copies remote bytes exactly, many ops in flight", "[transport][conformance]") {
  const uint64_t size = 8 * kMiB + 13;
  Pair p(size);
  CHECK(p.remote->length() == size);
  struct Case {
    uint64_t offset, length, chunk;
    size_t window;
  };
  const Case cases[] = {{0, 1, 1, 1},
                        {5, 7, 3, 4},
                        {4093, 4096, 4096, 2},
                        {100, 65537, 1000, 64},
                        {kMiB - 1, kMiB + 3, 64 * 1024, 32},
                        {0, size, 256 * 1024, 16}};
  for (const Case& c : cases) {
    INFO("offset " << c.offset << " length " << c.length << " chunk " << c.chunk);
    std::memset(p.a_buffer.data(), 0, size);
    absl::Status s = Transfer(true, *p.a, {p.b.get()}, *p.endpoint, *p.a_memory, c.offset,
                              *p.remote, c.offset, c.length, c.chunk, c.window);
    INFO(s.ToString());
    REQUIRE(s.ok());
    CHECK(FindPatternMismatch(p.a_buffer.data() + c.offset, c.length, 7, c.offset) == -1);
    // Nothing outside the window was touched.
    CHECK(std::all_of(p.a_buffer.data(), p.a_buffer.data() + c.offset,
                      [](uint8_t x) { return x == 0; }));
    CHECK(std::all_of(p.a_buffer.data() + c.offset + c.length, p.a_buffer.data() + size,
                      [](uint8_t x) { return x == 0; }));
  }
  CHECK(p.endpoint->outstanding() == 0);
  CHECK(p.a->outstanding() == 0);
  CHECK(p.endpoint->status().ok());
}

TEST_CASE("the target counts the bytes a peer's gets read from it", "[transport][conformance]") {
  // Memory registered by its owner is never mapped by a peer: every backend serves these reads
  // itself (a data plane judges how fast a relay moves bytes by this count).
  const uint64_t size = 3 * kMiB + 7;
  Pair p(size);
  const uint64_t a_served = p.a->bytes_served();
  const uint64_t b_served = p.b->bytes_served();
  absl::Status s = Transfer(true, *p.a, {p.b.get()}, *p.endpoint, *p.a_memory, 0, *p.remote, 0,
                            size, 256 * 1024, 8);
  INFO(s.ToString());
  REQUIRE(s.ok());
  Settle({p.a.get(), p.b.get()});  // a backend may count a reply once its send completes
  CHECK(p.b->bytes_served() - b_served == size);
  CHECK(p.a->bytes_served() == a_served);  // the reader served nothing
}

TEST_CASE("PostGetSpans moves many short ranges as one op", "[transport][conformance]") {
  Pair p(4 * kMiB, 11);
  CheckColumnSpans(*p.a, {p.b.get()}, *p.endpoint, *p.a_memory, p.a_buffer, *p.remote, 11);
}

TEST_CASE("get into a different local offset", "[transport][conformance]") {
  Pair p(kMiB);
  absl::Status s = Transfer(true, *p.a, {p.b.get()}, *p.endpoint, *p.a_memory, 0, *p.remote, 4096,
                            8192, 1024, 8);
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(p.a_buffer.data(), 8192, 7, 4096) == -1);
}

TEST_CASE("put writes remote bytes exactly", "[transport][conformance]") {
  const uint64_t size = 4 * kMiB + 5;
  Pair p(size);
  if (!p.a->capabilities().rma_put) {  // refused, and nothing lands
    CHECK(p.endpoint->PostPut(*p.a_memory, 0, *p.remote, 0, 8, 1).code() ==
          absl::StatusCode::kUnimplemented);
    CHECK(p.endpoint->outstanding() == 0);
    CHECK(FindPatternMismatch(p.b_buffer.data(), size, 7, 0) == -1);
    return;
  }
  FillPattern(p.a_buffer.data(), size, 99, 0);
  absl::Status s = Transfer(false, *p.a, {p.b.get()}, *p.endpoint, *p.a_memory, 3, *p.remote, 3,
                            size - 10, 128 * 1024, 16);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(p.b_buffer.data() + 3, size - 10, 99, 3) == -1);
  CHECK(FindPatternMismatch(p.b_buffer.data(), 3, 7, 0) == -1);  // untouched head
  CHECK(FindPatternMismatch(p.b_buffer.data() + size - 7, 7, 7, size - 7) == -1);
}

TEST_CASE("completions come only from Poll, once per op", "[transport][conformance]") {
  Pair p(64 * 1024);
  const uint64_t c1 = NextCookie(), c2 = NextCookie();
  REQUIRE(p.endpoint->PostGet(*p.a_memory, 0, *p.remote, 0, 4096, c1).ok());
  REQUIRE(p.endpoint->PostGet(*p.a_memory, 4096, *p.remote, 4096, 0, c2).ok());  // zero bytes
  CHECK(p.endpoint->outstanding() == 2);
  CHECK(p.a->outstanding() == 2);
  Results results;
  PollUntil(*p.a, {p.b.get()}, &results, 2);
  CHECK(results[c1].ok());
  CHECK(results[c2].ok());
  CHECK(p.endpoint->outstanding() == 0);
  CHECK(p.a->outstanding() == 0);
  // Nothing more arrives.
  std::vector<Completion> more;
  for (int i = 0; i < 100; ++i) p.a->Poll(&more);
  CHECK(more.empty());
}

TEST_CASE("bad ranges and foreign handles are refused without a completion",
          "[transport][conformance]") {
  Pair p(64 * 1024);
  auto other = MakeTransport();
  Buffer other_buffer(64 * 1024);
  auto other_memory = Register(*other, other_buffer);
  auto second_endpoint = ConnectTo(*p.a, p.b->LocalAddress());
  auto second_remote = Import(*second_endpoint, p.b_memory->descriptor());
  WireUp(*p.a, *p.b, *second_endpoint, *p.a_memory, *second_remote);
  const uint64_t kMax = ~uint64_t{0};
  auto code = [](const absl::Status& s) { return s.code(); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  Endpoint& e = *p.endpoint;
  CHECK(code(e.PostGet(*p.a_memory, 0, *p.remote, 0, 64 * 1024 + 1, 1)) == kInvalid);
  CHECK(code(e.PostGet(*p.a_memory, 1, *p.remote, 0, 64 * 1024, 2)) == kInvalid);
  CHECK(code(e.PostGet(*p.a_memory, 0, *p.remote, 1, 64 * 1024, 3)) == kInvalid);
  CHECK(code(e.PostGet(*p.a_memory, kMax, *p.remote, 0, 2, 4)) == kInvalid);
  CHECK(code(e.PostGet(*p.a_memory, 0, *p.remote, kMax, 2, 5)) == kInvalid);
  const auto put_refused =
      p.a->capabilities().rma_put ? kInvalid : absl::StatusCode::kUnimplemented;
  CHECK(code(e.PostPut(*p.a_memory, 8, *p.remote, 8, kMax - 4, 6)) == put_refused);
  CHECK(code(e.PostGet(*other_memory, 0, *p.remote, 0, 8, 7)) == kInvalid);
  CHECK(code(e.PostGet(*p.a_memory, 0, *second_remote, 0, 8, 8)) == kInvalid);
  CHECK(code(e.PostPut(*p.a_memory, 0, *second_remote, 0, 8, 9)) == kInvalid);  // foreign first
  // A descriptor issued by a transport other than the endpoint's peer.
  CHECK(code(e.ImportRemote(other_memory->descriptor()).status()) == kInvalid);
  CHECK(e.outstanding() == 0);
  std::vector<Completion> completions;
  for (int i = 0; i < 50; ++i) p.a->Poll(&completions);
  CHECK(completions.empty());
  CHECK(e.status().ok());
  second_remote.reset();
  second_endpoint.reset();
  other_memory.reset();
}

TEST_CASE("malformed descriptors and addresses are INVALID_ARGUMENT, never a crash",
          "[transport][conformance]") {
  Pair p(4096);
  const std::string descriptor = p.b_memory->descriptor();
  const std::string address = p.b->LocalAddress();
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  for (size_t n = 0; n < descriptor.size(); ++n) {
    INFO("descriptor truncated to " << n);
    CHECK(p.endpoint->ImportRemote(descriptor.substr(0, n)).status().code() == kInvalid);
  }
  for (size_t i = 0; i < descriptor.size(); ++i) {
    std::string bad = descriptor;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    INFO("descriptor byte " << i << " flipped");
    CHECK(p.endpoint->ImportRemote(bad).status().code() == kInvalid);
  }
  CHECK(p.endpoint->ImportRemote(descriptor + "x").status().code() == kInvalid);
  CHECK(p.endpoint->ImportRemote(std::string(200, '\xff')).status().code() == kInvalid);
  CHECK(p.endpoint->ImportRemote(address).status().code() == kInvalid);  // wrong kind of bytes

  for (size_t n = 0; n < address.size(); ++n) {
    INFO("address truncated to " << n);
    CHECK(p.a->Connect(address.substr(0, n)).status().code() == kInvalid);
  }
  for (size_t i = 0; i < address.size(); ++i) {
    std::string bad = address;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    INFO("address byte " << i << " flipped");
    CHECK(p.a->Connect(bad).status().code() == kInvalid);
  }
  CHECK(p.a->Connect(descriptor).status().code() == kInvalid);
  // The endpoint still works after all that.
  absl::Status s =
      Transfer(true, *p.a, {p.b.get()}, *p.endpoint, *p.a_memory, 0, *p.remote, 0, 4096, 4096, 1);
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(p.a_buffer.data(), 4096, 7, 0) == -1);
}

TEST_CASE("Cancel reports outstanding ops CANCELLED and the endpoint stays usable",
          "[transport][conformance]") {
  const uint64_t size = 4 * kMiB;
  Pair p(size);
  std::vector<uint64_t> cookies;
  for (uint64_t off = 0; off < size; off += 64 * 1024) {
    cookies.push_back(NextCookie());
    REQUIRE(p.endpoint->PostGet(*p.a_memory, off, *p.remote, off, 64 * 1024, cookies.back()).ok());
  }
  p.endpoint->Cancel();
  Results results;
  PollUntil(*p.a, {p.b.get()}, &results, cookies.size());
  for (uint64_t cookie : cookies) {
    INFO(results[cookie].ToString());
    CHECK(absl::IsCancelled(results[cookie]));
  }
  CHECK(p.endpoint->status().ok());
  CHECK(p.endpoint->outstanding() == 0);
  std::memset(p.a_buffer.data(), 0, size);
  absl::Status s = Transfer(true, *p.a, {p.b.get()}, *p.endpoint, *p.a_memory, 0, *p.remote, 0,
                            size, 256 * 1024, 8);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(p.a_buffer.data(), size, 7, 0) == -1);
}

TEST_CASE("Cancel or close on one side leaves the peer's own endpoint to us working",
          "[transport][conformance]") {
  const uint64_t size = kMiB;
  Pair p(size);
  Buffer a_exported(size);
  FillPattern(a_exported.data(), size, 13, 0);
  auto a_exported_memory = Register(*p.a, a_exported);
  auto back = ConnectTo(*p.b, p.a->LocalAddress());  // B's own connection to A
  auto back_remote = Import(*back, a_exported_memory->descriptor());
  REQUIRE(Transfer(true, *p.b, {p.a.get()}, *back, *p.b_memory, 0, *back_remote, 0, 4096, 4096, 1)
              .ok());
  std::vector<uint64_t> cookies;
  for (uint64_t off = 0; off < size; off += 64 * 1024) {
    cookies.push_back(NextCookie());
    REQUIRE(p.endpoint->PostGet(*p.a_memory, off, *p.remote, off, 64 * 1024, cookies.back()).ok());
  }
  p.endpoint->Cancel();
  Results results;
  PollUntil(*p.a, {p.b.get()}, &results, cookies.size());
  Settle({p.a.get(), p.b.get()});
  CHECK(back->status().ok());
  absl::Status s =
      Transfer(true, *p.b, {p.a.get()}, *back, *p.b_memory, 0, *back_remote, 0, size, 64 * 1024, 8);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(p.b_buffer.data(), size, 13, 0) == -1);
  // Closing A's endpoint to B doesn't break B's endpoint to A either.
  p.remote.reset();
  p.endpoint.reset();
  Settle({p.a.get(), p.b.get()});
  CHECK(back->status().ok());
  std::memset(p.b_buffer.data(), 0, size);
  s = Transfer(true, *p.b, {p.a.get()}, *back, *p.b_memory, 0, *back_remote, 0, size, 64 * 1024, 8);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(p.b_buffer.data(), size, 13, 0) == -1);
  back_remote.reset();
  back.reset();
  Settle({p.a.get(), p.b.get()});
  a_exported_memory.reset();
}

TEST_CASE("destroying an endpoint still reports each of its ops", "[transport][conformance]") {
  const uint64_t size = 2 * kMiB;
  Pair p(size);
  std::vector<uint64_t> cookies;
  for (uint64_t off = 0; off < size; off += 128 * 1024) {
    cookies.push_back(NextCookie());
    REQUIRE(p.endpoint->PostGet(*p.a_memory, off, *p.remote, off, 128 * 1024, cookies.back()).ok());
  }
  p.remote.reset();
  p.endpoint.reset();
  Results results;
  PollUntil(*p.a, {p.b.get()}, &results, cookies.size());
  for (uint64_t cookie : cookies) {
    INFO(results[cookie].ToString());
    CHECK(absl::IsCancelled(results[cookie]));
  }
  CHECK(p.a->outstanding() == 0);
}

TEST_CASE("memory handles may be destroyed while their ops are in flight",
          "[transport][conformance]") {
  const uint64_t size = 2 * kMiB;
  Pair p(size);
  std::vector<uint64_t> cookies;
  for (uint64_t off = 0; off < size; off += 256 * 1024) {
    cookies.push_back(NextCookie());
    REQUIRE(p.endpoint->PostGet(*p.a_memory, off, *p.remote, off, 256 * 1024, cookies.back()).ok());
  }
  p.remote.reset();
  p.a_memory.reset();  // the buffer itself stays alive
  Results results;
  PollUntil(*p.a, {p.b.get()}, &results, cookies.size());
  for (uint64_t cookie : cookies) {
    INFO(results[cookie].ToString());
    CHECK(results[cookie].ok());
  }
  CHECK(FindPatternMismatch(p.a_buffer.data(), size, 7, 0) == -1);
}

TEST_CASE("a crashed peer fails outstanding and later ops with UNAVAILABLE",
          "[transport][conformance][failure]") {
  if (!TestBackend().crash) {
    WARN(TestBackend().name << " has no in-process crash; the cross-process cases cover it");
    return;
  }
  const uint64_t size = kMiB;
  Pair p(size);
  auto c = MakeTransport();
  Buffer c_buffer(size);
  FillPattern(c_buffer.data(), size, 11, 0);
  auto c_memory = Register(*c, c_buffer);
  auto c_endpoint = ConnectTo(*p.a, c->LocalAddress());
  auto c_remote = Import(*c_endpoint, c_memory->descriptor());

  int handler_calls = 0;
  absl::Status handler_status;
  p.endpoint->SetFailureHandler([&](const absl::Status& s) {
    ++handler_calls;
    handler_status = s;
  });
  std::vector<uint64_t> cookies;
  for (uint64_t off = 0; off < size; off += 64 * 1024) {
    cookies.push_back(NextCookie());
    REQUIRE(p.endpoint->PostGet(*p.a_memory, off, *p.remote, off, 64 * 1024, cookies.back()).ok());
  }
  TestBackend().crash(*p.b);
  Results results;
  PollUntil(*p.a, {}, &results, cookies.size(), std::chrono::seconds(10));
  for (uint64_t cookie : cookies) {
    INFO(results[cookie].ToString());
    CHECK(absl::IsUnavailable(results[cookie]));
  }
  CHECK(absl::IsUnavailable(p.endpoint->status()));
  CHECK(handler_calls == 1);
  CHECK(absl::IsUnavailable(handler_status));
  CHECK(absl::IsUnavailable(p.endpoint->PostGet(*p.a_memory, 0, *p.remote, 0, 8, 1)));
  if (p.a->capabilities().rma_put) {
    CHECK(absl::IsUnavailable(p.endpoint->PostPut(*p.a_memory, 0, *p.remote, 0, 8, 2)));
  }
  CHECK(absl::IsUnavailable(p.endpoint->ImportRemote(p.b_memory->descriptor()).status()));
  p.endpoint->Cancel();  // a no-op on a failed endpoint
  CHECK(absl::IsUnavailable(p.endpoint->status()));
  std::vector<Completion> more;
  for (int i = 0; i < 20; ++i) p.a->Poll(&more);
  CHECK(more.empty());
  CHECK(handler_calls == 1);

  // The survivor keeps working with another peer.
  absl::Status s = Transfer(true, *p.a, {c.get()}, *c_endpoint, *p.a_memory, 0, *c_remote, 0, size,
                            64 * 1024, 8);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(FindPatternMismatch(p.a_buffer.data(), size, 11, 0) == -1);
  c_remote.reset();
  c_endpoint.reset();
  c_memory.reset();
}

}  // namespace
}  // namespace refit::transport::testing
