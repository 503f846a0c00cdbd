// fanout_sim: what the stripe trees of daemon/fleet/stripes.h do for 1 to 256 engine nodes,
// in the model of daemon/fleet/fanout_model.h. Prints T(K), T(K)/T(1), the origin's bytes per
// version and the most any engine uploaded, the same with a relay killed mid-transfer, a
// Kimi-K2-sized fleet beside Perplexity's published 1.3 s, and (with --calibrate-measured)
// the prediction beside figures measured on the real five-node run. docs/fanout-simulator.md
// explains the model and its assumptions.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/fleet/fanout_model.h"
#include "daemon/fleet/stripes.h"
#include "daemon/options.h"

namespace refit::fleet {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

struct Options {
  uint64_t model_bytes = uint64_t{256} << 20;
  // The simulated refitd's --chunk-bytes, --inflight and --relay: refitd's defaults.
  uint64_t chunk_bytes = DaemonOptions{}.chunk_bytes;
  double link_gbit = 1;
  // Goodput: the fraction of line rate a link delivers (TCP/IP headers, tbf, CPU). 0: 1 in the
  // tables; --calibrate-measured then fits it on its first figure.
  double goodput = 0;
  double latency_us = 100;
  int trainers = 1;
  int pieces_per_trainer = 1;
  std::string k_list = "1,2,4,8,16,32,64,128,256";
  int fanout = kDefaultFanout;
  int inflight = static_cast<int>(DaemonOptions{}.inflight);
  bool relay = DaemonOptions{}.relay;
  double kill_fraction = 0.5;
  double kill_time_s = -1;
  double detect_delay_s = 0.2;
  std::string failover = "children";
  std::string pair_sharing = "in-order";
  std::string calibrate_measured;
  std::string calibrate_k = "1,2,4";
  bool kimi = true;
  uint64_t kimi_chunk_bytes = uint64_t{64} << 20;
  bool sensitivity = true;
  std::string kimi_replicas = "1,2,4,8";
};

std::vector<std::string> Split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(item);
  if (!text.empty() && text.back() == ',') out.push_back("");
  return out;
}

bool ParseInts(const std::string& text, std::vector<int>* out) {
  for (const std::string& item : Split(text)) {
    try {
      out->push_back(std::stoi(item));
    } catch (...) {
      return false;
    }
    if (out->back() < 1) return false;
  }
  return !out->empty();
}

struct Run {
  SimResult result;
  SimScenario scenario;
  double seconds = 0;  // Wall time the simulation took.
};

SimScenario Configure(SimScenario s, const Options& o, bool relay) {
  s.chunk_bytes = o.chunk_bytes;
  s.fanout = o.fanout;
  s.inflight = o.inflight;
  s.relay = relay;
  s.detect_delay_s = o.detect_delay_s;
  s.failover = o.failover == "subtree" ? Failover::kSubtree : Failover::kChildren;
  s.pair_sharing = o.pair_sharing == "fair" ? PairSharing::kFair : PairSharing::kInOrder;
  return s;
}

bool Simulate(const SimScenario& s, Run* run) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<SimResult> result = Simulate(s);
  if (!result.ok()) {
    std::fprintf(stderr, "fanout_sim: %s\n", std::string(result.status().message()).c_str());
    return false;
  }
  run->result = *std::move(result);
  run->scenario = s;
  run->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return true;
}

// Per node: bytes uploaded, cut transfers included.
double Uploaded(const Run& run, size_t node) {
  const SimNodeResult& r = run.result.nodes[node];
  return static_cast<double>(r.bytes_sent + r.bytes_aborted);
}

// What the origins (trainer nodes) uploaded in all, and the most one engine node uploaded.
struct Uploads {
  double origins = 0;
  double max_engine = 0;
};

Uploads UploadsOf(const Run& run) {
  std::vector<bool> origin(run.scenario.nodes.size(), false);
  for (const SimPiece& p : run.scenario.pieces) origin[p.origin] = true;
  Uploads u;
  for (size_t n = 0; n < origin.size(); ++n) {
    if (origin[n]) {
      u.origins += Uploaded(run, n);
    } else {
      u.max_engine = std::max(u.max_engine, Uploaded(run, n));
    }
  }
  return u;
}

FleetSpec Fleet(const Options& o, int engines) {
  FleetSpec f;
  f.trainers = o.trainers;
  f.pieces_per_trainer = o.pieces_per_trainer;
  f.engines = engines;
  f.model_bytes = o.model_bytes;
  f.link_bytes_per_s = o.link_gbit * 1e9 / 8 * (o.goodput > 0 ? o.goodput : 1);
  f.latency_s = o.latency_us * 1e-6;
  return f;
}

bool RunFleet(const Options& o, const FleetSpec& f, bool relay, Run* run) {
  absl::StatusOr<SimScenario> s = MakeFleet(f);
  if (!s.ok()) {
    std::fprintf(stderr, "fanout_sim: %s\n", std::string(s.status().message()).c_str());
    return false;
  }
  return Simulate(Configure(*std::move(s), o, relay), run);
}

void PrintAssumptions(const Options& o) {
  char kill_at[64];
  if (o.kill_time_s >= 0) {
    std::snprintf(kill_at, sizeof(kill_at), "%.3f s", o.kill_time_s);
  } else {
    std::snprintf(kill_at, sizeof(kill_at), "%.2f x T(K)", o.kill_fraction);
  }
  std::printf(
      "fan-out simulator (daemon/fleet/fanout_model.h; routing from daemon/fleet/stripes.h)\n"
      "  model %.0f MiB in %d piece(s) on %d trainer node(s); chunks %.3g MiB; every node's\n"
      "  uplink and downlink %.3g Gbit/s at goodput %.3f; one-way latency %.0f us; fanout %d;\n"
      "  %d reads in\n"
      "  flight per (child, parent), %s; relay %s;\n"
      "  every engine pulls the whole model.\n"
      "  Failure case: the root of stripe 0 of piece 0 (the relay with the largest subtree) is\n"
      "  killed at %s; after %.2f s its %s re-source what they lack from the origin.\n\n",
      o.model_bytes / kMiB, o.trainers * o.pieces_per_trainer, o.trainers, o.chunk_bytes / kMiB,
      o.link_gbit, o.goodput > 0 ? o.goodput : 1.0, o.latency_us, o.fanout, o.inflight,
      o.pair_sharing == "fair" ? "each read a flow of its own" : "served in order per pair",
      o.relay ? "on" : "off (all from origin)", kill_at, o.detect_delay_s,
      o.failover == "subtree" ? "subtree's nodes" : "children");
}

bool PrintTable(const Options& o, const std::vector<int>& ks) {
  const double model = static_cast<double>(o.model_bytes);
  const double floor_s = model / (o.link_gbit * 1e9 / 8 * (o.goodput > 0 ? o.goodput : 1));
  std::printf("%5s %8s %7s %8s %8s %9s | %8s %7s %8s %10s %8s\n", "K", "T(K) s", "T/T(1)", "origin",
              "max eng", "no-relay", "T kill s", "/T(1)", "origin", "killed", "kill at");
  std::printf("%5s %8s %7s %8s %8s %9s | %8s %7s %8s %10s %8s\n", "", "", "", "models", "up model",
              "T(K) s", "", "", "models", "", "s");
  Run one;
  if (!RunFleet(o, Fleet(o, 1), o.relay, &one)) return false;
  const double t1 = one.result.time_s;
  for (int k : ks) {
    Run base, plain;
    if (!RunFleet(o, Fleet(o, k), o.relay, &base)) return false;
    if (!RunFleet(o, Fleet(o, k), false, &plain)) return false;
    const double ratio = base.result.time_s / t1;
    std::printf("%5d %8.3f %7.3f %8.3f %8.3f %9.3f |", k, base.result.time_s, ratio,
                UploadsOf(base).origins / model, UploadsOf(base).max_engine / model,
                plain.result.time_s);
    const int victim = BusiestRelay(base.scenario);
    if (victim < 0) {
      std::printf(" %8s %7s %8s %10s %8s   (no relay to kill)\n", "-", "-", "-", "-", "-");
      continue;
    }
    SimScenario s = base.scenario;
    const double at = o.kill_time_s >= 0 ? o.kill_time_s : o.kill_fraction * base.result.time_s;
    s.kills.push_back({victim, at});
    Run failed;
    if (!Simulate(s, &failed)) return false;
    int live = 0, done = 0;
    for (const SimNodeResult& r : failed.result.nodes) {
      if (r.killed) continue;
      ++live;
      done += r.done_s >= 0 ? 1 : 0;
    }
    std::printf(" %8.3f %7.3f %8.3f %10s %8.3f   (%d/%d live done, sim %.1f s)\n",
                failed.result.time_s, failed.result.time_s / t1, UploadsOf(failed).origins / model,
                s.nodes[victim].name.c_str(), at, done, live - o.trainers,
                base.seconds + failed.seconds);
  }
  std::printf(
      "\n  floor (model / link): %.3f s. origin models: bytes the trainer node(s) uploaded per\n"
      "  version / model bytes. max eng up: the most one engine node uploaded, in models.\n"
      "  no-relay: every engine reads everything from the origin (today's pull). sim: wall time\n"
      "  of the two runs. Without --kill-time the kill is at --kill-at x T(K).\n\n",
      floor_s);
  return true;
}

// 1 T parameters from 32 trainer nodes (8 ranks each) to 16 engine nodes, 8 x 400 Gbit/s each.
bool PrintKimi(const Options& o) {
  Options k = o;
  k.chunk_bytes = o.kimi_chunk_bytes;
  const double node_bytes_per_s = 8 * 400e9 / 8 * (o.goodput > 0 ? o.goodput : 1);
  std::printf(
      "Kimi-K2-sized fleet: 1e12 parameters, 32 trainer nodes x 8 ranks (256 pieces), 16 engine\n"
      "nodes, 8 x 400 Gbit/s at goodput %.3f = %.0f GB/s per node each way, %.0f MiB chunks,\n"
      "latency %.0f us.\n"
      "Perplexity reports < 1.3 s (BF16 training on 256 GPUs, FP8 inference on 128 GPUs; each\n"
      "inference GPU is written only the FP8 weights of its own shard).\n",
      o.goodput > 0 ? o.goodput : 1.0, node_bytes_per_s / 1e9, k.chunk_bytes / kMiB, o.latency_us);
  std::printf("  %-44s %8s %8s %10s %9s %9s\n", "case", "T s", "floor s", "trainers", "per node",
              "no-relay");
  std::printf("  %-44s %8s %8s %10s %9s %9s\n", "", "", "", "models", "GB in", "T s");
  struct Case {
    std::string name;
    double bytes;
    int replicas;
  };
  std::vector<Case> cases = {{"full BF16 copy (2 TB) on every engine node", 2e12, 0}};
  std::vector<int> replicas;
  if (!ParseInts(o.kimi_replicas, &replicas)) return false;
  for (int r : replicas) {
    cases.push_back({"FP8 (1 TB), " + std::to_string(r) + " replica(s) of " +
                         std::to_string(16 / r) + " nodes, shards",
                     1e12, r});
  }
  for (const Case& c : cases) {
    FleetSpec f;
    f.trainers = 32;
    f.pieces_per_trainer = 8;
    f.engines = 16;
    f.replicas = c.replicas;
    f.model_bytes = static_cast<uint64_t>(c.bytes);
    f.link_bytes_per_s = node_bytes_per_s;
    f.latency_s = o.latency_us * 1e-6;
    Run run, plain;
    if (!RunFleet(k, f, o.relay, &run) || !RunFleet(k, f, false, &plain)) return false;
    const double per_node = c.replicas == 0 ? c.bytes : c.bytes * c.replicas / 16;
    std::printf("  %-44s %8.3f %8.3f %10.3f %9.1f %9.3f\n", c.name.c_str(), run.result.time_s,
                per_node / node_bytes_per_s, UploadsOf(run).origins / c.bytes, per_node / 1e9,
                plain.result.time_s);
  }
  std::printf(
      "  floor: bytes one engine node must receive / its downlink. trainers models: "
      "bytes the 32 trainer\n  nodes uploaded / model bytes. no-relay: every engine "
      "reads its pieces from their origins.\n\n");
  return true;
}

// Relay hops below a stripe's root, at most, for `pullers` nodes (from PathTo).
int TreeDepth(int pullers, int fanout) {
  std::vector<std::string> names;
  for (int i = 0; i < pullers; ++i) names.push_back(std::to_string(100000 + i));
  const int stripes = StripeCount(names.size(), fanout);
  size_t longest = 1;
  for (int st = 0; st < stripes; ++st) {
    for (const std::string& n : names) {
      longest = std::max(longest, PathTo(names, n, st, stripes, fanout).size());
    }
  }
  return static_cast<int>(longest) - 1;
}

// How T(K)/T(1) depends on the pipelining depth: a relay forwards a chunk only once it has
// landed, so each hop below the root delays a stripe by what lands at once on that hop.
bool PrintSensitivity(const Options& o, int k) {
  struct Variant {
    const char* what;
    std::string sharing;
    int inflight;
    uint64_t chunk_bytes;
  };
  const std::vector<Variant> variants = {
      {"as above", o.pair_sharing, o.inflight, o.chunk_bytes},
      {"in-order per pair", "in-order", o.inflight, o.chunk_bytes},
      {"fair per read", "fair", o.inflight, o.chunk_bytes},
      {"fair per read, 2 in flight", "fair", 2, o.chunk_bytes},
      {"fair per read, 1 in flight", "fair", 1, o.chunk_bytes},
      {"in-order, chunks / 4", "in-order", o.inflight, std::max<uint64_t>(1, o.chunk_bytes / 4)},
      {"fair, 2 in flight, chunks / 4", "fair", 2, std::max<uint64_t>(1, o.chunk_bytes / 4)},
  };
  const int depth = TreeDepth(k, o.fanout);
  const int stripes = StripeCount(static_cast<size_t>(k), o.fanout);
  const double piece = static_cast<double>(o.model_bytes) / (o.trainers * o.pieces_per_trainer);
  std::printf("Pipelining depth at K=%d (%d stripes, %d relay hops below the root):\n", k, stripes,
              depth);
  std::printf("  %-32s %9s %9s %8s %11s\n", "variant", "chunk MiB", "in flight", "T/T(1)",
              "1+hops*S*w*c/piece");
  for (const Variant& v : variants) {
    Options x = o;
    x.pair_sharing = v.sharing;
    x.inflight = v.inflight;
    x.chunk_bytes = v.chunk_bytes;
    Run one, many;
    if (!RunFleet(x, Fleet(x, 1), true, &one) || !RunFleet(x, Fleet(x, k), true, &many)) {
      return false;
    }
    // What lands at once on a hop: one chunk in order, else every read in flight of the stripe.
    const double chunks_per_stripe = std::ceil(piece / v.chunk_bytes / stripes);
    const double w = v.sharing == "fair" ? std::min<double>(v.inflight, chunks_per_stripe) : 1;
    std::printf("  %-32s %9.2f %9d %8.3f %11.3f\n", v.what, v.chunk_bytes / kMiB, v.inflight,
                many.result.time_s / one.result.time_s,
                1 + depth * stripes * w * v.chunk_bytes / piece);
  }
  std::printf("\n");
  return true;
}

// The real five-node run: the table's model, link and chunk flags; K from --calibrate-k.
bool PrintCalibration(const Options& o) {
  std::vector<int> ks;
  if (!ParseInts(o.calibrate_k, &ks)) return false;
  const std::vector<std::string> measured = Split(o.calibrate_measured);
  std::printf(
      "Calibration against the real run (%.0f MiB, %.3g Gbit/s, %.0f us, %.3g MiB "
      "chunks, relay %s):\n",
      o.model_bytes / kMiB, o.link_gbit, o.latency_us, o.chunk_bytes / kMiB,
      o.relay ? "on" : "off");
  std::printf("  %4s %10s %10s %8s %12s %8s\n", "K", "sim T s", "measured", "diff", "sim x eff",
              "diff");
  // Goodput / line rate: --goodput where given, else fitted on the first measured figure.
  double efficiency = o.goodput;
  Options line = o;
  line.goodput = 1;
  bool all_within = true;
  for (size_t i = 0; i < ks.size(); ++i) {
    Run run;
    if (!RunFleet(line, Fleet(line, ks[i]), o.relay, &run)) return false;
    const double sim = run.result.time_s;
    double real = NAN;
    if (i < measured.size() && !measured[i].empty() && measured[i] != "-") {
      try {
        real = std::stod(measured[i]);
      } catch (...) {
        return false;
      }
    }
    if (std::isnan(real)) {
      std::printf("  %4d %10.3f %10s\n", ks[i], sim, "-");
      continue;
    }
    const bool fit_here = efficiency == 0;
    if (fit_here) efficiency = sim / real;
    // The same scenario with every link at that goodput (latencies unchanged).
    Options at = o;
    at.goodput = efficiency;
    Run calibrated;
    if (!RunFleet(at, Fleet(at, ks[i]), o.relay, &calibrated)) return false;
    const double fitted = calibrated.result.time_s;
    const bool within = std::fabs(fitted - real) <= 0.15 * real;
    all_within = all_within && within;
    std::printf("  %4d %10.3f %10.3f %+7.1f%% %12.3f %+7.1f%%%s%s\n", ks[i], sim, real,
                100 * (sim - real) / real, fitted, 100 * (fitted - real) / real,
                within ? "" : "  (outside 15 %)", fit_here ? "  (fitted here)" : "");
  }
  if (efficiency > 0) {
    std::printf("  sim x eff: every link at goodput %.3f (%s); %s.\n", efficiency,
                o.goodput > 0 ? "--goodput" : "fitted on the first figure",
                all_within ? "every row within 15 %" : "NOT every row within 15 %");
  }
  std::printf("\n");
  return true;
}

}  // namespace
}  // namespace refit::fleet

int main(int argc, char** argv) {
  using refit::fleet::Options;
  Options o;
  CLI::App app{"fanout_sim: the stripe trees of daemon/fleet/stripes.h for 1 to 256 engines"};
  app.add_option("--model-bytes", o.model_bytes, "bytes per version, e.g. 256MiB, 1GiB")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--chunk-bytes", o.chunk_bytes, "chunk size (the daemon's --chunk-bytes)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--link-gbit", o.link_gbit, "every node's uplink and downlink, Gbit/s")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--latency-us", o.latency_us, "one-way latency between two nodes, us")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--trainers", o.trainers, "origin (trainer) nodes")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--pieces-per-trainer", o.pieces_per_trainer, "pieces (ranks) per trainer node")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--k", o.k_list, "engine node counts, comma-separated")->capture_default_str();
  app.add_option("--fanout", o.fanout, "children per node in a stripe tree")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--inflight", o.inflight, "chunk reads in flight per (child, parent)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--relay", o.relay, "relay through stripe trees (false: all from the origin)")
      ->capture_default_str();
  app.add_option("--kill-at", o.kill_fraction, "kill time as a fraction of T(K) without failure")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--kill-time", o.kill_time_s, "kill time in seconds (overrides --kill-at)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--detect-delay", o.detect_delay_s, "seconds until a dead relay is noticed")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--failover", o.failover,
                 "who re-sources from the origin: children (of the dead relay) or subtree")
      ->capture_default_str()
      ->check(CLI::IsMember({"children", "subtree"}));
  app.add_option("--pair-sharing", o.pair_sharing,
                 "transfers between one sender and one receiver: in-order (one stream) or fair "
                 "(a flow each)")
      ->capture_default_str()
      ->check(CLI::IsMember({"in-order", "fair"}));
  app.add_option("--goodput", o.goodput,
                 "fraction of line rate every link delivers (0: 1, and --calibrate-measured "
                 "fits it on its first figure)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--calibrate-measured", o.calibrate_measured,
                 "measured T for the K of --calibrate-k, e.g. 2.31,2.40,2.52 (empty or - skips)");
  app.add_option("--calibrate-k", o.calibrate_k, "K of the measured figures")
      ->capture_default_str();
  app.add_option("--kimi", o.kimi, "print the Kimi-K2-sized case")->capture_default_str();
  app.add_option("--sensitivity", o.sensitivity,
                 "print T(K)/T(1) at the largest K for other pair sharing, reads and chunks")
      ->capture_default_str();
  app.add_option("--kimi-chunk-bytes", o.kimi_chunk_bytes, "chunk size for the Kimi-K2 case")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--kimi-replicas", o.kimi_replicas,
                 "replica counts for the sharded Kimi-K2 rows (each divides 16)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::vector<int> ks;
  if (!refit::fleet::ParseInts(o.k_list, &ks) || o.chunk_bytes == 0 || o.model_bytes == 0 ||
      o.kimi_chunk_bytes == 0) {
    std::fprintf(stderr, "fanout_sim: bad --k, --model-bytes or --chunk-bytes\n");
    return 2;
  }
  refit::fleet::PrintAssumptions(o);
  if (!o.calibrate_measured.empty() && !refit::fleet::PrintCalibration(o)) return 1;
  if (!refit::fleet::PrintTable(o, ks)) return 1;
  if (o.sensitivity &&
      !refit::fleet::PrintSensitivity(o, *std::max_element(ks.begin(), ks.end()))) {
    return 1;
  }
  if (o.kimi && !refit::fleet::PrintKimi(o)) return 1;
  return 0;
}
