// What other daemons send, hostile, against the real refitd, from fixed seeds:
//   - peer requests on --listen (Hello, Subscribe, Pin, Checksum with edge ranges and runs):
//     each answered with an allowed code, every Checksum answer equal to XXH3 of the bytes
//     published;
//   - a fake peer streaming garbage events (mutated layouts, random keys and addresses, deltas
//     that chain to nothing): no version completes from it;
//   - a fake peer that names itself "": refused, so its version never completes here.
// Afterwards the daemon still publishes and applies bit-exact. tests/fuzz_test.cc does the same
// for clients; $REFIT_FUZZ_SEED and $REFIT_FUZZ_ROUNDS explore further.

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/fuzz.h"
#include "tests/testing/peer_probe.h"
#include "xxhash.h"

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

// A source and a destination shm object for the daemon under test.
struct Local {
  Local() {
    auto s = SharedMemory::Create(testing::UniqueShmName("peer-fuzz-src"), kShmBytes);
    auto d = SharedMemory::Create(testing::UniqueShmName("peer-fuzz-dst"), kShmBytes);
    REQUIRE(s.ok());
    REQUIRE(d.ok());
    src = std::move(s).value();
    dst = std::move(d).value();
  }
  std::optional<SharedMemory> src, dst;
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
    auto id =
        (*c)->RegisterBuffer("p", v1::SOURCE, source.name(), {Slice("w", v1::FP32, {32, 32})});
    REQUIRE(id.ok());
    // Checksums are answered inside a grant (issue 37): readers "fuzz-1" and "fuzz-2" pin
    // versions 1 and 2 with the keys they were sent; most requests below ask as them.
    testing::PeerProbe probe(status->listen_port());
    for (uint64_t version : {1, 2}) {
      for (uint64_t i = 0; i < 4096; ++i) source.data()[i] = static_cast<uint8_t>(i * version);
      REQUIRE((*c)->Publish("p", version, {*id}).ok());
      published_[version].assign(source.data(), source.data() + 4096);
      const std::string reader = "fuzz-" + std::to_string(version);
      auto keys = probe.KeysFor(reader, "p", version);
      REQUIRE(keys.size() == 1);
      keys_[version] = keys.begin()->second;
      REQUIRE(probe.Pin(reader, "p", version, false, 300000).ok());
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
        return Expect(request, stub_->Hello(&context, request, &response),
                      {StatusCode::OK, StatusCode::INVALID_ARGUMENT});
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
        return Expect(request, reader->Finish(),
                      {StatusCode::OK, StatusCode::DEADLINE_EXCEEDED, StatusCode::INVALID_ARGUMENT,
                       StatusCode::RESOURCE_EXHAUSTED});
      }
      case 2: {
        v1::PinRequest request;
        request.set_model(gen_.OneIn(4) ? gen_.Text() : "p");
        request.set_version(gen_.OneIn(4) ? gen_.U64(4) : 1 + gen_.Below(2));
        request.set_node(gen_.Text());
        request.set_release(gen_.OneIn(2));
        request.set_lease_ms(
            static_cast<uint32_t>(gen_.OneIn(4) ? gen_.U64(5000) : 1 + gen_.Below(50)));
        request.set_bytes_read(gen_.U64(4096));
        v1::PinResponse response;
        return Expect(request, stub_->Pin(&context, request, &response),
                      {StatusCode::OK, StatusCode::NOT_FOUND, StatusCode::INVALID_ARGUMENT,
                       StatusCode::RESOURCE_EXHAUSTED});
      }
      default:
        return Checksum(&context);
    }
  }

  const std::map<int, int>& codes() const { return codes_; }

 private:
  void Expect(const google::protobuf::Message& request, const grpc::Status& status,
              std::set<StatusCode> allowed) {
    ++codes_[status.error_code()];
    INFO("round " << round_++ << ": " << request.GetDescriptor()->name() << " " << Describe(request)
                  << " -> " << status.error_code() << " " << status.error_message());
    REQUIRE(daemon_.running());
    CHECK(allowed.count(status.error_code()) == 1);
  }

  void Checksum(grpc::ClientContext* context) {
    v1::ChecksumRequest request;
    request.set_model(gen_.OneIn(6) ? gen_.Text() : "p");
    request.set_version(gen_.OneIn(6) ? gen_.U64(4) : 1 + gen_.Below(2));
    request.set_buffer_id(gen_.OneIn(6) ? gen_.Text() : piece_);
    // Mostly as the reader pinning that version, with its key; else as nobody, another
    // reader, or with a forged key: PERMISSION_DENIED.
    const bool granted = !gen_.OneIn(5);
    request.set_node(granted ? "fuzz-" + std::to_string(request.version())
                             : (gen_.OneIn(2) ? gen_.Text() : "fuzz-1"));
    auto key = keys_.find(request.version());
    request.set_remote_key(granted && key != keys_.end() ? key->second : Bytes(80));
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
           {StatusCode::OK, StatusCode::INVALID_ARGUMENT, StatusCode::NOT_FOUND,
            StatusCode::PERMISSION_DENIED});
    if (!status.ok()) return;
    // Only a reader with its pin and key of exactly that version is answered.
    REQUIRE(request.node() == "fuzz-" + std::to_string(request.version()));
    REQUIRE(request.remote_key() == keys_.at(request.version()));
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
      for (uint64_t k = 0; k < run.count(); ++k)
        expect(run.offset() + k * run.stride(), run.length());
    }
    const auto& answered = request.runs_size() > 0 ? response.sums() : response.xxh3();
    CHECK(std::vector<uint64_t>(answered.begin(), answered.end()) == expected);
  }

  std::string Bytes(uint64_t most) {
    std::string bytes(gen_.Below(most), '\0');
    for (char& c : bytes) c = static_cast<char>(gen_.Below(256));
    return bytes;
  }

  Gen gen_;
  testing::DaemonProcess& daemon_;
  std::map<uint64_t, std::string> keys_;  // version -> its key for reader "fuzz-<version>"
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
          gen_.MutateSlice(
              piece->mutable_tensors(static_cast<int>(gen_.Below(piece->tensors_size()))));
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

TEST_CASE("hostile peer requests are refused or answered right, and the daemon serves on",
          "[integration][fuzz]") {
  const uint64_t seed = EnvOr("REFIT_FUZZ_SEED", 20261130);
  const uint64_t rounds = EnvOr("REFIT_FUZZ_ROUNDS", 3000);
  auto daemon = testing::DaemonProcess::Start({"--retain=2"});
  REQUIRE(daemon.ok());
  Local local;
  PeerFuzz fuzz(**daemon, *local.src, seed);
  INFO("seed " << seed);
  for (uint64_t i = 0; i < rounds / 2; ++i) fuzz.Round();
  PrintCodes("peer", seed, fuzz.codes());
  CHECK(fuzz.codes().at(grpc::StatusCode::OK) > static_cast<int>(rounds / 10));
  CHECK(fuzz.codes().count(grpc::StatusCode::INVALID_ARGUMENT) == 1);
  CHECK(fuzz.codes().count(grpc::StatusCode::NOT_FOUND) == 1);
  CHECK(fuzz.codes().count(grpc::StatusCode::PERMISSION_DENIED) == 1);
  testing::ExpectStillServing(**daemon, *local.src, *local.dst);
}

TEST_CASE("a peer that sends garbage completes no version here, and the daemon serves on",
          "[integration][fuzz]") {
  const uint64_t seed = EnvOr("REFIT_FUZZ_SEED", 20261130);
  const uint64_t events = EnvOr("REFIT_FUZZ_ROUNDS", 3000) / 3;
  HostilePeer peer(seed, events);
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&peer, &port);
  auto daemon =
      testing::DaemonProcess::Start({"--retain=2", "--peers=127.0.0.1:" + std::to_string(port)});
  REQUIRE(daemon.ok());
  Local local;
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  // Destinations for what the peer claims to publish, so that this node tries to pull it.
  auto id =
      (*c)->RegisterBuffer("m", v1::DESTINATION, local.dst->name(),
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
  testing::ExpectStillServing(**daemon, *local.src, *local.dst);
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
