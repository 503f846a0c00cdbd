#include "daemon/store/remote_view.h"

#include <catch2/catch.hpp>

namespace refit {
namespace {

SourceLayout Layout(const std::string& id, uint64_t bytes) {
  return {id, std::make_shared<const std::vector<TensorSlice>>(), bytes};
}

RemoteDeltaRef Delta(const std::string& id, uint64_t from, uint64_t to) {
  return {id, from, to, "key-" + std::to_string(from) + "-" + std::to_string(to), 8};
}

TEST_CASE("Agreed is the version every node with sources announced", "[remote_view]") {
  RemoteView view;
  CHECK(view.Agreed("m", "") == 0);  // nothing known
  view.SetSources("m", "a", {Layout("a/1", 64)});
  view.SetSources("m", "b", {Layout("b/1", 64)});
  view.SetSources("m", "c", {});  // a node without sources is not waited for
  CHECK(view.HasSources("m"));
  CHECK(view.SourceNodes("m") == std::vector<std::string>{"a", "b"});
  CHECK(view.Agreed("m", "") == 0);  // no announcement yet

  CHECK(view.Announce("m", "a", 5, {{"a/1", "ka", 64}}, {}, "run-a", "") == 0);
  CHECK(view.Agreed("m", "") == 0);  // b has announced none
  CHECK(view.Announce("m", "b", 4, {{"b/1", "kb", 64}}, {}, "run-b", "") == 0);
  CHECK(view.Agreed("m", "") == 0);  // b lags
  CHECK(view.Announce("m", "b", 5, {{"b/1", "kb", 64}}, {}, "run-b", "") == 4);
  CHECK(view.Agreed("m", "") == 5);
  CHECK(view.RunOf("m", "b") == "run-b");
  CHECK(view.RunOf("m", "nobody").empty());

  // A node that names another trainer run than the model's is waited for.
  view.Announce("m", "a", 5, {{"a/1", "ka", 64}}, {}, "run-a", "trainer-2");
  CHECK(view.Agreed("m", "trainer-1") == 0);
  CHECK(view.Agreed("m", "trainer-2") == 5);

  // A node that went away: its versions are forgotten, its layouts stay.
  view.Forget("b");
  CHECK(view.Agreed("m", "trainer-2") == 0);
  RemoteView::Nodes nodes = view.Of("m");
  REQUIRE(nodes.count("b") == 1);
  CHECK(nodes["b"].announced == 0);
  CHECK(nodes["b"].pieces.empty());
  CHECK(nodes["b"].sources.size() == 1);
  CHECK(nodes["a"].announced == 5);

  view.Erase("m");
  CHECK_FALSE(view.HasSources("m"));
  CHECK(view.Of("m").empty());
  CHECK(view.SourceNodes("m").empty());
}

TEST_CASE("DeltaChain leads forward from one version to exactly another", "[remote_view]") {
  RemoteView view;
  view.SetSources("m", "a", {Layout("a/1", 64)});
  view.Announce("m", "a", 4, {{"a/1", "k", 64}},
                {Delta("a/1", 1, 2), Delta("a/1", 2, 3), Delta("a/1", 3, 4), Delta("a/2", 1, 4),
                 Delta("a/1", 2, 2) /* to itself: never followed */,
                 Delta("a/1", 3, 1) /* backwards: never followed */},
                "", "");
  auto chain = view.DeltaChain("m", "a", "a/1", 1, 4);
  REQUIRE(chain.size() == 3);
  CHECK(chain[0].base_version == 1);
  CHECK(chain[1].base_version == 2);
  CHECK(chain[2].version == 4);
  CHECK(view.DeltaChain("m", "a", "a/1", 2, 3).size() == 1);
  CHECK(view.DeltaChain("m", "a", "a/2", 1, 4).size() == 1);
  CHECK(view.DeltaChain("m", "a", "a/1", 0, 4).empty());  // no delta from 0
  CHECK(view.DeltaChain("m", "a", "a/1", 4, 4).empty());  // nothing to do
  CHECK(view.DeltaChain("m", "a", "a/1", 1, 5).empty());  // past the newest
  CHECK(view.DeltaChain("m", "a", "a/3", 1, 4).empty());  // another buffer
  CHECK(view.DeltaChain("m", "b", "a/1", 1, 4).empty());  // another node
  CHECK(view.DeltaChain("x", "a", "a/1", 1, 4).empty());  // another model
  // A chain that would overshoot is none.
  view.Announce("m", "a", 5, {{"a/1", "k", 64}}, {Delta("a/1", 1, 3), Delta("a/1", 3, 5)}, "", "");
  CHECK(view.DeltaChain("m", "a", "a/1", 1, 4).empty());
  CHECK(view.DeltaChain("m", "a", "a/1", 1, 5).size() == 2);
}

TEST_CASE("Import hands a version over whole and says whether the layout stayed", "[remote_view]") {
  RemoteView view;
  auto slot = std::shared_ptr<Region>();
  CHECK_FALSE(view.Import("m", "bucket", 3, {Layout("x", 64)}, {slot}));  // new layout
  CHECK(view.Agreed("m", "") == 3);
  CHECK(view.Import("m", "bucket", 4, {Layout("x", 64)}, {slot}));         // the same
  CHECK_FALSE(view.Import("m", "bucket", 5, {Layout("x", 128)}, {slot}));  // resized
  RemoteView::Nodes nodes = view.Of("m");
  CHECK(nodes["bucket"].imported.count("x") == 1);
  CHECK(nodes["bucket"].announced == 5);
}

TEST_CASE("SetHold records a node's hold once", "[remote_view]") {
  RemoteView view;
  CHECK_FALSE(view.SetHold("m", "a", 3));  // a node that told nothing of the model
  view.SetSources("m", "a", {Layout("a/1", 64)});
  CHECK(view.SetHold("m", "a", 3));
  CHECK_FALSE(view.SetHold("m", "a", 3));  // already that
  CHECK(view.SetHold("m", "a", 0));
  CHECK(view.Of("m")["a"].hold == 0);
}

}  // namespace
}  // namespace refit
