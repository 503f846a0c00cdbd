// ApplyJournal: an undone Apply leaves the bytes exactly as before; a committed one keeps what it
// wrote; a process killed while "writing" leaves a record the next journal on the same
// directory restores from, once, into the same memory.

#include "daemon/store/apply_journal.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/store/journal_files.h"

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

// The journal slot in `dir` holding a sparse record of `parts` parts (kind 4: each part's three
// words 64 bytes apart), rewritten as refitd wrote it before (kind 2: the words back to back).
// The header: magic (8), state (4), targets (4), table_bytes (8 at 16), data_offset, data_bytes,
// kind (8 at 40), saved, parts; the targets' table, then the parts' words. The journal of a
// state directory keeps its slots in /dev/shm (journal_files.h).
void RewriteAsThreeWordParts(const std::string& dir, uint64_t parts) {
  const std::string prefix =
      JournalFilesTag(std::filesystem::canonical(dir).string()) + kJournalSlotPrefix;
  size_t rewritten = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (entry.path().filename().string().rfind(prefix, 0) != 0) continue;
    FILE* f = std::fopen(entry.path().c_str(), "r+b");
    REQUIRE(f);
    std::vector<uint8_t> head(64 + 4096);
    const size_t got = std::fread(head.data(), 1, head.size(), f);
    uint64_t table = 0, kind = 0;
    std::memcpy(&table, head.data() + 16, 8);
    std::memcpy(&kind, head.data() + 40, 8);
    if (kind != 4) {
      std::fclose(f);
      continue;
    }
    REQUIRE(got >= 64 + table);
    const uint64_t targets_table = table - parts * 64;
    for (uint64_t k = 0; k < parts; ++k) {
      std::memmove(head.data() + 64 + targets_table + k * 24,
                   head.data() + 64 + targets_table + k * 64, 24);
    }
    kind = 2;
    table = targets_table + parts * 24;
    std::memcpy(head.data() + 16, &table, 8);
    std::memcpy(head.data() + 40, &kind, 8);
    REQUIRE(std::fseek(f, 0, SEEK_SET) == 0);
    REQUIRE(std::fwrite(head.data(), 1, got, f) == got);
    std::fclose(f);
    ++rewritten;
  }
  REQUIRE(rewritten == 1);
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
  // Written by this refitd, or (rewritten here into the three-word parts table of the journals
  // refitd wrote before 2026-12-05) by an older one and recovered after an upgrade.
  const bool older = GENERATE(false, true);
  SECTION("a kill while every part is being written: the next journal restores them all") {
    INFO("older journal: " << older);
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
    if (older) RewriteAsThreeWordParts(dir.path, kParts);
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

// A full Apply's plan for the folded tests: a long contiguous run (over 32 MiB: several threads),
// a row-split bf16 tensor into every other half row, and an fp32 -> bf16 conversion into every
// other element, into two buffers.
plan::Plan FoldedPlan() {
  plan::Plan p;
  plan::CopyOp a;
  a.count = 33 << 20;
  a.dst_offset = 4096;
  a.src_dtype = a.dst_dtype = DType::kUINT8;
  p.ops.push_back(a);
  plan::CopyOp b;
  b.src_offset = 33 << 20;
  b.dst_location = 1;
  b.count = 2048;
  b.rows = 256;
  b.src_row_stride = 2048;
  b.dst_row_stride = 4096;
  b.src_dtype = b.dst_dtype = DType::kBF16;
  p.ops.push_back(b);
  plan::CopyOp c;
  c.src_location = 1;
  c.dst_location = 1;
  c.dst_offset = 2 << 20;
  c.count = 65536;
  c.dst_stride = 2;
  c.src_dtype = DType::kFP32;
  c.dst_dtype = DType::kBF16;
  p.ops.push_back(c);
  for (const plan::CopyOp& op : p.ops) {
    p.dst_bytes += op.rows * op.count * DTypeSize(op.dst_dtype);
    p.src_bytes += op.rows * op.count * DTypeSize(op.src_dtype);
  }
  return p;
}

// Fill, 8 bytes a draw (the folded tests' buffers are tens of MiB).
void FillWords(uint8_t* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (size_t i = n / 8 * 8; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

// Sources for FoldedPlan: bytes, and fp32 values that bf16 holds exactly.
struct FoldedSources {
  FoldedSources() : bytes((33 << 20) + (1 << 20)), floats(65536) {
    FillWords(bytes.data(), bytes.size(), 21);
    for (size_t i = 0; i < floats.size(); ++i) floats[i] = static_cast<float>(i % 251) - 100.0f;
  }
  std::vector<const uint8_t*> src() const {
    return {bytes.data(), reinterpret_cast<const uint8_t*>(floats.data())};
  }
  std::vector<uint8_t> bytes;
  std::vector<float> floats;
};

TEST_CASE("a folded record: each piece saved as the verified copy goes; undone or committed whole",
          "[journal]") {
  TempDir dir;
  auto journal = ApplyJournal::Open(dir.path);
  REQUIRE(journal.ok());
  const plan::Plan plan = FoldedPlan();
  const FoldedSources sources;
  constexpr size_t kA = 40 << 20, kB = 4 << 20;
  Shared a(kA), b(kB);
  FillWords(a.data, kA, 1);
  FillWords(b.data, kB, 2);
  const std::vector<uint8_t> a0(a.data, a.data + kA), b0(b.data, b.data + kB);
  auto run = [&]() {
    auto entry = (*journal)->BeginFolded(
        {Target("a-mem", a.data, kA, {{0, kA}}), Target("b-mem", b.data, kB, {})}, plan);
    REQUIRE(entry.ok());
    REQUIRE((*entry)->saved() != nullptr);
    REQUIRE((*entry)->marks() != nullptr);
    CHECK((*entry)->undo_bytes() == plan::SavedBytes(plan));
    const auto bad = plan::ExecuteSaveAndVerifyOnHost(plan, sources.src(), {a.data, b.data},
                                                      (*entry)->saved(), (*entry)->marks());
    CHECK(bad.empty());
    for (uint64_t k = 0; k < plan::SaveTasks(plan); ++k) CHECK((*entry)->marks()[k] == 1);
    CHECK(std::memcmp(a.data + 4096, sources.bytes.data(), 33 << 20) == 0);
    return std::move(*entry);
  };
  SECTION("an error after the copy: Restore puts every byte back") {
    auto entry = run();
    entry->Restore();
    CHECK(std::memcmp(a.data, a0.data(), kA) == 0);
    CHECK(std::memcmp(b.data, b0.data(), kB) == 0);
  }
  SECTION("one buffer's memory gone: the others are put back, it is not touched") {
    auto entry = run();
    std::vector<uint8_t> b1(b.data, b.data + kB);
    entry->Restore({false, true});
    CHECK(std::memcmp(a.data, a0.data(), kA) == 0);
    CHECK(std::memcmp(b.data, b1.data(), kB) == 0);
  }
  SECTION("committed: the new bytes stay, and the slot is used again") {
    run()->Commit();
    CHECK(std::memcmp(a.data + 4096, sources.bytes.data(), 33 << 20) == 0);
    std::memcpy(a.data, a0.data(), kA);
    std::memcpy(b.data, b0.data(), kB);
    run()->Restore();
    CHECK(std::memcmp(a.data, a0.data(), kA) == 0);
    CHECK(std::memcmp(b.data, b0.data(), kB) == 0);
  }
  CHECK((*journal)->PendingRecoveries() == 0);
}

TEST_CASE("a process killed inside a folded Apply: the next journal restores the marked pieces",
          "[journal]") {
  TempDir dir;
  const plan::Plan plan = FoldedPlan();
  const FoldedSources sources;
  constexpr size_t kA = 40 << 20, kB = 4 << 20;
  Shared a(kA), b(kB);
  FillWords(a.data, kA, 3);
  FillWords(b.data, kB, 4);
  const std::vector<uint8_t> a0(a.data, a.data + kA), b0(b.data, b.data + kB);

  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto journal = ApplyJournal::Open(dir.path);
    if (!journal.ok()) _exit(2);
    auto entry = (*journal)->BeginFolded(
        {Target("a-mem", a.data, kA, {}), Target("b-mem", b.data, kB, {})}, plan);
    if (!entry.ok()) _exit(3);
    // The copy's commit point (test hook): SIGKILL after half the pieces, the others of the
    // threads part-way.
    setenv("REFIT_TEST_KILL_AT", "apply", 1);
    plan::ExecuteSaveAndVerifyOnHost(plan, sources.src(), {a.data, b.data}, (*entry)->saved(),
                                     (*entry)->marks());
    _exit(4);  // not reached: the hook kills
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFSIGNALED(status));
  // Part of the new version landed, not all of it.
  const uint64_t run = 33 << 20;
  uint64_t landed = 0;
  for (uint64_t at = 0; at < run; at += 4096) {
    landed += std::memcmp(a.data + 4096 + at, sources.bytes.data() + at, 4096) == 0;
  }
  CHECK(landed > 0);
  CHECK(landed < run / 4096);

  auto journal = ApplyJournal::Open(dir.path);
  REQUIRE(journal.ok());
  CHECK((*journal)->PendingRecoveries() == 2);
  auto held = (*journal)->Recover("a-mem", a.data, kA);
  REQUIRE(held.has_value());
  CHECK(*held == 6);
  CHECK(std::memcmp(a.data, a0.data(), kA) == 0);
  REQUIRE((*journal)->Recover("b-mem", b.data, kB).has_value());
  CHECK(std::memcmp(b.data, b0.data(), kB) == 0);
  CHECK((*journal)->PendingRecoveries() == 0);
}

}  // namespace
}  // namespace refit
