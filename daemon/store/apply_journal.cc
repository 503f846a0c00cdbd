// ApplyJournal: the undo record of each Apply in flight, in files under --state-dir that outlive
// a killed refitd (apply_journal.h; docs/architecture.md, "Atomic Apply").
//
// A slot file: a 64-byte header, the table (one entry per target), then at data_offset (a page
// boundary) the saved bytes of every target's ranges, in order. The header's state goes
// idle -> saving (table and bytes being written) -> writing (the Apply may write into the
// targets) -> idle (Commit, or after Restore). A file found "writing" at Open is a pending
// restore; each entry's `restored` word is set once its buffer got its bytes back, so a second
// restart does not restore it again over newer versions.

#include "daemon/store/apply_journal.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>
#include <ctime>
#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/plan/plan.h"
#include "daemon/store/journal_files.h"

namespace refit {
namespace {

constexpr char kMagic[8] = {'R', 'E', 'F', 'I', 'T', 'U', 'N', '1'};
constexpr uint32_t kIdle = 0, kSaving = 1, kWriting = 2;
constexpr uint64_t kPage = 4096;
constexpr const char* kSlotPrefix = kJournalSlotPrefix;
constexpr const char* kRecoverPrefix = kJournalRecoverPrefix;

struct Header {
  char magic[8];
  uint32_t state;
  uint32_t targets;
  uint64_t table_bytes;
  uint64_t data_offset;
  uint64_t data_bytes;
  // kDense: ranges in the table, their bytes in order; kSparse: records from data_offset;
  // kSparseParts: `parts` parts of records, each described after the targets' table by three
  // words (its start from data_offset, its capacity, the bytes of its records saved);
  // kSparsePartsPadded (what BeginSparse writes): the same three words of each part 64 bytes
  // apart, so that the threads saving into different parts never share a cache line.
  uint64_t kind;
  uint64_t saved;  // kSparse: the bytes of records saved, from data_offset
  uint64_t parts;  // kSparseParts
};
// kFolded: after the targets' table, the number of restore ops and of marks, the ops (kOpWords
// words each: piece, target, dst offset, dst stride, dst row stride, count, rows, dtype, offset
// from data_offset, its row stride), then one mark byte per piece (padded to 8): a piece's saved
// bytes are restored only when its mark is set (plan::ExecuteSaveAndVerifyOnHost).
constexpr uint64_t kDense = 0, kSparse = 1, kSparseParts = 2, kFolded = 3, kSparsePartsPadded = 4;
constexpr uint64_t kPartWords = 3;        // kSparseParts: words per part in the table
constexpr uint64_t kPaddedPartWords = 8;  // kSparsePartsPadded
constexpr uint64_t kOpWords = 10;
static_assert(sizeof(Header) == 64, "journal header is 64 bytes");

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

uint64_t TableBytes(const std::vector<UndoTarget>& targets) {
  uint64_t bytes = 0;
  for (const UndoTarget& t : targets) {
    // identity length, identity (padded), prev, version, size, restored, ranges, the ranges.
    bytes += 8 + RoundUp(t.identity.size(), 8) + 5 * 8 + t.ranges.size() * 16;
  }
  return bytes;
}

void Put(uint8_t*& at, uint64_t v) {
  std::memcpy(at, &v, 8);
  at += 8;
}

uint64_t Get(const uint8_t*& at) {
  uint64_t v = 0;
  std::memcpy(&v, at, 8);
  at += 8;
  return v;
}

// Writes the table of `targets` at `at`.
void WriteTable(const std::vector<UndoTarget>& targets, uint8_t* at) {
  for (const UndoTarget& t : targets) {
    Put(at, t.identity.size());
    std::memset(at, 0, RoundUp(t.identity.size(), 8));
    std::memcpy(at, t.identity.data(), t.identity.size());
    at += RoundUp(t.identity.size(), 8);
    Put(at, t.prev_version);
    Put(at, t.version);
    Put(at, t.size);
    Put(at, 0);  // restored
    Put(at, t.ranges.size());
    for (const auto& [b, e] : t.ranges) {
      Put(at, b);
      Put(at, e);
    }
  }
}

// The state word, stored after everything before it in program order (a killed process keeps
// every store it made to a shared file mapping: they are in the page cache).
void SetState(uint8_t* base, uint32_t state) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  reinterpret_cast<std::atomic<uint32_t>*>(base + offsetof(Header, state))
      ->store(state, std::memory_order_seq_cst);
}

// Copies each target's ranges between its memory and the journal's bytes at `data`, on several
// cores when large (plan::ExecuteOnHost with byte ops). `save`: target -> journal.
void CopyRanges(const std::vector<UndoTarget>& targets, uint8_t* data, bool save,
                const std::vector<bool>& skip) {
  plan::Plan copy;
  std::vector<const uint8_t*> src;
  std::vector<uint8_t*> dst;
  uint64_t at = 0;
  for (uint32_t i = 0; i < targets.size(); ++i) {
    const bool skipped = i < skip.size() && skip[i];
    if (save) {
      src.push_back(targets[i].data);
    } else {
      dst.push_back(targets[i].data);
    }
    for (const auto& [begin, end] : targets[i].ranges) {
      if (!skipped && end > begin) {
        plan::CopyOp op;
        op.src_location = save ? i : 0;
        op.dst_location = save ? 0 : i;
        op.src_offset = save ? begin : at;
        op.dst_offset = save ? at : begin;
        op.count = end - begin;
        op.src_dtype = op.dst_dtype = DType::kUINT8;
        copy.ops.push_back(op);
        copy.dst_bytes += op.count;
      }
      at += end - begin;
    }
  }
  if (save) {
    dst.push_back(data);
  } else {
    src.push_back(data);
  }
  copy.src_bytes = copy.dst_bytes;
  if (!copy.ops.empty()) plan::ExecuteOnHost(copy, src, dst);
}

}  // namespace

// One journal slot: a file (or anonymous memory) mapped shared.
class ApplyJournal::Slot {
 public:
  std::string path;  // empty: anonymous
  int fd = -1;
  uint8_t* base = nullptr;
  uint64_t mapped = 0;
  bool in_use = false;

  ~Slot() {
    Unmap();
    if (fd >= 0) close(fd);
  }
  void Unmap() {
    if (base) munmap(base, mapped);
    base = nullptr;
    mapped = 0;
  }
  absl::Status Ensure(uint64_t bytes) {
    if (base && mapped >= bytes) return absl::OkStatus();
    Unmap();
    const uint64_t size = RoundUp(bytes, kPage);
    if (fd < 0 && !path.empty()) {
      fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      if (fd < 0) {
        return absl::InternalError(
            absl::StrCat("apply journal ", path, ": open failed: ", std::strerror(errno)));
      }
    }
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) != 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("apply journal ", path, ": ", size, " bytes: ", std::strerror(errno)));
    }
    // Populated at once: faulting a model-sized slot in page by page costs more than the copy.
    void* p = fd >= 0
                  ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0)
                  : mmap(nullptr, size, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("apply journal: mapping ", size, " bytes: ", std::strerror(errno)));
    }
    base = static_cast<uint8_t*>(p);
    mapped = size;
    return absl::OkStatus();
  }
  // After use: a large slot gives its memory (and its dirty pages) back.
  void Shrink() {
    if (mapped <= kKeepBytes) return;
    Unmap();
    if (fd >= 0 && ftruncate(fd, 0) != 0) {
      Logger("store")->warn("apply journal {}: truncate failed: {}", path, std::strerror(errno));
    }
  }
};

// Saved bytes of one target: `len` bytes at `offset` of it, at `file_at` of the journal file.
struct SavedBytes {
  uint64_t offset = 0, len = 0, file_at = 0;
};

// One target of a slot file a killed refitd left "writing".
struct PendingTarget {
  UndoTarget target;              // data unset
  uint8_t* restored = nullptr;    // its word in the file
  std::vector<SavedBytes> saved;  // in the order they were saved (restored newest first)
  std::vector<plan::CopyOp> ops;  // folded: the marked pieces' restore ops (from the file)
};

// A slot file a killed refitd left "writing".
struct ApplyJournal::Pending {
  std::string path;
  int fd = -1;
  uint8_t* base = nullptr;
  uint64_t size = 0;
  using Target = PendingTarget;
  std::vector<Target> targets;
  ~Pending() {
    if (base) munmap(base, size);
    if (fd >= 0) close(fd);
  }
  bool Done() const {
    for (const Target& t : targets) {
      uint64_t restored = 0;
      std::memcpy(&restored, t.restored, 8);
      if (restored == 0) return false;
    }
    return true;
  }
};

namespace {

// A folded record's restore ops (the table from `at` to `end`) for `out`'s targets: those of
// the marked pieces, reading the saved bytes at their file offsets. DATA_LOSS when one does not
// lie inside its target or the saved bytes.
absl::StatusOr<bool> ReadFolded(const std::string& path, const Header& header, const uint8_t* at,
                                const uint8_t* end, std::vector<PendingTarget>* out) {
  if (end - at < 16) return absl::DataLossError(absl::StrCat(path, ": bad folded table"));
  const uint64_t ops = Get(at), marks = Get(at);
  const uint64_t left = static_cast<uint64_t>(end - at);
  if (ops > left / (8 * kOpWords) || marks > left - ops * 8 * kOpWords) {
    return absl::DataLossError(absl::StrCat(path, ": bad folded table"));
  }
  const uint8_t* mark = at + ops * 8 * kOpWords;
  constexpr uint64_t kMax = uint64_t{1} << 40;
  for (uint64_t j = 0; j < ops; ++j) {
    uint64_t w[kOpWords];
    for (uint64_t& v : w) v = Get(at);
    plan::CopyOp op;
    const uint64_t piece = w[0], target = w[1];
    op.dst_offset = w[2];
    op.dst_stride = static_cast<int64_t>(w[3]);
    op.dst_row_stride = static_cast<int64_t>(w[4]);
    op.count = w[5];
    op.rows = w[6];
    op.dst_dtype = op.src_dtype = static_cast<DType>(w[7] < 16 ? w[7] : 0);
    op.src_offset = header.data_offset + w[8];
    op.src_row_stride = static_cast<int64_t>(w[9]);
    const uint64_t elem = DTypeSize(op.dst_dtype);
    bool ok = piece < marks && target < out->size() && elem != 0 && op.count != 0 && op.rows != 0 &&
              w[3] != 0;
    for (int k = 2; k < 10; ++k) ok = ok && (k == 7 || w[k] < kMax);
    if (ok) {
      using U = unsigned __int128;
      const U dst_end =
          U{op.dst_offset} + (U{op.rows - 1} * w[4] + U{op.count - 1} * w[3] + 1) * elem;
      const U src_end = U{w[8]} + (U{op.rows - 1} * w[9] + op.count) * elem;
      ok = dst_end <= (*out)[target].target.size && src_end <= header.data_bytes;
    }
    if (!ok) return absl::DataLossError(absl::StrCat(path, ": bad restore op ", j));
    if (mark[piece] == 0) continue;  // not saved, so not written
    op.src_location = 0;
    op.dst_location = 0;
    (*out)[target].ops.push_back(op);
  }
  return true;
}

// Reads a pending restore from `path` (a slot file left "writing"); null when it is not one.
absl::StatusOr<bool> ReadPending(const std::string& path, uint8_t* base, uint64_t size,
                                 std::vector<PendingTarget>* out) {
  if (size < sizeof(Header)) return false;
  Header header;
  std::memcpy(&header, base, sizeof(header));
  if (std::memcmp(header.magic, kMagic, sizeof(kMagic)) != 0 || header.state != kWriting) {
    return false;
  }
  if (header.table_bytes > size || header.data_offset > size ||
      header.data_bytes > size - header.data_offset) {
    return absl::DataLossError(absl::StrCat("apply journal ", path, " is truncated"));
  }
  const uint8_t* at = base + sizeof(Header);
  const uint8_t* end = at + header.table_bytes;
  uint64_t data_at = header.data_offset;
  for (uint32_t i = 0; i < header.targets; ++i) {
    if (end - at < 8) return absl::DataLossError(absl::StrCat(path, ": bad table"));
    UndoTarget t;
    const uint64_t id_len = Get(at);
    if (static_cast<uint64_t>(end - at) < RoundUp(id_len, 8) + 40) {
      return absl::DataLossError(absl::StrCat(path, ": bad table"));
    }
    t.identity.assign(reinterpret_cast<const char*>(at), id_len);
    at += RoundUp(id_len, 8);
    t.prev_version = Get(at);
    t.version = Get(at);
    t.size = Get(at);
    uint8_t* restored = const_cast<uint8_t*>(at);
    at += 8;
    const uint64_t ranges = Get(at);
    if (static_cast<uint64_t>(end - at) / 16 < ranges) {
      return absl::DataLossError(absl::StrCat(path, ": bad table"));
    }
    uint64_t bytes = 0;
    for (uint64_t r = 0; r < ranges; ++r) {
      const uint64_t b = Get(at), e = Get(at);
      if (e < b || e > t.size) return absl::DataLossError(absl::StrCat(path, ": bad range"));
      t.ranges.emplace_back(b, e);
      bytes += e - b;
    }
    if (data_at + bytes > size) return absl::DataLossError(absl::StrCat(path, ": truncated"));
    PendingTarget pending;
    pending.restored = restored;
    for (const auto& [b, e] : t.ranges) {
      pending.saved.push_back({b, e - b, data_at});
      data_at += e - b;
    }
    pending.target = std::move(t);
    out->push_back(std::move(pending));
  }
  if (header.kind == kFolded) return ReadFolded(path, header, at, end, out);
  if (header.kind != kSparse && header.kind != kSparseParts && header.kind != kSparsePartsPadded) {
    return true;
  }
  // Sparse records: [offset | target << 40 | len << 48] then the bytes, padded to 8; one part
  // (kSparse) or several, read in order (restored newest first, the last part first).
  std::vector<std::pair<uint64_t, uint64_t>> parts;  // [begin, end) in the file
  if (header.kind == kSparse) {
    if (header.saved > size - header.data_offset) {
      return absl::DataLossError(absl::StrCat(path, ": truncated records"));
    }
    parts.emplace_back(header.data_offset, header.data_offset + header.saved);
  } else {
    const uint64_t stride = header.kind == kSparseParts ? kPartWords : kPaddedPartWords;
    if (header.parts > static_cast<uint64_t>(end - at) / (8 * stride)) {
      return absl::DataLossError(absl::StrCat(path, ": bad parts table"));
    }
    for (uint64_t k = 0; k < header.parts; ++k) {
      const uint8_t* part = at;
      const uint64_t begin = Get(at), capacity = Get(at), saved = Get(at);
      at = part + 8 * stride;
      if (begin > header.data_bytes || capacity > header.data_bytes - begin || saved > capacity) {
        return absl::DataLossError(absl::StrCat(path, ": bad part"));
      }
      parts.emplace_back(header.data_offset + begin, header.data_offset + begin + saved);
    }
  }
  for (const auto& [first, stop] : parts) {
    uint64_t pos = first;
    while (pos < stop) {
      if (stop - pos < 8) return absl::DataLossError(absl::StrCat(path, ": bad record"));
      uint64_t word = 0;
      std::memcpy(&word, base + pos, 8);
      const uint64_t offset = word & ((uint64_t{1} << 40) - 1);
      const uint64_t target = (word >> 40) & 0xff;
      const uint64_t len = word >> 48;
      const uint64_t need = ApplyJournal::Part::RecordBytes(len);
      if (target >= out->size() || need > stop - pos || offset + len > (*out)[target].target.size) {
        return absl::DataLossError(absl::StrCat(path, ": bad record"));
      }
      (*out)[target].saved.push_back({offset, len, pos + 8});
      pos += need;
    }
  }
  return true;
}

}  // namespace

ApplyJournal::ApplyJournal(std::string dir) : dir_(std::move(dir)) {}

absl::StatusOr<std::unique_ptr<ApplyJournal>> ApplyJournal::Open(const std::string& dir) {
  std::unique_ptr<ApplyJournal> journal(new ApplyJournal(dir));
  if (dir.empty()) return journal;
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(
        absl::StrCat("state directory ", dir, ": ", std::strerror(errno)));
  }
  struct stat shm {};
  if (stat("/dev/shm", &shm) == 0 && S_ISDIR(shm.st_mode)) {
    char real[PATH_MAX];
    const std::string named = realpath(dir.c_str(), real) ? std::string(real) : dir;
    journal->dir_ = "/dev/shm";
    journal->tag_ = JournalFilesTag(named);
  }
  const std::string files = journal->dir_;
  const std::string slot_prefix = journal->tag_ + kSlotPrefix;
  const std::string recover_prefix = journal->tag_ + kRecoverPrefix;
  DIR* d = opendir(files.c_str());
  if (!d) {
    return absl::FailedPreconditionError(
        absl::StrCat("apply journal ", files, ": ", std::strerror(errno)));
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (absl::StartsWith(name, slot_prefix) || absl::StartsWith(name, recover_prefix)) {
      names.push_back(name);
    }
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  int recovered = 0;
  for (const std::string& name : names) {
    const std::string path = absl::StrCat(files, "/", name);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    struct stat st {};
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(Header))) {
      if (fd >= 0) close(fd);
      unlink(path.c_str());
      continue;
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      close(fd);
      continue;
    }
    auto pending = std::make_unique<Pending>();
    pending->fd = fd;
    pending->base = static_cast<uint8_t*>(p);
    pending->size = size;
    std::vector<PendingTarget> targets;
    auto read = ReadPending(path, pending->base, size, &targets);
    if (!read.ok()) Logger("store")->error("{}: dropped", read.status().ToString());
    if (!read.ok() || !*read) {
      unlink(path.c_str());  // idle, or a record that was still being saved: nothing written
      continue;
    }
    // Keep it under a name no slot uses, so that new Applies can't overwrite it.
    std::string kept = path;
    if (absl::StartsWith(name, slot_prefix)) {
      kept = absl::StrCat(files, "/", recover_prefix, name.substr(slot_prefix.size()), "-",
                          static_cast<uint64_t>(time(nullptr)), "-", getpid());
      if (rename(path.c_str(), kept.c_str()) != 0) kept = path;
    }
    pending->path = kept;
    pending->targets = std::move(targets);
    if (pending->Done()) {
      unlink(kept.c_str());
      continue;
    }
    for (const auto& t : pending->targets) {
      Logger("store")->warn(
          "apply journal {}: an Apply of version {} into {} was cut short (refitd died): its "
          "bytes of version {} are put back when that memory registers again",
          kept, t.target.version, t.target.identity, t.target.prev_version);
    }
    ++recovered;
    common::MutexLock lock(journal->mu_);
    journal->pending_.push_back(std::move(pending));
  }
  (void)recovered;
  return journal;
}

ApplyJournal::~ApplyJournal() {
  common::MutexLock lock(mu_);
  for (auto& slot : slots_) {
    if (!slot->path.empty() && !slot->in_use) unlink(slot->path.c_str());
  }
}

absl::StatusOr<std::unique_ptr<ApplyJournal::Entry>> ApplyJournal::Begin(
    std::vector<UndoTarget> targets) {
  const uint64_t table = TableBytes(targets);
  uint64_t data = 0;
  for (const UndoTarget& t : targets) {
    for (const auto& [b, e] : t.ranges) data += e - b;
  }
  const uint64_t data_offset = RoundUp(sizeof(Header) + table, kPage);
  ASSIGN_OR_RETURN(Slot * slot, SlotFor(data_offset + data));
  uint8_t* base = slot->base;
  SetState(base, kSaving);
  Header header{};
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.state = kSaving;
  header.targets = static_cast<uint32_t>(targets.size());
  header.table_bytes = table;
  header.data_offset = data_offset;
  header.data_bytes = data;
  std::memcpy(base, &header, sizeof(header));
  WriteTable(targets, base + sizeof(Header));
  CopyRanges(targets, base + data_offset, /*save=*/true, {});
  SetState(base, kWriting);
  return std::unique_ptr<Entry>(new Entry(this, slot, std::move(targets), data));
}

absl::StatusOr<std::unique_ptr<ApplyJournal::Entry>> ApplyJournal::BeginFolded(
    std::vector<UndoTarget> targets, const plan::Plan& plan) {
  for (UndoTarget& t : targets) t.ranges.clear();
  std::vector<uint32_t> pieces;
  plan::Plan restore = plan::RestorePlan(plan, nullptr, &pieces);
  const uint64_t marks = plan::SaveTasks(plan);
  const uint64_t data = plan::SavedBytes(plan);
  const uint64_t targets_table = TableBytes(targets);
  const uint64_t table = targets_table + 16 + restore.ops.size() * kOpWords * 8 + RoundUp(marks, 8);
  const uint64_t data_offset = RoundUp(sizeof(Header) + table, kPage);
  ASSIGN_OR_RETURN(Slot * slot, SlotFor(data_offset + data));
  uint8_t* base = slot->base;
  SetState(base, kSaving);
  Header header{};
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.state = kSaving;
  header.targets = static_cast<uint32_t>(targets.size());
  header.table_bytes = table;
  header.data_offset = data_offset;
  header.data_bytes = data;
  header.kind = kFolded;
  std::memcpy(base, &header, sizeof(header));
  WriteTable(targets, base + sizeof(Header));
  uint8_t* at = base + sizeof(Header) + targets_table;
  Put(at, restore.ops.size());
  Put(at, marks);
  for (size_t j = 0; j < restore.ops.size(); ++j) {
    const plan::CopyOp& op = restore.ops[j];
    Put(at, pieces[j]);
    Put(at, op.dst_location);
    Put(at, op.dst_offset);
    Put(at, static_cast<uint64_t>(op.dst_stride));
    Put(at, static_cast<uint64_t>(op.dst_row_stride));
    Put(at, op.count);
    Put(at, op.rows);
    Put(at, static_cast<uint64_t>(op.dst_dtype));
    Put(at, op.src_offset);
    Put(at, static_cast<uint64_t>(op.src_row_stride));
  }
  std::memset(at, 0, RoundUp(marks, 8));  // nothing saved yet
  std::unique_ptr<Entry> entry(new Entry(this, slot, std::move(targets), data));
  entry->marks_ = at;
  entry->saved_ = base + data_offset;
  entry->restore_ = std::move(restore);
  entry->pieces_ = std::move(pieces);
  // The Apply saves and marks each piece before writing it; a piece counts once marked.
  SetState(base, kWriting);
  return entry;
}

absl::StatusOr<ApplyJournal::Slot*> ApplyJournal::SlotFor(uint64_t bytes) {
  Slot* slot = nullptr;
  {
    common::MutexLock lock(mu_);
    for (auto& s : slots_) {
      if (!s->in_use) {
        slot = s.get();
        break;
      }
    }
    if (!slot) {
      slots_.push_back(std::make_unique<Slot>());
      slot = slots_.back().get();
      if (!dir_.empty()) {
        slot->path = absl::StrCat(dir_, "/", tag_, kSlotPrefix, slots_.size() - 1);
      }
    }
    slot->in_use = true;
  }
  if (absl::Status made = slot->Ensure(bytes); !made.ok()) {
    Release(slot);
    return made;
  }
  return slot;
}

absl::StatusOr<std::unique_ptr<ApplyJournal::Entry>> ApplyJournal::BeginSparse(
    std::vector<UndoTarget> targets, uint64_t capacity) {
  return BeginSparse(std::move(targets), std::vector<uint64_t>{capacity});
}

absl::StatusOr<std::unique_ptr<ApplyJournal::Entry>> ApplyJournal::BeginSparse(
    std::vector<UndoTarget> targets, const std::vector<uint64_t>& capacities) {
  if (capacities.empty()) return absl::InvalidArgumentError("a sparse undo record has parts");
  if (targets.size() > 255) {
    return absl::InvalidArgumentError("a sparse undo record names at most 255 buffers");
  }
  for (UndoTarget& t : targets) {
    if (t.size >= (uint64_t{1} << 40)) {
      return absl::InvalidArgumentError("a sparse undo record covers buffers under 1 TiB");
    }
    t.ranges.clear();
  }
  const uint64_t targets_table = TableBytes(targets);
  const uint64_t table = targets_table + capacities.size() * kPaddedPartWords * 8;
  const uint64_t data_offset = RoundUp(sizeof(Header) + table, kPage);
  // Each part on cache lines of its own (threads append to them at once).
  std::vector<uint64_t> begins;
  uint64_t data = 0;
  for (uint64_t c : capacities) {
    begins.push_back(data);
    data += RoundUp(c, 64);
  }
  ASSIGN_OR_RETURN(Slot * slot, SlotFor(data_offset + data));
  uint8_t* base = slot->base;
  SetState(base, kSaving);
  Header header{};
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.state = kSaving;
  header.targets = static_cast<uint32_t>(targets.size());
  header.table_bytes = table;
  header.data_offset = data_offset;
  header.data_bytes = data;
  header.kind = kSparsePartsPadded;
  header.saved = 0;
  header.parts = capacities.size();
  std::memcpy(base, &header, sizeof(header));
  WriteTable(targets, base + sizeof(Header));
  uint8_t* words = base + sizeof(Header) + targets_table;
  std::unique_ptr<Entry> entry(new Entry(this, slot, std::move(targets), 0));
  for (size_t k = 0; k < capacities.size(); ++k) {
    uint8_t* at = words + k * kPaddedPartWords * 8;
    Put(at, begins[k]);
    Put(at, capacities[k]);
    Put(at, 0);  // saved
    Part part;
    part.data_ = base + data_offset + begins[k];
    part.cursor_ = part.data_;
    part.end_ = part.data_ + capacities[k];
    part.saved_ = reinterpret_cast<std::atomic<uint64_t>*>(words + k * kPaddedPartWords * 8 + 16);
    entry->parts_.push_back(part);
  }
  // Records are appended as the Apply goes; each counts once its part's `saved` covers it.
  SetState(base, kWriting);
  return entry;
}

uint64_t ApplyJournal::Entry::undo_bytes() const {
  uint64_t bytes = undo_bytes_;
  for (const Part& part : parts_) bytes += part.undo_bytes();
  return bytes;
}

void ApplyJournal::Entry::RestoreSparse(const std::vector<bool>& skip) {
  std::vector<uint8_t*> records;
  for (const Part& part : parts_) {
    for (uint8_t* at = part.data_; at < part.cursor_;) {
      records.push_back(at);
      uint64_t word = 0;
      std::memcpy(&word, at, 8);
      at += RecordBytes(word >> 48);
    }
  }
  for (auto it = records.rbegin(); it != records.rend(); ++it) {
    uint64_t word = 0;
    std::memcpy(&word, *it, 8);
    const uint64_t offset = word & ((uint64_t{1} << 40) - 1);
    const size_t target = (word >> 40) & 0xff;
    if (target < skip.size() && skip[target]) continue;
    std::memcpy(targets_[target].data + offset, *it + 8, word >> 48);
  }
}

void ApplyJournal::Release(Slot* slot) {
  slot->Shrink();
  common::MutexLock lock(mu_);
  slot->in_use = false;
}

ApplyJournal::Entry::~Entry() {
  if (!done_) Restore();
}

void ApplyJournal::Entry::Restore(const std::vector<bool>& skip) {
  if (done_) return;
  if (!parts_.empty()) {
    RestoreSparse(skip);
  } else if (marks_ != nullptr) {
    // Folded: the pieces marked saved (the others were not written), of targets not skipped.
    plan::Plan back;
    for (size_t j = 0; j < restore_.ops.size(); ++j) {
      const plan::CopyOp& op = restore_.ops[j];
      const bool skipped = op.dst_location < skip.size() && skip[op.dst_location];
      if (skipped || __atomic_load_n(&marks_[pieces_[j]], __ATOMIC_SEQ_CST) == 0) continue;
      back.ops.push_back(op);
    }
    std::vector<uint8_t*> dst;
    for (const UndoTarget& t : targets_) dst.push_back(t.data);
    if (!back.ops.empty()) plan::ExecuteOnHost(back, {saved_}, dst);
  } else {
    uint64_t data_offset = 0;
    std::memcpy(&data_offset, slot_->base + offsetof(Header, data_offset), 8);
    CopyRanges(targets_, slot_->base + data_offset, /*save=*/false, skip);
  }
  SetState(slot_->base, kIdle);
  done_ = true;
  journal_->Release(slot_);
}

void ApplyJournal::Entry::Commit() {
  if (done_) return;
  SetState(slot_->base, kIdle);
  done_ = true;
  journal_->Release(slot_);
}

std::optional<uint64_t> ApplyJournal::Recover(const std::string& identity, uint8_t* data,
                                              uint64_t size) {
  if (identity.empty()) return std::nullopt;
  common::MutexLock lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    Pending& p = **it;
    for (Pending::Target& t : p.targets) {
      uint64_t restored = 0;
      std::memcpy(&restored, t.restored, 8);
      if (restored != 0 || t.target.identity != identity || t.target.size != size) continue;
      // Newest first: a record saved after an earlier one overlapped it holds the bytes as
      // they were after that earlier write.
      for (auto r = t.saved.rbegin(); r != t.saved.rend(); ++r) {
        std::memcpy(data + r->offset, p.base + r->file_at, r->len);
      }
      if (!t.ops.empty()) {  // folded: the marked pieces (they do not overlap)
        plan::Plan back;
        back.ops = t.ops;
        plan::ExecuteOnHost(back, {p.base}, {data});
      }
      std::atomic_thread_fence(std::memory_order_seq_cst);
      const uint64_t one = 1;
      std::memcpy(t.restored, &one, 8);
      const uint64_t prev = t.target.prev_version;
      Logger("store")->warn(
          "apply journal {}: {} restored to the bytes it held before the Apply of version {} "
          "that a killed refitd left unfinished (version {})",
          p.path, identity, t.target.version, prev);
      if (p.Done()) {
        unlink(p.path.c_str());
        pending_.erase(it);
      }
      return prev;
    }
  }
  return std::nullopt;
}

size_t ApplyJournal::PendingRecoveries() const {
  common::MutexLock lock(mu_);
  size_t n = 0;
  for (const auto& p : pending_) {
    for (const auto& t : p->targets) {
      uint64_t restored = 0;
      std::memcpy(&restored, t.restored, 8);
      n += restored == 0;
    }
  }
  return n;
}

}  // namespace refit
