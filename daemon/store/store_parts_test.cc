// The store's parts on their own (issue 38: the store split along its seams): the checksum
// hints of a buffer, the slot budget, the quantizer's queue. The store's own tests cover them
// inside the store; these pin each part's contract.

#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/common/mutex.h"
#include "daemon/memory/checksum.h"
#include "daemon/memory/region.h"
#include "daemon/metrics/metrics.h"
#include "daemon/store/checksum_hints.h"
#include "daemon/store/quant_queue.h"
#include "daemon/store/slot_budget.h"
#include "daemon/store/store_metrics.h"

namespace refit {
namespace {

using Ranges = ChecksumHints::Ranges;

TEST_CASE("ChecksumHints: kept while asked about, dropped after kPublishes without") {
  ChecksumHints hints;
  CHECK(hints.ForPublish(1 << 20)->empty());
  // Two ranges of 1 KiB, 8 KiB apart, and a range longer than a copy block (never hashed).
  hints.Note(1 << 20, {{4096, 1024, 8192, 2}, {0, kCopyBlockBytes + 1, 0, 1}});
  CHECK(*hints.ForPublish(1 << 20) == Ranges{{4096, 5120}, {12288, 13312}});
  // Its first range again (a reader retrying a chunk) keeps the run as it is.
  hints.Note(1 << 20, {{4096, 1024, 8192, 1}});
  CHECK(hints.ForPublish(1 << 20)->size() == 2);
  // Past a smaller piece: dropped.
  CHECK(hints.ForPublish(8192)->empty());
  hints.Note(1 << 20, {{0, 512, 0, 1}});
  for (uint64_t i = 0; i < ChecksumHints::kPublishes; ++i) {
    CHECK(hints.ForPublish(1 << 20)->size() == 1);
  }
  CHECK(hints.ForPublish(1 << 20)->empty());  // not asked about for kPublishes + 1 Publishes
  // At most twice the piece's bytes are kept.
  hints.Note(4096, {{0, 1024, 1024, 4}, {8192, 1024, 1024, 5}});
  CHECK(hints.ForPublish(1 << 20)->size() == 4);
}

SlotBudget::Options BudgetOptions(uint64_t max_slot_bytes) {
  SlotBudget::Options options;
  options.retain = 2;
  options.max_spare_slot_bytes = 1 << 20;
  options.host_slot_allocator = [](uint64_t size) { return AllocateHost(size); };
  options.max_slot_bytes = max_slot_bytes;
  return options;
}

TEST_CASE("SlotBudget: shares, budgets, staging owners and the refusals") {
  Metrics metrics;
  SlotBudget budget(BudgetOptions(16384), &metrics);
  budget.SetShare("a", 4096);
  CHECK(budget.ShareOf("a") == 4096);
  CHECK(budget.ShareOf("b") == 0);

  ModelInfo info;
  budget.Fill("a", 0, &info);
  CHECK(info.share_bytes == 4096);
  CHECK(info.budget_bytes == 3 * 4096);
  CHECK(info.memory_warning.empty());

  // A staging slot of a size model "a" pulls belongs to it; another size to no model.
  budget.SetStaging("a", {4096});
  auto slot = budget.AcquireStaging(4096);
  REQUIRE(slot.ok());
  CHECK(budget.host()->UsageOf("a").in_use == 4096);
  auto other = budget.AcquireStaging(1024);
  REQUIRE(other.ok());
  CHECK(budget.host()->UsageOf("a").in_use == 4096);
  budget.EndStaging("a");
  auto after = budget.AcquireStaging(4096);
  REQUIRE(after.ok());
  CHECK(budget.host()->UsageOf("a").in_use == 4096);

  CHECK(budget.CheckVersionFits("b", 4096, "RegisterBuffer refused").ok());
  absl::Status refused = budget.CheckVersionFits("b", 16384, "RegisterBuffer refused");
  CHECK(refused.code() == absl::StatusCode::kResourceExhausted);
  CHECK(refused.message().find("--max-slot-memory=16384") != std::string::npos);
  CHECK(budget.CheckPullFits("a", 7, 16384, 1).code() == absl::StatusCode::kResourceExhausted);
  CHECK(budget.CheckPullFits("a", 7, 4096, 1).ok());

  budget.Forget("a");
  CHECK(budget.ShareOf("a") == 0);
  CHECK(metrics.Get(kSlotMemoryLimitBytes) == 16384);
}

struct FakeVersion {
  int number = 0;
};
using Queue = QuantQueue<FakeVersion>;

Queue::Job MakeJob(int number, bool early) {
  return {"m", std::make_shared<const FakeVersion>(FakeVersion{number}), early};
}

// Records each job, and holds the queue's thread inside it until Open.
class Recorder : public Queue::Worker {
 public:
  void Quantize(Queue::Job job) override {
    common::UniqueLock lock(mu_);
    seen_.push_back(std::string(job.early ? "early " : "whole ") +
                    std::to_string(job.version->number));
    changed_.NotifyAll();
    changed_.Wait(lock, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return open_; });
  }
  void Open() {
    common::MutexLock lock(mu_);
    open_ = true;
    changed_.NotifyAll();
  }
  std::vector<std::string> WaitFor(size_t n) {
    common::UniqueLock lock(mu_);
    changed_.Wait(lock, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return seen_.size() >= n; });
    return seen_;
  }
  std::vector<std::string> Seen() {
    common::MutexLock lock(mu_);
    return seen_;
  }

 private:
  common::Mutex mu_;
  common::CondVar changed_;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

TEST_CASE("QuantQueue: one job at a time, whole versions before early ones, each in order") {
  Recorder worker;
  Queue queue(&worker);
  queue.Push(MakeJob(1, false));
  CHECK(worker.WaitFor(1) == std::vector<std::string>{"whole 1"});  // the thread holds job 1
  queue.Push(MakeJob(2, true));
  queue.Push(MakeJob(3, false));
  queue.Push(MakeJob(4, true));
  queue.Push(MakeJob(5, false));
  worker.Open();
  CHECK(worker.WaitFor(5) ==
        std::vector<std::string>{"whole 1", "whole 3", "whole 5", "early 2", "early 4"});
  queue.Stop();
}

TEST_CASE("QuantQueue: Shutdown drops what is left once the running job ends") {
  Recorder worker;
  Queue queue(&worker);
  queue.Push(MakeJob(1, false));
  worker.WaitFor(1);
  queue.Push(MakeJob(2, false));
  queue.Shutdown();
  worker.Open();
  queue.Stop();  // joins the thread
  CHECK(worker.Seen() == std::vector<std::string>{"whole 1"});
  queue.Push(MakeJob(3, false));  // after Stop: a new thread that ends at once
  queue.Stop();
  CHECK(worker.Seen().size() == 1);
}

}  // namespace
}  // namespace refit
