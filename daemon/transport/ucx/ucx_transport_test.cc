// Behaviour specific to the UCX backend: status mapping, capabilities of Debian's UCX, options.
// The common contract is in the conformance suite (ucx_*_conformance_test).

#include "daemon/transport/ucx/ucx_transport.h"

#include <chrono>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/transport/ucx/ucx_internal.h"
#include "daemon/transport/ucx/ucx_utils.h"

namespace refit::transport {
namespace {

TEST_CASE("UCX statuses map onto the project's codes", "[transport][ucx]") {
  using absl::StatusCode;
  const std::vector<std::pair<ucs_status_t, StatusCode>> table = {
      {UCS_OK, StatusCode::kOk},
      {UCS_ERR_UNREACHABLE, StatusCode::kUnavailable},
      {UCS_ERR_CONNECTION_RESET, StatusCode::kUnavailable},
      {UCS_ERR_ENDPOINT_TIMEOUT, StatusCode::kUnavailable},
      {UCS_ERR_NOT_CONNECTED, StatusCode::kUnavailable},
      {UCS_ERR_REJECTED, StatusCode::kUnavailable},
      {UCS_ERR_IO_ERROR, StatusCode::kUnavailable},
      {static_cast<ucs_status_t>(UCS_ERR_FIRST_LINK_FAILURE - 1), StatusCode::kUnavailable},
      {UCS_ERR_CANCELED, StatusCode::kCancelled},
      {UCS_ERR_INVALID_PARAM, StatusCode::kInvalidArgument},
      {UCS_ERR_INVALID_ADDR, StatusCode::kInvalidArgument},
      {UCS_ERR_NO_MEMORY, StatusCode::kResourceExhausted},
      {UCS_ERR_NO_RESOURCE, StatusCode::kResourceExhausted},
      {UCS_ERR_UNSUPPORTED, StatusCode::kUnimplemented},
      {UCS_ERR_NO_DEVICE, StatusCode::kFailedPrecondition},
      {UCS_ERR_NO_MESSAGE, StatusCode::kInternal},
  };
  for (const auto& [ucs, code] : table) {
    absl::Status s = ucx::ToStatus(ucs, "op");
    INFO(ucs_status_string(ucs) << " -> " << s.ToString());
    CHECK(s.code() == code);
    if (!s.ok()) CHECK(s.message().find(ucs_status_string(ucs)) != std::string::npos);
  }
}

TEST_CASE("Debian's UCX registers host memory but not CUDA memory", "[transport][ucx]") {
  auto t = UcxTransport::Create();
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  const Capabilities& caps = (*t)->capabilities();
  INFO(caps.detail);
  CHECK(caps.name == "ucx");
  CHECK(caps.detail.find("host") != std::string::npos);
  CHECK_FALSE(caps.cuda_memory);  // built without CUDA: the daemon stages GPU data via host
}

TEST_CASE("options apply UCX settings unless the environment sets them", "[transport][ucx]") {
  UcxTransport::Options options;
  options.config.push_back({"KEEPALIVE_INTERVAL", "not-a-time"});
  auto t = UcxTransport::Create(options);
  INFO(t.status().ToString());
  CHECK(t.status().code() == absl::StatusCode::kInvalidArgument);
  // The environment wins over Options (UCX_NET_DEVICES=lo is set by the BUILD target).
  REQUIRE(std::getenv("UCX_NET_DEVICES") != nullptr);
  options.config = {{"NET_DEVICES", "no-such-device"}};
  t = UcxTransport::Create(options);
  INFO(t.status().ToString());
  CHECK(t.ok());
}

TEST_CASE("tcp's segments are set only where tcp may run and the operator didn't",
          "[transport][ucx]") {
  // Both or neither, of one size (UCX refuses a send segment above the receive segment), big
  // enough for a 1 MiB gather reply and its headers in one fragment.
  auto sets_segment = [] {
    std::string tx, rx;
    for (const auto& [name, value] : UcxTransport::Options::DefaultConfig()) {
      if (name == "TX_SEG_SIZE") tx = value;
      if (name == "RX_SEG_SIZE") rx = value;
    }
    CHECK(tx == rx);
    if (!tx.empty()) CHECK(tx == "2m");
    return !tx.empty();
  };
  const char* had = std::getenv("UCX_TLS");
  const std::string saved = had ? had : "";
  const std::vector<std::pair<std::string, bool>> cases = {
      {"", true},    {"tcp", true},   {"sm,tcp", true}, {"all", true},
      {"sm", false}, {"^tcp", false}, {"^sm", true},    {"rc,ud", false}};
  for (const auto& [tls, expected] : cases) {
    INFO("UCX_TLS=" << tls);
    if (tls.empty()) {
      unsetenv("UCX_TLS");
    } else {
      setenv("UCX_TLS", tls.c_str(), 1);
    }
    CHECK(sets_segment() == expected);
  }
  setenv("UCX_TLS", "tcp", 1);
  setenv("UCX_TCP_RX_SEG_SIZE", "16k", 1);  // ours would exceed it: left alone
  CHECK_FALSE(sets_segment());
  unsetenv("UCX_TCP_RX_SEG_SIZE");
  setenv("UCX_TCP_TX_SEG_SIZE", "32k", 1);
  CHECK_FALSE(sets_segment());
  unsetenv("UCX_TCP_TX_SEG_SIZE");
  if (had) {
    setenv("UCX_TLS", saved.c_str(), 1);
  } else {
    unsetenv("UCX_TLS");
  }
}

TEST_CASE("zero-copy sends are off where tcp may carry the data plane", "[transport][ucx]") {
  auto sets_threshold = [] {
    for (const auto& [name, value] : UcxTransport::Options::DefaultConfig()) {
      if (name == "ZCOPY_THRESH") return value == "inf";
    }
    return false;
  };
  const char* had = std::getenv("UCX_TLS");
  const std::string saved = had ? had : "";
  // Unset or "all" on a host with RDMA devices: rc/dc carry it, and keep their zero-copy.
  const bool rdma = RdmaDevicesPresent();
  const std::vector<std::pair<std::string, bool>> cases = {
      {"", !rdma},   {"all", !rdma},  {"tcp", true},    {"sm,tcp", true}, {"^sm", true},
      {"sm", false}, {"^tcp", false}, {"rc,ud", false}, {"rc,tcp", true}};
  for (const auto& [tls, expected] : cases) {
    INFO("UCX_TLS=" << tls);
    if (tls.empty()) {
      unsetenv("UCX_TLS");
    } else {
      setenv("UCX_TLS", tls.c_str(), 1);
    }
    CHECK(sets_threshold() == expected);
  }
  setenv("UCX_TLS", "tcp", 1);
  setenv("UCX_ZCOPY_THRESH", "64k", 1);  // the operator's: left alone
  CHECK_FALSE(sets_threshold());
  unsetenv("UCX_ZCOPY_THRESH");
  setenv("UCX_TCP_TX_SEG_SIZE", "32k", 1);  // the operator's segment doesn't skip it
  CHECK(sets_threshold());
  unsetenv("UCX_TCP_TX_SEG_SIZE");
  if (had) {
    setenv("UCX_TLS", saved.c_str(), 1);
  } else {
    unsetenv("UCX_TLS");
  }
}

TEST_CASE("UCX 1.13 shared memory refuses endpoints with peer-failure handling",
          "[transport][ucx]") {
  if (std::getenv("UCX_TLS") != nullptr) return;  // the environment would win
  UcxTransport::Options options;
  options.config.push_back({"TLS", "sm,self"});
  auto a = UcxTransport::Create(options);
  auto b = UcxTransport::Create(options);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  auto ep = (*a)->Connect((*b)->LocalAddress());
  INFO(ep.status().ToString());
  if (ep.ok()) {
    WARN("this UCX serves shared memory with peer-failure handling: use it");
    return;
  }
  CHECK(absl::IsUnavailable(ep.status()));  // "Destination is unreachable"

  options.peer_failure_handling = false;
  auto c = UcxTransport::Create(options);
  REQUIRE(c.ok());
  auto ep2 = (*c)->Connect((*b)->LocalAddress());
  INFO(ep2.status().ToString());
  CHECK(ep2.ok());
}

TEST_CASE("cma alone has no active messages: Create fails cleanly", "[transport][ucx]") {
  if (std::getenv("UCX_TLS") != nullptr) return;  // the environment would win
  UcxTransport::Options options;
  options.config.push_back({"TLS", "cma"});
  auto t = UcxTransport::Create(options);
  INFO(t.status().ToString());
  if (t.ok()) {
    // Some UCX versions accept the context and fail at connect instead; then the endpoint must
    // fail cleanly.
    auto ep = (*t)->Connect((*t)->LocalAddress());
    CHECK_FALSE(ep.ok());
  } else {
    CHECK(t.status().code() == absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace refit::transport

namespace refit::transport {
namespace {

// UCX 1.13 asserts when a worker is destroyed with an unsent wireup reply queued (fixed upstream
// in openucx/ucx#8175); ~UcxTransport flushes the worker first. This destroys transports at
// every stage of a connection's wireup.
TEST_CASE("transports can be destroyed at any stage of a peer's wireup", "[transport][ucx]") {
  UcxTransport::Options options;
  options.config.push_back({"TLS", "tcp"});
  // A flushing close never finishes when its peer is destroyed first or never polls again.
  options.close_timeout = std::chrono::milliseconds(100);
  for (int round = 0; round < 40; ++round) {
    auto a = UcxTransport::Create(options);
    auto b = UcxTransport::Create(options);
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    auto ep = (*a)->Connect((*b)->LocalAddress());
    REQUIRE(ep.ok());
    std::vector<Completion> ignored;
    auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(250 * round);
    while (std::chrono::steady_clock::now() < until) {
      (*a)->Poll(&ignored);
      (*b)->Poll(&ignored);
    }
    ep->reset();
    if (round % 2 == 0) {
      b->reset();
      a->reset();
    } else {
      a->reset();
      b->reset();
    }
  }
}

TEST_CASE("UCX RMA only where UCX_TLS names hardware RMA alone", "[transport][ucx]") {
  CHECK(HardwareRmaOnly("rc"));
  CHECK(HardwareRmaOnly("rc_x,dc_mlx5"));
  CHECK_FALSE(HardwareRmaOnly(nullptr));
  CHECK_FALSE(HardwareRmaOnly(""));
  CHECK_FALSE(HardwareRmaOnly("all"));
  CHECK_FALSE(HardwareRmaOnly("^tcp"));
  CHECK_FALSE(HardwareRmaOnly("tcp"));
  CHECK_FALSE(HardwareRmaOnly("rc,tcp"));
  CHECK_FALSE(HardwareRmaOnly("sm,rc"));
  CHECK_FALSE(HardwareRmaOnly("rc,"));
  CHECK_FALSE(HardwareRmaOnly("ud"));
  // Not with this test's UCX_TLS (unset, or tcp): refused.
  UcxTransport::Options options;
  options.rma = true;
  auto refused = UcxTransport::Create(options);
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  // The default: active messages only, reads checked, no puts.
  auto checked = UcxTransport::Create();
  REQUIRE(checked.ok());
  CHECK((*checked)->capabilities().rma_get);
  CHECK_FALSE((*checked)->capabilities().rma_put);
}

}  // namespace
}  // namespace refit::transport
