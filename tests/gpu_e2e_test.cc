// GPU end to end (--config=cuda, on a machine with a GPU; the GPU bundle runs it): this process
// allocates CUDA memory and lends it as IPC handles, named by GPU UUID; two refitd processes
// with CUDA version slots act as a trainer's and an engine's node. A version published from GPU
// memory on one lands resharded and converted in GPU memory on the other, bit-exact, a second
// version as a delta. Bad CUDA input (a UUID this node lacks, a stale handle, an allocation
// smaller than the slices) is refused with the documented codes, and the daemons keep serving;
// GPU slots are held to --max-gpu-slot-memory.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "catch2/catch.hpp"
#include "client/cuda_ipc.h"
#include "client/refit_client.h"
#include "cuda/gpu_testing.h"
#include "daemon/common/types.h"
#include "daemon/plan/dtype_convert.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::Slice;
using std::chrono::milliseconds;
using testing::DaemonProcess;
using Bytes = std::vector<uint8_t>;
using absl::StatusCode;

#define REQUIRE_GPU() REQUIRE(cuda::testing::HaveGpu())

Bytes RandomBytes(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(rng() >> 29);
  return out;
}

std::unique_ptr<client::Client> ConnectTo(const DaemonProcess& d) {
  auto c = d.Connect();
  REQUIRE(c.ok());
  (*c)->set_call_timeout(std::chrono::seconds(60));
  return std::move(c).value();
}

void WaitConnected(client::Client& client) {
  for (int i = 0; i < 400; ++i) {
    auto s = client.Status();
    REQUIRE(s.ok());
    if (s->peers_size() == 1 && s->peers(0).connected()) return;
    std::this_thread::sleep_for(milliseconds(50));
  }
  FAIL("the engine's node did not connect to the trainer's");
}

v1::RegisterBufferRequest Request(const std::string& model, v1::Role role,
                                  const v1::MemoryHandle& memory,
                                  const std::vector<v1::TensorSlice>& slices) {
  v1::RegisterBufferRequest request;
  request.set_model(model);
  request.set_role(role);
  *request.mutable_memory() = memory;
  for (const auto& s : slices) *request.add_tensors() = s;
  request.set_client("gpu_e2e_test");
  return request;
}

v1::MemoryHandle HandleOf(const cuda::testing::DeviceBuffer& buffer) {
  auto memory = client::CudaMemoryHandle(buffer.get(), 0, buffer.size());
  REQUIRE(memory.ok());
  CHECK(memory->cuda_ipc().device_uuid().rfind("GPU-", 0) == 0);
  return *memory;
}

// The trainer's tensors: a bf16 [2048, 1024] weight and an fp32 [3000] vector. The engine holds
// the weight's second half of rows (bf16) and the vector converted to bf16.
constexpr int64_t kRows = 2048, kCols = 1024, kVec = 3000;
constexpr uint64_t kWeightBytes = kRows * kCols * 2, kVecBytes = kVec * 4;
constexpr uint64_t kDstWeightBytes = kWeightBytes / 2, kDstVecOffset = kDstWeightBytes;

Bytes Expected(const Bytes& source) {
  Bytes want(kDstWeightBytes + kVec * 2);
  std::memcpy(want.data(), source.data() + kWeightBytes / 2, kDstWeightBytes);
  plan::ConvertRun(source.data() + kWeightBytes, DType::kFP32, 1, want.data() + kDstVecOffset,
                   DType::kBF16, 1, kVec);
  return want;
}

TEST_CASE("a version goes from GPU memory on one daemon to GPU memory on another", "[gpu][e2e]") {
  REQUIRE_GPU();
  auto trainer_node = DaemonProcess::Start({"--node=trainer-node", "--slot-memory=cuda"});
  REQUIRE(trainer_node.ok());
  auto trainer = ConnectTo(**trainer_node);
  auto port = trainer->Status();
  REQUIRE(port.ok());
  auto engine_node =
      DaemonProcess::Start({"--node=engine-node", "--slot-memory=cuda",
                            "--peers=127.0.0.1:" + std::to_string(port->listen_port())});
  REQUIRE(engine_node.ok());
  auto engine = ConnectTo(**engine_node);
  WaitConnected(*engine);

  cuda::testing::DeviceBuffer src(kWeightBytes + kVecBytes);
  cuda::testing::DeviceBuffer dst(kDstWeightBytes + kVec * 2);
  auto s = trainer->RegisterBuffer(Request(
      "m", v1::SOURCE, HandleOf(src),
      {Slice("w", v1::BF16, {kRows, kCols}, 0), Slice("v", v1::FP32, {kVec}, kWeightBytes)}));
  REQUIRE(s.ok());
  auto d = engine->RegisterBuffer(
      Request("m", v1::DESTINATION, HandleOf(dst),
              {Slice("w", v1::BF16, {kRows, kCols}, 0, {kRows / 2, 0}, {kRows / 2, kCols}),
               Slice("v", v1::BF16, {kVec}, kDstVecOffset)}));
  REQUIRE(d.ok());

  Bytes source = RandomBytes(src.size(), 1);
  for (uint64_t version = 1; version <= 3; ++version) {
    INFO("version " << version);
    if (version > 1) {  // an RL-like step: a few bf16 patterns move by one
      std::mt19937_64 rng(version);
      for (int k = 0; k < 2000; ++k) source[2 * (rng() % (kWeightBytes / 2))] ^= 1;
    }
    src.Upload(source.data(), source.size());
    REQUIRE(trainer->Publish("m", version, {*s}).ok());
    auto waited = engine->WaitForVersion("m", version, std::chrono::seconds(60));
    REQUIRE(waited.ok());
    CHECK(*waited == version);
    auto applied = engine->Apply("m", version, {*d});
    REQUIRE(applied.ok());
    CHECK(applied->bytes_written() == dst.size());
    const Bytes got = dst.Download(dst.size());
    const Bytes want = Expected(source);
    REQUIRE(got.size() == want.size());
    const auto first_wrong = std::mismatch(got.begin(), got.end(), want.begin()).first;
    INFO("first wrong byte at " << (first_wrong - got.begin()) << " of " << got.size());
    CHECK(first_wrong == got.end());
  }
  auto status = engine->Status();
  REQUIRE(status.ok());
  CHECK(status->metrics().at("refit_versions_completed_total") >= 3);
}

TEST_CASE("bad CUDA input is refused and the daemon keeps serving", "[gpu][e2e][codes]") {
  REQUIRE_GPU();
  auto node = DaemonProcess::Start({"--node=solo", "--slot-memory=cuda"});
  REQUIRE(node.ok());
  auto c = ConnectTo(**node);
  cuda::testing::DeviceBuffer buffer(1 << 20);
  const std::vector<v1::TensorSlice> slices = {Slice("w", v1::FP32, {1 << 18}, 0)};
  auto code = [&](const v1::MemoryHandle& memory, const std::vector<v1::TensorSlice>& s) {
    return c->RegisterBuffer(Request("m", v1::DESTINATION, memory, s)).status().code();
  };

  // The same buffer by UUID and by ordinal alone works.
  v1::MemoryHandle good = HandleOf(buffer);
  CHECK(code(good, slices) == StatusCode::kOk);
  v1::MemoryHandle by_ordinal = good;
  by_ordinal.mutable_cuda_ipc()->clear_device_uuid();
  CHECK(code(by_ordinal, slices) == StatusCode::kOk);

  // A GPU this node does not have; a malformed UUID.
  v1::MemoryHandle foreign = good;
  foreign.mutable_cuda_ipc()->set_device_uuid("GPU-00000000-0000-0000-0000-000000000001");
  CHECK(code(foreign, slices) == StatusCode::kFailedPrecondition);
  foreign.mutable_cuda_ipc()->set_device_uuid("GPU-12345");
  CHECK(code(foreign, slices) == StatusCode::kInvalidArgument);

  // Garbage, short, and stale handles (the allocation is gone).
  v1::MemoryHandle garbage = good;
  garbage.mutable_cuda_ipc()->set_handle(std::string(64, '\x5a'));
  CHECK(code(garbage, slices) == StatusCode::kInvalidArgument);
  garbage.mutable_cuda_ipc()->set_handle(std::string(10, '\1'));
  CHECK(code(garbage, slices) == StatusCode::kInvalidArgument);
  v1::MemoryHandle stale;
  {
    cuda::testing::DeviceBuffer gone(1 << 20);
    stale = HandleOf(gone);
  }
  // Refused where the driver knows the allocation is gone; driver 580 on an H200 still opened
  // it (the GPU bundle's first run): then it registers, over memory only this refitd maps, and
  // counts as a buffer. Either answer is clear and the daemon keeps serving.
  const StatusCode stale_code = code(stale, slices);
  CHECK((stale_code == StatusCode::kInvalidArgument || stale_code == StatusCode::kOk));
  const uint32_t registered = stale_code == StatusCode::kOk ? 3u : 2u;

  // Slices past the allocation's end: to the end (size 0), or a window claiming more. (Far
  // more: the driver may round an allocation up to its granularity.)
  v1::MemoryHandle whole = good;
  whole.set_size(0);
  const std::vector<v1::TensorSlice> too_big = {Slice("w", v1::FP32, {16 << 20}, 0)};
  CHECK(code(whole, too_big) == StatusCode::kInvalidArgument);
  v1::MemoryHandle window = good;
  window.set_size(64 << 20);
  CHECK(code(window, slices) == StatusCode::kInvalidArgument);
  window.set_offset(64 << 20);
  window.set_size(4);
  CHECK(code(window, {Slice("w", v1::FP32, {1}, 0)}) == StatusCode::kInvalidArgument);

  auto status = c->Status();
  REQUIRE(status.ok());
  REQUIRE(status->models_size() == 1);
  CHECK(status->models(0).destination_buffers() == registered);  // the good registrations
  auto healthy = c->Healthy();
  REQUIRE(healthy.ok());
  CHECK(*healthy);
}

TEST_CASE("GPU slots are held to --max-gpu-slot-memory", "[gpu][e2e][codes]") {
  REQUIRE_GPU();
  // Room for one 1 MiB version, not for a second one (--retain=2 keeps the first).
  auto node = DaemonProcess::Start({"--node=capped", "--slot-memory=cuda",
                                    "--max-gpu-slot-memory=1536KiB", "--delta-threshold=0"});
  REQUIRE(node.ok());
  auto c = ConnectTo(**node);
  cuda::testing::DeviceBuffer buffer(1 << 20);
  auto id = c->RegisterBuffer(
      Request("m", v1::SOURCE, HandleOf(buffer), {Slice("w", v1::FP32, {1 << 18}, 0)}));
  REQUIRE(id.ok());
  REQUIRE(c->Publish("m", 1, {*id}).ok());
  auto second = c->Publish("m", 2, {*id});
  CHECK(second.status().code() == StatusCode::kResourceExhausted);
  auto latest = c->Status();
  REQUIRE(latest.ok());
  REQUIRE(latest->models_size() == 1);
  CHECK(latest->models(0).latest_version() == 1);
}

}  // namespace
}  // namespace refit
