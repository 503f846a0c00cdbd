// ApplyJournal: an undone Apply leaves the bytes exactly as before; a committed one keeps what it
// wrote; a process killed while "writing" leaves a record the next journal on the same
// directory restores from, once, into the same memory.

#include "daemon/store/apply_journal.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"

namespace refit {
namespace {

struct TempDir {
  TempDir() {
    char t[] = "/tmp/apply-journal-test-XXXXXX";
    REQUIRE(mkdtemp(t));
    path = t;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string path;
};

// Memory that outlives a forked child (as an engine's buffer outlives refitd).
struct Shared {
  explicit Shared(size_t n) : size(n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    data = static_cast<uint8_t*>(p);
  }
  ~Shared() { munmap(data, size); }
  uint8_t* data;
  size_t size;
};

void Fill(uint8_t* p, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

UndoTarget Target(const std::string& identity, uint8_t* data, uint64_t size,
                  std::vector<std::pair<uint64_t, uint64_t>> ranges) {
  UndoTarget t;
  t.identity = identity;
  t.data = data;
  t.size = size;
  t.prev_version = 6;
  t.version = 7;
  t.ranges = std::move(ranges);
  return t;
}

TEST_CASE("an undone Apply leaves every byte as it was; a committed one keeps its writes",
          "[journal]") {
  const bool on_disk = GENERATE(false, true);
  TempDir dir;
  auto journal = ApplyJournal::Open(on_disk ? dir.path : "");
  REQUIRE(journal.ok());
  constexpr size_t kSize = 3 << 20;
  std::vector<uint8_t> a(kSize), b(kSize / 3);
  Fill(a.data(), a.size(), 1);
  Fill(b.data(), b.size(), 2);
  const std::vector<uint8_t> a0 = a, b0 = b;
  auto begin = [&] {
    return (*journal)->Begin({Target("a", a.data(), a.size(), {{0, 100}, {4096, kSize}}),
                              Target("b", b.data(), b.size(), {{10, 11}, {1000, 50000}})});
  };
  {
    auto entry = begin();
    REQUIRE(entry.ok());
    CHECK((*entry)->undo_bytes() == 100 + (kSize - 4096) + 1 + 49000);
    std::memset(a.data(), 0xee, 100);
    std::memset(a.data() + 4096, 0xee, kSize - 4096);
    std::memset(b.data() + 1000, 0xee, 49000);
    b[10] = 0;
    (*entry)->Restore();
  }
  CHECK(a == a0);
  CHECK(b == b0);
  {
    auto entry = begin();
    REQUIRE(entry.ok());
    std::memset(b.data() + 1000, 0x11, 49000);
    // Dropped without Commit: restored as well (an early return fails whole).
  }
  CHECK(b == b0);
  {
    auto entry = begin();
    REQUIRE(entry.ok());
    std::memset(b.data() + 1000, 0x22, 49000);
    (*entry)->Commit();
  }
  CHECK(b[1000] == 0x22);
  CHECK(a == a0);
  CHECK((*journal)->PendingRecoveries() == 0);
}

TEST_CASE("a process killed while writing: the next journal restores the memory, once",
          "[journal]") {
  TempDir dir;
  constexpr size_t kSize = 8 << 20;
  Shared engine(kSize), other(4096);
  Fill(engine.data, kSize, 7);
  Fill(other.data, 4096, 8);
  std::vector<uint8_t> before(engine.data, engine.data + kSize);
  std::vector<uint8_t> other_before(other.data, other.data + 4096);

  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto journal = ApplyJournal::Open(dir.path);
    if (!journal.ok()) _exit(2);
    auto entry = (*journal)->Begin({Target("engine-mem", engine.data, kSize, {{0, kSize}}),
                                    Target("other-mem", other.data, 4096, {{0, 4096}})});
    if (!entry.ok()) _exit(3);
    std::memset(engine.data, 0x5a, kSize / 2);  // half of the new version landed
    std::memset(other.data, 0x5a, 4096);
    kill(getpid(), SIGKILL);
    _exit(4);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFSIGNALED(status));
  REQUIRE(engine.data[0] == 0x5a);

  {
    auto journal = ApplyJournal::Open(dir.path);
    REQUIRE(journal.ok());
    CHECK((*journal)->PendingRecoveries() == 2);
    CHECK_FALSE((*journal)->Recover("someone-else", engine.data, kSize).has_value());
    CHECK_FALSE((*journal)->Recover("engine-mem", engine.data, kSize - 1).has_value());
    auto held = (*journal)->Recover("engine-mem", engine.data, kSize);
    REQUIRE(held.has_value());
    CHECK(*held == 6);
    CHECK(std::memcmp(engine.data, before.data(), kSize) == 0);
    CHECK_FALSE((*journal)->Recover("engine-mem", engine.data, kSize).has_value());
    CHECK((*journal)->PendingRecoveries() == 1);
  }
  // A second restart before "other-mem" registered: only it is restored, not engine-mem again.
  std::memset(engine.data, 0x77, kSize);  // a newer version applied since
  {
    auto journal = ApplyJournal::Open(dir.path);
    REQUIRE(journal.ok());
    CHECK((*journal)->PendingRecoveries() == 1);
    CHECK_FALSE((*journal)->Recover("engine-mem", engine.data, kSize).has_value());
    CHECK(engine.data[0] == 0x77);
    CHECK((*journal)->Recover("other-mem", other.data, 4096).has_value());
    CHECK(std::memcmp(other.data, other_before.data(), 4096) == 0);
    CHECK((*journal)->PendingRecoveries() == 0);
  }
  // Every record done: the journal's files are gone (they live in /dev/shm, named after the
  // state directory).
  auto last = ApplyJournal::Open(dir.path);
  REQUIRE(last.ok());
  CHECK((*last)->dir() == "/dev/shm");
  int left = 0;
  for (const auto& e : std::filesystem::directory_iterator((*last)->dir())) {
    left += e.path().filename().string().rfind((*last)->tag(), 0) == 0;
  }
  CHECK(left == 0);
}

TEST_CASE("sparse records: restored newest first, overlapping ones included; sized exactly",
          "[journal]") {
  const bool on_disk = GENERATE(false, true);
  TempDir dir;
  auto journal = ApplyJournal::Open(on_disk ? dir.path : "");
  REQUIRE(journal.ok());
  std::vector<uint8_t> a(1 << 20), b(300000);
  Fill(a.data(), a.size(), 3);
  Fill(b.data(), b.size(), 4);
  const std::vector<uint8_t> a0 = a, b0 = b;
  using Entry = ApplyJournal::Entry;
  const uint64_t big = 200000;  // more than one record holds
  const uint64_t capacity = Entry::RecordBytes(2) * 2 + Entry::RecordBytes(1) +
                            Entry::RecordBytes(Entry::kMaxRecordBytes) * 3 +
                            Entry::RecordBytes(big - 3 * Entry::kMaxRecordBytes);
  for (const bool commit : {false, true}) {
    a = a0;
    b = b0;
    auto entry = (*journal)->BeginSparse(
        {Target("a", a.data(), a.size(), {}), Target("b", b.data(), b.size(), {})}, capacity);
    REQUIRE(entry.ok());
    // A write, then one overlapping it (a strided destination's neighbour), then others.
    REQUIRE((*entry)->Save(0, 100, a.data() + 100, 2));
    a[100] = 0xa1;
    a[101] = 0xa2;
    REQUIRE((*entry)->Save(0, 101, a.data() + 101, 2));
    a[101] = 0xb1;
    a[102] = 0xb2;
    REQUIRE((*entry)->Save(1, 7, b.data() + 7, 1));
    b[7] ^= 0xff;
    REQUIRE((*entry)->Save(1, 1000, b.data() + 1000, big));
    std::memset(b.data() + 1000, 0x33, big);
    CHECK((*entry)->undo_bytes() == 2 + 2 + 1 + big);
    CHECK_FALSE((*entry)->Save(0, 0, a.data(), 1));  // the capacity is used up
    if (commit) {
      (*entry)->Commit();
      CHECK(a[101] == 0xb1);
      CHECK(b[1000] == 0x33);
    } else {
      (*entry)->Restore();
      CHECK(a == a0);
      CHECK(b == b0);
    }
  }
  CHECK((*journal)->PendingRecoveries() == 0);
}

TEST_CASE("a process killed inside a sparse Apply: the next journal restores what it wrote",
          "[journal]") {
  TempDir dir;
  constexpr size_t kSize = 1 << 20;
  Shared engine(kSize);
  Fill(engine.data, kSize, 9);
  const std::vector<uint8_t> before(engine.data, engine.data + kSize);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto journal = ApplyJournal::Open(dir.path);
    if (!journal.ok()) _exit(2);
    auto entry = (*journal)->BeginSparse({Target("engine-mem", engine.data, kSize, {})},
                                         1000 * ApplyJournal::Entry::RecordBytes(2));
    if (!entry.ok()) _exit(3);
    for (uint64_t i = 0; i < 1000; ++i) {  // every 1000th element, saved then written
      if (!(*entry)->Save(0, i * 1000, engine.data + i * 1000, 2)) _exit(5);
      engine.data[i * 1000] ^= 0x01;
      engine.data[i * 1000 + 1] ^= 0x80;
      if (i == 600) kill(getpid(), SIGKILL);
    }
    _exit(4);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFSIGNALED(status));
  REQUIRE(std::memcmp(engine.data, before.data(), kSize) != 0);
  auto journal = ApplyJournal::Open(dir.path);
  REQUIRE(journal.ok());
  CHECK((*journal)->PendingRecoveries() == 1);
  auto held = (*journal)->Recover("engine-mem", engine.data, kSize);
  REQUIRE(held.has_value());
  CHECK(*held == 6);
  CHECK(std::memcmp(engine.data, before.data(), kSize) == 0);
  CHECK((*journal)->PendingRecoveries() == 0);
}

// Part `part` of `parts` saves then flips the low byte of every 1000th element of its share of
// `data` (elements i with i % parts == part); `kill_at`: the process SIGKILLs itself there.
void SaveAndWrite(ApplyJournal::Part* undo, uint8_t* data, uint64_t elements, unsigned part,
                  unsigned parts, uint64_t kill_at) {
  for (uint64_t i = part; i < elements; i += parts) {
    if (!undo->Save(0, i * 1000, data + i * 1000, 2)) _exit(5);
    data[i * 1000] ^= 0x01;
    data[i * 1000 + 1] ^= 0x80;
    if (i == kill_at) kill(getpid(), SIGKILL);
  }
}

TEST_CASE("a sparse record in parts, written by several threads: undone whole, or recovered",
          "[journal]") {
  constexpr size_t kSize = 1 << 20;
  constexpr uint64_t kElements = 1000;
  constexpr unsigned kParts = 3;
  const std::vector<uint64_t> capacities(
      kParts, (kElements / kParts + 1) * ApplyJournal::Entry::RecordBytes(2));
  SECTION("an error: Restore puts every part back") {
    TempDir dir;
    auto journal = ApplyJournal::Open(dir.path);
    REQUIRE(journal.ok());
    Shared engine(kSize);
    Fill(engine.data, kSize, 10);
    const std::vector<uint8_t> before(engine.data, engine.data + kSize);
    auto entry =
        (*journal)->BeginSparse({Target("engine-mem", engine.data, kSize, {})}, capacities);
    REQUIRE(entry.ok());
    REQUIRE((*entry)->parts() == kParts);
    std::vector<std::thread> threads;
    for (unsigned k = 0; k < kParts; ++k) {
      threads.emplace_back(SaveAndWrite, &(*entry)->part(k), engine.data, kElements, k, kParts,
                           UINT64_MAX);
    }
    for (std::thread& t : threads) t.join();
    CHECK((*entry)->undo_bytes() == 2 * kElements);
    CHECK(std::memcmp(engine.data, before.data(), kSize) != 0);
    (*entry)->Restore();
    CHECK(std::memcmp(engine.data, before.data(), kSize) == 0);
  }
  SECTION("a kill while every part is being written: the next journal restores them all") {
    TempDir dir;
    Shared engine(kSize);
    Fill(engine.data, kSize, 11);
    const std::vector<uint8_t> before(engine.data, engine.data + kSize);
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      auto journal = ApplyJournal::Open(dir.path);
      if (!journal.ok()) _exit(2);
      auto entry =
          (*journal)->BeginSparse({Target("engine-mem", engine.data, kSize, {})}, capacities);
      if (!entry.ok()) _exit(3);
      // Parts 1 and 2 finish; part 0 is killed two thirds of the way through its share.
      std::thread one(SaveAndWrite, &(*entry)->part(1), engine.data, kElements, 1, kParts,
                      UINT64_MAX);
      std::thread two(SaveAndWrite, &(*entry)->part(2), engine.data, kElements, 2, kParts,
                      UINT64_MAX);
      one.join();
      two.join();
      SaveAndWrite(&(*entry)->part(0), engine.data, kElements, 0, kParts, 600);
      _exit(4);
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    REQUIRE(WIFSIGNALED(status));
    REQUIRE(std::memcmp(engine.data, before.data(), kSize) != 0);
    auto journal = ApplyJournal::Open(dir.path);
    REQUIRE(journal.ok());
    CHECK((*journal)->PendingRecoveries() == 1);
    auto held = (*journal)->Recover("engine-mem", engine.data, kSize);
    REQUIRE(held.has_value());
    CHECK(*held == 6);
    CHECK(std::memcmp(engine.data, before.data(), kSize) == 0);
    CHECK((*journal)->PendingRecoveries() == 0);
  }
}

}  // namespace
}  // namespace refit
