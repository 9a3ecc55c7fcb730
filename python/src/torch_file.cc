#include "torch_file.h"

#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "errors.h"
#include "gil.h"
#include "interrupt.h"
#include "tensorferry/convert.h"

namespace nb = nanobind;

namespace tensorferry::python {
namespace {

// Ctrl-C ends a read within one step.
constexpr uint64_t kReadStep = uint64_t{64} << 20;

// One opened checkpoint (a file, an index or a directory, as TorchCheckpoint::Open takes them).
// Thread-safety: as TorchCheckpoint's (reads are serialized inside); a read holds the checkpoint
// (shared ownership), so close() from another thread meanwhile frees it only after that read.
class TorchFile {
 public:
  explicit TorchFile(nb::handle path_object) : path_(ToPath(path_object, "path")) {
    Result<std::unique_ptr<TorchCheckpoint>> opened = Status(Code::kInternal, "not opened");
    {
      WithoutGil release;
      opened = TorchCheckpoint::Open(path_);
    }
    checkpoint_ = Unwrap(std::move(opened));
  }

  // [(name, torch dtype name, shape, byte size)] in the order the pickles hold them.
  nb::list Tensors() const {
    const std::shared_ptr<const TorchCheckpoint> held = Open();
    const TorchCheckpoint& c = *held;
    nb::list out;
    for (const TorchTensor& t : c.tensors()) {
      nb::list shape;
      for (uint64_t d : t.shape) shape.append(d);
      out.append(nb::make_tuple(t.name, t.torch_dtype, nb::tuple(shape), t.byte_size));
    }
    return out;
  }

  // Fills `out` (a writable C-contiguous buffer of exactly the tensor's byte size) with the
  // bytes of tensors[index], contiguous and little-endian, and checks its storage's CRC-32
  // (zip) before returning: bytes are handed out only once checked.
  void Read(size_t index, nb::handle out) {
    const std::shared_ptr<const TorchCheckpoint> held = Open();  // through a close() meanwhile
    const TorchCheckpoint& c = *held;
    if (index >= c.tensors().size()) {
      throw StatusError(
          Status(Code::kInvalidArgument, path_ + ": tensor index " + std::to_string(index) +
                                             " out of range (" +
                                             std::to_string(c.tensors().size()) + " tensors)"));
    }
    const TorchTensor& t = c.tensors()[index];
    Py_buffer view;
    if (PyObject_GetBuffer(out.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
      throw nb::python_error();
    }
    struct Release {
      Py_buffer* v;
      ~Release() { PyBuffer_Release(v); }
    } release_view{&view};
    if (static_cast<uint64_t>(view.len) != t.byte_size) {
      throw StatusError(
          Status(Code::kInvalidArgument, path_ + ": tensor \"" + t.name + "\" holds " +
                                             std::to_string(t.byte_size) + " bytes; the buffer " +
                                             std::to_string(view.len)));
    }
    const std::span<std::byte> dst(static_cast<std::byte*>(view.buf),
                                   static_cast<size_t>(view.len));
    std::atomic<bool> cancel{false};
    const Status read = Interruptible(cancel, [&]() -> Status {
      for (uint64_t done = 0; done < dst.size();) {
        if (cancel.load(std::memory_order_relaxed)) return Status(Code::kCancelled, "cancelled");
        const uint64_t n = std::min<uint64_t>(kReadStep, dst.size() - done);
        if (Status s = c.ReadTensor(index, done, dst.subspan(done, n)); !s.ok()) return s;
        done += n;
      }
      return c.CheckTensorRead(index, &cancel);
    });
    if (!read.ok()) {
      throw StatusError(
          Status(read.code(), read.message() + " (reading tensor \"" + t.name + "\")"));
    }
  }

  void Close() { checkpoint_.reset(); }

 private:
  std::shared_ptr<const TorchCheckpoint> Open() const {
    if (!checkpoint_) throw nb::value_error(("TorchFile of " + path_ + " is closed").c_str());
    return checkpoint_;
  }

  std::string path_;
  std::shared_ptr<const TorchCheckpoint> checkpoint_;  // (Python calls hold the GIL to swap it)
};

}  // namespace

void RegisterTorchFile(nb::module_& m) {
  nb::class_<TorchFile>(m, "TorchFile")
      .def(nb::init<nb::handle>(), nb::arg("path"))
      .def_prop_ro("tensors", &TorchFile::Tensors)
      .def("read", &TorchFile::Read, nb::arg("index"), nb::arg("out"))
      .def("close", &TorchFile::Close);
}

}  // namespace tensorferry::python
