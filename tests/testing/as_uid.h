#pragma once

// Runs a test binary under another uid (setpriv) against a refitd socket: the binary is copied
// into a /tmp folder every uid can read (Bazel's output tree is root's alone), removed when the
// AsUid goes. Used by the local-trust, memfd and hostile-caller tests.
//
// Not thread-safe; one test thread owns each AsUid.

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/testing/daemon_process.h"

namespace refit::testing {

class AsUid {
 public:
  // `runfile`: the binary's runfile path, e.g. "tests/testing/as_client".
  explicit AsUid(const std::string& runfile);
  ~AsUid();
  AsUid(const AsUid&) = delete;
  AsUid& operator=(const AsUid&) = delete;

  // The copy other uids run.
  const std::string& binary() const { return binary_; }
  // `binary() socket args...` as `uid` (gid `uid`, no supplementary groups).
  std::vector<std::string> Argv(uid_t uid, const std::string& socket,
                                const std::vector<std::string>& args) const;
  // Runs it to completion as `uid`; fails the test unless it exits 0; its stdout.
  std::string Run(uid_t uid, const std::string& socket, const std::vector<std::string>& args) const;
  // Starts it as `uid` and leaves it running (e.g. as_client's "hold").
  std::unique_ptr<ChildProcess> Spawn(uid_t uid, const std::string& socket,
                                      const std::vector<std::string>& args) const;

 private:
  std::string dir_, binary_;
};

// Lets every uid reach `socket` through /tmp (refitd's own policy decides who may use it).
void OpenSocketToAll(const std::string& socket);

}  // namespace refit::testing
