#pragma once

// DataPlaneOptions for tests. Test-only.

#include "daemon/dataplane/data_plane.h"

namespace refit::dataplane {

// 4 MiB gets, 16 in flight: the values the data plane's users' tests were written against.
// These are the tests' own; refitd's defaults live in DaemonOptions (daemon/options.h) alone,
// and DataPlaneOptionsFrom (daemon/component_options.h) carries them.
inline DataPlaneOptions TestDataPlaneOptions() {
  DataPlaneOptions options;
  options.chunk_bytes = uint64_t{4} << 20;
  options.inflight = 16;
  return options;
}

}  // namespace refit::dataplane
