#pragma once

// Client memory that can go away under the daemon. A client may truncate the shm object it
// registered (or unlink it and shrink it); touching the pages past the new end raises SIGBUS,
// which would kill refitd and every tenant's versions with it. Every client mapping is guarded
// here: refitd's SIGBUS handler looks the faulting address up among the guarded ranges and, when
// it lies in one, maps anonymous zero pages over the rest of that range (so the copy that faulted
// finishes, reading zeros or writing into memory nobody sees) and marks the range broken. The
// call that was copying checks Broken() afterwards and answers FAILED_PRECONDITION naming the
// buffer; nothing it produced is kept. A SIGBUS anywhere else is re-raised as before.
//
// The approach is the one Wayland compositors take with clients' wl_shm pools.
//
// Thread-safety: Guard/Unguard/Broken from any thread; the table is lock-free so the signal
// handler (on whichever thread faulted) can read it.

#include <cstddef>
#include <cstdint>

namespace refit {

// Installs the SIGBUS handler (once per process; later calls do nothing).
void InstallFaultGuard();

// A guarded range, held by the Region that maps the client's memory.
class FaultGuard {
 public:
  // Guards [begin, begin + length) (page-aligned mapping bounds). When the table is full the
  // range is not guarded (ok() false): the caller refuses the registration.
  FaultGuard(void* begin, size_t length);
  ~FaultGuard();  // unguards (before the mapping goes)
  FaultGuard(const FaultGuard&) = delete;
  FaultGuard& operator=(const FaultGuard&) = delete;

  bool ok() const { return slot_ >= 0; }
  // A SIGBUS hit this range: its bytes are not the client's any more.
  bool Broken() const;

  static constexpr int kMaxGuarded = 1 << 14;

 private:
  int slot_ = -1;
};

// SIGBUSes absorbed so far (for a metric).
uint64_t FaultGuardHits();

}  // namespace refit
