#include "daemon/common/names.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace refit {

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string NearestName(const std::string& name, const std::vector<std::string>& known) {
  std::string best;
  size_t best_distance = SIZE_MAX;
  for (const std::string& candidate : known) {
    if (candidate == name) continue;
    const size_t d = EditDistance(name, candidate);
    const size_t limit = std::max<size_t>(1, std::max(name.size(), candidate.size()) / 3);
    if (d <= limit && d < best_distance) {
      best = candidate;
      best_distance = d;
    }
  }
  return best;
}

std::string KnownModelsHint(const std::string& name, const std::vector<std::string>& known) {
  std::vector<std::string> others;
  for (const std::string& k : known) {
    if (k != name) others.push_back(k);
  }
  if (others.empty()) return " (this node knows no other model)";
  constexpr size_t kListed = 10;
  std::string list =
      absl::StrJoin(others.begin(), others.begin() + std::min(kListed, others.size()), ", ");
  if (others.size() > kListed) absl::StrAppend(&list, ", … ", others.size() - kListed, " more");
  const std::string nearest = NearestName(name, others);
  return absl::StrCat(" (known models: ", list,
                      nearest.empty() ? "" : absl::StrCat("; did you mean '", nearest, "'?"), ")");
}

}  // namespace refit
