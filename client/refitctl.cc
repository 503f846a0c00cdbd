// refitctl: look at and follow a node's refitd.
//
//   refitctl status            node, peers, models (latest version, versions held, buffers)
//   refitctl versions MODEL    versions held of one model
//   refitctl peers             the other daemons and whether they are connected
//   refitctl replicas MODEL    the nodes holding MODEL's versions, and how far behind each is
//   refitctl watch MODEL       one line per version as it completes (Ctrl-C to stop)
//   refitctl metrics           the daemon's counters
//   refitctl health            SERVING / NOT_SERVING
//   refitctl drop MODEL        releases a model's held versions and forgets it (no buffers left)
//   refitctl release BUFFER_ID releases a registered buffer (an operator cleaning up)
//   refitctl rollback MODEL VERSION
//                              every node with the model's DESTINATION buffers goes back to a
//                              retained VERSION; newer versions are held back until resume
//   refitctl resume MODEL      ends a rollback: the newest version is the target again
//   refitctl verify MODEL      compares the engine's destination bytes with the version each
//                              buffer holds (exit 1 naming the tensors that differ)
//   refitctl timeline MODEL [VERSION]
//                              each node's stages of the version(s) as a text Gantt chart;
//                              --trace=FILE also writes Chrome trace-event JSON (Perfetto)
//   refitctl --version
//
// --json prints machine-readable output (numbers as JSON numbers). --json, --socket and
// --timeout go before or after the subcommand. Exit codes: 0 success, 1 the daemon answered
// with an error, 2 bad usage, 3 no daemon answers at the socket.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <fstream>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/json_output.h"
#include "client/refit_client.h"
#include "client/timeline_output.h"
#include "daemon/common/names.h"
#include "daemon/version.h"

namespace {

namespace v1 = refit::v1;
using refit::client::Client;

constexpr int kExitError = 1;
constexpr int kExitNoDaemon = 3;

std::string Json(const google::protobuf::Message& message) {
  return refit::client::JsonText(refit::client::ToJson(message));
}

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrFormat("%.0f B", bytes) : absl::StrFormat("%.1f %s", bytes, units[u]);
}

int Fail(const absl::Status& status) {
  std::cerr << "refitctl: " << status.message() << "\n";
  return status.code() == absl::StatusCode::kUnavailable ? kExitNoDaemon : kExitError;
}

// The daemons this node pulls from (--peers) and those pulling from it (subscribed to it).
void PrintPeers(const v1::StatusResponse& status) {
  if (status.peers().empty() && status.pulled_by().empty()) {
    std::cout << "peers: none (no --peers, and no daemon pulls from this one)\n";
    return;
  }
  std::cout << absl::StrFormat("%-24s %-28s %-10s %s\n", "PEER", "ADDRESS", "DIRECTION", "STATE");
  for (const auto& p : status.peers()) {
    std::cout << absl::StrFormat("%-24s %-28s %-10s %s\n", p.node().empty() ? "-" : p.node(),
                                 p.address(), "pulls from",
                                 !p.error().empty() ? "refused"
                                 : p.connected()    ? "connected"
                                                    : "disconnected");
    if (!p.error().empty()) std::cout << "  error: " << p.error() << "\n";
  }
  for (const auto& p : status.pulled_by()) {
    std::cout << absl::StrFormat("%-24s %-28s %-10s %s\n", p.node().empty() ? "-" : p.node(),
                                 p.address(), "pulled by",
                                 p.connected() ? "connected" : "disconnected");
  }
}

// `peers --json`: one object per peer, "direction" telling which way versions go.
std::string PeersJson(const v1::StatusResponse& status) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const auto* peers : {&status.peers(), &status.pulled_by()}) {
    for (const auto& p : *peers) {
      nlohmann::ordered_json entry = refit::client::ToJson(p);
      entry["direction"] = peers == &status.peers() ? "pulls_from" : "pulled_by";
      list.push_back(std::move(entry));
    }
  }
  return refit::client::JsonText(list);
}

// The model named `model` in `status`, or null after saying on stderr what is known instead.
const v1::ModelStatus* FindModel(const v1::StatusResponse& status, const std::string& model) {
  std::vector<std::string> known;
  for (const auto& m : status.models()) {
    if (m.model() == model) return &m;
    known.push_back(m.model());
  }
  std::cerr << "refitctl: model " << model << " is not known to node " << status.node()
            << refit::KnownModelsHint(model, known)
            << "; a model is known once a buffer of it is registered on this node or a peer "
               "announces its sources\n";
  return nullptr;
}

void PrintStatus(const v1::StatusResponse& status) {
  std::cout << "node: " << status.node() << "   refitd " << status.version() << "   cuda: "
            << (status.cuda_enabled() ? absl::StrFormat("yes, %d device(s)", status.cuda_devices())
                                      : std::string("not compiled in"))
            << "\n";
  // Version slots held in host memory, against --max-slot-memory.
  const auto& metrics = status.metrics();
  if (auto held = metrics.find("refit_slot_memory_bytes"); held != metrics.end()) {
    auto limit = metrics.find("refit_slot_memory_limit_bytes");
    const double max = limit == metrics.end() ? 0 : limit->second;
    std::cout << "slot memory: " << HumanBytes(held->second) << " held"
              << (max > 0 ? " of " + HumanBytes(max) + " (--max-slot-memory)"
                          : std::string(", no limit"))
              << "\n";
  }
  PrintPeers(status);
  if (status.models().empty()) {
    std::cout << "models: none\n";
    return;
  }
  std::cout << absl::StrFormat("%-24s %8s %-16s %8s %13s %12s\n", "MODEL", "LATEST", "HELD",
                               "SOURCES", "DESTINATIONS", "VERSION SIZE");
  for (const auto& m : status.models()) {
    std::cout << absl::StrFormat("%-24s %8d %-16s %8d %13d %12s\n", m.model(), m.latest_version(),
                                 m.versions().empty() ? "-" : absl::StrJoin(m.versions(), ","),
                                 m.source_buffers(), m.destination_buffers(),
                                 HumanBytes(static_cast<double>(m.version_bytes())));
    if (m.budget_bytes() != 0 || m.held_bytes() != 0 || m.in_flight_bytes() != 0) {
      std::cout << absl::StrFormat(
          "  slots: %s held, %s spare, %s in flight; budget %s (retain + 1 versions of %s)\n",
          HumanBytes(static_cast<double>(m.held_bytes())),
          HumanBytes(static_cast<double>(m.spare_bytes())),
          HumanBytes(static_cast<double>(m.in_flight_bytes())),
          HumanBytes(static_cast<double>(m.budget_bytes())),
          HumanBytes(static_cast<double>(m.share_bytes())));
    }
    if (!m.memory_warning().empty()) {
      std::cout << "  memory: " << m.memory_warning() << "\n";
    }
    if (m.delta_base() == "destination") {
      std::cout << "  delta base: destination"
                << (m.destination_base_version() != 0
                        ? absl::StrCat(" (version ", m.destination_base_version(),
                                       " held only in the DESTINATION buffers)")
                        : std::string())
                << (m.delta_base_note().empty() ? std::string()
                                                : "; held copy kept: " + m.delta_base_note())
                << "\n";
    }
    if (m.abandoned_version() != 0) {
      std::cout << absl::StrFormat("  version %d abandoned: %s\n", m.abandoned_version(),
                                   m.abandoned_error());
    }
    if (!m.run().empty()) {
      std::cout << "  run: " << m.run()
                << (m.past_runs().empty()
                        ? std::string()
                        : absl::StrCat(" (after ", absl::StrJoin(m.past_runs(), ", "), ")"))
                << "\n";
    }
    if (m.rollback_version() != 0) {
      std::cout << absl::StrFormat(
          "  rolled back to version %d: newer versions are held back until `refitctl resume "
          "%s`\n",
          m.rollback_version(), m.model());
    }
    if (m.skipped_version() != 0) {
      std::cout << absl::StrFormat("  version %d skipped: %s\n", m.skipped_version(),
                                   m.skipped_reason());
    }
    for (const auto& b : m.buffers()) {
      std::cout << absl::StrFormat(
          "  %-34s %-11s %-4s %10s %5d tensors  client=%s%s\n", b.buffer_id(),
          b.role() == v1::SOURCE ? "source" : "destination", b.memory(),
          HumanBytes(static_cast<double>(b.bytes())), b.tensors(),
          b.client().empty() ? "-" : b.client(),
          b.role() == v1::SOURCE ? absl::StrFormat("  published=%d", b.last_published_version())
                                 : absl::StrFormat("  applied=%d", b.applied_version()));
      if (!b.error().empty()) std::cout << "    refused: " << b.error() << "\n";
    }
  }
}

std::string JsonString(const std::string& text);

std::string Bar(uint64_t done, uint64_t total) {
  const int width = 30;
  const int filled = total ? static_cast<int>(width * done / total) : width;
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
}

std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// Prints each version of `model` as it completes. On a terminal, a progress bar shows the pull
// in flight (from Status, polled every 200 ms) on the line below, and a version the node gave
// up on gets a line saying why.
int Watch(Client& client, const std::string& model, bool json) {
  auto watcher = client.Watch(model);
  if (!watcher.ok()) return Fail(watcher.status());
  std::mutex mu;
  std::deque<v1::VersionEvent> events;
  bool ended = false;
  std::thread reader([&] {
    v1::VersionEvent event;
    while ((*watcher)->Next(&event)) {
      std::lock_guard<std::mutex> lock(mu);
      events.push_back(event);
    }
    std::lock_guard<std::mutex> lock(mu);
    ended = true;
  });
  const bool tty = !json && isatty(STDOUT_FILENO);
  bool bar_shown = false;
  uint64_t abandoned_shown = 0;
  while (true) {
    std::deque<v1::VersionEvent> ready;
    bool done;
    {
      std::lock_guard<std::mutex> lock(mu);
      ready.swap(events);
      done = ended;
    }
    for (const auto& event : ready) {
      if (bar_shown) std::cout << "\r\033[K";
      bar_shown = false;
      if (json) {
        // One line per event; labels and the staleness fields only when set.
        std::cout << "{\"model\": " << JsonString(event.model())
                  << ", \"version\": " << event.version()
                  << ", \"rollback\": " << (event.rollback() ? "true" : "false")
                  << ", \"run\": " << JsonString(event.run());
        if (!event.labels().empty()) {
          std::cout << ", \"labels\": {";
          bool first = true;
          for (const auto& [k, v] :
               std::map<std::string, std::string>(event.labels().begin(), event.labels().end())) {
            std::cout << (first ? "" : ", ") << JsonString(k) << ": " << JsonString(v);
            first = false;
          }
          std::cout << "}";
        }
        if (event.stale() || event.stale_notice()) {
          std::cout << ", \"stale\": " << (event.stale() ? "true" : "false")
                    << ", \"published_version\": " << event.published_version()
                    << ", \"stale_notice\": " << (event.stale_notice() ? "true" : "false");
        }
        std::cout << "}" << std::endl;
      } else if (event.rollback()) {
        std::cout << event.model() << " version " << event.version()
                  << " rollback (newer versions held back until resume)" << std::endl;
      } else if (event.stale_notice()) {
        std::cout << event.model() << (event.stale() ? " stale" : " within its staleness budget")
                  << ": holds version " << event.version() << ", newest published "
                  << event.published_version() << std::endl;
      } else {
        std::vector<std::string> labels;
        for (const auto& [k, v] :
             std::map<std::string, std::string>(event.labels().begin(), event.labels().end())) {
          labels.push_back(k + "=" + v);
        }
        std::cout << event.model() << " version " << event.version() << " complete"
                  << (event.run().empty() ? std::string() : " (run " + event.run() + ")")
                  << (labels.empty() ? "" : " (" + absl::StrJoin(labels, ", ") + ")")
                  << (event.stale() ? " (stale)" : "") << std::endl;
      }
    }
    if (done) break;
    if (tty) {
      auto status = client.Status();
      if (status.ok()) {
        for (const auto& m : status->models()) {
          if (m.model() != model || m.abandoned_version() <= abandoned_shown) continue;
          if (bar_shown) std::cout << "\r\033[K";
          bar_shown = false;
          std::cout << model << " version " << m.abandoned_version()
                    << " abandoned: " << m.abandoned_error() << std::endl;
          abandoned_shown = m.abandoned_version();
        }
        for (const auto& t : status->transfers()) {
          if (t.model() != model) continue;
          std::cout << "\r\033[K"
                    << absl::StrFormat("%s version %d pulling %s %s / %s", model, t.version(),
                                       Bar(t.bytes_done(), t.bytes_total()),
                                       HumanBytes(double(t.bytes_done())),
                                       HumanBytes(double(t.bytes_total())))
                    << std::flush;
          bar_shown = true;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  reader.join();
  auto end = (*watcher)->status();
  return end.ok() ? 0 : Fail(end);
}

// One line (or JSON object) per node with DESTINATION buffers for the model: its newest
// complete version and how many versions it is behind the newest this node knows of.
int PrintReplicas(const v1::ModelStatus& model, bool json) {
  uint64_t newest = model.latest_version();
  for (const auto& r : model.replicas()) newest = std::max<uint64_t>(newest, r.latest_version());
  if (json) {
    std::cout << "[";
    for (int i = 0; i < model.replicas_size(); ++i) {
      const auto& r = model.replicas(i);
      std::cout << (i ? ",\n " : "\n ") << "{\"node\": " << JsonString(r.node())
                << ", \"latest_version\": " << r.latest_version()
                << ", \"behind\": " << newest - r.latest_version()
                << ", \"relay\": " << (r.relay() ? "true" : "false")
                << ", \"stale\": " << (r.stale() ? "true" : "false")
                << ", \"rollback_version\": " << r.rollback_version()
                << ", \"rolled_back\": " << (r.rolled_back() ? "true" : "false") << "}";
    }
    std::cout << (model.replicas_size() ? "\n]\n" : "]\n");
    return 0;
  }
  if (model.replicas().empty()) {
    std::cout << "no replicas: no node with DESTINATION buffers for " << model.model()
              << " has reported to this daemon\n";
    return 0;
  }
  std::cout << absl::StrFormat("%-32s %10s %8s %-5s %s\n", "node", "latest", "behind", "relay",
                               "stale");
  for (const auto& r : model.replicas()) {
    std::cout << absl::StrFormat(
        "%-32s %10d %8d %-5s %s%s\n", r.node(), r.latest_version(), newest - r.latest_version(),
        r.relay() ? "yes" : "no", r.stale() ? "STALE" : "no",
        r.rollback_version() == 0
            ? std::string()
            : absl::StrFormat("   rollback to %d: %s", r.rollback_version(),
                              r.rolled_back() ? "applied" : "not applied yet"));
  }
  if (model.max_staleness() > 0) {
    std::cout << "staleness budget: " << model.max_staleness() << " version(s) behind "
              << model.published_version() << "\n";
  }
  return 0;
}

// The flags every subcommand takes, before or after its name (and shown in its --help).
struct GlobalFlags {
  std::string socket = refit::client::DefaultSocketPath();
  bool json = false;
  double timeout_s = 5;

  void AddTo(CLI::App* app) {
    app->add_option("--socket", socket,
                    "the daemon's Unix socket (default $REFIT_SOCKET, else "
                    "/run/refit/refitd.sock)");
    app->add_flag("--json", json, "machine-readable output (numbers as JSON numbers)");
    app->add_option("--timeout", timeout_s,
                    "seconds to wait for a daemon whose socket exists but is slow (a missing "
                    "socket fails at once)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
  }
};

// refitctl timeline: every node's stages of MODEL's VERSION (0: those remembered).
int Timeline(Client& client, const std::string& model, uint64_t version, bool local,
             const std::string& trace, bool json) {
  auto timeline = client.Timeline(model, version, local);
  if (!timeline.ok()) return Fail(timeline.status());
  if (!trace.empty()) {
    std::ofstream file(trace);
    file << refit::client::TimelineTrace(*timeline).dump(1) << "\n";
    file.close();
    if (!file) {
      std::cerr << "refitctl: cannot write " << trace << "\n";
      return kExitError;
    }
  }
  if (json) {
    std::cout << refit::client::JsonText(refit::client::TimelineJson(*timeline));
  } else {
    std::cout << refit::client::TimelineText(*timeline);
    if (!trace.empty()) std::cout << "trace written to " << trace << " (open it in Perfetto)\n";
  }
  return 0;
}

int Drop(Client& client, const std::string& model, bool json) {
  auto dropped = client.DropModel(model);
  if (!dropped.ok()) return Fail(dropped.status());
  if (json) {
    std::cout << Json(*dropped);
  } else {
    std::cout << "model " << model << " dropped: released "
              << (dropped->released_versions().empty()
                      ? std::string("no versions")
                      : "versions " + absl::StrJoin(dropped->released_versions(), ","))
              << (dropped->forgotten_version() != 0
                      ? absl::StrCat("; forgot its newest published version ",
                                     dropped->forgotten_version(), " (the next run may start at 1)")
                      : std::string())
              << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  GlobalFlags flags;
  std::string model;

  CLI::App app{"refitctl: look at and follow a node's refitd"};
  flags.AddTo(&app);
  app.set_version_flag("--version", std::string("refitctl ") + refit::kRefitVersion,
                       "print the version and exit");
  app.require_subcommand(1);
  auto add = [&](const char* name, const char* what) {
    CLI::App* sub = app.add_subcommand(name, what);
    flags.AddTo(sub);
    return sub;
  };
  auto* status_cmd = add("status", "node, peers and models");
  auto* versions_cmd = add("versions", "versions held of one model");
  versions_cmd->add_option("MODEL", model, "model name")->required();
  auto* peers_cmd = add("peers", "the daemons this one pulls from and those pulling from it");
  auto* replicas_cmd = add("replicas", "the nodes holding MODEL and how far behind each is");
  replicas_cmd->add_option("MODEL", model, "model name")->required();
  auto* watch_cmd = add("watch", "print each version of MODEL as it completes");
  watch_cmd->add_option("MODEL", model, "model name")->required();
  auto* metrics_cmd = add("metrics", "the daemon's counters");
  auto* health_cmd = add("health", "whether the daemon is serving");
  auto* drop_cmd = add("drop",
                       "release MODEL's held versions and forget it, its newest published "
                       "version too (refused while buffers of it are registered)");
  drop_cmd->add_option("MODEL", model, "model name")->required();
  std::string buffer_id;
  auto* release_cmd = add("release",
                          "release a registered buffer (its published versions stay held; as "
                          "refitd's own user or root, any buffer)");
  release_cmd->add_option("BUFFER_ID", buffer_id, "a buffer id, as refitctl status shows it")
      ->required();
  auto* verify_cmd = add("verify",
                         "compare MODEL's destination buffers on this node with the version "
                         "their last Apply installed (exit 1 naming the tensors that differ)");
  verify_cmd->add_option("MODEL", model, "model name")->required();
  uint64_t timeline_version = 0;
  std::string trace;
  bool local = false;
  auto* timeline_cmd = add("timeline",
                           "each node's stages of MODEL's VERSION (default: the versions "
                           "remembered): published, announced, pulled from whom, verified, "
                           "quantized, complete, applied; a text Gantt chart");
  timeline_cmd->add_option("MODEL", model, "model name")->required();
  timeline_cmd->add_option("VERSION", timeline_version, "version (0: every version remembered)");
  timeline_cmd->add_option("--trace", trace,
                           "also write the timeline to FILE as Chrome trace-event JSON "
                           "(Perfetto, chrome://tracing): one process per node");
  timeline_cmd->add_flag("--local", local, "this node only (no other node asked)");
  uint64_t rollback_version = 0;
  auto* rollback_cmd = add("rollback",
                           "every node with MODEL's DESTINATION buffers goes back to the retained "
                           "VERSION (engines apply it); newer versions are held back until resume");
  rollback_cmd->add_option("MODEL", model, "model name")->required();
  rollback_cmd->add_option("VERSION", rollback_version, "a version still retained")->required();
  auto* resume_cmd = add("resume", "end MODEL's rollback: the newest version is the target again");
  resume_cmd->add_option("MODEL", model, "model name")->required();
  CLI11_PARSE(app, argc, argv);
  const bool json = flags.json;

  auto client = Client::Connect(
      flags.socket, std::chrono::milliseconds(static_cast<int64_t>(flags.timeout_s * 1000)));
  if (!client.ok()) return Fail(client.status());

  if (health_cmd->parsed()) {
    auto healthy = (*client)->Healthy();
    if (!healthy.ok()) return Fail(healthy.status());
    if (json) {
      std::cout << "{\"status\": \"" << (*healthy ? "SERVING" : "NOT_SERVING") << "\"}\n";
    } else {
      std::cout << (*healthy ? "SERVING" : "NOT_SERVING") << "\n";
    }
    return *healthy ? 0 : kExitError;
  }
  if (drop_cmd->parsed()) return Drop(**client, model, json);
  if (timeline_cmd->parsed()) {
    return Timeline(**client, model, timeline_version, local, trace, json);
  }
  if (rollback_cmd->parsed()) {
    auto rolled = (*client)->Rollback(model, rollback_version);
    if (!rolled.ok()) return Fail(rolled.status());
    if (json) {
      std::cout << "{\"model\": " << JsonString(model) << ", \"rollback_version\": " << *rolled
                << "}\n";
    } else {
      std::cout << model << " rolled back to version " << *rolled
                << "; newer versions are held back until `refitctl resume " << model << "`\n";
    }
    return 0;
  }
  if (resume_cmd->parsed()) {
    absl::Status resumed = (*client)->Resume(model);
    if (!resumed.ok()) return Fail(resumed);
    if (json) {
      std::cout << "{\"model\": " << JsonString(model) << ", \"resumed\": true}\n";
    } else {
      std::cout << model << " resumed: the newest version is the target again\n";
    }
    return 0;
  }
  if (verify_cmd->parsed()) {
    auto verified = (*client)->Verify(model);
    if (!verified.ok()) return Fail(verified.status());
    if (json) {
      std::cout << Json(*verified);
      return 0;
    }
    for (const v1::BufferVerification& b : verified->buffers()) {
      std::cout << b.buffer_id() << "  version " << b.version() << "  "
                << (b.checked() ? "ok" : "not checked: " + b.note()) << "\n";
    }
    if (verified->buffers().empty()) std::cout << "no destination buffers of " << model << "\n";
    return 0;
  }
  if (release_cmd->parsed()) {
    absl::Status released = (*client)->ReleaseBuffer(buffer_id);
    if (!released.ok()) return Fail(released);
    if (json) {
      nlohmann::ordered_json out;
      out["released"] = buffer_id;
      std::cout << out.dump(2) << "\n";
    } else {
      std::cout << "buffer " << buffer_id << " released\n";
    }
    return 0;
  }

  auto status = (*client)->Status();
  if (!status.ok()) return Fail(status.status());

  if (watch_cmd->parsed()) {
    // Like `versions`: a model this node doesn't know is an error, not a silent wait.
    if (!FindModel(*status, model)) return kExitError;
    return Watch(**client, model, json);
  }
  if (status_cmd->parsed()) {
    if (json) {
      std::cout << Json(*status);
    } else {
      PrintStatus(*status);
    }
  } else if (versions_cmd->parsed() || replicas_cmd->parsed()) {
    const v1::ModelStatus* found = FindModel(*status, model);
    if (!found) return kExitError;
    if (replicas_cmd->parsed()) return PrintReplicas(*found, json);
    if (json) {
      std::cout << Json(*found);
    } else {
      std::cout << "latest: " << found->latest_version() << "\nheld: "
                << (found->versions().empty() ? "none" : absl::StrJoin(found->versions(), " "))
                << "\n";
      if (found->skipped_version() != 0) {
        std::cout << "skipped: version " << found->skipped_version() << ": "
                  << found->skipped_reason() << "\n";
      }
    }
  } else if (peers_cmd->parsed()) {
    if (json) {
      std::cout << PeersJson(*status);
    } else {
      PrintPeers(*status);
    }
  } else if (metrics_cmd->parsed()) {
    std::map<std::string, double> sorted(status->metrics().begin(), status->metrics().end());
    if (json) {
      std::cout << "{";
      bool first = true;
      for (const auto& [k, v] : sorted) {
        std::cout << (first ? "\n  " : ",\n  ") << "\"";
        for (char c : k) std::cout << (c == '"' ? std::string("\\\"") : std::string(1, c));
        std::cout << "\": " << absl::StrFormat("%.17g", v);
        first = false;
      }
      std::cout << "\n}\n";
    } else {
      for (const auto& [k, v] : sorted)
        std::cout << k << " " << absl::StrFormat("%.17g", v) << "\n";
    }
  }
  return 0;
}
