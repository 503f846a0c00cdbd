#pragma once

// UcxTransport's handles as the Transport interface hands them out: a registered or allocated
// local memory (UcxLocalMemory), a peer's memory as its descriptor names it (UcxRemoteMemory),
// and a connection to a peer (UcxEndpoint). Internal to daemon/transport: ucx_transport.cc
// makes and uses them; the state they share with ops in flight is in ucx_internal.h.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/mutex.h"
#include "daemon/transport/ucx/ucx_internal.h"
#include "daemon/transport/ucx/ucx_transport.h"
#include "daemon/transport/wire.h"

namespace refit::transport {

class UcxTransport::UcxLocalMemory final : public LocalMemory {
 public:
  // `counted`: must go before the transport (RegisterMemory); AllocateMemory's memory keeps the
  // context alive itself and never touches the transport again.
  UcxLocalMemory(UcxTransport* owner, void* address, uint64_t length, MemoryKind kind,
                 std::shared_ptr<MemHolder> mem, std::string token, std::string rkey, bool counted,
                 std::shared_ptr<Registry> registry)
      : LocalMemory(address, length, kind),
        owner_(owner),
        issuer_(owner->identity_),
        mem_(std::move(mem)),
        token_(std::move(token)),
        rkey_(std::move(rkey)),
        counted_(counted),
        registry_(std::move(registry)) {
    set_descriptor(DescriptorFor(token_));
    if (counted_) ++owner_->live_objects_;
    common::MutexLock lock(registry_->mu);
    registry_->by_address.emplace(reinterpret_cast<uint64_t>(address),
                                  Registry::Entry{length, kind, mem_, !counted_});
    registry_->AddGrant(token_, reinterpret_cast<uint64_t>(address), length);
  }
  ~UcxLocalMemory() override {
    {
      // From now on peers' gathers can't read it (one already being sent keeps mem_ alive).
      common::MutexLock lock(registry_->mu);
      registry_->RemoveGrant(token_, reinterpret_cast<uint64_t>(address()), length());
      auto [begin, end] = registry_->by_address.equal_range(reinterpret_cast<uint64_t>(address()));
      for (auto it = begin; it != end; ++it) {
        if (it->second.mem.lock() == mem_) {
          registry_->by_address.erase(it);
          break;
        }
      }
    }
    if (counted_) --owner_->live_objects_;
  }
  const UcxTransport* owner() const { return owner_; }
  const std::shared_ptr<MemHolder>& mem() const { return mem_; }
  const std::shared_ptr<Registry>& registry() const { return registry_; }
  // This memory's descriptor under `token` (wire payload: token, then the packed rkey).
  std::string DescriptorFor(const std::string& token) const {
    WireDescriptor d;
    d.backend = WireBackend::kUcx;
    d.issuer = issuer_;
    d.address = reinterpret_cast<uint64_t>(address());
    d.length = length();
    d.payload = token + rkey_;
    return EncodeDescriptor(d);
  }

 private:
  UcxTransport* owner_;
  const uint64_t issuer_;
  std::shared_ptr<MemHolder> mem_;
  const std::string token_;  // the registration's own grant (descriptor())
  const std::string rkey_;   // packed
  bool counted_;
  std::shared_ptr<Registry> registry_;
};

class UcxTransport::UcxRemoteMemory final : public RemoteMemory {
 public:
  UcxRemoteMemory(UcxTransport* owner, const EpState* ep, uint64_t address, uint64_t length,
                  std::shared_ptr<RkeyHolder> rkey, uint8_t* mapped)
      : RemoteMemory(address, length),
        owner_(owner),
        ep_(ep),
        rkey_(std::move(rkey)),
        mapped_(mapped) {
    ++owner_->live_objects_;
  }
  ~UcxRemoteMemory() override { --owner_->live_objects_; }
  const EpState* ep() const { return ep_; }
  const std::shared_ptr<RkeyHolder>& rkey() const { return rkey_; }
  // The remote bytes mapped into this process (valid while rkey() lives), or null.
  uint8_t* mapping() const { return mapped_; }
  bool mapped() const override { return mapped_ != nullptr; }
  bool BatchesSpans(MemoryKind local) const override {
    return local == MemoryKind::kHost && (mapped() || !rkey_->no_gather);
  }

 private:
  UcxTransport* owner_;
  const EpState* ep_;
  std::shared_ptr<RkeyHolder> rkey_;
  uint8_t* mapped_;
};

class UcxTransport::UcxEndpoint final : public Endpoint {
 public:
  UcxEndpoint(UcxTransport* owner, std::shared_ptr<EpState> state)
      : owner_(owner), state_(std::move(state)) {
    ++owner_->live_objects_;
  }
  ~UcxEndpoint() override {
    state_->closed = true;
    state_->handler = nullptr;
    // Copies already running finish within one chunk's memcpy; queued ones are skipped.
    state_->abandon.store(true, std::memory_order_release);
    while (state_->copying.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    owner_->AbortGathers(state_.get(), UCS_ERR_CANCELED);
    owner_->CloseEp(state_);
    --owner_->live_objects_;
  }

  absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(std::string_view descriptor) override {
    ASSIGN_OR_RETURN(WireDescriptor d, DecodeDescriptor(descriptor, WireBackend::kUcx));
    if (d.issuer != state_->peer_identity) {
      return absl::InvalidArgumentError(
          "memory descriptor was issued by another transport than this endpoint's peer");
    }
    if (d.payload.size() <= kTokenBytes) {
      return absl::InvalidArgumentError("memory descriptor has no token and rkey");
    }
    if (!state_->failure.ok()) return state_->failure;
    ucp_rkey_h rkey = nullptr;
    ucs_status_t s = ucp_ep_rkey_unpack(state_->ep, d.payload.data() + kTokenBytes, &rkey);
    if (s != UCS_OK) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory descriptor's rkey rejected by UCX: ", ucs_status_string(s)));
    }
    auto holder = std::make_shared<RkeyHolder>();
    holder->rkey.reset(rkey);
    holder->token = d.payload.substr(0, kTokenBytes);
    // Shared memory of a peer on this host: UCX maps it (the whole segment, so the range the
    // descriptor announces is covered). Anything else (another host, memory UCX didn't
    // allocate) answers UNREACHABLE and goes through ucp_get/ucp_put.
    void* mapped = nullptr;
    if (ucp_rkey_ptr(rkey, d.address, &mapped) != UCS_OK) mapped = nullptr;
    return std::unique_ptr<RemoteMemory>(new UcxRemoteMemory(owner_, state_.get(), d.address,
                                                             d.length, std::move(holder),
                                                             static_cast<uint8_t*>(mapped)));
  }

  absl::Status PostGet(const LocalMemory& local, uint64_t local_offset, const RemoteMemory& remote,
                       uint64_t remote_offset, uint64_t length, uint64_t cookie) override {
    return owner_->Post(true, this, local, local_offset, remote, remote_offset, length, cookie);
  }
  absl::Status PostPut(const LocalMemory& local, uint64_t local_offset, const RemoteMemory& remote,
                       uint64_t remote_offset, uint64_t length, uint64_t cookie) override {
    return owner_->Post(false, this, local, local_offset, remote, remote_offset, length, cookie);
  }
  absl::Status PostGetSpans(const LocalMemory& local, const RemoteMemory& remote,
                            std::vector<Span> spans, uint64_t cookie) override {
    return owner_->PostSpans(this, local, remote, std::move(spans), cookie);
  }

  void Cancel() override { ++state_->epoch; }
  absl::Status status() const override { return state_->failure; }
  uint64_t outstanding() const override { return state_->outstanding; }
  void SetFailureHandler(std::function<void(const absl::Status&)> handler) override {
    state_->handler = std::move(handler);
  }

  const std::shared_ptr<EpState>& state() const { return state_; }

 private:
  UcxTransport* owner_;
  std::shared_ptr<EpState> state_;
};

}  // namespace refit::transport
