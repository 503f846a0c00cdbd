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
// Cost: one extra read of the overwritten bytes and one write of them into the journal. The
// sparse Apply's undo is its changed elements; a full Apply's is the whole destination. Slots
// stay mapped between Applies up to kKeepBytes (an engine node holds about 1x its destination
// bytes of journal in /dev/shm): allocating and zeroing a model-sized slot per Apply made a
// full Apply 17-19x memcpy instead of 0.77x (docs/benchmarks.md, "The install").
//
// Thread-safety: every method may be called from any thread; one Entry per Apply in flight.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"

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
    uint64_t undo_bytes() const { return undo_bytes_; }

   private:
    friend class ApplyJournal;
    Entry(ApplyJournal* journal, Slot* slot, std::vector<UndoTarget> targets, uint64_t undo_bytes)
        : journal_(journal), slot_(slot), targets_(std::move(targets)), undo_bytes_(undo_bytes) {}
    ApplyJournal* journal_;
    Slot* slot_;
    std::vector<UndoTarget> targets_;
    uint64_t undo_bytes_;
    bool done_ = false;
  };

  // Saves the bytes of `targets`' ranges (on several cores when large) and marks the record
  // writing. INTERNAL / RESOURCE_EXHAUSTED when the slot can't be made (nothing written then).
  absl::StatusOr<std::unique_ptr<Entry>> Begin(std::vector<UndoTarget> targets);

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
  void Release(Slot* slot);

  std::string dir_;  // where the slot files are: /dev/shm, else the state directory
  std::string tag_;  // their names' prefix there (naming the state directory in /dev/shm)
  mutable common::Mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Pending>> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
