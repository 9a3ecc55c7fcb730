// tensorferry._core: the compiled half of the Python package (the other half is
// python/tensorferry/*.py, which gives these functions the safetensors-compatible names).
//
// One file per concept: errors (Status -> exceptions), options (LoadOptions, LoadStats), export
// (bytes -> framework arrays), reader (Reader: one checkpoint), iterator (BatchStream: pull-style
// batches), shard (tensor-parallel slicing), io (whole files to and from bytes), distributed
// (cooperative loads), torch_file (torch.save checkpoints read without running them). This file
// holds the module and its small free functions.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "distributed.h"
#include "errors.h"
#include "export.h"
#include "gil.h"
#include "interrupt.h"
#include "io.h"
#include "iterator.h"
#include "options.h"
#include "reader.h"
#include "shard.h"
#include "tensorferry/cuda.h"
#include "tensorferry/device.h"
#include "tensorferry/format.h"
#include "tensorferry/loader.h"
#include "tensorferry/mapping.h"
#include "tensorferry/object_store.h"
#include "tensorferry/plan.h"
#include "tensorferry/shard.h"
#include "tensorferry/size.h"
#include "torch_file.h"

namespace nb = nanobind;

NB_MODULE(_core, m) {
  using namespace tensorferry;
  using namespace tensorferry::python;
  m.doc() = "tensorferry's compiled core (use the tensorferry package, not this module)";
  m.attr("__version__") = TENSORFERRY_VERSION_STRING;
  m.attr("SOURCE_HASH") = TENSORFERRY_SOURCE_HASH;
  RegisterErrors(m);
  RememberMainThread();
  RegisterDistributed(m);

  RegisterIterator(m);
  RegisterReader(m);
  RegisterShard(m);
  RegisterIo(m);
#ifdef TENSORFERRY_PY_TORCH_FILE
  RegisterTorchFile(m);
#endif
  RegisterOptions(m);
  m.def("format_bytes", &FormatBytes);
  // The keys LoadOptions::Set accepts (Loader keywords and TENSORFERRY_* settings), in order.
  m.def("option_keys", [] {
    std::vector<std::string> keys;
    for (std::string_view k : LoadOptionKeys()) keys.emplace_back(k);
    return keys;
  });
  // TENSORFERRY_* variables set that nothing reads (a typo), with a suggestion (options.h).
  m.def("unknown_environment_variables", [] { return UnknownEnvironmentVariables(); });
  m.def("cuda_available", [] { return CudaAvailable(); });
  m.def(
      "release_idle_staging", [] { return ReleaseIdleStaging(); },
      "Frees the pinned staging rings (and CUDA streams) closed loaders left for the next one "
      "(keep_staging, docs/gpu.md); returns how many.");
  m.def(
      "idle_staging_bytes", [] { return IdleStagingBytes(); },
      "Pinned bytes the staging rings kept for reuse hold now.");
  m.def(
      "wait_for_caches",
      [] {
        // In steps, so that Ctrl-C reaches Python: it gives up the copies (AbandonObjectCaches)
        // and raises KeyboardInterrupt.
        for (;;) {
          bool done = false;
          {
            WithoutGil unlocked;
            done = WaitForObjectCaches(std::chrono::milliseconds(100));
          }
          if (done) return TakeObjectCacheFailures();
          if (PyErr_CheckSignals() != 0) {
            AbandonObjectCaches();
            throw nb::python_error();
          }
        }
      },
      "Waits until the copies into object caches (object_cache_dir, the hub cache) that closed "
      "loaders and files left in progress are whole (docs/object_storage.md); the interpreter's "
      "exit waits for them too. Ctrl-C meanwhile gives them up (each is removed; the next load "
      "of its file downloads it again) and raises KeyboardInterrupt. Returns the copies that "
      "failed since the last call, each a line naming the cache, the object and why (such a "
      "failure cost no load anything: the next load of that file downloads it again).");
  m.def(
      "object_size",
      [](const std::string& url, const nb::dict& options) {
        const ObjectStoreOptions store = MakeLoadOptions(options).object_store;
        std::atomic<bool> cancel{false};
        return Unwrap(Interruptible(cancel, [&] { return ObjectSize(url, store, &cancel); }));
      },
      nb::arg("url"), nb::arg("options"),
      "The size of the object at `url` (one ranged GET); `options`: load options (s3_*, object_*). "
      "Ctrl-C abandons the GET and raises KeyboardInterrupt.");
  m.def(
      "read_object",
      [](const std::string& url, const nb::dict& options, uint64_t max_bytes) {
        const ObjectStoreOptions store = MakeLoadOptions(options).object_store;
        std::atomic<bool> cancel{false};
        const std::vector<std::byte> data = Unwrap(
            Interruptible(cancel, [&] { return ReadObject(url, store, max_bytes, &cancel); }));
        return nb::bytes(reinterpret_cast<const char*>(data.data()), data.size());
      },
      nb::arg("url"), nb::arg("options"), nb::arg("max_bytes"),
      "The whole object at `url` as bytes (tensorferry::ReadObject); InvalidArgumentError when it "
      "is larger than `max_bytes`. Ctrl-C abandons the GETs and raises KeyboardInterrupt.");
  m.def(
      "describe_object_store",
      [](const std::string& url, const nb::dict& options) {
        const ObjectStoreOptions store = MakeLoadOptions(options).object_store;
        // Ctrl-C abandons a hanging probe or credential fetch (KeyboardInterrupt).
        std::atomic<bool> cancel{false};
        const ObjectStoreReport r =
            Interruptible(cancel, [&] { return DescribeObjectStore(url, store, &cancel); });
        const auto status = [](const Status& s) {
          nb::dict d;
          d["ok"] = s.ok();
          d["code"] = s.ok() ? std::string() : std::string(CodeName(s.code()));
          d["category"] = s.ok() ? std::string() : std::string(CategoryName(s.category()));
          d["message"] = s.ok() ? std::string() : std::string(s.message());
          return d;
        };
        nb::dict d;
        d["url"] = r.url;
        d["store"] = r.store;
        d["settings"] = status(r.settings);
        d["endpoint"] = r.endpoint;
        d["endpoint_from"] = r.endpoint_from;
        d["region"] = r.region;
        d["region_from"] = r.region_from;
        d["addressing"] = r.addressing;
        d["credentials_from"] = r.credentials_from;
        d["credentials"] = r.credentials;
        d["credentials_status"] = status(r.credentials_status);
        d["credentials_seconds"] = r.credentials_seconds;
        d["request_url"] = r.request_url;
        d["probe"] = r.probe;
        d["probe_status"] = status(r.probe_status);
        d["probe_seconds"] = r.probe_seconds;
        return d;
      },
      nb::arg("url"), nb::arg("options"),
      "How the store of `url` is reached and whether it answers (tensorferry::DescribeObjectStore; "
      "the fields of `tensorferry doctor URL --json`'s object_store). Ctrl-C abandons its requests "
      "and raises KeyboardInterrupt.");
  m.def(
      "list_objects",
      [](const std::string& dir, const std::string& suffix, const nb::dict& options) {
        const ObjectStoreOptions store = MakeLoadOptions(options).object_store;
        std::atomic<bool> cancel{false};
        return Unwrap(
            Interruptible(cancel, [&] { return ListObjects(dir, suffix, store, &cancel); }));
      },
      nb::arg("dir"), nb::arg("suffix"), nb::arg("options"),
      "The URLs of the objects directly under the s3:// or gs:// prefix `dir` whose names end with "
      "`suffix`, sorted (FileNotFoundError for an HTTP URL: a server cannot be listed). Ctrl-C "
      "abandons the listing and raises KeyboardInterrupt.");
  m.def("mapping_stats", [] {
    const MappingStats s = GetMappingStats();
    nb::dict d;
    d["live"] = s.live;
    d["leased"] = s.leased;
    d["copied"] = s.copied;
    d["faults"] = s.faults;
    d["unleasable"] = s.unleasable;
    return d;
  });
  m.def("check_mapped_files", [] { Check(CheckMappedFiles()); });
  m.def("set_mapping_leases", [](bool enabled) { SetMappingLeases(enabled); });
  m.def(
      "copy_to_host",
      [](nb::ndarray<nb::c_contig> array) {  // (a strided view's bytes are not one range)
        // The bytes of any DLPack array, host or CUDA (a synchronous cudaMemcpy for device memory):
        // lets tests check what was exported without a CUDA-enabled framework.
        const size_t n = array.nbytes();
        const int type = array.device_type();
        Device device = Device::CPU();
        if (type == nb::device::cuda::value) {
          device = Device::CUDA(array.device_id());
        } else if (type != nb::device::cpu::value) {
          throw StatusError(Status(Code::kUnsupported,
                                   "copy_to_host: DLPack device type " + std::to_string(type)));
        }
        std::string bytes(n, '\0');
        Status s;
        {
          WithoutGil release;
          s = CopyToHost(device, array.data(), std::as_writable_bytes(std::span<char>(bytes)));
        }
        Check(s);
        return nb::bytes(bytes.data(), bytes.size());
      },
      nb::arg("array"), "The bytes of a DLPack array (host or CUDA) as bytes, copied to the host");
  m.def("layer_of",
        [](const std::string& name) -> std::optional<uint64_t> { return LayerOf(name); });
  m.def("dtype_bits", [](const std::string& name) {
    const std::optional<DType> d = DTypeFromName(name);
    if (!d) throw nb::key_error(name.c_str());
    return DTypeBits(*d);
  });
  m.def("exports_natively", [](const std::string& name, int framework) {
    const std::optional<DType> d = DTypeFromName(name);
    if (!d) throw nb::key_error(name.c_str());
    return ExportsNatively(*d, ToFramework(framework));
  });
  m.def("dtype_names", [] {
    std::vector<std::string> out;
    for (int i = 0; i < kNumDTypes; ++i) out.emplace_back(DTypeName(static_cast<DType>(i)));
    return out;
  });
  m.def(
      "gil_checks",
      [] { return nb::make_tuple(g_gil_sections.load(), g_gil_held_sections.load()); },
      "(C++ sections that release the GIL, those that found it still held) since import");
  m.def(
      "live_buffers", [] { return nb::make_tuple(Keeper::live_buffers(), Keeper::live_bytes()); },
      "(buffers, bytes) of loaded memory still referenced by arrays handed to Python");
}
