#include "daemon/fleet/relay_board.h"

#include <catch2/catch.hpp>
#include <thread>

namespace refit::fleet {
namespace {
using std::chrono::milliseconds;
auto In(milliseconds d) { return std::chrono::steady_clock::now() + d; }
}  // namespace

TEST_CASE("relay board: a reader sees ranges as they land, then completion", "[fleet]") {
  RelayBoard board;
  const RelayKey key{"m", 3, "trainer", "b1"};
  REQUIRE(board.Wait(key, 0, In(milliseconds(20))).status().code() == absl::StatusCode::kNotFound);
  auto slot = std::shared_ptr<Region>(AllocateHost(1 << 20).value().release());
  board.Begin(key, slot, 1 << 20, {{0, 1 << 20}});
  std::thread writer([&] {
    std::this_thread::sleep_for(milliseconds(20));
    board.Landed(key, 0, 4096);
    board.Landed(key, 4096, 4096);
  });
  auto first = board.Wait(key, 0, In(milliseconds(2000)));
  REQUIRE(first.ok());
  REQUIRE(first->slot == slot);
  REQUIRE(first->planned.size() == 1);
  REQUIRE(!first->landed.empty());
  writer.join();
  auto rest = board.Wait(key, first->cursor, In(milliseconds(50)));
  REQUIRE(rest.ok());
  REQUIRE(first->landed.size() + rest->landed.size() == 2);
  board.End("m", 3, true);
  auto done = board.Wait(key, rest->cursor, In(milliseconds(2000)));
  REQUIRE(done.ok());
  REQUIRE(done->state == RelayState::kComplete);
  // A later ranges of a finished piece are not taken.
  board.Landed(key, 8192, 10);
  REQUIRE(board.Wait(key, done->cursor, In(milliseconds(10)))->landed.empty());
}

TEST_CASE("relay board: a failed pull ends its readers, old versions are forgotten", "[fleet]") {
  RelayBoard board;
  auto slot = std::shared_ptr<Region>(AllocateHost(4096).value().release());
  const RelayKey key{"m", 1, "t", "b"};
  board.Begin(key, slot, 4096, {{0, 4096}});
  std::thread ender([&] {
    std::this_thread::sleep_for(milliseconds(20));
    board.End("m", 1, false);
  });
  auto view = board.Wait(key, 0, In(milliseconds(2000)));
  ender.join();
  REQUIRE(view.ok());
  REQUIRE(view->state == RelayState::kFailed);
  for (uint64_t v = 2; v <= 5; ++v) board.Begin({"m", v, "t", "b"}, slot, 4096, {{0, 4096}});
  REQUIRE(!board.Wait({"m", 4, "t", "b"}, 0, In(milliseconds(5))).ok());
  REQUIRE(board.Wait({"m", 5, "t", "b"}, 0, In(milliseconds(5))).ok());
}

TEST_CASE("relay board: Retire lets go of older versions' slots before a new pull takes slots",
          "[fleet]") {
  RelayBoard board;
  auto old_slot = std::shared_ptr<Region>(AllocateHost(4096).value().release());
  auto other_slot = std::shared_ptr<Region>(AllocateHost(4096).value().release());
  board.Begin({"m", 1, "t", "b"}, old_slot, 4096, {{0, 4096}});
  board.Begin({"other", 1, "t", "b"}, other_slot, 4096, {{0, 4096}});
  board.End("m", 1, true);
  // A reader still streaming version 1 holds its view's slot.
  auto reader = board.Wait({"m", 1, "t", "b"}, 0, In(milliseconds(5)));
  REQUIRE(reader.ok());
  REQUIRE(old_slot.use_count() == 3);  // here, the board, the reader's view
  board.Retire("m", 2);
  REQUIRE(old_slot.use_count() == 2);  // the board let go; the reader keeps it
  REQUIRE(reader->slot == old_slot);
  REQUIRE(!board.Wait({"m", 1, "t", "b"}, 0, In(milliseconds(5))).ok());
  // Another model, and the version being pulled, stay.
  REQUIRE(other_slot.use_count() == 2);
  board.Begin({"m", 2, "t", "b"}, old_slot, 4096, {{0, 4096}});
  board.Retire("m", 2);
  REQUIRE(board.Wait({"m", 2, "t", "b"}, 0, In(milliseconds(5))).ok());
}

}  // namespace refit::fleet
