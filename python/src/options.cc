// Load options and statistics for Python (options.h).
#include "options.h"

#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "tensorferry/device.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"
#include "tensorferry/size.h"

namespace nb = nanobind;

namespace tensorferry::python {
namespace {

// A Python option value as the text LoadOptions::Set reads: an int its digits (a negative one is
// refused there), a bool "true"/"false" (which only boolean options accept), a str itself.
std::string OptionText(nb::handle value, const std::string& key) {
  if (PyBool_Check(value.ptr())) return value.ptr() == Py_True ? "true" : "false";
  if (PyLong_Check(value.ptr())) return nb::cast<std::string>(nb::str(value));
  if (!PyUnicode_Check(value.ptr())) {
    throw StatusError(
        Status(Code::kInvalidArgument,
               key + " must be an int, a bool or a str, not " + Py_TYPE(value.ptr())->tp_name));
  }
  return ToText(value, key);
}

std::vector<std::pair<std::string, Device>> PlacementMap(nb::handle value) {
  std::vector<std::pair<std::string, Device>> map;
  for (nb::handle item : nb::cast<nb::list>(value)) {
    nb::tuple pair = nb::cast<nb::tuple>(item);
    map.emplace_back(ToText(pair[0], "placement prefix"),
                     Unwrap(ParseDevice(ToText(pair[1], "placement device"))));
  }
  return map;
}

}  // namespace

LoadOptions MakeLoadOptions(const nb::dict& options) {
  LoadOptions o = Unwrap(LoadOptions::FromEnvironment());
  std::optional<std::vector<std::pair<std::string, Device>>> placement;
  for (auto [key_handle, value] : options) {
    const std::string key = ToText(key_handle, "load option name");
    if (value.is_none()) continue;
    if (key == "placement") {
      placement = PlacementMap(value);
    } else if (key == "shard_rules" && !PyUnicode_Check(value.ptr())) {
      o.SetShardSpec(nb::cast<ShardSpec>(value));
    } else {
      Check(o.Set(key, OptionText(value, key)));
    }
  }
  if (placement) o.placement = Placement(std::move(*placement), o.device);
  Check(o.Validate());
  return o;
}

nb::dict OptionsDict(const LoadOptions& o) {
  nb::dict d;
  d["engine"] = std::string(EngineName(o.engine));
  d["direct"] = std::string(DirectIOName(o.direct));
  d["threads"] = o.threads;
  d["chunk_size"] = o.chunk_size;
  d["queue_depth"] = o.queue_depth;
  d["budget"] = o.budget;
  d["allow_oversized"] = o.allow_oversized;
  d["order"] = std::string(DeliveryOrderName(o.order));
  d["pool_bytes"] = o.pool_bytes;
  d["populate"] = o.populate;
  d["device"] = DeviceName(o.device);
  d["gds"] = std::string(GdsModeName(o.gds));
  d["staging_bytes"] = o.staging_bytes;
  d["staging_slot"] = o.staging_slot;
  d["device_budget"] = o.device_budget;
  d["keep_staging"] = o.keep_staging;
  d["device_producers"] = o.device_producers;
  d["prefer_mmap"] = o.prefer_mmap;
  // UINT64_MAX: no limit ("off").
  if (o.memory_limit == UINT64_MAX) {
    d["memory_limit"] = nb::none();
  } else {
    d["memory_limit"] = o.memory_limit;
  }
  d["drop_cache"] = o.drop_cache;
  d["verify"] = std::string(VerifyModeName(o.verify));
  d["coop_timeout_ms"] = o.cooperative.timeout_ms;
  d["coop_exchange"] = std::string(ExchangeChoiceName(o.cooperative.exchange));
  d["coop_storage_rate"] = o.cooperative.storage_rate;
  d["coop_network_rate"] = o.cooperative.network_rate;
  d["coop_probe_bytes"] = o.cooperative.probe_bytes;
  // Object storage. Secrets are not handed out: "<set>" when given, "" otherwise.
  const ObjectStoreOptions& s = o.object_store;
  const auto secret = [](const std::string& v) { return std::string(v.empty() ? "" : "<set>"); };
  const auto tri = [](int v) -> nb::object {
    return v < 0 ? nb::none() : nb::cast(v != 0);  // -1: decided per URL
  };
  d["s3_endpoint"] = s.endpoint;
  d["s3_region"] = s.region;
  d["s3_profile"] = s.profile;
  d["s3_access_key_id"] = s.access_key_id;
  d["s3_secret_access_key"] = secret(s.secret_access_key);
  d["s3_session_token"] = secret(s.session_token);
  d["s3_anonymous"] = tri(s.anonymous);
  d["s3_path_style"] = tri(s.path_style);
  d["gcs_token"] = secret(s.gcs_token);
  d["http_token"] = secret(s.http_token);
  d["object_concurrency"] = s.concurrency;  // 0 (and part size 0): chosen per endpoint
  d["object_part_size"] = s.part_size;
  d["object_retries"] = s.retries;
  d["object_timeout_ms"] = s.timeout_ms;
  d["object_header_bytes"] = s.header_bytes;
  d["object_verify_tls"] = s.verify_tls;
  d["object_ca_bundle"] = s.ca_bundle;
  d["object_cache_dir"] = s.cache_dir;
  d["object_cache_max"] = s.cache_max;
  d["object_hub_cache"] = s.hub_cache;
  d["object_cache_write_behind"] = s.cache_write_behind;
  d["object_cache_fetch_once"] = s.cache_fetch_once;
  if (o.tensor_parallel) {
    d["tp_rank"] = o.tensor_parallel->rank;
    d["tp_size"] = o.tensor_parallel->world;
    d["shard_rules"] = o.tensor_parallel->spec;
    d["shard_max_gap"] = o.tensor_parallel->max_gap;
    d["shard_exact_when_cached"] = o.tensor_parallel->exact_when_cached;
  }
  return d;
}

nb::dict StatsDict(const LoadStats& stats) {
  nb::dict d;
  VisitLoadStats(stats, [&d](const char* name, const auto& value) { d[name] = value; });
  return d;
}

uint64_t ParseSizeValue(nb::handle value) {
  if (PyBool_Check(value.ptr()) || !(PyLong_Check(value.ptr()) || PyUnicode_Check(value.ptr()))) {
    throw StatusError(
        Status(Code::kInvalidArgument, "not a size: " + nb::cast<std::string>(nb::repr(value)) +
                                           " (an int, or a str such as \"256MB\")"));
  }
  const std::string text = OptionText(value, "size");
  const std::optional<uint64_t> v = ParseSize(text);
  if (!v) {
    throw StatusError(
        Status(Code::kInvalidArgument, "not a size: \"" + text + "\" (e.g. 256MB, 1.5GiB, 4096)"));
  }
  return *v;
}

void RegisterOptions(nb::module_& m) {
  m.def("parse_size", &ParseSizeValue, nb::arg("value"),
        "Bytes from an int >= 0 or a str such as \"256MB\" (tensorferry::ParseSize)");
  m.def(
      "parse_option",
      [](const std::string& key, nb::handle value) {
        LoadOptions o;
        Check(o.Set(key, OptionText(value, key)));
        const nb::dict options = OptionsDict(o);
        return nb::object(options[key.c_str()]);  // not the accessor: it refers to `options`
      },
      nb::arg("key"), nb::arg("value"),
      "The value of load option `key` as LoadOptions::Set reads and checks it (its errors)");
  m.def(
      "stats_fields", [] { return StatsDict(LoadStats{}); },
      "Every LoadStats field (VisitLoadStats) by name, in order, with its zero value");
}

}  // namespace tensorferry::python
