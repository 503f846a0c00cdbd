// dataplane::DataPlane in one process, over the in-process transport (issue 38 item 3): a source
// node's data plane exposes a slot, a puller's data plane reads it. The puller's transport is
// the in-process one behind a ScriptedTransport that the test steers: it can hand completions
// back in reverse, fail one read, flip a byte of one read as it lands (a byte corrupted on the
// wire), hold every read until the test lets go (or let them through a few at a time, as a slow
// link's would arrive), and tell the plane that it may block on a wake fd of its own (as UCX's
// armed worker fd does), so the plane's blocking paths are exercised.

#include "daemon/dataplane/data_plane.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/common/xxh3.h"
#include "daemon/dataplane/data_plane_testing.h"
#include "daemon/memory/region.h"
#include "daemon/metrics/metrics.h"
#include "daemon/transport/inproc/inproc_transport.h"

namespace refit::dataplane {
namespace {

using transport::Completion;
using transport::Endpoint;
using transport::LocalMemory;
using transport::RemoteMemory;
using transport::Span;

constexpr char kSource[] = "source";
constexpr char kPuller[] = "puller";
constexpr uint64_t kChunk = 64 << 10;  // one PostGet per chunk (not a batch of short reads)
constexpr uint64_t kBytes = 16 * kChunk;
constexpr auto kWait = std::chrono::seconds(10);  // a hang fails the test; never reached

std::vector<uint8_t> Pattern(uint64_t size, uint8_t seed) {
  std::vector<uint8_t> bytes(size);
  for (uint64_t i = 0; i < size; ++i) {
    bytes[i] = static_cast<uint8_t>((i * 131 + (i >> 12) + seed) & 0xff);
  }
  return bytes;
}

// What ScriptedTransport does to the completions it hands back; set before the reads it
// concerns are posted (the plane's thread reads it).
struct Script {
  bool reverse = false;  // hold completions until none is outstanding, then hand them back reversed
  int fail_nth = 0;      // the nth OK completion (1-based) reports UNAVAILABLE instead; 0: none
  int corrupt_nth = 0;   // the nth OK completion's first landed byte is flipped first; 0: none
  bool armable = false;  // PrepareToSleep / ArmWhileBusy say the plane may block on WakeFd()
};

class ScriptedTransport;

// The in-process endpoint, noting where each posted read lands (by cookie).
class ScriptedEndpoint final : public Endpoint {
 public:
  ScriptedEndpoint(std::unique_ptr<Endpoint> inner, ScriptedTransport* owner)
      : inner_(std::move(inner)), owner_(owner) {}
  absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(std::string_view descriptor) override {
    return inner_->ImportRemote(descriptor);
  }
  absl::Status PostGet(const LocalMemory& local, uint64_t local_offset, const RemoteMemory& remote,
                       uint64_t remote_offset, uint64_t length, uint64_t cookie) override;
  absl::Status PostGetSpans(const LocalMemory& local, const RemoteMemory& remote,
                            std::vector<Span> spans, uint64_t cookie) override;
  absl::Status PostPut(const LocalMemory& local, uint64_t local_offset, const RemoteMemory& remote,
                       uint64_t remote_offset, uint64_t length, uint64_t cookie) override {
    return inner_->PostPut(local, local_offset, remote, remote_offset, length, cookie);
  }
  void Cancel() override { inner_->Cancel(); }
  absl::Status status() const override { return inner_->status(); }
  uint64_t outstanding() const override { return inner_->outstanding(); }
  void SetFailureHandler(std::function<void(const absl::Status&)> handler) override {
    inner_->SetFailureHandler(std::move(handler));
  }

 private:
  std::unique_ptr<Endpoint> inner_;
  ScriptedTransport* const owner_;
};

class ScriptedTransport final : public transport::Transport {
 public:
  explicit ScriptedTransport(Script script)
      : inner_(transport::InprocTransport::Create()), script_(script) {
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    REQUIRE(wake_fd_ >= 0);
  }
  ~ScriptedTransport() override { close(wake_fd_); }

  const transport::Capabilities& capabilities() const override { return inner_->capabilities(); }
  const std::string& LocalAddress() const override { return inner_->LocalAddress(); }
  absl::StatusOr<std::unique_ptr<LocalMemory>> RegisterMemory(void* address, uint64_t length,
                                                              MemoryKind kind) override {
    return inner_->RegisterMemory(address, length, kind);
  }
  absl::StatusOr<std::unique_ptr<LocalMemory>> AllocateMemory(uint64_t length) override {
    return inner_->AllocateMemory(length);
  }
  absl::StatusOr<std::unique_ptr<Endpoint>> Connect(std::string_view peer_address) override {
    auto endpoint = inner_->Connect(peer_address);
    if (!endpoint.ok()) return endpoint.status();
    return std::unique_ptr<Endpoint>(new ScriptedEndpoint(std::move(endpoint).value(), this));
  }
  absl::StatusOr<Grant> GrantRead(const LocalMemory& memory, std::string_view token) override {
    return inner_->GrantRead(memory, token);
  }

  size_t Poll(std::vector<Completion>* out) override {
    ++polls;
    uint64_t count = 0;
    [[maybe_unused]] const ssize_t got = read(wake_fd_, &count, sizeof(count));
    if (held_.load() && allowance_.load() == 0) return 0;  // nothing moves until the test lets go
    std::vector<Completion> fresh;
    inner_->Poll(&fresh);
    for (Completion& c : fresh) {
      if (!c.status.ok()) {
        pending_.push_back(std::move(c));
        continue;
      }
      ++ok_completions_;
      const auto landed = landing_.find(c.cookie);
      if (ok_completions_ == script_.corrupt_nth && landed != landing_.end()) {
        landed->second[0] ^= 0x5a;
        corrupted_at = landed->second;
      }
      if (ok_completions_ == script_.fail_nth) {
        c.status = absl::UnavailableError("scripted: the link broke under this read");
      }
      landing_.erase(c.cookie);
      pending_.push_back(std::move(c));
    }
    // Reversed: only once every posted read has come back, so that a batch is reordered whole.
    if (script_.reverse && inner_->outstanding() > 0) return 0;
    if (script_.reverse && pending_.size() > 1) {
      std::reverse(pending_.begin(), pending_.end());
      ++reversed_batches;
    }
    size_t n = pending_.size();
    if (held_.load()) {  // trickling: only as many as the test allowed so far
      n = std::min<size_t>(n, static_cast<size_t>(allowance_.load()));
      allowance_ -= static_cast<int>(n);
    }
    for (size_t i = 0; i < n; ++i) out->push_back(std::move(pending_[i]));
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(n));
    return n;
  }
  uint64_t outstanding() const override { return inner_->outstanding() + pending_.size(); }
  uint64_t activity() const override { return inner_->activity(); }
  uint64_t bytes_served() const override { return inner_->bytes_served(); }

  bool PrepareToSleep() override {
    if (!script_.armable || held_.load() || outstanding() > 0) return false;
    ++sleeps;
    return true;
  }
  Armed ArmWhileBusy() override {
    if (!script_.armable) return Armed::kCannot;
    if ((!held_.load() || allowance_.load() > 0) && outstanding() > 0) {
      return Armed::kPending;  // Poll completes them
    }
    ++arms;
    return Armed::kArmed;
  }
  int WakeFd() const override { return script_.armable ? wake_fd_ : -1; }

  // Holds every read (Poll moves nothing) until Release, which wakes the plane through WakeFd
  // as a network event would.
  void Hold() { held_ = true; }
  void Release() {
    held_ = false;
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t written = write(wake_fd_, &one, sizeof(one));
  }
  // While held: lets `n` more completions through, and wakes the plane as their arrival would.
  void Trickle(int n) {
    allowance_ += n;
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t written = write(wake_fd_, &one, sizeof(one));
  }

  void NoteLanding(uint64_t cookie, uint8_t* at) { landing_[cookie] = at; }

  // Read from the test thread while the plane runs.
  std::atomic<uint64_t> polls{0};
  std::atomic<uint64_t> sleeps{0};  // PrepareToSleep said yes
  std::atomic<uint64_t> arms{0};    // ArmWhileBusy said kArmed
  std::atomic<int> reversed_batches{0};
  // Where the corrupted byte is (set on the plane's thread before the completion is handed
  // back; read by the test after the future is ready).
  uint8_t* corrupted_at = nullptr;

 private:
  std::unique_ptr<transport::InprocTransport> inner_;
  const Script script_;
  int wake_fd_ = -1;
  std::atomic<bool> held_{false};
  std::atomic<int> allowance_{0};  // completions Poll may still hand back while held
  int ok_completions_ = 0;
  std::map<uint64_t, uint8_t*> landing_;  // cookie -> first byte the read writes
  std::vector<Completion> pending_;
};

absl::Status ScriptedEndpoint::PostGet(const LocalMemory& local, uint64_t local_offset,
                                       const RemoteMemory& remote, uint64_t remote_offset,
                                       uint64_t length, uint64_t cookie) {
  absl::Status posted = inner_->PostGet(local, local_offset, remote, remote_offset, length, cookie);
  if (posted.ok())
    owner_->NoteLanding(cookie, static_cast<uint8_t*>(local.address()) + local_offset);
  return posted;
}

absl::Status ScriptedEndpoint::PostGetSpans(const LocalMemory& local, const RemoteMemory& remote,
                                            std::vector<Span> spans, uint64_t cookie) {
  const uint64_t first = spans.empty() ? 0 : spans.front().local_offset;
  absl::Status posted = inner_->PostGetSpans(local, remote, std::move(spans), cookie);
  if (posted.ok()) owner_->NoteLanding(cookie, static_cast<uint8_t*>(local.address()) + first);
  return posted;
}

// A source node (its own data plane over the plain in-process transport) exposing a slot that
// holds `truth`, and a puller node whose data plane reads it through a ScriptedTransport.
struct TwoPlanes {
  explicit TwoPlanes(Script script, uint64_t bytes = kBytes, ProgressOptions progress = {})
      : truth(Pattern(bytes, 7)),
        source_plane(transport::InprocTransport::Create(), TestDataPlaneOptions(), &source_metrics),
        scripted(new ScriptedTransport(script)),
        puller_plane(std::unique_ptr<transport::Transport>(scripted), Options(), &puller_metrics,
                     progress) {
    auto slot_or = source_plane.AllocateSlot(truth.size());
    REQUIRE(slot_or.ok());
    slot = std::shared_ptr<Region>(std::move(*slot_or));
    std::memcpy(slot->data(), truth.data(), truth.size());
    auto exposed = source_plane.Expose(slot, kPuller);
    REQUIRE(exposed.ok());
    grant = exposed->grant;
    fetch.node = kSource;
    fetch.buffer_id = "b";
    fetch.remote_key = exposed->descriptor;
    fetch.bytes = truth.size();
    fetch.ranges = {{0, truth.size()}};
    job.model = "m";
    job.version = 1;
    job.fetches.push_back(fetch);
    puller_plane.Connect(kSource, source_plane.LocalAddress());
  }

  static DataPlaneOptions Options() {
    DataPlaneOptions options;
    options.chunk_bytes = kChunk;
    options.inflight = 4;
    options.relay_chunk_bytes = kChunk / 4;
    return options;
  }

  // Staging slots the pulls land in (kept, so that the test can look at them).
  DataPlane::Acquire Acquire() {
    return [this](uint64_t size) -> absl::StatusOr<std::shared_ptr<Region>> {
      auto region = AllocateHost(size);
      if (!region.ok()) return region.status();
      std::shared_ptr<Region> held(std::move(*region));
      std::memset(held->data(), 0, held->size());
      staged.push_back(held);
      return held;
    };
  }

  bool Matches(const Region& region, uint64_t offset = 0, uint64_t length = kBytes) const {
    return std::memcmp(region.data() + offset, truth.data() + offset, length) == 0;
  }

  const std::vector<uint8_t> truth;
  Metrics source_metrics;
  Metrics puller_metrics;
  DataPlane source_plane;
  ScriptedTransport* const scripted;  // owned by puller_plane
  DataPlane puller_plane;
  std::shared_ptr<Region> slot;
  std::shared_ptr<void> grant;
  PullJob::Fetch fetch;
  PullJob job;
  std::vector<std::shared_ptr<Region>> staged;
};

template <typename Future>
auto Wait(Future& future) {
  REQUIRE(future.wait_for(kWait) == std::future_status::ready);
  return future.get();
}

// Waits until `counter` passes `above` (the plane's thread moves it).
void WaitFor(const std::atomic<uint64_t>& counter, uint64_t above) {
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (counter.load() <= above) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST_CASE("a pull's reads complete byte-equal, each with the digest of its bytes", "[dataplane]") {
  TwoPlanes planes(Script{});
  auto hashes = std::make_shared<DataPlane::ReadHashes>();
  auto pulled = planes.puller_plane.Pull(planes.job, planes.Acquire(), hashes);
  auto slots = Wait(pulled);
  REQUIRE(slots.ok());
  REQUIRE(slots->size() == 1);
  CHECK(planes.Matches(*(*slots)[0]));
  // One digest per chunk-sized read, at its offset: XXH3-64 of the source's bytes there.
  REQUIRE(hashes->size() == 1);
  CHECK((*hashes)[0].size() == kBytes / kChunk);
  for (uint64_t offset = 0; offset < kBytes; offset += kChunk) {
    INFO("offset " << offset);
    const auto it = (*hashes)[0].find(offset);
    REQUIRE(it != (*hashes)[0].end());
    CHECK(it->second.first == kChunk);
    CHECK(it->second.second == XXH3_64bits(planes.truth.data() + offset, kChunk));
  }
  CHECK(planes.puller_metrics.Get(kDataBytesReceived) == static_cast<double>(kBytes));
}

TEST_CASE("ranges are read at their offsets, and Read tells of each read as it lands",
          "[dataplane]") {
  TwoPlanes planes(Script{});
  auto staging = AllocateHost(kBytes);
  REQUIRE(staging.ok());
  std::shared_ptr<Region> slot(std::move(*staging));
  std::memset(slot->data(), 0, slot->size());
  // Two ranges, one not on the chunk grid; the bytes between them stay untouched.
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {{0, kChunk + 100},
                                                             {5 * kChunk + 7, 9 * kChunk}};
  std::vector<std::pair<uint64_t, uint64_t>> landed;
  auto read = planes.puller_plane.Read(
      planes.fetch, ranges, slot,
      [&landed](uint64_t offset, uint64_t length) { landed.emplace_back(offset, length); });
  REQUIRE(Wait(read).ok());
  uint64_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    CHECK(planes.Matches(*slot, begin, end - begin));
    covered += end - begin;
  }
  const std::vector<uint8_t> zeros(kBytes, 0);
  CHECK(std::memcmp(slot->data() + kChunk + 100, zeros.data(), 5 * kChunk + 7 - kChunk - 100) == 0);
  CHECK(std::memcmp(slot->data() + 9 * kChunk, zeros.data(), kBytes - 9 * kChunk) == 0);
  // Every landed read lies inside a range, and together they are the ranges' bytes.
  uint64_t told = 0;
  for (const auto& [offset, length] : landed) {
    const bool inside = std::any_of(ranges.begin(), ranges.end(), [&](const auto& range) {
      return offset >= range.first && offset + length <= range.second;
    });
    CHECK(inside);
    told += length;
  }
  CHECK(told == covered);
}

TEST_CASE("a relayed read lands in --relay-chunk-bytes steps, a plain one in --chunk-bytes",
          "[dataplane]") {
  TwoPlanes planes(Script{});
  for (const auto grain : {DataPlane::ReadGrain::kChunk, DataPlane::ReadGrain::kRelayed}) {
    auto staging = AllocateHost(kBytes);
    REQUIRE(staging.ok());
    std::shared_ptr<Region> slot(std::move(*staging));
    std::memset(slot->data(), 0, slot->size());
    const std::vector<std::pair<uint64_t, uint64_t>> ranges = {{0, 2 * kChunk + 100}};
    std::vector<std::pair<uint64_t, uint64_t>> landed;
    auto hashes = std::make_shared<DataPlane::ReadHashes>();
    auto read = planes.puller_plane.Read(
        planes.fetch, ranges, slot,
        [&landed](uint64_t offset, uint64_t length) { landed.emplace_back(offset, length); },
        hashes, grain);
    REQUIRE(Wait(read).ok());
    CHECK(planes.Matches(*slot, 0, 2 * kChunk + 100));
    const uint64_t step = grain == DataPlane::ReadGrain::kRelayed ? kChunk / 4 : kChunk;
    std::sort(landed.begin(), landed.end());
    REQUIRE(landed.size() == (2 * kChunk + 100 + step - 1) / step);
    for (size_t i = 0; i < landed.size(); ++i) {
      CHECK(landed[i].first == i * step);
      CHECK(landed[i].second == std::min<uint64_t>(step, 2 * kChunk + 100 - i * step));
    }
    // One digest per read, at the read's offset.
    REQUIRE(hashes->size() == 1);
    CHECK((*hashes)[0].size() == landed.size());
    CHECK((*hashes)[0].count(step) == 1);
  }
}

TEST_CASE("completions out of the order the reads were posted in", "[dataplane]") {
  Script script;
  script.reverse = true;
  TwoPlanes planes(script);
  auto hashes = std::make_shared<DataPlane::ReadHashes>();
  auto pulled = planes.puller_plane.Pull(planes.job, planes.Acquire(), hashes);
  auto slots = Wait(pulled);
  REQUIRE(slots.ok());
  CHECK(planes.Matches(*(*slots)[0]));
  // Four reads in flight at a time, each batch handed back last-posted first.
  CHECK(planes.scripted->reversed_batches.load() == static_cast<int>(kBytes / kChunk / 4));
  for (uint64_t offset = 0; offset < kBytes; offset += kChunk) {
    INFO("offset " << offset);
    CHECK((*hashes)[0].at(offset).second == XXH3_64bits(planes.truth.data() + offset, kChunk));
  }
}

TEST_CASE("a failed read fails the pull with its status; the plane keeps serving", "[dataplane]") {
  Script script;
  script.fail_nth = 3;
  TwoPlanes planes(script);
  auto pulled = planes.puller_plane.Pull(planes.job, planes.Acquire());
  auto slots = Wait(pulled);
  REQUIRE_FALSE(slots.ok());
  CHECK(slots.status().code() == absl::StatusCode::kUnavailable);
  CHECK(slots.status().message().find("the link broke") != std::string::npos);
  // The next pull on the same plane and connection is whole.
  auto again = planes.puller_plane.Pull(planes.job, planes.Acquire());
  auto second = Wait(again);
  REQUIRE(second.ok());
  CHECK(planes.Matches(*(*second)[0]));
}

TEST_CASE("a pull from a node the plane has no connection to fails UNAVAILABLE", "[dataplane]") {
  TwoPlanes planes(Script{});
  PullJob job = planes.job;
  job.fetches[0].node = "nobody";
  auto pulled = planes.puller_plane.Pull(job, planes.Acquire());
  auto slots = Wait(pulled);
  REQUIRE_FALSE(slots.ok());
  CHECK(slots.status().code() == absl::StatusCode::kUnavailable);
  // A descriptor that isn't one: refused, nothing read.
  job = planes.job;
  job.fetches[0].remote_key = "not a descriptor";
  auto bad = planes.puller_plane.Pull(job, planes.Acquire());
  auto refused = Wait(bad);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a byte corrupted in transit shows in its read's digest; a refetch repairs it",
          "[dataplane]") {
  Script script;
  script.corrupt_nth = 6;
  TwoPlanes planes(script);
  auto hashes = std::make_shared<DataPlane::ReadHashes>();
  auto pulled = planes.puller_plane.Pull(planes.job, planes.Acquire(), hashes);
  auto slots = Wait(pulled);
  REQUIRE(slots.ok());
  const std::shared_ptr<Region>& slot = (*slots)[0];
  REQUIRE(planes.scripted->corrupted_at != nullptr);
  const uint64_t bad = static_cast<uint64_t>(planes.scripted->corrupted_at - slot->data());
  REQUIRE(bad % kChunk == 0);
  CHECK_FALSE(planes.Matches(*slot));
  // The digest describes the bytes that landed: it differs from the source's for that read
  // only, which is how a checked pull finds the chunk to fetch again.
  std::vector<uint64_t> mismatched;
  for (uint64_t offset = 0; offset < kBytes; offset += kChunk) {
    const uint64_t digest = (*hashes)[0].at(offset).second;
    CHECK(digest == XXH3_64bits(slot->data() + offset, kChunk));
    if (digest != XXH3_64bits(planes.truth.data() + offset, kChunk)) mismatched.push_back(offset);
  }
  CHECK(mismatched == std::vector<uint64_t>{bad});
  auto refetched = planes.puller_plane.Refetch(planes.job, 0, {{bad, bad + kChunk}}, slot);
  REQUIRE(Wait(refetched).ok());
  CHECK(planes.Matches(*slot));
}

TEST_CASE("a read submitted while the plane is blocked on the wake fds is served", "[dataplane]") {
  Script script;
  script.armable = true;
  TwoPlanes planes(script);
  // Connected, nothing registered, nothing in flight: the plane blocks with no deadline. It
  // settles into a sleep that no poll interrupts (the Connect it was handed may still wake it
  // once right after its first sleep).
  WaitFor(planes.scripted->sleeps, 0);
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (true) {
    const uint64_t polls = planes.scripted->polls.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    if (planes.scripted->polls.load() == polls) break;  // asleep, not polling
    REQUIRE(std::chrono::steady_clock::now() < deadline);
  }
  auto pulled = planes.puller_plane.Pull(planes.job, planes.Acquire());
  auto slots = Wait(pulled);
  REQUIRE(slots.ok());
  CHECK(planes.Matches(*(*slots)[0]));
}

TEST_CASE(
    "reads in flight while the plane waits on the armed transport fd complete when it "
    "turns readable",
    "[dataplane]") {
  Script script;
  script.armable = true;
  TwoPlanes planes(script);
  planes.scripted->Hold();  // the reads go out; nothing comes back yet
  auto pulled = planes.puller_plane.Pull(planes.job, planes.Acquire());
  // With its reads in flight and none completing, the plane arms the transport and blocks on
  // its fd (after polling on for a little while).
  WaitFor(planes.scripted->arms, 0);
  CHECK(pulled.wait_for(std::chrono::milliseconds(0)) == std::future_status::timeout);
  planes.scripted->Release();  // a network event: the fd turns readable
  auto slots = Wait(pulled);
  REQUIRE(slots.ok());
  CHECK(planes.Matches(*(*slots)[0]));
}

TEST_CASE(
    "a pull whose reads trickle in completes under a progress policy that blocks, armed at most "
    "once per moderation",
    "[dataplane]") {
  Script script;
  script.armable = true;
  ProgressOptions progress;
  progress.window = std::chrono::milliseconds(1);
  progress.poll_rate = 1e18;  // past the first window: always block
  const auto moderation = std::chrono::milliseconds(5);
  progress.moderation = moderation;
  TwoPlanes planes(script, kBytes, progress);
  planes.scripted->Hold();
  const uint64_t arms_before = planes.scripted->arms.load();
  const auto start = std::chrono::steady_clock::now();
  auto pulled = planes.puller_plane.Pull(planes.job, planes.Acquire());
  // One read comes back every millisecond, each with a network event on the transport's fd.
  while (pulled.wait_for(std::chrono::milliseconds(1)) == std::future_status::timeout) {
    planes.scripted->Trickle(1);
    REQUIRE(std::chrono::steady_clock::now() - start < kWait);
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  auto slots = pulled.get();
  REQUIRE(slots.ok());
  CHECK(planes.Matches(*(*slots)[0]));
  // The plane blocked on the armed fd, but armed it no more often than once per moderation
  // (after the first window, which arms at every wait): events were taken a batch at a time.
  const uint64_t arms = planes.scripted->arms.load() - arms_before;
  INFO("arms " << arms << " in " << std::chrono::duration<double>(elapsed).count() << " s");
  CHECK(arms >= 1);
  CHECK(arms <= static_cast<uint64_t>(elapsed / moderation) + 3);
}

TEST_CASE("a plane stopped with a pull in flight fails it CANCELLED", "[dataplane]") {
  Script script;
  script.armable = true;
  auto planes = std::make_unique<TwoPlanes>(script);
  planes->scripted->Hold();
  auto pulled = planes->puller_plane.Pull(planes->job, planes->Acquire());
  WaitFor(planes->scripted->arms, 0);
  // Destroying the data plane stops its thread; the pull's future is answered.
  planes.reset();
  auto slots = Wait(pulled);
  REQUIRE_FALSE(slots.ok());
  CHECK(slots.status().code() == absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace refit::dataplane
