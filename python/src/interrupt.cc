#include "interrupt.h"

#include <Python.h>

namespace tensorferry::python {
namespace {
unsigned long g_main_thread = 0;  // threading.main_thread().ident, set at import
}  // namespace

void RememberMainThread() {
  nanobind::object main = nanobind::module_::import_("threading").attr("main_thread")();
  g_main_thread = nanobind::cast<unsigned long>(main.attr("ident"));
}

bool OnMainThread() {
  return PyThread_get_thread_ident() == g_main_thread;
}

}  // namespace tensorferry::python
