// Status propagation macros for code above kernels/. Debian 12's Abseil (20220623) ships no
// public RETURN_IF_ERROR / ASSIGN_OR_RETURN, so they are defined once here.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define WPUB_STATUS_CONCAT_INNER_(a, b) a##b
#define WPUB_STATUS_CONCAT_(a, b) WPUB_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function if not OK.
#define WPUB_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status wpub_status_ = (expr);        \
    if (!wpub_status_.ok()) return wpub_status_; \
  } while (0)

// `lhs` is a declaration or an lvalue; `rexpr` an absl::StatusOr<T>. On error returns the
// status, otherwise moves the value into `lhs`.
#define WPUB_ASSIGN_OR_RETURN(lhs, rexpr) \
  WPUB_ASSIGN_OR_RETURN_IMPL_(WPUB_STATUS_CONCAT_(wpub_statusor_, __LINE__), lhs, rexpr)

#define WPUB_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr)  \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()
