#pragma once

// refitctl timeline: a TimelineResponse (every node's stages of a model's versions) as a text
// Gantt chart, as JSON, and as a Chrome trace-event file (the JSON Perfetto and
// chrome://tracing open: one process per node, named after it, one thread per version, each
// stage a complete event "X", or an instant event "i" where it has no duration).
//
// Thread-safety: pure functions.

#include <string>

#include "nlohmann/json.hpp"
#include "proto/refit/v1/refit.pb.h"

namespace refit::client {

// One block per version: a header with the version's first time (UTC), then one line per node
// and stage, with its start and duration relative to that time in ms, a bar of `width`
// characters over the version's whole span, and the stage's detail. Unreachable nodes are
// listed at the end with their error.
std::string TimelineText(const v1::TimelineResponse& timeline, int width = 48);

// {"model": ..., "versions": [{"version": N, "nodes": [{"node": ..., "stages": [{"stage",
// "start_us", "end_us", "detail"}]}]}], "unreachable": [{"address", "error"}]}
nlohmann::ordered_json TimelineJson(const v1::TimelineResponse& timeline);

// The Chrome trace-event JSON object ({"traceEvents": [...], "displayTimeUnit": "ms"}); times in
// microseconds since the earliest stage.
nlohmann::ordered_json TimelineTrace(const v1::TimelineResponse& timeline);

}  // namespace refit::client
