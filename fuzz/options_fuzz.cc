// libFuzzer target: the bytes are option text as the edges pass it on (TENSORFERRY_* variables,
// --flags, Python keywords): lines "key=value", each given to LoadOptions::Set, and each value
// also read by the text parsers behind it (ParseSize, ParseBool, ParseDevice, ParseEngine,
// ParseDirectIO, ParseGdsMode, ParseDeliveryOrder). None may crash, hang or read outside the
// input (the first 8 lines are read). Errors are kInvalidArgument naming the key or value; accepted
// values read back through their names; Validated() either refuses the options or returns them
// within the documented bounds.
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "tensorferry/device.h"
#include "tensorferry/options.h"
#include "tensorferry/size.h"

namespace {

using tensorferry::Code;

template <typename R>
void CheckError(const R& r) {
  if (r.ok()) return;
  if (r.status().code() != Code::kInvalidArgument || r.status().message().empty()) std::abort();
}

void CheckSize(std::string_view value) {
  const auto size = tensorferry::ParseSize(value);
  if (!size) return;
  (void)tensorferry::FormatBytes(*size);
  // Plain decimal digits are bytes, exactly.
  if (value.find_first_not_of("0123456789") == std::string_view::npos) {
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (ec != std::errc() || end != value.data() + value.size() || v != *size) std::abort();
    // With a binary unit, 1024 times as many, when that fits.
    if (v <= UINT64_MAX / 1024) {
      const auto kib = tensorferry::ParseSize(std::string(value) + "KiB");
      if (!kib || *kib != v * 1024) std::abort();
    }
  }
}

void CheckParsers(std::string_view value) {
  CheckSize(value);
  if (auto device = tensorferry::ParseDevice(value); device.ok()) {
    auto again = tensorferry::ParseDevice(tensorferry::DeviceName(*device));
    if (!again.ok() || !(*again == *device)) std::abort();
  } else {
    CheckError(device);
  }
  if (auto engine = tensorferry::ParseEngine(value); engine.ok()) {
    auto again = tensorferry::ParseEngine(tensorferry::EngineName(*engine));
    if (!again.ok() || *again != *engine) std::abort();
  } else {
    CheckError(engine);
  }
  if (auto direct = tensorferry::ParseDirectIO(value); direct.ok()) {
    auto again = tensorferry::ParseDirectIO(tensorferry::DirectIOName(*direct));
    if (!again.ok() || *again != *direct) std::abort();
  } else {
    CheckError(direct);
  }
  if (auto gds = tensorferry::ParseGdsMode(value); gds.ok()) {
    auto again = tensorferry::ParseGdsMode(tensorferry::GdsModeName(*gds));
    if (!again.ok() || *again != *gds) std::abort();
  } else {
    CheckError(gds);
  }
  if (auto order = tensorferry::ParseDeliveryOrder(value); order.ok()) {
    auto again = tensorferry::ParseDeliveryOrder(tensorferry::DeliveryOrderName(*order));
    if (!again.ok() || *again != *order) std::abort();
  } else {
    CheckError(order);
  }
  if (auto b = tensorferry::ParseBool(value); b.ok()) {
    if (value != "1" && value != "0" && value != "on" && value != "off" && value != "true" &&
        value != "false" && value != "yes" && value != "no") {
      std::abort();
    }
  } else {
    CheckError(b);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  tensorferry::LoadOptions options;
  // A few lines are enough to combine keys; more only slow each run down (every Set copies the
  // options, shard spec included).
  for (int lines = 0; lines < 8 && !text.empty(); ++lines) {
    const size_t eol = text.find('\n');
    const std::string_view line = text.substr(0, eol);
    text = eol == std::string_view::npos ? std::string_view() : text.substr(eol + 1);
    const size_t eq = line.find('=');
    const std::string_view key = line.substr(0, eq);
    const std::string_view value =
        eq == std::string_view::npos ? std::string_view() : line.substr(eq + 1);
    CheckParsers(value);

    const uint64_t chunk_size = options.chunk_size;
    const tensorferry::Status s = options.Set(key, value);
    if (!s.ok()) {
      // Errors name the key; options are left as they were.
      if (s.code() != Code::kInvalidArgument || s.message().find(key) == std::string::npos) {
        std::abort();
      }
      if (options.chunk_size != chunk_size) std::abort();
      continue;
    }
    if (value.empty()) std::abort();  // an empty value is always refused
    if (key == "chunk_size" || key == "budget" || key == "pool_bytes" || key == "staging_bytes" ||
        key == "staging_slot" || key == "device_budget") {
      const auto v = tensorferry::ParseSize(value);
      if (!v) std::abort();
      const uint64_t got = key == "chunk_size"      ? options.chunk_size
                           : key == "budget"        ? options.budget
                           : key == "pool_bytes"    ? options.pool_bytes
                           : key == "staging_bytes" ? options.staging_bytes
                           : key == "staging_slot"  ? options.staging_slot
                                                    : options.device_budget;
      if (got != *v) std::abort();
    }
    if (key.rfind("tp_", 0) == 0 || key.rfind("shard_", 0) == 0) {
      if (!options.tensor_parallel) std::abort();
    }
  }
  auto validated = options.Validated();
  if (!validated.ok()) {
    CheckError(validated);
    return 0;
  }
  if (validated->chunk_size < tensorferry::kMinChunkSize ||
      validated->threads > tensorferry::kMaxThreads || validated->queue_depth == 0 ||
      validated->queue_depth > tensorferry::kMaxQueueDepth) {
    std::abort();
  }
  if (const auto& tp = validated->tensor_parallel) {
    if (tp->world == 0 || tp->rank >= tp->world || !tp->spec.Validate().ok()) std::abort();
  }
  return 0;
}
