// What a peer's event may announce before the store sees it: deltas that lead forward and have
// sizes a piece can have (the others dropped), no more of them than kMaxDeltasPerEvent.

#include "daemon/peer/peer_events.h"

#include <vector>

#include "catch2/catch.hpp"

namespace refit::peer {
namespace {

v1::PeerEvent Announce(uint64_t version) {
  v1::PeerEvent event;
  event.set_model("m");
  event.set_version(version);
  return event;
}

void AddDelta(v1::PeerEvent& event, uint64_t base, uint64_t version, uint64_t bytes = 4096) {
  v1::DeltaPiece* d = event.add_deltas();
  d->set_buffer_id("trainer/m/src-0");
  d->set_base_version(base);
  d->set_version(version);
  d->set_remote_key("key");
  d->set_bytes(bytes);
}

absl::StatusCode Check(const v1::PeerEvent& event, std::vector<RemoteDeltaRef>* out = nullptr,
                       int* dropped_out = nullptr) {
  std::vector<RemoteDeltaRef> deltas;
  int dropped = -1;
  const absl::Status status = PeerDeltas(event, &deltas, &dropped);
  INFO(status.ToString());
  if (out) *out = deltas;
  if (dropped_out) *dropped_out = dropped;
  return status.code();
}

TEST_CASE("a peer's deltas are taken when each leads forward to the version announced",
          "[peer][hostile]") {
  v1::PeerEvent event = Announce(7);
  AddDelta(event, 6, 7);
  AddDelta(event, 5, 6);
  AddDelta(event, 4, 7);
  std::vector<RemoteDeltaRef> deltas;
  REQUIRE(Check(event, &deltas) == absl::StatusCode::kOk);
  REQUIRE(deltas.size() == 3);
  CHECK(deltas[1].base_version == 5);
  CHECK(deltas[1].version == 6);
  CHECK(deltas[1].bytes == 4096);
  CHECK(Check(Announce(7)) == absl::StatusCode::kOk);  // none at all
}

TEST_CASE(
    "a delta from a version to itself, backwards, past the announcement or too big is "
    "dropped",
    "[peer][hostile]") {
  // A self-loop (7 -> 7) made the store chain deltas forever under its lock.
  for (auto [base, version] : {std::pair<uint64_t, uint64_t>{7, 7}, {6, 5}, {6, 8}, {0, 0}}) {
    v1::PeerEvent event = Announce(7);
    AddDelta(event, 6, 7);
    AddDelta(event, base, version);
    INFO(base << " -> " << version);
    std::vector<RemoteDeltaRef> kept;
    int dropped = 0;
    REQUIRE(Check(event, &kept, &dropped) == absl::StatusCode::kOk);
    CHECK(dropped == 1);
    REQUIRE(kept.size() == 1);
    CHECK(kept[0].base_version == 6);
    CHECK(kept[0].version == 7);
  }
  v1::PeerEvent big = Announce(2);
  AddDelta(big, 1, 2, UINT64_MAX - 10);
  std::vector<RemoteDeltaRef> kept;
  int dropped = 0;
  REQUIRE(Check(big, &kept, &dropped) == absl::StatusCode::kOk);
  CHECK(kept.empty());
  CHECK(dropped == 1);
}

TEST_CASE("an event with more than kMaxDeltasPerEvent deltas is refused", "[peer][hostile]") {
  v1::PeerEvent many = Announce(2);
  for (int i = 0; i <= kMaxDeltasPerEvent; ++i) AddDelta(many, 1, 2);
  CHECK(Check(many) == absl::StatusCode::kInvalidArgument);
  many.mutable_deltas()->RemoveLast();
  CHECK(Check(many) == absl::StatusCode::kOk);
}

}  // namespace
}  // namespace refit::peer
