#include "daemon/dataplane/data_plane.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/common/liveness.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/test_hooks.h"
#include "daemon/common/xxh3.h"
#include "daemon/transport/wire.h"
#include "openssl/evp.h"
#include "openssl/hmac.h"

namespace refit::dataplane {
namespace {

// Counted only by the test build's REFIT_FAULT_TRANSIT_FLIP (daemon/common/test_hooks.h).
constexpr Counter kTestTransitFlips{"refit_test_transit_flips_total",
                                    "Test builds only: bytes flipped in transit on purpose."};

}  // namespace
namespace {

// Reads posted at once by one pull, whatever their size (each holds a UCX request).
constexpr int kMaxReadsInFlight = 1024;
// madvise(MADV_POPULATE_WRITE), Linux 5.14; glibc 2.36's headers may lack the name.
constexpr int kPopulateWrite = 23;
// Reads shorter than this go out in batches of up to kSpansPerBatch (Endpoint::PostGetSpans):
// a column-split tensor gives one short range per row.
constexpr uint64_t kShortRead = 64ull << 10;
// Spans of a long read sent as gathers: the most one gather carries (ucx_gather.cc).
constexpr uint64_t kGatherSpanBytes = 1ull << 20;
constexpr size_t kSpansPerBatch = 256;
// How often the loop lets slots that only their registration holds go: often while the data
// plane is busy (kLinger after it last got anything done), seldom when idle.
constexpr auto kSweepEvery = std::chrono::milliseconds(5);
constexpr auto kIdleSweepEvery = std::chrono::milliseconds(100);
// While the transport has something in flight (serving a peer's pull) and can't be armed, or
// progress_ says to poll on, the loop naps briefly (kNap) for kLinger after it last got
// anything done; later, kIdleNap.
constexpr auto kLinger = std::chrono::milliseconds(100);
constexpr auto kNap = std::chrono::microseconds(20);
constexpr auto kIdleNap = std::chrono::milliseconds(1);
// With something in flight and nothing done in a turn, when progress_ says to block, the loop
// blocks on the transport's wake fd (armed while busy: Transport::ArmWhileBusy) for at most
// kBusyWait, or naps kBusyNap where the transport can't arm. Spinning instead (Poll, yield,
// Poll) kept a core busy per pulling daemon for the whole pull: at K = 4 on two cores most of
// the daemons' CPU time, taken from the kernel's TCP work that moves the bytes.
constexpr auto kBusyWait = std::chrono::milliseconds(2);
constexpr auto kBusyNap = std::chrono::microseconds(50);
// A watched loop (DataPlaneOptions::liveness) turns at least this often, asleep or not, so
// that a wedge shows within a stall bound even when no work comes.
constexpr auto kLivenessTurn = std::chrono::milliseconds(500);
// A peer's slot not used by any pull for this long is no longer imported (unmapped).
constexpr auto kRemoteIdle = std::chrono::seconds(30);

// Test build only ($REFIT_FAULT_TRANSIT_FLIP=1/N): true for every Nth read that lands, whose
// first byte the caller then flips before the read is hashed, as a byte corrupted on the wire
// would be. Read once; 0 (off) in refitd.
bool TransitFlip() {
  static const long every = [] {
    const char* fault = TestSwitch("REFIT_FAULT_TRANSIT_FLIP");
    if (!fault) return 0L;
    const char* slash = std::strchr(fault, '/');
    const long n = std::atol(slash ? slash + 1 : fault);
    if (n > 0) Logger("dataplane")->warn("fault injection: every {}th read gets a flipped byte", n);
    return n;
  }();
  if (every <= 0) return false;
  static std::atomic<long> reads{0};
  return ++reads % every == 0;
}

// Test build only ($REFIT_FAULT_READ_PACE_US=N): the data-plane thread waits N µs before it
// posts each read, so that a pull takes at least (reads x N) however fast the machine is
// (tests/two_node_liveness_test, lease case). Read once; 0 (off) in refitd.
std::chrono::microseconds ReadPace() {
  static const std::chrono::microseconds pace = [] {
    const char* fault = TestSwitch("REFIT_FAULT_READ_PACE_US");
    const long us = fault ? std::atol(fault) : 0;
    if (us > 0) Logger("dataplane")->warn("fault injection: each read waits {} us", us);
    return std::chrono::microseconds(std::max(0L, us));
  }();
  return pace;
}

}  // namespace

struct DataPlane::Transfer {
  struct Op {
    size_t fetch;
    uint64_t offset;
    uint64_t length;
  };
  std::vector<Op> ops;
  size_t next = 0;
  int inflight = 0;
  uint64_t bytes_inflight = 0;
  std::vector<std::shared_ptr<Region>> staging;
  std::vector<transport::LocalMemory*> local;  // owned by registrations_
  std::vector<std::shared_ptr<transport::RemoteMemory>> remote;
  std::vector<transport::Endpoint*> endpoint;
  std::shared_ptr<ReadHashes> hashes;  // null: don't hash
  Landed landed;                       // null: nobody to tell
  absl::Status status;
  std::function<void(absl::Status)> done;
  bool finished = false;
};

DataPlane::DataPlane(std::unique_ptr<transport::Transport> transport, DataPlaneOptions options,
                     Metrics* metrics, ProgressOptions progress)
    : transport_(std::move(transport)),
      token_key_(::refit::transport::RandomBytes(32)),
      options_(options),
      metrics_(metrics),
      data_bytes_received_(metrics->Declare(kDataBytesReceived)),
      progress_(progress) {
  if (options_.chunk_bytes == 0 || options_.inflight < 1) {
    Logger("transport")
        ->critical(
            "DataPlane: chunk_bytes {} and inflight {}: set them from --chunk-bytes and "
            "--inflight (DaemonOptions; > 0)",
            options_.chunk_bytes, options_.inflight);
    std::abort();
  }
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    Logger("transport")->critical("eventfd: {}", std::strerror(errno));
    std::abort();
  }
  thread_ = std::thread([this] { Run(); });
}

DataPlane::~DataPlane() {
  {
    common::MutexLock lock(mu_);
    stop_ = true;
  }
  Wake();
  thread_.join();
  close(wake_fd_);
}

std::string DataPlane::LocalAddress() const {
  return transport_ ? transport_->LocalAddress() : std::string();
}

std::string DataPlane::TransportName() const {
  return transport_ ? transport_->capabilities().name : std::string("none");
}

void DataPlane::Post(std::function<void()> work) {
  {
    common::MutexLock lock(mu_);
    work_.push_back(std::move(work));
  }
  Wake();
}

void DataPlane::Wake() {
  const uint64_t one = 1;
  // EAGAIN: the counter is full, so the loop wakes anyway.
  [[maybe_unused]] const ssize_t written = write(wake_fd_, &one, sizeof(one));
}

ProgressPolicy::Sample DataPlane::Progress(Clock::time_point now,
                                           Clock::time_point active_at) const {
  return {now, bytes_read_, transport_ ? transport_->bytes_served() : 0, active_at};
}

bool DataPlane::Wait(int transport_fd, Clock::time_point until) {
  pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {transport_fd, POLLIN, 0}};  // -1: poll(2) ignores it
  timespec timeout{};
  const timespec* wait = nullptr;  // no deadline: until woken
  if (until != Clock::time_point::max()) {
    const auto ns = std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::nanoseconds>(until - Clock::now()).count());
    timeout.tv_sec = static_cast<time_t>(ns / 1000000000);
    timeout.tv_nsec = static_cast<long>(ns % 1000000000);
    wait = &timeout;
  }
  if (options_.liveness) options_.liveness->Idle();
  if (ppoll(fds, 2, wait, nullptr) > 0 && (fds[0].revents & POLLIN)) {
    uint64_t count = 0;
    [[maybe_unused]] const ssize_t got = read(wake_fd_, &count, sizeof(count));
    return true;
  }
  return false;
}

void DataPlane::Sleep(Clock::time_point active_at) {
  const auto now = Clock::now();
  auto until = Clock::time_point::max();
  if (!registrations_.empty()) until = std::min(until, next_sweep_);
  if (!imported_.empty()) until = std::min(until, last_eviction_ + kRemoteIdle / 8);
  if (options_.liveness) until = std::min(until, now + kLivenessTurn);
  int transport_fd = -1;
  if (transport_ && !transport_->PrepareToSleep()) {
    // Something in flight (serving a peer's reads, a closing endpoint): nap briefly while bytes
    // flow fast; otherwise block until the transport's next event where it can say when that
    // is (armed no sooner than progress_ allows: events gather meanwhile), briefly; else nap.
    const ProgressPolicy::Turn turn = progress_.Next(Progress(now, active_at));
    transport::Transport::Armed armed = transport::Transport::Armed::kCannot;
    if (turn.action == ProgressPolicy::Action::kBlock) {
      if (turn.arm_at > now) {
        if (until <= turn.arm_at) {  // a deadline of the loop's comes first
          if (until > now) Wait(-1, until);
          return;
        }
        if (Wait(-1, turn.arm_at)) return;  // posted work
      }
      armed = transport_->ArmWhileBusy();
    }
    if (armed == transport::Transport::Armed::kPending) return;
    if (armed == transport::Transport::Armed::kArmed) {
      transport_fd = transport_->WakeFd();
      until = std::min(until, Clock::now() + kBusyWait);
    } else {
      const Clock::duration nap = now - active_at < kLinger ? Clock::duration(kNap) : kIdleNap;
      until = std::min(until, Clock::now() + nap);
    }
  } else if (transport_) {
    progress_.Idle(now);
    transport_fd = transport_->WakeFd();  // may be -1
  }
  if (until <= now) return;
  Wait(transport_fd, until);
}

void DataPlane::WaitInFlight(Clock::time_point active_at) {
  const auto now = Clock::now();
  const ProgressPolicy::Turn turn = progress_.Next(Progress(now, active_at));
  if (turn.action == ProgressPolicy::Action::kPollOn) {
    std::this_thread::yield();  // bytes are flowing fast: poll on
    return;
  }
  // Interrupt moderation: the transport's events gather until arm_at; posted work still wakes
  // the loop.
  if (turn.arm_at > now && Wait(-1, turn.arm_at)) return;
  switch (transport_->ArmWhileBusy()) {
    case transport::Transport::Armed::kPending:
      return;  // Poll again at once
    case transport::Transport::Armed::kArmed:
      Wait(transport_->WakeFd(), Clock::now() + kBusyWait);
      return;
    case transport::Transport::Armed::kCannot:
      Wait(-1, Clock::now() + kBusyNap);
      return;
  }
}

void DataPlane::Run() {
  std::vector<transport::Completion> completions;
  // When the loop last got anything done: work, completions, or the transport serving a peer.
  auto active_at = Clock::now();
  uint64_t activity = 0;
  while (true) {
    std::deque<std::function<void()>> work;
    {
      common::MutexLock lock(mu_);
      if (stop_) break;
      work.swap(work_);
    }
    // Busy from here to the next sleep: a turn that never ends (a wedged transport) is stuck.
    if (options_.liveness) options_.liveness->Busy();
    TestHookWedge("dataplane");
    bool busy = !work.empty();
    for (auto& w : work) w();
    const auto now = Clock::now();
    // Unmap peers' slots nobody pulled for a while even when no pull comes to do it.
    if (!imported_.empty() && now - last_eviction_ > kRemoteIdle / 8) EvictImports(now);
    // Let slots that only their registration still holds go back to their pool (a few per
    // version and piece); on a deadline, not on every turn of this loop. Pulls sweep first too.
    if (!registrations_.empty() && now >= next_sweep_) {
      SweepRegistrations();
      next_sweep_ = now + (now - active_at < kLinger ? kSweepEvery : kIdleSweepEvery);
    }
    bool completed = false;
    if (transport_) {
      completions.clear();
      transport_->Poll(&completions);
      completed = !completions.empty();
      busy = busy || completed || transport_->activity() != activity;
      activity = transport_->activity();
      for (const auto& c : completions) {
        auto it = by_cookie_.find(c.cookie);
        if (it == by_cookie_.end()) continue;
        InFlight done = std::move(it->second);
        by_cookie_.erase(it);
        done.transfer->inflight -= done.reads;
        done.transfer->bytes_inflight -= done.length;
        if (c.status.ok()) {
          data_bytes_received_.Add(static_cast<double>(done.length));
          bytes_read_ += done.length;
          Transfer& t = *done.transfer;
          const bool flipped = t.status.ok() && TransitFlip();
          if (flipped) {
            const Transfer::Op& op = t.ops[done.first_op];
            static_cast<uint8_t*>(t.local[done.fetch]->address())[op.offset] ^= 0x5a;
            metrics_->Add(kTestTransitFlips, 1);
          }
          if (t.hashes && t.status.ok()) RecordHashes(t, done, c, /*rehash=*/flipped);
          if (t.landed && t.status.ok()) {
            for (size_t i = 0; i < done.count; ++i) {
              const Transfer::Op& op = t.ops[done.first_op + i];
              t.landed(op.offset, op.length);
            }
          }
        } else {
          Fail(*done.transfer, c.status);
        }
        Pump(done.transfer);
      }
    }
    if (busy) {
      active_at = Clock::now();
      next_sweep_ = std::min(next_sweep_, active_at + kSweepEvery);
    }
    // Our own reads in flight: poll on, or block between events (WaitInFlight, as progress_
    // says) when a turn completed nothing. Otherwise sleep until there is something to do.
    if (by_cookie_.empty()) {
      Sleep(active_at);
    } else if (!completed && work.empty()) {
      WaitInFlight(active_at);
    }
  }
  // Shutting down: fail what is left, then release UCX objects before the transport.
  for (auto& [cookie, in_flight] : by_cookie_) {
    Transfer& t = *in_flight.transfer;
    Fail(t, absl::CancelledError("refitd is stopping"));
    if (!t.finished) {
      t.finished = true;
      t.done(t.status);
    }
  }
  // Endpoints first: closing them cancels the gets still in flight, before the staging slots
  // they write into go with the transfers.
  imported_.clear();
  endpoints_.clear();
  by_cookie_.clear();
  registrations_.clear();
  common::MutexLock lock(alloc_mu_);
  transport_.reset();
}

absl::StatusOr<std::unique_ptr<Region>> DataPlane::AllocateSlot(uint64_t size) {
  std::unique_ptr<transport::LocalMemory> memory;
  {
    common::MutexLock lock(alloc_mu_);
    if (!transport_) return AllocateHost(size);
    ASSIGN_OR_RETURN(memory, transport_->AllocateMemory(size));
  }
  // Fault every page in now, as AllocateHost does, so the first copy into the slot runs at
  // memcpy speed. Shared memory past what /dev/shm may hold (a container's default 64 MiB)
  // would kill the process with SIGBUS at the first touch; MADV_POPULATE_WRITE (Linux 5.14)
  // reports that as an error instead, and the slot then comes from ordinary memory.
  const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t populate = (size + page - 1) / page * page;
  if (madvise(memory->address(), populate, kPopulateWrite) != 0) {
    const int error = errno;
    // EINVAL: a kernel before 5.14. Touch the pages instead, if /dev/shm has room for them
    // (where UCX puts POSIX shared memory; touching past its limit would be a SIGBUS).
    struct statvfs shm;
    const bool room = error == EINVAL && statvfs("/dev/shm", &shm) == 0 &&
                      static_cast<uint64_t>(shm.f_bavail) * shm.f_frsize >= populate;
    if (!room) {
      Logger("transport")
          ->warn(
              "cannot fault in {} B of transport memory ({}); this slot uses ordinary memory, "
              "which peers on this host read through UCX (check the size of /dev/shm)",
              size, std::strerror(error));
      memory.reset();
      return AllocateHost(size);
    }
    std::memset(memory->address(), 0, size);
  }
  return std::unique_ptr<Region>(new transport::TransportRegion(std::move(memory)));
}

transport::LocalMemory* DataPlane::Registration(const std::shared_ptr<Region>& region) {
  if (auto* allocated = dynamic_cast<const transport::TransportRegion*>(region.get())) {
    return allocated->memory();
  }
  SweepRegistrations();
  auto it = registrations_.find(region->data());
  if (it != registrations_.end() && it->second.region == region) return it->second.memory.get();
  auto registered = transport_->RegisterMemory(region->data(), region->size(), region->kind());
  if (!registered.ok()) {
    Logger("transport")
        ->error("cannot register {}: {}", region->Describe(), registered.status().ToString());
    return nullptr;
  }
  auto& entry = registrations_[region->data()];
  entry.memory = std::move(registered).value();  // replaces an alias's registration, if any
  entry.region = region;
  return entry.memory.get();
}

void DataPlane::SweepRegistrations() {
  for (auto it = registrations_.begin(); it != registrations_.end();) {
    if (it->second.region.use_count() == 1) {  // only the registration holds the slot
      it->second.memory.reset();               // deregistered first: no peer reads it from now on
      it = registrations_.erase(it);
    } else {
      ++it;
    }
  }
}

std::string DataPlane::SessionToken(const std::string& node) {
  // HMAC-SHA256 under this process's random key, cut to the token's length: the same node
  // always gets the same token, no node can work out another's, and nothing is kept per name
  // (peers choose names: a table of them would grow with every name a peer makes up).
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), token_key_.data(), static_cast<int>(token_key_.size()),
           reinterpret_cast<const unsigned char*>(node.data()), node.size(), mac,
           &length) == nullptr ||
      length < transport::Transport::kTokenBytes) {
    // Never happens with OpenSSL's SHA-256; a fresh random token only grants nothing later.
    return transport::RandomBytes(transport::Transport::kTokenBytes);
  }
  return std::string(reinterpret_cast<const char*>(mac), transport::Transport::kTokenBytes);
}

absl::StatusOr<DataPlane::Exposed> DataPlane::Expose(const std::shared_ptr<Region>& slot,
                                                     const std::string& node) {
  if (!transport_) return absl::UnavailableError("this refitd has no data plane");
  const std::string token = SessionToken(node);
  // A slot from AllocateSlot is registered already, and GrantRead may be called from any
  // thread: no trip to the data-plane thread (a Pin would otherwise wait for it).
  if (auto* allocated = dynamic_cast<const transport::TransportRegion*>(slot.get())) {
    common::MutexLock lock(alloc_mu_);  // the transport stays while it is held
    if (!transport_) return absl::UnavailableError("this refitd's data plane stopped");
    ASSIGN_OR_RETURN(transport::Transport::Grant grant,
                     transport_->GrantRead(*allocated->memory(), token));
    return Exposed{std::move(grant.descriptor), std::move(grant.hold)};
  }
  auto promise = std::make_shared<std::promise<absl::StatusOr<Exposed>>>();
  auto future = promise->get_future();
  Post([this, slot, token, promise] {
    transport::LocalMemory* memory = Registration(slot);
    if (!memory) {
      promise->set_value(absl::InternalError("cannot register a version slot"));
      return;
    }
    auto grant = transport_->GrantRead(*memory, token);
    if (!grant.ok()) {
      promise->set_value(grant.status());
    } else {
      promise->set_value(Exposed{std::move(grant->descriptor), std::move(grant->hold)});
    }
  });
  return future.get();
}

void DataPlane::Connect(const std::string& node, const std::string& address) {
  if (!transport_) return;
  Post([this, node, address] {
    imported_.erase(node);  // imported on the endpoint this replaces
    auto endpoint = transport_->Connect(address);
    if (!endpoint.ok()) {
      Logger("transport")->error("peer={} cannot connect: {}", node, endpoint.status().ToString());
      endpoints_.erase(node);
      return;
    }
    (*endpoint)->SetFailureHandler([node](const absl::Status& status) {
      Logger("transport")
          ->warn("peer={} data-plane connection failed: {}", node, status.ToString());
    });
    endpoints_[node] = std::move(endpoint).value();
  });
}

void DataPlane::Disconnect(const std::string& node) {
  Post([this, node] {
    if (auto it = endpoints_.find(node); it != endpoints_.end()) {
      // Pulls reading from it fail for what happened (their ops then end CANCELLED as the
      // endpoint goes), and post nothing more through it.
      const absl::Status gone = absl::UnavailableError(
          absl::StrCat("node ", node, " went away during the pull (its connection closed)"));
      for (auto& [cookie, in_flight] : by_cookie_) {
        Transfer& t = *in_flight.transfer;
        if (std::find(t.endpoint.begin(), t.endpoint.end(), it->second.get()) != t.endpoint.end()) {
          Fail(t, gone);
        }
      }
    }
    imported_.erase(node);  // before the endpoint they were imported on
    endpoints_.erase(node);
  });
}

void DataPlane::Fail(Transfer& t, absl::Status status) {
  if (t.status.ok()) t.status = std::move(status);
  t.next = t.ops.size();  // post nothing more
}

void DataPlane::Pump(const std::shared_ptr<Transfer>& transfer) {
  Transfer& t = *transfer;
  if (t.finished) return;
  // In flight: up to --inflight reads' worth of bytes (--inflight x --chunk-bytes). Chunk-sized
  // reads are --inflight at a time; the short reads of a resharded pull (a row-split tensor
  // gives one range per row) may be many more, up to kMaxReadsInFlight, so their round trips
  // overlap instead of adding up.
  const uint64_t budget = static_cast<uint64_t>(options_.inflight) * options_.chunk_bytes;
  while (t.status.ok() && t.next < t.ops.size() && t.inflight < kMaxReadsInFlight &&
         (t.inflight == 0 || t.bytes_inflight + t.ops[t.next].length <= budget)) {
    const Transfer::Op& op = t.ops[t.next];
    const uint64_t cookie = next_cookie_++;
    // Short reads of one fetch in a row: one batch (staging is laid out like the source piece,
    // so each span's local and remote offsets are equal).
    size_t n = 1;
    uint64_t bytes = op.length;
    if (op.length < kShortRead) {
      // A batch from a mapped slot is one copy job, and a gathering transport moves it as a
      // few messages; otherwise each span is a transport read and counts against
      // kMaxReadsInFlight.
      const bool one_job = OneRead(t, op.fetch);
      while (t.next + n < t.ops.size() && n < kSpansPerBatch &&
             (one_job || t.inflight + static_cast<int>(n) < kMaxReadsInFlight)) {
        const Transfer::Op& more = t.ops[t.next + n];
        if (more.fetch != op.fetch || more.length >= kShortRead ||
            t.bytes_inflight + bytes + more.length > budget) {
          break;
        }
        bytes += more.length;
        ++n;
      }
    }
    if (ReadPace().count() > 0) std::this_thread::sleep_for(ReadPace());
    absl::Status posted;
    // A long read from an unmapped peer slot over a gathering transport goes as gathers too
    // (active messages of at most kGatherSpanBytes each, served by refit's handler) rather than
    // UCX's software get: UCX 1.13 aborts the serving process when a get's requester dies while
    // it is being answered (ucp_get_req_handler: "unexpected error: Endpoint timeout"), and the
    // gather handler checks every span against the server's own registrations.
    if (n == 1 && op.length >= kShortRead && OneRead(t, op.fetch) &&
        !t.remote[op.fetch]->mapped()) {
      std::vector<transport::Span> spans;
      for (uint64_t at = 0; at < op.length; at += kGatherSpanBytes) {
        const uint64_t length = std::min(kGatherSpanBytes, op.length - at);
        spans.push_back({op.offset + at, op.offset + at, length});
      }
      posted = t.endpoint[op.fetch]->PostGetSpans(*t.local[op.fetch], *t.remote[op.fetch],
                                                  std::move(spans), cookie);
    } else if (n > 1) {
      std::vector<transport::Span> spans(n);
      for (size_t i = 0; i < n; ++i) {
        const Transfer::Op& o = t.ops[t.next + i];
        spans[i] = {o.offset, o.offset, o.length};
      }
      posted = t.endpoint[op.fetch]->PostGetSpans(*t.local[op.fetch], *t.remote[op.fetch],
                                                  std::move(spans), cookie);
    } else {
      posted = t.endpoint[op.fetch]->PostGet(*t.local[op.fetch], op.offset, *t.remote[op.fetch],
                                             op.offset, op.length, cookie);
    }
    if (!posted.ok()) {
      Fail(t, posted);
      break;
    }
    const int reads = OneRead(t, op.fetch) ? 1 : static_cast<int>(n);
    t.next += n;
    t.inflight += reads;
    t.bytes_inflight += bytes;
    by_cookie_[cookie] = InFlight{transfer, op.fetch, op.offset, bytes, t.next - n, n, reads};
  }
  if (t.inflight == 0 && (t.next >= t.ops.size() || !t.status.ok())) {
    t.finished = true;
    t.done(t.status);
  }
}

bool DataPlane::OneRead(const Transfer& t, size_t fetch) const {
  return t.remote[fetch]->BatchesSpans(t.local[fetch]->kind());
}

void DataPlane::RecordHashes(Transfer& t, const InFlight& done, const transport::Completion& c,
                             bool rehash) {
  // Each read's digest: from the transport when it hashed the bytes on the way, otherwise
  // taken here while they are likely still in cache.
  auto& by_offset = (*t.hashes)[done.fetch];
  const auto* bytes = static_cast<const uint8_t*>(t.local[done.fetch]->address());
  const bool given = !rehash && c.span_xxh3.size() == done.count;
  for (size_t i = 0; i < done.count; ++i) {
    const Transfer::Op& op = t.ops[done.first_op + i];
    uint64_t sum;
    if (done.count == 1 && c.has_xxh3 && !rehash) {
      sum = c.xxh3;
    } else if (given && done.count > 1) {
      sum = c.span_xxh3[i];
    } else {
      sum = XXH3_64bits(bytes + op.offset, op.length);
    }
    by_offset[op.offset] = {op.length, sum};
  }
}

absl::Status DataPlane::Prepare(Transfer& t, const PullJob::Fetch& fetch,
                                std::shared_ptr<Region> slot) {
  auto ep = endpoints_.find(fetch.node);
  if (ep == endpoints_.end() || !ep->second->status().ok()) {
    return absl::UnavailableError(absl::StrCat("no data-plane connection to node ", fetch.node));
  }
  absl::Status imported;
  std::shared_ptr<transport::RemoteMemory> remote =
      Import(*ep->second, fetch.node, fetch.remote_key, &imported);
  if (!remote) return imported;
  if (remote->length() < fetch.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("node ", fetch.node, " piece ", fetch.buffer_id,
                                                   " is smaller than announced"));
  }
  transport::LocalMemory* local = Registration(slot);
  if (!local) return absl::InternalError("cannot register a staging slot");
  t.endpoint.push_back(ep->second.get());
  t.remote.push_back(std::move(remote));
  t.local.push_back(local);
  t.staging.push_back(std::move(slot));
  return absl::OkStatus();
}

void DataPlane::EvictImports(std::chrono::steady_clock::time_point now) {
  for (auto& [name, by_descriptor] : imported_) {
    for (auto it = by_descriptor.begin(); it != by_descriptor.end();) {
      // Still used by a transfer in flight: the transfer holds it; only the cache lets go.
      it = now - it->second.used > kRemoteIdle ? by_descriptor.erase(it) : std::next(it);
    }
  }
  for (auto it = imported_.begin(); it != imported_.end();) {
    it = it->second.empty() ? imported_.erase(it) : std::next(it);
  }
  last_eviction_ = now;
}

std::shared_ptr<transport::RemoteMemory> DataPlane::Import(transport::Endpoint& endpoint,
                                                           const std::string& node,
                                                           const std::string& descriptor,
                                                           absl::Status* status) {
  const auto now = std::chrono::steady_clock::now();
  EvictImports(now);
  Imported& entry = imported_[node][descriptor];
  if (!entry.memory) {
    auto remote = endpoint.ImportRemote(descriptor);
    if (!remote.ok()) {
      imported_[node].erase(descriptor);
      *status = remote.status();
      return nullptr;
    }
    entry.memory = std::move(remote).value();
    Logger("transport")
        ->info("peer={} imported a {} B slot: {}", node, entry.memory->length(),
               entry.memory->mapped() ? "mapped here (shared memory, memcpy)"
                                      : "read through the transport");
  }
  entry.used = now;
  return entry.memory;
}

std::future<absl::StatusOr<std::vector<std::shared_ptr<Region>>>> DataPlane::Pull(
    const PullJob& job, Acquire acquire, std::shared_ptr<ReadHashes> hashes) {
  using Result = absl::StatusOr<std::vector<std::shared_ptr<Region>>>;
  auto promise = std::make_shared<std::promise<Result>>();
  auto future = promise->get_future();
  if (!transport_) {
    promise->set_value(absl::UnavailableError("this refitd has no data plane"));
    return future;
  }
  if (hashes) hashes->assign(job.fetches.size(), {});
  Post([this, job, acquire, promise, hashes] {
    SweepRegistrations();  // slots only their registration holds go back to the pool first
    auto t = std::make_shared<Transfer>();
    t->hashes = hashes;
    for (size_t f = 0; f < job.fetches.size(); ++f) {
      const PullJob::Fetch& fetch = job.fetches[f];
      auto slot = acquire(fetch.bytes);
      absl::Status ready = slot.ok() ? Prepare(*t, fetch, *slot) : slot.status();
      if (!ready.ok()) {
        promise->set_value(ready);
        return;
      }
      const size_t first = t->ops.size();
      for (const auto& [begin, end] : fetch.ranges) {
        for (uint64_t off = begin; off < end; off += options_.chunk_bytes) {
          t->ops.push_back({f, off, std::min(options_.chunk_bytes, end - off)});
        }
      }
      if (hashes) (*hashes)[f].reserve(t->ops.size() - first);
    }
    t->done = [t_weak = std::weak_ptr<Transfer>(t), promise](absl::Status status) {
      auto held = t_weak.lock();
      if (!status.ok() || !held) {
        promise->set_value(status.ok() ? absl::InternalError("transfer lost") : status);
      } else {
        promise->set_value(held->staging);
      }
    };
    Pump(t);
  });
  return future;
}

std::future<absl::Status> DataPlane::Read(const PullJob::Fetch& from,
                                          std::vector<std::pair<uint64_t, uint64_t>> ranges,
                                          std::shared_ptr<Region> slot, Landed landed,
                                          std::shared_ptr<ReadHashes> hashes, ReadGrain grain) {
  auto promise = std::make_shared<std::promise<absl::Status>>();
  auto future = promise->get_future();
  if (!transport_) {
    promise->set_value(absl::UnavailableError("this refitd has no data plane"));
    return future;
  }
  if (hashes) hashes->assign(1, {});
  const uint64_t step = grain == ReadGrain::kRelayed && options_.relay_chunk_bytes > 0
                            ? std::min(options_.chunk_bytes, options_.relay_chunk_bytes)
                            : options_.chunk_bytes;
  Post([this, from, ranges = std::move(ranges), slot, promise, landed = std::move(landed), hashes,
        step] {
    auto t = std::make_shared<Transfer>();
    absl::Status ready = Prepare(*t, from, slot);
    if (!ready.ok()) {
      promise->set_value(ready);
      return;
    }
    for (const auto& [begin, end] : ranges) {
      for (uint64_t off = begin; off < end; off += step) {
        t->ops.push_back({0, off, std::min(step, end - off)});
      }
    }
    t->landed = landed;
    t->hashes = hashes;
    t->done = [promise](absl::Status status) { promise->set_value(status); };
    Pump(t);
  });
  return future;
}

std::future<absl::Status> DataPlane::Refetch(const PullJob& job, size_t fetch,
                                             std::vector<std::pair<uint64_t, uint64_t>> ranges,
                                             std::shared_ptr<Region> slot) {
  return Read(job.fetches[fetch], std::move(ranges), std::move(slot));
}

}  // namespace refit::dataplane
