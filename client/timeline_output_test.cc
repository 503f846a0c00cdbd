#include "client/timeline_output.h"

#include <catch2/catch.hpp>

namespace refit::client {
namespace {

v1::TimelineResponse Sample() {
  v1::TimelineResponse r;
  r.set_model("m");
  auto stage = [](v1::VersionTimeline* v, const char* name, int64_t start, int64_t end,
                  const char* detail) {
    v1::TimelineStage* s = v->add_stages();
    s->set_stage(name);
    s->set_start_us(start);
    s->set_end_us(end);
    s->set_detail(detail);
  };
  v1::NodeTimeline* t = r.add_nodes();
  t->set_node("trainer");
  v1::VersionTimeline* tv = t->add_versions();
  tv->set_version(2);
  stage(tv, "published", 1000000, 1100000, "by pid 7");
  stage(tv, "complete", 1100000, 1100000, "");
  v1::NodeTimeline* e = r.add_nodes();
  e->set_node("engine-0");
  v1::VersionTimeline* ev = e->add_versions();
  ev->set_version(2);
  stage(ev, "announced", 1150000, 1150000, "by trainer");
  stage(ev, "pulled", 1150000, 1400000, "from trainer 100 bytes");
  v1::NodeTimeline* gone = r.add_nodes();
  gone->set_address("127.0.0.1:9");
  gone->set_error("connection refused");
  return r;
}

TEST_CASE("timeline text: one line per node and stage, relative times, bars, the unreachable") {
  const std::string text = TimelineText(Sample(), 20);
  INFO(text);
  CHECK(text.find("m version 2: from 1970-01-01 00:00:01.000000 UTC, 400.0 ms in all") !=
        std::string::npos);
  CHECK(text.find("trainer  published         0.0      100.0 [#####") != std::string::npos);
  CHECK(
      text.find("engine-0 pulled          150.0      250.0 [       #############] from trainer") !=
      std::string::npos);
  CHECK(text.find("|") != std::string::npos);
  CHECK(text.find("unreachable: 127.0.0.1:9: connection refused") != std::string::npos);
}

TEST_CASE("timeline trace: Chrome trace events, a process per node, X spans and instants") {
  const nlohmann::ordered_json trace = TimelineTrace(Sample());
  const auto parsed = nlohmann::json::parse(trace.dump());
  REQUIRE(parsed["traceEvents"].is_array());
  int names = 0, spans = 0, instants = 0;
  for (const auto& e : parsed["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") ++names;
    if (e["ph"] == "X") {
      ++spans;
      CHECK(e["dur"].get<int64_t>() > 0);
    }
    if (e["ph"] == "i") ++instants;
    if (e["name"] == "pulled") {
      CHECK(e["ts"] == 150000);
      CHECK(e["dur"] == 250000);
      CHECK(e["args"]["node"] == "engine-0");
    }
  }
  CHECK(names == 2);
  CHECK(spans == 2);
  CHECK(instants == 2);
  const auto json = TimelineJson(Sample());
  CHECK(json["versions"][0]["nodes"][1]["stages"][1]["detail"] == "from trainer 100 bytes");
  CHECK(json["unreachable"][0]["error"] == "connection refused");
}

}  // namespace
}  // namespace refit::client
