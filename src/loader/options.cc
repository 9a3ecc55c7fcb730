// LoadOptions: names of the enums and the TENSORFERRY_* environment variables.
#include <cstdlib>
#include <string>

#include "tensorferry/loader.h"
#include "tensorferry/size.h"
#include "util/macros.h"

namespace tensorferry {

std::string_view EngineName(Engine engine) noexcept {
  switch (engine) {
    case Engine::kAuto: return "auto";
    case Engine::kPread: return "pread";
    case Engine::kIoUring: return "io_uring";
    case Engine::kMmap: return "mmap";
  }
  return "?";
}

Result<Engine> ParseEngine(std::string_view name) {
  for (Engine e : {Engine::kAuto, Engine::kPread, Engine::kIoUring, Engine::kMmap}) {
    if (name == EngineName(e)) return e;
  }
  if (name == "iouring" || name == "io-uring" || name == "uring") return Engine::kIoUring;
  return Status(Code::kInvalidArgument,
                "unknown engine \"" + std::string(name) + "\" (auto, pread, io_uring, mmap)");
}

std::string_view DirectIOName(DirectIO direct) noexcept {
  switch (direct) {
    case DirectIO::kAuto: return "auto";
    case DirectIO::kOn: return "on";
    case DirectIO::kOff: return "off";
  }
  return "?";
}

Result<DirectIO> ParseDirectIO(std::string_view name) {
  if (name == "auto") return DirectIO::kAuto;
  if (name == "on" || name == "1" || name == "true" || name == "yes") return DirectIO::kOn;
  if (name == "off" || name == "0" || name == "false" || name == "no") return DirectIO::kOff;
  return Status(Code::kInvalidArgument,
                "unknown O_DIRECT mode \"" + std::string(name) + "\" (auto, on, off)");
}

namespace {

Status BadVariable(const char* variable, std::string_view value, std::string_view why) {
  return Status(Code::kInvalidArgument,
                std::string(variable) + "=\"" + std::string(value) + "\": " + std::string(why));
}

Result<uint64_t> SizeVariable(const char* variable, std::string_view value, bool allow_zero) {
  std::optional<uint64_t> v = ParseSize(value);
  if (!v) return BadVariable(variable, value, "not a size (e.g. 8MB, 1GiB, 4096)");
  if (!allow_zero && *v == 0) return BadVariable(variable, value, "must be > 0");
  return *v;
}

Result<unsigned> CountVariable(const char* variable, std::string_view value, unsigned max) {
  unsigned long v = 0;
  if (value.empty() || value.size() > 9) return BadVariable(variable, value, "not a count");
  for (char c : value) {
    if (c < '0' || c > '9') return BadVariable(variable, value, "not a count");
    v = v * 10 + static_cast<unsigned>(c - '0');
  }
  if (v > max) return BadVariable(variable, value, "at most " + std::to_string(max));
  return static_cast<unsigned>(v);
}

}  // namespace

Result<LoadOptions> LoadOptions::FromEnvironment() {
  LoadOptions o;
  auto get = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  };
  if (const char* v = get("TENSORFERRY_ENGINE")) {
    auto e = ParseEngine(v);
    if (!e.ok()) return BadVariable("TENSORFERRY_ENGINE", v, e.status().message());
    o.engine = *e;
  }
  if (const char* v = get("TENSORFERRY_THREADS")) {
    TF_ASSIGN_OR_RETURN(o.threads, CountVariable("TENSORFERRY_THREADS", v, 1024));
  }
  if (const char* v = get("TENSORFERRY_CHUNK_SIZE")) {
    TF_ASSIGN_OR_RETURN(o.chunk_size, SizeVariable("TENSORFERRY_CHUNK_SIZE", v, false));
  }
  if (const char* v = get("TENSORFERRY_DIRECT_IO")) {
    auto d = ParseDirectIO(v);
    if (!d.ok()) return BadVariable("TENSORFERRY_DIRECT_IO", v, d.status().message());
    o.direct = *d;
  }
  if (const char* v = get("TENSORFERRY_QUEUE_DEPTH")) {
    TF_ASSIGN_OR_RETURN(o.queue_depth, CountVariable("TENSORFERRY_QUEUE_DEPTH", v, 4096));
    if (o.queue_depth == 0) return BadVariable("TENSORFERRY_QUEUE_DEPTH", v, "must be > 0");
  }
  if (const char* v = get("TENSORFERRY_BUDGET")) {
    TF_ASSIGN_OR_RETURN(o.budget, SizeVariable("TENSORFERRY_BUDGET", v, true));
  }
  if (const char* v = get("TENSORFERRY_POOL_BYTES")) {
    TF_ASSIGN_OR_RETURN(o.pool_bytes, SizeVariable("TENSORFERRY_POOL_BYTES", v, true));
  }
  if (const char* v = get("TENSORFERRY_ORDER")) {
    const std::string_view s(v);
    if (s == "file") {
      o.order = DeliveryOrder::kFile;
    } else if (s == "layer") {
      o.order = DeliveryOrder::kLayer;
    } else {
      return BadVariable("TENSORFERRY_ORDER", s, "expected file or layer");
    }
  }
  if (const char* v = get("TENSORFERRY_POPULATE")) {
    auto d = ParseDirectIO(v);  // same vocabulary: on/off, 1/0, true/false
    if (!d.ok() || *d == DirectIO::kAuto) {
      return BadVariable("TENSORFERRY_POPULATE", v, "expected 1/0, on/off, true/false");
    }
    o.populate = *d == DirectIO::kOn;
  }
  if (const char* v = get("TENSORFERRY_DEVICE")) {
    auto d = ParseDevice(v);
    if (!d.ok()) return BadVariable("TENSORFERRY_DEVICE", v, d.status().message());
    o.device = *d;
  }
  if (const char* v = get("TENSORFERRY_GDS")) {
    auto g = ParseGdsMode(v);
    if (!g.ok()) return BadVariable("TENSORFERRY_GDS", v, g.status().message());
    o.gds = *g;
  }
  if (const char* v = get("TENSORFERRY_STAGING_BYTES")) {
    TF_ASSIGN_OR_RETURN(o.staging_bytes, SizeVariable("TENSORFERRY_STAGING_BYTES", v, false));
  }
  if (const char* v = get("TENSORFERRY_STAGING_SLOT")) {
    TF_ASSIGN_OR_RETURN(o.staging_slot, SizeVariable("TENSORFERRY_STAGING_SLOT", v, false));
  }
  if (const char* v = get("TENSORFERRY_DEVICE_BUDGET")) {
    TF_ASSIGN_OR_RETURN(o.device_budget, SizeVariable("TENSORFERRY_DEVICE_BUDGET", v, true));
  }
  return o;
}

}  // namespace tensorferry
