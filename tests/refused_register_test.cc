// Regression (issue 31, item 7): an engine node whose RegisterBuffer is refused (a wrong shape,
// a wrong dtype, memory already registered otherwise) keeps everything it knew of the model,
// the trainer's node's SOURCE buffers included: the engine then registers correctly, the
// trainer publishes, and the version arrives and applies bit-exact. Before the fix the refused
// registration dropped the model, and WaitForVersion answered "no node has SOURCE buffers".
// Two real refitd processes, real gRPC, UCX between them.

#include <unistd.h>

#include <cstring>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/two_nodes.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;

constexpr int64_t kRows = 256, kCols = 512;  // bf16 [256, 512]: 256 KiB
constexpr uint64_t kBytes = kRows * kCols * 2;

// True once `client`'s daemon knows `model` (from another node's SOURCE buffers).
bool KnowsModel(client::Client& client, const std::string& model) {
  auto s = client.Status();
  REQUIRE(s.ok());
  for (const auto& m : s->models()) {
    if (m.model() == model) return true;
  }
  return false;
}

TEST_CASE("a refused RegisterBuffer on the engine's node changes nothing; versions still arrive",
          "[integration][two]") {
  const std::string kind = GENERATE("shape", "dtype", "memory");
  INFO("refused for its " << kind);
  testing::TwoNodes nodes;
  SharedMemory src = testing::MakeShm(kBytes);
  auto s = nodes.trainer->RegisterBuffer("m", v1::SOURCE, src,
                                         {Slice("w", v1::BF16, {kRows, kCols})}, "trainer");
  REQUIRE(s.ok());
  // The engine's node hears of the trainer's SOURCE buffers before the engine registers.
  for (int i = 0; i < 200 && !KnowsModel(*nodes.engine, "m"); ++i) {
    std::this_thread::sleep_for(milliseconds(50));
  }
  REQUIRE(KnowsModel(*nodes.engine, "m"));

  SharedMemory dst = testing::MakeShm(kBytes);
  std::string other_buffer;
  if (kind == "shape") {
    auto bad = nodes.engine->RegisterBuffer("m", v1::DESTINATION, dst,
                                            {Slice("w", v1::BF16, {kRows, kCols / 2})}, "engine");
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  } else if (kind == "dtype") {
    auto bad = nodes.engine->RegisterBuffer("m", v1::DESTINATION, dst,
                                            {Slice("w", v1::INT32, {kRows, kCols})}, "engine");
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  } else {
    // The memory is already another model's buffer: ALREADY_EXISTS.
    auto held = nodes.engine->RegisterBuffer("other", v1::DESTINATION, dst,
                                             {Slice("x", v1::BF16, {kRows, kCols})}, "engine");
    REQUIRE(held.ok());
    other_buffer = *held;
    auto bad = nodes.engine->RegisterBuffer("m", v1::DESTINATION, dst,
                                            {Slice("w", v1::BF16, {kRows, kCols})}, "engine");
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.status().code() == absl::StatusCode::kAlreadyExists);
    REQUIRE(nodes.engine->ReleaseBuffer(other_buffer).ok());
  }
  // Nothing was forgotten: the model and its remote sources are still known.
  CHECK(KnowsModel(*nodes.engine, "m"));

  auto d = nodes.engine->RegisterBuffer("m", v1::DESTINATION, dst,
                                        {Slice("w", v1::BF16, {kRows, kCols})}, "engine");
  REQUIRE(d.ok());
  for (uint64_t v = 1; v <= 2; ++v) {
    testing::FillRandom(src, static_cast<uint32_t>(v));
    REQUIRE(nodes.trainer->Publish("m", v, {*s}).ok());
    auto got = nodes.engine->WaitForVersion("m", v, milliseconds(20000));
    INFO(got.status().ToString());
    REQUIRE(got.ok());
    CHECK(*got == v);
    REQUIRE(nodes.engine->Apply("m", v, {*d}).ok());
    CHECK(std::memcmp(dst.data(), src.data(), kBytes) == 0);
  }
}

}  // namespace
}  // namespace refit
