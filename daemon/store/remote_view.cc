#include "daemon/store/remote_view.h"

#include <algorithm>

namespace refit {

void RemoteView::SetSources(const std::string& model, const std::string& node,
                            std::vector<SourceLayout> sources) {
  common::MutexLock lock(mu_);
  models_[model][node].sources = std::move(sources);
}

bool RemoteView::Import(const std::string& model, const std::string& node, uint64_t version,
                        std::vector<SourceLayout> layouts,
                        std::vector<std::shared_ptr<Region>> slots) {
  common::MutexLock lock(mu_);
  RemoteNode& remote = models_[model][node];
  bool same_layout = remote.sources.size() == layouts.size();
  for (size_t i = 0; same_layout && i < layouts.size(); ++i) {
    same_layout = remote.sources[i].buffer_id == layouts[i].buffer_id &&
                  remote.sources[i].bytes == layouts[i].bytes;
  }
  remote.imported.clear();
  for (size_t i = 0; i < layouts.size() && i < slots.size(); ++i) {
    remote.imported[layouts[i].buffer_id] = std::move(slots[i]);
  }
  remote.sources = std::move(layouts);
  remote.pieces.clear();
  remote.deltas.clear();
  remote.announced = version;
  return same_layout;
}

uint64_t RemoteView::Announce(const std::string& model, const std::string& node, uint64_t version,
                              std::vector<RemotePieceRef> pieces,
                              std::vector<RemoteDeltaRef> deltas, const std::string& run,
                              const std::string& trainer_run) {
  common::MutexLock lock(mu_);
  RemoteNode& remote = models_[model][node];
  const uint64_t before = remote.announced;
  remote.trainer_run = trainer_run;
  remote.run = run;
  remote.announced = version;
  remote.pieces = std::move(pieces);
  remote.deltas = std::move(deltas);
  return before;
}

bool RemoteView::SetHold(const std::string& model, const std::string& node, uint64_t version) {
  common::MutexLock lock(mu_);
  auto m = models_.find(model);
  if (m == models_.end()) return false;
  auto remote = m->second.find(node);
  if (remote == m->second.end() || remote->second.hold == version) return false;
  remote->second.hold = version;
  return true;
}

void RemoteView::Forget(const std::string& node) {
  common::MutexLock lock(mu_);
  for (auto& [model, nodes] : models_) {
    auto it = nodes.find(node);
    if (it == nodes.end()) continue;
    it->second.announced = 0;
    it->second.pieces.clear();
    it->second.deltas.clear();
  }
}

void RemoteView::Erase(const std::string& model) {
  common::MutexLock lock(mu_);
  models_.erase(model);
}

RemoteView::Nodes RemoteView::Of(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  return it == models_.end() ? Nodes{} : it->second;
}

bool RemoteView::HasSources(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(),
                     [](const auto& node) { return !node.second.sources.empty(); });
}

std::vector<std::string> RemoteView::SourceNodes(const std::string& model) const {
  common::MutexLock lock(mu_);
  std::vector<std::string> out;
  auto it = models_.find(model);
  if (it == models_.end()) return out;
  for (const auto& [node, remote] : it->second) {
    if (!remote.sources.empty()) out.push_back(node);
  }
  return out;
}

std::string RemoteView::RunOf(const std::string& model, const std::string& node) const {
  common::MutexLock lock(mu_);
  auto m = models_.find(model);
  if (m == models_.end()) return "";
  auto remote = m->second.find(node);
  return remote == m->second.end() ? "" : remote->second.run;
}

uint64_t RemoteView::Agreed(const std::string& model, const std::string& run) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return 0;
  uint64_t agreed = 0;
  for (const auto& [node, remote] : it->second) {
    if (remote.sources.empty()) continue;
    if (remote.announced == 0) return 0;
    if (agreed != 0 && remote.announced != agreed) return 0;  // wait for the laggard
    // A node still on a run the model left: wait for it to announce the current run.
    if (!remote.trainer_run.empty() && remote.trainer_run != run) return 0;
    agreed = remote.announced;
  }
  return agreed;
}

std::vector<RemoteDeltaRef> RemoteView::DeltaChain(const std::string& model,
                                                   const std::string& node,
                                                   const std::string& buffer_id, uint64_t from,
                                                   uint64_t to) const {
  common::MutexLock lock(mu_);
  std::vector<RemoteDeltaRef> chain;
  auto m = models_.find(model);
  if (m == models_.end()) return chain;
  auto remote = m->second.find(node);
  if (remote == m->second.end()) return chain;
  uint64_t at = from;
  while (at < to) {
    const RemoteDeltaRef* next = nullptr;
    for (const RemoteDeltaRef& d : remote->second.deltas) {
      // Each step moves forward: a peer's delta from a version to itself (or back) would
      // otherwise chain forever here, under the store's lock.
      if (d.buffer_id == buffer_id && d.base_version == at && d.version > at && d.version <= to) {
        next = &d;
      }
    }
    if (!next) return {};  // more versions behind than the sender keeps deltas for
    chain.push_back(*next);
    at = next->version;
  }
  if (at != to) return {};
  return chain;
}

}  // namespace refit
