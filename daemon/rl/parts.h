#pragma once

// The RL-semantics components one refitd keeps (daemon/rl), handed to the parts of the daemon
// that feed them; any may be null (in-process tests: not recorded).

namespace refit::rl {

class Timeline;
class VersionLabels;
class Staleness;

struct Parts {
  Timeline* timeline = nullptr;     // not owned
  VersionLabels* labels = nullptr;  // not owned
  Staleness* staleness = nullptr;   // not owned
};

}  // namespace refit::rl
