#pragma once

// Early-return helpers for absl::Status / absl::StatusOr, as used throughout the daemon.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define REFIT_CONCAT_INNER(a, b) a##b
#define REFIT_CONCAT(a, b) REFIT_CONCAT_INNER(a, b)

// Returns from the current function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    ::absl::Status _refit_status = (expr);         \
    if (!_refit_status.ok()) return _refit_status; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, Foo());` assigns the value of a StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(REFIT_CONCAT(_refit_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
