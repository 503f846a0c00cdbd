// Behaviour specific to the in-process backend: its fault injection and its use from several
// threads (several "daemons" in one test process). The common contract is in the conformance
// suite (inproc_conformance_test).

#include "daemon/transport/inproc/inproc_transport.h"

#include <atomic>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"

namespace refit::transport {
namespace {

struct Node {
  explicit Node(size_t size, uint8_t fill = 0)
      : transport(InprocTransport::Create()), bytes(size, fill) {
    auto m = transport->RegisterMemory(bytes.data(), bytes.size(), MemoryKind::kHost);
    REQUIRE(m.ok());
    memory = *std::move(m);
  }
  ~Node() { memory.reset(); }
  std::unique_ptr<InprocTransport> transport;
  std::vector<uint8_t> bytes;
  std::unique_ptr<LocalMemory> memory;
};

TEST_CASE("max_ops_per_poll keeps ops in flight across polls", "[transport][inproc]") {
  Node a(1024), b(1024, 0xab);
  a.transport->set_max_ops_per_poll(2);
  auto ep = a.transport->Connect(b.transport->LocalAddress());
  REQUIRE(ep.ok());
  auto remote = (*ep)->ImportRemote(b.memory->descriptor());
  REQUIRE(remote.ok());
  for (uint64_t i = 0; i < 5; ++i) {
    REQUIRE((*ep)->PostGet(*a.memory, i * 100, **remote, i * 100, 100, i).ok());
  }
  std::vector<Completion> out;
  CHECK(a.transport->Poll(&out) == 2);
  CHECK((*ep)->outstanding() == 3);
  CHECK(a.transport->Poll(&out) == 2);
  CHECK(a.transport->Poll(&out) == 1);
  REQUIRE(out.size() == 5);
  for (uint64_t i = 0; i < 5; ++i) {
    CHECK(out[i].cookie == i);  // in posting order
    CHECK(out[i].status.ok());
  }
  CHECK(a.bytes[499] == 0xab);
  CHECK(a.bytes[500] == 0);
  remote->reset();
  ep->reset();
}

TEST_CASE("FailEndpoint fails only that endpoint", "[transport][inproc]") {
  Node a(64), b(64, 1);
  auto ep1 = a.transport->Connect(b.transport->LocalAddress());
  auto ep2 = a.transport->Connect(b.transport->LocalAddress());
  REQUIRE(ep1.ok());
  REQUIRE(ep2.ok());
  auto r1 = (*ep1)->ImportRemote(b.memory->descriptor());
  auto r2 = (*ep2)->ImportRemote(b.memory->descriptor());
  REQUIRE(r1.ok());
  REQUIRE(r2.ok());
  int failures = 0;
  (*ep1)->SetFailureHandler([&](const absl::Status& s) {
    ++failures;
    CHECK(absl::IsUnavailable(s));
  });
  REQUIRE((*ep1)->PostGet(*a.memory, 0, **r1, 0, 8, 1).ok());
  REQUIRE((*ep2)->PostGet(*a.memory, 8, **r2, 8, 8, 2).ok());
  a.transport->FailEndpoint(**ep1);
  std::vector<Completion> out;
  a.transport->Poll(&out);
  REQUIRE(out.size() == 2);
  std::map<uint64_t, absl::Status> by_cookie;
  for (auto& c : out) by_cookie[c.cookie] = c.status;
  CHECK(absl::IsUnavailable(by_cookie[1]));
  CHECK(by_cookie[2].ok());
  CHECK(failures == 1);
  CHECK(absl::IsUnavailable((*ep1)->PostGet(*a.memory, 0, **r1, 0, 8, 3)));
  CHECK((*ep2)->status().ok());
  r1->reset();
  r2->reset();
  ep1->reset();
  ep2->reset();
}

TEST_CASE("a destroyed or unknown peer is UNAVAILABLE, not a crash", "[transport][inproc]") {
  Node a(64);
  std::string gone_address, gone_descriptor;
  {
    Node b(64);
    gone_address = b.transport->LocalAddress();
    gone_descriptor = b.memory->descriptor();
  }
  auto ep = a.transport->Connect(gone_address);
  REQUIRE(ep.ok());  // like UCX: connecting doesn't wait for the peer
  auto remote = (*ep)->ImportRemote(gone_descriptor);
  REQUIRE(remote.ok());
  REQUIRE((*ep)->PostGet(*a.memory, 0, **remote, 0, 8, 1).ok());
  std::vector<Completion> out;
  a.transport->Poll(&out);
  REQUIRE(out.size() == 1);
  CHECK(absl::IsUnavailable(out[0].status));
  CHECK(absl::IsUnavailable((*ep)->status()));
  remote->reset();
  ep->reset();
}

TEST_CASE("a deregistered remote region is FAILED_PRECONDITION", "[transport][inproc]") {
  Node a(64), b(64);
  auto ep = a.transport->Connect(b.transport->LocalAddress());
  REQUIRE(ep.ok());
  auto remote = (*ep)->ImportRemote(b.memory->descriptor());
  REQUIRE(remote.ok());
  b.memory.reset();
  REQUIRE((*ep)->PostGet(*a.memory, 0, **remote, 0, 8, 1).ok());
  std::vector<Completion> out;
  a.transport->Poll(&out);
  REQUIRE(out.size() == 1);
  CHECK(out[0].status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK((*ep)->status().ok());
  remote->reset();
  ep->reset();
}

TEST_CASE("transports on different threads move data concurrently", "[transport][inproc]") {
  constexpr int kNodes = 4;
  constexpr size_t kSize = 1 << 16;
  std::vector<std::unique_ptr<Node>> nodes;
  for (int i = 0; i < kNodes; ++i) nodes.push_back(std::make_unique<Node>(kSize, uint8_t(i + 1)));
  std::vector<std::string> addresses, descriptors;
  for (auto& n : nodes) {
    addresses.push_back(n->transport->LocalAddress());
    descriptors.push_back(n->memory->descriptor());
  }
  // Each node reads a slice from every other node on its own thread, polling all the while.
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < kNodes; ++i) {
    threads.emplace_back([&, i] {
      Node& self = *nodes[i];
      std::vector<std::unique_ptr<Endpoint>> eps;
      std::vector<std::unique_ptr<RemoteMemory>> remotes;
      const size_t slice = kSize / kNodes;
      size_t posted = 0;
      for (int round = 0; round < 50; ++round) {
        for (int j = 0; j < kNodes; ++j) {
          if (j == i) continue;
          if (round == 0) {
            eps.push_back(*self.transport->Connect(addresses[j]));
            remotes.push_back(*eps.back()->ImportRemote(descriptors[j]));
          }
          size_t k = j < i ? j : j - 1;
          if (!eps[k]
                   ->PostGet(*self.memory, j * slice, *remotes[k], j * slice, slice, posted++)
                   .ok()) {
            ++failures;
          }
        }
      }
      std::vector<Completion> out;
      while (out.size() < posted) self.transport->Poll(&out);
      for (auto& c : out) failures += c.status.ok() ? 0 : 1;
      for (int j = 0; j < kNodes; ++j) {
        if (j == i) continue;
        for (size_t b = j * slice; b < (j + 1) * slice; ++b) {
          if (self.bytes[b] != uint8_t(j + 1)) {
            ++failures;
            break;
          }
        }
      }
      remotes.clear();
      eps.clear();
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
}

}  // namespace
}  // namespace refit::transport
