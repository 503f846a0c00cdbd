// Hostile client requests against the real refitd, generated from fixed seeds: thousands of
// requests on the Unix socket, each a sane request with a few fields mutated (edge integers,
// unknown enum values, names that aren't shm names, ids that don't exist, huge slice lists),
// then the same requests' bytes corrupted and sent raw. For every request:
//   - the answer's code is one docs/api.md gives (never UNKNOWN, INTERNAL, UNIMPLEMENTED, ...);
//   - a refused request changed nothing: Status (models, versions, buffers) and the destination
//     bytes are the same before and after;
//   - the daemon is still running.
// At the end the daemon still does its job: a fresh version is published and applied bit-exact.
// tests/peer_fuzz_test.cc does the same for what other daemons send.
//
// $REFIT_FUZZ_SEED and $REFIT_FUZZ_ROUNDS explore further; a failure prints the seed, the round
// and the request.
#include "tests/testing/fuzz.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/refit.grpc.pb.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using grpc::StatusCode;
using testing::Describe;
using testing::EnvOr;
using testing::Gen;
using testing::kShmBytes;
using testing::PrintCodes;

// What RegisterBuffer, Publish and Apply may answer (docs/api.md).
const std::set<StatusCode> kChangeCodes = {StatusCode::OK, StatusCode::INVALID_ARGUMENT,
                                           StatusCode::NOT_FOUND, StatusCode::FAILED_PRECONDITION};
// RegisterBuffer also: the same memory (sources share their region) registered again for
// another model, role or layout answers ALREADY_EXISTS (docs/api.md, Registering again).
const std::set<StatusCode> kRegisterCodes = {StatusCode::OK, StatusCode::INVALID_ARGUMENT,
                                             StatusCode::NOT_FOUND, StatusCode::FAILED_PRECONDITION,
                                             StatusCode::ALREADY_EXISTS};

// What a refused request must leave alone: every model's versions and buffers.
std::string Fingerprint(const v1::StatusResponse& status) {
  std::string out;
  for (const v1::ModelStatus& m : status.models()) {
    out += m.model() + " latest=" + std::to_string(m.latest_version()) + " versions=";
    for (uint64_t v : m.versions()) out += std::to_string(v) + ",";
    out += " src=" + std::to_string(m.source_buffers()) +
           " dst=" + std::to_string(m.destination_buffers()) +
           " abandoned=" + std::to_string(m.abandoned_version()) + " buffers=";
    for (const v1::BufferStatus& b : m.buffers()) {
      out += b.buffer_id() + "@" + std::to_string(b.last_published_version()) + ",";
    }
    out += "\n";
  }
  return out;
}

// The client API with a daemon, one source and one destination shm object, and what the
// fuzzer learned (buffer ids, versions published).
class ClientFuzz {
 public:
  ClientFuzz(testing::DaemonProcess& daemon, uint64_t seed)
      : gen_(seed),
        stub_(v1::Refit::NewStub(
            grpc::CreateChannel("unix:" + daemon.socket(), grpc::InsecureChannelCredentials()))),
        daemon_(daemon) {
    auto s = SharedMemory::Create(testing::UniqueShmName("fuzz-src"), kShmBytes);
    auto d = SharedMemory::Create(testing::UniqueShmName("fuzz-dst"), kShmBytes);
    REQUIRE(s.ok());
    REQUIRE(d.ok());
    src_ = std::move(s).value();
    dst_ = std::move(d).value();
    for (uint64_t i = 0; i < kShmBytes; ++i) src_->data()[i] = static_cast<uint8_t>(i * 7 + 1);
  }

  // One request of a random kind; checks its code and, when refused, that nothing changed.
  void Round() {
    switch (gen_.Below(10)) {
      case 0:
      case 1:
      case 2:
        return Register();
      case 3:
      case 4:
        return Publish();
      case 5:
      case 6:
        return Apply();
      case 7:
        return Wait();
      case 8:
        return Release();
      default:
        return Watch();
    }
  }

  // A request's serialized bytes, corrupted, sent to a random method: any answer will do as
  // long as the daemon lives (an unparseable request is gRPC's INTERNAL).
  void RawRound() {
    static const std::vector<std::string> kMethods = {
        "/refit.v1.Refit/RegisterBuffer", "/refit.v1.Refit/ReleaseBuffer",
        "/refit.v1.Refit/Publish",        "/refit.v1.Refit/WaitForVersion",
        "/refit.v1.Refit/Apply",          "/refit.v1.Refit/Status"};
    std::string bytes = RegisterRequest().SerializeAsString();
    for (uint64_t n = 1 + gen_.Below(4); n > 0 && !bytes.empty(); --n) {
      const uint64_t at = gen_.Below(bytes.size());
      switch (gen_.Below(3)) {
        case 0:
          bytes[at] = static_cast<char>(gen_.Below(256));
          break;
        case 1:
          bytes.resize(at);
          break;
        default:
          bytes.insert(at, 1 + gen_.Below(8), static_cast<char>(gen_.Below(256)));
      }
    }
    grpc::GenericStub generic(
        grpc::CreateChannel("unix:" + daemon_.socket(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::CompletionQueue queue;
    const std::string& method = gen_.Pick(kMethods);
    auto call = generic.PrepareUnaryCall(&context, method, request, &queue);
    call->StartCall();
    grpc::Status status;
    call->Finish(&response, &status, reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    REQUIRE(queue.Next(&tag, &ok));
    queue.Shutdown();
    while (queue.Next(&tag, &ok)) {
    }
    INFO(method << " " << status.error_code() << " " << status.error_message());
    REQUIRE(daemon_.running());
    ++codes_[status.error_code()];
  }

  // The daemon still works: a fresh model is published and applied bit-exact (fp32 to bf16
  // too), and Status answers.
  void ExpectStillServing() { testing::ExpectStillServing(daemon_, *src_, *dst_); }

  const std::map<int, int>& codes() const { return codes_; }

 private:
  struct Buffer {
    std::string id;
    std::string model;
    v1::Role role;
  };

  std::string Model() {
    static const std::vector<std::string> kModels = {"m", "m", "m", "n"};
    return gen_.OneIn(8) ? gen_.Text() : gen_.Pick(kModels);
  }

  v1::RegisterBufferRequest RegisterRequest() {
    v1::RegisterBufferRequest r;
    r.set_model(Model());
    r.set_role(gen_.OneIn(2) ? v1::SOURCE : v1::DESTINATION);
    const bool source = r.role() == v1::SOURCE;
    r.mutable_memory()->mutable_host_shm()->set_name(source ? src_->name() : dst_->name());
    r.set_client("fuzz");
    // Sources share their region's first 8 KiB (a replicated rank); destinations get a 4 KiB
    // place of their own where one is free, so that Apply has somewhere to write.
    const uint64_t base = source ? 0 : 4096 * gen_.Below(kShmBytes / 4096);
    for (uint64_t n = 1 + gen_.Below(2), at = base; n > 0; --n, at += 4096) {
      *r.add_tensors() = gen_.SaneSlice(at);
    }
    for (uint64_t n = gen_.Below(4); n > 0; --n) {
      switch (gen_.Below(12)) {
        case 0:
          r.set_role(static_cast<v1::Role>(gen_.Int(8)));
          break;
        case 1:
          r.mutable_memory()->mutable_host_shm()->set_name(ShmName());
          break;
        case 2:
          r.mutable_memory()->set_offset(gen_.U64(kShmBytes));
          break;
        case 3:
          r.mutable_memory()->set_size(gen_.U64(kShmBytes));
          break;
        case 4: {
          auto* cuda = r.mutable_memory()->mutable_cuda_ipc();
          cuda->set_handle(std::string(gen_.OneIn(2) ? 64 : gen_.Below(100), 'h'));
          cuda->set_device(static_cast<int32_t>(gen_.Int(8)));
          break;
        }
        case 5:
          r.mutable_memory()->clear_kind();
          break;
        case 6:
          r.clear_tensors();
          break;
        case 7:  // many slices of one tensor: overlapping in the buffer, or out of it
          for (int i = 0; i < 3000; ++i) *r.add_tensors() = gen_.SaneSlice(gen_.Below(kShmBytes));
          break;
        case 8:
          r.clear_memory();
          break;
        default:
          if (r.tensors_size() > 0) {
            gen_.MutateSlice(r.mutable_tensors(static_cast<int>(gen_.Below(r.tensors_size()))));
          }
      }
    }
    return r;
  }

  std::string ShmName() {
    const std::string plain = src_->name().substr(1);  // shm_open's form without the '/'
    const std::vector<std::string> names = {plain,
                                            "/refit-fuzz-missing",
                                            "",
                                            "/",
                                            "//",
                                            "/a/b",
                                            "/..",
                                            std::string(300, 'n'),
                                            dst_->name() + "x"};
    return gen_.Pick(names);
  }

  std::vector<std::string> Ids() {
    std::vector<std::string> ids;
    for (uint64_t n = gen_.OneIn(10) ? 0 : 1 + gen_.Below(3); n > 0; --n) {
      if (!buffers_.empty() && !gen_.OneIn(5)) {
        ids.push_back(gen_.Pick(buffers_).id);
      } else {
        ids.push_back(gen_.OneIn(2) ? gen_.Text() : "b-" + std::to_string(gen_.Below(100)));
      }
    }
    return ids;
  }

  // Runs one unary call, counting its code and checking it against `allowed`; a refused call
  // must leave Status and the destination bytes as they were.
  template <class Call>
  grpc::Status Check(const google::protobuf::Message& request, std::set<StatusCode> allowed,
                     Call call) {
    auto before = StatusNow();
    std::vector<uint8_t> dst_before(dst_->data(), dst_->data() + kShmBytes);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status status = call(&context);
    ++codes_[status.error_code()];
    INFO("round " << round_ << ": " << request.GetDescriptor()->name() << " " << Describe(request)
                  << " -> " << status.error_code() << " " << status.error_message());
    REQUIRE(daemon_.running());
    CHECK(allowed.count(status.error_code()) == 1);
    if (!status.ok()) {
      CHECK(Fingerprint(StatusNow()) == Fingerprint(before));
      CHECK(std::memcmp(dst_before.data(), dst_->data(), kShmBytes) == 0);
    }
    ++round_;
    return status;
  }

  // A deadline of 1-20 ms, for calls that block (WaitForVersion, Watch).
  void ShortDeadline(grpc::ClientContext* c) {
    c->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(1 + gen_.Below(20)));
  }

  v1::StatusResponse StatusNow() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::StatusResponse response;
    grpc::Status status = stub_->Status(&context, v1::StatusRequest(), &response);
    REQUIRE(status.ok());
    return response;
  }

  void Register() {
    const v1::RegisterBufferRequest request = RegisterRequest();
    v1::RegisterBufferResponse response;
    grpc::Status s = Check(request, kRegisterCodes, [&](grpc::ClientContext* c) {
      return stub_->RegisterBuffer(c, request, &response);
    });
    // The same request again is the same buffer (RegisterBuffer is idempotent): listed once.
    if (s.ok() && std::none_of(buffers_.begin(), buffers_.end(),
                               [&](const auto& b) { return b.id == response.buffer_id(); })) {
      buffers_.push_back({response.buffer_id(), request.model(), request.role()});
    }
  }

  void Publish() {
    v1::PublishRequest request;
    request.set_model(Model());
    uint64_t& next = next_version_[request.model()];
    request.set_version(gen_.OneIn(6) ? gen_.U64(next + 2) : ++next);
    for (const std::string& id : Ids()) request.add_buffer_ids(id);
    // Each version's bytes differ, so an Apply that wrote anything shows.
    std::memset(src_->data(), static_cast<int>(request.version() & 0xff), 8192);
    v1::PublishResponse response;
    Check(request, kChangeCodes,
          [&](grpc::ClientContext* c) { return stub_->Publish(c, request, &response); });
  }

  void Apply() {
    v1::ApplyRequest request;
    request.set_model(Model());
    request.set_version(gen_.OneIn(3) ? gen_.U64(next_version_[request.model()] + 2) : 0);
    for (const std::string& id : Ids()) request.add_buffer_ids(id);
    v1::ApplyResponse response;
    Check(request, kChangeCodes,
          [&](grpc::ClientContext* c) { return stub_->Apply(c, request, &response); });
  }

  void Wait() {
    v1::WaitForVersionRequest request;
    request.set_model(Model());
    request.set_min_version(gen_.U64(next_version_[request.model()] + 2));
    v1::WaitForVersionResponse response;
    Check(request, {StatusCode::OK, StatusCode::DEADLINE_EXCEEDED, StatusCode::INVALID_ARGUMENT},
          [&](grpc::ClientContext* c) {
            ShortDeadline(c);
            return stub_->WaitForVersion(c, request, &response);
          });
  }

  void Release() {
    v1::ReleaseBufferRequest request;
    const size_t at = buffers_.empty() ? 0 : gen_.Below(buffers_.size());
    const bool known = !buffers_.empty() && !gen_.OneIn(4);
    request.set_buffer_id(known ? buffers_[at].id : gen_.Text());
    v1::ReleaseBufferResponse response;
    grpc::Status s =
        Check(request, {StatusCode::OK, StatusCode::NOT_FOUND, StatusCode::INVALID_ARGUMENT},
              [&](grpc::ClientContext* c) { return stub_->ReleaseBuffer(c, request, &response); });
    if (known) {
      CHECK(s.ok());
      buffers_.erase(buffers_.begin() + static_cast<std::ptrdiff_t>(at));
    }
  }

  void Watch() {
    v1::WatchRequest request;
    request.set_model(Model());
    request.set_after_version(gen_.U64(next_version_[request.model()] + 2));
    Check(request, {StatusCode::OK, StatusCode::DEADLINE_EXCEEDED, StatusCode::INVALID_ARGUMENT},
          [&](grpc::ClientContext* c) {
            ShortDeadline(c);
            auto reader = stub_->Watch(c, request);
            v1::VersionEvent event;
            uint64_t last = request.after_version();
            while (reader->Read(&event)) {
              CHECK(event.model() == request.model());
              CHECK(event.version() > last);
              last = event.version();
            }
            return reader->Finish();
          });
  }

  Gen gen_;
  std::unique_ptr<v1::Refit::Stub> stub_;
  testing::DaemonProcess& daemon_;
  std::optional<SharedMemory> src_, dst_;
  std::vector<Buffer> buffers_;
  std::map<std::string, uint64_t> next_version_;
  std::map<int, int> codes_;
  uint64_t round_ = 0;
};

TEST_CASE("hostile client requests get api.md's codes, change nothing, and the daemon serves on",
          "[integration][fuzz]") {
  const uint64_t seed = EnvOr("REFIT_FUZZ_SEED", 20261130);
  const uint64_t rounds = EnvOr("REFIT_FUZZ_ROUNDS", 3000);
  auto daemon = testing::DaemonProcess::Start({"--retain=2"});
  REQUIRE(daemon.ok());
  ClientFuzz fuzz(**daemon, seed);
  INFO("seed " << seed);
  for (uint64_t i = 0; i < rounds; ++i) fuzz.Round();
  PrintCodes("structured", seed, fuzz.codes());
  // The fuzzer reached the daemon's working paths, not only its refusals.
  CHECK(fuzz.codes().at(grpc::StatusCode::OK) > static_cast<int>(rounds / 10));
  CHECK(fuzz.codes().count(grpc::StatusCode::INVALID_ARGUMENT) == 1);
  CHECK(fuzz.codes().count(grpc::StatusCode::NOT_FOUND) == 1);
  CHECK(fuzz.codes().count(grpc::StatusCode::FAILED_PRECONDITION) == 1);
  for (uint64_t i = 0; i < rounds / 3; ++i) fuzz.RawRound();
  PrintCodes("structured + raw", seed, fuzz.codes());
  fuzz.ExpectStillServing();
}

}  // namespace
}  // namespace refit
