// The peer that ucx_peer_kill_test kills: a process with its own UcxTransport that reads a
// survivor's buffer as fast as it can (checked reads: gathers the survivor answers with large
// replies) and serves a pattern-filled buffer of its own that the survivor reads back. The
// test SIGKILLs it mid-stream and checks the survivor lives on.
//
//   ucx_kill_peer ADDRESS_HEX DESCRIPTOR_HEX SEED [--verify=N]
//
// Prints its own address and its buffer's descriptor (hex, one line each) once it has connected,
// then reads forever, keeping kDepth chunks in flight. With --verify=N it instead reads N chunks,
// checks each against the survivor's pattern (SEED) and exits 0, or 1 on a failed read or a
// wrong byte.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "daemon/transport/testing/peer_process.h"
#include "daemon/transport/ucx/ucx_transport.h"

namespace refit::transport {
namespace {

constexpr uint64_t kChunk = 4ull << 20;  // a checked read of one gather's largest reply
constexpr int kDepth = 8;
constexpr uint64_t kOwnBytes = 32ull << 20;
constexpr uint64_t kOwnSeed = 0x6b696c6c;  // "kill": the survivor checks what it reads

int Fail(const std::string& why) {
  std::fprintf(stderr, "ucx_kill_peer: %s\n", why.c_str());
  return 1;
}

int Run(int argc, char** argv) {
  if (argc < 4) return Fail("usage: ucx_kill_peer ADDRESS_HEX DESCRIPTOR_HEX SEED [--verify=N]");
  const std::string address = absl::HexStringToBytes(argv[1]);
  const std::string descriptor = absl::HexStringToBytes(argv[2]);
  uint64_t seed = 0, verify = 0;
  if (!absl::SimpleAtoi(argv[3], &seed)) return Fail("bad seed");
  if (argc > 4 &&
      (std::strncmp(argv[4], "--verify=", 9) != 0 || !absl::SimpleAtoi(argv[4] + 9, &verify))) {
    return Fail("bad --verify");
  }
  auto transport = UcxTransport::Create();
  if (!transport.ok()) return Fail(transport.status().ToString());
  auto own = (*transport)->AllocateMemory(kOwnBytes);
  if (!own.ok()) return Fail(own.status().ToString());
  FillPattern(static_cast<uint8_t*>((*own)->address()), kOwnBytes, kOwnSeed, 0);
  auto landing = (*transport)->AllocateMemory(kChunk * kDepth);
  if (!landing.ok()) return Fail(landing.status().ToString());
  auto ep = (*transport)->Connect(address);
  if (!ep.ok()) return Fail(ep.status().ToString());
  auto remote = (*ep)->ImportRemote(descriptor);
  if (!remote.ok()) return Fail(remote.status().ToString());
  const uint64_t chunks = (*remote)->length() / kChunk;
  if (chunks == 0) return Fail("the survivor's buffer is shorter than a chunk");
  std::printf("%s\n%s\n", absl::BytesToHexString((*transport)->LocalAddress()).c_str(),
              absl::BytesToHexString((*own)->descriptor()).c_str());
  std::fflush(stdout);

  uint64_t posted = 0, done = 0;
  auto post = [&](int slot) {
    const uint64_t chunk = posted % chunks;
    ++posted;
    return (*ep)->PostGet(**landing, slot * kChunk, **remote, chunk * kChunk, kChunk,
                          (chunk << 8) | static_cast<uint64_t>(slot));
  };
  for (int slot = 0; slot < kDepth; ++slot) {
    if (absl::Status s = post(slot); !s.ok()) return Fail(s.ToString());
  }
  std::vector<Completion> completions;
  while (verify == 0 || done < verify) {
    completions.clear();
    (*transport)->Poll(&completions);
    for (const Completion& c : completions) {
      if (!c.status.ok()) return Fail("read failed: " + c.status.ToString());
      const int slot = static_cast<int>(c.cookie & 0xff);
      const uint64_t chunk = c.cookie >> 8;
      const auto* at = static_cast<const uint8_t*>((*landing)->address()) + slot * kChunk;
      if (verify != 0 && FindPatternMismatch(at, kChunk, seed, chunk * kChunk) >= 0) {
        return Fail("chunk " + std::to_string(chunk) + " has wrong bytes");
      }
      ++done;
      if (verify == 0 || posted < verify) {
        if (absl::Status s = post(slot); !s.ok()) return Fail(s.ToString());
      }
    }
  }
  // Let the last reads' endpoints settle before the transport goes.
  while ((*transport)->outstanding() != 0) {
    completions.clear();
    (*transport)->Poll(&completions);
  }
  remote->reset();
  ep->reset();
  landing->reset();
  own->reset();
  return 0;
}

}  // namespace
}  // namespace refit::transport

int main(int argc, char** argv) { return refit::transport::Run(argc, argv); }
