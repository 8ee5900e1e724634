// Early-return helpers for absl::Status / absl::StatusOr, used across every
// module boundary (the Abseil release in Debian does not ship its own).
#ifndef PDSERVE_COMMON_STATUS_MACROS_H_
#define PDSERVE_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PD_STATUS_CONCAT_INNER_(a, b) a##b
#define PD_STATUS_CONCAT_(a, b) PD_STATUS_CONCAT_INNER_(a, b)

// Returns from the calling function if `expr` (an absl::Status) is not OK.
#define PD_RETURN_IF_ERROR(expr)                 \
  do {                                           \
    ::absl::Status pd_status_ = (expr);          \
    if (!pd_status_.ok()) return pd_status_;     \
  } while (0)

// `lhs = value of expr`, or returns the error of the StatusOr `expr`.
#define PD_ASSIGN_OR_RETURN(lhs, expr) \
  PD_ASSIGN_OR_RETURN_IMPL_(PD_STATUS_CONCAT_(pd_statusor_, __LINE__), lhs, expr)
#define PD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

#endif  // PDSERVE_COMMON_STATUS_MACROS_H_
