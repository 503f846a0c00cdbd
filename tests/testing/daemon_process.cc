#include "tests/testing/daemon_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"

namespace refit::testing {
namespace {

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::string RunfilePath(const std::string& workspace_relative) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir && workspace) return absl::StrCat(srcdir, "/", workspace, "/", workspace_relative);
  return workspace_relative;  // run by hand from the bazel-bin directory
}

std::string UniqueShmName(const std::string& tag) {
  // Bazel runs tests in their own PID namespaces over one /dev/shm: the pid alone can collide.
  static const uint64_t nonce = std::random_device{}() ^ (static_cast<uint64_t>(getpid()) << 20);
  static std::atomic<int> counter{0};
  return absl::StrCat("/refit-test-", absl::Hex(nonce), "-", tag, "-", counter++);
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(
    const std::vector<std::string>& extra_args, const std::string& socket,
    const std::vector<std::string>& env, const std::vector<std::string>& wrapper) {
  std::unique_ptr<DaemonProcess> d(new DaemonProcess());
  char dir_template[] = "/tmp/refit-test-XXXXXX";  // short: Unix socket paths are limited
  if (!mkdtemp(dir_template)) return absl::InternalError("mkdtemp failed");
  d->dir_ = dir_template;
  d->socket_ = socket.empty() ? d->dir_ + "/run/refitd.sock" : socket;

  // Fault switches and test knobs act only in the test build of refitd.
  std::string binary = RunfilePath("daemon/refitd");
  for (const std::string& e : env) {
    if (e.rfind("REFIT_FAULT_", 0) == 0 || e.rfind("REFIT_TEST_", 0) == 0) {
      binary = RunfilePath("daemon/refitd_testing");
    }
  }
  for (const std::string& e : env) {
    if (e.rfind("REFIT_TEST_BINARY=", 0) == 0) binary = e.substr(e.find('=') + 1);
  }
  std::vector<std::string> args = wrapper;
  args.insert(args.end(), {binary, "--socket=" + d->socket_, "--log-level=debug"});
  const bool has_listen = std::any_of(extra_args.begin(), extra_args.end(),
                                      [](const auto& a) { return a.rfind("--listen=", 0) == 0; });
  if (!has_listen) args.push_back("--listen=127.0.0.1:0");
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  // Only async-signal-safe calls between fork and exec: this process has gRPC threads.
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
  env_strings.insert(env_strings.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  d->pid_ = pid;

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    if (!d->running()) {
      return absl::InternalError(
          absl::StrCat("refitd exited with ", d->exit_code_, " during start"));
    }
    struct stat st;
    if (stat(d->socket_.c_str(), &st) == 0) {
      // Ready once a Status call is answered (a connection alone may be a stale one).
      auto client = client::Client::Connect(d->socket_, std::chrono::milliseconds(500));
      if (client.ok()) {
        (*client)->set_call_timeout(std::chrono::milliseconds(1000));
        if ((*client)->Status().ok()) return d;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError("refitd did not start serving within 20 s");
}

DaemonProcess::~DaemonProcess() {
  if (running()) Stop(SIGKILL, 10);
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

bool DaemonProcess::running() {
  if (pid_ <= 0 || exit_code_ != -1) return false;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exit_code_ = DecodeWaitStatus(status);
    return false;
  }
  return r == 0;
}

absl::StatusOr<std::unique_ptr<client::Client>> DaemonProcess::Connect() const {
  return client::Client::Connect(socket_, std::chrono::seconds(5));
}

int DaemonProcess::Stop(int signal, double timeout_s) {
  if (!running()) return exit_code_;
  kill(pid_, signal);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  while (std::chrono::steady_clock::now() < deadline) {
    if (!running()) return exit_code_;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  exit_code_ = DecodeWaitStatus(status);
  return -1;
}

CommandResult RunCommand(const std::vector<std::string>& argv_in) {
  CommandResult result;
  char out_template[] = "/tmp/refit-cmd-out-XXXXXX";
  char err_template[] = "/tmp/refit-cmd-err-XXXXXX";
  int out_fd = mkstemp(out_template);
  int err_fd = mkstemp(err_template);
  std::vector<std::string> copy = argv_in;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  close(out_fd);
  close(err_fd);
  result.exit_code = DecodeWaitStatus(status);
  result.out = ReadFile(out_template);
  result.err = ReadFile(err_template);
  unlink(out_template);
  unlink(err_template);
  return result;
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(
    const std::vector<std::string>& argv_in) {
  int in_pipe[2], out_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0) return absl::InternalError("pipe");
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    close(in_pipe[0]);
    close(in_pipe[1]);
    return absl::InternalError("pipe");
  }
  std::vector<std::string> copy = argv_in;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork");
  if (pid == 0) {
    dup2(in_pipe[0], 0);
    dup2(out_pipe[1], 1);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(in_pipe[0]);
  close(out_pipe[1]);
  std::unique_ptr<ChildProcess> child(new ChildProcess());
  child->pid_ = pid;
  child->in_fd_ = in_pipe[1];
  child->out_fd_ = out_pipe[0];
  return child;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) Stop(SIGKILL);
  CloseStdin();
  if (out_fd_ >= 0) close(out_fd_);
}

absl::StatusOr<std::string> ChildProcess::ReadLine(double timeout_s) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1000));
  while (true) {
    const size_t newline = buffered_.find('\n');
    if (newline != std::string::npos) {
      std::string line = buffered_.substr(0, newline);
      buffered_.erase(0, newline + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return absl::DeadlineExceededError("no line from the child");
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(out_fd_, chunk, sizeof(chunk));
    if (n <= 0) return absl::UnavailableError("the child closed its output: " + buffered_);
    buffered_.append(chunk, static_cast<size_t>(n));
  }
}

void ChildProcess::CloseStdin() {
  if (in_fd_ >= 0) close(in_fd_);
  in_fd_ = -1;
}

int ChildProcess::Stop(int signal) {
  if (pid_ <= 0) return -1;
  kill(pid_, signal);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return DecodeWaitStatus(status);
}

absl::StatusOr<DaemonPair> StartPair(const std::vector<std::string>& trainer_args,
                                     std::vector<std::string> engine_args,
                                     const std::vector<std::string>& trainer_env,
                                     const std::vector<std::string>& engine_env) {
  DaemonPair pair;
  auto trainer = DaemonProcess::Start(trainer_args, "", trainer_env);
  if (!trainer.ok()) return trainer.status();
  pair.trainer = std::move(trainer).value();
  auto trainer_client = pair.trainer->Connect();
  if (!trainer_client.ok()) return trainer_client.status();
  pair.trainer_client = std::move(trainer_client).value();
  auto status = pair.trainer_client->Status();
  if (!status.ok()) return status.status();
  engine_args.push_back(absl::StrCat("--peers=127.0.0.1:", status->listen_port()));
  auto engine = DaemonProcess::Start(engine_args, "", engine_env);
  if (!engine.ok()) return engine.status();
  pair.engine = std::move(engine).value();
  auto engine_client = pair.engine->Connect();
  if (!engine_client.ok()) return engine_client.status();
  pair.engine_client = std::move(engine_client).value();
  return pair;
}

absl::StatusOr<v1::ModelStatus> ModelStatusOf(client::Client& client, const std::string& model) {
  auto status = client.Status();
  if (!status.ok()) return status.status();
  for (const v1::ModelStatus& m : status->models()) {
    if (m.model() == model) return m;
  }
  return absl::NotFoundError(absl::StrCat("Status lists no model ", model));
}

}  // namespace refit::testing
