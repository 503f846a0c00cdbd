#pragma once

// Starts real refitd processes for integration tests: each on its own temporary socket and on
// TCP port 0, each stopped (SIGKILL if need be) and cleaned up when the handle goes away.
//
// Not thread-safe; one test thread owns each handle.

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/refit_client.h"

namespace refit::testing {

// Path of a binary built by Bazel and listed in the test's `data`, e.g. "daemon/refitd".
std::string RunfilePath(const std::string& workspace_relative);

// A unique POSIX shm name for this test process.
std::string UniqueShmName(const std::string& tag);

class DaemonProcess {
 public:
  // Starts refitd with --socket in a fresh temporary directory, --listen=127.0.0.1:0 and
  // `extra_args`; returns once the socket answers (or an error after 20 s).
  // With `socket` set, serves that path instead of one in a fresh directory.
  // `env` entries ("NAME=value") are added to the daemon's environment. With a fault switch or
  // test knob among them (REFIT_FAULT_..., REFIT_TEST_...) it runs daemon/refitd_testing (list
  // it in the test's data), the only build in which they act; REFIT_TEST_BINARY=PATH runs PATH.
  // `wrapper` (e.g. {"/usr/sbin/ip", "netns", "exec", "ns1"}) is run with refitd's command line.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(
      const std::vector<std::string>& extra_args = {}, const std::string& socket = "",
      const std::vector<std::string>& env = {}, const std::vector<std::string>& wrapper = {});
  ~DaemonProcess();

  const std::string& socket() const { return socket_; }
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }
  bool running();

  absl::StatusOr<std::unique_ptr<client::Client>> Connect() const;

  // Sends `signal` and waits up to `timeout_s` for the exit. Returns the exit code, or 128 +
  // the signal number when the process was killed by a signal, or -1 after a timeout (the
  // process is then SIGKILLed).
  int Stop(int signal, double timeout_s = 20);

 private:
  DaemonProcess() = default;

  pid_t pid_ = -1;
  int exit_code_ = -1;
  std::string dir_;
  std::string socket_;
};

// Runs a command to completion; returns its exit code and standard output.
struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};
CommandResult RunCommand(const std::vector<std::string>& argv);

// Two refitd: a trainer's node and an engine's node peered with it (--peers), each started
// with its `args` (and `env`, as DaemonProcess::Start takes it) and connected.
struct DaemonPair {
  std::unique_ptr<DaemonProcess> trainer;
  std::unique_ptr<DaemonProcess> engine;
  std::unique_ptr<client::Client> trainer_client;
  std::unique_ptr<client::Client> engine_client;
};
absl::StatusOr<DaemonPair> StartPair(const std::vector<std::string>& trainer_args,
                                     std::vector<std::string> engine_args,
                                     const std::vector<std::string>& trainer_env = {},
                                     const std::vector<std::string>& engine_env = {});

// The Status entry of `model` on the daemon `client` talks to; NOT_FOUND when it lists none.
absl::StatusOr<v1::ModelStatus> ModelStatusOf(client::Client& client, const std::string& model);

// A command left running: its standard input and output are pipes to the test. SIGKILLed and
// reaped when the handle goes away.
class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(const std::vector<std::string>& argv);
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  // The next line of its standard output (without the newline); an error at EOF or after
  // `timeout_s`.
  absl::StatusOr<std::string> ReadLine(double timeout_s = 20);
  void CloseStdin();
  // Sends `signal` and waits for the exit; returns what RunCommand's exit_code would say.
  int Stop(int signal);

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  int in_fd_ = -1;
  int out_fd_ = -1;
  std::string buffered_;
};

}  // namespace refit::testing
