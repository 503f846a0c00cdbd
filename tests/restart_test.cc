// Clients ride out a restarted refitd (issue 18, C++ client) and registration is idempotent
// for the same caller and memory. The daemon is a real refitd, SIGKILLed and started again on
// the same socket; the other caller is a real process (tests/testing/as_client).

#include <signal.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using std::chrono::seconds;
using testing::DaemonProcess;

constexpr int64_t kRows = 256, kCols = 1024;  // bf16: 512 KiB, as_client's tensor "w"
constexpr uint64_t kBytes = kRows * kCols * 2;

std::vector<v1::TensorSlice> Tensors() { return {Slice("w", v1::BF16, {kRows, kCols}, 0)}; }

// The bytes of version `v`: every byte depends on the version and its offset.
void Fill(uint8_t* data, uint64_t v) {
  for (uint64_t i = 0; i < kBytes; ++i) data[i] = static_cast<uint8_t>(i * 7 + v * 13 + 1);
}
bool Holds(const uint8_t* data, uint64_t v) {
  for (uint64_t i = 0; i < kBytes; ++i) {
    if (data[i] != static_cast<uint8_t>(i * 7 + v * 13 + 1)) return false;
  }
  return true;
}

const v1::ModelStatus* FindModel(const v1::StatusResponse& status, const std::string& model) {
  for (const v1::ModelStatus& m : status.models()) {
    if (m.model() == model) return &m;
  }
  return nullptr;
}

// refitd processes, one after another, on one socket in a directory of the test's own (a
// DaemonProcess removes its directory when it goes).
class Generations {
 public:
  Generations() {
    char dir[] = "/tmp/r18c-restart-XXXXXX";
    REQUIRE(mkdtemp(dir) != nullptr);
    dir_ = dir;
    socket_ = dir_ + "/refitd.sock";
  }
  ~Generations() {
    daemons_.clear();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  // Starts the next refitd; an error (not REQUIRE: restarts run on a thread of their own).
  absl::Status Start() {
    auto daemon = DaemonProcess::Start({}, socket_);
    if (!daemon.ok()) return daemon.status();
    daemons_.push_back(std::move(daemon).value());
    return absl::OkStatus();
  }
  // SIGKILLs the current refitd and, after `downtime`, starts the next.
  absl::Status Restart(milliseconds downtime) {
    if (daemons_.back()->Stop(SIGKILL) != 128 + SIGKILL) {
      return absl::InternalError("refitd did not die of SIGKILL");
    }
    std::this_thread::sleep_for(downtime);
    return Start();
  }
  DaemonProcess& current() { return *daemons_.back(); }

 private:
  std::string dir_;
  std::string socket_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
};

// Waits (up to 20 s) until `done`.
template <typename Done>
bool WaitFor(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + seconds(20);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return true;
}

}  // namespace

TEST_CASE("a trainer and an engine carry on across a SIGKILLed and restarted refitd",
          "[integration][restart]") {
  Generations daemons;
  REQUIRE(daemons.Start().ok());
  auto t = daemons.current().Connect();
  auto e = daemons.current().Connect();
  REQUIRE(t.ok());
  REQUIRE(e.ok());
  client::Client& trainer = **t;
  client::Client& engine = **e;

  // The trainer's memory is a sealed memfd (passed anew after a restart), the engine's a
  // named shm object (registered again by name).
  auto src = SharedMemory::CreateSealed(kBytes, "r18c-trainer");
  auto dst = SharedMemory::Create(testing::UniqueShmName("r18c-engine"), kBytes);
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  auto src_id = trainer.RegisterBuffer("m", v1::SOURCE, *src, Tensors(), "trainer");
  auto dst_id = engine.RegisterBuffer("m", v1::DESTINATION, dst->name(), Tensors(), "engine");
  REQUIRE(src_id.ok());
  REQUIRE(dst_id.ok());

  Fill(src->data(), 1);
  REQUIRE(trainer.Publish("m", 1, {*src_id}).ok());
  REQUIRE(engine.WaitForVersion("m", 1, seconds(20)).ok());
  REQUIRE(engine.Apply("m", 1, {*dst_id}).ok());
  REQUIRE(Holds(dst->data(), 1));
  auto watcher = engine.Watch("m", 1);
  REQUIRE(watcher.ok());

  // The trainer loop keeps publishing through two restarts (and 5 versions past the second);
  // the engine follows with the watch opened before them and applies what it announces.
  std::atomic<bool> restarts_done{false};
  std::atomic<uint64_t> last{0};  // the trainer's final version, once it stopped
  std::atomic<bool> trainer_failed{false};
  std::string trainer_error;
  std::thread trainer_loop([&] {
    uint64_t after = 0;
    for (uint64_t v = 2;; ++v) {
      // The final version is known before it is published: the engine stops once it has it.
      const bool final = restarts_done && ++after == 5;
      if (final) last = v;
      Fill(src->data(), v);
      auto published = trainer.Publish("m", v, {*src_id});
      if (!published.ok()) {
        trainer_error = published.status().ToString();
        trainer_failed = true;
        last = v;
        (*watcher)->Cancel();  // the engine's loop ends (and the test fails below)
        return;
      }
      if (final) return;
      std::this_thread::sleep_for(milliseconds(50));
    }
  });
  absl::Status restarted;
  std::thread restarts([&] {
    std::this_thread::sleep_for(milliseconds(250));
    restarted = daemons.Restart(milliseconds(300));
    // Once both rode that one out, again (a refitd that is back at once).
    if (restarted.ok() &&
        !WaitFor([&] { return trainer.restarts_ridden() == 1 && engine.restarts_ridden() == 1; })) {
      restarted = absl::DeadlineExceededError("the clients did not register again");
    }
    std::this_thread::sleep_for(milliseconds(300));
    if (restarted.ok()) restarted = daemons.Restart(milliseconds(0));
    restarts_done = true;
  });
  uint64_t applied = 1, last_event = 1;
  while (last == 0 || applied < last) {
    if (trainer_failed) break;
    v1::VersionEvent event;
    const bool next = (*watcher)->Next(&event);
    INFO((*watcher)->status().ToString());
    REQUIRE(next);
    REQUIRE(event.version() > last_event);  // in order, each once
    last_event = event.version();
    if (event.version() <= applied) continue;
    auto apply = engine.Apply("m", 0, {*dst_id});  // the newest
    INFO(apply.status().ToString());
    REQUIRE(apply.ok());
    REQUIRE(apply->version() >= event.version());
    REQUIRE(Holds(dst->data(), apply->version()));  // bit-exact
    applied = apply->version();
  }
  restarts.join();
  trainer_loop.join();
  INFO(restarted.ToString());
  REQUIRE(restarted.ok());
  INFO(trainer_error);
  REQUIRE_FALSE(trainer_failed);
  (*watcher)->Cancel();
  const uint64_t kLast = last;

  // The engine's WaitForVersion style goes on too; callers still hold their first ids.
  auto newest = engine.WaitForVersion("m", kLast, seconds(20));
  INFO(newest.status().ToString());
  REQUIRE(newest.ok());
  REQUIRE(*newest == kLast);
  CHECK(trainer.restarts_ridden() == 2);
  CHECK(engine.restarts_ridden() == 2);
  // One buffer each on the daemon, not one per restart.
  auto status = engine.Status();
  REQUIRE(status.ok());
  const v1::ModelStatus* m = FindModel(*status, "m");
  REQUIRE(m != nullptr);
  CHECK(m->source_buffers() == 1);
  CHECK(m->destination_buffers() == 1);
  CHECK(m->latest_version() == kLast);
  REQUIRE(trainer.ReleaseBuffer(*src_id).ok());
  REQUIRE(engine.ReleaseBuffer(*dst_id).ok());
  REQUIRE(daemons.current().running());
}

TEST_CASE("a Watch of a client without buffers follows a restarted refitd",
          "[integration][restart]") {
  Generations daemons;
  REQUIRE(daemons.Start().ok());
  auto t = daemons.current().Connect();
  auto o = daemons.current().Connect();
  REQUIRE(t.ok());
  REQUIRE(o.ok());
  client::Client& trainer = **t;
  client::Client& observer = **o;  // registers nothing (a dashboard, `refitctl watch`)
  auto src = SharedMemory::CreateSealed(kBytes, "r33-trainer");
  REQUIRE(src.ok());
  auto src_id = trainer.RegisterBuffer("m", v1::SOURCE, *src, Tensors(), "trainer");
  REQUIRE(src_id.ok());
  Fill(src->data(), 1);
  REQUIRE(trainer.Publish("m", 1, {*src_id}).ok());
  auto watcher = observer.Watch("m");  // from now: after version 1
  REQUIRE(watcher.ok());

  REQUIRE(daemons.Restart(milliseconds(300)).ok());
  // The trainer rides the restart (registers again) and publishes 2 on the new refitd; the
  // observer's stream, broken by the kill, resumes after version 1 and delivers 2.
  Fill(src->data(), 2);
  auto published = trainer.Publish("m", 2, {*src_id});
  INFO(published.status().ToString());
  REQUIRE(published.ok());
  v1::VersionEvent event;
  const bool next = (*watcher)->Next(&event);
  INFO((*watcher)->status().ToString());
  REQUIRE(next);
  CHECK(event.version() == 2);
  CHECK(trainer.restarts_ridden() == 1);
  CHECK(observer.restarts_ridden() == 0);  // nothing to register again
  (*watcher)->Cancel();
}

TEST_CASE("a call waits for a restarted refitd only as long as restart_timeout",
          "[integration][restart]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto dst = SharedMemory::Create(testing::UniqueShmName("r18c-gone"), kBytes);
  REQUIRE(dst.ok());
  auto id = (*c)->RegisterBuffer("m", v1::DESTINATION, dst->name(), Tensors(), "engine");
  REQUIRE(id.ok());
  (*c)->set_restart_timeout(milliseconds(500));
  REQUIRE((*daemon)->Stop(SIGKILL) == 128 + SIGKILL);
  auto applied = (*c)->Apply("m", 1, {*id});
  CHECK(applied.status().code() == absl::StatusCode::kUnavailable);
  CHECK((*c)->restarts_ridden() == 0);
}

TEST_CASE("registering the same memory again: the same id for its caller, refused otherwise",
          "[integration][register]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  client::Client& client = **c;
  auto shm = SharedMemory::Create(testing::UniqueShmName("r18c-same"), kBytes);
  auto sealed = SharedMemory::CreateSealed(kBytes, "r18c-same");
  REQUIRE(shm.ok());
  REQUIRE(sealed.ok());

  auto first = client.RegisterBuffer("m", v1::SOURCE, shm->name(), Tensors(), "trainer");
  REQUIRE(first.ok());
  auto again = client.RegisterBuffer("m", v1::SOURCE, shm->name(), Tensors(), "trainer");
  REQUIRE(again.ok());
  CHECK(*again == *first);
  // A memfd passed twice is the same memory too.
  auto memfd_first = client.RegisterBuffer("m", v1::SOURCE, *sealed,
                                           {Slice("v", v1::BF16, {kRows, kCols}, 0)}, "trainer");
  REQUIRE(memfd_first.ok());
  auto memfd_again = client.RegisterBuffer("m", v1::SOURCE, *sealed,
                                           {Slice("v", v1::BF16, {kRows, kCols}, 0)}, "trainer");
  REQUIRE(memfd_again.ok());
  CHECK(*memfd_again == *memfd_first);

  auto count = [&] {
    auto status = client.Status();
    REQUIRE(status.ok());
    const v1::ModelStatus* m = FindModel(*status, "m");
    return m ? m->source_buffers() + m->destination_buffers() : 0;
  };
  CHECK(count() == 2);

  // Another role or layout on that memory: ALREADY_EXISTS naming the buffer; nothing changes.
  auto role = client.RegisterBuffer("m", v1::DESTINATION, shm->name(), Tensors(), "engine");
  CHECK(role.status().code() == absl::StatusCode::kAlreadyExists);
  CHECK(role.status().message().find(*first) != std::string::npos);
  auto layout = client.RegisterBuffer(
      "m", v1::SOURCE, shm->name(),
      {Slice("w", v1::BF16, {kRows, kCols}, 0, {0, 0}, {kRows / 2, kCols})}, "trainer");
  CHECK(layout.status().code() == absl::StatusCode::kAlreadyExists);
  // Another process registering it: refused the same way.
  auto other = testing::RunCommand({testing::RunfilePath("tests/testing/as_client"),
                                    (*daemon)->socket(), "register", "SOURCE", "m", shm->name()});
  INFO(other.out);
  CHECK(other.out.rfind("ALREADY_EXISTS ", 0) == 0);
  CHECK(other.out.find(*first) != std::string::npos);
  CHECK(count() == 2);
  REQUIRE(client.Publish("m", 1, {*first, *memfd_first}).ok());

  // A release of an id that is gone: NOT_FOUND, the other buffer untouched.
  REQUIRE(client.ReleaseBuffer(*first).ok());
  CHECK(client.ReleaseBuffer(*first).code() == absl::StatusCode::kNotFound);
  CHECK(count() == 1);
  REQUIRE((*daemon)->running());
}

}  // namespace refit
