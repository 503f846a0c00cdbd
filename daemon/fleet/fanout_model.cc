#include "daemon/fleet/fanout_model.h"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>
#include <queue>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/fleet/stripes.h"

namespace refit::fleet {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();
// Events closer than this are one instant: they are handled before rates are recomputed.
constexpr double kSameInstant = 1e-12;

enum ChunkState : uint8_t { kMissing, kRequested, kHave };

// One puller's progress on one piece.
struct Pull {
  std::vector<uint8_t> state;       // ChunkState per chunk.
  std::vector<int> requested_from;  // The node a kRequested chunk was asked of.
  std::vector<int> source;          // Per stripe: the node this puller reads it from.
};

struct PieceRouting {
  int stripes = 1;
  std::vector<int> stripe_of;                           // Per chunk.
  std::vector<int> slot_of;                             // Per node: index into pullers, or -1.
  std::vector<std::vector<std::vector<int>>> children;  // [stripe][slot]: nodes served.
  std::vector<std::vector<std::vector<int>>> below;     // [stripe][slot]: whole subtree.
};

struct ChunkRef {
  int piece;
  int chunk;
};

// What a child knows it may ask one parent for, and how many reads it has outstanding there.
struct Link {
  int inflight = 0;
  std::deque<ChunkRef> ready;
};

// The chunk transfers from one sender to one receiver. They face the same two links, so max-min
// fairness gives each the same rate (kFair: `served` and `rate` are per transfer), or they are
// one stream served in order (kInOrder: `served` and `rate` are the stream's, and each target
// starts where the previous one ends). A transfer ends when `served` reaches its target.
struct Edge {
  int sender = 0;
  int receiver = 0;
  double served = 0;
  double rate = 0;  // Bytes/s, per transfer or for the stream.
  double last_target = 0;
  bool listed = false;
  // (target, flow id), smallest target on top.
  std::priority_queue<std::pair<double, int>, std::vector<std::pair<double, int>>, std::greater<>>
      flows;
};

struct Flow {
  int piece;
  int chunk;
  uint64_t bytes;
  double target;
};

enum class EventType { kAnnounce, kRequestArrive, kLand, kKill, kDetect };

struct Event {
  double time;
  uint64_t seq;
  EventType type;
  int a;  // receiver / child / killed node
  int b;  // sender / parent / dead node
  int piece;
  int chunk;  // For kDetect: the stripe.
  bool operator>(const Event& o) const { return time != o.time ? time > o.time : seq > o.seq; }
};

class Simulator {
 public:
  explicit Simulator(const SimScenario& s) : s_(s) {}

  absl::StatusOr<SimResult> Run() {
    RETURN_IF_ERROR(Validate());
    RETURN_IF_ERROR(Route());
    for (const SimKill& k : s_.kills) Push(k.time_s, EventType::kKill, k.node, -1, -1, -1);
    SeedOrigins();
    Loop();
    SimResult result;
    result.nodes = std::move(out_);
    result.transfers = transfers_;
    result.events = events_;
    for (size_t n = 0; n < s_.nodes.size(); ++n) {
      if (missing_[n] == 0 || killed_[n]) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          "node ", s_.nodes[n].name, " never completed: ", missing_[n], " chunks missing"));
    }
    for (const SimNodeResult& n : result.nodes) result.time_s = std::max(result.time_s, n.done_s);
    return result;
  }

 private:
  absl::Status Validate() {
    const int n = static_cast<int>(s_.nodes.size());
    if (s_.chunk_bytes == 0 || s_.fanout < 1 || s_.inflight < 1) {
      return absl::InvalidArgumentError("chunk_bytes, fanout and inflight must be positive");
    }
    for (const SimNode& node : s_.nodes) {
      if (!(node.up_bytes_per_s > 0) || !(node.down_bytes_per_s > 0) || node.latency_s < 0) {
        return absl::InvalidArgumentError(absl::StrCat("node ", node.name, ": bad link"));
      }
    }
    std::vector<bool> origin(n, false);
    for (const SimPiece& p : s_.pieces) {
      if (p.origin < 0 || p.origin >= n) return absl::InvalidArgumentError("bad origin");
      origin[p.origin] = true;
      for (int q : p.pullers) {
        if (q < 0 || q >= n || q == p.origin) {
          return absl::InvalidArgumentError(absl::StrCat("piece ", p.buffer_id, ": bad puller"));
        }
      }
    }
    for (const SimKill& k : s_.kills) {
      if (k.node < 0 || k.node >= n || origin[k.node] || k.time_s < 0) {
        return absl::InvalidArgumentError("a kill must name a puller, not an origin");
      }
    }
    return absl::OkStatus();
  }

  // Every routing decision, from stripes.h.
  absl::Status Route() {
    const size_t n = s_.nodes.size();
    killed_.assign(n, false);
    missing_.assign(n, 0);
    out_.assign(n, SimNodeResult{});
    std::map<std::string, int> by_name;
    for (size_t i = 0; i < n; ++i) by_name[s_.nodes[i].name] = static_cast<int>(i);
    if (by_name.size() != n) return absl::InvalidArgumentError("node names must differ");
    routing_.resize(s_.pieces.size());
    pulls_.resize(s_.pieces.size());
    for (size_t p = 0; p < s_.pieces.size(); ++p) {
      const SimPiece& piece = s_.pieces[p];
      std::vector<std::string> names;
      for (int q : piece.pullers) names.push_back(s_.nodes[q].name);
      std::sort(names.begin(), names.end());
      names.erase(std::unique(names.begin(), names.end()), names.end());
      const std::string& origin = s_.nodes[piece.origin].name;
      PieceRouting& r = routing_[p];
      r.stripes = s_.relay ? StripeCount(names.size(), s_.fanout) : 1;
      const uint64_t salt = PieceSalt(origin, piece.buffer_id);
      const int chunks = ChunkCount(p);
      for (int c = 0; c < chunks; ++c) r.stripe_of.push_back(StripeOf(c, salt, r.stripes));
      r.slot_of.assign(n, -1);
      for (size_t i = 0; i < names.size(); ++i) r.slot_of[by_name[names[i]]] = static_cast<int>(i);
      r.children.assign(r.stripes, std::vector<std::vector<int>>(names.size()));
      r.below.assign(r.stripes, std::vector<std::vector<int>>(names.size()));
      pulls_[p].resize(names.size());
      for (size_t i = 0; i < names.size(); ++i) {
        const int self = by_name[names[i]];
        Pull& pull = pulls_[p][i];
        pull.state.assign(chunks, kMissing);
        pull.requested_from.assign(chunks, -1);
        pull.source.assign(r.stripes, piece.origin);
        missing_[self] += chunks;
        if (!s_.relay) continue;
        for (int st = 0; st < r.stripes; ++st) {
          const std::string parent = ParentFor(names, origin, names[i], st, r.stripes, s_.fanout);
          const int parent_index = by_name.at(parent);
          pull.source[st] = parent_index;
          if (parent_index != piece.origin) {
            r.children[st][r.slot_of[parent_index]].push_back(self);
          }
          const std::vector<std::string> path = PathTo(names, names[i], st, r.stripes, s_.fanout);
          for (size_t j = 0; j + 1 < path.size(); ++j) {
            r.below[st][r.slot_of[by_name.at(path[j])]].push_back(self);
          }
        }
      }
    }
    return absl::OkStatus();
  }

  int ChunkCount(size_t p) const {
    return static_cast<int>((s_.pieces[p].bytes + s_.chunk_bytes - 1) / s_.chunk_bytes);
  }
  uint64_t ChunkSize(int p, int c) const {
    const uint64_t start = static_cast<uint64_t>(c) * s_.chunk_bytes;
    return std::min(s_.chunk_bytes, s_.pieces[p].bytes - start);
  }
  double Latency(int a, int b) const { return s_.nodes[a].latency_s + s_.nodes[b].latency_s; }
  Pull& PullOf(int p, int node) { return pulls_[p][routing_[p].slot_of[node]]; }
  Link& LinkOf(int child, int parent) {
    return links_[static_cast<int64_t>(child) * static_cast<int64_t>(s_.nodes.size()) + parent];
  }

  void Push(double t, EventType type, int a, int b, int piece, int chunk) {
    queue_.push(Event{t, seq_++, type, a, b, piece, chunk});
  }

  // The origin holds every chunk at time 0 and its children know it.
  void SeedOrigins() {
    std::map<std::pair<int, int>, std::vector<ChunkRef>> seeds;  // (child, origin) -> chunks.
    for (size_t p = 0; p < s_.pieces.size(); ++p) {
      const PieceRouting& r = routing_[p];
      for (int node = 0; node < static_cast<int>(s_.nodes.size()); ++node) {
        if (r.slot_of[node] < 0) continue;
        const Pull& pull = PullOf(static_cast<int>(p), node);
        for (int c = 0; c < static_cast<int>(r.stripe_of.size()); ++c) {
          const int origin = s_.pieces[p].origin;
          if (pull.source[r.stripe_of[c]] == origin) {
            seeds[{node, origin}].push_back({static_cast<int>(p), c});
          }
        }
      }
    }
    for (auto& [key, refs] : seeds) {
      // Chunk k of every piece before chunk k+1 of any: pieces advance side by side.
      std::stable_sort(refs.begin(), refs.end(), [](const ChunkRef& x, const ChunkRef& y) {
        return x.chunk != y.chunk ? x.chunk < y.chunk : x.piece < y.piece;
      });
      Link& link = LinkOf(key.first, key.second);
      link.ready.assign(refs.begin(), refs.end());
      TryIssue(key.first, key.second);
    }
  }

  void TryIssue(int child, int parent) {
    if (killed_[child] || killed_[parent]) return;
    Link& link = LinkOf(child, parent);
    while (link.inflight < s_.inflight && !link.ready.empty()) {
      const ChunkRef ref = link.ready.front();
      link.ready.pop_front();
      Pull& pull = PullOf(ref.piece, child);
      if (pull.state[ref.chunk] != kMissing) continue;
      if (pull.source[routing_[ref.piece].stripe_of[ref.chunk]] != parent) continue;
      pull.state[ref.chunk] = kRequested;
      pull.requested_from[ref.chunk] = parent;
      ++link.inflight;
      Push(now_ + Latency(child, parent), EventType::kRequestArrive, child, parent, ref.piece,
           ref.chunk);
    }
  }

  Edge& EdgeOf(int sender, int receiver) {
    const int64_t key =
        static_cast<int64_t>(sender) * static_cast<int64_t>(s_.nodes.size()) + receiver;
    auto [it, inserted] = edge_index_.try_emplace(key, static_cast<int>(edges_.size()));
    if (inserted) {
      edges_.emplace_back();
      edges_.back().sender = sender;
      edges_.back().receiver = receiver;
    }
    return edges_[it->second];
  }

  void StartFlow(int sender, int receiver, int piece, int chunk) {
    Edge& edge = EdgeOf(sender, receiver);
    const uint64_t bytes = ChunkSize(piece, chunk);
    const double start = s_.pair_sharing == PairSharing::kFair
                             ? edge.served
                             : std::max(edge.served, edge.last_target);
    edge.last_target = start + static_cast<double>(bytes);
    flows_.push_back(Flow{piece, chunk, bytes, edge.last_target});
    edge.flows.push({flows_.back().target, static_cast<int>(flows_.size()) - 1});
    if (!edge.listed) {
      edge.listed = true;
      active_.push_back(static_cast<int>(&edge - edges_.data()));
    }
    rates_dirty_ = true;
  }

  void FinishFlow(Edge& edge) {
    const Flow& flow = flows_[edge.flows.top().second];
    edge.flows.pop();
    rates_dirty_ = true;
    Push(now_ + Latency(edge.sender, edge.receiver), EventType::kLand, edge.receiver, edge.sender,
         flow.piece, flow.chunk);
  }

  void OnLand(const Event& e) {
    const int node = e.a, sender = e.b;
    const uint64_t bytes = ChunkSize(e.piece, e.chunk);
    Link& link = LinkOf(node, sender);
    if (link.inflight > 0) --link.inflight;
    Pull& pull = PullOf(e.piece, node);
    if (killed_[node] || pull.state[e.chunk] == kHave) {
      out_[sender].bytes_aborted += bytes;
      return;
    }
    pull.state[e.chunk] = kHave;
    out_[sender].bytes_sent += bytes;
    ++out_[sender].chunks_sent;
    out_[node].bytes_received += bytes;
    ++transfers_;
    if (--missing_[node] == 0) out_[node].done_s = now_;
    const PieceRouting& r = routing_[e.piece];
    for (int child : r.children[r.stripe_of[e.chunk]][r.slot_of[node]]) {
      Push(now_ + Latency(node, child), EventType::kAnnounce, child, node, e.piece, e.chunk);
    }
    TryIssue(node, sender);
  }

  void OnAnnounce(const Event& e) {
    const int child = e.a, parent = e.b;
    if (killed_[child] || killed_[parent]) return;
    LinkOf(child, parent).ready.push_back({e.piece, e.chunk});
    TryIssue(child, parent);
  }

  void OnKill(const Event& e) {
    const int dead = e.a;
    if (killed_[dead]) return;
    killed_[dead] = true;
    out_[dead].killed = true;
    out_[dead].done_s = -1;
    for (int id : active_) {
      Edge& edge = edges_[id];
      if (edge.sender != dead && edge.receiver != dead) continue;
      while (!edge.flows.empty()) {
        const Flow& flow = flows_[edge.flows.top().second];
        const double left =
            std::clamp(flow.target - edge.served, 0.0, static_cast<double>(flow.bytes));
        out_[edge.sender].bytes_aborted += static_cast<uint64_t>(flow.bytes - left);
        edge.flows.pop();
      }
      edge.last_target = edge.served;
      rates_dirty_ = true;
    }
    for (size_t p = 0; p < s_.pieces.size(); ++p) {
      const PieceRouting& r = routing_[p];
      const int slot = r.slot_of[dead];
      if (slot < 0) continue;
      for (int st = 0; st < r.stripes; ++st) {
        const auto& notify =
            s_.failover == Failover::kChildren ? r.children[st][slot] : r.below[st][slot];
        for (int node : notify) {
          Push(now_ + s_.detect_delay_s, EventType::kDetect, node, dead, static_cast<int>(p), st);
        }
      }
    }
  }

  // `node` has noticed that `dead` is gone: it reads what it lacks of the stripe from the origin.
  void OnDetect(const Event& e) {
    const int node = e.a, dead = e.b, stripe = e.chunk;
    if (killed_[node]) return;
    const int origin = s_.pieces[e.piece].origin;
    Pull& pull = PullOf(e.piece, node);
    pull.source[stripe] = origin;
    Link& link = LinkOf(node, origin);
    const PieceRouting& r = routing_[e.piece];
    for (int c = 0; c < static_cast<int>(r.stripe_of.size()); ++c) {
      if (r.stripe_of[c] != stripe) continue;
      if (pull.state[c] == kRequested && pull.requested_from[c] == dead) pull.state[c] = kMissing;
      if (pull.state[c] == kMissing) link.ready.push_back({e.piece, c});
    }
    TryIssue(node, origin);
  }

  void OnRequestArrive(const Event& e) {
    if (killed_[e.a] || killed_[e.b]) return;
    StartFlow(e.b, e.a, e.piece, e.chunk);
  }

  // Weighted max-min fair rates by progressive filling over uplinks and downlinks.
  void Recompute() {
    rates_dirty_ = false;
    active_.erase(std::remove_if(active_.begin(), active_.end(),
                                 [this](int id) {
                                   if (!edges_[id].flows.empty()) return false;
                                   edges_[id].listed = false;
                                   edges_[id].rate = 0;
                                   return true;
                                 }),
                  active_.end());
    const size_t n = s_.nodes.size();
    cap_up_.assign(n, 0);
    cap_down_.assign(n, 0);
    w_up_.assign(n, 0);
    w_down_.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
      cap_up_[i] = s_.nodes[i].up_bytes_per_s;
      cap_down_[i] = s_.nodes[i].down_bytes_per_s;
    }
    std::vector<int> open = active_;
    for (int id : open) {
      const Edge& edge = edges_[id];
      w_up_[edge.sender] += Weight(edge);
      w_down_[edge.receiver] += Weight(edge);
    }
    std::vector<int> frozen, still_open;
    while (!open.empty()) {
      double level = kInfinity;
      for (int id : open) {
        const Edge& edge = edges_[id];
        level = std::min(
            {level, Share(cap_up_, w_up_, edge.sender), Share(cap_down_, w_down_, edge.receiver)});
      }
      const double limit = level * (1 + 1e-9);
      frozen.clear();
      still_open.clear();
      for (int id : open) {
        const Edge& edge = edges_[id];
        const bool bottleneck = Share(cap_up_, w_up_, edge.sender) <= limit ||
                                Share(cap_down_, w_down_, edge.receiver) <= limit;
        (bottleneck ? frozen : still_open).push_back(id);
      }
      for (int id : frozen) {
        Edge& edge = edges_[id];
        const double weight = Weight(edge);
        edge.rate = level;
        cap_up_[edge.sender] = std::max(0.0, cap_up_[edge.sender] - weight * level);
        cap_down_[edge.receiver] = std::max(0.0, cap_down_[edge.receiver] - weight * level);
        w_up_[edge.sender] -= weight;
        w_down_[edge.receiver] -= weight;
      }
      open.swap(still_open);
    }
  }

  double Weight(const Edge& edge) const {
    return s_.pair_sharing == PairSharing::kFair ? static_cast<double>(edge.flows.size()) : 1.0;
  }

  static double Share(const std::vector<double>& cap, const std::vector<double>& w, int i) {
    return w[i] > 0 ? cap[i] / w[i] : kInfinity;
  }

  void Loop() {
    while (true) {
      if (rates_dirty_) Recompute();
      double next_drain = kInfinity;
      int drain_edge = -1;
      for (int id : active_) {
        const Edge& edge = edges_[id];
        if (edge.flows.empty() || edge.rate <= 0) continue;
        const double t = now_ + (edge.flows.top().first - edge.served) / edge.rate;
        if (t < next_drain) {
          next_drain = t;
          drain_edge = id;
        }
      }
      const double next_event = queue_.empty() ? kInfinity : queue_.top().time;
      const double next = std::min(next_drain, next_event);
      if (next == kInfinity) return;
      const double dt = std::max(0.0, next - now_);
      for (int id : active_) edges_[id].served += edges_[id].rate * dt;
      now_ = std::max(now_, next);
      if (drain_edge >= 0 && next_drain <= next_event) {
        Edge& first = edges_[drain_edge];
        first.served = std::max(first.served, first.flows.top().first);
      }
      for (int id : active_) {
        Edge& edge = edges_[id];
        while (!edge.flows.empty() &&
               edge.flows.top().first - edge.served <= 1e-9 * edge.flows.top().first) {
          FinishFlow(edge);
        }
      }
      while (!queue_.empty() && queue_.top().time <= now_ + kSameInstant) {
        const Event e = queue_.top();
        queue_.pop();
        ++events_;
        switch (e.type) {
          case EventType::kAnnounce:
            OnAnnounce(e);
            break;
          case EventType::kRequestArrive:
            OnRequestArrive(e);
            break;
          case EventType::kLand:
            OnLand(e);
            break;
          case EventType::kKill:
            OnKill(e);
            break;
          case EventType::kDetect:
            OnDetect(e);
            break;
        }
      }
    }
  }

  const SimScenario& s_;
  std::vector<PieceRouting> routing_;
  std::vector<std::vector<Pull>> pulls_;  // [piece][slot]
  std::unordered_map<int64_t, Link> links_;
  std::unordered_map<int64_t, int> edge_index_;
  std::vector<Edge> edges_;
  std::vector<int> active_;  // Edges with transfers (or just emptied).
  std::vector<Flow> flows_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  std::vector<bool> killed_;
  std::vector<int64_t> missing_;  // Per node: chunks still to land.
  std::vector<SimNodeResult> out_;
  std::vector<double> cap_up_, cap_down_, w_up_, w_down_;
  double now_ = 0;
  uint64_t seq_ = 0;
  uint64_t transfers_ = 0;
  uint64_t events_ = 0;
  bool rates_dirty_ = false;
};

}  // namespace

absl::StatusOr<SimResult> Simulate(const SimScenario& scenario) {
  return Simulator(scenario).Run();
}

absl::StatusOr<SimScenario> MakeFleet(const FleetSpec& spec) {
  if (spec.trainers < 1 || spec.pieces_per_trainer < 1 || spec.engines < 1 || spec.replicas < 0 ||
      spec.model_bytes == 0 || !(spec.link_bytes_per_s > 0) || spec.latency_s < 0) {
    return absl::InvalidArgumentError("bad fleet");
  }
  if (spec.replicas > 0 && spec.engines % spec.replicas != 0) {
    return absl::InvalidArgumentError("engines must be a multiple of replicas");
  }
  SimScenario s;
  char name[32];
  for (int t = 0; t < spec.trainers; ++t) {
    std::snprintf(name, sizeof(name), "trainer-%02d", t);
    s.nodes.push_back({name, spec.link_bytes_per_s, spec.link_bytes_per_s, spec.latency_s / 2});
  }
  for (int e = 0; e < spec.engines; ++e) {
    std::snprintf(name, sizeof(name), "engine-%03d", e);
    s.nodes.push_back({name, spec.link_bytes_per_s, spec.link_bytes_per_s, spec.latency_s / 2});
  }
  const uint64_t count = static_cast<uint64_t>(spec.trainers) * spec.pieces_per_trainer;
  const int shard_nodes = spec.replicas > 0 ? spec.engines / spec.replicas : 0;
  for (uint64_t g = 0; g < count; ++g) {
    SimPiece piece;
    piece.origin = static_cast<int>(g / spec.pieces_per_trainer);
    piece.buffer_id = absl::StrCat("rank-", g);
    piece.bytes = spec.model_bytes / count + (g < spec.model_bytes % count ? 1 : 0);
    if (piece.bytes == 0) return absl::InvalidArgumentError("more pieces than bytes");
    for (int e = 0; e < spec.engines; ++e) {
      if (shard_nodes == 0 || e % shard_nodes == static_cast<int>(g % shard_nodes)) {
        piece.pullers.push_back(spec.trainers + e);
      }
    }
    s.pieces.push_back(std::move(piece));
  }
  return s;
}

int BusiestRelay(const SimScenario& scenario) {
  if (!scenario.relay || scenario.pieces.empty()) return -1;
  const SimPiece& piece = scenario.pieces[0];
  if (piece.pullers.size() < 2) return -1;
  std::vector<std::string> names;
  for (int q : piece.pullers) names.push_back(scenario.nodes[q].name);
  std::sort(names.begin(), names.end());
  const std::string& origin = scenario.nodes[piece.origin].name;
  const int stripes = StripeCount(names.size(), scenario.fanout);
  for (int q : piece.pullers) {
    if (ParentFor(names, origin, scenario.nodes[q].name, 0, stripes, scenario.fanout) == origin) {
      return q;
    }
  }
  return -1;
}

}  // namespace refit::fleet
