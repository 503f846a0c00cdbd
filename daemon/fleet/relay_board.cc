#include "daemon/fleet/relay_board.h"

#include <set>

namespace refit::fleet {

void RelayBoard::Begin(const RelayKey& key, std::shared_ptr<Region> slot, uint64_t bytes,
                       Ranges planned) {
  {
    common::MutexLock lock(mu_);
    Entry& e = entries_[key];
    e.slot = std::move(slot);
    e.bytes = bytes;
    e.planned = std::move(planned);
    e.landed.clear();
    e.state = RelayState::kPulling;
    // Forget pieces of this model's older versions beyond the newest kVersionsKept.
    std::set<uint64_t> versions;
    for (const auto& [k, entry] : entries_) {
      if (k.model == key.model) versions.insert(k.version);
    }
    while (versions.size() > static_cast<size_t>(kVersionsKept)) {
      const uint64_t oldest = *versions.begin();
      versions.erase(versions.begin());
      for (auto it = entries_.begin(); it != entries_.end();) {
        it = it->first.model == key.model && it->first.version == oldest ? entries_.erase(it)
                                                                         : std::next(it);
      }
    }
  }
  changed_.NotifyAll();
}

void RelayBoard::Landed(const RelayKey& key, uint64_t offset, uint64_t length) {
  {
    common::MutexLock lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.state != RelayState::kPulling) return;
    it->second.landed.emplace_back(offset, offset + length);
  }
  changed_.NotifyAll();
}

void RelayBoard::End(const std::string& model, uint64_t version, bool complete) {
  {
    common::MutexLock lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->first.model == model && it->first.version == version) {
        if (!complete) {
          it = entries_.erase(it);  // readers holding a view keep the slot until they let go
          continue;
        }
        it->second.state = RelayState::kComplete;
      }
      ++it;
    }
  }
  changed_.NotifyAll();
}

void RelayBoard::Retire(const std::string& model, uint64_t version) {
  std::vector<std::shared_ptr<Region>> going;  // let go outside the lock
  {
    common::MutexLock lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->first.model == model && it->first.version < version) {
        going.push_back(std::move(it->second.slot));
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
  }
  changed_.NotifyAll();
}

absl::StatusOr<RelayView> RelayBoard::Wait(const RelayKey& key, size_t cursor,
                                           std::chrono::steady_clock::time_point deadline) {
  common::UniqueLock lock(mu_);
  bool seen = false;
  while (true) {
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      seen = true;
      const Entry& e = it->second;
      if (e.landed.size() > cursor || e.state != RelayState::kPulling ||
          std::chrono::steady_clock::now() >= deadline) {
        RelayView view;
        view.slot = e.slot;
        view.bytes = e.bytes;
        view.planned = e.planned;
        if (cursor < e.landed.size()) {
          view.landed.assign(e.landed.begin() + static_cast<long>(cursor), e.landed.end());
        }
        view.cursor = e.landed.size();
        view.state = e.state;
        return view;
      }
    } else if (seen) {
      RelayView failed;
      failed.state = RelayState::kFailed;  // the pull failed and its entry went
      failed.cursor = cursor;
      return failed;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::NotFoundError("this node is not pulling that piece of that version");
    }
    changed_.WaitUntil(lock, deadline);
  }
}

}  // namespace refit::fleet
