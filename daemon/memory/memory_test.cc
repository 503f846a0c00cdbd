#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "catch2/catch.hpp"
#include "daemon/memory/region.h"
#include "daemon/memory/slot_pool.h"

namespace refit {
namespace {

// A shm object created for one test and unlinked after it.
struct TestShm {
  explicit TestShm(uint64_t size) {
    name = "/refit-memtest-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, static_cast<off_t>(size)) == 0);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    REQUIRE(p != MAP_FAILED);
    close(fd);
    data = static_cast<uint8_t*>(p);
    length = size;
  }
  ~TestShm() {
    munmap(data, length);
    shm_unlink(name.c_str());
  }
  static inline int counter = 0;
  std::string name;
  uint8_t* data;
  uint64_t length;
};

TEST_CASE("MapHostShm maps the requested window of a shared-memory object", "[memory]") {
  TestShm shm(3 * 4096 + 100);
  for (uint64_t i = 0; i < shm.length; ++i) shm.data[i] = static_cast<uint8_t>(i * 7);

  auto region = MapHostShm(shm.name, 5000, 6000);
  REQUIRE(region.ok());
  CHECK((*region)->kind() == MemoryKind::kHost);
  CHECK((*region)->size() == 6000);
  CHECK((*region)->data()[0] == static_cast<uint8_t>(5000 * 7));
  (*region)->data()[10] = 0xAB;  // writes reach the client's mapping
  CHECK(shm.data[5010] == 0xAB);

  auto whole = MapHostShm(shm.name, 100, 0);
  REQUIRE(whole.ok());
  CHECK((*whole)->size() == shm.length - 100);
}

TEST_CASE("MapHostShm rejects missing objects, bad names and windows past the end", "[memory]") {
  TestShm shm(4096);
  CHECK(MapHostShm("/refit-does-not-exist-xyz", 0, 16).status().code() ==
        absl::StatusCode::kNotFound);
  CHECK(MapHostShm("no-slash", 0, 16).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm("/a/b", 0, 16).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm(shm.name, 0, 4097).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm(shm.name, 4000, 97).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm(shm.name, 5000, 0).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm(shm.name, 4000, 96).ok());
}

TEST_CASE("SlotPool reuses released slots up to its spare limit", "[memory]") {
  auto pool = SlotPool::Create(/*max_spare_bytes=*/10000);
  uint8_t* first_data = nullptr;
  {
    auto slot = pool->Acquire(8000);
    REQUIRE(slot.ok());
    first_data = (*slot)->data();
    std::memset(first_data, 1, 8000);
  }
  CHECK(pool->spare_bytes() == 8000);
  auto again = pool->Acquire(8000);
  REQUIRE(again.ok());
  CHECK((*again)->data() == first_data);
  CHECK(pool->spare_bytes() == 0);

  { auto big = pool->Acquire(20000); REQUIRE(big.ok()); }
  CHECK(pool->spare_bytes() == 0);  // too big to keep
}

TEST_CASE("Slots outlive their pool", "[memory]") {
  std::shared_ptr<Region> slot;
  {
    auto pool = SlotPool::Create(1 << 20);
    auto acquired = pool->Acquire(4096);
    REQUIRE(acquired.ok());
    slot = *acquired;
  }
  slot->data()[4095] = 1;
  CHECK(slot->size() == 4096);
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE("SlotPool::Reserve pre-allocates spare slots within the limit", "[memory]") {
  auto pool = SlotPool::Create(3 * 4096);
  REQUIRE(pool->Reserve(4096, 2).ok());
  CHECK(pool->spare_bytes() == 2 * 4096);
  REQUIRE(pool->Reserve(4096, 5).ok());  // capped by the limit
  CHECK(pool->spare_bytes() == 3 * 4096);
  auto slot = pool->Acquire(4096);
  REQUIRE(slot.ok());
  CHECK(pool->spare_bytes() == 2 * 4096);
}

}  // namespace
}  // namespace refit
