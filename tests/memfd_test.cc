// Sealed memfds passed over refitd's socket (SCM_RIGHTS), the clients' default host memory
// (issue 17): sources and destinations round-trip bit-exact; an unsealed memfd is
// FAILED_PRECONDITION; a token is its uid's alone and good once; a forged one is NOT_FOUND;
// nobody can shrink the memory under refitd; refitd keeps no fd it was passed.

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/as_uid.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using testing::DaemonProcess;

constexpr int64_t kRows = 256, kCols = 1024;  // bf16: 512 KiB, as as_client's buffers
constexpr uint64_t kBytes = kRows * kCols * 2;
constexpr uid_t kNobody = 65534;    // allowed by the daemons below
constexpr uid_t kStranger = 65533;  // not allowed

std::vector<v1::TensorSlice> Tensors() { return {Slice("w", v1::BF16, {kRows, kCols}, 0)}; }

SharedMemory Sealed(const std::string& label, int fill) {
  auto memory = SharedMemory::CreateSealed(kBytes, label);
  REQUIRE(memory.ok());
  std::memset(memory->data(), fill, kBytes);
  return std::move(memory).value();
}

v1::RegisterBufferRequest Request(const std::string& model, v1::Role role,
                                  const std::string& token) {
  v1::RegisterBufferRequest request;
  request.set_model(model);
  request.set_role(role);
  request.mutable_memory()->mutable_memfd()->set_token(token);
  for (const auto& t : Tensors()) *request.add_tensors() = t;
  return request;
}

// An unsealed memfd of kBytes (sealing allowed, not done).
int Unsealed() {
  const int fd = memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(fd >= 0);
  REQUIRE(ftruncate(fd, kBytes) == 0);
  return fd;
}

size_t OpenFds(pid_t pid) {
  size_t count = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    (void)entry;
    ++count;
  }
  return count;
}

bool Starts(const std::string& line, const std::string& prefix) {
  return line.rfind(prefix, 0) == 0;
}

}  // namespace

TEST_CASE("sealed memfd sources and destinations round-trip bit-exact", "[integration][memfd]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  SharedMemory src = Sealed("trainer", 0);
  SharedMemory dst = Sealed("engine", 0);
  REQUIRE(src.sealed());
  REQUIRE(src.name().empty());
  auto s = client.RegisterBuffer("m", v1::SOURCE, src, Tensors(), "trainer");
  auto d = client.RegisterBuffer("m", v1::DESTINATION, dst, Tensors(), "engine");
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  for (uint64_t version = 1; version <= 3; ++version) {
    for (uint64_t i = 0; i < kBytes; ++i) src.data()[i] = static_cast<uint8_t>(i * 7 + version);
    REQUIRE(client.Publish("m", version, {*s}).ok());
    auto applied = client.Apply("m", version, {*d});
    REQUIRE(applied.ok());
    REQUIRE(applied->bytes_written() == kBytes);
    REQUIRE(std::memcmp(src.data(), dst.data(), kBytes) == 0);
  }
  // Mixed with named shm (still available): memfd source into a named destination.
  auto named = SharedMemory::Create(testing::UniqueShmName("memfd-named"), kBytes);
  REQUIRE(named.ok());
  auto n = client.RegisterBuffer("m", v1::DESTINATION, *named, Tensors(), "engine-2");
  REQUIRE(n.ok());
  REQUIRE(client.Apply("m", 3, {*n}).ok());
  REQUIRE(std::memcmp(src.data(), named->data(), kBytes) == 0);
  REQUIRE(client.ReleaseBuffer(*n).ok());

  // Nobody can shrink it under refitd: not through its fd, nor through a fresh open of it.
  REQUIRE(ftruncate(src.fd(), 4096) == -1);
  REQUIRE(errno == EPERM);
  const int reopened = open(("/proc/self/fd/" + std::to_string(dst.fd())).c_str(), O_RDWR);
  REQUIRE(reopened >= 0);
  REQUIRE(ftruncate(reopened, 0) == -1);
  REQUIRE(errno == EPERM);
  close(reopened);
  uint64_t version = 4;
  for (int attempt = 0; attempt < 100; ++attempt, ++version) {
    INFO("attempt " << attempt);
    const off_t to = attempt % 3 == 0 ? 0 : static_cast<off_t>(kBytes) - 4096 * attempt;
    REQUIRE(ftruncate(attempt % 2 ? src.fd() : dst.fd(), std::max<off_t>(to, 0)) == -1);
    REQUIRE(errno == EPERM);
    REQUIRE(ftruncate(src.fd(), static_cast<off_t>(kBytes) * 2) == -1);  // nor grown
    std::memset(src.data(), static_cast<int>(version), kBytes);
    REQUIRE(client.Publish("m", version, {*s}).ok());
    REQUIRE(client.Apply("m", version, {*d}).ok());
    REQUIRE(std::memcmp(src.data(), dst.data(), kBytes) == 0);
  }
  // Punching a hole is allowed (it doesn't shrink): the client zeroes its own bytes, and
  // refitd reads those zeros rather than faulting.
  REQUIRE(fallocate(src.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 65536) == 0);
  REQUIRE(client.Publish("m", version, {*s}).ok());
  REQUIRE(client.Apply("m", version, {*d}).ok());
  REQUIRE(dst.data()[0] == 0);
  REQUIRE(std::memcmp(src.data(), dst.data(), kBytes) == 0);
  REQUIRE((*daemon)->running());
}

TEST_CASE("memfds refitd refuses: unsealed, forged or spent tokens, too many",
          "[integration][memfd]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;

  // Unsealed: FAILED_PRECONDITION saying why; the same memfd sealed is taken.
  const int fd = Unsealed();
  auto token = client.PassMemfd(fd);
  REQUIRE(token.ok());
  auto refused = client.RegisterBuffer(Request("u", v1::SOURCE, *token));
  REQUIRE(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(std::string(refused.status().message()).find("F_SEAL_SHRINK") != std::string::npos);
  REQUIRE(std::string(refused.status().message()).find("memfd unsealed") != std::string::npos);
  // The token was spent by that call.
  REQUIRE(client.RegisterBuffer(Request("u", v1::SOURCE, *token)).status().code() ==
          absl::StatusCode::kNotFound);
  REQUIRE(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
  token = client.PassMemfd(fd);
  REQUIRE(token.ok());
  auto taken = client.RegisterBuffer(Request("u", v1::DESTINATION, *token));
  REQUIRE(taken.ok());
  REQUIRE(client.ReleaseBuffer(*taken).ok());
  close(fd);

  // Sealed against writes: refitd maps read-write, so FAILED_PRECONDITION too.
  const int frozen = Unsealed();
  REQUIRE(fcntl(frozen, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_WRITE) == 0);
  token = client.PassMemfd(frozen);
  REQUIRE(token.ok());
  REQUIRE(client.RegisterBuffer(Request("u", v1::SOURCE, *token)).status().code() ==
          absl::StatusCode::kFailedPrecondition);
  close(frozen);

  // Not a memory file at all: refused when passed.
  const int dir = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  REQUIRE(client.PassMemfd(dir).status().code() == absl::StatusCode::kInvalidArgument);
  close(dir);

  // Forged or unknown tokens: NOT_FOUND.
  for (const std::string& forged : std::vector<std::string>{
           "memfd-00000000000000000000000000000000", "", "memfd-", std::string(5000, 'x')}) {
    auto r = client.RegisterBuffer(Request("u", v1::SOURCE, forged));
    REQUIRE(r.status().code() == absl::StatusCode::kNotFound);
  }

  // A region past the memfd's end: INVALID_ARGUMENT.
  SharedMemory small = Sealed("small", 1);
  token = client.PassMemfd(small.fd());
  REQUIRE(token.ok());
  auto request = Request("u", v1::SOURCE, *token);
  request.mutable_memory()->set_offset(kBytes);
  request.mutable_memory()->set_size(4096);
  REQUIRE(client.RegisterBuffer(request).status().code() == absl::StatusCode::kInvalidArgument);

  // At most 64 unregistered memfds per uid.
  int held = 0;
  absl::Status last;
  for (int i = 0; i < 70 && last.ok(); ++i) {
    auto t = client.PassMemfd(small.fd());
    last = t.status();
    if (t.ok()) ++held;
  }
  REQUIRE(held == 64);
  REQUIRE(last.code() == absl::StatusCode::kResourceExhausted);
  REQUIRE((*daemon)->running());
}

TEST_CASE("refitd keeps no fd of the memfds it was passed", "[integration][memfd]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  SharedMemory memory = Sealed("leak", 2);
  // Warm up: gRPC's threads and connection are in place before counting.
  auto warm = client.RegisterBuffer("leak", v1::SOURCE, memory, Tensors());
  REQUIRE(warm.ok());
  REQUIRE(client.ReleaseBuffer(*warm).ok());
  const size_t before = OpenFds((*daemon)->pid());
  const int unsealed = Unsealed();
  for (int i = 0; i < 100; ++i) {
    INFO("round " << i);
    auto id =
        client.RegisterBuffer("leak", i % 2 ? v1::SOURCE : v1::DESTINATION, memory, Tensors());
    REQUIRE(id.ok());
    REQUIRE(client.ReleaseBuffer(*id).ok());
    if (i % 10 == 0) {  // refused ones let go of their fds too
      auto token = client.PassMemfd(unsealed);
      REQUIRE(token.ok());
      REQUIRE(client.RegisterBuffer(Request("leak", v1::SOURCE, *token)).status().code() ==
              absl::StatusCode::kFailedPrecondition);
    }
  }
  close(unsealed);
  size_t after = OpenFds((*daemon)->pid());
  for (int i = 0; i < 30 && after > before; ++i) {  // side connections close asynchronously
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    after = OpenFds((*daemon)->pid());
  }
  INFO("refitd's open fds: " << before << " before, " << after << " after");
  REQUIRE(after <= before);
  REQUIRE((*daemon)->running());
}

TEST_CASE("a memfd token is its uid's alone", "[integration][memfd][trust]") {
  auto daemon = DaemonProcess::Start({"--allow-uids=" + std::to_string(kNobody)});
  REQUIRE(daemon.ok());
  const std::string socket = (*daemon)->socket();
  testing::OpenSocketToAll(socket);
  const testing::AsUid as_client("tests/testing/as_client");
  // One operation as `uid`: the first line it printed.
  auto as = [&](uid_t uid, const std::vector<std::string>& args) {
    const std::string out = as_client.Run(uid, socket, args);
    return out.substr(0, out.find('\n'));
  };
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& root = **c;

  // Another allowed uid uses the sealed path end to end.
  REQUIRE(Starts(as(kNobody, {"register-sealed", "SOURCE", "theirs"}), "OK "));
  // nobody's token, named by root: PERMISSION_DENIED (root may read refitd's memory anyway,
  // but it must not take over another uid's memory by a token).
  const std::string passed = as(kNobody, {"pass-memfd"});
  REQUIRE(Starts(passed, "OK memfd-"));
  const std::string their_token = passed.substr(3);
  auto stolen = root.RegisterBuffer(Request("m", v1::SOURCE, their_token));
  REQUIRE(stolen.status().code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(std::string(stolen.status().message()).find("uid 65534") != std::string::npos);
  // root's token, named by nobody: PERMISSION_DENIED; it stays good for root.
  SharedMemory mine = Sealed("root", 3);
  auto token = root.PassMemfd(mine.fd());
  REQUIRE(token.ok());
  REQUIRE(Starts(as(kNobody, {"register-memfd", "SOURCE", "m", *token}), "PERMISSION_DENIED"));
  REQUIRE(root.RegisterBuffer(Request("m", v1::SOURCE, *token)).ok());
  // A uid the policy refuses may not even pass an fd.
  REQUIRE(Starts(as(kStranger, {"pass-memfd"}), "PERMISSION_DENIED"));
  REQUIRE((*daemon)->running());
}

}  // namespace refit
