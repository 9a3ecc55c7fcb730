// Python exceptions for tensorferry::Status values.
//
// Binding code throws StatusError for a non-OK Status; the translator registered by
// RegisterErrors turns it into the Python exception of the status's category:
//
//   kCorrupt, kCuda, kInternal  -> tensorferry.SafetensorError
//   kInvalidArgument            -> tensorferry.InvalidArgumentError (SafetensorError, ValueError)
//   kUnsupported                -> tensorferry.UnsupportedError (SafetensorError,
//                                  NotImplementedError)
//   kBudget                     -> tensorferry.BudgetExceededError (SafetensorError)
//   kNotFound                   -> a FileNotFoundError (errno ENOENT) that is a SafetensorError
//   kIo                         -> an OSError that is a SafetensorError: the OSError subclass
//                                  Python gives the errno the message reports (IsADirectoryError,
//                                  PermissionError, ...; EIO when it names none)
//
// File-system errors are instances of both the builtin OSError subclass and SafetensorError
// (classes tensorferry._core.<builtin name>, see OsError), so that `except FileNotFoundError` and
// `except SafetensorError` both catch them. Every raised exception carries `code` (e.g.
// "duplicate_key") and `category` (e.g. "corrupt") attributes; str(exception) is the status
// message (file, tensor, offset and values at fault; bytes that are not UTF-8, as in a file name,
// are shown as \xNN escapes).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <exception>
#include <limits>
#include <string>
#include <utility>

#include "tensorferry/status.h"

namespace tensorferry::python {

class StatusError : public std::exception {
 public:
  explicit StatusError(Status status) : status_(std::move(status)), what_(status_.ToString()) {}
  const char* what() const noexcept override { return what_.c_str(); }
  const Status& status() const noexcept { return status_; }

 private:
  Status status_;
  std::string what_;
};

inline void Check(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T Unwrap(Result<T>&& result) {
  if (!result.ok()) throw StatusError(result.status());
  return std::move(result).value();
}

// Python values to C++ at the edges, with errors that name the argument: `what` must be text
// encodable as UTF-8 (a lone surrogate is refused), an int (not a bool) in [0, max of T].
// Errors: InvalidArgumentError.
std::string ToText(nanobind::handle value, const std::string& what);
uint64_t ToUnsigned(nanobind::handle value, const std::string& what, uint64_t max);
// A file name or URL as the bytes the system call takes: a str (os.fsencode's bytes when it is
// not UTF-8, e.g. a name decoded with surrogateescape), bytes, or an os.PathLike of either.
// Errors: InvalidArgumentError naming `what`.
std::string ToPath(nanobind::handle value, const std::string& what);
// A path from the C++ side as Python names it: a str, decoded as os.fsdecode does (bytes that
// are not UTF-8 become surrogate escapes, so that the str opens the same file again).
nanobind::object FromPath(const std::string& path);
template <typename T>
T ToUnsigned(nanobind::handle value, const std::string& what) {
  return static_cast<T>(ToUnsigned(value, what, std::numeric_limits<T>::max()));
}

// Creates the exception classes as attributes of `m` and registers the translator.
void RegisterErrors(nanobind::module_& m);

// The tensorferry.SafetensorError class (valid after RegisterErrors).
nanobind::handle SafetensorErrorType();

// A new exception for the system error `err`: an instance of the OSError subclass Python gives
// `err` (OSError(err, ...) decides) and of SafetensorError, with errno, strerror = `message` and
// filename = `filename` (unless None), as OSError(err, message[, filename]) sets them.
nanobind::object OsError(int err, nanobind::handle message, nanobind::handle filename);

// Raises the reference's SafetensorError "File does not contain tensor <name>" (code and category
// "not_found") for a name the checkpoint does not hold.
[[noreturn]] void RaiseMissingTensor(const std::string& name);

}  // namespace tensorferry::python
