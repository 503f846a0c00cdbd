#include "daemon/peer/replica_reporter.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "daemon/common/logging.h"
#include "daemon/peer/peer_limits.h"

namespace refit::peer {
namespace {

using std::chrono::milliseconds;

// Replica reports: on every completion here, and at least this often (a heartbeat: a node
// silent for fleet::kReplicaTtl reads as gone).
constexpr auto kReportEvery = milliseconds(1000);
constexpr auto kReportDeadline = milliseconds(2000);

}  // namespace

ReplicaReporter::ReplicaReporter(ReplicaReporterOptions options, ModelCatalog* store,
                                 PeerLinks* links, RelayChannels* channels,
                                 fleet::ReplicaTable* replicas)
    : options_(std::move(options)),
      store_(store),
      links_(links),
      channels_(channels),
      replicas_(replicas),
      loop_(WorkerLoop::Options{"replica reports", kReportEvery, /*run_at_start=*/false}) {}

void ReplicaReporter::Start() {
  loop_.Start([this] { Report(); });
}

void ReplicaReporter::Stop() { loop_.Stop(); }

void ReplicaReporter::Report() {
  channels_->CloseIdle();
  v1::ReplicaReport report;
  report.set_node(options_.node);
  report.set_relay(options_.relay);
  report.set_site(options_.site);
  std::vector<fleet::ReplicaEntry> entries;
  for (const ModelInfo& model : store_->Models()) {
    if (model.destination_buffers == 0) continue;
    // Rollback: whether every destination here holds the version the model is held back to.
    const bool rolled_back =
        model.rollback_version != 0 &&
        std::all_of(model.buffers.begin(), model.buffers.end(), [&](const BufferInfo& b) {
          return b.role != Role::kDestination || b.applied_version == model.rollback_version;
        });
    entries.push_back({model.name, model.latest_version, model.rollback_version, rolled_back});
    v1::ReplicaReport::Model* m = report.add_models();
    m->set_model(model.name);
    m->set_latest_version(model.latest_version);
    m->set_rollback_version(model.rollback_version);
    m->set_rolled_back(rolled_back);
  }
  if (entries.empty() && !reported_) return;  // a trainer's node has nothing to say
  reported_ = !entries.empty();
  if (replicas_) {
    if (entries.empty()) {
      replicas_->Forget(options_.node);
    } else {
      (void)replicas_->Report(options_.node, options_.relay, entries, options_.site);
    }
  }
  // Shared, not borrowed: a peer's loop replaces its stub when it reconnects.
  for (const auto& [node, stub] : links_->AllConnected()) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineIn(kReportDeadline));
    v1::ReplicaReportResponse response;
    grpc::Status status = stub->Report(&context, report, &response);
    if (status.ok()) Learn(response);
    if (!status.ok() && status.error_code() != grpc::StatusCode::UNAVAILABLE) {
      Logger("peer")->debug("peer={} refused this node's replica report: {}", node,
                            status.error_message());
    }
  }
}

void ReplicaReporter::Learn(const v1::ReplicaReportResponse& response) {
  constexpr int kMaxModels = 10000;
  for (const v1::FleetMember& member : response.members()) {
    if (member.node().empty() || member.node().size() > 255 || member.node() == options_.node ||
        member.listen().empty() || member.listen().size() > 1024 ||
        member.models_size() > kMaxModels || member.site().size() > kMaxNodeName) {
      continue;
    }
    // A --peers node speaks for itself (its own reports, its own address).
    if (links_->Has(member.node())) continue;
    channels_->Know(member.node(), member.listen());
    if (!replicas_) continue;
    std::vector<fleet::ReplicaEntry> entries;
    for (const auto& m : member.models()) {
      if (!m.model().empty()) {
        entries.push_back({m.model(), m.latest_version(), m.rollback_version(), m.rolled_back()});
      }
    }
    // Merged: another origin's answer may name other models of the same node.
    (void)replicas_->Merge(member.node(), member.relay(), std::move(entries), member.site());
  }
}

}  // namespace refit::peer
