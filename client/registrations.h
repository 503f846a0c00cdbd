#pragma once

// What a Client needs to register its buffers again on a restarted refitd: each buffer's
// RegisterBufferRequest (for a sealed memfd, a dup of its fd, passed anew each time: a token
// serves one registration), by the id refitd first gave it, which callers keep using, and the
// id refitd knows it by now.
//
// Thread-safety: every method may be called from any thread.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "daemon/common/mutex.h"
#include "proto/refit/v1/refit.pb.h"

namespace refit::client {

class Registrations {
 public:
  Registrations() = default;
  Registrations(const Registrations&) = delete;
  Registrations& operator=(const Registrations&) = delete;
  ~Registrations();

  struct Entry {
    std::string first;  // the id callers hold
    std::string current;
    v1::RegisterBufferRequest request;  // memory.memfd's token to be filled in when memfd >= 0
    int memfd = -1;                     // owned here (a dup)
  };

  // Remembers the buffer `id` registered by `request`; `memfd` >= 0: a sealed memfd (dup'ed
  // here) to pass again for each registration.
  void Add(const std::string& id, const v1::RegisterBufferRequest& request, int memfd);
  // Forgets the buffer callers know as `id`; returns the id refitd knows it by (`id` itself
  // for an id not remembered here).
  std::string Remove(const std::string& id);
  // The ids refitd knows the buffers `ids` by now.
  std::string Current(const std::string& id) const;
  std::vector<std::string> Current(const std::vector<std::string>& ids) const;
  // Every remembered buffer (the memfds stay owned here: use them before the next Remove).
  std::vector<Entry> All() const;
  bool empty() const;
  // The buffer callers know as `first` is known to refitd as `now` (a registration again);
  // bumps generation().
  void Moved(const std::string& first, const std::string& now);
  // Counts the registrations again: a call made before a bump named ids that may be gone.
  uint64_t generation() const;

 private:
  mutable common::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);  // by first id
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

// One recovery from a restarted refitd at a time (Client::Recover holds `mu` while it waits for
// refitd and registers the buffers again), and how many registered the buffers again.
struct Recoveries {
  common::Mutex mu;
  uint64_t count ABSL_GUARDED_BY(mu) = 0;
};

}  // namespace refit::client
