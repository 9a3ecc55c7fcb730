// `tensorferry doctor` and `tensorferry load --device` end to end: the CLI runs as a child process
// with the fake CUDA runtime and cuFile selected through the environment variables users would set.
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "cli_testing.h"
#include "tensorferry/loader.h"
#include "tensorferry/memory_limit.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using testing::RunCli;
using testing::RunResult;

TEST(DoctorCliTest, ReportsTheFakeDeviceAndGdsAsJson) {
  const RunResult r =
      RunCli({"doctor", "--json"}, {{"TENSORFERRY_CUDA_RUNTIME", TENSORFERRY_FAKE_CUDA_PATH},
                                    {"TENSORFERRY_CUFILE_LIBRARY", TENSORFERRY_FAKE_CUDA_PATH}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(r.out).get(doc), simdjson::SUCCESS) << r.out;
  EXPECT_TRUE(doc["cuda_available"].get_bool().value());
  EXPECT_EQ(std::string(doc["runtime"]["path"].get_string().value()), TENSORFERRY_FAKE_CUDA_PATH);
  EXPECT_EQ(std::string(doc["runtime"]["version"].get_string().value()), "13.0");
  simdjson::dom::array devices = doc["devices"].get_array().value();
  ASSERT_EQ(devices.size(), 1u);
  EXPECT_EQ(std::string(devices.at(0)["name"].get_string().value()), "tensorferry fake GPU 0");
  EXPECT_EQ(std::string(devices.at(0)["pci_bus_id"].get_string().value()), "0000:10:00.0");
  EXPECT_EQ(devices.at(0)["total_memory"].get_uint64().value(), 1ull << 30);
  EXPECT_TRUE(doc["cufile"]["driver_opened"].get_bool().value());
  EXPECT_TRUE(doc["gds"]["usable"].get_bool().value());
  // How auto reads local files here: the same answer as the library's, with its reason if not.
  const Status io_uring = EngineAvailable(Engine::kIoUring);
  EXPECT_EQ(doc["io_uring"]["available"].get_bool().value(), io_uring.ok());
  EXPECT_EQ(std::string(doc["io_uring"]["error"].get_string().value()),
            io_uring.ok() ? "" : io_uring.message());
  EXPECT_TRUE(EngineAvailable(Engine::kPread).ok());
  EXPECT_TRUE(EngineAvailable(Engine::kMmap).ok());
  // What a load without a budget may fill: 3/4 of what this process may use, as Loader::Open
  // (read in another process a moment apart: within 10% of what this one reads).
  const double here = static_cast<double>(ReadMemoryLimit().DefaultLoadLimit());
  const auto there = static_cast<double>(doc["memory"]["load_memory_limit"].get_uint64().value());
  EXPECT_NEAR(there, here, here / 10);
  EXPECT_EQ(std::string(doc["memory"]["load_memory_limit_from"].get_string().value()),
            here > 0 ? "3/4 of what this process may use" : "unknown (no check)");
}

TEST(DoctorCliTest, ReportsTheLoadMemoryLimitTheEnvironmentSets) {
  const RunResult r = RunCli({"doctor", "--json"}, {{"TENSORFERRY_MEMORY_LIMIT", "100KB"}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(r.out).get(doc), simdjson::SUCCESS) << r.out;
  EXPECT_EQ(doc["memory"]["load_memory_limit"].get_uint64().value(), 100000u);
  EXPECT_EQ(std::string(doc["memory"]["load_memory_limit_from"].get_string().value()),
            "TENSORFERRY_MEMORY_LIMIT");
}

TEST(DoctorCliTest, SaysWhichRuntimeItTriedWhenNoneLoads) {
  const RunResult r =
      RunCli({"doctor"}, {{"TENSORFERRY_CUDA_RUNTIME", "/nonexistent/libcudart.so.13"},
                          {"TENSORFERRY_CUFILE_LIBRARY", std::nullopt}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("CUDA runtime: not loaded: CUDA runtime (libcudart) not found; tried: "
                       "/nonexistent/libcudart.so.13"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("GPUDirect Storage: not usable: no usable CUDA device"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.err, "");
}

TEST(DoctorCliTest, TextReportNamesDevicesAndCufile) {
  const RunResult r = RunCli({"doctor", "--quick"},
                             {{"TENSORFERRY_CUDA_RUNTIME", TENSORFERRY_FAKE_CUDA_PATH},
                              {"TENSORFERRY_CUFILE_LIBRARY", "/nonexistent/libcufile.so.0"}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("devices: 1\n  0: tensorferry fake GPU 0, 0000:10:00.0, compute 9.0, "
                       "1.07 GB total"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("cuFile: not loaded: cuFile library (libcufile) not found; tried: "
                       "/nonexistent/libcufile.so.0"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("GPUDirect Storage: not usable: cuFile is not installed"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(EngineAvailable(Engine::kIoUring).ok()
                           ? "reads: io_uring available: local files are read with io_uring"
                           : "reads: io_uring unavailable ("),
            std::string::npos)
      << r.out;
}

// `doctor --quick --json URL`'s object_store section (and the whole output, for searching).
struct StoreReport {
  RunResult run;
  std::string url, store, request_url, settings, settings_code, probe, probe_message;
};
StoreReport DoctorStore(const std::string& url,
                        const std::map<std::string, std::optional<std::string>>& env = {}) {
  StoreReport r;
  r.run = RunCli({"doctor", "--quick", "--json", url}, env);
  EXPECT_EQ(r.run.exit_code, 0) << r.run.out << r.run.err;
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (parser.parse(r.run.out).get(doc) != simdjson::SUCCESS) {
    ADD_FAILURE() << r.run.out;
    return r;
  }
  simdjson::dom::element o = doc["object_store"].value();
  r.url = std::string(o["url"].get_string().value());
  r.store = std::string(o["store"].get_string().value());
  r.request_url = std::string(o["request_url"].get_string().value());
  r.settings = std::string(o["settings"]["message"].get_string().value());
  r.settings_code = std::string(o["settings"]["code"].get_string().value());
  r.probe = std::string(o["probe"].get_string().value());
  r.probe_message = std::string(o["probe_status"]["message"].get_string().value());
  return r;
}

// Found by a review: doctor printed a URL's password (twice), and replaced ParseObjectUrl's
// precise reason by "not a URL tensorferry reads" on a URL shown without its query (a signed link
// looked refused as shown). Every URL is shown redacted, with the reason it is refused.
TEST(DoctorCliTest, UrlsAreShownRedactedWithTheReasonTheyAreRefused) {
  StoreReport r = DoctorStore("https://user:hunter2@example.invalid/x.safetensors");
  EXPECT_EQ(r.run.out.find("hunter2"), std::string::npos) << r.run.out;
  EXPECT_EQ(r.run.err.find("hunter2"), std::string::npos) << r.run.err;
  EXPECT_EQ(r.url, "https://***@example.invalid/x.safetensors");
  EXPECT_EQ(r.settings_code, "invalid_argument") << r.settings;
  EXPECT_EQ(r.settings,
            "object URL \"https://***@example.invalid/x.safetensors\": credentials (user@host) "
            "are not allowed in URLs; use the options instead");
  EXPECT_EQ(r.request_url, "");  // nothing asked
  r = DoctorStore("https://example.invalid/x.safetensors?X-Amz-Signature=s3cr3t&X-Amz-Date=1");
  EXPECT_EQ(r.run.out.find("s3cr3t"), std::string::npos) << r.run.out;
  EXPECT_EQ(r.url, "https://example.invalid/x.safetensors?***");
  EXPECT_NE(r.settings.find("\"https://example.invalid/x.safetensors?***\": a '?query' is not "
                            "allowed"),
            std::string::npos)
      << r.settings;
  r = DoctorStore("http://example.invalid:70000/x.safetensors");
  EXPECT_EQ(r.url, "http://example.invalid:70000/x.safetensors");
  EXPECT_NE(r.settings.find("the port is not a number from 1 to 65535"), std::string::npos)
      << r.settings;
  // The text report too.
  const RunResult text =
      RunCli({"doctor", "--quick", "https://user:hunter2@example.invalid/x.safetensors"}, {});
  EXPECT_EQ(text.exit_code, 0) << text.out << text.err;
  EXPECT_EQ(text.out.find("hunter2"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("object store: https://***@example.invalid/x.safetensors\n  settings: "
                          "object URL \"https://***@example.invalid/x.safetensors\": "
                          "credentials (user@host)"),
            std::string::npos)
      << text.out;
}

// Found by a review: an hf:// path (which loads read) got "not a URL tensorferry reads".
TEST(DoctorCliTest, HubPathsSayDoctorDoesNotProbeThem) {
  testing::TempDir dir;
  const StoreReport r = DoctorStore(
      "hf://org/model", {{"HF_HUB_CACHE", dir.path()}, {"HF_ENDPOINT", "http://hub.invalid"}});
  EXPECT_EQ(r.url, "hf://org/model");
  EXPECT_EQ(r.settings_code, "unsupported") << r.settings;
  EXPECT_NE(r.settings.find("hf://org/model: a Hugging Face hub path: doctor does not probe hub "
                            "paths"),
            std::string::npos)
      << r.settings;
  EXPECT_NE(r.settings.find(dir.path()), std::string::npos) << r.settings;
  EXPECT_NE(r.settings.find("http://hub.invalid"), std::string::npos) << r.settings;
}

// An endpoint that refuses connections at once (port 1 on loopback), unsigned, no retries: what
// doctor would ask is in the report without a server.
std::map<std::string, std::optional<std::string>> RefusingS3() {
  return {{"AWS_ENDPOINT_URL", "http://127.0.0.1:1"},
          {"AWS_NO_SIGN_REQUEST", "true"},
          {"AWS_REGION", "us-east-1"},
          {"AWS_PROFILE", std::nullopt},
          {"AWS_SHARED_CREDENTIALS_FILE", "/dev/null"},
          {"AWS_CONFIG_FILE", "/dev/null"},
          {"TENSORFERRY_OBJECT_RETRIES", "0"}};
}

// Found by a review: an s3:// key holding '?' was shown cut at the '?' while its whole key was
// asked for; and a prefix was asked for as an object, not as a load asks (its index first).
TEST(DoctorCliTest, BucketUrlsAreAskedForAsALoadAsks) {
  StoreReport r = DoctorStore("s3://bucket/a?b.safetensors", RefusingS3());
  if (r.settings.find("libcurl") != std::string::npos) GTEST_SKIP() << r.settings;
  EXPECT_EQ(r.url, "s3://bucket/a?b.safetensors");
  EXPECT_EQ(r.store, "s3");
  EXPECT_EQ(r.request_url, "http://127.0.0.1:1/bucket/a%3Fb.safetensors");
  EXPECT_NE(r.probe_message.find("s3://bucket/a?b.safetensors"), std::string::npos)
      << r.probe_message;
  // A prefix, with or without '/': its index first (the store refuses: nothing more is asked).
  for (const char* prefix : {"s3://bucket/model", "s3://bucket/model/"}) {
    r = DoctorStore(prefix, RefusingS3());
    EXPECT_EQ(r.request_url, "http://127.0.0.1:1/bucket/model/model.safetensors.index.json")
        << prefix;
    EXPECT_NE(r.probe_message.find("s3://bucket/model/model.safetensors.index.json"),
              std::string::npos)
        << r.probe_message;
  }
}

// Runs the CLI with `args` under a seccomp filter that fails io_uring_setup with EPERM, as a
// container's profile does (Docker's default refuses io_uring): fork, the filter, exec.
RunResult RunCliWithoutIoUring(const std::vector<std::string>& args) {
  testing::TempDir io;
  const std::string out_path = io.Join("stdout"), err_path = io.Join("stderr");
  std::vector<std::string> argv_storage = {TENSORFERRY_CLI_PATH};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  const int out_fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err_fd = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  RunResult result;
  const pid_t pid = ::fork();
  if (pid == 0) {  // the child: async-signal-safe calls only
    if (::dup2(out_fd, 1) < 0 || ::dup2(err_fd, 2) < 0) ::_exit(126);
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) != 0) {
      ::_exit(125);  // no seccomp filters here: the test skips
    }
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(out_fd);
  ::close(err_fd);
  if (pid < 0) {
    ADD_FAILURE() << "fork failed: " << errno;
    return result;
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = testing::ReadBytes(out_path);
  result.err = testing::ReadBytes(err_path);
  return result;
}

// Where io_uring is refused, doctor says so and why, and a load reads with pread (engine_reason
// says why) and gets the same bytes.
TEST(DoctorCliTest, WithoutIoUringDoctorSaysWhyAndLoadsUsePread) {
  testing::TempDir dir;
  const std::string ckpt = dir.Join("c");
  ASSERT_EQ(RunCli({"gen", ckpt, "--preset", "tiny", "--no-sync"}, {}).exit_code, 0);
  const RunResult doctor = RunCliWithoutIoUring({"doctor", "--json", "--quick"});
  if (doctor.exit_code == 125) GTEST_SKIP() << "this kernel refuses seccomp filters";
  ASSERT_EQ(doctor.exit_code, 0) << doctor.out << doctor.err;
  simdjson::dom::parser parser;
  simdjson::dom::element d = parser.parse(doctor.out).value();
  EXPECT_FALSE(d["io_uring"]["available"].get_bool().value());
  const std::string why(d["io_uring"]["error"].get_string().value());
  EXPECT_NE(why.find("Operation not permitted"), std::string::npos) << why;
  const RunResult text = RunCliWithoutIoUring({"doctor", "--quick"});
  EXPECT_NE(text.out.find("reads: io_uring unavailable (" + why +
                          "): local files are read with pread, one read in flight per worker, "
                          "at least 8 workers (auto)"),
            std::string::npos)
      << text.out;

  const RunResult plain = RunCli({"load", ckpt, "--json"}, {});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const std::string plain_sum(parser.parse(plain.out).value()["checksum"].get_string().value());
  const RunResult load = RunCliWithoutIoUring({"load", ckpt, "--json"});
  ASSERT_EQ(load.exit_code, 0) << load.out << load.err;
  simdjson::dom::element l = parser.parse(load.out).value();
  EXPECT_EQ(std::string(l["engine"].get_string().value()), "pread");
  const std::string reason(l["engine_reason"].get_string().value());
  EXPECT_EQ(reason, "io_uring unavailable: " + why) << reason;
  EXPECT_EQ(std::string(l["checksum"].get_string().value()), plain_sum);
}

std::map<std::string, std::optional<std::string>> FakeEnv() {
  return {{"TENSORFERRY_CUDA_RUNTIME", TENSORFERRY_FAKE_CUDA_PATH},
          {"TENSORFERRY_CUFILE_LIBRARY", TENSORFERRY_FAKE_CUDA_PATH}};
}

// The checksum of tensors loaded to the (fake) device, computed on their copy back to the host,
// equals the host load's, for every GDS mode, engine and device budget.
TEST(DeviceLoadCli, ChecksumOnTheDeviceEqualsTheHostLoad) {
  testing::TempDir dir;
  const std::string ckpt = dir.Join("c");
  const RunResult gen =
      RunCli({"gen", ckpt, "--preset", "tiny", "--no-sync", "--shard-size", "40KB"}, {});
  ASSERT_EQ(gen.exit_code, 0) << gen.err;
  const RunResult host = RunCli({"load", ckpt, "--json"}, {});
  ASSERT_EQ(host.exit_code, 0) << host.err;
  simdjson::dom::parser parser;
  simdjson::dom::element h = parser.parse(host.out).value();
  const std::string host_sum(h["checksum"].get_string().value());
  const uint64_t bytes = h["bytes"].get_uint64().value();
  EXPECT_EQ(std::string(h["device"].get_string().value()), "cpu");
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--gds", "off"},
        {"--gds", "auto", "--engine", "pread", "--direct", "on"},
        {"--gds", "on", "--engine", "mmap"},
        {"--gds", "off", "--device-budget", "64KB", "--staging-bytes", "64KB", "--staging-slot",
         "16KB"}}) {
    std::vector<std::string> args = {"load", ckpt, "--json", "--device", "cuda:0"};
    args.insert(args.end(), extra.begin(), extra.end());
    const RunResult r = RunCli(args, FakeEnv());
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    simdjson::dom::parser p;
    simdjson::dom::element e = p.parse(r.out).value();
    EXPECT_EQ(std::string(e["checksum"].get_string().value()), host_sum) << r.out;
    EXPECT_EQ(std::string(e["device"].get_string().value()), "cuda:0");
    EXPECT_EQ(e["device_bytes"].get_uint64().value(), bytes);
    EXPECT_EQ(e["staged_bytes"].get_uint64().value() + e["gds_bytes"].get_uint64().value(), bytes);
    EXPECT_GT(e["pinned_bytes"].get_uint64().value(), 0u);
    const uint64_t device_budget = e["device_budget"].get_uint64().value();
    if (device_budget > 0) {
      EXPECT_LE(e["peak_device_bytes"].get_uint64().value(), device_budget);
      EXPECT_GT(e["device_batches"].get_uint64().value(), 1u);
    }
    if (extra[1] == "off") {
      EXPECT_EQ(e["gds_bytes"].get_uint64().value(), 0u);
    }
    if (extra[1] == "on") {
      EXPECT_GT(e["gds_bytes"].get_uint64().value(), 0u) << r.out;
    }
  }
  // The text report gains a device line.
  const RunResult text = RunCli({"load", ckpt, "--device", "cuda"}, FakeEnv());
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("checksum " + host_sum), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("\ndevice cuda:0: "), std::string::npos) << text.out;
}

// `load --tp-rank R --tp-size N --device cuda:0`: each rank's slices (builtin rules: q/k/v/gate/up
// and embeddings on dim 0, o_proj/down_proj on dim 1) land on the (fake) device; their checksum,
// on the copy back, equals the host sliced load's, with GDS off and auto, and under a device
// budget.
TEST(DeviceLoadCli, TensorParallelSlicesOnTheDeviceEqualTheHostSlices) {
  testing::TempDir dir;
  const std::string ckpt = dir.Join("c");
  const RunResult gen =
      RunCli({"gen", ckpt, "--preset", "tiny", "--no-sync", "--shard-size", "40KB"}, {});
  ASSERT_EQ(gen.exit_code, 0) << gen.err;
  for (const char* world_text : {"2", "3"}) {
    const std::string world = world_text;
    for (int rank = 0; rank < std::stoi(world); ++rank) {
      const std::vector<std::string> tp = {"--tp-rank", std::to_string(rank), "--tp-size", world};
      std::vector<std::string> host_args = {"load", ckpt, "--json", "--engine", "pread"};
      host_args.insert(host_args.end(), tp.begin(), tp.end());
      const RunResult host = RunCli(host_args, {});
      ASSERT_EQ(host.exit_code, 0) << host.err;
      simdjson::dom::parser parser;
      simdjson::dom::element h = parser.parse(host.out).value();
      const std::string host_sum(h["checksum"].get_string().value());
      const uint64_t bytes = h["bytes"].get_uint64().value();
      for (const std::vector<std::string>& extra :
           {std::vector<std::string>{"--gds", "off"},
            {"--gds", "auto", "--engine", "mmap"},
            {"--gds", "off", "--device-budget", "48KB", "--staging-bytes", "64KB", "--staging-slot",
             "16KB"}}) {
        std::vector<std::string> args = {"load", ckpt, "--json", "--device", "cuda:0"};
        args.insert(args.end(), tp.begin(), tp.end());
        args.insert(args.end(), extra.begin(), extra.end());
        const RunResult r = RunCli(args, FakeEnv());
        ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
        simdjson::dom::parser p;
        simdjson::dom::element e = p.parse(r.out).value();
        EXPECT_EQ(std::string(e["checksum"].get_string().value()), host_sum)
            << "rank " << rank << " of " << world << ": " << r.out;
        EXPECT_EQ(e["device_bytes"].get_uint64().value(), bytes);
        EXPECT_EQ(e["tp_size"].get_uint64().value(), std::stoull(world));
        const uint64_t device_budget = e["device_budget"].get_uint64().value();
        if (device_budget > 0) {
          EXPECT_LE(e["peak_device_bytes"].get_uint64().value(), device_budget);
        }
      }
    }
  }
}

TEST(DeviceLoadCli, NoRuntimeOrNoDeviceIsOneClearLine) {
  testing::TempDir dir;
  const std::string ckpt = dir.Join("c");
  ASSERT_EQ(RunCli({"gen", ckpt, "--preset", "tiny", "--no-sync"}, {}).exit_code, 0);
  const RunResult none = RunCli({"load", ckpt, "--device", "cuda:0"},
                                {{"TENSORFERRY_CUDA_RUNTIME", "/nonexistent/libcudart.so.13"}});
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(
      none.err.find("CUDA runtime (libcudart) not found; tried: /nonexistent/libcudart.so.13"),
      std::string::npos)
      << none.err;
  const RunResult missing = RunCli({"load", ckpt, "--device", "cuda:4"}, FakeEnv());
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("CUDA device 4 does not exist"), std::string::npos) << missing.err;
  const RunResult bad = RunCli({"load", ckpt, "--device", "tpu"}, FakeEnv());
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
}

}  // namespace
}  // namespace tensorferry
