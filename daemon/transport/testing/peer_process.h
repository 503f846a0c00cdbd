#pragma once

// A Transport in a forked child process that serves one registered, pattern-filled buffer: the
// "other daemon" of the two-process conformance tests and of transport_bench. The child talks to
// the parent over a socketpair (address + descriptor at start; hash / refill / quit commands)
// and polls its transport between commands, as a daemon's data-plane thread would.
//
// Fork safety: Start() forks, so call it before this process creates any UCX context or thread
// (the child inherits neither); start every peer a test needs first, then make the parent's
// transport. The child dies with the parent (PR_SET_PDEATHSIG).
//
// Not thread-safe; one owner thread.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/transport/transport.h"

namespace refit::transport {

using TransportFactory = std::function<absl::StatusOr<std::unique_ptr<Transport>>()>;

// Byte i of the pattern for `seed` (a function of the absolute index, so any window of it can be
// produced or checked on its own).
void FillPattern(uint8_t* data, uint64_t length, uint64_t seed, uint64_t start_index);
// Index (relative to `data`) of the first byte that differs from the pattern, or -1.
int64_t FindPatternMismatch(const uint8_t* data, uint64_t length, uint64_t seed,
                            uint64_t start_index);
uint64_t HashBytes(const uint8_t* data, uint64_t length);

class PeerProcess {
 public:
  // Forks a child that creates a transport with `make`, registers `size` bytes filled with the
  // pattern for `seed`, and serves them until destroyed. Returns once the child is ready.
  // `allocate`: the buffer comes from the child's Transport::AllocateMemory instead of an
  // anonymous mapping registered with RegisterMemory.
  static absl::StatusOr<std::unique_ptr<PeerProcess>> Start(TransportFactory make, uint64_t size,
                                                            uint64_t seed, bool allocate = false);
  ~PeerProcess();  // asks the child to exit; SIGKILL if it doesn't within a few seconds

  pid_t pid() const { return pid_; }
  const std::string& address() const { return address_; }        // its Transport::LocalAddress
  const std::string& descriptor() const { return descriptor_; }  // of its buffer
  uint64_t size() const { return size_; }

  // HashBytes of the child's buffer [offset, +length).
  absl::StatusOr<uint64_t> Hash(uint64_t offset, uint64_t length);
  // SIGKILL, then reap: the child is gone when this returns.
  void Kill();
  // SIGSTOP / SIGCONT: an unresponsive peer whose kernel still answers TCP.
  void Stop();
  void Continue();

 private:
  PeerProcess() = default;
  absl::StatusOr<std::string> Request(const std::string& command);

  pid_t pid_ = -1;
  int fd_ = -1;
  uint64_t size_ = 0;
  std::string address_;
  std::string descriptor_;
};

}  // namespace refit::transport
