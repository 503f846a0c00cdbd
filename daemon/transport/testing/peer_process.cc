#include "daemon/transport/testing/peer_process.h"

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace refit::transport {
namespace {

constexpr auto kReplyTimeout = std::chrono::seconds(60);

uint64_t PatternWord(uint64_t seed, uint64_t word) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (word + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint8_t PatternByte(uint64_t seed, uint64_t index) {
  return static_cast<uint8_t>(PatternWord(seed, index / 8) >> (8 * (index % 8)));
}

bool WriteAll(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// Reads exactly `size` bytes, waiting at most until `deadline`.
bool ReadAll(int fd, void* data, size_t size, std::chrono::steady_clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    int r = poll(&pfd, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    ssize_t n = read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool WriteFrame(int fd, const std::string& payload) {
  uint32_t size = static_cast<uint32_t>(payload.size());
  return WriteAll(fd, &size, sizeof(size)) && WriteAll(fd, payload.data(), payload.size());
}

bool ReadFrame(int fd, std::string* payload, std::chrono::steady_clock::time_point deadline) {
  uint32_t size = 0;
  if (!ReadAll(fd, &size, sizeof(size), deadline)) return false;
  payload->resize(size);
  return ReadAll(fd, payload->data(), size, deadline);
}

uint64_t ReadU64(const std::string& s, size_t at) {
  uint64_t v = 0;
  if (s.size() >= at + 8) std::memcpy(&v, s.data() + at, 8);
  return v;
}

std::string U64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }

// The child: never returns.
[[noreturn]] void Serve(const TransportFactory& make, uint64_t size, uint64_t seed, bool allocate,
                        int fd) {
  auto fail = [fd](const std::string& why) {
    WriteFrame(fd, "E" + why);
    _exit(2);
  };
  {
    auto transport = make();
    if (!transport.ok()) fail(transport.status().ToString());
    uint8_t* buffer = nullptr;
    absl::StatusOr<std::unique_ptr<LocalMemory>> memory;
    if (allocate) {
      memory = (*transport)->AllocateMemory(size);
      if (!memory.ok()) fail(memory.status().ToString());
      buffer = static_cast<uint8_t*>((*memory)->address());
    } else {
      void* mapped =
          mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mapped == MAP_FAILED) fail("mmap failed");
      buffer = static_cast<uint8_t*>(mapped);
      memory = (*transport)->RegisterMemory(buffer, size, MemoryKind::kHost);
      if (!memory.ok()) fail(memory.status().ToString());
    }
    FillPattern(buffer, size, seed, 0);
    if (!WriteFrame(fd, "A" + (*transport)->LocalAddress()) ||
        !WriteFrame(fd, "D" + (*memory)->descriptor())) {
      _exit(3);
    }
    std::vector<Completion> completions;
    bool running = true;
    for (uint64_t spin = 0; running; ++spin) {
      completions.clear();
      (*transport)->Poll(&completions);
      if (spin % 16 != 0) continue;
      pollfd pfd{fd, POLLIN, 0};
      if (poll(&pfd, 1, 0) <= 0) continue;
      std::string command;
      if (!ReadFrame(fd, &command, std::chrono::steady_clock::now() + kReplyTimeout) ||
          command.empty()) {
        break;  // the parent went away
      }
      switch (command[0]) {
        case 'H': {
          uint64_t offset = ReadU64(command, 1), length = ReadU64(command, 9);
          if (offset > size || length > size - offset) {
            WriteFrame(fd, "Erange");
          } else {
            WriteFrame(fd, "H" + U64(HashBytes(buffer + offset, length)));
          }
          break;
        }
        case 'Q':
          running = false;
          break;
        default:
          WriteFrame(fd, "Eunknown command");
      }
    }
    memory->reset();
  }
  WriteFrame(fd, "Q");
  _exit(0);
}

int CountThreads() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  int count = 0;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count;
}

}  // namespace

void FillPattern(uint8_t* data, uint64_t length, uint64_t seed, uint64_t start_index) {
  uint64_t i = 0;
  while (i < length && (start_index + i) % 8 != 0) {
    data[i] = PatternByte(seed, start_index + i);
    ++i;
  }
  for (; i + 8 <= length; i += 8) {
    uint64_t word = PatternWord(seed, (start_index + i) / 8);
    std::memcpy(data + i, &word, 8);  // little-endian: byte k is bits 8k..8k+7
  }
  for (; i < length; ++i) data[i] = PatternByte(seed, start_index + i);
}

int64_t FindPatternMismatch(const uint8_t* data, uint64_t length, uint64_t seed,
                            uint64_t start_index) {
  constexpr uint64_t kBlock = 1 << 16;
  std::vector<uint8_t> expected(kBlock);
  for (uint64_t at = 0; at < length; at += kBlock) {
    uint64_t n = std::min(kBlock, length - at);
    FillPattern(expected.data(), n, seed, start_index + at);
    if (std::memcmp(expected.data(), data + at, n) != 0) {
      for (uint64_t k = 0; k < n; ++k) {
        if (expected[k] != data[at + k]) return static_cast<int64_t>(at + k);
      }
    }
  }
  return -1;
}

uint64_t HashBytes(const uint8_t* data, uint64_t length) { return XXH3_64bits(data, length); }

absl::StatusOr<std::unique_ptr<PeerProcess>> PeerProcess::Start(TransportFactory make,
                                                                uint64_t size, uint64_t seed,
                                                                bool allocate) {
  // The child gets only the forking thread: any other (a UCX progress thread, say) would leave
  // it with locks and state nobody owns.
  int threads = CountThreads();
  if (threads != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("PeerProcess::Start must fork a single-threaded process; this one has ",
                     threads, " threads (start peers before making a transport)"));
  }
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return absl::InternalError(absl::StrCat("socketpair: ", std::strerror(errno)));
  }
  std::fflush(nullptr);  // don't let the child flush the parent's buffered output again
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    close(fds[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(4);
    Serve(make, size, seed, allocate, fds[1]);
  }
  close(fds[1]);
  std::unique_ptr<PeerProcess> peer(new PeerProcess());
  peer->pid_ = pid;
  peer->fd_ = fds[0];
  peer->size_ = size;
  auto deadline = std::chrono::steady_clock::now() + kReplyTimeout;
  std::string address, descriptor;
  if (!ReadFrame(peer->fd_, &address, deadline) || address.empty() || address[0] != 'A') {
    return absl::InternalError(absl::StrCat("peer process failed to start: ",
                                            address.empty() ? "no reply" : address.substr(1)));
  }
  if (!ReadFrame(peer->fd_, &descriptor, deadline) || descriptor.empty() || descriptor[0] != 'D') {
    return absl::InternalError("peer process sent no descriptor");
  }
  peer->address_ = address.substr(1);
  peer->descriptor_ = descriptor.substr(1);
  return peer;
}

absl::StatusOr<std::string> PeerProcess::Request(const std::string& command) {
  if (pid_ < 0) return absl::FailedPreconditionError("peer process is gone");
  std::string reply;
  if (!WriteFrame(fd_, command) ||
      !ReadFrame(fd_, &reply, std::chrono::steady_clock::now() + kReplyTimeout) || reply.empty()) {
    return absl::UnavailableError("peer process did not answer");
  }
  if (reply[0] == 'E') return absl::InternalError("peer process: " + reply.substr(1));
  return reply;
}

absl::StatusOr<uint64_t> PeerProcess::Hash(uint64_t offset, uint64_t length) {
  auto reply = Request("H" + U64(offset) + U64(length));
  if (!reply.ok()) return reply.status();
  return ReadU64(*reply, 1);
}

void PeerProcess::Kill() {
  if (pid_ < 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

void PeerProcess::Stop() {
  if (pid_ >= 0) kill(pid_, SIGSTOP);
}

void PeerProcess::Continue() {
  if (pid_ >= 0) kill(pid_, SIGCONT);
}

PeerProcess::~PeerProcess() {
  if (pid_ >= 0) {
    std::string reply;
    // The child answers "Q" once its transport is closed; give it a few seconds.
    if (WriteFrame(fd_, "Q")) {
      ReadFrame(fd_, &reply, std::chrono::steady_clock::now() + std::chrono::seconds(5));
    }
    if (waitpid(pid_, nullptr, WNOHANG) == 0) {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (waitpid(pid_, nullptr, WNOHANG) == 0) {
        if (std::chrono::steady_clock::now() > deadline) {
          Kill();
          break;
        }
        usleep(1000);
      }
    }
  }
  if (fd_ >= 0) close(fd_);
}

}  // namespace refit::transport
