// The UCX backend's gathers (ucx_gather.cc), between two transports in this process over tcp:
// what the conformance suite can't see — how many messages went, the fallback to gets, a
// target's refusal, and replies that come after their op was given up.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/transport/ucx/ucx_transport.h"
#include "daemon/transport/wire.h"
#include "xxhash.h"

namespace refit::transport {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMiB = 1ull << 20;

// `rma`: UCX RMA on over tcp (the RMA code paths; refitd never runs so).
std::unique_ptr<UcxTransport> Tcp(bool serve_gathers = true, bool rma = false) {
  UcxTransport::Options options;
  options.config.push_back({"TLS", "tcp"});
  options.serve_gathers = serve_gathers;
  options.rma = rma;
  options.rma_any_transport = rma;
  auto t = UcxTransport::Create(options);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  return std::move(*t);
}

// `target` serves `size` bytes (byte i = i * 7 + i / 251); `self` reads them into a zeroed
// buffer of its own. Members go in reverse order.
struct Pair {
  explicit Pair(uint64_t size, bool serve_gathers = true, bool rma = false)
      : self(Tcp(true, rma)), target(Tcp(serve_gathers, rma)), source(size), sink(size, 0) {
    for (uint64_t i = 0; i < size; ++i) source[i] = static_cast<uint8_t>(i * 7 + i / 251);
    auto s = target->RegisterMemory(source.data(), size, MemoryKind::kHost);
    auto d = self->RegisterMemory(sink.data(), size, MemoryKind::kHost);
    REQUIRE(s.ok());
    REQUIRE(d.ok());
    source_memory = std::move(*s);
    sink_memory = std::move(*d);
    auto ep = self->Connect(target->LocalAddress());
    REQUIRE(ep.ok());
    endpoint = std::move(*ep);
    auto r = endpoint->ImportRemote(source_memory->descriptor());
    REQUIRE(r.ok());
    remote = std::move(*r);
  }
  // Polls both until `n` completions arrived on `self` (or 20 s passed).
  std::vector<Completion> Wait(size_t n) {
    std::vector<Completion> got, ignored;
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (got.size() < n && Clock::now() < deadline) {
      self->Poll(&got);
      target->Poll(&ignored);
    }
    REQUIRE(got.size() == n);
    return got;
  }

  std::unique_ptr<UcxTransport> self;
  std::unique_ptr<UcxTransport> target;
  std::vector<uint8_t> source;
  std::vector<uint8_t> sink;
  std::unique_ptr<LocalMemory> source_memory;
  std::unique_ptr<LocalMemory> sink_memory;
  std::unique_ptr<Endpoint> endpoint;
  std::unique_ptr<RemoteMemory> remote;
};

// The second half of each `row`-byte row of the first `rows` rows.
std::vector<Span> Columns(uint64_t rows, uint64_t row) {
  std::vector<Span> spans;
  for (uint64_t r = 0; r < rows; ++r)
    spans.push_back({r * row + row / 2, r * row + row / 2, row / 2});
  return spans;
}

void CheckLanded(const Pair& p, const std::vector<Span>& spans) {
  for (const Span& s : spans) {
    REQUIRE(std::equal(p.sink.begin() + s.local_offset, p.sink.begin() + s.local_offset + s.length,
                       p.source.begin() + s.remote_offset));
  }
}

TEST_CASE("short spans go as gathers of at most 1 MiB, with a digest per span",
          "[transport][ucx][gather]") {
  Pair p(8 * kMiB);
  // 2,048 spans of 2 KiB: 4 MiB in 4 gathers, one completion.
  const std::vector<Span> spans = Columns(2048, 4096);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 7).ok());
  const std::vector<Completion> done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CHECK(done[0].cookie == 7);
  CheckLanded(p, spans);
  CHECK(std::all_of(p.sink.begin(), p.sink.begin() + 2048, [](uint8_t b) { return b == 0; }));
  CHECK(p.self->gathers_sent() == 4);
  CHECK(p.target->gathers_served() == 4);
  REQUIRE(done[0].span_xxh3.size() == spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    CHECK(done[0].span_xxh3[i] == XXH3_64bits(p.sink.data() + spans[i].local_offset, 2048));
  }
}

TEST_CASE("a target that doesn't serve gathers: the spans come by gets, and later ones too",
          "[transport][ucx][gather]") {
  Pair p(4 * kMiB, /*serve_gathers=*/false, /*rma=*/true);
  const std::vector<Span> spans = Columns(1024, 4096);  // 2 MiB: two gathers
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 1).ok());
  std::vector<Completion> done = p.Wait(1);
  INFO(done[0].status.ToString());
  REQUIRE(done[0].status.ok());
  CheckLanded(p, spans);
  CHECK(done[0].span_xxh3.empty());  // gets carry no digests
  CHECK(p.self->gathers_sent() == 2);
  CHECK(p.target->gathers_served() == 2);  // each answered UNSUPPORTED

  std::fill(p.sink.begin(), p.sink.end(), 0);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 2).ok());
  done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CheckLanded(p, spans);
  CHECK(p.self->gathers_sent() == 2);  // that memory is read with gets from now on
}

TEST_CASE("a gather outside the target's registration fails; the target keeps serving",
          "[transport][ucx][gather]") {
  Pair p(kMiB);
  // A descriptor claiming twice the registered length (a peer's bug, or memory since shrunk):
  // the requester's own range check passes, the target's refuses.
  auto d = DecodeDescriptor(p.source_memory->descriptor(), WireBackend::kUcx);
  REQUIRE(d.ok());
  d->length *= 2;
  auto forged = p.endpoint->ImportRemote(EncodeDescriptor(*d));
  REQUIRE(forged.ok());
  std::vector<Span> beyond = {{0, 0, 4096}, {4096, kMiB + 4096, 4096}};
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, **forged, beyond, 1).ok());
  std::vector<Completion> done = p.Wait(1);
  INFO(done[0].status.ToString());
  CHECK(absl::IsInvalidArgument(done[0].status));
  CHECK(p.endpoint->status().ok());

  const std::vector<Span> spans = Columns(256, 4096);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 2).ok());
  done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CheckLanded(p, spans);
  forged->reset();
}

TEST_CASE("closing an endpoint with a gather in flight: CANCELLED at once, no byte lands later",
          "[transport][ucx][gather]") {
  Pair p(4 * kMiB);
  // Wire the connection up first, so the gather goes out at once.
  REQUIRE(p.endpoint->PostGet(*p.sink_memory, 0, *p.remote, 0, 8, 1).ok());
  REQUIRE(p.Wait(1)[0].status.ok());
  std::fill(p.sink.begin(), p.sink.end(), 0);

  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, Columns(512, 4096), 2).ok());
  p.remote.reset();
  p.endpoint.reset();  // the target hasn't polled: its reply is still to come
  std::vector<Completion> got, ignored;
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (got.empty() && Clock::now() < deadline) p.self->Poll(&got);
  REQUIRE(got.size() == 1);
  INFO(got[0].status.ToString());
  CHECK(absl::IsCancelled(got[0].status));
  // Now the target serves it; the reply arrives and must be dropped.
  const uint64_t served = p.target->gathers_served();
  const auto until = Clock::now() + std::chrono::milliseconds(500);
  while (Clock::now() < until) {
    p.target->Poll(&ignored);
    p.self->Poll(&got);
  }
  CHECK(got.size() == 1);
  CHECK(p.target->gathers_served() == served + 1);
  // The reply is lost with the connection, or arrives and is dropped (a reply for an unknown
  // id is tested on its own below): either way nothing is written.
  CHECK(p.self->replies_dropped() <= 1);
  CHECK(std::all_of(p.sink.begin(), p.sink.end(), [](uint8_t b) { return b == 0; }));
}

TEST_CASE("Cancel with gathers outstanding: one CANCELLED completion each",
          "[transport][ucx][gather]") {
  Pair p(4 * kMiB);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, Columns(1024, 4096), 1).ok());
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, Columns(256, 4096), 2).ok());
  p.endpoint->Cancel();
  const std::vector<Completion> done = p.Wait(2);
  for (const Completion& c : done) {
    INFO(c.cookie << ": " << c.status.ToString());
    CHECK(absl::IsCancelled(c.status));
  }
  CHECK(done[0].cookie != done[1].cookie);
  std::vector<Completion> more, ignored;
  for (int i = 0; i < 50; ++i) {
    p.self->Poll(&more);
    p.target->Poll(&ignored);
  }
  CHECK(more.empty());
  // The endpoint goes on working.
  const std::vector<Span> spans = Columns(256, 4096);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 3).ok());
  REQUIRE(p.Wait(1)[0].status.ok());
  CheckLanded(p, spans);
}

TEST_CASE("memory released on the target: its gathers are refused", "[transport][ucx][gather]") {
  Pair p(kMiB);
  p.source_memory.reset();  // deregistered: no longer readable by peers
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, Columns(64, 4096), 1).ok());
  const std::vector<Completion> done = p.Wait(1);
  INFO(done[0].status.ToString());
  CHECK(absl::IsInvalidArgument(done[0].status));
  CHECK(p.target->gathers_refused() == 1);
  CHECK(std::all_of(p.sink.begin(), p.sink.end(), [](uint8_t b) { return b == 0; }));
}

TEST_CASE("checked reads: no gets to fall back on", "[transport][ucx][gather]") {
  Pair p(4 * kMiB, /*serve_gathers=*/false);
  const std::vector<Span> spans = Columns(1024, 4096);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 1).ok());
  std::vector<Completion> done = p.Wait(1);
  CHECK(done[0].status.code() == absl::StatusCode::kUnimplemented);
  CHECK(std::all_of(p.sink.begin(), p.sink.end(), [](uint8_t b) { return b == 0; }));
  CHECK(p.endpoint->PostPut(*p.sink_memory, 0, *p.remote, 0, 4096, 2).code() ==
        absl::StatusCode::kUnimplemented);
  CHECK_FALSE(p.self->capabilities().rma_put);
}

TEST_CASE("checked reads: a get is a gather with its digest; long spans go in pieces",
          "[transport][ucx][gather]") {
  Pair p(16 * kMiB);
  // One 4 MiB get: one gather, hashed on the way.
  REQUIRE(p.endpoint->PostGet(*p.sink_memory, 5, *p.remote, 7, 4 * kMiB, 1).ok());
  std::vector<Completion> done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CHECK(std::equal(p.sink.begin() + 5, p.sink.begin() + 5 + 4 * kMiB, p.source.begin() + 7));
  CHECK(done[0].has_xxh3);
  CHECK(done[0].xxh3 == XXH3_64bits(p.sink.data() + 5, 4 * kMiB));
  CHECK(p.self->gathers_sent() == 1);
  // 9 MiB in one get: three gathers, no digest (the caller hashes).
  REQUIRE(p.endpoint->PostGet(*p.sink_memory, 0, *p.remote, 0, 9 * kMiB, 2).ok());
  done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CHECK(std::equal(p.sink.begin(), p.sink.begin() + 9 * kMiB, p.source.begin()));
  CHECK_FALSE(done[0].has_xxh3);
  CHECK(p.self->gathers_sent() == 4);
  // Spans over 1 MiB are gathers too.
  const std::vector<Span> long_spans = {{0, 0, 3 * kMiB}, {4 * kMiB, 5 * kMiB, 4096}};
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, long_spans, 3).ok());
  done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CheckLanded(p, long_spans);
  CHECK(done[0].span_xxh3.size() == 2);
  CHECK(p.self->gathers_sent() == 6);
}

TEST_CASE("with RMA, spans over 1 MiB go as gets; empty spans are fine",
          "[transport][ucx][gather]") {
  Pair p(8 * kMiB, /*serve_gathers=*/true, /*rma=*/true);
  const std::vector<Span> long_spans = {{0, 0, 3 * kMiB}, {4 * kMiB, 5 * kMiB, 4096}};
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, long_spans, 1).ok());
  std::vector<Completion> done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CHECK(done[0].span_xxh3.empty());
  CheckLanded(p, long_spans);
  CHECK(p.self->gathers_sent() == 0);

  std::vector<Span> with_empty = Columns(8, 4096);
  with_empty.insert(with_empty.begin() + 3, Span{0, 100, 0});
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, with_empty, 2).ok());
  done = p.Wait(1);
  REQUIRE(done[0].status.ok());
  CheckLanded(p, with_empty);
  CHECK(p.self->gathers_sent() == 1);
  REQUIRE(done[0].span_xxh3.size() == with_empty.size());
  CHECK(done[0].span_xxh3[3] == XXH3_64bits(nullptr, 0));
  CHECK(done[0].span_xxh3[4] ==
        XXH3_64bits(p.sink.data() + with_empty[4].local_offset, with_empty[4].length));
}

// A bare UCP worker that sends hand-made gather requests, as a peer with a bug (or another
// version) would, and keeps the replies.
class RawPeer {
 public:
  struct Reply {
    uint32_t magic;
    int32_t status;
    uint64_t id;
    std::vector<uint8_t> data;
  };

  // With an empty `target_address` it connects nowhere (a target for a real transport to read:
  // AnswerGathers).
  explicit RawPeer(const std::string& target_address) {
    ucp_config_t* config = nullptr;
    REQUIRE(ucp_config_read(nullptr, nullptr, &config) == UCS_OK);
    ucp_config_modify(config, "TLS", "tcp");
    ucp_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA;
    REQUIRE(ucp_init(&params, config, &context_) == UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t worker_params;
    std::memset(&worker_params, 0, sizeof(worker_params));
    REQUIRE(ucp_worker_create(context_, &worker_params, &worker_) == UCS_OK);
    ucp_am_handler_param_t handler;
    std::memset(&handler, 0, sizeof(handler));
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = 2;  // the reply id
    handler.cb = [](void* arg, const void* header, size_t header_length, void* data, size_t length,
                    const ucp_am_recv_param_t*) {
      Reply reply{};
      if (header_length == 16) {
        std::memcpy(&reply.magic, header, 4);
        std::memcpy(&reply.status, static_cast<const uint8_t*>(header) + 4, 4);
        std::memcpy(&reply.id, static_cast<const uint8_t*>(header) + 8, 8);
      }
      reply.data.assign(static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + length);
      static_cast<RawPeer*>(arg)->replies_.push_back(std::move(reply));
      return UCS_OK;
    };
    handler.arg = this;
    REQUIRE(ucp_worker_set_am_recv_handler(worker_, &handler) == UCS_OK);
    if (target_address.empty()) return;
    auto address = DecodeAddress(target_address, WireBackend::kUcx);
    REQUIRE(address.ok());
    ucp_ep_params_t ep_params;
    std::memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(address->payload.data());
    REQUIRE(ucp_ep_create(worker_, &ep_params, &ep_) == UCS_OK);
  }
  ~RawPeer() {
    if (memh_ != nullptr) ucp_mem_unmap(context_, memh_);
    if (ep_ == nullptr) {
      ucp_worker_destroy(worker_);
      ucp_cleanup(context_);
      return;
    }
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    ucs_status_ptr_t close = ucp_ep_close_nbx(ep_, &param);
    const auto deadline = Clock::now() + std::chrono::seconds(2);
    while (UCS_PTR_IS_PTR(close) && ucp_request_check_status(close) == UCS_INPROGRESS &&
           Clock::now() < deadline) {
      ucp_worker_progress(worker_);
      if (target_) target_->Poll(&ignored_);
    }
    if (UCS_PTR_IS_PTR(close)) ucp_request_free(close);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }

  // Sends one request and returns the replies that came within `wait` (the target polled).
  std::vector<Reply> Send(UcxTransport& target, const std::vector<uint8_t>& header,
                          const std::vector<uint64_t>& spans, bool reply_flag = true,
                          std::chrono::milliseconds wait = std::chrono::milliseconds(300),
                          unsigned am_id = 1) {
    target_ = &target;
    replies_.clear();
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_EAGER | (reply_flag ? UCP_AM_SEND_FLAG_REPLY : 0);
    ucs_status_ptr_t request = ucp_am_send_nbx(ep_, am_id, header.data(), header.size(),
                                               spans.data(), spans.size() * 8, &param);
    REQUIRE_FALSE(UCS_PTR_IS_ERR(request));
    const auto deadline = Clock::now() + wait;
    while (Clock::now() < deadline && (replies_.empty() || UCS_PTR_IS_PTR(request))) {
      ucp_worker_progress(worker_);
      target.Poll(&ignored_);
      if (UCS_PTR_IS_PTR(request) && ucp_request_check_status(request) != UCS_INPROGRESS) {
        ucp_request_free(request);
        request = nullptr;
      }
    }
    if (UCS_PTR_IS_PTR(request)) ucp_request_free(request);
    return replies_;
  }

  // Serves `memory` bytes of pattern (byte i = i * 3) to a real transport: its address and a
  // descriptor of that memory, then answers every gather with `status` and the bytes asked for
  // plus `extra` (a negative `extra`: fewer).
  std::string Address() const {
    ucp_address_t* raw = nullptr;
    size_t length = 0;
    REQUIRE(ucp_worker_get_address(worker_, &raw, &length) == UCS_OK);
    std::string address = EncodeAddress(
        {WireBackend::kUcx, kIdentity, std::string(reinterpret_cast<const char*>(raw), length)});
    ucp_worker_release_address(worker_, raw);
    return address;
  }
  std::string Descriptor(uint64_t memory) {
    pattern_.resize(memory);
    for (uint64_t i = 0; i < memory; ++i) pattern_[i] = static_cast<uint8_t>(i * 3);
    ucp_mem_map_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = pattern_.data();
    params.length = memory;
    REQUIRE(ucp_mem_map(context_, &params, &memh_) == UCS_OK);
    void* rkey = nullptr;
    size_t rkey_length = 0;
    REQUIRE(ucp_rkey_pack(context_, memh_, &rkey, &rkey_length) == UCS_OK);
    // Payload: a token (this target checks none), then the rkey.
    WireDescriptor d{
        WireBackend::kUcx, kIdentity, reinterpret_cast<uint64_t>(pattern_.data()), memory,
        std::string(16, 'T') + std::string(static_cast<const char*>(rkey), rkey_length)};
    ucp_rkey_buffer_release(rkey);
    return EncodeDescriptor(d);
  }
  void AnswerGathers(int32_t status, int64_t extra) {
    answer_status_ = status;
    answer_extra_ = extra;
    ucp_am_handler_param_t handler;
    std::memset(&handler, 0, sizeof(handler));
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = 1;  // the request id
    handler.cb = [](void* arg, const void* header, size_t, void* data, size_t length,
                    const ucp_am_recv_param_t* param) {
      auto* self = static_cast<RawPeer*>(arg);
      // Header: magic, count, id, base; data: (offset, length) pairs.
      uint64_t id = 0;
      std::memcpy(&id, static_cast<const uint8_t*>(header) + 8, 8);
      self->ids_seen_.push_back(id);
      self->answer_.clear();
      for (size_t at = 0; at + 16 <= length; at += 16) {
        uint64_t span[2];
        std::memcpy(span, static_cast<const uint8_t*>(data) + at, 16);
        self->answer_.insert(self->answer_.end(), self->pattern_.begin() + span[0],
                             self->pattern_.begin() + span[0] + span[1]);
      }
      self->answer_.resize(self->answer_.size() + self->answer_extra_, 0);
      self->answer_header_.assign(16, 0);
      const uint32_t magic = 0x31525246;
      std::memcpy(self->answer_header_.data(), &magic, 4);
      std::memcpy(self->answer_header_.data() + 4, &self->answer_status_, 4);
      std::memcpy(self->answer_header_.data() + 8, &id, 8);
      ucp_request_param_t send;
      std::memset(&send, 0, sizeof(send));
      send.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK;
      send.flags = UCP_AM_SEND_FLAG_EAGER;
      send.cb.send = [](void* request, ucs_status_t, void*) { ucp_request_free(request); };
      ucs_status_ptr_t sent = ucp_am_send_nbx(param->reply_ep, 2, self->answer_header_.data(), 16,
                                              self->answer_.data(), self->answer_.size(), &send);
      CHECK_FALSE(UCS_PTR_IS_ERR(sent));
      return UCS_OK;
    };
    handler.arg = this;
    REQUIRE(ucp_worker_set_am_recv_handler(worker_, &handler) == UCS_OK);
  }
  void Progress() { ucp_worker_progress(worker_); }
  // The ids of the gather requests it answered, in order.
  const std::vector<uint64_t>& ids_seen() const { return ids_seen_; }

 private:
  static constexpr uint64_t kIdentity = 0x5eed;
  std::vector<uint64_t> ids_seen_;
  ucp_mem_h memh_ = nullptr;
  std::vector<uint8_t> pattern_;
  std::vector<uint8_t> answer_;
  std::vector<uint8_t> answer_header_;
  int32_t answer_status_ = UCS_OK;
  int64_t answer_extra_ = 0;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  UcxTransport* target_ = nullptr;
  std::vector<Reply> replies_;
  std::vector<Completion> ignored_;
};

// A request header as ucx_gather.cc lays it out: magic, count, id, base, token.
std::vector<uint8_t> RequestBytes(uint32_t magic, uint32_t count, uint64_t id, uint64_t base,
                                  const std::string& token) {
  std::vector<uint8_t> bytes(40, 0);
  std::memcpy(bytes.data(), &magic, 4);
  std::memcpy(bytes.data() + 4, &count, 4);
  std::memcpy(bytes.data() + 8, &id, 8);
  std::memcpy(bytes.data() + 16, &base, 8);
  std::memcpy(bytes.data() + 24, token.data(), std::min<size_t>(16, token.size()));
  return bytes;
}

TEST_CASE("malformed gather requests are refused or dropped; the target keeps serving",
          "[transport][ucx][gather]") {
  Pair p(kMiB);
  constexpr uint32_t kMagic = 0x32475246;
  const uint64_t base = reinterpret_cast<uint64_t>(p.source.data());
  auto descriptor = DecodeDescriptor(p.source_memory->descriptor(), WireBackend::kUcx);
  REQUIRE(descriptor.ok());
  const std::string token = descriptor->payload.substr(0, 16);
  RawPeer raw(p.target->LocalAddress());

  // A well-formed request first: the bytes come back.
  auto replies = raw.Send(*p.target, RequestBytes(kMagic, 1, 7, base, token), {16, 64});
  REQUIRE(replies.size() == 1);
  CHECK(replies[0].id == 7);
  CHECK(replies[0].status == UCS_OK);
  REQUIRE(replies[0].data.size() == 64);
  CHECK(std::equal(replies[0].data.begin(), replies[0].data.end(), p.source.begin() + 16));

  struct Case {
    const char* what;
    std::vector<uint8_t> header;
    std::vector<uint64_t> spans;
  };
  const std::vector<Case> refused = {
      {"wrong magic", RequestBytes(0x12345678, 1, 8, base, token), {0, 64}},
      {"count and data disagree", RequestBytes(kMagic, 3, 9, base, token), {0, 64}},
      {"offset + length overflows", RequestBytes(kMagic, 1, 10, base, token), {~0ull - 10, 100}},
      {"past the registration's end", RequestBytes(kMagic, 1, 11, base, token), {kMiB - 8, 16}},
      {"not a registration's start", RequestBytes(kMagic, 1, 12, base + 4096, token), {0, 64}},
      {"no registration at all", RequestBytes(kMagic, 1, 13, 4096, token), {0, 64}},
      {"a token without a grant", RequestBytes(kMagic, 1, 16, base, std::string(16, 'x')), {0, 64}},
      {"the old protocol (no token)", RequestBytes(0x31475246, 1, 17, base, token), {0, 64}},
      {"more than the target serves at once",
       RequestBytes(kMagic, 2, 14, base, token),
       {0, kMiB, 0, 4 * kMiB}},
  };
  for (const Case& c : refused) {
    INFO(c.what);
    replies = raw.Send(*p.target, c.header, c.spans);
    REQUIRE(replies.size() == 1);
    CHECK(replies[0].status == UCS_ERR_INVALID_PARAM);
    CHECK(replies[0].data.empty());
  }
  CHECK(p.target->gathers_refused() == refused.size());

  // Nobody to answer: no id, or no way back.
  CHECK(raw.Send(*p.target, {1, 2, 3}, {0, 64}).empty());
  CHECK(raw.Send(*p.target, RequestBytes(kMagic, 1, 15, base, token), {0, 64}, /*reply_flag=*/false)
            .empty());
  CHECK(p.target->gathers_dropped() == 2);

  // The target still serves its real peers.
  const std::vector<Span> spans = Columns(128, 4096);
  REQUIRE(p.endpoint->PostGetSpans(*p.sink_memory, *p.remote, spans, 1).ok());
  REQUIRE(p.Wait(1)[0].status.ok());
  CheckLanded(p, spans);
}

TEST_CASE("a reply nobody asked for (its op ended) is dropped without writing",
          "[transport][ucx][gather]") {
  Pair p(kMiB);
  RawPeer raw(p.self->LocalAddress());
  // A reply header (magic "RFR1", OK, an id never sent) with bytes.
  std::vector<uint8_t> header(16);
  const uint32_t magic = 0x31525246;
  const uint64_t id = 999999;
  std::memcpy(header.data(), &magic, 4);
  std::memcpy(header.data() + 8, &id, 8);
  raw.Send(*p.self, header, std::vector<uint64_t>(512, ~0ull), /*reply_flag=*/false,
           std::chrono::milliseconds(300), /*am_id=*/2);
  CHECK(p.self->replies_dropped() == 1);
  CHECK(std::all_of(p.sink.begin(), p.sink.end(), [](uint8_t b) { return b == 0; }));
}

TEST_CASE("a target's malformed or busy replies fail the op, not the connection",
          "[transport][ucx][gather]") {
  auto self = Tcp();
  std::vector<uint8_t> sink(kMiB, 0);
  auto sink_memory = self->RegisterMemory(sink.data(), sink.size(), MemoryKind::kHost);
  REQUIRE(sink_memory.ok());
  RawPeer target("");
  const std::string descriptor = target.Descriptor(kMiB);
  auto endpoint = self->Connect(target.Address());
  REQUIRE(endpoint.ok());
  auto remote = (*endpoint)->ImportRemote(descriptor);
  REQUIRE(remote.ok());
  const std::vector<Span> spans = Columns(64, 4096);
  auto gather = [&](int32_t status, int64_t extra) {
    target.AnswerGathers(status, extra);
    std::fill(sink.begin(), sink.end(), 0);
    REQUIRE((*endpoint)->PostGetSpans(**sink_memory, **remote, spans, 1).ok());
    std::vector<Completion> got;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (got.empty() && Clock::now() < deadline) {
      self->Poll(&got);
      target.Progress();
    }
    REQUIRE(got.size() == 1);
    return got[0].status;
  };
  struct Case {
    const char* what;
    int32_t status;
    int64_t extra;
    absl::StatusCode code;
  };
  for (const Case& c :
       {Case{"BUSY: the target couldn't send", UCS_ERR_BUSY, 0, absl::StatusCode::kUnavailable},
        Case{"bytes missing", UCS_OK, -100, absl::StatusCode::kInvalidArgument},
        Case{"bytes extra", UCS_OK, 100, absl::StatusCode::kInvalidArgument},
        Case{"a status nobody sends", 12345, 0, absl::StatusCode::kInvalidArgument},
        Case{"a peer-failure status", UCS_ERR_CONNECTION_RESET, 0,
             absl::StatusCode::kInvalidArgument}}) {
    INFO(c.what);
    const absl::Status status = gather(c.status, c.extra);
    INFO(status.ToString());
    CHECK(status.code() == c.code);
    CHECK((*endpoint)->status().ok());
  }
  // A good answer after all that: the bytes, bit-exact.
  REQUIRE(gather(UCS_OK, 0).ok());
  for (const Span& span : spans) {
    for (uint64_t i = 0; i < span.length; ++i) {
      REQUIRE(sink[span.local_offset + i] == static_cast<uint8_t>((span.remote_offset + i) * 3));
    }
  }
  // Its gathers' ids were unguessable: another peer answering ids it made up (1, 2, 3 ...) would
  // fail or divert this node's gathers to someone else (matched by id alone).
  const std::vector<uint64_t>& ids = target.ids_seen();
  REQUIRE(ids.size() == 6);
  for (size_t a = 0; a < ids.size(); ++a) {
    INFO("gather id " << ids[a]);
    CHECK(ids[a] > (uint64_t{1} << 32));
    for (size_t b = a + 1; b < ids.size(); ++b) CHECK(ids[a] != ids[b]);
  }
  remote->reset();
  endpoint->reset();
  std::vector<Completion> ignored;
  for (int i = 0; i < 100; ++i) {
    self->Poll(&ignored);
    target.Progress();
  }
}

}  // namespace
}  // namespace refit::transport
