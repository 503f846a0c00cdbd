// A peer SIGKILLed mid-stream never takes the survivor with it (UCX over tcp, peer-failure
// handling on): round after round, a child process (ucx_kill_peer) reads the survivor's buffer
// with checked reads as fast as it can while the survivor reads the child's, and is killed
// while replies are queued on the survivor's sockets. The survivor must notice, fail only that
// endpoint's ops, drain every reply it was sending, and go on serving: a last child reads
// every byte back and checks it.
//
// What this catches: UCX 1.13's tcp transport completes a zero-copy send twice when the socket
// fails under it (uct_tcp_ep_sendv: uct_tcp_ep_handle_send_err purges the send, then sendv
// completes it again), which aborts the process ("uct_iface.h:884 Assertion `comp->count > 0'
// ... status=-80"), within the first three rounds here. UcxTransport's DefaultConfig turns
// zero-copy sends off where tcp may carry the data plane (ZCOPY_THRESH=inf, ucx_options.cc); with
// REFIT_TEST_TCP_ZCOPY=1 this test puts them back, to show the abort.
//
// And: UCX 1.13 asserts when it purges a failed tcp ep whose pending queue holds a wire-up reply
// ("ucp_request.c:684 Assertion ... got REP message"): a peer killed after its wire-up request
// reached us and before it acknowledged the tcp connection our reply goes on. ucx_tcp_purge.cc
// keeps such messages from UCX's purge; the third case stops the peer in that window every round
// (it aborts in round 0 with REFIT_TEST_UCX_PURGE_FILTER=0).

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "daemon/transport/testing/peer_process.h"
#include "daemon/transport/ucx/ucx_internal.h"
#include "daemon/transport/ucx/ucx_transport.h"

extern char** environ;

namespace refit::transport {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint64_t kBytes = 64ull << 20;  // the survivor's buffer
constexpr uint64_t kSeed = 0x73757276;    // "surv"
constexpr uint64_t kChunk = 4ull << 20;
constexpr int kDepth = 4;  // the survivor's reads of the child in flight
constexpr uint64_t kChildBytes = 32ull << 20;
constexpr uint64_t kChildSeed = 0x6b696c6c;  // ucx_kill_peer's kOwnSeed

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir && workspace) return absl::StrCat(srcdir, "/", workspace, "/", path);
  return path;
}

// A ucx_kill_peer child: its stdout is a pipe we read lines from while the survivor polls.
class Child {
 public:
  Child(const std::string& address, const std::string& descriptor, const std::string& extra) {
    int fds[2];
    REQUIRE(pipe2(fds, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    const std::string binary = Runfile("daemon/transport/ucx/ucx_kill_peer");
    std::vector<std::string> args = {binary, absl::BytesToHexString(address),
                                     absl::BytesToHexString(descriptor), std::to_string(kSeed)};
    if (!extra.empty()) args.push_back(extra);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    fd_ = fds[0];
    INFO(binary << ": " << std::strerror(rc));
    REQUIRE(rc == 0);
    fcntl(fd_, F_SETFL, O_NONBLOCK);
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    close(fd_);
  }
  pid_t pid() const { return pid_; }
  // The next line of its stdout, if one is complete.
  bool Line(std::string* line) {
    char buffer[4096];
    ssize_t n;
    while ((n = read(fd_, buffer, sizeof(buffer))) > 0) out_.append(buffer, n);
    const size_t end = out_.find('\n');
    if (end == std::string::npos) return false;
    *line = out_.substr(0, end);
    out_.erase(0, end + 1);
    return true;
  }
  void Kill() {
    REQUIRE(kill(pid_, SIGKILL) == 0);
    REQUIRE(waitpid(pid_, nullptr, 0) == pid_);
    pid_ = -1;
  }
  // Its exit status once exited, or -1 while it runs.
  int Exited() {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return -1;
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string out_;
};

int Rounds() {
  int rounds = 24;
  const char* env = std::getenv("REFIT_TEST_KILL_ROUNDS");
  if (env != nullptr) REQUIRE(absl::SimpleAtoi(env, &rounds));
  return rounds;
}

// When a round kills its child.
enum class Phase {
  kMidStream,   // both directions busy (every other round stopped first: replies back up)
  kConnecting,  // 0-20 ms after it started connecting: wireup messages in flight both ways
};

// The surviving transport, its pattern-filled buffer and where its own reads land.
class Survivor {
 public:
  Survivor() {
    UcxTransport::Options options;
    if (const char* zcopy = std::getenv("REFIT_TEST_TCP_ZCOPY"); zcopy && *zcopy == '1') {
      // UCX's own default (tcp's zero-copy sends on): shows the abort this test is for.
      for (auto it = options.config.begin(); it != options.config.end();) {
        it = it->first == "ZCOPY_THRESH" ? options.config.erase(it) : it + 1;
      }
    }
    auto made = UcxTransport::Create(options);
    INFO(made.status().ToString());
    REQUIRE(made.ok());
    transport_ = std::move(*made);
    auto memory = transport_->AllocateMemory(kBytes);
    REQUIRE(memory.ok());
    memory_ = std::move(*memory);
    FillPattern(static_cast<uint8_t*>(memory_->address()), kBytes, kSeed, 0);
    auto landing = transport_->AllocateMemory(kChunk * kDepth);
    REQUIRE(landing.ok());
    landing_ = std::move(*landing);
  }
  ~Survivor() {
    landing_.reset();
    memory_.reset();
  }

  void Poll() {
    completions_.clear();
    transport_->Poll(&completions_);
  }

  // One child, killed in `phase`; the survivor must notice, fail only that endpoint's ops and
  // let go of everything it was sending it.
  void Round(Phase phase, int round) {
    INFO("round " << round << (phase == Phase::kMidStream ? ", mid-stream" : ", connecting"));
    Child child(transport_->LocalAddress(), memory_->descriptor(), "");
    std::string address, descriptor;
    auto deadline = Clock::now() + std::chrono::seconds(30);
    while (!child.Line(&address) && Clock::now() < deadline) {
      Poll();
      std::this_thread::sleep_for(milliseconds(1));
    }
    while (!child.Line(&descriptor) && Clock::now() < deadline) Poll();
    REQUIRE(!descriptor.empty());
    auto ep = transport_->Connect(absl::HexStringToBytes(address));
    REQUIRE(ep.ok());
    auto remote = (*ep)->ImportRemote(absl::HexStringToBytes(descriptor));
    REQUIRE(remote.ok());
    uint64_t next = 0, read_ok = 0;
    auto post = [&](int slot) {
      const uint64_t chunk = next++ % (kChildBytes / kChunk);
      return (*ep)->PostGet(*landing_, slot * kChunk, **remote, chunk * kChunk, kChunk,
                            (chunk << 8) | static_cast<uint64_t>(slot));
    };
    for (int slot = 0; slot < kDepth; ++slot) REQUIRE(post(slot).ok());
    bool killed = false;
    auto take = [&] {
      for (const Completion& c : completions_) {
        if (!c.status.ok()) {
          INFO(c.status.ToString());
          REQUIRE(killed);
          REQUIRE((absl::IsUnavailable(c.status) || absl::IsCancelled(c.status)));
          ++failed_ops_;
          continue;
        }
        const int slot = static_cast<int>(c.cookie & 0xff);
        const auto* at = static_cast<const uint8_t*>(landing_->address()) + slot * kChunk;
        REQUIRE(FindPatternMismatch(at, kChunk, kChildSeed, (c.cookie >> 8) * kChunk) < 0);
        ++read_ok;
        if (!killed && (*ep)->status().ok()) REQUIRE(post(slot).ok());
      }
    };
    if (phase == Phase::kConnecting) {
      // Both sides are still wiring up: its requests to us, ours to it, the replies.
      const auto until = Clock::now() + milliseconds(round % 21);
      while (Clock::now() < until) {
        Poll();
        take();
      }
    } else {
      // Both directions busy: the child has had replies from us, and we from it.
      const uint64_t served_before = transport_->gathers_served();
      deadline = Clock::now() + std::chrono::seconds(30);
      while ((transport_->gathers_served() < served_before + 8 || read_ok < 2) &&
             Clock::now() < deadline) {
        Poll();
        take();
        if (child.Exited() != -1) FAIL("the child died before it was killed");
      }
      REQUIRE(transport_->gathers_served() >= served_before + 8);
      // Kill it while our replies queue on its sockets: every other round it is stopped
      // first, so they back up until the socket is full (a send left half-written).
      if (round % 2 == 1) {
        REQUIRE(kill(child.pid(), SIGSTOP) == 0);
        for (auto until = Clock::now() + milliseconds(150); Clock::now() < until;) {
          Poll();
          take();
        }
      }
    }
    killed = true;
    child.Kill();
    deadline = Clock::now() + std::chrono::seconds(20);
    while (((*ep)->status().ok() || (*ep)->outstanding() != 0) && Clock::now() < deadline) {
      Poll();
      take();
    }
    INFO((*ep)->status().ToString());
    REQUIRE(absl::IsUnavailable((*ep)->status()));
    REQUIRE((*ep)->outstanding() == 0);
    remote->reset();
    ep->reset();
    bool idle = false;
    while (!(idle = transport_->PrepareToSleep()) && Clock::now() < deadline) Poll();
    REQUIRE(idle);  // nothing of the dead peer's left in flight
  }

  // A child that connects to us and is stopped once its wire-up request has reached us, before
  // it can acknowledge the tcp connection our reply needs: our reply waits in the tcp ep's
  // pending queue until the child is killed (the trainer's abort of fleet_sites_test, where a
  // node falling back to the trainer was killed just after it connected).
  // Returns whether the round hit the window (the purge kept a wire-up message of ours): how
  // long the child takes to send its request depends on the machine's load, so the caller
  // varies `settle` from round to round.
  bool RoundReplyPending(int round, milliseconds settle) {
    INFO("round " << round << ", our wire-up reply pending, settle " << settle.count() << " ms");
    Child child(transport_->LocalAddress(), memory_->descriptor(), "");
    std::string address, descriptor;
    auto deadline = Clock::now() + std::chrono::seconds(30);
    // Not polling: its connection waits in our listen backlog.
    while (!child.Line(&descriptor) && Clock::now() < deadline) {
      if (address.empty()) child.Line(&address);
      std::this_thread::sleep_for(milliseconds(1));
    }
    REQUIRE(!descriptor.empty());
    const uint64_t dropped_before = TcpPurgeDroppedWireupMessages();
    Poll();  // accept it: its wire-up request and first gathers come next
    std::this_thread::sleep_for(settle);
    REQUIRE(kill(child.pid(), SIGSTOP) == 0);
    for (auto until = Clock::now() + milliseconds(100); Clock::now() < until;) Poll();
    child.Kill();
    for (auto until = Clock::now() + milliseconds(300); Clock::now() < until;) Poll();
    REQUIRE(completions_.empty());  // nothing of ours was posted to it
    const bool hit = TcpPurgeDroppedWireupMessages() > dropped_before;
    deadline = Clock::now() + std::chrono::seconds(20);
    bool idle = false;
    while (!(idle = transport_->PrepareToSleep()) && Clock::now() < deadline) Poll();
    REQUIRE(idle);
    return hit;
  }

  // Still serving: a child reads every byte (twice) and checks it.
  void Verify() {
    INFO(failed_ops_ << " of the survivor's reads failed with their peer");
    Child verifier(transport_->LocalAddress(), memory_->descriptor(),
                   "--verify=" + std::to_string(2 * kBytes / kChunk));
    int status = -1;
    for (auto deadline = Clock::now() + std::chrono::seconds(120);
         (status = verifier.Exited()) == -1 && Clock::now() < deadline;) {
      Poll();
      REQUIRE(completions_.empty());
    }
    REQUIRE(status == 0);
  }

 private:
  std::unique_ptr<UcxTransport> transport_;
  std::unique_ptr<LocalMemory> memory_;
  std::unique_ptr<LocalMemory> landing_;
  std::vector<Completion> completions_;
  uint64_t failed_ops_ = 0;
};

TEST_CASE(
    "ucx over tcp: a peer SIGKILLed mid-stream, round after round, never takes the "
    "survivor with it",
    "[transport][ucx][kill]") {
  Survivor survivor;
  for (int round = 0, rounds = Rounds(); round < rounds; ++round) {
    survivor.Round(Phase::kMidStream, round);
  }
  survivor.Verify();
}

TEST_CASE(
    "ucx over tcp: a peer SIGKILLed while both sides connect, round after round, never takes "
    "the survivor with it",
    "[transport][ucx][kill]") {
  Survivor survivor;
  for (int round = 0, rounds = Rounds(); round < rounds; ++round) {
    survivor.Round(Phase::kConnecting, round);
  }
  survivor.Verify();
}

TEST_CASE(
    "ucx over tcp: a peer SIGKILLed while our wire-up reply to it waits for its tcp "
    "acknowledgement never takes the survivor with it",
    "[transport][ucx][kill]") {
  // UCX 1.13 (Debian 12's): the abort is possible; REFIT_TEST_UCX_PURGE_FILTER=0 shows it.
  const char* off = std::getenv("REFIT_TEST_UCX_PURGE_FILTER");
  const bool filter = !(off != nullptr && std::string(off) == "0");
  REQUIRE(TcpPurgeWorkaroundActive() == filter);
  // On a loaded machine the child may not have sent its request within the settle time (no
  // reply of ours yet), or may have acknowledged our reply already (none pending): such a round
  // still must not hurt the survivor, but it does not count. Settle times cycle 50..400 ms until
  // six rounds hit the window; with the workaround on, at least one must (CI's run of 12-03 had
  // round 0 miss at a fixed 50 ms).
  Survivor survivor;
  constexpr int kSettleMs[] = {50, 100, 25, 200, 400};
  int hits = 0, rounds = 0;
  for (; rounds < 30 && hits < 6; ++rounds) {
    hits += survivor.RoundReplyPending(rounds, milliseconds(kSettleMs[rounds % 5])) ? 1 : 0;
  }
  std::printf("%d of %d rounds hit the window\n", hits, rounds);
  INFO(hits << " of " << rounds << " rounds hit the window");
  if (TcpPurgeWorkaroundActive()) REQUIRE(hits >= 1);
  survivor.Verify();
}

}  // namespace
}  // namespace refit::transport
