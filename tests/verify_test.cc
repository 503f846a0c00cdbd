// Verified install (issue 18): Apply checks what landed against the version as it copies and
// answers DATA_LOSS naming the tensors when a byte differs (a test build's fault switch flips
// one under the copy, as a concurrent writer would); applying again restores them; `refitctl
// verify MODEL` compares the destination bytes with the version each buffer holds, later.

#include <cstring>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/faults.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using testing::DaemonProcess;

constexpr int64_t kRows = 1024, kCols = 1024;  // bf16: 2 MiB per tensor
constexpr uint64_t kBytes = kRows * kCols * 2;

SharedMemory Make(const std::string& tag, uint64_t bytes, int fill) {
  auto shm = SharedMemory::Create(testing::UniqueShmName(tag), bytes);
  REQUIRE(shm.ok());
  std::memset(shm->data(), fill, bytes);
  return std::move(shm).value();
}

double Metric(client::Client& c, const std::string& name) {
  auto status = c.Status();
  REQUIRE(status.ok());
  auto it = status->metrics().find(name);
  return it == status->metrics().end() ? -1 : it->second;
}

}  // namespace

TEST_CASE("Apply verifies what lands; refitctl verify finds bytes changed later",
          "[integration][verify]") {
  auto daemon = DaemonProcess::Start({}, "", {"REFIT_FAULT_APPLY_FLIP=1"});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  // Tensors "a" and "b" back to back; the destination holds them as fp32 "a" and bf16 "b".
  auto src = Make("verify-src", 2 * kBytes, 0x3c);
  auto src_id = client.RegisterBuffer(
      "m", v1::SOURCE, src.name(),
      {Slice("a", v1::BF16, {kRows, kCols}, 0), Slice("b", v1::BF16, {kRows, kCols}, kBytes)},
      "trainer");
  REQUIRE(src_id.ok());
  auto dst = Make("verify-dst", 3 * kBytes, 0);
  auto dst_id = client.RegisterBuffer(
      "m", v1::DESTINATION, dst.name(),
      {Slice("a", v1::FP32, {kRows, kCols}, 0), Slice("b", v1::BF16, {kRows, kCols}, 2 * kBytes)},
      "engine");
  REQUIRE(dst_id.ok());
  REQUIRE(client.Publish("m", 1, {*src_id}).ok());

  // A byte flipped under the copy: DATA_LOSS naming the tensor and buffer; the undo journal
  // put every byte back (atomic Apply): the buffer is as it was, nothing verified.
  auto first = client.Apply("m", 1, {*dst_id});
  REQUIRE(first.status().code() == absl::StatusCode::kDataLoss);
  const std::string message(first.status().message());
  INFO(message);
  CHECK(message.find(*dst_id) != std::string::npos);
  CHECK(message.find("put back as it was") != std::string::npos);
  {
    const std::vector<uint8_t> zeros(3 * kBytes, 0);
    CHECK(std::memcmp(dst.data(), zeros.data(), zeros.size()) == 0);
  }
  CHECK((message.find(": a") != std::string::npos || message.find(": b") != std::string::npos));
  CHECK(Metric(client, "refit_apply_verify_failures_total") == 1);
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto unverified =
      testing::RunCommand({refitctl, "--socket=" + (*daemon)->socket(), "verify", "m"});
  CHECK(unverified.exit_code == 0);
  CHECK(unverified.out.find("not checked") != std::string::npos);

  // Applying again restores every tensor; verify agrees.
  REQUIRE(client.Apply("m", 1, {*dst_id}).ok());
  CHECK(std::memcmp(dst.data() + 2 * kBytes, src.data() + kBytes, kBytes) == 0);
  auto ok = testing::RunCommand({refitctl, "--socket=" + (*daemon)->socket(), "verify", "m"});
  INFO(ok.out << ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(ok.out.find("version 1  ok") != std::string::npos);

  // Someone writes into tensor b afterwards: verify names it, exit 1.
  dst.data()[2 * kBytes + 12345] ^= 0xff;
  auto changed = testing::RunCommand({refitctl, "--socket=" + (*daemon)->socket(), "verify", "m"});
  INFO(changed.out << changed.err);
  CHECK(changed.exit_code == 1);
  CHECK(changed.err.find(*dst_id) != std::string::npos);
  CHECK(changed.err.find(": b") != std::string::npos);
  CHECK(changed.err.find("a,") == std::string::npos);
  auto rpc = client.Verify("m");
  CHECK(rpc.status().code() == absl::StatusCode::kDataLoss);
  // The next Apply puts it right.
  REQUIRE(client.Apply("m", 1, {*dst_id}).ok());
  CHECK(client.Verify("m").ok());
  CHECK(client.Verify("no-such-model").status().code() == absl::StatusCode::kNotFound);
  CHECK((*daemon)->running());
}

TEST_CASE("a flipped byte caught by the verified Apply leaves the buffer as it was, 0 mixed",
          "[integration][verify][faults]") {
  // Every one of the first kFlips verified Applies sees a byte change under its copy (the test
  // build's switch): each answers DATA_LOSS and the destination still holds the previous
  // version's bytes, all of them; then an Apply lands.
  const int kFlips = 1000;
  auto daemon = DaemonProcess::Start({}, "", {"REFIT_FAULT_APPLY_FLIP=" + std::to_string(kFlips)});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  constexpr int64_t kN = 256 * 1024;  // bf16 "w" (512 KiB), converted to fp32 for "x"
  auto src = Make("flip-src", 2 * kN * 2, 0x3c);
  auto src_id = client.RegisterBuffer(
      "m", v1::SOURCE, src.name(),
      {Slice("w", v1::BF16, {kN}, 0), Slice("x", v1::BF16, {kN}, kN * 2)}, "trainer");
  REQUIRE(src_id.ok());
  auto dst = Make("flip-dst", kN * 2 + kN * 4, 0x11);  // the "previous version"
  for (uint64_t i = 0; i < dst.size(); ++i) dst.data()[i] = static_cast<uint8_t>(i * 7 + 3);
  const std::vector<uint8_t> before(dst.data(), dst.data() + dst.size());
  auto dst_id = client.RegisterBuffer(
      "m", v1::DESTINATION, dst.name(),
      {Slice("w", v1::BF16, {kN}, 0), Slice("x", v1::FP32, {kN}, kN * 2)}, "engine");
  REQUIRE(dst_id.ok());
  REQUIRE(client.Publish("m", 1, {*src_id}).ok());
  int mixed = 0, refused = 0;
  for (int i = 0; i < kFlips; ++i) {
    auto applied = client.Apply("m", 1, {*dst_id});
    refused += applied.status().code() == absl::StatusCode::kDataLoss;
    mixed += std::memcmp(dst.data(), before.data(), before.size()) != 0;
  }
  testing::PrintFigureText("verified_apply_flip_mixed",
                           std::to_string(mixed) + "/" + std::to_string(kFlips));
  CHECK(refused == kFlips);
  CHECK(mixed == 0);
  CHECK(Metric(client, "refit_apply_verify_failures_total") == kFlips);
  REQUIRE(client.Apply("m", 1, {*dst_id}).ok());
  CHECK(std::memcmp(dst.data(), src.data(), kN * 2) == 0);
  CHECK(client.Verify("m").ok());
}

TEST_CASE("a flipped byte caught by the verified sparse Apply leaves the buffer as it was",
          "[integration][verify][faults]") {
  // The destination holds version 1; version 2 changes 0.4 % of the elements (a sparse Apply:
  // the test build's REFIT_TEST_SPARSE_ALWAYS takes it even on this small model). In each of
  // the first kFlips sparse Applies a byte changes under the first write: DATA_LOSS, and the
  // destination holds version 1, every byte; then one lands, bit-exact. (The switch flips the
  // first kFlips full Applies too: version 1 lands after them.)
  const int kFlips = 1000;
  auto daemon = DaemonProcess::Start(
      {"--retain=2"}, "",
      {"REFIT_FAULT_APPLY_FLIP=" + std::to_string(kFlips), "REFIT_TEST_SPARSE_ALWAYS=1"});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  constexpr int64_t kN = 256 * 1024;  // bf16 "w": 512 KiB
  auto src = Make("sflip-src", kN * 2, 0x3c);
  for (uint64_t i = 0; i < src.size(); ++i) src.data()[i] = static_cast<uint8_t>(i * 13 + 5);
  auto dst = Make("sflip-dst", kN * 2, 0x11);
  const std::vector<v1::TensorSlice> layout = {Slice("w", v1::BF16, {kN}, 0)};
  auto src_id = client.RegisterBuffer("m", v1::SOURCE, src.name(), layout, "trainer");
  auto dst_id = client.RegisterBuffer("m", v1::DESTINATION, dst.name(), layout, "engine");
  REQUIRE(src_id.ok());
  REQUIRE(dst_id.ok());
  REQUIRE(client.Publish("m", 1, {*src_id}).ok());
  int full_tries = 0;
  while (!client.Apply("m", 1, {*dst_id}).ok() && full_tries <= kFlips) ++full_tries;
  REQUIRE(full_tries == kFlips);
  const std::vector<uint8_t> v1_bytes(dst.data(), dst.data() + dst.size());
  REQUIRE(std::memcmp(v1_bytes.data(), src.data(), src.size()) == 0);
  for (uint64_t e = 0; e < static_cast<uint64_t>(kN); e += 250) src.data()[2 * e] ^= 1;
  REQUIRE(client.Publish("m", 2, {*src_id}).ok());
  const double sparse_before = Metric(client, "refit_apply_sparse_total");
  int mixed = 0, refused = 0;
  for (int i = 0; i < kFlips; ++i) {
    auto applied = client.Apply("m", 2, {*dst_id});
    refused += applied.status().code() == absl::StatusCode::kDataLoss;
    mixed += std::memcmp(dst.data(), v1_bytes.data(), v1_bytes.size()) != 0;
  }
  testing::PrintFigureText("verified_sparse_apply_flip_mixed",
                           std::to_string(mixed) + "/" + std::to_string(kFlips));
  CHECK(refused == kFlips);
  CHECK(mixed == 0);
  auto landed = client.Apply("m", 2, {*dst_id});
  REQUIRE(landed.ok());
  CHECK(std::memcmp(dst.data(), src.data(), src.size()) == 0);
  CHECK(Metric(client, "refit_apply_sparse_total") == sparse_before + 1);
  CHECK(client.Verify("m").ok());
}

TEST_CASE("a byte flipped under a sparse fp8 Apply: DATA_LOSS, the fp8 bytes and scales of N-1",
          "[integration][verify][faults]") {
  // As above, into an FP8_E4M3 destination with [128, 128] block scales: the sparse Apply
  // writes what version 2's quantization changed; each of the first kFlips is caught and
  // undone whole; then one lands, byte for byte a full Apply's (a second buffer, registered
  // afresh).
  const int kFlips = 200;
  auto daemon = DaemonProcess::Start(
      {"--retain=2"}, "",
      {"REFIT_FAULT_APPLY_FLIP=" + std::to_string(kFlips), "REFIT_TEST_SPARSE_ALWAYS=1"});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  constexpr int64_t kN = 512;  // bf16 "w" [512, 512]; fp8 256 KiB + [4, 4] scales
  constexpr uint64_t kFp8 = kN * kN, kDst = kFp8 + 16 * 4;
  auto src = Make("fflip-src", kN * kN * 2, 0);
  for (uint64_t e = 0; e < static_cast<uint64_t>(kN * kN); ++e) {
    const uint16_t v = static_cast<uint16_t>(0x3c00 | ((e * 2654435761u) >> 7 & 0x3ff));
    std::memcpy(src.data() + 2 * e, &v, 2);
  }
  auto dst = Make("fflip-dst", kDst, 0x11);
  auto ref = Make("fflip-ref", kDst, 0x22);
  v1::TensorSlice q = Slice("w", v1::FP8_E4M3, {kN, kN}, 0);
  q.set_scale_tensor("w_scale_inv");
  q.add_scale_block(128);
  q.add_scale_block(128);
  const std::vector<v1::TensorSlice> fp8 = {q, Slice("w_scale_inv", v1::FP32, {4, 4}, kFp8)};
  auto src_id = client.RegisterBuffer("m", v1::SOURCE, src.name(),
                                      {Slice("w", v1::BF16, {kN, kN}, 0)}, "trainer");
  auto dst_id = client.RegisterBuffer("m", v1::DESTINATION, dst.name(), fp8, "engine");
  REQUIRE(src_id.ok());
  REQUIRE(dst_id.ok());
  REQUIRE(client.Publish("m", 1, {*src_id}).ok());
  REQUIRE(client.WaitForVersion("m", 1, std::chrono::milliseconds(10000)).ok());  // quantized
  int full_tries = 0;
  while (!client.Apply("m", 1, {*dst_id}).ok() && full_tries <= kFlips) ++full_tries;
  REQUIRE(full_tries == kFlips);
  const std::vector<uint8_t> v1_bytes(dst.data(), dst.data() + dst.size());
  for (uint64_t e = 0; e < static_cast<uint64_t>(kN * kN); e += 50) src.data()[2 * e] ^= 0x10;
  REQUIRE(client.Publish("m", 2, {*src_id}).ok());
  REQUIRE(client.WaitForVersion("m", 2, std::chrono::milliseconds(10000)).ok());
  const double sparse_before = Metric(client, "refit_apply_sparse_total");
  int mixed = 0, refused = 0;
  for (int i = 0; i < kFlips; ++i) {
    auto applied = client.Apply("m", 2, {*dst_id});
    refused += applied.status().code() == absl::StatusCode::kDataLoss;
    mixed += std::memcmp(dst.data(), v1_bytes.data(), v1_bytes.size()) != 0;
  }
  testing::PrintFigureText("verified_sparse_fp8_apply_flip_mixed",
                           std::to_string(mixed) + "/" + std::to_string(kFlips));
  CHECK(refused == kFlips);
  CHECK(mixed == 0);
  auto landed = client.Apply("m", 2, {*dst_id});
  REQUIRE(landed.ok());
  CHECK(Metric(client, "refit_apply_sparse_total") == sparse_before + 1);
  CHECK(std::memcmp(dst.data(), v1_bytes.data(), v1_bytes.size()) != 0);
  auto ref_id = client.RegisterBuffer("m", v1::DESTINATION, ref.name(), fp8, "reference");
  REQUIRE(ref_id.ok());
  REQUIRE(client.Apply("m", 2, {*ref_id}).ok());
  CHECK(std::memcmp(dst.data(), ref.data(), kDst) == 0);
  CHECK(client.Verify("m").ok());
}

}  // namespace refit
