#pragma once

// The undo journal that makes Apply all or nothing (docs/architecture.md, "Atomic Apply").
//
// Before an Apply writes a byte into an engine's DESTINATION buffer, the bytes it may overwrite
// (the destination extents of its plan, merged) are copied into a journal slot and the slot is
// marked "writing". If the Apply fails after that (a verified Apply caught a byte that did not
// land, the client's memory went away), Restore() puts the saved bytes back and the buffer is
// exactly as it was before the call. If refitd dies while a slot is "writing", the slot outlives
// it: it is a file under --state-dir (mapped shared, so every store refitd made is in the page
// cache, which a killed process does not lose). The next refitd finds it at Open and restores
// each buffer when its client registers the same memory again (Region::Identity: the shm object
// or memfd and the range), before that RegisterBuffer is answered: no call on the model sees the
// mix. Without --state-dir the slots are anonymous memory: errors are undone, a kill is not.
//
// Cost: one extra read of the overwritten bytes and one write of them into the journal (folded
// into the verified copy, BeginFolded: the write alone). The
// sparse Apply's undo is its changed elements; a full Apply's is the whole destination. Slots
// stay mapped between Applies up to kKeepBytes (an engine node holds about 1x its destination
// bytes of journal in /dev/shm): allocating and zeroing a model-sized slot per Apply made a
// full Apply 17-19x memcpy instead of 0.77x (docs/benchmarks.md, "The install").
//
// Thread-safety: every method may be called from any thread; one Entry per Apply in flight.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"
#include "daemon/plan/plan.h"

namespace refit {

// One destination buffer's part of an Apply.
struct UndoTarget {
  std::string identity;  // Region::Identity(); empty: not recoverable after a restart
  uint8_t* data = nullptr;
  uint64_t size = 0;
  uint64_t prev_version = 0;  // what the buffer held entirely before (0: not known)
  uint64_t version = 0;       // the version being applied
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [begin, end) the Apply may write; merged
};

class ApplyJournal {
 public:
  // Slots kept mapped between Applies up to this size; larger ones are truncated after use.
  static constexpr uint64_t kKeepBytes = 1ull << 40;

  // `dir` empty: anonymous memory (errors are undone, a kill is not). Otherwise the slot files
  // are /dev/shm/refit-<hash of DIR's real path>-apply-journal-N (tmpfs: a model-sized undo
  // record never goes to a disk; the same state directory finds them again after a restart),
  // or DIR/apply-journal-N where there is no /dev/shm; those a killed refitd left "writing"
  // become pending restores (Recover).
  static absl::StatusOr<std::unique_ptr<ApplyJournal>> Open(const std::string& dir);
  ~ApplyJournal();
  ApplyJournal(const ApplyJournal&) = delete;
  ApplyJournal& operator=(const ApplyJournal&) = delete;

  class Slot;

  // One part of a sparse undo record (BeginSparse): appended to by one thread. A cache line of
  // its own: the threads of one Apply save into their parts at once.
  class alignas(64) Part {
   public:
    // Saves `n` bytes of target `target` at `offset`, which the Apply is about to overwrite;
    // call it before writing there. False when the part's capacity is used up (nothing saved:
    // don't write). The record counts as saved, also for a refitd killed right after, before
    // this returns (the part's count word is stored after the bytes, in program order, in a
    // shared file mapping).
    bool Save(uint32_t target, uint64_t offset, const uint8_t* bytes, uint64_t n) {
      while (n > kMaxRecordBytes) {
        if (!Save(target, offset, bytes, kMaxRecordBytes)) return false;
        offset += kMaxRecordBytes;
        bytes += kMaxRecordBytes;
        n -= kMaxRecordBytes;
      }
      const uint64_t need = RecordBytes(n);
      if (static_cast<uint64_t>(end_ - cursor_) < need) return false;
      const uint64_t word = offset | (uint64_t{target} << 40) | (n << 48);
      __builtin_memcpy(cursor_, &word, 8);
      uint8_t* to = cursor_ + 8;
      if (n == 2) {
        __builtin_memcpy(to, bytes, 2);
      } else if (n == 1) {
        *to = *bytes;
      } else {
        __builtin_memcpy(to, bytes, n);
      }
      cursor_ += need;
      undo_bytes_ += n;
      saved_->store(static_cast<uint64_t>(cursor_ - data_), std::memory_order_release);
      return true;
    }
    // The bytes a sparse record of `n` saved bytes takes in the journal (n <= kMaxRecordBytes).
    static constexpr uint64_t RecordBytes(uint64_t n) { return 8 + (n + 7) / 8 * 8; }
    static constexpr uint64_t kMaxRecordBytes = 0xffff;
    uint64_t undo_bytes() const { return undo_bytes_; }

   private:
    friend class ApplyJournal;
    uint8_t* data_ = nullptr;    // where its records start
    uint8_t* cursor_ = nullptr;  // the next one
    uint8_t* end_ = nullptr;
    std::atomic<uint64_t>* saved_ = nullptr;  // the bytes of records saved, in the file
    uint64_t undo_bytes_ = 0;
  };

  // One Apply's undo record, saved: the Apply may write into the targets now. Dropping it
  // without Commit() restores the targets (an Apply that returns early fails whole).
  class Entry {
   public:
    ~Entry();
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    // Puts the saved bytes back into every target (skipping `skip[i]`, e.g. memory gone).
    void Restore(const std::vector<bool>& skip = {});
    // The Apply landed: the record is void.
    void Commit();
    // The bytes saved: the dense ranges, or the sparse parts' records.
    uint64_t undo_bytes() const;

    // Sparse records (BeginSparse): part `k`, for one thread to append to.
    Part& part(size_t k) { return parts_[k]; }
    size_t parts() const { return parts_.size(); }
    // Part 0's Save (a record of one part).
    bool Save(uint32_t target, uint64_t offset, const uint8_t* bytes, uint64_t n) {
      return parts_[0].Save(target, offset, bytes, n);
    }
    static constexpr uint64_t RecordBytes(uint64_t n) { return Part::RecordBytes(n); }
    static constexpr uint64_t kMaxRecordBytes = Part::kMaxRecordBytes;

    // A folded record (BeginFolded): the save area and the marks that
    // plan::ExecuteSaveAndVerifyOnHost(plan, src, dst, saved(), marks()) fills. Null otherwise.
    uint8_t* saved() const { return saved_; }
    uint8_t* marks() const { return marks_; }

   private:
    friend class ApplyJournal;
    Entry(ApplyJournal* journal, Slot* slot, std::vector<UndoTarget> targets, uint64_t undo_bytes)
        : journal_(journal), slot_(slot), targets_(std::move(targets)), undo_bytes_(undo_bytes) {}
    void RestoreSparse(const std::vector<bool>& skip);
    ApplyJournal* journal_;
    Slot* slot_;
    std::vector<UndoTarget> targets_;
    uint64_t undo_bytes_;  // dense records
    bool done_ = false;
    std::vector<Part> parts_;  // sparse records (empty: dense)
    // Folded records: the restore plan of every piece (location 0: saved_), each op's piece.
    uint8_t* saved_ = nullptr;
    uint8_t* marks_ = nullptr;
    plan::Plan restore_;
    std::vector<uint32_t> pieces_;
  };

  // Saves the bytes of `targets`' ranges (on several cores when large) and marks the record
  // writing. INTERNAL / RESOURCE_EXHAUSTED when the slot can't be made (nothing written then).
  absl::StatusOr<std::unique_ptr<Entry>> Begin(std::vector<UndoTarget> targets);

  // A sparse undo record: `targets` (their ranges unused) get records appended by
  // Entry::Save, up to `capacity` bytes of records (the sum of Entry::RecordBytes), each saved
  // just before the Apply writes there, in one pass with the writes. Restore puts the records
  // back newest first, so overlapping records (strided writes) undo exactly. Targets: at most
  // 255, each under 1 TiB (INVALID_ARGUMENT otherwise: take Begin).
  absl::StatusOr<std::unique_ptr<Entry>> BeginSparse(std::vector<UndoTarget> targets,
                                                     uint64_t capacity);
  // The same in `capacities.size()` parts (Entry::part), each with its own capacity and its
  // own saved count, so that several threads save and write at once (their records must
  // cover disjoint destination bytes: parts are restored in reverse order, each newest first).
  absl::StatusOr<std::unique_ptr<Entry>> BeginSparse(std::vector<UndoTarget> targets,
                                                     const std::vector<uint64_t>& capacities);

  // A full Apply's undo record with the save folded into the copy: the slot holds the save area
  // (Entry::saved(), plan::SavedBytes(plan) bytes), one mark per piece of work (Entry::marks(),
  // plan::SaveTasks(plan) bytes, zero) and the plan that restores each piece, and is marked
  // writing at once, with nothing saved yet: plan::ExecuteSaveAndVerifyOnHost(plan, src, dst,
  // saved(), marks()) saves each piece and marks it before writing it (no separate save pass: the
  // save reads each destination line the verified copy reads anyway). Restore, and a restart's
  // Recover after a kill, put back only the marked pieces: the others were not written. The
  // plan's destinations must not overlap (BuildPlan writes each element once). `targets`' ranges
  // are unused. INTERNAL / RESOURCE_EXHAUSTED when the slot can't be made.
  absl::StatusOr<std::unique_ptr<Entry>> BeginFolded(std::vector<UndoTarget> targets,
                                                     const plan::Plan& plan);

  // A buffer registered with `identity` (its memory at `data`, `size` bytes): when a killed
  // refitd left an Apply into it unfinished, restores the bytes it held before that Apply and
  // returns the version it held then (0: not known). nullopt: nothing to restore.
  std::optional<uint64_t> Recover(const std::string& identity, uint8_t* data, uint64_t size);

  // Records a killed refitd left that are still waiting for their buffer to register.
  size_t PendingRecoveries() const;
  const std::string& dir() const { return dir_; }
  const std::string& tag() const { return tag_; }

 private:
  struct Pending;
  explicit ApplyJournal(std::string dir);
  absl::StatusOr<Slot*> SlotFor(uint64_t bytes);
  void Release(Slot* slot);

  std::string dir_;  // where the slot files are: /dev/shm, else the state directory
  std::string tag_;  // their names' prefix there (naming the state directory in /dev/shm)
  mutable common::Mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Pending>> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
