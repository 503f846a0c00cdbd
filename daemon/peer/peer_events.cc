#include "daemon/peer/peer_events.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/convert/convert.h"
#include "daemon/peer/peer_limits.h"
#include "daemon/plan/plan.h"
#include "daemon/rl/labels.h"
#include "daemon/rl/staleness.h"
#include "daemon/rl/timeline.h"

namespace refit::peer {

namespace {
constexpr uint64_t kMaxPieceBytes = uint64_t{1} << 44;  // 16 TiB: no GPU rank's buffer
}  // namespace

absl::Status PeerLayouts(const v1::PeerEvent& event, std::vector<SourceLayout>* layouts) {
  std::set<std::string> ids;
  for (const v1::SourcePiece& source : event.sources()) {
    if (!ids.insert(source.buffer_id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", source.buffer_id(), " is described twice"));
    }
    if (source.bytes() > kMaxPieceBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", source.buffer_id(), " claims ", source.bytes(), " bytes"));
    }
    ASSIGN_OR_RETURN(std::vector<TensorSlice> slices, convert::FromProto(source.tensors()));
    if (slices.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", source.buffer_id(), " has no tensors"));
    }
    absl::Status valid = plan::NormalizeAndValidateBuffer(slices, source.bytes());
    if (!valid.ok()) {
      return absl::Status(valid.code(), absl::StrCat("piece ", source.buffer_id(), " of ",
                                                     source.bytes(), " bytes: ", valid.message()));
    }
    layouts->push_back({source.buffer_id(),
                        std::make_shared<std::vector<TensorSlice>>(std::move(slices)),
                        source.bytes()});
  }
  return absl::OkStatus();
}

absl::Status PeerDeltas(const v1::PeerEvent& event, std::vector<RemoteDeltaRef>* deltas,
                        int* dropped) {
  *dropped = 0;
  if (event.deltas_size() > kMaxDeltasPerEvent) {
    return absl::InvalidArgumentError(absl::StrCat("version ", event.version(), " comes with ",
                                                   event.deltas_size(), " deltas (at most ",
                                                   kMaxDeltasPerEvent, ")"));
  }
  deltas->reserve(event.deltas_size());
  for (const v1::DeltaPiece& d : event.deltas()) {
    if (d.base_version() >= d.version() || d.version() > event.version() ||
        d.bytes() > kMaxPieceBytes) {
      ++*dropped;
      continue;
    }
    deltas->push_back({d.buffer_id(), d.base_version(), d.version(), d.remote_key(), d.bytes()});
  }
  return absl::OkStatus();
}

absl::Status PeerEvents::Apply(const std::string& node, const v1::PeerEvent& event) {
  if (absl::Status name = CheckModelName(event.model()); !name.ok()) {
    // No model here can have that name: the event is about nothing this node knows.
    Logger("peer")->debug("peer={} model={}: event ignored: {}", Printable(node),
                          Printable(event.model()), name.ToString());
    return absl::OkStatus();
  }
  // Layouts come when they change; an event without them keeps the last ones.
  if (!event.sources_unchanged()) {
    std::vector<SourceLayout> layouts;
    absl::Status valid = PeerLayouts(event, &layouts);
    if (!valid.ok()) {
      // Planned from, it could have this node copy outside a slot; taken as "no sources
      // there", it could let a version complete without that node's shards.
      Logger("peer")->error("peer={} model={}: layout refused, disconnecting: {}", Printable(node),
                            Printable(event.model()), Printable(valid.ToString(), 512));
      return valid;
    }
    store_->SetRemoteSources(node, event.model(), std::move(layouts));
    store_->ReserveStaging(event.model());
  }
  if (event.version() > 0) {
    std::vector<RemotePieceRef> pieces;
    for (const auto& p : event.pieces()) {
      pieces.push_back({p.buffer_id(), p.remote_key(), p.bytes()});
    }
    std::vector<RemoteDeltaRef> deltas;
    int dropped = 0;
    if (absl::Status valid = PeerDeltas(event, &deltas, &dropped); !valid.ok()) {
      Logger("peer")->error("peer={} model={}: version {} refused, disconnecting: {}",
                            Printable(node), Printable(event.model()), event.version(),
                            Printable(valid.ToString(), 512));
      return valid;
    }
    if (dropped > 0) {
      Logger("peer")->warn(
          "peer={} model={} version={}: {} of its deltas lead nowhere (not forward to this "
          "version, or of impossible sizes): dropped",
          Printable(node), Printable(event.model()), event.version(), dropped);
    }
    NoteAnnounced(node, event);
    store_->AnnounceRemoteVersion(node, event.model(), event.version(), std::move(pieces),
                                  std::move(deltas), event.run(), event.trainer_run());
  }
  // Rollback / Resume asked there (or forwarded to it): followed here on each change.
  store_->FollowHold(node, event.model(), event.rollback_version());
  return absl::OkStatus();
}

void PeerEvents::Forget(const std::string& node) {
  store_->ForgetRemoteVersions(node);
  if (replicas_) replicas_->Forget(node);
}

void PeerEvents::NoteAnnounced(const std::string& node, const v1::PeerEvent& event) {
  if (rl_.labels && !event.labels().empty()) {
    rl::Labels labels(event.labels().begin(), event.labels().end());
    // The sender checked them at Publish; a peer's oversized labels are not kept.
    if (rl::CheckLabels(labels).ok()) {
      rl_.labels->Set(event.model(), event.version(), std::move(labels));
    }
  }
  if (rl_.staleness) {
    rl_.staleness->NotePublished(event.model(), event.version(), event.max_staleness());
  }
  if (rl_.timeline) {
    rl_.timeline->Mark(event.model(), event.version(), rl::kStageAnnounced,
                       absl::StrCat("by ", node));
  }
}

}  // namespace refit::peer
