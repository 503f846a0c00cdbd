#pragma once

// The metrics the local API counts (docs/api.md).

#include "daemon/metrics/metrics.h"

namespace refit::server {

// One series per status code, e.g. refit_request_errors_total{code="NOT_FOUND"}.
inline constexpr Counter kRequestErrors{"refit_request_errors_total",
                                        "Failed calls on the local API, by status code."};
inline constexpr Counter kOwnerExitReleases{
    "refit_owner_exit_releases_total",
    "Buffers released because the process that registered them exited (or stopped renewing "
    "its lease)."};

}  // namespace refit::server
