#pragma once

// Thin RAII over UCP handles (as nixl's ucx_utils.h does): every handle the UCX backend holds is
// owned by a std::unique_ptr whose deleter releases it, so no error path leaks one. Endpoints are
// the exception: closing one is asynchronous, so UcxTransport owns them and closes them itself.
// Plus the one place where ucs_status_t becomes absl::Status.
//
// Internal to daemon/transport. Same thread rules as the owning UcxTransport.

#include <ucp/api/ucp.h>

#include <memory>
#include <string_view>

#include "absl/status/status.h"

namespace refit::transport::ucx {

struct ConfigDeleter {
  void operator()(ucp_config_t* config) const { ucp_config_release(config); }
};
struct ContextDeleter {
  void operator()(ucp_context* context) const { ucp_cleanup(context); }
};
struct WorkerDeleter {
  void operator()(ucp_worker* worker) const { ucp_worker_destroy(worker); }
};
// A memory handle must be unmapped through the context that mapped it.
struct MemDeleter {
  ucp_context_h context = nullptr;
  void operator()(ucp_mem* memh) const { ucp_mem_unmap(context, memh); }
};
struct RkeyDeleter {
  void operator()(ucp_rkey* rkey) const { ucp_rkey_destroy(rkey); }
};
struct RkeyBufferDeleter {
  void operator()(void* buffer) const { ucp_rkey_buffer_release(buffer); }
};
struct WorkerAddressDeleter {
  ucp_worker_h worker = nullptr;
  void operator()(ucp_address_t* address) const { ucp_worker_release_address(worker, address); }
};

using ConfigPtr = std::unique_ptr<ucp_config_t, ConfigDeleter>;
using ContextPtr = std::unique_ptr<ucp_context, ContextDeleter>;
using WorkerPtr = std::unique_ptr<ucp_worker, WorkerDeleter>;
using MemPtr = std::unique_ptr<ucp_mem, MemDeleter>;
using RkeyPtr = std::unique_ptr<ucp_rkey, RkeyDeleter>;
using RkeyBufferPtr = std::unique_ptr<void, RkeyBufferDeleter>;
using WorkerAddressPtr = std::unique_ptr<ucp_address_t, WorkerAddressDeleter>;

// Maps a UCX status to the project's codes: peer/link failures (UNREACHABLE, CONNECTION_RESET,
// ENDPOINT_TIMEOUT, the link/endpoint failure ranges, ...) -> UNAVAILABLE, CANCELED ->
// CANCELLED, bad parameters -> INVALID_ARGUMENT, out of resources -> RESOURCE_EXHAUSTED,
// unsupported -> UNIMPLEMENTED, anything else -> INTERNAL. `what` prefixes the message.
absl::Status ToStatus(ucs_status_t status, std::string_view what);

// True for statuses that mean "the peer or the path to it is gone".
bool IsPeerFailure(ucs_status_t status);

}  // namespace refit::transport::ucx
