// Internal helpers for propagating Status and Result values.
#pragma once

#include "tensorferry/status.h"

#define TF_CONCAT_INNER(a, b) a##b
#define TF_CONCAT(a, b) TF_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when `expr` (a Status) is not OK.
#define TF_RETURN_IF_ERROR(expr)               \
  do {                                         \
    ::tensorferry::Status tf_status_ = (expr); \
    if (!tf_status_.ok()) return tf_status_;   \
  } while (0)

// `lhs = value of expr` (a Result<T>), or returns its status.
#define TF_ASSIGN_OR_RETURN(lhs, expr) \
  TF_ASSIGN_OR_RETURN_IMPL(TF_CONCAT(tf_result_, __LINE__), lhs, expr)
#define TF_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
