#include "errors.h"

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

// Builds the exception instance for `status` and sets it as the current Python error.
void SetError(const Status& status) {
  const std::string& message = status.message();
  PyObject* cls = g_safetensor_error;
  nb::object exc;
  switch (status.category()) {
    case Category::kNotFound:
      exc =
          nb::steal(PyObject_CallFunction(PyExc_FileNotFoundError, "is", ENOENT, message.c_str()));
      break;
    case Category::kIo:
      exc =
          nb::steal(PyObject_CallFunction(PyExc_OSError, "is", OsErrno(message), message.c_str()));
      break;
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
    exc = nb::steal(PyObject_CallFunction(cls, "s", message.c_str()));
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
