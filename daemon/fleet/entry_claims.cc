#include "daemon/fleet/entry_claims.h"

#include <algorithm>

namespace refit::fleet {
namespace {

// Bytes in both of two sorted, disjoint range lists.
uint64_t Overlap(const Ranges& a, const Ranges& b) {
  uint64_t total = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const uint64_t begin = std::max(a[i].first, b[j].first);
    const uint64_t end = std::min(a[i].second, b[j].second);
    if (begin < end) total += end - begin;
    if (a[i].second < b[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return total;
}

void MergeInto(Ranges* into, const Ranges& more) {
  into->insert(into->end(), more.begin(), more.end());
  std::sort(into->begin(), into->end());
  Ranges merged;
  for (const auto& r : *into) {
    if (r.first >= r.second) continue;
    if (!merged.empty() && r.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  into->swap(merged);
}

}  // namespace

EntryClaims::Conflict EntryClaims::Claim(const RelayKey& key, const std::string& site,
                                         const std::string& node, const Ranges& wanted) {
  Conflict conflict;
  common::MutexLock lock(mu_);
  const Piece piece{key, site};
  auto it = claims_.find(piece);
  if (it == claims_.end()) {
    it = claims_.emplace(piece, std::map<std::string, Ranges>()).first;
    order_.push_back(piece);
    while (order_.size() > kPiecesKept) {
      claims_.erase(order_.front());
      order_.pop_front();
    }
  }
  for (const auto& [other, ranges] : it->second) {
    if (other == node) continue;
    const uint64_t both = Overlap(ranges, wanted);
    if (both > 0 && conflict.other.empty()) conflict = {other, both, false};
  }
  if (!conflict.other.empty()) {
    if (said_.size() >= kPiecesKept) said_.clear();
    conflict.first = said_.emplace(key.model, key.version, site).second;
  }
  MergeInto(&it->second[node], wanted);
  return conflict;
}

}  // namespace refit::fleet
