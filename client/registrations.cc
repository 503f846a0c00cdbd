#include "client/registrations.h"

#include <fcntl.h>
#include <unistd.h>

namespace refit::client {

Registrations::~Registrations() {
  for (auto& [id, entry] : entries_) {
    if (entry.memfd >= 0) close(entry.memfd);
  }
}

void Registrations::Add(const std::string& id, const v1::RegisterBufferRequest& request,
                        int memfd) {
  const int owned = memfd >= 0 ? fcntl(memfd, F_DUPFD_CLOEXEC, 0) : -1;
  if (memfd >= 0 && owned < 0) return;  // out of fds: this one won't be registered again
  common::MutexLock lock(mu_);
  auto [it, added] = entries_.try_emplace(id);
  Entry& entry = it->second;
  if (!added) {
    // refitd gave an id it gave before (the same memory again): still one buffer.
    if (owned >= 0) close(owned);
    return;
  }
  entry.first = id;
  entry.current = id;
  entry.request = request;
  entry.memfd = owned;
}

std::string Registrations::Remove(const std::string& id) {
  common::MutexLock lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return id;
  std::string current = it->second.current;
  if (it->second.memfd >= 0) close(it->second.memfd);
  entries_.erase(it);
  return current;
}

std::string Registrations::Current(const std::string& id) const {
  common::MutexLock lock(mu_);
  auto it = entries_.find(id);
  return it == entries_.end() ? id : it->second.current;
}

std::vector<std::string> Registrations::Current(const std::vector<std::string>& ids) const {
  common::MutexLock lock(mu_);
  std::vector<std::string> out;
  out.reserve(ids.size());
  for (const std::string& id : ids) {
    auto it = entries_.find(id);
    out.push_back(it == entries_.end() ? id : it->second.current);
  }
  return out;
}

std::vector<Registrations::Entry> Registrations::All() const {
  common::MutexLock lock(mu_);
  std::vector<Entry> out;
  for (const auto& [id, entry] : entries_) out.push_back(entry);
  return out;
}

bool Registrations::empty() const {
  common::MutexLock lock(mu_);
  return entries_.empty();
}

void Registrations::Moved(const std::string& first, const std::string& now) {
  common::MutexLock lock(mu_);
  auto it = entries_.find(first);
  if (it != entries_.end()) it->second.current = now;
  ++generation_;
}

uint64_t Registrations::generation() const {
  common::MutexLock lock(mu_);
  return generation_;
}

}  // namespace refit::client
