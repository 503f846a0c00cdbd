// Client memory that goes away under refitd: a trainer or engine truncates (or unlinks and
// shrinks) the shm object it registered. The call that touches it answers FAILED_PRECONDITION
// naming the buffer; the daemon keeps running and every other model is untouched (issue 17).

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using testing::DaemonProcess;

constexpr int64_t kRows = 256, kCols = 1024;  // bf16: 512 KiB
constexpr uint64_t kBytes = kRows * kCols * 2;

SharedMemory Make(const std::string& tag) {
  auto shm = SharedMemory::Create(testing::UniqueShmName(tag), kBytes);
  REQUIRE(shm.ok());
  std::memset(shm->data(), 0x3c, kBytes);
  return std::move(shm).value();
}

// Shrinks the shm object under its mappings: to 4 KiB, or (unlink) after removing its name.
void Shrink(const SharedMemory& shm, bool unlink_first) {
  const int fd = shm_open(shm.name().c_str(), O_RDWR, 0);
  REQUIRE(fd >= 0);
  if (unlink_first) shm_unlink(shm.name().c_str());
  REQUIRE(ftruncate(fd, 4096) == 0);
  close(fd);
}

// A healthy model on the same daemon, checked after every bad call.
struct Bystander {
  explicit Bystander(client::Client& c) : client(c), src(Make("by-src")), dst(Make("by-dst")) {
    auto s = c.RegisterBuffer("bystander", v1::SOURCE, src.name(),
                              {Slice("w", v1::BF16, {kRows, kCols}, 0)}, "bystander-trainer");
    auto d = c.RegisterBuffer("bystander", v1::DESTINATION, dst.name(),
                              {Slice("w", v1::BF16, {kRows, kCols}, 0)}, "bystander-engine");
    REQUIRE(s.ok());
    REQUIRE(d.ok());
    source = *s;
    destination = *d;
  }
  void Check() {
    ++version;
    std::memset(src.data(), static_cast<int>(version & 0xff), kBytes);
    REQUIRE(client.Publish("bystander", version, {source}).ok());
    auto applied = client.Apply("bystander", version, {destination});
    REQUIRE(applied.ok());
    REQUIRE(std::memcmp(src.data(), dst.data(), kBytes) == 0);
  }
  client::Client& client;
  SharedMemory src, dst;
  std::string source, destination;
  uint64_t version = 0;
};

}  // namespace

TEST_CASE("truncated or unlinked client memory: FAILED_PRECONDITION, the daemon lives on",
          "[integration][trust]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  Bystander bystander(client);
  for (int round = 0; round < 100; ++round) {
    INFO("round " << round);
    const bool unlink_first = round % 2 == 1;
    const std::string model = "m" + std::to_string(round);
    // A source shrunk before Publish.
    SharedMemory src = Make("trunc-src");
    auto s = client.RegisterBuffer(model, v1::SOURCE, src.name(),
                                   {Slice("w", v1::BF16, {kRows, kCols}, 0)}, "trainer");
    REQUIRE(s.ok());
    Shrink(src, unlink_first);
    auto published = client.Publish(model, 1, {*s});
    REQUIRE(published.status().code() == absl::StatusCode::kFailedPrecondition);
    REQUIRE(std::string(published.status().message()).find(*s) != std::string::npos);
    // Nothing was published, and it stays refused.
    REQUIRE(client.Publish(model, 2, {*s}).status().code() ==
            absl::StatusCode::kFailedPrecondition);
    REQUIRE(client.ReleaseBuffer(*s).ok());
    // A destination shrunk before Apply.
    SharedMemory good = Make("good-src");
    SharedMemory dst = Make("trunc-dst");
    auto s2 = client.RegisterBuffer(model, v1::SOURCE, good.name(),
                                    {Slice("w", v1::BF16, {kRows, kCols}, 0)}, "trainer");
    auto d = client.RegisterBuffer(model, v1::DESTINATION, dst.name(),
                                   {Slice("w", v1::BF16, {kRows, kCols}, 0)}, "engine");
    REQUIRE(s2.ok());
    REQUIRE(d.ok());
    REQUIRE(client.Publish(model, 3, {*s2}).ok());
    Shrink(dst, unlink_first);
    auto applied = client.Apply(model, 3, {*d});
    REQUIRE(applied.status().code() == absl::StatusCode::kFailedPrecondition);
    REQUIRE(std::string(applied.status().message()).find(*d) != std::string::npos);
    REQUIRE((*daemon)->running());
    REQUIRE(client.ReleaseBuffer(*d).ok());
    REQUIRE(client.ReleaseBuffer(*s2).ok());
    if (round % 10 == 0) bystander.Check();
  }
  bystander.Check();
  auto status = client.Status();
  REQUIRE(status.ok());
  REQUIRE((*daemon)->running());
}

}  // namespace refit
