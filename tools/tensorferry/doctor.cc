// tensorferry doctor: can this process load to a GPU, and if not, why not. Prints the CUDA runtime
// found (or every candidate tried), the devices, and whether GPUDirect Storage (cuFile) is usable
// with the reason; the host memory this process may use (memory_limit.h: the memory cgroup's
// limit, MemAvailable), which bounds loads without a budget; and whether io_uring is allowed here
// (loader.h, EngineAvailable: a container's seccomp profile often refuses it, and auto then reads
// with pread). With a URL (s3://, gs://, http(s)://), also how its store is reached: the
// settings as resolved and where each came from, the credentials fetched (never a secret), and
// the requests a load makes first (object_store.h, DescribeObjectStore: a prefix's index, then
// its listing or model.safetensors); URLs are shown redacted (RedactUrl). Exits 0 whatever it
// finds: the report is the result (scripts read "cuda_available", "object_store" from --json).
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/cuda.h"
#include "tensorferry/loader.h"
#include "tensorferry/memory_limit.h"
#include "tensorferry/object_store.h"
#include "tensorferry/options.h"
#include "tensorferry/size.h"

namespace tensorferry::cli {
namespace {

struct DoctorArgs {
  bool json = false;
  bool quick = false;
  std::string url;  // "": no object store section
};

std::string Version(int v) {
  if (v <= 0) return "none";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

std::string ComputeCapability(const CudaDeviceInfo& d) {
  return std::to_string(d.compute_major) + "." + std::to_string(d.compute_minor);
}

// How `auto` reads local files in this process: io_uring where the kernel and seccomp allow it.
struct Engines {
  Status io_uring = EngineAvailable(Engine::kIoUring);
  std::string Describe() const {
    if (io_uring.ok()) return "io_uring available: local files are read with io_uring (auto)";
    return "io_uring unavailable (" + io_uring.message() +
           "): local files are read with pread, one read in flight per worker, at least " +
           std::to_string(kPreadMinThreads) + " workers (auto)";
  }
};

// The host memory a load without a budget may fill, as Loader::Open decides it: the
// memory_limit setting (TENSORFERRY_MEMORY_LIMIT), else 3/4 of what this process may use.
struct LoadLimit {
  uint64_t bytes = 0;  // 0: no check (unknown, or "off")
  std::string from;
};
LoadLimit LoadLimitOf(const MemoryLimit& m) {
  const Result<LoadOptions> env = LoadOptions::FromEnvironment();
  if (!env.ok()) {  // loads fail until it is fixed: say so, rather than a limit they never use
    return {0, "loads fail: " + std::string(env.status().message())};
  }
  const uint64_t set = env->memory_limit;
  if (set == UINT64_MAX) return {0, "TENSORFERRY_MEMORY_LIMIT=off"};
  if (set > 0) return {set, "TENSORFERRY_MEMORY_LIMIT"};
  const uint64_t bytes = m.DefaultLoadLimit();
  return {bytes, bytes == 0 ? "unknown (no check)" : "3/4 of what this process may use"};
}

void StatusFields(JsonOut& j, std::string_view key, const Status& s) {
  j.Key(key).BeginObject();
  j.Field("ok", s.ok());
  j.Field("code", s.ok() ? std::string_view() : CodeName(s.code()));
  j.Field("category", s.ok() ? std::string_view() : CategoryName(s.category()));
  j.Field("message", s.ok() ? std::string_view() : s.message());
  j.EndObject();
}

void StoreJson(JsonOut& j, const ObjectStoreReport& o) {
  j.Key("object_store").BeginObject();
  j.Field("url", o.url);
  j.Field("store", o.store);
  StatusFields(j, "settings", o.settings);
  j.Field("endpoint", o.endpoint);
  j.Field("endpoint_from", o.endpoint_from);
  j.Field("region", o.region);
  j.Field("region_from", o.region_from);
  j.Field("addressing", o.addressing);
  j.Field("credentials_from", o.credentials_from);
  j.Field("credentials", o.credentials);
  StatusFields(j, "credentials_status", o.credentials_status);
  j.Field("credentials_seconds", o.credentials_seconds);
  j.Field("request_url", o.request_url);
  j.Field("probe", o.probe);
  StatusFields(j, "probe_status", o.probe_status);
  j.Field("probe_seconds", o.probe_seconds);
  j.EndObject();
}

std::string StoreText(const ObjectStoreReport& o) {
  std::string out = "object store: " + o.url + "\n";
  if (!o.settings.ok()) return out + "  settings: " + std::string(o.settings.message()) + "\n";
  if (!o.endpoint.empty()) {
    out += "  endpoint: " + o.endpoint + " (" + o.endpoint_from + "), " + o.addressing + "\n";
    out += "  region: " + o.region + " (" + o.region_from + ")\n";
  }
  out += "  credentials: " + o.credentials_from + "\n";
  char seconds[32];
  if (!o.credentials_status.ok()) {
    return out + "  credentials fetched: failed: " + std::string(o.credentials_status.message()) +
           "\n";
  }
  if (!o.credentials.empty()) {
    std::snprintf(seconds, sizeof seconds, "%.3f", o.credentials_seconds);
    out += "  credentials fetched: " + o.credentials + " (" + seconds + " s)\n";
  }
  std::snprintf(seconds, sizeof seconds, "%.3f", o.probe_seconds);
  out += "  request: " + o.request_url + "\n";
  out += "  answer: " +
         (o.probe_status.ok() ? o.probe : "failed: " + std::string(o.probe_status.message())) +
         " (" + seconds + " s)\n";
  return out;
}

std::string Json(const CudaReport& r, const MemoryLimit& m, const Engines& e,
                 const ObjectStoreReport* store) {
  JsonOut j;
  j.BeginObject();
  // As every --json document: the command did its work (what it found is in the fields; the
  // probe of a URL has its own "ok").
  j.Field("ok", true);
  if (store != nullptr) StoreJson(j, *store);
  j.Key("io_uring").BeginObject();
  j.Field("available", e.io_uring.ok());
  j.Field("error", e.io_uring.ok() ? std::string() : e.io_uring.message());
  j.EndObject();
  j.Key("memory").BeginObject();
  j.Field("cgroup_version", m.cgroup_version);
  j.Field("cgroup_limit", m.cgroup_limit);
  j.Field("cgroup_usage", m.cgroup_usage);
  j.Field("cgroup_reclaimable", m.cgroup_reclaimable);
  j.Field("cgroup_file", m.cgroup_file);
  j.Field("cgroup_error", m.cgroup_error);
  j.Field("mem_total", m.mem_total);
  j.Field("mem_available", m.mem_available);
  j.Key("available");  // null: neither the cgroup nor MemAvailable is known
  if (m.Available() == UINT64_MAX) {
    j.Raw("null");
  } else {
    j.Uint(m.Available());
  }
  // What a load without a budget may fill (LoadOptions::memory_limit), and from where.
  const LoadLimit load = LoadLimitOf(m);
  j.Field("load_memory_limit", load.bytes);
  j.Field("load_memory_limit_from", load.from);
  j.EndObject();
  j.Field("cuda_available", r.cuda_usable());
  j.Key("runtime").BeginObject();
  j.Field("loaded", r.runtime_loaded);
  j.Field("path", r.runtime_path);
  j.Field("error", r.runtime_error);
  j.Field("version", Version(r.runtime_version));
  j.Field("driver_version", Version(r.driver_version));
  j.EndObject();
  j.Key("devices").BeginArray();
  for (const CudaDeviceInfo& d : r.devices) {
    j.BeginObject();
    j.Field("index", static_cast<uint64_t>(d.index));
    j.Field("name", d.name);
    j.Field("pci_bus_id", d.pci_bus_id);
    j.Field("compute_capability", ComputeCapability(d));
    j.Field("total_memory", d.total_memory);
    j.Field("free_memory", d.free_memory);
    j.Field("error", d.error);
    j.EndObject();
  }
  j.EndArray();
  j.Field("device_error", r.device_error);
  j.Key("cufile").BeginObject();
  j.Field("loaded", r.cufile_loaded);
  j.Field("path", r.cufile_path);
  j.Field("error", r.cufile_error);
  j.Field("driver_opened", r.cufile_driver_opened);
  j.Field("driver_error", r.cufile_driver_error);
  j.EndObject();
  j.Key("gds").BeginObject();
  j.Field("usable", r.gds_usable);
  j.Field("reason", r.gds_reason);
  j.EndObject();
  j.EndObject();
  return j.str();
}

std::string Text(const CudaReport& r, const MemoryLimit& m, const Engines& e,
                 const ObjectStoreReport* store) {
  std::string out = store != nullptr ? StoreText(*store) : std::string();
  out += "host memory: " + m.Describe() + "\n";
  const LoadLimit load = LoadLimitOf(m);
  out += "loads without a budget may fill: " +
         (load.bytes == 0 ? std::string("no limit") : FormatBytes(load.bytes)) + " (" + load.from +
         ")\n";
  out += "reads: " + e.Describe() + "\n";
  if (r.runtime_loaded) {
    out += "CUDA runtime: " + r.runtime_path + " (runtime " + Version(r.runtime_version) +
           ", driver " + Version(r.driver_version) + ")\n";
  } else {
    out += "CUDA runtime: not loaded: " + r.runtime_error + "\n";
  }
  if (r.devices.empty()) {
    out += "devices: none: " + r.device_error + "\n";
  } else {
    out += "devices: " + std::to_string(r.devices.size()) + "\n";
    for (const CudaDeviceInfo& d : r.devices) {
      out += "  " + std::to_string(d.index) + ": " + d.name + ", " + d.pci_bus_id + ", compute " +
             ComputeCapability(d) + ", " + FormatBytes(d.total_memory) + " total";
      if (d.free_memory > 0) out += ", " + FormatBytes(d.free_memory) + " free";
      if (!d.error.empty()) out += " (" + d.error + ")";
      out += "\n";
    }
  }
  if (r.cufile_loaded) {
    out += "cuFile: " + r.cufile_path +
           (r.cufile_driver_opened          ? ", driver opened"
            : r.cufile_driver_error.empty() ? ""
                                            : ", driver failed: " + r.cufile_driver_error) +
           "\n";
  } else {
    out += "cuFile: not loaded: " + r.cufile_error + "\n";
  }
  out += std::string("GPUDirect Storage: ") + (r.gds_usable ? "usable: " : "not usable: ") +
         r.gds_reason;
  return out;
}

int RunDoctor(const DoctorArgs& args) {
  DiagnoseOptions options;
  options.query_free_memory = !args.quick;
  options.open_cufile_driver = !args.quick;
  const CudaReport report = DiagnoseDevices(options);
  const MemoryLimit memory = ReadMemoryLimit();
  const Engines engines;
  std::optional<ObjectStoreReport> store;
  if (!args.url.empty()) {
    Result<OpenOptions> open = OpenOptionsFor(args.url);  // TENSORFERRY_OBJECT_* and AWS_*
    if (open.ok()) {
      store = DescribeObjectStore(args.url, open->object_store);
    } else {
      store.emplace();
      store->url = RedactUrl(args.url);  // no password, no signed link's query
      store->settings = open.status();
    }
  }
  const ObjectStoreReport* s = store ? &*store : nullptr;
  return PrintReport(args.json ? Json(report, memory, engines, s)
                               : Text(report, memory, engines, s));
}

}  // namespace

Command AddDoctorCommand(CLI::App& parent) {
  auto args = std::make_shared<DoctorArgs>();
  CLI::App* app = parent.add_subcommand(
      "doctor",
      "Report the host memory this process may use, how local files are read (io_uring or "
      "pread), the CUDA runtime, devices and GPUDirect Storage support, and why not");
  app->add_flag("--json", args->json, "One JSON document");
  app->add_flag("--quick", args->quick,
                "Skip what needs a CUDA context: free memory, opening the cuFile driver");
  app->add_option("url", args->url,
                  "An s3://, gs:// or http(s):// URL (an object, an index, or a prefix): "
                  "also report how its store is reached, where each setting came from, the "
                  "credentials fetched, and the requests a load of it makes first");
  return Command{app, [args] { return RunDoctor(*args); }};
}

}  // namespace tensorferry::cli
