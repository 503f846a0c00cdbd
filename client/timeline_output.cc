#include "client/timeline_output.h"

#include <algorithm>
#include <climits>
#include <ctime>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace refit::client {

namespace {

// version -> node -> its stages of that version, nodes in the response's order.
using ByVersion =
    std::map<uint64_t, std::vector<std::pair<std::string, const v1::VersionTimeline*>>>;

ByVersion Group(const v1::TimelineResponse& timeline) {
  ByVersion out;
  for (const v1::NodeTimeline& node : timeline.nodes()) {
    if (!node.error().empty()) continue;
    for (const v1::VersionTimeline& v : node.versions()) {
      out[v.version()].emplace_back(node.node(), &v);
    }
  }
  return out;
}

std::string UtcTime(int64_t us) {
  const time_t seconds = static_cast<time_t>(us / 1000000);
  struct tm tm;
  gmtime_r(&seconds, &tm);
  char text[32];
  strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &tm);
  return absl::StrFormat("%s.%06d UTC", text, static_cast<int>(us % 1000000));
}

}  // namespace

std::string TimelineText(const v1::TimelineResponse& timeline, int width) {
  std::string out;
  const ByVersion versions = Group(timeline);
  if (versions.empty()) {
    absl::StrAppend(&out, "no timeline of ", timeline.model(), " on the nodes reached\n");
  }
  for (const auto& [version, nodes] : versions) {
    int64_t first = INT64_MAX, last = INT64_MIN;
    size_t name_width = 4;
    for (const auto& [node, v] : nodes) {
      name_width = std::max(name_width, node.size());
      for (const v1::TimelineStage& s : v->stages()) {
        first = std::min(first, s.start_us());
        last = std::max(last, s.end_us());
      }
    }
    if (first == INT64_MAX) continue;
    const double span = static_cast<double>(std::max<int64_t>(1, last - first));
    absl::StrAppend(&out, timeline.model(), " version ", version, ": from ", UtcTime(first),
                    absl::StrFormat(", %.1f ms in all\n", (last - first) / 1e3));
    absl::StrAppend(
        &out, absl::StrFormat("  %-*s %-10s %10s %10s  %-*s  %s\n", static_cast<int>(name_width),
                              "node", "stage", "start ms", "ms", width, "", "detail"));
    for (const auto& [node, v] : nodes) {
      for (const v1::TimelineStage& s : v->stages()) {
        std::string bar(static_cast<size_t>(width), ' ');
        const int from =
            std::clamp(static_cast<int>((s.start_us() - first) / span * (width - 1)), 0, width - 1);
        const int to = std::clamp(static_cast<int>((s.end_us() - first) / span * (width - 1)), from,
                                  width - 1);
        if (s.end_us() == s.start_us()) {
          bar[static_cast<size_t>(from)] = '|';
        } else {
          for (int i = from; i <= to; ++i) bar[static_cast<size_t>(i)] = '#';
        }
        absl::StrAppend(&out, absl::StrFormat("  %-*s %-10s %10.1f %10.1f [%s] %s\n",
                                              static_cast<int>(name_width), node, s.stage(),
                                              (s.start_us() - first) / 1e3,
                                              (s.end_us() - s.start_us()) / 1e3, bar, s.detail()));
      }
    }
  }
  for (const v1::NodeTimeline& node : timeline.nodes()) {
    if (node.error().empty()) continue;
    absl::StrAppend(&out, "unreachable: ", node.address(), ": ", node.error(), "\n");
  }
  return out;
}

nlohmann::ordered_json TimelineJson(const v1::TimelineResponse& timeline) {
  nlohmann::ordered_json out;
  out["model"] = timeline.model();
  out["versions"] = nlohmann::ordered_json::array();
  for (const auto& [version, nodes] : Group(timeline)) {
    nlohmann::ordered_json v;
    v["version"] = version;
    v["nodes"] = nlohmann::ordered_json::array();
    for (const auto& [node, record] : nodes) {
      nlohmann::ordered_json n;
      n["node"] = node;
      n["stages"] = nlohmann::ordered_json::array();
      for (const v1::TimelineStage& s : record->stages()) {
        nlohmann::ordered_json stage;
        stage["stage"] = s.stage();
        stage["start_us"] = s.start_us();
        stage["end_us"] = s.end_us();
        stage["detail"] = s.detail();
        n["stages"].push_back(std::move(stage));
      }
      v["nodes"].push_back(std::move(n));
    }
    out["versions"].push_back(std::move(v));
  }
  out["unreachable"] = nlohmann::ordered_json::array();
  for (const v1::NodeTimeline& node : timeline.nodes()) {
    if (node.error().empty()) continue;
    out["unreachable"].push_back({{"address", node.address()}, {"error", node.error()}});
  }
  return out;
}

nlohmann::ordered_json TimelineTrace(const v1::TimelineResponse& timeline) {
  int64_t first = INT64_MAX;
  for (const v1::NodeTimeline& node : timeline.nodes()) {
    for (const v1::VersionTimeline& v : node.versions()) {
      for (const v1::TimelineStage& s : v.stages()) first = std::min(first, s.start_us());
    }
  }
  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  int pid = 0;
  for (const v1::NodeTimeline& node : timeline.nodes()) {
    if (!node.error().empty()) continue;
    ++pid;
    events.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", pid},
                      {"tid", 0},
                      {"args", {{"name", node.node()}}}});
    events.push_back({{"name", "process_sort_index"},
                      {"ph", "M"},
                      {"pid", pid},
                      {"tid", 0},
                      {"args", {{"sort_index", pid}}}});
    for (const v1::VersionTimeline& v : node.versions()) {
      const int tid = static_cast<int>(v.version() % 1000000);
      events.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", pid},
                        {"tid", tid},
                        {"args", {{"name", "version " + std::to_string(v.version())}}}});
      for (const v1::TimelineStage& s : v.stages()) {
        nlohmann::ordered_json e;
        e["name"] = s.stage();
        e["cat"] = "refit";
        e["ph"] = s.end_us() > s.start_us() ? "X" : "i";
        e["ts"] = s.start_us() - first;
        if (s.end_us() > s.start_us()) {
          e["dur"] = s.end_us() - s.start_us();
        } else {
          e["s"] = "t";
        }
        e["pid"] = pid;
        e["tid"] = tid;
        e["args"] = {{"version", v.version()}, {"node", node.node()}, {"detail", s.detail()}};
        events.push_back(std::move(e));
      }
    }
  }
  nlohmann::ordered_json out;
  out["traceEvents"] = std::move(events);
  out["displayTimeUnit"] = "ms";
  out["otherData"] = {{"model", timeline.model()}, {"origin_us", first == INT64_MAX ? 0 : first}};
  return out;
}

}  // namespace refit::client
