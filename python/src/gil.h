// Releasing the GIL around C++ work, checked.
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <cstdint>

namespace tensorferry::python {

// Counts of WithoutGil sections entered, and of those entered with the GIL still held (a bug);
// tensorferry._core.gil_checks() returns both so tests can prove every load releases it.
inline std::atomic<int64_t> g_gil_sections{0};
inline std::atomic<int64_t> g_gil_held_sections{0};

// Releases the GIL for its scope (every call that reads or writes file bytes, or waits, runs in
// one) and records whether it really is released.
class WithoutGil {
 public:
  WithoutGil() {
    g_gil_sections.fetch_add(1, std::memory_order_relaxed);
    if (PyGILState_Check() != 0) g_gil_held_sections.fetch_add(1, std::memory_order_relaxed);
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  nanobind::gil_scoped_release release_;  // constructed before the checks above run
};

}  // namespace tensorferry::python
