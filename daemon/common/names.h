#pragma once

// Telling a user which name they probably meant: the models a node knows, and the one nearest
// to a misspelled name. Used by the daemon's messages (WaitForVersion past its deadline) and by
// refitctl (a model it does not know).
//
// Thread-safety: pure functions.

#include <string>
#include <vector>

namespace refit {

// Levenshtein distance (insertions, deletions, substitutions, one byte each).
size_t EditDistance(const std::string& a, const std::string& b);

// The name in `known` nearest to `name`, if it is close enough to be a plausible typo (at most
// a third of the longer name's bytes differ, and at least one); empty otherwise.
std::string NearestName(const std::string& name, const std::vector<std::string>& known);

// " (known models: a, b; did you mean 'a'?)", " (this node knows no models)", etc.: what a
// message about the unknown `name` appends.
std::string KnownModelsHint(const std::string& name, const std::vector<std::string>& known);

}  // namespace refit
