#include "daemon/fleet/stripes.h"

#include <algorithm>

#include "daemon/common/xxh3.h"

namespace refit::fleet {
namespace {

// Position of `self` in stripe `stripe`'s rotated order, or -1.
long PositionOf(const std::vector<std::string>& pullers, const std::string& self, int stripe,
                int stripes) {
  const auto it = std::lower_bound(pullers.begin(), pullers.end(), self);
  if (it == pullers.end() || *it != self) return -1;
  const long k = static_cast<long>(pullers.size());
  const long index = it - pullers.begin();
  const long shift = (k + stripes - 1) / stripes * stripe;
  return ((index - shift) % k + k) % k;
}

const std::string& AtPosition(const std::vector<std::string>& pullers, long position, int stripe,
                              int stripes) {
  const long k = static_cast<long>(pullers.size());
  const long shift = (k + stripes - 1) / stripes * stripe;
  return pullers[static_cast<size_t>((position + shift) % k)];
}

}  // namespace

int StripeCount(size_t pullers, int fanout) {
  if (pullers == 0) return 1;
  return static_cast<int>(std::min<size_t>(pullers, static_cast<size_t>(std::max(1, fanout))));
}

int StripeOf(uint64_t chunk, uint64_t salt, int stripes) {
  if (stripes <= 1) return 0;
  return static_cast<int>((chunk + salt) % static_cast<uint64_t>(stripes));
}

uint64_t PieceSalt(const std::string& origin, const std::string& buffer_id) {
  const std::string key = origin + "/" + buffer_id;
  return XXH3_64bits(key.data(), key.size());
}

std::string ParentFor(const std::vector<std::string>& pullers, const std::string& origin,
                      const std::string& self, int stripe, int stripes, int fanout) {
  const long position = PositionOf(pullers, self, stripe, stripes);
  if (position <= 0) return origin;
  const long parent = (position - 1) / std::max(1, fanout);
  return AtPosition(pullers, parent, stripe, stripes);
}

std::vector<std::string> PathTo(const std::vector<std::string>& pullers, const std::string& self,
                                int stripe, int stripes, int fanout) {
  long position = PositionOf(pullers, self, stripe, stripes);
  if (position < 0) return {self};
  std::vector<std::string> path;
  while (true) {
    path.push_back(AtPosition(pullers, position, stripe, stripes));
    if (position == 0) break;
    position = (position - 1) / std::max(1, fanout);
  }
  std::reverse(path.begin(), path.end());
  return path;
}

const std::string& RootOf(const std::vector<std::string>& pullers, int stripe, int stripes) {
  return AtPosition(pullers, 0, stripe, stripes);
}

const std::string& SiteView::SiteOf(const std::string& origin) const {
  auto it = origin_sites.find(origin);
  return it == origin_sites.end() ? site : it->second;
}

bool SiteView::Across(const std::string& node) const {
  if (auto it = origin_sites.find(node); it != origin_sites.end()) return it->second != site;
  for (const auto& [other, nodes] : remote) {
    if (std::binary_search(nodes.begin(), nodes.end(), node)) return true;
  }
  return false;
}

std::string SourceOf(const SiteView& view, const std::string& origin, uint64_t chunk,
                     uint64_t salt) {
  const int stripes = StripeCount(view.local.size(), view.fanout);
  const int stripe = StripeOf(chunk, salt, stripes);
  std::string parent = ParentFor(view.local, origin, view.self, stripe, stripes, view.fanout);
  if (parent != origin) return parent;
  const std::string& site = view.SiteOf(origin);
  if (site == view.site) return parent;
  auto upstream = view.remote.find(site);
  if (upstream == view.remote.end() || upstream->second.empty()) return parent;
  const std::vector<std::string>& there = upstream->second;
  const int there_stripes = StripeCount(there.size(), view.fanout);
  return RootOf(there, StripeOf(chunk, salt, there_stripes), there_stripes);
}

}  // namespace refit::fleet
