// CallBudget: long-lived calls counted per process, per uid and in all; the excess is
// RESOURCE_EXHAUSTED naming the bound; holds given back when they go.

#include "daemon/callers/call_budget.h"

#include <string>
#include <vector>

#include "catch2/catch.hpp"

namespace refit::callers {
namespace {

Caller Of(uid_t uid, pid_t pid) {
  Caller caller;
  caller.uid = uid;
  caller.pid = pid;
  return caller;
}

}  // namespace

TEST_CASE("CallBudget: bounded per process, per uid and in all", "[callers][hostile]") {
  CallBudget budget(CallLimits{2, 3, 4});
  std::vector<CallBudget::Hold> held;
  for (int i = 0; i < 2; ++i) {
    auto hold = budget.Acquire(Of(1000, 10), "Watch");
    REQUIRE(hold.ok());
    held.push_back(std::move(hold).value());
  }
  auto process = budget.Acquire(Of(1000, 10), "Watch");
  REQUIRE(process.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(process.status().message()).find("this client process holds 2") !=
        std::string::npos);
  // Another process of the uid: one more, then the uid's bound.
  auto other = budget.Acquire(Of(1000, 11), "WaitForVersion");
  REQUIRE(other.ok());
  auto uid = budget.Acquire(Of(1000, 12), "WaitForVersion");
  REQUIRE(uid.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(uid.status().message()).find("this caller's uid holds 3") != std::string::npos);
  // Another uid: the total's last one, then nobody.
  auto last = budget.Acquire(Of(2000, 0), "Watch");
  REQUIRE(last.ok());
  REQUIRE(budget.Acquire(Of(3000, 5), "Watch").status().code() ==
          absl::StatusCode::kResourceExhausted);
  CHECK(budget.held() == 4);
  CHECK(budget.held_by_uid(1000) == 3);
  // Given back as the holds go, moved holds counted once.
  CallBudget::Hold moved = std::move(held[0]);
  held.clear();
  CHECK(budget.held() == 3);
  moved.Release();
  moved.Release();
  CHECK(budget.held() == 2);
  REQUIRE(budget.Acquire(Of(1000, 10), "Watch").ok());  // a temporary: released at once
  CHECK(budget.held() == 2);
}

}  // namespace refit::callers
