// The gather protocol of UcxTransport: PostGetSpans into host memory, from a peer whose memory
// isn't mapped here, as active messages (ucx_transport.h, "PostGetSpans").
//
//   requester                                   target (the peer whose memory is read)
//   GATHER   header {magic, count, id, base,  ->  looks `base` up among its registrations and
//                   token[16]}                    the grants of `token` (transport.h, "Grants"),
//            data   count x {offset, length}      checks every span lies inside both, answers
//   REPLY    header {magic, status, id}        <-  with the spans' bytes as one message (a UCX
//            data   the spans' bytes, in order     iov over the registration; no copy of ours)
//   scatters them into place, hashing each span on the way
//
// Both messages are eager (UCX fragments and reassembles them), sent with UCP_AM_SEND_FLAG_REPLY
// so the target answers on the endpoint the request came from. Integers are in the host's byte
// order: peers are daemons of one job on one architecture. A reply with an unknown id (its
// gather was cancelled or its endpoint closed) is dropped without touching memory.
//
// What a target refuses, answered with a status and no bytes: a malformed request, a base that
// is no registration of its own (memory since released), a token without a grant of it (a
// forged token, a pin that ended), a span past its end (INVALID_PARAM: the op completes
// INVALID_ARGUMENT), and memory it can't send from the host (a GPU's) or any gather while
// serve_gathers is off (UNSUPPORTED: with Options::rma the requester posts the spans as
// ucp_get_nbx instead, and uses gets for that memory from then on; without it the op fails). A
// reply it couldn't send goes again without bytes (BUSY: the op completes UNAVAILABLE, the
// connection stays up). A reply of the wrong length or with another status fails the op
// INVALID_ARGUMENT. Memory UCX allocated is sent from in place (an iov); memory the caller
// registered is copied into the reply first, as it may be unmapped once deregistered, while a reply
// is still going out. With Options::rma, spans longer than kGatherBytes aren't gathered: such a
// PostGetSpans goes as one ucp_get_nbx per span. Without it (checked reads) a span of up to
// kSpanBytes goes as a gather of its own, and a longer one in pieces of kSpanBytes (no digests
// then: the caller hashes).

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "daemon/common/logging.h"
#include "daemon/common/xxh3.h"
#include "daemon/memory/checksum.h"
#include "daemon/memory/stream_copy.h"
#include "daemon/transport/ucx/ucx_internal.h"

namespace refit::transport {
namespace {

// UCX keeps a table of handlers indexed by id: small ids (the magics tell the messages apart).
constexpr unsigned kGatherAmId = 1;
constexpr unsigned kReplyAmId = 2;
constexpr uint32_t kRequestMagic = 0x32475246;  // "RFG2": with a token
constexpr uint32_t kReplyMagic = 0x31525246;    // "RFR1"
// One gather asks for at most this many bytes (unless one span alone is longer) and spans:
// big enough that per-message costs vanish, small enough that several are in flight.
constexpr uint64_t kGatherBytes = 1ull << 20;
constexpr size_t kGatherSpans = 4096;
// Checked reads: one span this long at most per gather (a PostGet of a data-plane chunk).
constexpr uint64_t kSpanBytes = 4ull << 20;
// What a target serves in one reply at most.
constexpr uint64_t kServeBytesMax = kSpanBytes;
constexpr uint32_t kServeSpansMax = 1u << 16;

struct RequestHeader {
  uint32_t magic;
  uint32_t count;
  uint64_t id;
  uint64_t base;
  char token[Transport::kTokenBytes];
};
struct WireSpan {
  uint64_t offset;
  uint64_t length;
};
struct ReplyHeader {
  uint32_t magic;
  int32_t status;
  uint64_t id;
};

// The statuses a reply may carry; anything else from the network is a malformed reply
// (MESSAGE_TRUNCATED: the op fails INVALID_ARGUMENT). None of them is a peer failure, which
// would fail the whole connection (ucx::IsPeerFailure).
ucs_status_t ReplyStatus(int32_t status) {
  switch (status) {
    case UCS_OK:
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_BUSY:
      return static_cast<ucs_status_t>(status);
    default:
      return UCS_ERR_MESSAGE_TRUNCATED;
  }
}

// Logs a refused or dropped request: the first few, then every thousandth (a peer with a stale
// descriptor would otherwise log once per gather).
void WarnThrottled(uint64_t* count, const std::string& what) {
  ++*count;
  if (*count <= 3 || *count % 1000 == 0) {
    Logger("transport")->warn("{} ({} such so far)", what, *count);
  }
}

void ServeDone(void* request, ucs_status_t status, void* user_data) {
  auto* serve = static_cast<UcxTransport::Serve*>(user_data);
  serve->owner->OnServeDone(serve, status);
  ucp_request_free(request);
}

ucs_status_t GatherRequestCallback(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<UcxTransport*>(arg)->OnGatherRequest(header, header_length, data, length,
                                                          param);
}

ucs_status_t GatherReplyCallback(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<UcxTransport*>(arg)->OnGatherReply(header, header_length, data, length, param);
}

// A message to an id refit doesn't use (a hostile or broken peer): dropped, counted.
ucs_status_t UnknownAmCallback(void* arg, const void* /*header*/, size_t /*header_length*/,
                               void* /*data*/, size_t /*length*/,
                               const ucp_am_recv_param_t* /*param*/) {
  static_cast<UcxTransport*>(arg)->OnUnknownAm();
  return UCS_OK;
}

}  // namespace

// A request on its way out: UCX reads the header and span list until the send completes.
struct UcxTransport::Outgoing {
  std::shared_ptr<EpState> ep;
  uint64_t id = 0;
  RequestHeader header{};
  std::vector<WireSpan> spans;
};

namespace {

void OutgoingDone(void* request, ucs_status_t status, void* user_data) {
  auto* outgoing = static_cast<UcxTransport::Outgoing*>(user_data);
  outgoing->ep->owner->OnOutgoingDone(outgoing, status);
  ucp_request_free(request);
}

}  // namespace

void UcxTransport::DeleteOutgoing(Outgoing* outgoing) { delete outgoing; }

void UcxTransport::OnOutgoingDone(Outgoing* outgoing, ucs_status_t status) {
  std::unique_ptr<Outgoing> owned(outgoing);
  outgoings_.erase(outgoing);
  --in_ucx_;
  --outgoing->ep->in_ucx;
  if (status == UCS_OK) return;
  // The request never reached the peer: no reply will come for it.
  if (ucx::IsPeerFailure(status)) OnEpError(outgoing->ep.get(), status);  // fails all its gathers
  auto it = gathers_.find(outgoing->id);
  if (it == gathers_.end()) return;  // already aborted
  std::unique_ptr<Gather> gather(it->second);
  gathers_.erase(it);
  FinishOp(gather->op, status);
}

absl::Status UcxTransport::InitGathers() {
  // Every id below kAmIds gets a handler, in increasing order, the unused ones one that drops
  // the message. UCX 1.13 grows its table of handlers without initializing the new slots but
  // the one being set (ucp_worker_set_am_handler_common passes `id` where it means `i`), so a
  // peer's message to an id in the table that nobody set called whatever the heap held there:
  // refitd crashed (SIGSEGV) when a hostile peer sent to id 0 or 3 (tests/hostile_peer_test).
  // The table doubles from 2 slots, so setting ids 0, 1, ..., kAmIds - 1 (a power of two) in
  // order sets every slot it has; ids past it are refused by UCX ("no registered callback").
  constexpr unsigned kAmIds = 4;
  static_assert(kGatherAmId < kAmIds && kReplyAmId < kAmIds && (kAmIds & (kAmIds - 1)) == 0);
  for (unsigned id = 0; id < kAmIds; ++id) {
    ucp_am_recv_callback_t callback = id == kGatherAmId  ? &GatherRequestCallback
                                      : id == kReplyAmId ? &GatherReplyCallback
                                                         : &UnknownAmCallback;
    ucp_am_handler_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    param.id = id;
    param.flags = UCP_AM_FLAG_WHOLE_MSG;
    param.cb = callback;
    param.arg = this;
    ucs_status_t s = ucp_worker_set_am_recv_handler(worker_.get(), &param);
    if (s != UCS_OK) return ucx::ToStatus(s, "ucp_worker_set_am_recv_handler");
  }
  return absl::OkStatus();
}

absl::Status UcxTransport::PostGathers(const std::shared_ptr<EpState>& ep,
                                       const std::shared_ptr<MemHolder>& mem,
                                       const std::shared_ptr<RkeyHolder>& rkey, uint8_t* base,
                                       uint64_t remote_address, std::vector<Span> spans,
                                       uint64_t cookie, bool single) {
  // Checked reads: spans over kSpanBytes go in pieces (whose digests aren't the span's).
  bool pieces = false;
  if (!rma_ && std::any_of(spans.begin(), spans.end(),
                           [](const Span& span) { return span.length > kSpanBytes; })) {
    std::vector<Span> cut;
    for (const Span& span : spans) {
      uint64_t at = 0;
      do {
        const uint64_t n = std::min(kSpanBytes, span.length - at);
        cut.push_back({span.local_offset + at, span.remote_offset + at, n});
        at += n;
      } while (at < span.length);
    }
    spans = std::move(cut);
    pieces = true;
  }
  auto all = std::make_shared<const std::vector<Span>>(std::move(spans));
  // One ucp_get_nbx per span instead (refuse_first: an error posting the first one refuses the
  // call, as PostGetSpans must).
  auto by_gets = [&]() -> absl::Status {
    auto group = std::make_shared<Group>();
    group->remaining = all->size();
    ucs_status_t failure = UCS_OK;
    const size_t posted =
        PostSpanGets(ep, mem, MemoryKind::kHost, rkey, base, remote_address, *all, 0, all->size(),
                     cookie, ep->epoch, group, /*refuse_first=*/true, &failure);
    if (posted == 0 && failure != UCS_OK) return ucx::ToStatus(failure, "ucp_get_nbx");
    ++outstanding_;
    ++ep->outstanding;
    return absl::OkStatus();
  };
  // With RMA, a long span is better off as a get of its own (and a gather's reply stays small).
  if (rma_ && std::any_of(all->begin(), all->end(),
                          [](const Span& span) { return span.length > kGatherBytes; })) {
    return by_gets();
  }
  // Cut into gathers: [bounds[k], bounds[k + 1]).
  std::vector<size_t> bounds = {0};
  uint64_t bytes = 0;
  for (size_t i = 0; i < all->size(); ++i) {
    const size_t in_this = i - bounds.back();
    if (in_this > 0 && (in_this == kGatherSpans || bytes + (*all)[i].length > kGatherBytes)) {
      bounds.push_back(i);
      bytes = 0;
    }
    bytes += (*all)[i].length;
  }
  bounds.push_back(all->size());
  const size_t count = bounds.size() - 1;

  auto group = std::make_shared<Group>();
  group->remaining = count;
  group->hashed = !pieces;
  group->single = single && !pieces;
  group->span_xxh3.assign(all->size(), 0);
  for (size_t k = 0; k < count; ++k) {
    auto gather = std::make_unique<Gather>();
    gather->id = NextGatherId();
    gather->base = base;
    gather->remote_address = remote_address;
    gather->spans = all;
    gather->first = bounds[k];
    gather->last = bounds[k + 1];
    auto outgoing = std::make_unique<Outgoing>();
    outgoing->ep = ep;
    outgoing->id = gather->id;
    outgoing->spans.reserve(gather->last - gather->first);
    for (size_t i = gather->first; i < gather->last; ++i) {
      outgoing->spans.push_back({(*all)[i].remote_offset, (*all)[i].length});
      gather->bytes += (*all)[i].length;
    }
    outgoing->header = {kRequestMagic,
                        static_cast<uint32_t>(outgoing->spans.size()),
                        gather->id,
                        remote_address,
                        {}};
    std::memcpy(outgoing->header.token, rkey->token.data(),
                std::min(rkey->token.size(), sizeof(outgoing->header.token)));

    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    param.cb.send = OutgoingDone;
    param.user_data = outgoing.get();
    ucs_status_ptr_t request =
        ucp_am_send_nbx(ep->ep, kGatherAmId, &outgoing->header, sizeof(RequestHeader),
                        outgoing->spans.data(), outgoing->spans.size() * sizeof(WireSpan), &param);
    if (UCS_PTR_IS_ERR(request)) {
      const ucs_status_t status = UCS_PTR_STATUS(request);
      if (ucx::IsPeerFailure(status)) OnEpError(ep.get(), status);
      if (k == 0 && status == UCS_ERR_UNSUPPORTED && rma_) {  // no active messages here
        rkey->no_gather = true;
        return by_gets();
      }
      if (k == 0) return ucx::ToStatus(status, "ucp_am_send_nbx");  // nothing posted
      // The gathers not sent count as failed; the op completes with the error once the sent
      // ones are done.
      group->remaining -= count - k - 1;
      FinishOp(new Op{ep, mem, rkey, cookie, ep->epoch, group}, status);
      break;
    }
    if (request != nullptr) {  // OutgoingDone frees it
      ++in_ucx_;
      ++ep->in_ucx;
      outgoings_.insert(outgoing.release());
    }
    gather->op = new Op{ep, mem, rkey, cookie, ep->epoch, group};
    const uint64_t id = gather->id;
    gathers_.emplace(id, gather.release());
    ++gathers_sent_;
  }
  ++outstanding_;
  ++ep->outstanding;
  return absl::OkStatus();
}

ucs_status_t UcxTransport::OnGatherRequest(const void* header, size_t header_length,
                                           const void* data, size_t length,
                                           const ucp_am_recv_param_t* param) {
  RequestHeader request;
  if (header_length != sizeof(request) ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
    // Without an id or a way back there is nobody to answer.
    WarnThrottled(&gathers_dropped_, "dropped a gather request of " +
                                         std::to_string(header_length) +
                                         " header bytes or without a reply endpoint");
    return UCS_OK;
  }
  std::memcpy(&request, header, sizeof(request));

  auto serve = std::make_unique<Serve>();
  serve->owner = this;
  ucs_status_t status = UCS_OK;
  if (request.magic != kRequestMagic) {
    status = UCS_ERR_INVALID_PARAM;
  } else if (!serve_gathers_) {
    status = UCS_ERR_UNSUPPORTED;
  } else if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ||
             request.count > kServeSpansMax || length != request.count * sizeof(WireSpan)) {
    status = UCS_ERR_INVALID_PARAM;
  } else {
    // The registration that starts at `base` and holds every span (two registrations of one
    // address may differ in length).
    uint64_t end = 0;
    uint64_t total = 0;
    std::vector<WireSpan> spans(request.count);
    if (request.count > 0) std::memcpy(spans.data(), data, length);
    for (const WireSpan& span : spans) {
      if (span.offset > UINT64_MAX - span.length || span.length > kServeBytesMax - total) {
        status = UCS_ERR_INVALID_PARAM;
        break;
      }
      end = std::max(end, span.offset + span.length);
      total += span.length;
    }
    const Registry::Entry* found = nullptr;
    common::UniqueLock lock(registry_->mu);
    if (status == UCS_OK) {
      auto [begin, stop] = registry_->by_address.equal_range(request.base);
      for (auto it = begin; it != stop; ++it) {
        if (it->second.length >= end) found = &it->second;
      }
      if (found == nullptr) status = UCS_ERR_INVALID_PARAM;
    }
    if (status == UCS_OK &&
        !registry_->Allows(std::string(request.token, sizeof(request.token)), request.base, end)) {
      // A forged or stale token, or a pin that ended: nothing is read.
      status = UCS_ERR_INVALID_PARAM;
      found = nullptr;
    }
    if (status == UCS_OK && found->kind != MemoryKind::kHost) status = UCS_ERR_UNSUPPORTED;
    bool owned = false;
    if (status == UCS_OK) {
      serve->mem = found->mem.lock();
      owned = found->owned;
      if (serve->mem == nullptr) status = UCS_ERR_INVALID_PARAM;
    }
    lock.unlock();
    if (status == UCS_OK) serve->bytes = total;
    if (status == UCS_OK && owned) {
      // Memory UCX allocated: the registration (serve->mem) keeps the bytes, so UCX may send
      // straight from them however long the reply takes.
      serve->iov.reserve(spans.size());
      for (const WireSpan& span : spans) {
        if (span.length == 0) continue;
        serve->iov.push_back({reinterpret_cast<void*>(request.base + span.offset), span.length});
      }
    } else if (status == UCS_OK) {
      // Memory the caller registered may be unmapped once it is deregistered, which can happen
      // while a reply is still going out: copy the spans now (this handler and the
      // deregistration run on the same thread) and send the copy.
      serve->packed.resize(total);
      uint8_t* to = serve->packed.data();
      for (const WireSpan& span : spans) {
        std::memcpy(to, reinterpret_cast<const void*>(request.base + span.offset), span.length);
        to += span.length;
      }
      serve->mem.reset();
      if (total > 0) serve->iov.push_back({serve->packed.data(), total});
    }
  }
  if (status == UCS_ERR_INVALID_PARAM) {
    WarnThrottled(
        &gathers_refused_,
        "refused a gather of " + std::to_string(request.count) +
            " spans: malformed, not within one registration here, or not granted to its token");
  }
  ++gathers_served_;

  ucs_status_ptr_t sent = SendReply(param->reply_ep, serve.get(), request.id, status);
  if (UCS_PTR_IS_ERR(sent) && !ucx::IsPeerFailure(UCS_PTR_STATUS(sent))) {
    // The reply couldn't go (UCX out of resources, say): tell the requester, or it would wait.
    // BUSY: its op fails UNAVAILABLE, and its connection stays up.
    Logger("transport")
        ->warn("gather reply not sent ({}); answering BUSY",
               ucs_status_string(UCS_PTR_STATUS(sent)));
    serve->iov.clear();
    serve->packed.clear();
    serve->mem.reset();
    serve->bytes = 0;
    sent = SendReply(param->reply_ep, serve.get(), request.id, UCS_ERR_BUSY);
  }
  if (UCS_PTR_IS_ERR(sent)) {
    // The requester is gone or going; its side fails the op.
    Logger("transport")
        ->debug("gather reply not sent: {}", ucs_status_string(UCS_PTR_STATUS(sent)));
  } else if (sent != nullptr) {
    serves_.insert(serve.release());  // ServeDone frees it (and counts its bytes)
  } else {
    bytes_served_ += serve->bytes;  // sent already
  }
  return UCS_OK;
}

ucs_status_ptr_t UcxTransport::SendReply(ucp_ep_h reply_ep, Serve* serve, uint64_t id,
                                         ucs_status_t status) {
  ReplyHeader reply{kReplyMagic, static_cast<int32_t>(status), id};
  serve->header.assign(reinterpret_cast<const char*>(&reply), sizeof(reply));
  ucp_request_param_t send;
  std::memset(&send, 0, sizeof(send));
  send.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  send.flags = UCP_AM_SEND_FLAG_EAGER;
  send.memory_type = UCS_MEMORY_TYPE_HOST;
  send.cb.send = ServeDone;
  send.user_data = serve;
  const void* buffer = nullptr;
  size_t count = 0;
  if (!serve->iov.empty()) {
    send.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    send.datatype = ucp_dt_make_iov();
    buffer = serve->iov.data();
    count = serve->iov.size();
  }
  return ucp_am_send_nbx(reply_ep, kReplyAmId, serve->header.data(), serve->header.size(), buffer,
                         count, &send);
}

void UcxTransport::OnUnknownAm() {
  WarnThrottled(&gathers_dropped_, "dropped an active message to an id refit doesn't use");
}

uint64_t UcxTransport::NextGatherId() {
  for (;;) {
    if (random_ids_.empty()) {
      random_ids_.resize(512);
      uint8_t* at = reinterpret_cast<uint8_t*>(random_ids_.data());
      size_t left = random_ids_.size() * sizeof(uint64_t);
      while (left > 0) {
        const ssize_t got = getrandom(at, left, 0);
        if (got < 0) {
          if (errno == EINTR) continue;
          // No kernel randomness (Linux < 3.17): ids unguessable no more, still unique.
          static uint64_t fallback = 0;
          for (uint64_t& id : random_ids_) id = ++fallback | (uint64_t{1} << 63);
          break;
        }
        at += got;
        left -= static_cast<size_t>(got);
      }
    }
    const uint64_t id = random_ids_.back();
    random_ids_.pop_back();
    if (id != 0 && gathers_.count(id) == 0) return id;
  }
}

void UcxTransport::OnServeDone(Serve* serve, ucs_status_t status) {
  // Counted as the reply goes rather than as the request arrives: readers ask for many MiB at
  // once, and a rate taken from the requests would show a burst where the link is slow.
  if (status == UCS_OK) bytes_served_ += serve->bytes;
  serves_.erase(serve);
  delete serve;
}

ucs_status_t UcxTransport::OnGatherReply(const void* header, size_t header_length, const void* data,
                                         size_t length, const ucp_am_recv_param_t* param) {
  ReplyHeader reply;
  if (header_length != sizeof(reply)) return UCS_OK;
  std::memcpy(&reply, header, sizeof(reply));
  auto it = gathers_.find(reply.id);
  if (reply.magic != kReplyMagic || it == gathers_.end()) {  // its op already ended: dropped
    ++replies_dropped_;
    return UCS_OK;
  }
  std::unique_ptr<Gather> gather(it->second);
  gathers_.erase(it);

  ucs_status_t status = ReplyStatus(reply.status);
  if (status == UCS_ERR_UNSUPPORTED) {
    FallBackToGets(gather.get());
    return UCS_OK;
  }
  if (status == UCS_OK &&
      ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 || length != gather->bytes)) {
    Logger("transport")
        ->warn("gather reply of {} bytes where {} were asked for", length, gather->bytes);
    status = UCS_ERR_MESSAGE_TRUNCATED;
  }
  if (status == UCS_OK) {
    Group& group = *gather->op->group;
    const auto* in = static_cast<const uint8_t*>(data);
    for (size_t i = gather->first; i < gather->last; ++i) {
      const Span& span = (*gather->spans)[i];
      if (span.length == 0) {  // `data` may be null when every span is empty
        group.span_xxh3[i] = XXH3_64bits(nullptr, 0);
        continue;
      }
      group.span_xxh3[i] = CopyAndHashRange(gather->base + span.local_offset, in, span.length);
      in += span.length;
    }
    StoreFence();
  }
  FinishOp(gather->op, status);
  return UCS_OK;
}

void UcxTransport::FallBackToGets(Gather* gather) {
  Op* op = gather->op;
  if (!rma_) {  // no gets without RMA: the read can't be had
    FinishOp(op, UCS_ERR_UNSUPPORTED);
    return;
  }
  op->rkey->no_gather = true;
  Group& group = *op->group;
  group.hashed = false;
  // The gather counted once in the group; its spans count one each now.
  group.remaining += gather->last - gather->first - 1;
  ucs_status_t failure = UCS_OK;
  PostSpanGets(op->ep, op->mem, MemoryKind::kHost, op->rkey, gather->base, gather->remote_address,
               *gather->spans, gather->first, gather->last, op->cookie, op->epoch, op->group,
               /*refuse_first=*/false, &failure);
  delete op;
}

void UcxTransport::AbortGathers(const EpState* ep, ucs_status_t status) {
  for (auto it = gathers_.begin(); it != gathers_.end();) {
    Gather* gather = it->second;
    if (gather->op->ep.get() != ep) {
      ++it;
      continue;
    }
    it = gathers_.erase(it);
    FinishOp(gather->op, status);
    delete gather;
  }
}

}  // namespace refit::transport
