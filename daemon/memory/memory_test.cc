#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/memory/checksum.h"
#include "daemon/memory/region.h"
#include "daemon/memory/slot_pool.h"
#include "daemon/memory/stream_copy.h"

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

TEST_CASE("MapSealedMemfd maps only memfds sealed against shrinking", "[memory][memfd]") {
  const uint64_t size = 3 * 4096 + 100;
  auto make = [&](unsigned seals) {
    const int fd = memfd_create("memtest", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, static_cast<off_t>(size)) == 0);
    if (seals) REQUIRE(fcntl(fd, F_ADD_SEALS, seals) == 0);
    return fd;
  };
  const int sealed = make(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  REQUIRE(pwrite(sealed, "refit", 5, 5000) == 5);
  auto region = MapSealedMemfd(sealed, 5000, 6000);
  close(sealed);  // the mapping keeps the memory
  REQUIRE(region.ok());
  CHECK((*region)->size() == 6000);
  CHECK(std::memcmp((*region)->data(), "refit", 5) == 0);
  CHECK((*region)->Describe() == "host memfd memtest [5000, 11000)");
  CHECK_FALSE((*region)->Broken());

  const int unsealed = make(0);
  auto refused = MapSealedMemfd(unsealed, 0, 0);
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(refused.status().message()).find("F_SEAL_SHRINK") != std::string::npos);
  REQUIRE(fcntl(unsealed, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
  CHECK(MapSealedMemfd(unsealed, 0, 0).ok());
  CHECK(MapSealedMemfd(unsealed, size, 1).status().code() == absl::StatusCode::kInvalidArgument);
  const int read_only =
      open(("/proc/self/fd/" + std::to_string(unsealed)).c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(read_only >= 0);
  CHECK(MapSealedMemfd(read_only, 0, 0).status().code() == absl::StatusCode::kPermissionDenied);
  close(read_only);
  close(unsealed);

  const int frozen = make(F_SEAL_SHRINK | F_SEAL_WRITE);
  CHECK(MapSealedMemfd(frozen, 0, 0).status().code() == absl::StatusCode::kFailedPrecondition);
  close(frozen);
  // Not a memfd at all: nothing to seal.
  const int proc_fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
  CHECK(MapSealedMemfd(proc_fd, 0, 0).status().code() == absl::StatusCode::kFailedPrecondition);
  close(proc_fd);
}

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

  // Python's SharedMemory.name has no leading '/': the same object.
  auto unslashed = MapHostShm(shm.name.substr(1), 5000, 6000);
  REQUIRE(unslashed.ok());
  CHECK(std::memcmp((*unslashed)->data(), (*region)->data(), 6000) == 0);
  auto whole = MapHostShm(shm.name, 100, 0);
  REQUIRE(whole.ok());
  CHECK((*whole)->size() == shm.length - 100);
}

TEST_CASE("MapHostShm rejects missing objects, bad names and windows past the end", "[memory]") {
  TestShm shm(4096);
  CHECK(MapHostShm("/refit-does-not-exist-xyz", 0, 16).status().code() ==
        absl::StatusCode::kNotFound);
  CHECK(MapHostShm("refit-does-not-exist-xyz", 0, 16).status().code() ==
        absl::StatusCode::kNotFound);  // the leading '/' may be left out
  CHECK(MapHostShm("", 0, 16).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm("/", 0, 16).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm("/a/b", 0, 16).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm("/..", 0, 16).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm("..", 0, 16).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MapHostShm("/.", 0, 16).status().code() == absl::StatusCode::kInvalidArgument);
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

  {
    auto big = pool->Acquire(20000);
    REQUIRE(big.ok());
  }
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

TEST_CASE("SlotPool with a byte limit frees spare slots for room, then refuses", "[memory]") {
  std::vector<uint64_t> observed;
  auto pool =
      SlotPool::Create(/*max_spare_bytes=*/1 << 20, AllocateHost,
                       /*max_bytes=*/3 * 4096, [&](uint64_t held) { observed.push_back(held); });
  auto a = pool->Acquire(4096);
  auto b = pool->Acquire(4096);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(pool->held_bytes() == 2 * 4096);
  // 4096 + 8192 = 12288 fits exactly; 1 byte more doesn't, and changes nothing.
  auto too_big = pool->Acquire(2 * 4096 + 1);
  CHECK(too_big.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(too_big.status().message().find("--max-slot-memory") != std::string::npos);
  CHECK(pool->held_bytes() == 2 * 4096);
  // A released slot stays spare (still held) until a slot of another size needs its room.
  a->reset();
  CHECK(pool->spare_bytes() == 4096);
  CHECK(pool->held_bytes() == 2 * 4096);
  auto c = pool->Acquire(2 * 4096);
  REQUIRE(c.ok());
  CHECK(pool->spare_bytes() == 0);
  CHECK(pool->held_bytes() == 3 * 4096);
  // Reserve stays within the limit without freeing anything.
  REQUIRE(pool->Reserve(4096, 2).ok());
  CHECK(pool->spare_bytes() == 0);
  b->reset();
  c->reset();
  CHECK(pool->held_bytes() == 3 * 4096);  // spare, for reuse
  CHECK(observed.back() == 3 * 4096);
  CHECK(std::find(observed.begin(), observed.end(), 2 * 4096) != observed.end());
}

TEST_CASE("CopyAndHash copies and hashes each chunk like XXH3 over the copy", "[memory]") {
  // 40 MiB + 123 bytes: above the threaded threshold, with a short last chunk.
  const uint64_t size = (40ull << 20) + 123;
  std::vector<uint8_t> src(size);
  for (uint64_t i = 0; i < size; ++i) src[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  std::vector<uint8_t> dst(size, 0);
  const std::vector<uint64_t> sums = CopyAndHash(dst.data(), src.data(), size);
  CHECK(dst == src);
  REQUIRE(sums.size() == 11);
  for (size_t i = 0; i < sums.size(); ++i) {
    const uint64_t begin = i * kChecksumChunkBytes;
    const uint64_t n = std::min<uint64_t>(kChecksumChunkBytes, size - begin);
    CHECK(sums[i] == XXH3_64bits(src.data() + begin, n));
  }
  CHECK(HashChunks(src.data(), size) == sums);
  // A small copy on the calling thread, with an odd chunk size.
  std::vector<uint8_t> small(1000, 0);
  const auto small_sums = CopyAndHash(small.data(), src.data(), 1000, 300);
  CHECK(std::equal(small.begin(), small.end(), src.begin()));
  REQUIRE(small_sums.size() == 4);
  CHECK(small_sums[3] == XXH3_64bits(src.data() + 900, 100));
}

TEST_CASE("CopyAndHash also hashes the ranges asked for that lie inside one of its blocks",
          "[memory]") {
  constexpr uint64_t kBlock = 256 << 10;       // CopyAndHash's block
  const uint64_t size = (36ull << 20) + 4321;  // threaded, a short last chunk
  std::vector<uint8_t> src(size);
  for (uint64_t i = 0; i < size; ++i) src[i] = static_cast<uint8_t>(i * 40503u >> 7);
  // Column ranges (8 KiB of every 16 KiB), one across a block boundary, one in the short last
  // chunk, two at one begin, one empty and one past the end.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (uint64_t b = 8192; b + 8192 <= size; b += 16384) ranges.emplace_back(b, b + 8192);
  const std::pair<uint64_t, uint64_t> across{5 * kBlock - 100, 5 * kBlock + 100};
  const std::pair<uint64_t, uint64_t> tail{size - 21, size - 1};
  const std::pair<uint64_t, uint64_t> shorter{8192, 8192 + 7};
  ranges.push_back(across);
  ranges.push_back(tail);
  ranges.push_back(shorter);
  ranges.emplace_back(100, 100);
  ranges.emplace_back(size - 10, size + 10);
  std::sort(ranges.begin(), ranges.end());

  std::vector<uint8_t> dst(size, 0);
  RangeSums range_sums;
  const auto sums = CopyAndHash(dst.data(), src.data(), size, ranges, &range_sums);
  CHECK(dst == src);
  CHECK(sums == HashChunks(src.data(), size));
  auto digest = [&](std::pair<uint64_t, uint64_t> r) {
    return XXH3_64bits(src.data() + r.first, r.second - r.first);
  };
  // Every range inside a block is there with its digest; the others are not.
  CHECK(range_sums.size() == ranges.size() - 3);
  uint64_t got = 0;
  for (const auto& r : ranges) {
    const bool inside =
        r.first < r.second && r.second <= size && r.first / kBlock == (r.second - 1) / kBlock;
    INFO("range " << r.first << ".." << r.second);
    REQUIRE(range_sums.Find(r.first, r.second - r.first, &got) == inside);
    if (inside) CHECK(got == digest(r));
  }
  CHECK(range_sums.Find(tail.first, tail.second - tail.first, &got));
  CHECK(got == digest(tail));
  CHECK(range_sums.Find(shorter.first, 7, &got));  // two lengths at one begin
  CHECK(got == digest(shorter));
  CHECK_FALSE(range_sums.Find(across.first, across.second - across.first, &got));
  CHECK_FALSE(range_sums.Find(8192, 8191, &got));  // a length never asked for
  // No ranges: the same copy, nothing else.
  RangeSums none;
  CHECK(CopyAndHash(dst.data(), src.data(), size, {}, &none) == sums);
  CHECK(none.size() == 0);
}

TEST_CASE("CopyAndHashRange copies and returns the XXH3 of what it wrote", "[memory]") {
  std::vector<uint8_t> src((1 << 20) + 77);
  for (uint64_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 977 >> 3);
  // One short span, one block exactly, several blocks with a short last one, odd offsets.
  for (const auto& [offset, size] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, 8192}, {3, kCopyBlockBytes}, {5, src.size() - 5}, {11, 1}}) {
    INFO("offset " << offset << " size " << size);
    std::vector<uint8_t> dst(size + 2, 0xee);
    const uint64_t sum = CopyAndHashRange(dst.data() + 1, src.data() + offset, size);
    StoreFence();
    CHECK(sum == XXH3_64bits(src.data() + offset, size));
    CHECK(std::memcmp(dst.data() + 1, src.data() + offset, size) == 0);
    CHECK(dst.front() == 0xee);  // nothing written outside
    CHECK(dst.back() == 0xee);
  }
}

TEST_CASE("HashRanges hashes each range in order", "[memory]") {
  std::vector<uint8_t> data(64ull << 20);
  for (uint64_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i ^ (i >> 9));
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (uint64_t b = 7; b + 5000 < data.size(); b += 3ull << 20) ranges.emplace_back(b, b + 5000);
  ranges.emplace_back(0, data.size());  // one large range among many small ones
  const auto sums = HashRanges(data.data(), ranges);
  REQUIRE(sums.size() == ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    CHECK(sums[i] ==
          XXH3_64bits(data.data() + ranges[i].first, ranges[i].second - ranges[i].first));
  }
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE("SlotPool keeps an owner's spare slots only within its budget", "[memory]") {
  auto pool = SlotPool::Create(/*max_spare_bytes=*/1 << 20);
  pool->SetBudget("m", 2 * 4096);  // retain 1: the held version and the next
  REQUIRE(pool->Reserve(4096, 3, "m").ok());
  CHECK(pool->UsageOf("m").spare == 2 * 4096);  // the third is past the budget

  auto v1 = pool->Acquire(4096, "m");
  auto v2 = pool->Acquire(4096, "m");
  REQUIRE(v1.ok());
  REQUIRE(v2.ok());
  CHECK(pool->UsageOf("m").in_use == 2 * 4096);
  CHECK(pool->held_bytes() == 2 * 4096);
  // A third version in flight (a reader still holds v1) goes past the budget: nothing of it
  // is kept once released.
  auto v3 = pool->Acquire(4096, "m");
  REQUIRE(v3.ok());
  v1->reset();
  CHECK(pool->UsageOf("m").spare == 0);
  CHECK(pool->held_bytes() == 2 * 4096);
  v2->reset();  // v3 held, v2's slot kept for the next one
  CHECK(pool->UsageOf("m").spare == 4096);
  CHECK(pool->held_bytes() == 2 * 4096);

  // A slot acquired for no owner (a pull's staging) takes the owner's spare and is handed to
  // it once the version completes.
  auto staging = pool->Acquire(4096);
  REQUIRE(staging.ok());
  CHECK(pool->UsageOf("m").spare == 0);
  CHECK(pool->UsageOf("").in_use == 4096);
  pool->Adopt(staging->get(), "m");
  CHECK(pool->UsageOf("").in_use == 0);
  CHECK(pool->UsageOf("m").in_use == 2 * 4096);
  v3->reset();
  CHECK(pool->UsageOf("m").spare == 4096);

  // A budget of 0 (the model forgotten) frees the owner's spare slots now, and its slots in
  // use once released.
  pool->SetBudget("m", 0);
  CHECK(pool->UsageOf("m").spare == 0);
  CHECK(pool->held_bytes() == 4096);
  staging->reset();
  CHECK(pool->held_bytes() == 0);
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE("a host slot of a size that would wrap when rounded to pages is refused",
          "[memory][hostile]") {
  // A size can come from a peer's announcement: rounded up to whole pages, UINT64_MAX - 100
  // would wrap to a one-page mapping that claims ~2^64 bytes.
  for (uint64_t size : {UINT64_MAX, UINT64_MAX - 100, UINT64_MAX - 4095}) {
    auto slot = AllocateHost(size);
    INFO(size);
    CHECK(slot.status().code() == absl::StatusCode::kResourceExhausted);
  }
  auto small = AllocateHost(100);
  REQUIRE(small.ok());
  CHECK((*small)->size() == 100);
}

}  // namespace
}  // namespace refit
