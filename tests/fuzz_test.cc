// Hostile input against the real refitd, generated from fixed seeds.
//
// Client API: thousands of requests on the Unix socket, each a sane request with a few fields
// mutated (edge integers, unknown enum values, names that aren't shm names, ids that don't
// exist, huge slice lists), then the same requests' bytes corrupted and sent raw. Peer API: the
// same on --listen. For every request:
//   - the answer's code is one docs/api.md gives (never UNKNOWN, INTERNAL, UNIMPLEMENTED, ...);
//   - a refused request changed nothing: Status (models, versions, buffers) and the destination
//     bytes are the same before and after;
//   - the daemon is still running.
// At the end the daemon still does its job: a fresh version is published and applied bit-exact,
// and the peer API's checksums match the bytes.
//
// $REFIT_FUZZ_SEED and $REFIT_FUZZ_ROUNDS explore further; a failure prints the seed, the round
// and the request.

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <mutex>
#include <set>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "proto/refit/v1/refit.grpc.pb.h"
#include "tests/testing/daemon_process.h"
#include "xxhash.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using grpc::StatusCode;

constexpr uint64_t kShmBytes = 64 << 10;

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  return value ? std::strtoull(value, nullptr, 10) : fallback;
}

// Random choices from one seed: mostly ordinary values, sometimes one at an edge.
class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}

  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  bool OneIn(uint64_t n) { return Below(n) == 0; }
  template <class T>
  const T& Pick(const std::vector<T>& from) {
    return from[Below(from.size())];
  }

  int64_t Int(int64_t usual) {
    static const int64_t kEdges[] = {0,         -1, 1, INT64_MAX, INT64_MIN, INT32_MAX,
                                     int64_t{1} << 32, int64_t{1} << 62, -(int64_t{1} << 40)};
    if (OneIn(5)) return kEdges[Below(std::size(kEdges))];
    return static_cast<int64_t>(Below(static_cast<uint64_t>(usual)));
  }
  uint64_t U64(uint64_t usual) {
    static const uint64_t kEdges[] = {0,          1,         UINT64_MAX, UINT64_MAX - 3,
                                      1ull << 63, 1ull << 32, kShmBytes,  kShmBytes + 1};
    if (OneIn(5)) return kEdges[Below(std::size(kEdges))];
    return Below(usual);
  }
  std::string Text() {
    static const std::vector<std::string> kTexts = {
        "", "m", "w", "v", "x", "a b/c", "model.layers.0.self_attn.q_proj.weight", "\xc3\xa9t\xc3\xa9",
        std::string(5000, 'a'), "%s%s%n", "../../etc/passwd"};
    if (OneIn(3)) {
      std::string s(Below(20), ' ');
      for (char& c : s) c = static_cast<char>(' ' + Below(95));
      return s;
    }
    return Pick(kTexts);
  }

  // Slices that register: "w" [32, 32] fp32 whole or in row halves, "v" [64] bf16.
  v1::TensorSlice SaneSlice(uint64_t buffer_offset) {
    switch (Below(4)) {
      case 0: return Slice("w", v1::FP32, {32, 32}, buffer_offset);
      case 1: return Slice("w", v1::FP32, {32, 32}, buffer_offset, {0, 0}, {16, 32});
      case 2: return Slice("w", v1::FP32, {32, 32}, buffer_offset, {16, 0}, {16, 32});
      default: return Slice("v", v1::BF16, {64}, buffer_offset);
    }
  }

  void MutateSlice(v1::TensorSlice* s) {
    auto dims = [&](google::protobuf::RepeatedField<int64_t>* f) {
      if (OneIn(3)) {
        f->Clear();
        for (uint64_t n = OneIn(10) ? 40 : Below(4); n > 0; --n) f->Add(Int(40));
      } else if (!f->empty()) {
        f->Set(static_cast<int>(Below(f->size())), Int(40));
      }
    };
    switch (Below(7)) {
      case 0: s->set_name(Text()); break;
      case 1: s->set_dtype(static_cast<v1::DType>(OneIn(4) ? Int(100) : Below(12)));
        break;
      case 2: dims(s->mutable_global_shape()); break;
      case 3: dims(s->mutable_offsets()); break;
      case 4: dims(s->mutable_sizes()); break;
      case 5: s->set_buffer_offset(U64(kShmBytes)); break;
      default: dims(s->mutable_buffer_strides());
    }
  }

 private:
  std::mt19937_64 rng_;
};

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

std::string Describe(const google::protobuf::Message& message) {
  std::string text = message.ShortDebugString();
  if (text.size() > 2000) text = text.substr(0, 2000) + "...";
  return text;
}

// The client API with a daemon, one source and one destination shm object, and what the
// fuzzer learned (buffer ids, versions published).
class ClientFuzz {
 public:
  ClientFuzz(testing::DaemonProcess& daemon, uint64_t seed)
      : gen_(seed),
        stub_(v1::Refit::NewStub(grpc::CreateChannel("unix:" + daemon.socket(),
                                                     grpc::InsecureChannelCredentials()))),
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
      case 2: return Register();
      case 3:
      case 4: return Publish();
      case 5:
      case 6: return Apply();
      case 7: return Wait();
      case 8: return Release();
      default: return Watch();
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
        case 0: bytes[at] = static_cast<char>(gen_.Below(256)); break;
        case 1: bytes.resize(at); break;
        default: bytes.insert(at, 1 + gen_.Below(8), static_cast<char>(gen_.Below(256)));
      }
    }
    grpc::GenericStub generic(grpc::CreateChannel("unix:" + daemon_.socket(),
                                                  grpc::InsecureChannelCredentials()));
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
  void ExpectStillServing() {
    REQUIRE(daemon_.running());
    auto c = daemon_.Connect();
    REQUIRE(c.ok());
    auto& client = **c;
    auto sid = client.RegisterBuffer("after", v1::SOURCE, src_->name(),
                                     {Slice("w", v1::FP32, {32, 32})});
    auto did = client.RegisterBuffer("after", v1::DESTINATION, dst_->name(),
                                     {Slice("w", v1::FP32, {32, 32}, 8192)});
    REQUIRE(sid.ok());
    REQUIRE(did.ok());
    REQUIRE(client.Publish("after", 1, {*sid}).ok());
    auto applied = client.Apply("after", 0, {*did});
    REQUIRE(applied.ok());
    CHECK(applied->version() == 1);
    CHECK(std::memcmp(src_->data(), dst_->data() + 8192, 4096) == 0);
  }

  const std::map<int, int>& codes() const { return codes_; }
  const std::string& destination_name() const { return dst_->name(); }
  SharedMemory& source() { return *src_; }

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
        case 0: r.set_role(static_cast<v1::Role>(gen_.Int(8))); break;
        case 1: r.mutable_memory()->mutable_host_shm()->set_name(ShmName()); break;
        case 2: r.mutable_memory()->set_offset(gen_.U64(kShmBytes)); break;
        case 3: r.mutable_memory()->set_size(gen_.U64(kShmBytes)); break;
        case 4: {
          auto* cuda = r.mutable_memory()->mutable_cuda_ipc();
          cuda->set_handle(std::string(gen_.OneIn(2) ? 64 : gen_.Below(100), 'h'));
          cuda->set_device(static_cast<int32_t>(gen_.Int(8)));
          break;
        }
        case 5: r.mutable_memory()->clear_kind(); break;
        case 6: r.clear_tensors(); break;
        case 7:  // many slices of one tensor: overlapping in the buffer, or out of it
          for (int i = 0; i < 3000; ++i) *r.add_tensors() = gen_.SaneSlice(gen_.Below(kShmBytes));
          break;
        case 8: r.clear_memory(); break;
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
    const std::vector<std::string> names = {
        plain, "/refit-fuzz-missing", "", "/", "//", "/a/b", "/..", std::string(300, 'n'),
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
    INFO("round " << round_ << ": " << request.GetDescriptor()->name() << " "
                  << Describe(request) << " -> " << status.error_code() << " "
                  << status.error_message());
    REQUIRE(daemon_.running());
    CHECK(allowed.count(status.error_code()) == 1);
    if (!status.ok()) {
      CHECK(Fingerprint(StatusNow()) == Fingerprint(before));
      CHECK(std::memcmp(dst_before.data(), dst_->data(), kShmBytes) == 0);
    }
    ++round_;
    return status;
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
    grpc::Status s = Check(request,
                           {StatusCode::OK, StatusCode::INVALID_ARGUMENT, StatusCode::NOT_FOUND,
                            StatusCode::FAILED_PRECONDITION},
                           [&](grpc::ClientContext* c) {
                             return stub_->RegisterBuffer(c, request, &response);
                           });
    if (s.ok()) buffers_.push_back({response.buffer_id(), request.model(), request.role()});
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
    Check(request,
          {StatusCode::OK, StatusCode::INVALID_ARGUMENT, StatusCode::NOT_FOUND,
           StatusCode::FAILED_PRECONDITION},
          [&](grpc::ClientContext* c) { return stub_->Publish(c, request, &response); });
  }

  void Apply() {
    v1::ApplyRequest request;
    request.set_model(Model());
    request.set_version(gen_.OneIn(3) ? gen_.U64(next_version_[request.model()] + 2) : 0);
    for (const std::string& id : Ids()) request.add_buffer_ids(id);
    v1::ApplyResponse response;
    Check(request,
          {StatusCode::OK, StatusCode::INVALID_ARGUMENT, StatusCode::NOT_FOUND,
           StatusCode::FAILED_PRECONDITION},
          [&](grpc::ClientContext* c) { return stub_->Apply(c, request, &response); });
  }

  void Wait() {
    v1::WaitForVersionRequest request;
    request.set_model(Model());
    request.set_min_version(gen_.U64(next_version_[request.model()] + 2));
    v1::WaitForVersionResponse response;
    Check(request, {StatusCode::OK, StatusCode::DEADLINE_EXCEEDED, StatusCode::INVALID_ARGUMENT},
          [&](grpc::ClientContext* c) {
            c->set_deadline(std::chrono::system_clock::now() +
                            std::chrono::milliseconds(1 + gen_.Below(20)));
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
            c->set_deadline(std::chrono::system_clock::now() +
                            std::chrono::milliseconds(1 + gen_.Below(20)));
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

// The peer API on --listen, as another daemon (or anything that reaches the port) could call
// it: model "p" has versions 1 and 2 published here; Checksum answers are checked against the
// bytes published.
class PeerFuzz {
 public:
  PeerFuzz(testing::DaemonProcess& daemon, SharedMemory& source, uint64_t seed)
      : gen_(seed), daemon_(daemon) {
    auto c = daemon.Connect();
    REQUIRE(c.ok());
    auto status = (*c)->Status();
    REQUIRE(status.ok());
    stub_ = v1::Peer::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(status->listen_port()), grpc::InsecureChannelCredentials()));
    auto id = (*c)->RegisterBuffer("p", v1::SOURCE, source.name(),
                                   {Slice("w", v1::FP32, {32, 32})});
    REQUIRE(id.ok());
    for (uint64_t version : {1, 2}) {
      for (uint64_t i = 0; i < 4096; ++i) source.data()[i] = static_cast<uint8_t>(i * version);
      REQUIRE((*c)->Publish("p", version, {*id}).ok());
      published_[version].assign(source.data(), source.data() + 4096);
    }
    // The piece to ask about, as a subscriber learns it.
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::SubscribeRequest subscribe;
    subscribe.set_node("fuzz");
    auto reader = stub_->Subscribe(&context, subscribe);
    v1::PeerEvent event;
    // Version 2 as soon as the daemon has prepared it (events may name version 1 first).
    while (reader->Read(&event) &&
           (event.model() != "p" || event.version() != 2 || event.pieces_size() == 0)) {
    }
    REQUIRE(event.model() == "p");
    REQUIRE(event.version() == 2);
    REQUIRE(event.pieces_size() == 1);
    piece_ = event.pieces(0).buffer_id();
    REQUIRE(event.pieces(0).bytes() == 4096);
    context.TryCancel();
  }

  void Round() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    switch (gen_.Below(6)) {
      case 0: {
        v1::HelloRequest request;
        request.set_node(gen_.Text());
        request.set_version(gen_.Text());
        v1::HelloResponse response;
        return Expect(request, stub_->Hello(&context, request, &response), {StatusCode::OK});
      }
      case 1: {
        v1::SubscribeRequest request;
        request.set_node(gen_.Text());
        context.set_deadline(std::chrono::system_clock::now() +
                             std::chrono::milliseconds(1 + gen_.Below(30)));
        auto reader = stub_->Subscribe(&context, request);
        v1::PeerEvent event;
        while (reader->Read(&event)) {
        }
        return Expect(request, reader->Finish(), {StatusCode::OK, StatusCode::DEADLINE_EXCEEDED});
      }
      case 2: {
        v1::PinRequest request;
        request.set_model(gen_.OneIn(4) ? gen_.Text() : "p");
        request.set_version(gen_.OneIn(4) ? gen_.U64(4) : 1 + gen_.Below(2));
        request.set_node(gen_.Text());
        request.set_release(gen_.OneIn(2));
        request.set_lease_ms(static_cast<uint32_t>(gen_.OneIn(4) ? gen_.U64(5000) : 1 + gen_.Below(50)));
        request.set_bytes_read(gen_.U64(4096));
        v1::PinResponse response;
        return Expect(request, stub_->Pin(&context, request, &response),
                      {StatusCode::OK, StatusCode::NOT_FOUND, StatusCode::INVALID_ARGUMENT});
      }
      default: return Checksum(&context);
    }
  }

  const std::map<int, int>& codes() const { return codes_; }

 private:
  void Expect(const google::protobuf::Message& request, const grpc::Status& status,
              std::set<StatusCode> allowed) {
    ++codes_[status.error_code()];
    INFO("round " << round_++ << ": " << request.GetDescriptor()->name() << " "
                  << Describe(request) << " -> " << status.error_code() << " "
                  << status.error_message());
    REQUIRE(daemon_.running());
    CHECK(allowed.count(status.error_code()) == 1);
  }

  void Checksum(grpc::ClientContext* context) {
    v1::ChecksumRequest request;
    request.set_model(gen_.OneIn(6) ? gen_.Text() : "p");
    request.set_version(gen_.OneIn(6) ? gen_.U64(4) : 1 + gen_.Below(2));
    request.set_buffer_id(gen_.OneIn(6) ? gen_.Text() : piece_);
    for (uint64_t n = gen_.OneIn(20) ? 300000 : gen_.Below(4); n > 0; --n) {
      v1::ByteRange* r = request.add_ranges();
      r->set_offset(gen_.U64(4096));
      r->set_length(gen_.OneIn(3) ? gen_.U64(64) : gen_.Below(4096 - r->offset() % 4096));
    }
    for (uint64_t n = gen_.Below(3); n > 0; --n) {
      v1::RangeRun* run = request.add_runs();
      run->set_offset(gen_.U64(1024));
      run->set_length(gen_.U64(64));
      run->set_stride(gen_.OneIn(3) ? gen_.U64(256) : 64 + gen_.Below(64));
      run->set_count(gen_.OneIn(4) ? gen_.U64(1u << 20) : gen_.Below(16));
    }
    v1::ChecksumResponse response;
    const grpc::Status status = stub_->Checksum(context, request, &response);
    Expect(request, status,
           {StatusCode::OK, StatusCode::INVALID_ARGUMENT, StatusCode::NOT_FOUND});
    if (!status.ok()) return;
    // Every answer is the XXH3 of the bytes that version published: `ranges` then `runs`
    // expanded, in `sums` when the request has runs (in `xxh3`, as older peers read, if not).
    const std::vector<uint8_t>& bytes = published_.at(request.version());
    std::vector<uint64_t> expected;
    auto expect = [&](uint64_t offset, uint64_t length) {
      REQUIRE(offset + length <= bytes.size());
      expected.push_back(XXH3_64bits(bytes.data() + offset, length));
    };
    for (const v1::ByteRange& r : request.ranges()) expect(r.offset(), r.length());
    for (const v1::RangeRun& run : request.runs()) {
      for (uint64_t k = 0; k < run.count(); ++k) expect(run.offset() + k * run.stride(), run.length());
    }
    const auto& answered = request.runs_size() > 0 ? response.sums() : response.xxh3();
    CHECK(std::vector<uint64_t>(answered.begin(), answered.end()) == expected);
  }

  Gen gen_;
  testing::DaemonProcess& daemon_;
  std::unique_ptr<v1::Peer::Stub> stub_;
  std::map<uint64_t, std::vector<uint8_t>> published_;
  std::string piece_;
  std::map<int, int> codes_;
  uint64_t round_ = 0;
};

// A peer that answers like a daemon but whose events are garbage: layouts of mutated slices,
// versions whose pieces name keys no transport issued, deltas that chain to nothing, a
// data-plane address of random bytes. Nothing it announces can be pulled.
class HostilePeer final : public v1::Peer::Service {
 public:
  HostilePeer(uint64_t seed, uint64_t events) : gen_(seed), left_(events) {}

  grpc::Status Hello(grpc::ServerContext*, const v1::HelloRequest* request,
                     v1::HelloResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    response->set_node(gen_.OneIn(4) ? gen_.Text() : "hostile");
    response->set_version(request->version());
    response->set_transport("ucx");
    response->set_transport_address(gen_.OneIn(3) ? "" : Bytes(200));
    return grpc::Status::OK;
  }

  grpc::Status Subscribe(grpc::ServerContext* context, const v1::SubscribeRequest*,
                         grpc::ServerWriter<v1::PeerEvent>* writer) override {
    for (int i = 0; i < 50 && !context->IsCancelled(); ++i) {
      v1::PeerEvent event;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (left_ == 0) break;
        --left_;
        event = Event();
      }
      if (!writer->Write(event)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return grpc::Status::OK;  // the daemon subscribes again
  }

  grpc::Status Checksum(grpc::ServerContext*, const v1::ChecksumRequest*,
                        v1::ChecksumResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t n = gen_.Below(8); n > 0; --n) response->add_sums(gen_.U64(UINT64_MAX));
    return grpc::Status::OK;
  }

  grpc::Status Pin(grpc::ServerContext*, const v1::PinRequest*, v1::PinResponse*) override {
    return grpc::Status::OK;
  }

  uint64_t left() {
    std::lock_guard<std::mutex> lock(mu_);
    return left_;
  }

 private:
  std::string Bytes(uint64_t most) {
    std::string bytes(gen_.Below(most), '\0');
    for (char& c : bytes) c = static_cast<char>(gen_.Below(256));
    return bytes;
  }

  // As daemons send layouts: offsets, sizes and (row-major) strides spelled out.
  static v1::TensorSlice Normalized(v1::TensorSlice slice) {
    const int rank = slice.global_shape_size();
    if (slice.offsets_size() == 0) {
      for (int d = 0; d < rank; ++d) slice.add_offsets(0);
    }
    if (slice.sizes_size() == 0) *slice.mutable_sizes() = slice.global_shape();
    int64_t stride = 1;
    slice.mutable_buffer_strides()->Resize(rank, 0);
    for (int d = rank - 1; d >= 0; --d) {
      slice.set_buffer_strides(d, stride);
      stride *= slice.sizes(d);
    }
    return slice;
  }

  std::string SourceId() {
    return gen_.OneIn(4) ? gen_.Text() : "vm/m/src-" + std::to_string(gen_.Below(3));
  }

  v1::PeerEvent Event() {
    v1::PeerEvent event;
    event.set_model(gen_.OneIn(5) ? gen_.Text() : "m");
    event.set_sources_unchanged(gen_.OneIn(3));
    if (!event.sources_unchanged()) {
      for (uint64_t n = gen_.OneIn(3) ? gen_.Below(3) : 1; n > 0; --n) {
        v1::SourcePiece* piece = event.add_sources();
        piece->set_buffer_id(SourceId());
        if (gen_.OneIn(2)) {  // what the destinations here need, from one piece
          *piece->add_tensors() = Normalized(Slice("w", v1::FP32, {32, 32}));
          *piece->add_tensors() = Normalized(Slice("v", v1::BF16, {64}, 4096));
        } else {
          for (uint64_t k = 0, count = 1 + gen_.Below(2); k < count; ++k) {
            *piece->add_tensors() = Normalized(gen_.SaneSlice(4096 * k));
          }
        }
        for (uint64_t m = gen_.OneIn(2) ? 0 : 1 + gen_.Below(2); m > 0; --m) {
          gen_.MutateSlice(piece->mutable_tensors(static_cast<int>(gen_.Below(piece->tensors_size()))));
        }
        piece->set_bytes(gen_.OneIn(3) ? gen_.U64(16384) : 8192);
      }
    }
    if (!event.sources_unchanged()) {
      ids_.clear();
      for (const v1::SourcePiece& source : event.sources()) ids_.push_back(source.buffer_id());
    }
    event.set_version(gen_.OneIn(4) ? gen_.U64(version_ + 2) : ++version_);
    // Mostly a piece for each source it described, so that this node goes as far as pulling.
    std::vector<std::string> pieces = ids_;
    if (gen_.OneIn(4)) pieces.push_back(SourceId());
    if (gen_.OneIn(6) && !pieces.empty()) pieces.pop_back();
    for (const std::string& id : pieces) {
      v1::VersionPiece* piece = event.add_pieces();
      piece->set_buffer_id(id);
      piece->set_remote_key(Bytes(120));
      piece->set_bytes(gen_.OneIn(3) ? gen_.U64(16384) : 8192);
    }
    for (uint64_t n = gen_.Below(3); n > 0; --n) {
      v1::DeltaPiece* delta = event.add_deltas();
      delta->set_buffer_id(SourceId());
      delta->set_base_version(gen_.U64(version_ + 1));
      delta->set_version(gen_.OneIn(2) ? event.version() : gen_.U64(version_ + 2));
      delta->set_remote_key(Bytes(120));
      delta->set_bytes(gen_.U64(16384));
    }
    return event;
  }

  std::mutex mu_;
  Gen gen_;
  uint64_t left_;
  uint64_t version_ = 0;
  std::vector<std::string> ids_;  // the sources of the last layout sent
};

// A peer that names itself "" and announces a version of the model this node's destinations
// want. Pieces without a node are a node's own, so such a version would look complete here
// without a byte pulled: the peer is refused at Hello.
class NamelessPeer final : public v1::Peer::Service {
 public:
  grpc::Status Hello(grpc::ServerContext*, const v1::HelloRequest* request,
                     v1::HelloResponse* response) override {
    ++hellos_;
    response->set_version(request->version());
    response->set_transport("ucx");
    return grpc::Status::OK;
  }

  grpc::Status Subscribe(grpc::ServerContext* context, const v1::SubscribeRequest*,
                         grpc::ServerWriter<v1::PeerEvent>* writer) override {
    v1::PeerEvent event;
    event.set_model("m");
    v1::SourcePiece* source = event.add_sources();
    source->set_buffer_id("src");
    source->set_bytes(8192);
    *source->add_tensors() = Slice("w", v1::FP32, {32, 32}, 0, {0, 0}, {32, 32}, {32, 1});
    *source->add_tensors() = Slice("v", v1::BF16, {64}, 4096, {0}, {64}, {1});
    event.set_version(1);
    v1::VersionPiece* piece = event.add_pieces();
    piece->set_buffer_id("src");
    piece->set_remote_key("not a key");
    piece->set_bytes(8192);
    writer->Write(event);
    while (!context->IsCancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return grpc::Status::OK;
  }

  int hellos() const { return hellos_.load(); }

 private:
  std::atomic<int> hellos_{0};
};

// Serves a fake peer on 127.0.0.1 and a free port.
std::unique_ptr<grpc::Server> ServeOnLoopback(grpc::Service* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(server);
  REQUIRE(*port > 0);
  return server;
}

void PrintCodes(const char* what, uint64_t seed, const std::map<int, int>& codes) {
  std::string line;
  for (const auto& [code, count] : codes) {
    line += " code" + std::to_string(code) + "=" + std::to_string(count);
  }
  WARN(what << " seed " << seed << ":" << line);
}

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

TEST_CASE("hostile peer requests are refused or answered right, and the daemon serves on",
          "[integration][fuzz]") {
  const uint64_t seed = EnvOr("REFIT_FUZZ_SEED", 20261130);
  const uint64_t rounds = EnvOr("REFIT_FUZZ_ROUNDS", 3000);
  auto daemon = testing::DaemonProcess::Start({"--retain=2"});
  REQUIRE(daemon.ok());
  ClientFuzz client(**daemon, seed);
  PeerFuzz fuzz(**daemon, client.source(), seed);
  INFO("seed " << seed);
  for (uint64_t i = 0; i < rounds / 2; ++i) fuzz.Round();
  PrintCodes("peer", seed, fuzz.codes());
  CHECK(fuzz.codes().at(grpc::StatusCode::OK) > static_cast<int>(rounds / 10));
  CHECK(fuzz.codes().count(grpc::StatusCode::INVALID_ARGUMENT) == 1);
  CHECK(fuzz.codes().count(grpc::StatusCode::NOT_FOUND) == 1);
  client.ExpectStillServing();
}

TEST_CASE("a peer that sends garbage completes no version here, and the daemon serves on",
          "[integration][fuzz]") {
  const uint64_t seed = EnvOr("REFIT_FUZZ_SEED", 20261130);
  const uint64_t events = EnvOr("REFIT_FUZZ_ROUNDS", 3000) / 3;
  HostilePeer peer(seed, events);
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&peer, &port);
  auto daemon = testing::DaemonProcess::Start(
      {"--retain=2", "--peers=127.0.0.1:" + std::to_string(port)});
  REQUIRE(daemon.ok());
  ClientFuzz local(**daemon, seed);
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  // Destinations for what the peer claims to publish, so that this node tries to pull it.
  auto id = (*c)->RegisterBuffer("m", v1::DESTINATION, local.destination_name(),
                                 {Slice("w", v1::FP32, {32, 32}), Slice("v", v1::BF16, {64}, 4096)});
  REQUIRE(id.ok());
  INFO("seed " << seed);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (peer.left() > 0 && std::chrono::steady_clock::now() < give_up) {
    REQUIRE((*daemon)->running());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK(peer.left() == 0);  // the daemon kept reading (and reconnecting)
  REQUIRE((*daemon)->running());
  auto status = (*c)->Status();
  REQUIRE(status.ok());
  for (const v1::ModelStatus& m : status->models()) {
    INFO(m.ShortDebugString());
    CHECK(m.versions_size() == 0);  // nothing it announced could be pulled and verified
  }
  auto applied = (*c)->Apply("m", 0, {*id});
  CHECK(applied.status().code() == absl::StatusCode::kFailedPrecondition);
  local.ExpectStillServing();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

TEST_CASE("a peer without a node name is refused, and its version never completes here",
          "[integration][fuzz]") {
  NamelessPeer peer;
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&peer, &port);
  auto daemon = testing::DaemonProcess::Start({"--peers=127.0.0.1:" + std::to_string(port)});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto dst = SharedMemory::Create(testing::UniqueShmName("nameless"), 8192);
  REQUIRE(dst.ok());
  REQUIRE((*c)->RegisterBuffer("m", v1::DESTINATION, dst->name(),
                               {Slice("w", v1::FP32, {32, 32}), Slice("v", v1::BF16, {64}, 4096)})
              .ok());
  // Asked twice: refused the first time, and retried.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (peer.hellos() < 2 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(peer.hellos() >= 2);
  CHECK((*c)->WaitForVersion("m", 1, std::chrono::milliseconds(300)).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
  auto status = (*c)->Status();
  REQUIRE(status.ok());
  REQUIRE(status->peers_size() == 1);
  CHECK_FALSE(status->peers(0).connected());
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

}  // namespace
}  // namespace refit
