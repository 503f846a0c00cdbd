// Every row of the status-code table in docs/api.md, against the real refitd: the right code,
// nothing changed, and the daemon keeps serving.

#include <cstring>
#include <optional>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using absl::StatusCode;
using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;

struct Fixture {
  Fixture() {
    auto started = testing::DaemonProcess::Start({"--retain=2"});
    REQUIRE(started.ok());
    daemon = std::move(started).value();
    auto connected = daemon->Connect();
    REQUIRE(connected.ok());
    client = std::move(connected).value();
    auto s = SharedMemory::Create(testing::UniqueShmName("src"), 4096);
    auto d = SharedMemory::Create(testing::UniqueShmName("dst"), 4096);
    REQUIRE(s.ok());
    REQUIRE(d.ok());
    src = std::move(s).value();
    dst = std::move(d).value();
    auto sid =
        client->RegisterBuffer("m", v1::SOURCE, src->name(), {Slice("w", v1::FP32, {32, 32})});
    auto did =
        client->RegisterBuffer("m", v1::DESTINATION, dst->name(), {Slice("w", v1::FP32, {32, 32})});
    REQUIRE(sid.ok());
    REQUIRE(did.ok());
    src_id = *sid;
    dst_id = *did;
  }

  // Registering these tensors in `src` must fail with `code` and change nothing.
  void ExpectRegisterFails(std::vector<v1::TensorSlice> tensors, StatusCode code,
                           v1::Role role = v1::SOURCE, const std::string& model = "m") {
    auto before = client->Status();
    REQUIRE(before.ok());
    auto id = client->RegisterBuffer(model, role, src->name(), tensors);
    INFO(id.status().ToString());
    CHECK(id.status().code() == code);
    auto after = client->Status();
    REQUIRE(after.ok());
    CHECK(after->models_size() == before->models_size());
    CHECK(after->models(0).source_buffers() == before->models(0).source_buffers());
    CHECK(after->models(0).destination_buffers() == before->models(0).destination_buffers());
  }

  // The daemon still does its job: publish a fresh version and apply it bit-exact.
  void ExpectStillServing() {
    auto latest = client->Status();
    REQUIRE(latest.ok());
    const uint64_t next = latest->models(0).latest_version() + 1;
    std::memset(src->data(), static_cast<int>(next), 4096);
    REQUIRE(client->Publish("m", next, {src_id}).ok());
    auto applied = client->Apply("m", 0, {dst_id});
    REQUIRE(applied.ok());
    CHECK(applied->version() == next);
    CHECK(std::memcmp(src->data(), dst->data(), 4096) == 0);
  }

  std::unique_ptr<testing::DaemonProcess> daemon;
  std::unique_ptr<client::Client> client;
  std::optional<SharedMemory> src, dst;
  std::string src_id, dst_id;
};

TEST_CASE_METHOD(Fixture, "malformed slices are INVALID_ARGUMENT", "[integration][codes]") {
  SECTION("out of the tensor's bounds") {
    ExpectRegisterFails({Slice("x", v1::FP32, {8, 8}, 0, {4, 0}, {8, 8})},
                        StatusCode::kInvalidArgument);
  }
  SECTION("overlapping in one buffer") {
    ExpectRegisterFails({Slice("x", v1::FP32, {16}, 0), Slice("y", v1::FP32, {16}, 32)},
                        StatusCode::kInvalidArgument);
  }
  SECTION("shape disagreement with the model") {
    ExpectRegisterFails({Slice("w", v1::FP32, {16, 64})}, StatusCode::kInvalidArgument);
  }
  SECTION("dtype disagreement with the model") {
    ExpectRegisterFails({Slice("w", v1::BF16, {32, 32})}, StatusCode::kInvalidArgument);
  }
  SECTION("region too small") {
    ExpectRegisterFails({Slice("x", v1::FP32, {2048})}, StatusCode::kInvalidArgument);
  }
  SECTION("unspecified dtype, no role, unknown dtype value, empty model") {
    ExpectRegisterFails({Slice("x", v1::DTYPE_UNSPECIFIED, {4})}, StatusCode::kInvalidArgument);
    ExpectRegisterFails({Slice("x", v1::FP32, {4})}, StatusCode::kInvalidArgument,
                        v1::ROLE_UNSPECIFIED);
    ExpectRegisterFails({Slice("x", static_cast<v1::DType>(77), {4})},
                        StatusCode::kInvalidArgument);
    ExpectRegisterFails({Slice("x", v1::FP32, {4})}, StatusCode::kInvalidArgument, v1::SOURCE, "");
  }
  SECTION("two slices of one tensor disagreeing in one request") {
    ExpectRegisterFails({Slice("x", v1::FP32, {2, 4}, 0, {0, 0}, {1, 4}),
                         Slice("x", v1::BF16, {2, 4}, 64, {1, 0}, {1, 4})},
                        StatusCode::kInvalidArgument);
  }
  SECTION("malformed slices with a missing shm object: the slices are what's wrong") {
    auto id = client->RegisterBuffer("m", v1::SOURCE, "/refit-no-such-object",
                                     {Slice("x", v1::FP32, {8, 8}, 0, {4, 0}, {8, 8})});
    CHECK(id.status().code() == StatusCode::kInvalidArgument);
    id = client->RegisterBuffer("m", v1::ROLE_UNSPECIFIED, "/refit-no-such-object",
                                {Slice("x", v1::FP32, {4})});
    CHECK(id.status().code() == StatusCode::kInvalidArgument);
  }
  SECTION("a memory window past the shm object's end") {
    auto id = client->RegisterBuffer("m", v1::SOURCE, src->name(), {Slice("x", v1::FP32, {4})}, "",
                                     4000, 200);
    CHECK(id.status().code() == StatusCode::kInvalidArgument);
  }
  ExpectStillServing();
}

TEST_CASE_METHOD(Fixture, "missing shm objects and buffer ids are NOT_FOUND",
                 "[integration][codes]") {
  auto id =
      client->RegisterBuffer("m", v1::SOURCE, "/refit-no-such-object", {Slice("x", v1::FP32, {4})});
  CHECK(id.status().code() == StatusCode::kNotFound);
  CHECK(client->Publish("m", 1, {"no-such-buffer"}).status().code() == StatusCode::kNotFound);
  CHECK(client->Apply("m", 0, {"no-such-buffer"}).status().code() == StatusCode::kNotFound);
  CHECK(client->ReleaseBuffer("no-such-buffer").code() == StatusCode::kNotFound);
  ExpectStillServing();
}

TEST_CASE_METHOD(Fixture, "a version not newer than the buffer's last is FAILED_PRECONDITION",
                 "[integration][codes]") {
  REQUIRE(client->Publish("m", 5, {src_id}).ok());
  CHECK(client->Publish("m", 5, {src_id}).status().code() == StatusCode::kFailedPrecondition);
  CHECK(client->Publish("m", 3, {src_id}).status().code() == StatusCode::kFailedPrecondition);
  auto status = client->Status();
  REQUIRE(status.ok());
  CHECK(status->models(0).latest_version() == 5);
  ExpectStillServing();
}

TEST_CASE_METHOD(Fixture,
                 "Apply of an incomplete version is FAILED_PRECONDITION; of a dropped "
                 "one NOT_FOUND",
                 "[integration][codes]") {
  CHECK(client->Apply("m", 0, {dst_id}).status().code() == StatusCode::kFailedPrecondition);
  for (uint64_t v = 1; v <= 3; ++v) REQUIRE(client->Publish("m", v, {src_id}).ok());
  CHECK(client->Apply("m", 4, {dst_id}).status().code() == StatusCode::kFailedPrecondition);
  CHECK(client->Apply("m", 1, {dst_id}).status().code() == StatusCode::kNotFound);  // --retain=2
  CHECK(client->Apply("m", 2, {dst_id}).ok());
  ExpectStillServing();
}

TEST_CASE_METHOD(Fixture, "WaitForVersion past its deadline is DEADLINE_EXCEEDED",
                 "[integration][codes]") {
  CHECK(client->WaitForVersion("m", 1, milliseconds(200)).status().code() ==
        StatusCode::kDeadlineExceeded);
  CHECK(client->WaitForVersion("unknown-model", 1, milliseconds(100)).status().code() ==
        StatusCode::kDeadlineExceeded);
  ExpectStillServing();
}

TEST_CASE_METHOD(Fixture, "a CUDA IPC handle without CUDA support is FAILED_PRECONDITION",
                 "[integration][codes]") {
  v1::RegisterBufferRequest request;
  request.set_model("m");
  request.set_role(v1::DESTINATION);
  request.mutable_memory()->mutable_cuda_ipc()->set_handle(std::string(64, '\1'));
  request.mutable_memory()->mutable_cuda_ipc()->set_device(0);
  request.mutable_memory()->set_size(4096);
  *request.add_tensors() = Slice("w", v1::FP32, {32, 32});
  CHECK(client->RegisterBuffer(request).status().code() == StatusCode::kFailedPrecondition);
  // By UUID: one that names a GPU is as unservable here; a malformed one is bad input anywhere.
  request.mutable_memory()->mutable_cuda_ipc()->set_device_uuid(
      "GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a");
  CHECK(client->RegisterBuffer(request).status().code() == StatusCode::kFailedPrecondition);
  for (const char* uuid : {"GPU-6b1c9f2e", "MIG-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a", "0"}) {
    request.mutable_memory()->mutable_cuda_ipc()->set_device_uuid(uuid);
    auto registered = client->RegisterBuffer(request);
    INFO(uuid << ": " << registered.status().ToString());
    CHECK(registered.status().code() == StatusCode::kInvalidArgument);
  }
  ExpectStillServing();
}

TEST_CASE_METHOD(Fixture, "buffers of the wrong role or model are INVALID_ARGUMENT",
                 "[integration][codes]") {
  CHECK(client->Publish("m", 1, {dst_id}).status().code() == StatusCode::kInvalidArgument);
  CHECK(client->Apply("m", 0, {src_id}).status().code() == StatusCode::kInvalidArgument);
  CHECK(client->Publish("m", 1, {}).status().code() == StatusCode::kInvalidArgument);
  CHECK(client->Publish("m", 0, {src_id}).status().code() == StatusCode::kInvalidArgument);
  ExpectStillServing();
}

TEST_CASE("a Publish past --max-slot-memory is RESOURCE_EXHAUSTED and changes nothing",
          "[integration][codes]") {
  // 192 KiB of slots: model a (64 KiB, retain 1) holds its version and a spare; model b's
  // 128 KiB version then takes a's spare's room, and a's next version has none left.
  // No deltas: their encoder would hold a version's slot for a while after the next.
  auto started = testing::DaemonProcess::Start(
      {"--retain=1", "--max-slot-memory=192KiB", "--delta-threshold=0"});
  REQUIRE(started.ok());
  auto connected = (*started)->Connect();
  REQUIRE(connected.ok());
  client::Client& c = **connected;
  auto a = SharedMemory::Create(testing::UniqueShmName("limit-a"), 64 << 10);
  auto b = SharedMemory::Create(testing::UniqueShmName("limit-b"), 128 << 10);
  auto d = SharedMemory::Create(testing::UniqueShmName("limit-d"), 64 << 10);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(d.ok());
  auto a_id = c.RegisterBuffer("a", v1::SOURCE, a->name(), {Slice("w", v1::UINT8, {64 << 10})});
  auto d_id =
      c.RegisterBuffer("a", v1::DESTINATION, d->name(), {Slice("w", v1::UINT8, {64 << 10})});
  auto b_id = c.RegisterBuffer("b", v1::SOURCE, b->name(), {Slice("w", v1::UINT8, {128 << 10})});
  REQUIRE(a_id.ok());
  REQUIRE(d_id.ok());
  REQUIRE(b_id.ok());
  std::memset(a->data(), 1, 64 << 10);
  REQUIRE(c.Publish("a", 1, {*a_id}).ok());
  std::memset(a->data(), 2, 64 << 10);
  REQUIRE(c.Publish("a", 2, {*a_id}).ok());
  REQUIRE(c.Publish("b", 1, {*b_id}).ok());

  std::memset(a->data(), 3, 64 << 10);
  auto refused = c.Publish("a", 3, {*a_id});
  INFO(refused.status().ToString());
  CHECK(refused.status().code() == StatusCode::kResourceExhausted);
  CHECK(refused.status().message().find("--max-slot-memory") != std::string::npos);
  // Nothing changed: the buffer may publish version 3 again (and is refused the same way).
  auto again = c.Publish("a", 3, {*a_id});
  CHECK(again.status().code() == StatusCode::kResourceExhausted);
  auto status = c.Status();
  REQUIRE(status.ok());
  for (const v1::ModelStatus& m : status->models()) {
    if (m.model() != "a") continue;
    CHECK(m.latest_version() == 2);
    for (const v1::BufferStatus& buffer : m.buffers()) {
      if (buffer.buffer_id() == *a_id) CHECK(buffer.last_published_version() == 2);
    }
  }
  CHECK(status->metrics().at("refit_slot_memory_bytes") == 192 << 10);
  CHECK(status->metrics().at("refit_slot_memory_limit_bytes") == 192 << 10);
  // Still serving what it holds.
  auto applied = c.Apply("a", 0, {*d_id});
  REQUIRE(applied.ok());
  CHECK(applied->version() == 2);
  CHECK(d->data()[0] == 2);
  CHECK(d->data()[(64 << 10) - 1] == 2);
}

}  // namespace
}  // namespace refit
