#include "daemon/rl/timeline_service.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>

#include "daemon/common/logging.h"

namespace refit::rl {

v1::NodeTimeline ToProto(const std::string& node, const std::vector<VersionRecord>& records) {
  v1::NodeTimeline out;
  out.set_node(node);
  for (const VersionRecord& record : records) {
    v1::VersionTimeline* version = out.add_versions();
    version->set_version(record.version);
    for (const StageRecord& s : record.stages) {
      v1::TimelineStage* stage = version->add_stages();
      stage->set_stage(s.stage);
      stage->set_start_us(s.start_us);
      stage->set_end_us(s.end_us);
      stage->set_detail(s.detail);
    }
  }
  return out;
}

void ToProto(const Labels& labels, google::protobuf::Map<std::string, std::string>* out) {
  for (const auto& [key, value] : labels) (*out)[key] = value;
}

Labels FromProto(const google::protobuf::Map<std::string, std::string>& labels) {
  return Labels(labels.begin(), labels.end());
}

grpc::Status TimelineService::Timeline(grpc::ServerContext*, const v1::PeerTimelineRequest* request,
                                       v1::PeerTimelineResponse* response) {
  if (request->model().empty() || request->model().size() > 1024) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "model name is 1 to 1024 bytes");
  }
  *response->mutable_node() = ToProto(node_, timeline_->Get(request->model(), request->version()));
  if (neighbors_) {
    for (const std::string& address : neighbors_()) response->add_neighbors(address);
  }
  return grpc::Status::OK;
}

namespace {

// "ipv4:127.0.0.1:7070" (a caller's address as gRPC names it) -> "127.0.0.1:7070".
std::string Dialable(const std::string& address) {
  for (const char* prefix : {"ipv4:", "ipv6:"}) {
    if (address.rfind(prefix, 0) == 0) return address.substr(std::string(prefix).size());
  }
  return address;
}

}  // namespace

std::vector<v1::NodeTimeline> GatherTimelines(const GatherOptions& options,
                                              const std::string& model, uint64_t version,
                                              const std::vector<std::string>& start) {
  std::deque<std::string> queue;
  std::set<std::string> asked;
  for (const std::string& a : start) {
    if (!a.empty() && asked.insert(Dialable(a)).second) queue.push_back(Dialable(a));
  }
  std::map<std::string, v1::NodeTimeline> nodes;  // by node name
  std::vector<v1::NodeTimeline> failed;
  while (!queue.empty() && nodes.size() + failed.size() < kMaxGatherNodes) {
    const std::string address = queue.front();
    queue.pop_front();
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(16 << 20);
    auto channel = grpc::CreateCustomChannel(address, tls::ChannelCredentials(options.tls), args);
    auto stub = v1::PeerInsight::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + options.per_node);
    v1::PeerTimelineRequest request;
    request.set_model(model);
    request.set_version(version);
    v1::PeerTimelineResponse response;
    grpc::Status status = stub->Timeline(&context, request, &response);
    if (!status.ok()) {
      v1::NodeTimeline entry;
      entry.set_address(address);
      entry.set_error(status.error_message().empty() ? std::string("no answer")
                                                     : status.error_message().substr(0, 512));
      failed.push_back(std::move(entry));
      continue;
    }
    v1::NodeTimeline& node = *response.mutable_node();
    if (options.tls.enabled()) {
      // Its identity is its certificate: a daemon may not answer for another node.
      auto auth = context.auth_context();
      absl::Status identity = auth ? tls::CheckIdentity(*auth, node.node())
                                   : absl::PermissionDeniedError("no peer certificate");
      if (!identity.ok()) {
        v1::NodeTimeline entry;
        entry.set_address(address);
        entry.set_error(std::string(identity.message()).substr(0, 512));
        failed.push_back(std::move(entry));
        continue;
      }
    }
    if (node.node().empty() || node.node() == options.node || nodes.count(node.node())) continue;
    node.set_address(address);
    for (const std::string& n : response.neighbors()) {
      if (!n.empty() && asked.size() < 4 * kMaxGatherNodes && asked.insert(Dialable(n)).second) {
        queue.push_back(Dialable(n));
      }
    }
    const std::string name = node.node();
    nodes[name] = std::move(node);
  }
  std::vector<v1::NodeTimeline> out;
  for (auto& [name, node] : nodes) out.push_back(std::move(node));
  for (auto& entry : failed) out.push_back(std::move(entry));
  return out;
}

}  // namespace refit::rl
