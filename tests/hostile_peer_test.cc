// A hostile peer on the data plane (issue 17, "the data plane grants, it does not expose"),
// against the real refitd over UCX's tcp transport. The test is a peer that reached the daemon's
// peer port (no TLS here: it can claim any node name) and its UCX port:
//   - with refit's own transport, it reads a version slot through the descriptor it was sent:
//     refused before it pins the version, served while the pin lasts, refused once it ends;
//     refused with a forged token, with another node's token, and for ranges of a forged
//     descriptor outside the slot;
//   - with a UCX context of its own that has RMA on, it gets and puts at the slot's address and
//     at arbitrary addresses, and sends active messages with forged tokens, spans, headers and
//     ids: nothing is read (the buffers keep their fill), nothing is written (the slot reads
//     back as published), every forged gather is refused (INVALID_PARAM, no bytes);
// and the daemon stays alive and serving throughout.

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "daemon/transport/ucx/ucx_transport.h"
#include "daemon/transport/wire.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using Clock = std::chrono::steady_clock;
using transport::Completion;
using transport::DecodeDescriptor;
using transport::EncodeDescriptor;
using transport::WireBackend;
using transport::WireDescriptor;

constexpr uint64_t kBytes = 1 << 20;  // the model: one fp32 tensor of 512 x 512
uint8_t Pattern(uint64_t i) { return static_cast<uint8_t>(i * 13 + 7); }

// The daemon under test with model "h" version 1 published, and its peer API.
struct Target {
  Target() {
    auto d = testing::DaemonProcess::Start();
    INFO(d.status().ToString());
    REQUIRE(d.ok());
    daemon = std::move(*d);
    auto c = daemon->Connect();
    REQUIRE(c.ok());
    client = std::move(*c);
    auto status = client->Status();
    REQUIRE(status.ok());
    stub = v1::Peer::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(status->listen_port()), grpc::InsecureChannelCredentials()));
    auto shm = SharedMemory::Create(testing::UniqueShmName("hostile-src"), kBytes);
    REQUIRE(shm.ok());
    source.emplace(std::move(*shm));
    for (uint64_t i = 0; i < kBytes; ++i) source->data()[i] = Pattern(i);
    auto id =
        client->RegisterBuffer("h", v1::SOURCE, source->name(), {Slice("w", v1::FP32, {512, 512})});
    REQUIRE(id.ok());
    REQUIRE(client->Publish("h", 1, {*id}).ok());
    std::memset(source->data(), 0, kBytes);  // the daemon's slot holds the only copy now

    grpc::ClientContext context;
    v1::HelloRequest hello;
    hello.set_node("hostile");
    v1::HelloResponse response;
    REQUIRE(stub->Hello(&context, hello, &response).ok());
    address = response.transport_address();
    REQUIRE_FALSE(address.empty());
  }

  // The remote key of version 1's piece as the daemon announces it to `node`.
  std::string KeyFor(const std::string& node) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::SubscribeRequest request;
    request.set_node(node);
    auto reader = stub->Subscribe(&context, request);
    v1::PeerEvent event;
    while (reader->Read(&event) && (event.model() != "h" || event.pieces_size() == 0)) {
    }
    context.TryCancel();
    REQUIRE(event.pieces_size() == 1);
    REQUIRE(event.pieces(0).bytes() == kBytes);
    return event.pieces(0).remote_key();
  }

  grpc::Status Pin(const std::string& node, bool release) {
    grpc::ClientContext context;
    v1::PinRequest request;
    request.set_model("h");
    request.set_version(1);
    request.set_node(node);
    request.set_release(release);
    request.set_lease_ms(60000);
    v1::PinResponse response;
    return stub->Pin(&context, request, &response);
  }

  std::unique_ptr<testing::DaemonProcess> daemon;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<v1::Peer::Stub> stub;
  std::optional<SharedMemory> source;
  std::string address;
};

// A peer that reads with refit's own transport (checked reads).
struct Reader {
  explicit Reader(const std::string& address) : sink(kBytes, 0) {
    auto t = transport::UcxTransport::Create();
    REQUIRE(t.ok());
    ucx = std::move(*t);
    auto memory = ucx->RegisterMemory(sink.data(), kBytes, MemoryKind::kHost);
    REQUIRE(memory.ok());
    local = std::move(*memory);
    auto ep = ucx->Connect(address);
    REQUIRE(ep.ok());
    endpoint = std::move(*ep);
  }
  ~Reader() {
    endpoint.reset();
    std::vector<Completion> ignored;
    for (int i = 0; i < 100; ++i) ucx->Poll(&ignored);
    local.reset();
  }
  // Reads [offset, +length) of the memory `descriptor` names into a zeroed sink: the code of
  // its completion (or of the refused post).
  absl::StatusCode Read(const std::string& descriptor, uint64_t offset, uint64_t length) {
    std::fill(sink.begin(), sink.end(), 0);
    auto remote = endpoint->ImportRemote(descriptor);
    if (!remote.ok()) return remote.status().code();
    absl::Status posted = endpoint->PostGet(*local, 0, **remote, offset, length, ++cookie);
    if (!posted.ok()) return posted.code();
    std::vector<Completion> done;
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (done.empty() && Clock::now() < deadline) ucx->Poll(&done);
    REQUIRE(done.size() == 1);
    return done[0].status.code();
  }
  bool Untouched() const {
    return std::all_of(sink.begin(), sink.end(), [](uint8_t b) { return b == 0; });
  }
  bool HoldsPattern(uint64_t offset, uint64_t length) const {
    for (uint64_t i = 0; i < length; ++i) {
      if (sink[i] != Pattern(offset + i)) return false;
    }
    return true;
  }

  std::vector<uint8_t> sink;
  std::unique_ptr<transport::UcxTransport> ucx;
  std::unique_ptr<transport::LocalMemory> local;
  std::unique_ptr<transport::Endpoint> endpoint;
  uint64_t cookie = 0;
};

// `descriptor` with another token (the first 16 bytes of its payload), address or length.
std::string Forge(const std::string& descriptor, std::optional<std::string> token,
                  int64_t address_delta = 0, uint64_t length = 0) {
  auto d = DecodeDescriptor(descriptor, WireBackend::kUcx);
  REQUIRE(d.ok());
  if (token) d->payload.replace(0, token->size(), *token);
  d->address += address_delta;
  if (length != 0) d->length = length;
  return EncodeDescriptor(*d);
}

// A peer with a raw UCX context of its own, RMA on: what UCX lets anyone on the network send.
class RawPeer {
 public:
  struct Reply {
    uint32_t magic = 0;
    int32_t status = 0;
    uint64_t id = 0;
    size_t bytes = 0;
  };

  explicit RawPeer(const std::string& address) {
    auto decoded = transport::DecodeAddress(address, WireBackend::kUcx);
    REQUIRE(decoded.ok());
    ucp_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
    ucp_config_t* config = nullptr;
    REQUIRE(ucp_config_read(nullptr, nullptr, &config) == UCS_OK);
    REQUIRE(ucp_init(&params, config, &context_) == UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t worker;
    std::memset(&worker, 0, sizeof(worker));
    REQUIRE(ucp_worker_create(context_, &worker, &worker_) == UCS_OK);
    ucp_am_handler_param_t handler;
    std::memset(&handler, 0, sizeof(handler));
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    handler.id = 2;  // gather replies
    handler.flags = UCP_AM_FLAG_WHOLE_MSG;
    handler.cb = [](void* arg, const void* header, size_t header_length, void*, size_t length,
                    const ucp_am_recv_param_t*) {
      Reply reply;
      if (header_length >= 16) {
        std::memcpy(&reply.magic, header, 4);
        std::memcpy(&reply.status, static_cast<const uint8_t*>(header) + 4, 4);
        std::memcpy(&reply.id, static_cast<const uint8_t*>(header) + 8, 8);
      }
      reply.bytes = length;
      static_cast<RawPeer*>(arg)->replies_.push_back(reply);
      return UCS_OK;
    };
    handler.arg = this;
    REQUIRE(ucp_worker_set_am_recv_handler(worker_, &handler) == UCS_OK);
    ucp_ep_params_t ep;
    std::memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(decoded->payload.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) {
      static_cast<RawPeer*>(arg)->failed_ = true;
    };
    ep.err_handler.arg = this;
    REQUIRE(ucp_ep_create(worker_, &ep, &ep_) == UCS_OK);
  }

  ~RawPeer() {
    for (auto* rkey : rkeys_) ucp_rkey_destroy(rkey);
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;  // ends the gets and puts that never completed
    ucs_status_ptr_t closing = ucp_ep_close_nbx(ep_, &param);
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (UCS_PTR_IS_PTR(closing) && ucp_request_check_status(closing) == UCS_INPROGRESS &&
           Clock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    if (UCS_PTR_IS_PTR(closing)) ucp_request_free(closing);
    for (void* request : pending_) {
      for (int i = 0; i < 1000 && ucp_request_check_status(request) == UCS_INPROGRESS; ++i) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(request);
    }
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }

  // The daemon's packed rkey from a descriptor (payload: token, then the rkey), unpacked here.
  ucp_rkey_h Rkey(const std::string& descriptor) {
    auto d = DecodeDescriptor(descriptor, WireBackend::kUcx);
    REQUIRE(d.ok());
    REQUIRE(d->payload.size() > 16);
    ucp_rkey_h rkey = nullptr;
    if (ucp_ep_rkey_unpack(ep_, d->payload.data() + 16, &rkey) != UCS_OK) return nullptr;
    rkeys_.push_back(rkey);
    return rkey;
  }

  // A get (put) of `length` bytes at the daemon's `address`: its status once done, or
  // UCS_INPROGRESS if it didn't finish within `wait` (the daemon dropped the request).
  ucs_status_t Rma(bool get, uint64_t address, ucp_rkey_h rkey, uint8_t* buffer, size_t length,
                   std::chrono::milliseconds wait) {
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    ucs_status_ptr_t request = get ? ucp_get_nbx(ep_, buffer, length, address, rkey, &param)
                                   : ucp_put_nbx(ep_, buffer, length, address, rkey, &param);
    if (!get && !UCS_PTR_IS_ERR(request)) {
      if (UCS_PTR_IS_PTR(request)) pending_.push_back(request);
      request = ucp_ep_flush_nbx(ep_, &param);  // done once the bytes are there
    }
    if (!UCS_PTR_IS_PTR(request)) return UCS_PTR_STATUS(request);
    const auto deadline = Clock::now() + wait;
    while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    const ucs_status_t status = ucp_request_check_status(request);
    if (status == UCS_INPROGRESS) {
      pending_.push_back(request);
    } else {
      ucp_request_free(request);
    }
    return status;
  }

  // Sends an active message with id `am_id` (UCP_AM_SEND_FLAG_REPLY: the daemon may answer)
  // and returns what comes back on the reply id: with `answer` set, once the reply carrying
  // that gather id arrived (the replies with it; none if it didn't within 20 s, however loaded
  // the machine), else whatever arrived within `wait`. A reply that comes late is kept and
  // counted by all_replies(), never mistaken for the next call's.
  std::vector<Reply> Send(unsigned am_id, const std::vector<uint8_t>& header,
                          const std::vector<uint64_t>& data, std::chrono::milliseconds wait,
                          std::optional<uint64_t> answer = std::nullopt) {
    const size_t before = replies_.size();
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t request = ucp_am_send_nbx(ep_, am_id, header.data(), header.size(),
                                               data.data(), data.size() * 8, &param);
    INFO("ucp_am_send_nbx: " << ucs_status_string(UCS_PTR_IS_ERR(request) ? UCS_PTR_STATUS(request)
                                                                          : UCS_OK)
                             << (failed_ ? ", the endpoint failed" : ""));
    REQUIRE_FALSE(UCS_PTR_IS_ERR(request));
    auto arrived = [&] {
      for (size_t i = before; i < replies_.size(); ++i) {
        if (answer && replies_[i].id == *answer) return true;
      }
      return false;
    };
    const auto deadline = Clock::now() + (answer ? std::chrono::seconds(20) : wait);
    while (Clock::now() < deadline && !arrived()) ucp_worker_progress(worker_);
    if (UCS_PTR_IS_PTR(request)) pending_.push_back(request);
    std::vector<Reply> out;
    for (size_t i = before; i < replies_.size(); ++i) {
      if (!answer || replies_[i].id == *answer) out.push_back(replies_[i]);
    }
    return out;
  }

  // Progresses for `wait`, then: every reply received so far, late ones included.
  const std::vector<Reply>& all_replies(std::chrono::milliseconds wait) {
    for (const auto deadline = Clock::now() + wait; Clock::now() < deadline;) {
      ucp_worker_progress(worker_);
    }
    return replies_;
  }

  bool failed() const { return failed_; }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  std::vector<ucp_rkey_h> rkeys_;
  std::vector<void*> pending_;
  std::vector<Reply> replies_;
  bool failed_ = false;
};

// A gather request as ucx_gather.cc lays it out: magic "RFG2", span count, id, base, token.
std::vector<uint8_t> Gather(uint32_t count, uint64_t id, uint64_t base, const std::string& token,
                            uint32_t magic = 0x32475246) {
  std::vector<uint8_t> bytes(24 + 16, 0);
  std::memcpy(bytes.data(), &magic, 4);
  std::memcpy(bytes.data() + 4, &count, 4);
  std::memcpy(bytes.data() + 8, &id, 8);
  std::memcpy(bytes.data() + 16, &base, 8);
  std::memcpy(bytes.data() + 24, token.data(), std::min<size_t>(16, token.size()));
  return bytes;
}

std::string TokenOf(const std::string& descriptor) {
  auto d = DecodeDescriptor(descriptor, WireBackend::kUcx);
  REQUIRE(d.ok());
  return d->payload.substr(0, 16);
}

TEST_CASE("a peer reads a slot only through its own token, while its pin lasts",
          "[hostile][dataplane]") {
  Target target;
  const std::string key = target.KeyFor("mallory");
  const std::string other_key = target.KeyFor("alice");
  CHECK(TokenOf(key) != TokenOf(other_key));  // a token per session
  Reader reader(target.address);

  // Announced, not pinned: nothing is read.
  CHECK(reader.Read(key, 0, kBytes) == absl::StatusCode::kInvalidArgument);
  CHECK(reader.Untouched());

  // Alice's pin grants Alice, not mallory.
  REQUIRE(target.Pin("alice", false).ok());
  CHECK(reader.Read(key, 0, kBytes) == absl::StatusCode::kInvalidArgument);
  CHECK(reader.Untouched());

  // Mallory's own pin: served, bit-exact.
  REQUIRE(target.Pin("mallory", false).ok());
  REQUIRE(reader.Read(key, 0, kBytes) == absl::StatusCode::kOk);
  CHECK(reader.HoldsPattern(0, kBytes));
  REQUIRE(reader.Read(key, 4093, 8192) == absl::StatusCode::kOk);
  CHECK(reader.HoldsPattern(4093, 8192));

  // Forgeries, while mallory's pin lasts: a random token; ranges outside the slot through a
  // forged address or length.
  CHECK(reader.Read(Forge(key, transport::RandomBytes(16)), 0, 4096) ==
        absl::StatusCode::kInvalidArgument);
  CHECK(reader.Untouched());
  CHECK(reader.Read(Forge(key, std::nullopt, -4096, kBytes + 4096), 0, 4096) ==
        absl::StatusCode::kInvalidArgument);
  CHECK(reader.Untouched());
  CHECK(reader.Read(Forge(key, std::nullopt, 0, 4 * kBytes), kBytes, 4096) ==
        absl::StatusCode::kInvalidArgument);
  CHECK(reader.Untouched());
  CHECK(reader.Read(Forge(key, std::nullopt, 4096, kBytes), 0, 4096) ==
        absl::StatusCode::kInvalidArgument);
  CHECK(reader.Untouched());

  // The pin ends: so does the grant.
  REQUIRE(target.Pin("mallory", true).ok());
  CHECK(reader.Read(key, 0, kBytes) == absl::StatusCode::kInvalidArgument);
  CHECK(reader.Untouched());
  // Alice still reads with hers.
  REQUIRE(reader.Read(other_key, 0, kBytes) == absl::StatusCode::kOk);
  CHECK(reader.HoldsPattern(0, kBytes));
  CHECK(target.daemon->running());
}

TEST_CASE("raw UCX gets, puts and forged active messages read and write nothing",
          "[hostile][dataplane]") {
  Target target;
  const std::string key = target.KeyFor("mallory");
  auto d = DecodeDescriptor(key, WireBackend::kUcx);
  REQUIRE(d.ok());
  const uint64_t base = d->address;
  const std::string token = TokenOf(key);
  REQUIRE(target.Pin("mallory", false).ok());
  {
    RawPeer raw(target.address);

    // Gets and puts at the slot and at arbitrary addresses (one that would crash the daemon if
    // written), with the daemon's own rkey: UCX finds no RMA handler there and drops them.
    ucp_rkey_h rkey = raw.Rkey(key);
    REQUIRE(rkey != nullptr);
    std::vector<uint8_t> buffer(4096, 0xee);
    const auto wait = std::chrono::milliseconds(1500);
    for (uint64_t address : {base, base + kBytes / 2, uint64_t{0x1000}}) {
      INFO("address " << address);
      const ucs_status_t got = raw.Rma(true, address, rkey, buffer.data(), 4096, wait);
      CHECK(got != UCS_OK);
      CHECK(std::all_of(buffer.begin(), buffer.end(), [](uint8_t b) { return b == 0xee; }));
      std::vector<uint8_t> garbage(4096, 0xab);
      CHECK(raw.Rma(false, address, rkey, garbage.data(), 4096, wait) != UCS_OK);
    }
    CHECK(target.daemon->running());

    // Gathers: the real one is served (the protocol is reachable) ...
    auto replies = raw.Send(1, Gather(1, 1, base, token), {16, 64}, wait, 1);
    REQUIRE(replies.size() == 1);
    CHECK(replies[0].status == UCS_OK);
    CHECK(replies[0].bytes == 64);
    // ... and every forgery refused with no bytes.
    struct Case {
      const char* what;
      std::vector<uint8_t> header;
      std::vector<uint64_t> spans;
    };
    const std::string random_token = transport::RandomBytes(16);
    const std::vector<Case> refused = {
        {"a random token", Gather(1, 2, base, random_token), {0, 4096}},
        {"no token", Gather(1, 3, base, std::string(16, '\0')), {0, 4096}},
        {"another address with the real token", Gather(1, 4, 0x1000, token), {0, 4096}},
        {"inside the slot, not its start", Gather(1, 5, base + 4096, token), {0, 4096}},
        {"past the slot's end", Gather(1, 6, base, token), {kBytes - 8, 16}},
        {"wrapping around", Gather(1, 7, base, token), {~0ull - 8, 4096}},
        {"the old protocol without a token", Gather(1, 8, base, token, 0x31475246), {0, 64}},
        {"count and data disagree", Gather(9, 9, base, token), {0, 64}},
    };
    for (uint64_t id = 2; id < 2 + refused.size(); ++id) {
      const Case& c = refused[id - 2];
      INFO(c.what);
      replies = raw.Send(1, c.header, c.spans, std::chrono::milliseconds(300), id);
      REQUIRE(replies.size() == 1);
      CHECK(replies[0].status == UCS_ERR_INVALID_PARAM);
      CHECK(replies[0].bytes == 0);
    }
    // Garbage under other ids and headers: nothing answers, nothing breaks.
    CHECK(raw.Send(1, {1, 2, 3}, {0, 64}, std::chrono::milliseconds(200)).empty());
    for (unsigned id : {0u, 2u, 3u, 17u, 255u}) {
      INFO("am id " << id);
      CHECK(raw.Send(id, Gather(1, 10, base, token), {0, 4096}, std::chrono::milliseconds(200))
                .empty());
    }
    // A reply nobody asked for, sent to the daemon: dropped.
    CHECK(raw.Send(2, {0x46, 0x52, 0x52, 0x31, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0}, {1, 2, 3},
                   std::chrono::milliseconds(200))
              .empty());
    // Nothing answered the garbage, not even late: one reply for each gather above, ids 1-9.
    std::vector<uint64_t> ids;
    for (const auto& reply : raw.all_replies(std::chrono::milliseconds(500))) {
      ids.push_back(reply.id);
    }
    std::sort(ids.begin(), ids.end());
    CHECK(ids == std::vector<uint64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9});
    CHECK_FALSE(raw.failed());
  }
  // Alive and serving, and the slot holds what was published: nothing was written.
  REQUIRE(target.daemon->running());
  REQUIRE(target.client->Status().ok());
  Reader reader(target.address);
  REQUIRE(reader.Read(key, 0, kBytes) == absl::StatusCode::kOk);
  CHECK(reader.HoldsPattern(0, kBytes));
}

}  // namespace
}  // namespace refit
