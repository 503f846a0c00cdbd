#pragma once

// Runs tests/testing/hostile_client under other uids (setpriv) for the hostile-caller tests,
// and reads refitd's threads and descriptors from /proc.
//
// Not thread-safe; one test thread owns each Hostile.

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/testing/as_uid.h"
#include "tests/testing/daemon_process.h"

namespace refit::testing {

// hostile_client (and as_client) copied where other uids can run them (AsUid).
class Hostile {
 public:
  Hostile();

  // A hostile_client left running as `uid` (it holds what it opened until `child` goes), with
  // the line it printed.
  struct Held {
    std::unique_ptr<ChildProcess> child;
    std::string line;
  };
  Held Hold(uid_t uid, const std::string& socket, const std::vector<std::string>& args) const;
  // Runs one as `uid` to completion; returns its line.
  std::string Run(uid_t uid, const std::string& socket, const std::vector<std::string>& args) const;
  const AsUid& hostile_client() const { return hostile_client_; }
  const AsUid& as_client() const { return as_client_; }  // tests/testing/as_client

 private:
  AsUid hostile_client_, as_client_;
};

// "OK open=3 exhausted=2" -> {"open": 3, "exhausted": 2}.
std::map<std::string, int> ParseCounts(const std::string& line);
// One value of such a line (-1 if missing).
int ParseCounts(const std::string& line, const std::string& key);

// Threads, open descriptors and resident kilobytes of process `pid` (-1 if unknown).
long ThreadsOf(pid_t pid);
long FdsOf(pid_t pid);
long RssKiBOf(pid_t pid);

}  // namespace refit::testing
