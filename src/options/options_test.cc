// LoadOptions::Set / Validated / FromEnvironment (tensorferry/options.h): every key, bad values,
// clamps.
#include "tensorferry/options.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "testing/test_util.h"

namespace tensorferry {
namespace {

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

LoadOptions MustSet(std::initializer_list<std::pair<const char*, const char*>> values) {
  LoadOptions o;
  for (const auto& [key, value] : values) {
    const Status s = o.Set(key, value);
    EXPECT_TRUE(s.ok()) << key << "=" << value << ": " << s.ToString();
  }
  return o;
}

TEST(LoadOptionsSet, EveryKey) {
  const LoadOptions o = MustSet({{"engine", "pread"},
                                 {"threads", "7"},
                                 {"chunk_size", "1MiB"},
                                 {"direct", "on"},
                                 {"queue_depth", "32"},
                                 {"budget", "2GB"},
                                 {"allow_oversized", "yes"},
                                 {"order", "layer"},
                                 {"pool_bytes", "0"},
                                 {"populate", "true"},
                                 {"prefer_mmap", "on"},
                                 {"memory_limit", "3GiB"},
                                 {"drop_cache", "1"},
                                 {"device", "cuda:1"},
                                 {"gds", "off"},
                                 {"staging_bytes", "32MiB"},
                                 {"staging_slot", "4MiB"},
                                 {"device_producers", "2"},
                                 {"device_budget", "1GiB"},
                                 {"keep_staging", "no"},
                                 {"tp_rank", "1"},
                                 {"tp_size", "4"},
                                 {"shard_rules", "none"},
                                 {"shard_max_gap", "0"},
                                 {"s3_endpoint", "http://127.0.0.1:9000"},
                                 {"s3_region", "eu-west-1"},
                                 {"s3_profile", "dev"},
                                 {"s3_access_key_id", "AK"},
                                 {"s3_secret_access_key", "SK"},
                                 {"s3_session_token", "ST"},
                                 {"s3_anonymous", "0"},
                                 {"s3_path_style", "1"},
                                 {"gcs_token", "ya29.x"},
                                 {"object_concurrency", "8"},
                                 {"object_part_size", "16MiB"},
                                 {"object_retries", "2"},
                                 {"object_timeout_ms", "5000"},
                                 {"object_header_bytes", "64KiB"},
                                 {"object_verify_tls", "0"},
                                 {"object_ca_bundle", "/etc/ssl/ca.pem"},
                                 {"object_cache_dir", "/var/cache/tf"},
                                 {"object_cache_max", "100GiB"},
                                 {"object_hub_cache", "off"},
                                 {"object_cache_write_behind", "8MiB"},
                                 {"object_cache_fetch_once", "1"},
                                 {"coop_exchange", "none"},
                                 {"coop_storage_rate", "500MB"},
                                 {"coop_network_rate", "125MB"},
                                 {"coop_timeout_ms", "20000"},
                                 {"coop_probe_bytes", "4MiB"}});
  EXPECT_EQ(o.engine, Engine::kPread);
  EXPECT_EQ(o.threads, 7u);
  EXPECT_EQ(o.chunk_size, 1u << 20);
  EXPECT_EQ(o.direct, DirectIO::kOn);
  EXPECT_EQ(o.queue_depth, 32u);
  EXPECT_EQ(o.budget, 2000000000u);
  EXPECT_TRUE(o.allow_oversized);
  EXPECT_EQ(o.order, DeliveryOrder::kLayer);
  EXPECT_EQ(o.pool_bytes, 0u);
  EXPECT_TRUE(o.populate);
  EXPECT_TRUE(o.prefer_mmap);
  EXPECT_EQ(o.memory_limit, 3ull << 30);
  EXPECT_TRUE(o.drop_cache);
  LoadOptions off;
  EXPECT_TRUE(off.Set("memory_limit", "off").ok());
  EXPECT_EQ(off.memory_limit, UINT64_MAX);
  EXPECT_EQ(o.device, (Device{DeviceKind::kCUDA, 1}));
  EXPECT_EQ(o.gds, GdsMode::kOff);
  EXPECT_EQ(o.staging_bytes, 32u << 20);
  EXPECT_EQ(o.staging_slot, 4u << 20);
  EXPECT_EQ(o.device_producers, 2u);
  EXPECT_EQ(o.device_budget, 1u << 30);
  EXPECT_FALSE(o.keep_staging);
  ASSERT_TRUE(o.tensor_parallel.has_value());
  EXPECT_EQ(o.tensor_parallel->rank, 1u);
  EXPECT_EQ(o.tensor_parallel->world, 4u);
  EXPECT_EQ(o.tensor_parallel->max_gap, 0u);
  EXPECT_FALSE(o.tensor_parallel->exact_when_cached);  // an explicit gap applies to every file
  const ObjectStoreOptions& os = o.object_store;
  EXPECT_EQ(os.endpoint, "http://127.0.0.1:9000");
  EXPECT_EQ(os.region, "eu-west-1");
  EXPECT_EQ(os.profile, "dev");
  EXPECT_EQ(os.access_key_id, "AK");
  EXPECT_EQ(os.secret_access_key, "SK");
  EXPECT_EQ(os.session_token, "ST");
  EXPECT_EQ(os.anonymous, 0);
  EXPECT_EQ(os.path_style, 1);
  EXPECT_EQ(os.gcs_token, "ya29.x");
  EXPECT_EQ(os.concurrency, 8u);
  EXPECT_EQ(os.part_size, 16u << 20);
  EXPECT_EQ(os.retries, 2u);
  EXPECT_EQ(os.timeout_ms, 5000u);
  EXPECT_EQ(os.header_bytes, 64u << 10);
  EXPECT_FALSE(os.verify_tls);
  EXPECT_EQ(os.ca_bundle, "/etc/ssl/ca.pem");
  EXPECT_EQ(os.cache_dir, "/var/cache/tf");
  EXPECT_EQ(os.cache_max, 100ull << 30);
  EXPECT_FALSE(os.hub_cache);
  EXPECT_EQ(os.cache_write_behind, 8u << 20);
  EXPECT_TRUE(os.cache_fetch_once);
  EXPECT_EQ(o.cooperative.exchange, ExchangeChoice::kNone);
  EXPECT_EQ(o.cooperative.storage_rate, 500'000'000u);
  EXPECT_EQ(o.cooperative.network_rate, 125'000'000u);
  EXPECT_EQ(o.cooperative.timeout_ms, 20'000u);
  EXPECT_EQ(o.cooperative.probe_bytes, 4u << 20);
  EXPECT_TRUE(o.Validate().ok()) << o.Validate().ToString();

  // LoadOptionKeys lists exactly the keys Set accepts, each once.
  std::set<std::string_view> keys(LoadOptionKeys().begin(), LoadOptionKeys().end());
  EXPECT_EQ(keys.size(), LoadOptionKeys().size());
  EXPECT_EQ(keys.size(), 52u);

  // The per-store defaults (0) can be set again over a value ("auto" or 0): a variable set for
  // the process could not be undone by a keyword or a flag.
  for (const char* reset : {"auto", "0"}) {
    LoadOptions r = o;
    ASSERT_TRUE(r.Set("object_concurrency", reset).ok()) << reset;
    ASSERT_TRUE(r.Set("object_part_size", reset).ok()) << reset;
    EXPECT_EQ(r.object_store.concurrency, 0u);
    EXPECT_EQ(r.object_store.part_size, 0u);
  }
}

TEST(LoadOptionsSet, BadValuesNameKeyAndValueAndLeaveOptionsUnchanged) {
  struct Case {
    const char* key;
    const char* value;
    const char* words;
  };
  for (const Case& c :
       {Case{"engine", "fast", "engine = fast: unknown engine"},
        Case{"threads", "-1", "threads = -1 is not a count"},
        Case{"threads", "4294967296", "threads = 4294967296 is out of range"},
        Case{"threads", "99999999999999999999999", "is out of range"},
        Case{"chunk_size", "0", "chunk_size = 0 must be > 0"},
        Case{"chunk_size", "1XB", "chunk_size = 1XB is not a size"},
        Case{"budget", "18446744073709551616",
             "budget = 18446744073709551616 "
             "is out of range"},
        Case{"budget", "99999999999999999999G", "budget = 99999999999999999999G is out of range"},
        Case{"budget", "18.5E", "budget = 18.5E is out of range"},
        Case{"budget", "0.4", "budget = 0.4 is less than one byte"},
        Case{"direct", "maybe", "unknown O_DIRECT mode"},
        Case{"queue_depth", "0", "queue_depth = 0 must be > 0"},
        // Added to the clock by the watchdog: larger values overflowed (every load aborted).
        Case{"coop_timeout_ms", "1000000000001",
             "coop_timeout_ms = 1000000000001 is out of range (at most 1000000000000)"},
        Case{"coop_timeout_ms", "18446744073709551615", "is out of range"},
        // A CUDA stream each, made at open (4294967295 ran the process out of threads).
        Case{"device_producers", "257", "device_producers = 257 is out of range (at most 256)"},
        Case{"allow_oversized", "sure", "is not a boolean"},
        Case{"order", "random", "order = random: unknown order"},
        Case{"populate", "auto", "is not a boolean"},
        Case{"memory_limit", "lots", "memory_limit = lots is not a size"},
        Case{"drop_cache", "maybe", "is not a boolean"}, Case{"device", "tpu", "device = tpu"},
        Case{"gds", "always", "gds = always"}, Case{"staging_bytes", "0", "must be > 0"},
        Case{"staging_slot", "0", "must be > 0"}, Case{"tp_rank", "4294967295", "is out of range"},
        Case{"shard_rules", "{\"nope\": 1}", "shard_rules = "},
        Case{"coop_exchange", "some", "coop_exchange = some: unknown exchange"},
        Case{"coop_network_rate", "fast", "coop_network_rate = fast is not a size"},
        Case{"coop_probe_bytes", "2GiB", "coop_probe_bytes = 2GiB is more than 1GiB"},
        Case{"budget", "", "budget: empty value"},
        Case{"speed", "11", "unknown load option \"speed\""}}) {
    LoadOptions o;
    const Status s = o.Set(c.key, c.value);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << c.key << "=" << c.value;
    EXPECT_TRUE(Contains(s.message(), c.words)) << s.message();
    EXPECT_FALSE(o.tensor_parallel.has_value()) << c.key;
    EXPECT_EQ(o.budget, 0u);
  }
  LoadOptions o;
  const Status s = SetContext(o, "budget", "lots", "--budget");
  EXPECT_EQ(s.message().rfind("--budget: budget = lots is not a size", 0), 0u) << s.message();
}

TEST(LoadOptionsValidated, ClampsAndRefusals) {
  LoadOptions o;
  o.chunk_size = 1;
  o.threads = 100000;
  o.queue_depth = 1u << 20;
  auto v = o.Validated();
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->chunk_size, kMinChunkSize);
  EXPECT_EQ(v->threads, kMaxThreads);
  EXPECT_EQ(v->queue_depth, kMaxQueueDepth);
  EXPECT_EQ(o.chunk_size, 1u);  // the original is untouched

  o = LoadOptions();
  o.chunk_size = 0;
  EXPECT_TRUE(Contains(o.Validate().message(), "chunk_size must be > 0"));
  o = LoadOptions();
  o.queue_depth = 0;
  EXPECT_TRUE(Contains(o.Validate().message(), "queue_depth must be > 0"));
  o = LoadOptions();
  o.staging_slot = 0;
  EXPECT_TRUE(Contains(o.Validate().message(), "staging_slot must be > 0"));
  o = LoadOptions();
  o.staging_bytes = 0;
  EXPECT_TRUE(Contains(o.Validate().message(), "staging_bytes must be > 0"));
  // An enumeration set from a number that names none of its values (a typed edge's cast).
  o = LoadOptions();
  o.engine = static_cast<Engine>(9);
  EXPECT_TRUE(Contains(o.Validate().message(), "engine 9 is not an Engine"));
  o = LoadOptions();
  o.direct = static_cast<DirectIO>(3);
  EXPECT_EQ(o.Validate().code(), Code::kInvalidArgument);
  o = LoadOptions();
  o.order = static_cast<DeliveryOrder>(2);
  EXPECT_EQ(o.Validate().code(), Code::kInvalidArgument);
  o = LoadOptions();
  o.gds = static_cast<GdsMode>(3);
  EXPECT_EQ(o.Validate().code(), Code::kInvalidArgument);
  o = LoadOptions();
  o.verify = static_cast<VerifyMode>(3);
  EXPECT_EQ(o.Validate().code(), Code::kInvalidArgument);
  o = LoadOptions();
  o.cooperative.exchange = static_cast<ExchangeChoice>(3);
  EXPECT_EQ(o.Validate().code(), Code::kInvalidArgument);

  // Tensor parallelism: both keys, rank below size, a valid spec.
  EXPECT_TRUE(Contains(MustSet({{"tp_size", "2"}}).Validate().message(),
                       "tp_rank and tp_size go together"));
  EXPECT_TRUE(Contains(MustSet({{"tp_rank", "0"}}).Validate().message(),
                       "tp_rank and tp_size go together"));
  EXPECT_TRUE(Contains(
      MustSet({{"shard_max_gap", "1MB"}}).Validate().message(),
      "tp_rank and tp_size go together, tp_size at least 1 (shard_rules or shard_max_gap given"));
  EXPECT_TRUE(Contains(MustSet({{"tp_rank", "0"}, {"tp_size", "0"}}).Validate().message(),
                       "(tp_rank 0 without tp_size, or tp_size 0)"));
  // Settings that contradict each other.
  EXPECT_TRUE(Contains(MustSet({{"engine", "mmap"}, {"drop_cache", "1"}}).Validate().message(),
                       "drop_cache does not go with engine mmap"));
  EXPECT_TRUE(Contains(MustSet({{"tp_rank", "2"}, {"tp_size", "2"}}).Validate().message(),
                       "tp_rank 2 is not below tp_size 2"));
  EXPECT_TRUE(MustSet({{"tp_size", "2"}, {"tp_rank", "1"}}).Validate().ok());
  o = LoadOptions();
  o.tensor_parallel = TensorParallelOptions{ShardSpec::Builtin(), 0, 0};
  EXPECT_EQ(o.Validate().code(), Code::kInvalidArgument);
}

TEST(LoadOptionsEnvironment, VariablesGoThroughSet) {
  EXPECT_EQ(LoadOptionVariable("direct"), "TENSORFERRY_DIRECT_IO");
  EXPECT_EQ(LoadOptionVariable("chunk_size"), "TENSORFERRY_CHUNK_SIZE");
  EXPECT_EQ(LoadOptionVariable("tp_rank"), "");
  ::setenv("TENSORFERRY_CHUNK_SIZE", "64KiB", 1);
  ::setenv("TENSORFERRY_DEVICE_BUDGET", "1GB", 1);
  ::setenv("TENSORFERRY_THREADS", "5000", 1);  // accepted; Validated clamps it
  auto o = LoadOptions::FromEnvironment();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->chunk_size, 64u << 10);
  EXPECT_EQ(o->device_budget, 1000000000u);
  EXPECT_EQ(o->threads, 5000u);
  ::setenv("TENSORFERRY_QUEUE_DEPTH", "0", 1);
  auto bad = LoadOptions::FromEnvironment();
  EXPECT_TRUE(Contains(bad.status().message(),
                       "TENSORFERRY_QUEUE_DEPTH=\"0\": queue_depth = 0 must be > 0"))
      << bad.status().message();
  for (const char* v : {"TENSORFERRY_CHUNK_SIZE", "TENSORFERRY_DEVICE_BUDGET",
                        "TENSORFERRY_THREADS", "TENSORFERRY_QUEUE_DEPTH"}) {
    ::unsetenv(v);
  }
}

// A misspelt variable would be ignored without a word: it is named, with the nearest known name
// when one is at most 3 edits away; known variables, the library's others and the test suite's
// are not named.
TEST(LoadOptionsEnvironment, UnknownVariablesAreNamedWithTheNearestKnownOne) {
  std::vector<std::string> want = UnknownEnvironmentVariables();  // the caller's, if any
  testing::ScopedEnv typo("TENSORFERRY_BUGDET", "1GB");
  testing::ScopedEnv swapped("TENSORFERRY_TRHEADS", "4");
  testing::ScopedEnv far("TENSORFERRY_NOTHING_LIKE_IT", "1");
  testing::ScopedEnv known("TENSORFERRY_BUDGET", "1GB");
  testing::ScopedEnv library("TENSORFERRY_CURL_LIBRARY", "/x.so");
  testing::ScopedEnv suite("TENSORFERRY_TEST_S3_URL", "http://x");
  testing::ScopedEnv other("NOT_TENSORFERRY_BUGDET", "1");
  want.insert(want.end(),
              {"TENSORFERRY_BUGDET is not a tensorferry setting: it is ignored (did you mean "
               "TENSORFERRY_BUDGET?)",
               "TENSORFERRY_NOTHING_LIKE_IT is not a tensorferry setting: it is ignored",
               "TENSORFERRY_TRHEADS is not a tensorferry setting: it is ignored (did you mean "
               "TENSORFERRY_THREADS?)"});
  std::sort(want.begin(), want.end());
  EXPECT_EQ(UnknownEnvironmentVariables(), want);
}

TEST(LoadOptionsNames, RoundTrip) {
  for (DeliveryOrder d : {DeliveryOrder::kFile, DeliveryOrder::kLayer}) {
    EXPECT_EQ(*ParseDeliveryOrder(DeliveryOrderName(d)), d);
  }
  EXPECT_EQ(*ParseBool("no"), false);
  EXPECT_EQ(*ParseBool("1"), true);
  EXPECT_EQ(ParseBool("2").status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace tensorferry
