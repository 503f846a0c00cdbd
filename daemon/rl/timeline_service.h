#pragma once

// The timeline across nodes: refit.v1.PeerInsight.Timeline, served on --listen, answers with
// this node's timeline of a model (rl::Timeline) and the --listen addresses of the daemons it
// knows; GatherTimelines walks the fleet from a node's neighbours with it (breadth first, each
// node once, at most kMaxGatherNodes), for refit.v1.Refit.Timeline (refitctl timeline).
//
// Thread-safety: gRPC calls the handler concurrently; GatherTimelines is reentrant.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "daemon/rl/labels.h"
#include "daemon/rl/timeline.h"
#include "daemon/tls/peer_tls.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "proto/refit/v1/refit.pb.h"

namespace refit::rl {

inline constexpr size_t kMaxGatherNodes = 256;

// This node's records of `model` (`version`; 0: every version kept) as a NodeTimeline.
v1::NodeTimeline ToProto(const std::string& node, const std::vector<VersionRecord>& records);
// Labels into a protobuf map.
void ToProto(const Labels& labels, google::protobuf::Map<std::string, std::string>* out);
Labels FromProto(const google::protobuf::Map<std::string, std::string>& labels);

class TimelineService final : public v1::PeerInsight::Service {
 public:
  // `neighbors` lists the --listen addresses of the daemons this one knows (may be empty).
  TimelineService(std::string node, const rl::Timeline* timeline,
                  std::function<std::vector<std::string>()> neighbors)
      : node_(std::move(node)), timeline_(timeline), neighbors_(std::move(neighbors)) {}

  grpc::Status Timeline(grpc::ServerContext* context, const v1::PeerTimelineRequest* request,
                        v1::PeerTimelineResponse* response) override;

 private:
  const std::string node_;
  const rl::Timeline* const timeline_;
  const std::function<std::vector<std::string>()> neighbors_;
};

struct GatherOptions {
  std::string node;                          // this node: left out of what is gathered
  tls::PeerTlsFiles tls;                     // the peer plane's credentials (none: plaintext)
  std::chrono::milliseconds per_node{2000};  // each node's answer's deadline
};

// Every node reachable from `start` (--listen addresses), each once, this node left out,
// sorted by node name. A node that can't be asked is listed with `error` and its address.
std::vector<v1::NodeTimeline> GatherTimelines(const GatherOptions& options,
                                              const std::string& model, uint64_t version,
                                              const std::vector<std::string>& start);

}  // namespace refit::rl
