#include "daemon/callers/call_budget.h"

#include <malloc.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace refit::callers {

CallBudget::Hold& CallBudget::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = other.budget_;
    uid_ = other.uid_;
    pid_ = other.pid_;
    other.budget_ = nullptr;
  }
  return *this;
}

void CallBudget::Hold::Release() {
  if (budget_) budget_->Return(uid_, pid_);
  budget_ = nullptr;
}

absl::StatusOr<CallBudget::Hold> CallBudget::Acquire(const Caller& caller, const char* what) {
  common::MutexLock lock(mu_);
  const auto process = std::make_pair(caller.uid, caller.pid);
  auto refuse = [&](const char* bound, size_t limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": ", bound, " holds ", limit, " long-lived calls (Watch, WaitForVersion, ",
        "WaitForReplicas, health Watch) already, the most refitd allows; close some or retry "
        "later (",
        caller.Describe(), ")"));
  };
  if (total_ >= limits_.total) return refuse("refitd's local callers together", limits_.total);
  if (by_uid_[caller.uid] >= limits_.per_uid) {
    return refuse("this caller's uid", limits_.per_uid);
  }
  if (caller.pid != 0 && by_process_[process] >= limits_.per_process) {
    return refuse("this client process", limits_.per_process);
  }
  ++total_;
  peak_ = std::max(peak_, total_);
  ++by_uid_[caller.uid];
  if (caller.pid != 0) ++by_process_[process];
  Hold hold;
  hold.budget_ = this;
  hold.uid_ = caller.uid;
  hold.pid_ = caller.pid;
  return hold;
}

void CallBudget::Return(uid_t uid, pid_t pid) {
  bool trim = false;
  {
    common::MutexLock lock(mu_);
    trim = ReturnLocked(uid, pid);
  }
  // The last of many long-lived calls ended: the memory their threads' malloc arenas kept goes
  // back to the system (else a burst of calls leaves refitd tens of MiB bigger for good).
  if (trim) malloc_trim(0);
}

bool CallBudget::ReturnLocked(uid_t uid, pid_t pid) {
  --total_;
  if (--by_uid_[uid] == 0) by_uid_.erase(uid);
  if (pid != 0) {
    auto it = by_process_.find({uid, pid});
    if (it != by_process_.end() && --it->second == 0) by_process_.erase(it);
  }
  if (total_ == 0 && peak_ >= kTrimAfter) {
    peak_ = 0;
    return true;
  }
  return false;
}

size_t CallBudget::held() const {
  common::MutexLock lock(mu_);
  return total_;
}

size_t CallBudget::held_by_uid(uid_t uid) const {
  common::MutexLock lock(mu_);
  auto it = by_uid_.find(uid);
  return it == by_uid_.end() ? 0 : it->second;
}

}  // namespace refit::callers
