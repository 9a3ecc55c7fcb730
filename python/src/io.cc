#include "io.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "errors.h"
#include "export.h"
#include "gil.h"
#include "tensorferry/format.h"
#include "tensorferry/mapping.h"
#include "tensorferry/writer.h"

namespace nb = nanobind;

namespace tensorferry::python {
namespace {

// Buffers (Py_buffer) held while their bytes are written; released on destruction.
class HeldBuffers {
 public:
  HeldBuffers() = default;
  HeldBuffers(const HeldBuffers&) = delete;
  HeldBuffers& operator=(const HeldBuffers&) = delete;
  ~HeldBuffers() {
    for (Py_buffer& v : views_) PyBuffer_Release(&v);
  }
  // The bytes of `object` (any object with the buffer protocol, C-contiguous).
  std::span<const std::byte> Hold(nb::handle object) {
    // Filled in place (an exporter may point its fields into the struct) and never moved.
    Py_buffer& view = views_.emplace_back();
    if (PyObject_GetBuffer(object.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
      views_.pop_back();
      throw nb::python_error();
    }
    return std::span<const std::byte>(static_cast<const std::byte*>(view.buf),
                                      static_cast<size_t>(view.len));
  }

 private:
  std::deque<Py_buffer> views_;
};

// entries: [(name, dtype name, shape, data, byte length)] where data is an address (an int:
// the caller keeps the memory alive and unchanged for the duration of the call) or an object
// with the buffer protocol (held by `held` meanwhile; its length must be the byte length).
std::vector<TensorToWrite> ToWrite(const nb::list& entries, HeldBuffers& held) {
  std::vector<TensorToWrite> out;
  out.reserve(entries.size());
  for (nb::handle h : entries) {
    nb::tuple e = nb::cast<nb::tuple>(h);
    if (e.size() != 5) throw nb::value_error("entries are (name, dtype, shape, data, length)");
    TensorToWrite t;
    t.name = ToText(e[0], "tensor name");
    const std::string dtype = ToText(e[1], "dtype");
    const std::optional<DType> d = DTypeFromName(dtype);
    if (!d) {
      throw StatusError(Status(Code::kInvalidArgument,
                               "tensor \"" + t.name + "\": unknown dtype \"" + dtype + "\""));
    }
    t.dtype = *d;
    t.shape = nb::cast<std::vector<uint64_t>>(e[2]);
    const auto length = nb::cast<size_t>(e[4]);
    if (nb::isinstance<nb::int_>(e[3])) {
      const auto address = nb::cast<uintptr_t>(e[3]);
      if (address == 0 && length != 0) {
        throw StatusError(Status(Code::kInvalidArgument, "tensor \"" + t.name +
                                                             "\": data_ptr is 0 (NULL) for " +
                                                             std::to_string(length) + " bytes"));
      }
      t.data = std::span<const std::byte>(reinterpret_cast<const std::byte*>(address), length);
    } else {
      t.data = held.Hold(e[3]);
      if (t.data.size() != length) {
        throw StatusError(
            Status(Code::kInvalidArgument, "tensor \"" + t.name + "\": its data holds " +
                                               std::to_string(t.data.size()) + " bytes, not " +
                                               std::to_string(length)));
      }
    }
    out.push_back(std::move(t));
  }
  return out;
}

Metadata ToMetadata(const std::optional<nb::dict>& metadata) {
  Metadata out;
  if (!metadata) return out;
  for (auto [k, v] : *metadata)
    out.emplace_back(ToText(k, "metadata key"), ToText(v, "metadata value"));
  return out;
}

nb::bytes Serialize(const nb::list& entries, const std::optional<nb::dict>& metadata) {
  HeldBuffers held;
  const std::vector<TensorToWrite> tensors = ToWrite(entries, held);
  const Metadata meta = ToMetadata(metadata);
  // metadata={} gives "__metadata__":{} (as the reference writes it); None gives none.
  const SerializedHeader header = Unwrap(SerializeHeader(tensors, meta, metadata.has_value()));
  const uint64_t total = 8 + header.json.size() + header.data_size;
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total));
  if (raw == nullptr) throw nb::python_error();
  nb::bytes out = nb::steal<nb::bytes>(raw);
  char* dst = PyBytes_AS_STRING(raw);
  {
    WithoutGil release;
    uint64_t n = header.json.size();
    for (int i = 0; i < 8; ++i) dst[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    std::memcpy(dst + 8, header.json.data(), header.json.size());
    char* p = dst + 8 + header.json.size();
    for (size_t i : header.order) {
      const auto& d = tensors[i].data;
      if (!d.empty()) std::memcpy(p, d.data(), d.size());
      p += d.size();
    }
  }
  Check(CheckMappedFiles());  // (as SerializeFile: views of a file that shrank read as zeros)
  return out;
}

void SerializeFile(const nb::list& entries, const std::optional<nb::dict>& metadata,
                   nb::handle path_object, bool checksums) {
  const std::string path = ToPath(path_object, "path");
  Check(CheckMappedFiles());  // the tensors to write may be views of a file that shrank
  HeldBuffers held;
  const std::vector<TensorToWrite> tensors = ToWrite(entries, held);
  const Metadata meta = ToMetadata(metadata);
  Status s;
  {
    WithoutGil release;
    WriteOptions options;
    options.checksums = checksums;  // per-tensor checksums in the metadata (docs/integrity.md)
    options.metadata_table = metadata.has_value();
    // Checked again once the bytes are written, before the file is put in place: a mapped file
    // that shrank while they were copied left zeros in them (which the checksums would vouch for).
    options.before_commit = [] { return CheckMappedFiles(); };
    s = WriteFile(path, tensors, meta, options);
  }
  Check(s);
}

// The tensors of a whole safetensors file held in `data` (any object with the buffer protocol),
// as (name, dtype name, shape, array) in name order. The data section is copied once into a block
// all tensors share.
nb::list Deserialize(nb::handle data, int framework) {
  const Framework fw = ToFramework(framework);
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
  struct Release {
    Py_buffer* v;
    ~Release() { PyBuffer_Release(v); }
  } release_view{&view};
  const auto* bytes = static_cast<const std::byte*>(view.buf);
  const auto size = static_cast<uint64_t>(view.len);
  Header header;
  std::shared_ptr<std::byte> block;
  {
    WithoutGil release;
    header = Unwrap(ParseHeader(std::span<const std::byte>(bytes, size), size, {}, "<bytes>"));
    block = AllocateBytes(header.data_size);
    if (header.data_size != 0) {
      std::memcpy(block.get(), bytes + header.data_offset(), header.data_size);
    }
  }
  auto keeper = std::make_shared<Keeper>(std::shared_ptr<const void>(block), header.data_size);
  std::vector<const TensorEntry*> entries;
  for (const TensorEntry& t : header.tensors) entries.push_back(&t);
  std::sort(entries.begin(), entries.end(),
            [](const TensorEntry* a, const TensorEntry* b) { return a->name < b->name; });
  nb::list out;
  for (const TensorEntry* t : entries) {
    const std::string_view dtype = DTypeName(t->dtype);
    out.append(nb::make_tuple(
        t->name, nb::str(dtype.data(), dtype.size()), ShapeList(t->shape),
        Export(fw, keeper, block.get() + t->begin, t->byte_size(), t->dtype, t->shape)));
  }
  return out;
}

// The tensors of a whole safetensors file held in `data` (any object with the buffer protocol),
// as (name, dtype name, shape, bytearray of its bytes) in the order of their bytes in the file
// (safetensors.deserialize's order is its hash map's).
nb::list DeserializeRaw(nb::handle data) {
  HeldBuffers held;
  const std::span<const std::byte> bytes = held.Hold(data);
  Header header;
  {
    WithoutGil release;
    header = Unwrap(ParseHeader(bytes, bytes.size(), {}, "<bytes>"));
  }
  std::vector<const TensorEntry*> entries;
  for (const TensorEntry& t : header.tensors) entries.push_back(&t);
  std::stable_sort(entries.begin(), entries.end(),
                   [](const TensorEntry* a, const TensorEntry* b) { return a->begin < b->begin; });
  nb::list out;
  for (const TensorEntry* t : entries) {
    const std::string_view dtype = DTypeName(t->dtype);
    PyObject* copy = PyByteArray_FromStringAndSize(
        reinterpret_cast<const char*>(bytes.data() + header.data_offset() + t->begin),
        static_cast<Py_ssize_t>(t->byte_size()));
    if (copy == nullptr) throw nb::python_error();
    out.append(nb::make_tuple(t->name, nb::str(dtype.data(), dtype.size()), ShapeList(t->shape),
                              nb::steal(copy)));
  }
  return out;
}

}  // namespace

void RegisterIo(nb::module_& m) {
  m.def("serialize", &Serialize, nb::arg("entries"), nb::arg("metadata").none());
  m.def("serialize_file", &SerializeFile, nb::arg("entries"), nb::arg("metadata").none(),
        nb::arg("path"), nb::arg("checksums") = true);
  m.def("deserialize", &Deserialize, nb::arg("data"), nb::arg("framework"));
  m.def("deserialize_raw", &DeserializeRaw, nb::arg("data"));
}

}  // namespace tensorferry::python
