#include "errors.h"

#include <array>
#include <cerrno>

namespace nb = nanobind;

namespace tensorferry::python {
namespace {

PyObject* g_safetensor_error = nullptr;
PyObject* g_invalid_argument_error = nullptr;
PyObject* g_unsupported_error = nullptr;
PyObject* g_budget_error = nullptr;
PyObject* g_cuda_error = nullptr;
PyObject* g_cuda_not_found_error = nullptr;

// The OSError subclasses OSError(errno, ...) picks among (PEP 3151), each paired with the class
// that is both it and SafetensorError (created by RegisterErrors).
struct OsErrorClass {
  PyObject* builtin;
  PyObject* combined;
};
std::array<OsErrorClass, 16> g_os_errors{{
    {PyExc_OSError, nullptr},
    {PyExc_BlockingIOError, nullptr},
    {PyExc_ChildProcessError, nullptr},
    {PyExc_ConnectionError, nullptr},
    {PyExc_BrokenPipeError, nullptr},
    {PyExc_ConnectionAbortedError, nullptr},
    {PyExc_ConnectionRefusedError, nullptr},
    {PyExc_ConnectionResetError, nullptr},
    {PyExc_FileExistsError, nullptr},
    {PyExc_FileNotFoundError, nullptr},
    {PyExc_InterruptedError, nullptr},
    {PyExc_IsADirectoryError, nullptr},
    {PyExc_NotADirectoryError, nullptr},
    {PyExc_PermissionError, nullptr},
    {PyExc_ProcessLookupError, nullptr},
    {PyExc_TimeoutError, nullptr},
}};

PyObject* NewClass(nb::module_& m, const char* name, const char* doc, PyObject* bases) {
  const std::string qualified = std::string("tensorferry.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (cls == nullptr) throw nb::python_error();
  m.attr(name) = nb::handle(cls);
  return cls;
}

// The errno an I/O error's message reports (ErrnoText writes "<text> (errno N)"; the last one
// counts), so that OSError.errno is the system's (EMFILE, EISDIR, ...); EIO when it names none.
int OsErrno(const std::string& message) {
  const size_t at = message.rfind("(errno ");
  if (at == std::string::npos) return EIO;
  int value = 0;
  size_t i = at + 7;
  for (; i < message.size() && message[i] >= '0' && message[i] <= '9' && value < 100000; ++i) {
    value = value * 10 + (message[i] - '0');
  }
  return i < message.size() && message[i] == ')' && value > 0 ? value : EIO;
}

// The message as a str: UTF-8, with \xNN for bytes that are not (a file name's).
nb::object MessageText(const std::string& message) {
  return nb::steal(PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()),
                                        "backslashreplace"));
}

// Builds the exception instance for `status` and sets it as the current Python error.
void SetError(const Status& status) {
  const std::string& message = status.message();
  const nb::object text = MessageText(message);
  if (!text.is_valid()) return;  // its error stands
  PyObject* cls = g_safetensor_error;
  nb::object exc;
  switch (status.category()) {
    case Category::kNotFound:
    case Category::kIo: {
      const int err = status.category() == Category::kNotFound ? ENOENT
                      : status.code() == Code::kAccessDenied   ? EACCES  // PermissionError
                                                               : OsErrno(message);
      try {
        exc = OsError(err, text, nb::none());
      } catch (nb::python_error& e) {
        e.restore();
        return;
      }
      break;
    }
    case Category::kInvalidArgument: cls = g_invalid_argument_error; break;
    case Category::kUnsupported:
      cls = status.code() == Code::kCudaNotFound || status.code() == Code::kCudaSymbolMissing ||
                    status.code() == Code::kCudaNoDevice || status.code() == Code::kGdsUnavailable
                ? g_cuda_not_found_error
                : g_unsupported_error;
      break;
    case Category::kBudget: cls = g_budget_error; break;
    case Category::kCuda: cls = g_cuda_error; break;
    default: break;
  }
  if (!exc.is_valid()) {
    if (PyErr_Occurred() != nullptr) return;
    exc = nb::steal(PyObject_CallOneArg(cls, text.ptr()));
  }
  if (!exc.is_valid()) return;  // the constructor failed: its error stands
  const std::string_view code = CodeName(status.code());
  const std::string_view category = CategoryName(status.category());
  PyObject_SetAttrString(exc.ptr(), "code", nb::str(code.data(), code.size()).ptr());
  PyObject_SetAttrString(exc.ptr(), "category", nb::str(category.data(), category.size()).ptr());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

}  // namespace

void RegisterErrors(nb::module_& m) {
  g_safetensor_error = NewClass(
      m, "SafetensorError",
      "A file or checkpoint breaks the safetensors format (or another tensorferry error).\n\n"
      "Attributes: code (e.g. 'duplicate_key'), category (e.g. 'corrupt').",
      PyExc_Exception);
  nb::object invalid_bases =
      nb::make_tuple(nb::handle(g_safetensor_error), nb::handle(PyExc_ValueError));
  g_invalid_argument_error = NewClass(m, "InvalidArgumentError",
                                      "An argument tensorferry cannot use.", invalid_bases.ptr());
  nb::object unsupported_bases =
      nb::make_tuple(nb::handle(g_safetensor_error), nb::handle(PyExc_NotImplementedError));
  g_unsupported_error =
      NewClass(m, "UnsupportedError", "Valid, but this build or machine cannot do it.",
               unsupported_bases.ptr());
  g_budget_error =
      NewClass(m, "BudgetExceededError", "The request does not fit the configured memory budget.",
               g_safetensor_error);

  nb::object cuda_bases =
      nb::make_tuple(nb::handle(g_safetensor_error), nb::handle(PyExc_RuntimeError));
  g_cuda_error =
      NewClass(m, "CudaError", "The CUDA runtime or cuFile failed (e.g. out of device memory).",
               cuda_bases.ptr());
  // File-system errors: each OSError subclass, made a SafetensorError too. The names stay the
  // builtins' (type(e).__name__ == "FileNotFoundError"); they live in tensorferry._core, which
  // is where pickle finds them.
  for (OsErrorClass& c : g_os_errors) {
    const char* name = reinterpret_cast<PyTypeObject*>(c.builtin)->tp_name;
    const std::string qualified = std::string("tensorferry._core.") + name;
    nb::object bases = nb::make_tuple(nb::handle(g_safetensor_error), nb::handle(c.builtin));
    c.combined = PyErr_NewExceptionWithDoc(
        qualified.c_str(),
        "A file-system error: the builtin OSError subclass of its errno, and a SafetensorError.",
        bases.ptr(), nullptr);
    if (c.combined == nullptr) throw nb::python_error();
    m.attr(name) = nb::handle(c.combined);
  }
  m.def(
      "os_error",
      [](int err, nb::str message, nb::object filename) { return OsError(err, message, filename); },
      nb::arg("errno"), nb::arg("message"), nb::arg("filename").none() = nb::none(),
      "The exception OSError(errno, message[, filename]) would be, as a SafetensorError too.");

  // UnsupportedError is a NotImplementedError, hence a RuntimeError too.
  g_cuda_not_found_error = NewClass(
      m, "CudaNotFoundError",
      "No usable CUDA here: the runtime library did not load (the message lists every candidate "
      "tried and why), it lacks a function, there is no such device, or GDS was forced on but "
      "is unusable.",
      g_unsupported_error);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      SetError(e.status());
    }
  });
}

nb::handle SafetensorErrorType() {
  return nb::handle(g_safetensor_error);
}

nb::object OsError(int err, nb::handle message, nb::handle filename) {
  // OSError(err, message) is the builtin subclass Python gives err; its class picks ours.
  nb::object plain = nb::steal(PyObject_CallFunction(PyExc_OSError, "iO", err, message.ptr()));
  if (!plain.is_valid()) throw nb::python_error();
  PyObject* cls = g_os_errors[0].combined;
  for (const OsErrorClass& c : g_os_errors) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(plain.ptr())) == c.builtin) cls = c.combined;
  }
  nb::object exc =
      filename.is_none()
          ? nb::steal(PyObject_CallFunction(cls, "iO", err, message.ptr()))
          : nb::steal(PyObject_CallFunction(cls, "iOO", err, message.ptr(), filename.ptr()));
  if (!exc.is_valid()) throw nb::python_error();
  return exc;
}

void RaiseMissingTensor(const std::string& name) {
  nb::object exc = SafetensorErrorType()(nb::str(("File does not contain tensor " + name).c_str()));
  exc.attr("code") = "not_found";
  exc.attr("category") = "not_found";
  PyErr_SetObject(SafetensorErrorType().ptr(), exc.ptr());
  throw nb::python_error();
}

namespace {

// str(x) of a Python object as UTF-8 (with replacement characters where it cannot be encoded).
std::string Utf8Of(nb::handle text) {
  if (!text.is_valid()) {
    PyErr_Clear();
    return "?";
  }
  nb::object bytes = nb::steal(PyUnicode_AsEncodedString(text.ptr(), "utf-8", "backslashreplace"));
  if (!bytes.is_valid()) {
    PyErr_Clear();
    return "?";
  }
  return std::string(PyBytes_AsString(bytes.ptr()), static_cast<size_t>(PyBytes_Size(bytes.ptr())));
}

std::string Repr(nb::handle value) {
  return Utf8Of(nb::steal(PyObject_Repr(value.ptr())));
}
std::string TypeName(nb::handle value) {
  return Utf8Of(nb::steal(PyObject_GetAttrString(value.type().ptr(), "__name__")));
}

}  // namespace

std::string ToText(nb::handle value, const std::string& what) {
  if (!PyUnicode_Check(value.ptr())) {
    throw StatusError(
        Status(Code::kInvalidArgument, what + " must be a str, not " + TypeName(value)));
  }
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(value.ptr(), &size);
  if (utf8 == nullptr) {
    PyErr_Clear();
    throw StatusError(
        Status(Code::kInvalidArgument,
               what + " " + Repr(value) + " cannot be encoded as UTF-8 (a lone surrogate?)"));
  }
  return std::string(utf8, static_cast<size_t>(size));
}

std::string ToPath(nb::handle value, const std::string& what) {
  nb::object path = nb::steal(PyOS_FSPath(value.ptr()));
  if (!path.is_valid()) {
    PyErr_Clear();
    throw StatusError(
        Status(Code::kInvalidArgument,
               what + " must be a str, bytes or os.PathLike, not " + TypeName(value)));
  }
  nb::object bytes;
  if (PyUnicode_Check(path.ptr())) {
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(path.ptr(), &size);
    if (utf8 != nullptr) return std::string(utf8, static_cast<size_t>(size));
    PyErr_Clear();
    // Not UTF-8 (surrogate escapes of a name's undecodable bytes): the bytes os.fsencode gives.
    bytes = nb::steal(PyUnicode_EncodeFSDefault(path.ptr()));
    if (!bytes.is_valid()) {
      PyErr_Clear();
      throw StatusError(Status(Code::kInvalidArgument,
                               what + " " + Repr(value) + " cannot be encoded as a file name"));
    }
  } else {
    bytes = path;  // PyOS_FSPath returns a str or bytes
  }
  return std::string(PyBytes_AS_STRING(bytes.ptr()),
                     static_cast<size_t>(PyBytes_GET_SIZE(bytes.ptr())));
}

nb::object FromPath(const std::string& path) {
  nb::object out = nb::steal(
      PyUnicode_DecodeFSDefaultAndSize(path.data(), static_cast<Py_ssize_t>(path.size())));
  if (!out.is_valid()) throw nb::python_error();
  return out;
}

uint64_t ToUnsigned(nb::handle value, const std::string& what, uint64_t max) {
  if (!PyLong_Check(value.ptr()) || PyBool_Check(value.ptr())) {
    throw StatusError(
        Status(Code::kInvalidArgument, what + " must be an int, not " + TypeName(value)));
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(value.ptr());
  const bool failed = v == static_cast<unsigned long long>(-1) && PyErr_Occurred() != nullptr;
  if (failed) PyErr_Clear();
  if (failed || v > max) {
    throw StatusError(
        Status(Code::kInvalidArgument,
               what + " = " + Repr(value) + " is out of range [0, " + std::to_string(max) + "]"));
  }
  return v;
}

}  // namespace tensorferry::python
