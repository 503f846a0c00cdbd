// Fault suite (issue 18): client deadlines are honoured. WaitForVersion and WaitForReplicas
// for a version that never comes answer DEADLINE_EXCEEDED at the deadline (the goal is within
// ±10 %; asserted here within a generous bound, the error is a figure for scripts/faults.sh),
// and an Apply cut short by its deadline leaves refitd serving: the next Apply is exact.
// $REFIT_FAULTS_ITERATIONS rounds (default 1).

#include <chrono>
#include <cmath>
#include <string>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/faults.h"
#include "tests/testing/required.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::MakeShm;

// Relative error of `elapsed` against `deadline`, after checking the call ended by its deadline
// within a generous bound.
double Honoured(const absl::Status& status, double elapsed, double deadline) {
  INFO(status.ToString() << " after " << elapsed << " s (deadline " << deadline << " s)");
  CHECK(status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(elapsed >= deadline * 0.9);
  CHECK(elapsed <= deadline * 1.5 + 0.5);
  return (elapsed - deadline) / deadline;
}

}  // namespace

TEST_CASE("WaitForVersion, WaitForReplicas and Apply honour the client's deadline",
          "[integration][faults][deadline]") {
  auto daemon = testing::DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  constexpr uint64_t kBytes = 128ull << 20;
  SharedMemory src = MakeShm("deadline", kBytes), dst = MakeShm("deadline", kBytes);
  const std::vector<v1::TensorSlice> layout = {Slice("w", v1::BF16, {kBytes / 2})};
  auto s = client.RegisterBuffer("m", v1::SOURCE, src.name(), layout, "trainer");
  auto d = client.RegisterBuffer("m", v1::DESTINATION, dst.name(), layout, "engine");
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  testing::FillPattern(src, 1);
  REQUIRE(client.Publish("m", 1, {*s}).ok());
  REQUIRE(client.WaitForVersion("m", 1, milliseconds(10000)).ok());

  std::vector<double> wait_errors, replicas_errors, apply_ms;
  const int rounds = testing::Iterations(1);
  for (int round = 0; round < rounds; ++round) {
    for (const int ms : {200, 1000, 3000}) {
      double started = testing::Now();
      auto waited = client.WaitForVersion("m", 99, milliseconds(ms));
      wait_errors.push_back(100 * Honoured(waited.status(), testing::Now() - started, ms / 1000.0));
      started = testing::Now();
      auto replicas = client.WaitForReplicas("m", 99, 0, milliseconds(ms));
      replicas_errors.push_back(100 *
                                Honoured(replicas.status(), testing::Now() - started, ms / 1000.0));
    }
    // An Apply of 128 MiB given 1 ms: cut short by its deadline, refitd goes on serving.
    client.set_call_timeout(milliseconds(1));
    const double started = testing::Now();
    auto cut = client.Apply("m", 1, {*d});
    apply_ms.push_back(1000 * (testing::Now() - started));
    client.set_call_timeout(milliseconds(60000));
    INFO(cut.status().ToString());
    CHECK(cut.status().code() == absl::StatusCode::kDeadlineExceeded);
    REQUIRE(client.Apply("m", 1, {*d}).ok());
    REQUIRE(testing::HoldsPattern(dst, 1));
  }
  testing::PrintFigure("deadline_wait_for_version_error", wait_errors, "%");
  testing::PrintFigure("deadline_wait_for_replicas_error", replicas_errors, "%");
  testing::PrintFigure("deadline_apply_1ms_returned_after", apply_ms, "ms");
  REQUIRE((*daemon)->running());
}

}  // namespace refit
