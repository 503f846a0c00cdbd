// A workaround for an assertion in UCX 1.13 that aborts refitd when a peer dies while its
// endpoint is being wired up over tcp (issue 37: a peer dying never crashes refitd).
//
// The path (UCX 1.13.1, Debian 12's): a peer creates an endpoint to this worker's address and
// sends a WIREUP REQUEST; this worker creates its own endpoint back, whose tcp lane is a bare
// uct_tcp ep (tcp connects to the interface, so UCP wraps it in no wire-up proxy), and sends
// the WIREUP REPLY on it. Until the peer acknowledges the new tcp connection
// (CONNECTING / WAITING_ACK) the reply waits in that ep's pending queue. If the peer is killed
// then, uct_tcp_ep_set_failed -> ucp_ep_set_failed -> ucp_worker_discard_uct_ep purges the
// queue, and ucp_request_send_state_ff asserts that a wire-up message found there is only
// EP_REMOVED, EP_CHECK or ACK ("ucp_request.c:684 Assertion ... got REP message"): abort
// (ucx_peer_kill_test's third case stops a peer in that window). UCX removed that assertion in 1.14
// (commit 9ccaf31b, "UCP/CORE: Remove assertion for checking WIREUP_MSGs when purging"): the
// request's release after it was always right.
//
// What this file does: it defines uct_tcp_ep_pending_purge itself. libuct's tcp interface names
// that function in its ops table through a dynamic relocation (R_X86_64_64 against the exported
// symbol), so the executable's definition is the one its table holds. Ours calls libuct's
// (RTLD_NEXT) with a filter in front of UCP's callback that keeps wire-up messages from it: such a
// request is dropped instead of released (a few hundred bytes per endpoint that died mid wire-up;
// nothing else refers to it once purged: wire-up messages are not counted by flushes). Every
// other pending request goes to UCP's callback as before. Only for UCX < 1.14; in a build where
// the symbol doesn't interpose (a shared-library test build), nothing changes
// (TcpPurgeWorkaroundActive says which).

#include <dlfcn.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "daemon/common/logging.h"
#include "daemon/transport/ucx/ucx_internal.h"

// libuct's tcp ep_pending_purge, interposed (defined at the end of this file).
extern "C" void uct_tcp_ep_pending_purge(uct_ep_h ep, uct_pending_purge_callback_t callback,
                                         void* arg);

namespace refit::transport {
namespace {

using PurgeFunction = void (*)(uct_ep_h, uct_pending_purge_callback_t, void*);

std::atomic<uint64_t> dropped_wireup_messages{0};

struct Affected {
  PurgeFunction real = nullptr;
  void* wireup_progress = nullptr;  // ucp_wireup_msg_progress: a wire-up message's `func`
  bool filter = false;
};

const Affected& Lookup() {
  static const Affected affected = [] {
    Affected a;
    a.real = reinterpret_cast<PurgeFunction>(dlsym(RTLD_NEXT, "uct_tcp_ep_pending_purge"));
    a.wireup_progress = dlsym(RTLD_DEFAULT, "ucp_wireup_msg_progress");
    unsigned major = 0, minor = 0, release = 0;
    ucp_get_version(&major, &minor, &release);
    // REFIT_TEST_UCX_PURGE_FILTER=0: UCX's own purge, to show the abort (ucx_peer_kill_test).
    const char* test_off = std::getenv("REFIT_TEST_UCX_PURGE_FILTER");
    a.filter = a.wireup_progress != nullptr && major == 1 && minor < 14 &&
               !(test_off != nullptr && std::string_view(test_off) == "0");
    return a;
  }();
  return affected;
}

struct FilterArg {
  uct_pending_purge_callback_t callback;
  void* arg;
  void* wireup_progress;
};

void FilterWireup(uct_pending_req_t* request, void* arg) {
  auto* filter = static_cast<FilterArg*>(arg);
  if (reinterpret_cast<void*>(request->func) == filter->wireup_progress) {
    const uint64_t n = dropped_wireup_messages.fetch_add(1, std::memory_order_relaxed) + 1;
    Logger("transport")
        ->info(
            "a peer failed mid wire-up over tcp: its pending wire-up message dropped, not handed "
            "to "
            "UCX 1.13's purge (which would abort); {} so far",
            n);
    return;
  }
  if (filter->callback != nullptr) filter->callback(request, filter->arg);
}

}  // namespace

bool TcpPurgeWorkaroundActive() {
  const Affected& affected = Lookup();
  return affected.filter && dlsym(RTLD_DEFAULT, "uct_tcp_ep_pending_purge") ==
                                reinterpret_cast<void*>(&uct_tcp_ep_pending_purge);
}

uint64_t TcpPurgeDroppedWireupMessages() {
  return dropped_wireup_messages.load(std::memory_order_relaxed);
}

}  // namespace refit::transport

// libuct's tcp ep_pending_purge, interposed (see the top of this file).
extern "C" void uct_tcp_ep_pending_purge(uct_ep_h ep, uct_pending_purge_callback_t callback,
                                         void* arg) {
  const refit::transport::Affected& affected = refit::transport::Lookup();
  if (affected.real == nullptr) return;  // never: libuct is what called us
  if (!affected.filter) {
    affected.real(ep, callback, arg);
    return;
  }
  refit::transport::FilterArg filter{callback, arg, affected.wireup_progress};
  affected.real(ep, &refit::transport::FilterWireup, &filter);
}
