#pragma once

// Where the undo journal of a --state-dir keeps its files (apply_journal.h): in /dev/shm, named
// refit-<std::hash of the directory's real path, hex>-apply-{journal,recover}-<n>, so that the
// Apply's saves go to memory and a refitd restarted on the same directory finds them. The one
// place that names them: ApplyJournal::Open, and the tests that clean up after a state directory
// they remove (a killed refitd's files outlive it). Header-only, no dependencies.

#include <cstdio>
#include <functional>
#include <string>

namespace refit {

// The prefix every journal file of the state directory whose real path is `real_dir` starts
// with (in /dev/shm).
inline std::string JournalFilesTag(const std::string& real_dir) {
  char tag[48];
  std::snprintf(tag, sizeof(tag), "refit-%zx-", std::hash<std::string>{}(real_dir));
  return tag;
}

inline constexpr const char* kJournalSlotPrefix = "apply-journal-";
inline constexpr const char* kJournalRecoverPrefix = "apply-recover-";

}  // namespace refit
