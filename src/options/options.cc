// LoadOptions (tensorferry/options.h): the one place that reads options from text and checks them.
#include "tensorferry/options.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

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

Result<bool> ParseBool(std::string_view text) {
  if (text == "on" || text == "1" || text == "true" || text == "yes") return true;
  if (text == "off" || text == "0" || text == "false" || text == "no") return false;
  std::string message = "\"";
  message.append(text).append("\" is not a boolean (1/0, on/off, true/false, yes/no)");
  return Status(Code::kInvalidArgument, std::move(message));
}

Result<DirectIO> ParseDirectIO(std::string_view name) {
  if (name == "auto") return DirectIO::kAuto;
  if (auto b = ParseBool(name); b.ok()) return *b ? DirectIO::kOn : DirectIO::kOff;
  return Status(Code::kInvalidArgument,
                "unknown O_DIRECT mode \"" + std::string(name) + "\" (auto, on, off)");
}

std::string_view DeliveryOrderName(DeliveryOrder order) noexcept {
  return order == DeliveryOrder::kLayer ? "layer" : "file";
}

Result<DeliveryOrder> ParseDeliveryOrder(std::string_view name) {
  if (name == "file") return DeliveryOrder::kFile;
  if (name == "layer") return DeliveryOrder::kLayer;
  return Status(Code::kInvalidArgument,
                "unknown order \"" + std::string(name) + "\" (file, layer)");
}

std::string_view ExchangeChoiceName(ExchangeChoice choice) noexcept {
  switch (choice) {
    case ExchangeChoice::kAuto: return "auto";
    case ExchangeChoice::kAll: return "all";
    case ExchangeChoice::kNone: return "none";
  }
  return "?";
}

Result<ExchangeChoice> ParseExchangeChoice(std::string_view name) {
  for (ExchangeChoice c : {ExchangeChoice::kAuto, ExchangeChoice::kAll, ExchangeChoice::kNone}) {
    if (name == ExchangeChoiceName(c)) return c;
  }
  return Status(Code::kInvalidArgument,
                "unknown exchange choice \"" + std::string(name) + "\" (auto, all, none)");
}

std::string_view VerifyModeName(VerifyMode mode) noexcept {
  switch (mode) {
    case VerifyMode::kAuto: return "auto";
    case VerifyMode::kOn: return "on";
    case VerifyMode::kOff: return "off";
  }
  return "auto";
}

Result<VerifyMode> ParseVerifyMode(std::string_view name) {
  if (name == "auto") return VerifyMode::kAuto;
  if (name == "on") return VerifyMode::kOn;
  if (name == "off") return VerifyMode::kOff;
  return Status(Code::kInvalidArgument,
                "unknown verify mode \"" + std::string(name) + "\" (auto, on, off)");
}

namespace {

// A setter reports why a value is refused as a phrase ("is not a size ...", "must be > 0") or a
// Parse* message; Set puts "<key> = <value>" in front.
using Setter = Status (*)(LoadOptions&, std::string_view);

Status Why(std::string why) {
  return Status(Code::kInvalidArgument, std::move(why));
}

template <class T>
Status Assign(Result<T> parsed, T& field) {
  if (!parsed.ok()) return parsed.status();
  field = std::move(parsed).value();
  return Status::Ok();
}

Result<uint64_t> Count(std::string_view value, uint64_t max) {
  if (value.empty() || value.find_first_not_of("0123456789") != std::string_view::npos) {
    return Why("is not a count");
  }
  uint64_t v = 0;
  for (char c : value) {
    if (v > (max - static_cast<uint64_t>(c - '0')) / 10) {
      return Why("is out of range (at most " + std::to_string(max) + ")");
    }
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

Result<uint64_t> Size(std::string_view value, bool allow_zero) {
  const std::optional<uint64_t> v = ParseSize(value);
  if (!v) {
    // A number with a valid unit that does not fit 64 bits is out of range, not malformed.
    const size_t unit = value.find_first_not_of("0123456789.");
    const std::string_view number = value.substr(0, unit);
    const std::optional<uint64_t> factor =
        ParseSize("1" + std::string(unit == std::string_view::npos ? "" : value.substr(unit)));
    if (factor && !number.empty() && number != "." && number.find('.') == number.rfind('.')) {
      const double bytes =
          std::strtod(std::string(number).c_str(), nullptr) * static_cast<double>(*factor);
      if (bytes >= 1) return Why("is out of range (at most 18446744073709551615 bytes, 16 EiB)");
      if (bytes > 0) return Why("is less than one byte");
    }
    return Why("is not a size (e.g. 8MB, 1GiB, 4096)");
  }
  if (!allow_zero && *v == 0) return Why("must be > 0");
  return *v;
}

template <auto Field, uint64_t Max, bool AllowZero>
Status SetCount(LoadOptions& o, std::string_view value) {
  TF_ASSIGN_OR_RETURN(uint64_t v, Count(value, Max));
  if (!AllowZero && v == 0) return Why("must be > 0");
  o.*Field = static_cast<std::remove_reference_t<decltype(o.*Field)>>(v);
  return Status::Ok();
}

template <auto Field, bool AllowZero>
Status SetSize(LoadOptions& o, std::string_view value) {
  TF_ASSIGN_OR_RETURN(o.*Field, Size(value, AllowZero));
  return Status::Ok();
}

template <auto Field>
Status SetBool(LoadOptions& o, std::string_view value) {
  TF_ASSIGN_OR_RETURN(o.*Field, ParseBool(value));
  return Status::Ok();
}

// Tensor parallelism set key by key: rank and world stay "unset" until given.
TensorParallelOptions& TensorParallel(LoadOptions& o) {
  if (!o.tensor_parallel)
    o.tensor_parallel = TensorParallelOptions{ShardSpec::Builtin(), kUnsetTpRank, 0};
  return *o.tensor_parallel;
}

Status SetShardRules(LoadOptions& o, std::string_view value) {
  if (std::optional<ShardSpec> named = ShardSpec::Named(value)) {
    TensorParallel(o).spec = std::move(*named);
    return Status::Ok();
  }
  TF_ASSIGN_OR_RETURN(ShardSpec spec, ShardSpec::FromJson(value));
  TensorParallel(o).spec = std::move(spec);
  return Status::Ok();
}

// Object storage (object_store.h): text, tri-state and numeric fields of LoadOptions::object_store.
template <std::string ObjectStoreOptions::*Field>
Status SetText(LoadOptions& o, std::string_view value) {
  o.object_store.*Field = std::string(value);
  return Status::Ok();
}

template <int ObjectStoreOptions::*Field>
Status SetTriState(LoadOptions& o, std::string_view value) {
  if (value == "auto") {
    o.object_store.*Field = -1;
    return Status::Ok();
  }
  TF_ASSIGN_OR_RETURN(const bool on, ParseBool(value));
  o.object_store.*Field = on ? 1 : 0;
  return Status::Ok();
}

template <auto Field, uint64_t Min, uint64_t Max>
Status SetObjectNumber(LoadOptions& o, std::string_view value) {
  const bool is_size =
      std::is_same_v<std::remove_reference_t<decltype(o.object_store.*Field)>, uint64_t>;
  uint64_t v = 0;
  if (is_size) {
    TF_ASSIGN_OR_RETURN(v, Size(value, true));
  } else {
    TF_ASSIGN_OR_RETURN(v, Count(value, Max));
  }
  if (v < Min) return Why("must be at least " + std::to_string(Min));
  if (v > Max) return Why("is out of range (at most " + std::to_string(Max) + ")");
  o.object_store.*Field = static_cast<std::remove_reference_t<decltype(o.object_store.*Field)>>(v);
  return Status::Ok();
}

// A setting whose 0 is "auto" (chosen per store when a URL is opened): "auto" or 0 sets that,
// anything else goes through SetObjectNumber's range; a variable set for a process can so be
// put back to the default by a Python keyword or a flag.
template <auto Field, uint64_t Min, uint64_t Max>
Status SetObjectNumberOrAuto(LoadOptions& o, std::string_view value) {
  if (value == "auto" || value == "0") {
    o.object_store.*Field = 0;
    return Status::Ok();
  }
  return SetObjectNumber<Field, Min, Max>(o, value);
}

template <bool ObjectStoreOptions::*Field>
Status SetObjectBool(LoadOptions& o, std::string_view value) {
  TF_ASSIGN_OR_RETURN(o.object_store.*Field, ParseBool(value));
  return Status::Ok();
}

struct Key {
  std::string_view key;
  std::string_view variable;  // "" when no environment variable sets it
  Setter set;
};

constexpr uint64_t kU32 = UINT32_MAX;

const std::array<Key, 52> kKeys = {{
    {"engine", "TENSORFERRY_ENGINE",
     [](LoadOptions& o, std::string_view v) { return Assign(ParseEngine(v), o.engine); }},
    {"threads", "TENSORFERRY_THREADS", SetCount<&LoadOptions::threads, kU32, true>},
    {"chunk_size", "TENSORFERRY_CHUNK_SIZE", SetSize<&LoadOptions::chunk_size, false>},
    {"direct", "TENSORFERRY_DIRECT_IO",
     [](LoadOptions& o, std::string_view v) { return Assign(ParseDirectIO(v), o.direct); }},
    {"queue_depth", "TENSORFERRY_QUEUE_DEPTH", SetCount<&LoadOptions::queue_depth, kU32, false>},
    {"budget", "TENSORFERRY_BUDGET", SetSize<&LoadOptions::budget, true>},
    {"allow_oversized", "", SetBool<&LoadOptions::allow_oversized>},
    {"order", "TENSORFERRY_ORDER",
     [](LoadOptions& o, std::string_view v) { return Assign(ParseDeliveryOrder(v), o.order); }},
    {"pool_bytes", "TENSORFERRY_POOL_BYTES", SetSize<&LoadOptions::pool_bytes, true>},
    {"populate", "TENSORFERRY_POPULATE", SetBool<&LoadOptions::populate>},
    {"prefer_mmap", "TENSORFERRY_PREFER_MMAP", SetBool<&LoadOptions::prefer_mmap>},
    {"memory_limit", "TENSORFERRY_MEMORY_LIMIT",
     [](LoadOptions& o, std::string_view v) -> Status {
       if (v == "off" || v == "none") {
         o.memory_limit = UINT64_MAX;
         return Status::Ok();
       }
       return SetSize<&LoadOptions::memory_limit, true>(o, v);
     }},
    {"drop_cache", "TENSORFERRY_DROP_CACHE", SetBool<&LoadOptions::drop_cache>},
    {"device", "TENSORFERRY_DEVICE",
     [](LoadOptions& o, std::string_view v) { return Assign(ParseDevice(v), o.device); }},
    {"gds", "TENSORFERRY_GDS",
     [](LoadOptions& o, std::string_view v) { return Assign(ParseGdsMode(v), o.gds); }},
    {"staging_bytes", "TENSORFERRY_STAGING_BYTES", SetSize<&LoadOptions::staging_bytes, false>},
    {"staging_slot", "TENSORFERRY_STAGING_SLOT", SetSize<&LoadOptions::staging_slot, false>},
    {"device_producers", "TENSORFERRY_DEVICE_PRODUCERS",
     SetCount<&LoadOptions::device_producers, kMaxThreads, true>},
    {"device_budget", "TENSORFERRY_DEVICE_BUDGET", SetSize<&LoadOptions::device_budget, true>},
    {"keep_staging", "TENSORFERRY_KEEP_STAGING", SetBool<&LoadOptions::keep_staging>},
    {"tp_rank", "",
     [](LoadOptions& o, std::string_view v) -> Status {
       TF_ASSIGN_OR_RETURN(uint64_t rank, Count(v, kU32 - 1));
       TensorParallel(o).rank = static_cast<uint32_t>(rank);
       return Status::Ok();
     }},
    {"tp_size", "",
     [](LoadOptions& o, std::string_view v) -> Status {
       TF_ASSIGN_OR_RETURN(uint64_t world, Count(v, kU32));
       TensorParallel(o).world = static_cast<uint32_t>(world);
       return Status::Ok();
     }},
    {"shard_rules", "", SetShardRules},
    {"shard_max_gap", "",
     [](LoadOptions& o, std::string_view v) -> Status {
       TF_ASSIGN_OR_RETURN(uint64_t gap, Size(v, true));
       TensorParallel(o).max_gap = gap;
       o.tensor_parallel->exact_when_cached = false;  // an explicit gap applies to every file
       return Status::Ok();
     }},
    // S3 settings: the AWS_* variables and files are read when a URL is opened (object_store.h);
    // these override them.
    {"s3_endpoint", "", SetText<&ObjectStoreOptions::endpoint>},
    {"s3_region", "", SetText<&ObjectStoreOptions::region>},
    {"s3_profile", "", SetText<&ObjectStoreOptions::profile>},
    {"s3_access_key_id", "", SetText<&ObjectStoreOptions::access_key_id>},
    {"s3_secret_access_key", "", SetText<&ObjectStoreOptions::secret_access_key>},
    {"s3_session_token", "", SetText<&ObjectStoreOptions::session_token>},
    {"s3_anonymous", "", SetTriState<&ObjectStoreOptions::anonymous>},
    {"s3_path_style", "", SetTriState<&ObjectStoreOptions::path_style>},
    // gs:// URLs: an OAuth 2 access token (else GOOGLE_OAUTH_ACCESS_TOKEN, then Google's
    // application default credentials; gcs_auth.h).
    {"gcs_token", "", SetText<&ObjectStoreOptions::gcs_token>},
    // http(s):// URLs: a bearer token for the origin (else HF_TOKEN for the Hugging Face hub's
    // hosts; http_auth.h).
    {"http_token", "", SetText<&ObjectStoreOptions::http_token>},
    {"object_concurrency", "TENSORFERRY_OBJECT_CONCURRENCY",
     SetObjectNumberOrAuto<&ObjectStoreOptions::concurrency, 1, kMaxThreads>},
    {"object_part_size", "TENSORFERRY_OBJECT_PART_SIZE",
     SetObjectNumberOrAuto<&ObjectStoreOptions::part_size, 4096, (1ull << 32)>},
    {"object_retries", "TENSORFERRY_OBJECT_RETRIES",
     SetObjectNumber<&ObjectStoreOptions::retries, 0, 100>},
    {"object_timeout_ms", "TENSORFERRY_OBJECT_TIMEOUT_MS",
     SetObjectNumber<&ObjectStoreOptions::timeout_ms, 100, 3'600'000>},
    {"object_header_bytes", "TENSORFERRY_OBJECT_HEADER_BYTES",
     SetObjectNumber<&ObjectStoreOptions::header_bytes, 8, (256ull << 20)>},
    {"object_verify_tls", "TENSORFERRY_OBJECT_VERIFY_TLS",
     SetObjectBool<&ObjectStoreOptions::verify_tls>},
    {"object_ca_bundle", "TENSORFERRY_OBJECT_CA_BUNDLE", SetText<&ObjectStoreOptions::ca_bundle>},
    {"object_cache_dir", "TENSORFERRY_OBJECT_CACHE_DIR", SetText<&ObjectStoreOptions::cache_dir>},
    {"object_cache_max", "TENSORFERRY_OBJECT_CACHE_MAX",
     SetObjectNumber<&ObjectStoreOptions::cache_max, 0, UINT64_MAX>},
    {"object_hub_cache", "TENSORFERRY_OBJECT_HUB_CACHE",
     SetObjectBool<&ObjectStoreOptions::hub_cache>},
    {"object_cache_write_behind", "TENSORFERRY_OBJECT_CACHE_WRITE_BEHIND",
     SetObjectNumber<&ObjectStoreOptions::cache_write_behind, 0, (16ull << 30)>},
    {"object_cache_fetch_once", "TENSORFERRY_OBJECT_CACHE_FETCH_ONCE",
     SetObjectBool<&ObjectStoreOptions::cache_fetch_once>},
    {"verify", "TENSORFERRY_VERIFY",
     [](LoadOptions& o, std::string_view v) { return Assign(ParseVerifyMode(v), o.verify); }},
    {"coop_exchange", "TENSORFERRY_COOP_EXCHANGE",
     [](LoadOptions& o,
        std::string_view v) { return Assign(ParseExchangeChoice(v), o.cooperative.exchange); }},
    {"coop_storage_rate", "TENSORFERRY_COOP_STORAGE_RATE",
     [](LoadOptions& o, std::string_view v) -> Status {
       TF_ASSIGN_OR_RETURN(o.cooperative.storage_rate, Size(v, true));
       return Status::Ok();
     }},
    {"coop_timeout_ms", "TENSORFERRY_COOP_TIMEOUT_MS",
     [](LoadOptions& o, std::string_view v) -> Status {
       // At most about 31 years: the watchdog adds it to the clock (larger values overflowed and
       // aborted every load at its first step).
       TF_ASSIGN_OR_RETURN(o.cooperative.timeout_ms, Count(v, kMaxCoopTimeoutMs));
       return Status::Ok();
     }},
    {"coop_network_rate", "TENSORFERRY_COOP_NETWORK_RATE",
     [](LoadOptions& o, std::string_view v) -> Status {
       TF_ASSIGN_OR_RETURN(o.cooperative.network_rate, Size(v, true));
       return Status::Ok();
     }},
    {"coop_probe_bytes", "TENSORFERRY_COOP_PROBE_BYTES",
     [](LoadOptions& o, std::string_view v) -> Status {
       TF_ASSIGN_OR_RETURN(o.cooperative.probe_bytes, Size(v, true));
       if (o.cooperative.probe_bytes > (uint64_t{1} << 30)) return Why("is more than 1GiB");
       return Status::Ok();
     }},
}};

std::array<std::string_view, kKeys.size()> KeyNames() {
  std::array<std::string_view, kKeys.size()> names;
  for (size_t i = 0; i < kKeys.size(); ++i) names[i] = kKeys[i].key;
  return names;
}

const Key* FindKey(std::string_view key) {
  for (const Key& k : kKeys) {
    if (k.key == key) return &k;
  }
  return nullptr;
}

}  // namespace

std::span<const std::string_view> LoadOptionKeys() noexcept {
  static const auto names = KeyNames();
  return names;
}

std::string LoadOptionVariable(std::string_view key) {
  const Key* k = FindKey(key);
  return k ? std::string(k->variable) : std::string();
}

Status LoadOptions::Set(std::string_view key, std::string_view value) {
  const Key* k = FindKey(key);
  if (k == nullptr) {
    std::string known;
    for (std::string_view name : LoadOptionKeys()) {
      if (!known.empty()) known += ", ";
      known += name;
    }
    return Status(Code::kInvalidArgument,
                  "unknown load option \"" + std::string(key) + "\" (" + known + ")");
  }
  const std::string head = std::string(key) + " = " + std::string(value);
  if (value.empty()) return Status(Code::kInvalidArgument, std::string(key) + ": empty value");
  LoadOptions changed = *this;  // unchanged on error
  const Status s = k->set(changed, value);
  if (!s.ok()) {
    const std::string& why = s.message();
    const bool phrase = why.rfind("is ", 0) == 0 || why.rfind("must ", 0) == 0;
    return Status(s.code(), head + (phrase ? " " : ": ") + why);
  }
  *this = std::move(changed);
  return Status::Ok();
}

void LoadOptions::SetShardSpec(ShardSpec spec) {
  TensorParallel(*this).spec = std::move(spec);
}

Status SetContext(LoadOptions& options, std::string_view key, std::string_view value,
                  std::string_view where) {
  return options.Set(key, value).WithPrefix(where);
}

Result<LoadOptions> LoadOptions::Validated() const {
  if (chunk_size == 0) return Status(Code::kInvalidArgument, "chunk_size must be > 0");
  if (queue_depth == 0) return Status(Code::kInvalidArgument, "queue_depth must be > 0");
  if (staging_bytes == 0) return Status(Code::kInvalidArgument, "staging_bytes must be > 0");
  if (staging_slot == 0) return Status(Code::kInvalidArgument, "staging_slot must be > 0");
  // Enumerations set by a cast from a number (the Set path parses names): one past the last value
  // is no engine to run.
  if (static_cast<unsigned>(engine) > static_cast<unsigned>(Engine::kMmap)) {
    return Status(Code::kInvalidArgument,
                  "engine " + std::to_string(static_cast<unsigned>(engine)) + " is not an Engine");
  }
  if (static_cast<unsigned>(direct) > static_cast<unsigned>(DirectIO::kOff)) {
    return Status(Code::kInvalidArgument,
                  "direct " + std::to_string(static_cast<unsigned>(direct)) + " is not a DirectIO");
  }
  if (static_cast<unsigned>(order) > static_cast<unsigned>(DeliveryOrder::kLayer)) {
    return Status(Code::kInvalidArgument, "order " + std::to_string(static_cast<unsigned>(order)) +
                                              " is not a DeliveryOrder");
  }
  if (static_cast<unsigned>(gds) > static_cast<unsigned>(GdsMode::kOff)) {
    return Status(Code::kInvalidArgument,
                  "gds " + std::to_string(static_cast<unsigned>(gds)) + " is not a GdsMode");
  }
  if (static_cast<unsigned>(verify) > static_cast<unsigned>(VerifyMode::kOff)) {
    return Status(
        Code::kInvalidArgument,
        "verify " + std::to_string(static_cast<unsigned>(verify)) + " is not a VerifyMode");
  }
  if (static_cast<unsigned>(cooperative.exchange) > static_cast<unsigned>(ExchangeChoice::kNone)) {
    return Status(Code::kInvalidArgument,
                  "coop_exchange " + std::to_string(static_cast<unsigned>(cooperative.exchange)) +
                      " is not an ExchangeChoice");
  }
  // Clamped, not refused: a tiny chunk only multiplies per-read costs (and plan memory: one task
  // per chunk), and threads beyond kMaxThreads only cost memory and start-up time.
  // Settings that contradict each other are refused rather than ignored (direct, populate and gds
  // are per-engine or per-device settings: what does not use one ignores it, so that a variable
  // set for a process does not fail its other loads).
  if (drop_cache && engine == Engine::kMmap) {
    return Status(Code::kInvalidArgument,
                  "drop_cache does not go with engine mmap: the tensors are the page cache's "
                  "pages (use a copying engine, pread or io_uring)");
  }
  LoadOptions o = *this;
  o.chunk_size = std::max(o.chunk_size, kMinChunkSize);
  o.threads = std::min(o.threads, kMaxThreads);
  o.queue_depth = std::min(o.queue_depth, kMaxQueueDepth);
  if (o.tensor_parallel) {
    const TensorParallelOptions& tp = *o.tensor_parallel;
    if (tp.rank == kUnsetTpRank || tp.world == 0) {
      // What was given, in the words of the keys the caller set.
      std::string given = " (shard_rules or shard_max_gap given without them)";
      if (tp.rank != kUnsetTpRank) {
        given = " (tp_rank " + std::to_string(tp.rank) + " without tp_size, or tp_size 0)";
      }
      if (tp.world != 0) given = " (tp_size " + std::to_string(tp.world) + " without tp_rank)";
      return Status(Code::kInvalidArgument,
                    "tp_rank and tp_size go together, tp_size at least 1" + given);
    }
    if (tp.rank >= tp.world) {
      const std::string rank = std::to_string(tp.rank), world = std::to_string(tp.world);
      return Status(Code::kInvalidArgument, "tensor parallelism: rank " + rank + " of " + world +
                                                ": tp_rank " + rank + " is not below tp_size " +
                                                world);
    }
    TF_RETURN_IF_ERROR(tp.spec.Validate());
  }
  return o;
}

namespace {

// Edits (insertions, deletions, substitutions, swaps of neighbours) between a and b.
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> before(b.size() + 1), row(b.size() + 1), now(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    now[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      now[j] = std::min({row[j] + 1, now[j - 1] + 1, row[j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        now[j] = std::min(now[j], before[j - 2] + 1);
      }
    }
    before.swap(row);
    row.swap(now);
  }
  return row[b.size()];
}

}  // namespace

std::vector<std::string> UnknownEnvironmentVariables() {
  // Read outside the options table: by the library (run-time libraries to load), and by the test
  // suite and scripts (tests/python/test_options.py checks that the sources read no other).
  static constexpr std::array<std::string_view, 11> kOthers = {
      "TENSORFERRY_CUDA_RUNTIME", "TENSORFERRY_CUFILE_LIBRARY",
      "TENSORFERRY_CURL_LIBRARY", "TENSORFERRY_CLI",
      "TENSORFERRY_KIT",          "TENSORFERRY_TESTS_OFFLINE",
      "TENSORFERRY_TEST_S3_URL",  "TENSORFERRY_TEST_S3_LOCAL",
      "TENSORFERRY_VLLM_PYTHON",  "TENSORFERRY_CGROUP_TEST_GIB",
      "TENSORFERRY_FAKE_CUDA"};
  std::vector<std::string_view> known(kOthers.begin(), kOthers.end());
  for (const Key& k : kKeys) {
    if (!k.variable.empty()) known.push_back(k.variable);
  }
  constexpr std::string_view kPrefix = "TENSORFERRY_";
  std::vector<std::string> unknown;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (!name.starts_with(kPrefix) || std::find(known.begin(), known.end(), name) != known.end()) {
      continue;
    }
    std::string_view closest;
    size_t best = 4;  // at most 3 edits away, and nearer than any other
    for (std::string_view k : known) {
      const size_t d = EditDistance(name.substr(kPrefix.size()), k.substr(kPrefix.size()));
      if (d < best) {
        best = d;
        closest = k;
      }
    }
    unknown.push_back(std::string(name) + " is not a tensorferry setting: it is ignored" +
                      (closest.empty() ? "" : " (did you mean " + std::string(closest) + "?)"));
  }
  std::sort(unknown.begin(), unknown.end());
  return unknown;
}

Result<LoadOptions> LoadOptions::FromEnvironment() {
  LoadOptions o;
  for (const Key& k : kKeys) {
    if (k.variable.empty()) continue;
    const char* v = std::getenv(std::string(k.variable).c_str());
    if (v == nullptr || *v == '\0') continue;
    TF_RETURN_IF_ERROR(
        SetContext(o, k.key, v, std::string(k.variable) + "=\"" + std::string(v) + "\""));
  }
  return o;
}

}  // namespace tensorferry
