// Riding out a restarted refitd (refit_client.h): waiting for it, registering a Client's
// buffers again, and the Watch that resumes after the last version it delivered.

#include <algorithm>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/lease_keeper.h"
#include "client/refit_client.h"
#include "client/registrations.h"
#include "daemon/common/mutex.h"
#include "grpcpp/grpcpp.h"

namespace refit::client {

uint64_t Client::restarts_ridden() const {
  common::MutexLock lock(recoveries_->mu);
  return recoveries_->count;
}

uint64_t Client::generation() const { return registrations_->generation(); }

std::optional<v1::StatusResponse> Client::StatusWhenBack() {
  using std::chrono::steady_clock;
  const auto deadline = steady_clock::now() + restart_timeout_;
  auto delay = std::chrono::milliseconds(100);
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::StatusResponse response;
    if (stub_->Status(&context, v1::StatusRequest(), &response).ok()) return response;
    if (steady_clock::now() + delay > deadline) return std::nullopt;
    std::this_thread::sleep_for(delay);
    delay = std::min(delay * 2, std::chrono::milliseconds(1000));
  }
}

absl::Status Client::RegisterAgain() {
  for (const Registrations::Entry& entry : registrations_->All()) {
    v1::RegisterBufferRequest request = entry.request;
    if (entry.memfd >= 0) {
      auto token = PassMemfd(entry.memfd);
      if (!token.ok()) return token.status();
      request.mutable_memory()->mutable_memfd()->set_token(*token);
    }
    auto response = RegisterOnce(request);
    if (!response.ok()) {
      return absl::Status(response.status().code(), absl::StrCat("registering buffer ", entry.first,
                                                                 " again on a restarted refitd: ",
                                                                 response.status().message()));
    }
    leases_->Remove(entry.current);
    registrations_->Moved(entry.first, response->buffer_id());
  }
  return absl::OkStatus();
}

bool Client::Recover(const absl::Status& error, uint64_t generation) {
  const absl::StatusCode code = error.code();
  if (restart_timeout_.count() <= 0 || registrations_->empty() ||
      (code != absl::StatusCode::kUnavailable && code != absl::StatusCode::kNotFound)) {
    return false;
  }
  common::MutexLock lock(recoveries_->mu);
  // Another call registered the buffers again meanwhile: retry with the ids it got.
  if (registrations_->generation() != generation) return true;
  const std::optional<v1::StatusResponse> status = StatusWhenBack();
  if (!status) return false;
  std::set<std::string> known;
  for (const v1::ModelStatus& model : status->models()) {
    for (const v1::BufferStatus& buffer : model.buffers()) known.insert(buffer.buffer_id());
  }
  for (const Registrations::Entry& entry : registrations_->All()) {
    // The same refitd: UNAVAILABLE was a passing failure; NOT_FOUND is the call's own answer.
    if (known.count(entry.current) > 0) return code == absl::StatusCode::kUnavailable;
  }
  if (!RegisterAgain().ok()) return false;
  ++recoveries_->count;
  return true;
}

bool Client::AwaitRefitd(const absl::Status& error, uint64_t generation) {
  if (!registrations_->empty()) return Recover(error, generation);
  if (restart_timeout_.count() <= 0 || error.code() != absl::StatusCode::kUnavailable) {
    return false;
  }
  return StatusWhenBack().has_value();
}

namespace {

// A Watch stream that, when it ends UNAVAILABLE, waits for refitd (Client::AwaitRefitd: with
// buffers, registering them again on a restarted one) and opens again after the last version it
// delivered.
class ResumingWatcher final : public Watcher {
 public:
  ResumingWatcher(Client* client, std::string model, uint64_t after_version)
      : client_(client), model_(std::move(model)), last_(after_version) {}

  void Open() {
    common::MutexLock lock(mu_);
    context_ = std::make_unique<grpc::ClientContext>();
    if (cancelled_) context_->TryCancel();
    v1::WatchRequest request;
    request.set_model(model_);
    request.set_after_version(last_);
    reader_ = client_->stub()->Watch(context_.get(), request);
    reader_->WaitForInitialMetadata();
  }
  // "From now": where now is, to resume from on another refitd.
  void set_last(uint64_t last) { last_ = last; }

  bool Next(v1::VersionEvent* event) override {
    while (true) {
      if (reader_->Read(event)) {
        last_ = event->version();
        return true;
      }
      const uint64_t generation = client_->generation();
      final_ = FromGrpc(reader_->Finish(), "Watch");
      if (Cancelled() || !client_->AwaitRefitd(final_, generation)) return false;
      Open();
    }
  }
  void Cancel() override {
    common::MutexLock lock(mu_);
    cancelled_ = true;
    if (context_) context_->TryCancel();
  }
  absl::Status status() override { return final_; }

 private:
  bool Cancelled() {
    common::MutexLock lock(mu_);
    return cancelled_;
  }

  Client* const client_;
  const std::string model_;
  uint64_t last_;
  common::Mutex mu_;  // Cancel comes from any thread
  std::unique_ptr<grpc::ClientContext> context_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<grpc::ClientReader<v1::VersionEvent>> reader_;
  absl::Status final_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Watcher>> Client::Watch(const std::string& model,
                                                       uint64_t after_version) {
  auto watcher = std::make_unique<ResumingWatcher>(this, model, after_version);
  watcher->Open();
  if (after_version == 0) {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::StatusResponse status;
    if (stub_->Status(&context, v1::StatusRequest(), &status).ok()) {
      for (const v1::ModelStatus& m : status.models()) {
        if (m.model() == model) watcher->set_last(m.latest_version());
      }
    }
  }
  return std::unique_ptr<Watcher>(std::move(watcher));
}

}  // namespace refit::client
