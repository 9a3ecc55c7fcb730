// tf_device_overlap_bench: does the device pipeline overlap reads and copies? (docs/benchmarks.md,
// "Device pipeline overlap (no GPU)").
//
// Runs against the fake CUDA runtime, so it needs no GPU. In one process, in alternating rounds, it
// moves the same bytes (files written to a temporary directory, warm in the page cache) three
// ways, with the same chunks (slot_size pieces), the same number of threads and streams:
//   read      the engine reads every chunk into pinned memory (the ring's slots), nothing copied;
//   copy      every chunk is copied from pinned memory to device memory on the streams, nothing
//   read; pipeline  DevicePipeline::Run: read into a slot, cudaMemcpyAsync from it, the slot reused
//   after
//             its event.
// The figure is pipeline / min(read, copy) per round (median over rounds): 100% when reads and
// copies overlap perfectly, 50% when two equal stages run one after the other.
//
// On a machine with few cores, unthrottled stages measure CPU contention (every stage is a memcpy
// here), not overlap. So both links are modeled: --copy-gbps makes the fake's copies share one copy
// engine of that bandwidth (TfFakeCudaConfig::copy_bytes_per_second; the PCIe link), and
// --read-gbps makes reads share a storage link of that bandwidth (the engine's reads from the page
// cache, then a wait until the link would have carried the bytes). Equal rates are the hardest case
// for overlap. 0 disables a limit.
//
//   tf_device_overlap_bench [--size-mib 512] [--files 4] [--read-gbps 0.25] [--copy-gbps 0.25]
//                           [--rounds 7] [--slot-mib 8] [--staging-mib 64] [--producers 0]
//                           [--json]
// The default rates are low enough that, on a shared 2-core machine, the copy path's CPU work (the
// fake checksums every source twice and copies it) and the reads' memcpy from the page cache stay
// a small share of a core, so each stage alone reaches its link's rate.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/resources.h"
#include "device/device_memory.h"
#include "device/pipeline.h"
#include "io/read_engine.h"
#include "tensorferry/env.h"
#include "testing/fake_cuda.h"
#include "testing/test_util.h"

namespace tensorferry::device {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  uint64_t size_mib = 512;
  unsigned files = 4;
  double read_gbps = 0.25;
  double copy_gbps = 0.25;
  unsigned rounds = 7;
  uint64_t slot_mib = 8;
  uint64_t staging_mib = 64;
  unsigned producers = 0;
  bool json = false;
};

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "tf_device_overlap_bench: %s\n", message.c_str());
  std::exit(1);
}

void Check(const Status& status, const char* what) {
  if (!status.ok()) Die(std::string(what) + ": " + status.ToString());
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json") {
      o.json = true;
      continue;
    }
    if (arg == "--help" || arg == "-h") {
      std::printf(
          "tf_device_overlap_bench [--size-mib N] [--files N] [--read-gbps X] [--copy-gbps X]\n"
          "  [--rounds N] [--slot-mib N] [--staging-mib N] [--producers N] [--json]\n"
          "The device pipeline's throughput against min(read, copy), on the fake CUDA runtime\n"
          "(docs/benchmarks.md). A rate of 0 disables that link's limit.\n");
      std::exit(0);
    }
    if (i + 1 >= argc) Die("missing value after " + arg);
    const char* value = argv[++i];
    char* end = nullptr;
    const double v = std::strtod(value, &end);
    if (end == value || *end != '\0' || v < 0) Die("bad value for " + arg + ": " + value);
    if (arg == "--size-mib") {
      o.size_mib = static_cast<uint64_t>(v);
    } else if (arg == "--files") {
      o.files = static_cast<unsigned>(v);
    } else if (arg == "--read-gbps") {
      o.read_gbps = v;
    } else if (arg == "--copy-gbps") {
      o.copy_gbps = v;
    } else if (arg == "--rounds") {
      o.rounds = static_cast<unsigned>(v);
    } else if (arg == "--slot-mib") {
      o.slot_mib = static_cast<uint64_t>(v);
    } else if (arg == "--staging-mib") {
      o.staging_mib = static_cast<uint64_t>(v);
    } else if (arg == "--producers") {
      o.producers = static_cast<unsigned>(v);
    } else {
      Die("unknown option " + arg + " (--help)");
    }
  }
  if (o.files == 0 || o.rounds == 0 || o.size_mib < o.files || o.slot_mib == 0) {
    Die("--files, --rounds, --slot-mib must be positive and --size-mib at least --files");
  }
  return o;
}

// A storage link of `bytes_per_second` shared by every reader: each Execute returns once the link
// would have carried its bytes after those of the reads started before it (on any thread). The
// bytes themselves come from the inner engine (the page cache). 0: no limit.
class ThrottledEngine final : public io::ReadEngine {
 public:
  ThrottledEngine(std::unique_ptr<io::ReadEngine> inner, double bytes_per_second)
      : inner_(std::move(inner)), bytes_per_second_(bytes_per_second) {}

  Status Execute(std::span<const io::ReadRequest> requests) override {
    Clock::time_point done{};
    if (bytes_per_second_ > 0) {
      uint64_t bytes = 0;
      for (const io::ReadRequest& r : requests) bytes += r.dst.size();
      std::lock_guard<std::mutex> lock(mu_);
      const Clock::time_point start = std::max(Clock::now(), link_free_);
      done = start + std::chrono::nanoseconds(static_cast<int64_t>(static_cast<double>(bytes) *
                                                                   1e9 / bytes_per_second_));
      link_free_ = done;
    }
    Status status = inner_->Execute(requests);
    if (bytes_per_second_ > 0) std::this_thread::sleep_until(done);
    return status;
  }
  io::EngineStats stats() const override { return inner_->stats(); }
  std::string_view name() const override { return inner_->name(); }

 private:
  std::unique_ptr<io::ReadEngine> inner_;
  const double bytes_per_second_;
  std::mutex mu_;
  Clock::time_point link_free_{};
};

struct Chunk {
  const RandomAccessFile* file;
  uint64_t offset;
  uint64_t length;
  std::byte* dst;
};

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string Rate(double gbps) {
  if (gbps <= 0) return "unlimited";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g GB/s", gbps);
  return buf;
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// Bytes that differ per file and position (a 64-bit LCG), written quickly.
std::string Content(uint64_t size, uint64_t seed) {
  std::string s(size, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t i = 0; i + 8 <= size; i += 8) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    std::memcpy(s.data() + i, &x, 8);
  }
  return s;
}

int Main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  const uint64_t mib = 1ull << 20;
  const uint64_t file_size = o.size_mib / o.files * mib;
  const uint64_t total = file_size * o.files;

  auto fake = testing::FakeCuda::Load();
  if (!fake.ok()) Die("loading the fake CUDA runtime: " + fake.status().ToString());
  TfFakeCudaConfig config = fake->DefaultConfig();
  config.device_memory = total + (64ull << 20);
  config.copy_bytes_per_second = static_cast<uint64_t>(o.copy_gbps * 1e9);
  fake->Reset(config);
  const std::shared_ptr<const cuda::Runtime>& runtime = fake->runtime();

  // The files, warm in the page cache (just written, then read once by the warm-up round).
  testing::TempDir dir;
  std::vector<std::string> paths;
  std::vector<std::unique_ptr<RandomAccessFile>> files;
  for (unsigned f = 0; f < o.files; ++f) {
    paths.push_back(dir.Join("shard" + std::to_string(f) + ".bin"));
    testing::WriteBytes(paths.back(), Content(file_size, f));
    auto file = Env::Default()->OpenRandomAccess(paths.back());
    Check(file.status(), "open");
    files.push_back(std::move(file).value());
  }

  DevicePipelineOptions popts;
  popts.slot_size = o.slot_mib * mib;
  popts.staging_bytes = o.staging_mib * mib;
  popts.producers = o.producers;
  popts.gds = GdsMode::kOff;
  auto pipeline = DevicePipeline::Create(runtime, popts, fake->cufile());
  Check(pipeline.status(), "pipeline");
  const DevicePipelineStats layout = (*pipeline)->stats();
  const unsigned producers = layout.producers;
  const unsigned slots = layout.slots;
  const uint64_t slot = layout.slot_size;

  auto inner = io::MakePreadEngine(producers);
  Check(inner.status(), "engine");
  ThrottledEngine engine(std::move(inner).value(), o.read_gbps * 1e9);

  auto allocator = DeviceAllocator::Create(runtime, 0, 0);
  auto buffer = allocator->Allocate(total);
  Check(buffer.status(), "device buffer");
  std::byte* device = (*buffer)->data();

  // The same chunks the pipeline makes of whole files starting at offset 0.
  std::vector<DeviceTask> tasks;
  std::vector<Chunk> chunks;
  for (unsigned f = 0; f < o.files; ++f) {
    std::byte* dst = device + f * file_size;
    DeviceTask task;
    task.file = files[f].get();
    task.length = file_size;
    task.dst = dst;
    tasks.push_back(task);
    for (uint64_t at = 0; at < file_size; at += slot) {
      chunks.push_back(Chunk{files[f].get(), at, std::min(slot, file_size - at), dst + at});
    }
  }

  auto pinned = cuda::PinnedHostBuffer::Allocate(runtime, slots * slot);
  Check(pinned.status(), "pinned");
  std::vector<cuda::UniqueStream> streams;
  for (unsigned p = 0; p < producers; ++p) {
    auto stream = cuda::UniqueStream::Create(runtime);
    Check(stream.status(), "stream");
    streams.push_back(std::move(stream).value());
  }

  // Read alone: `producers` threads, each reading the next chunk into a slot of its own.
  auto read_alone = [&] {
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::vector<std::thread> threads;
    const Clock::time_point start = Clock::now();
    for (unsigned p = 0; p < producers; ++p) {
      threads.emplace_back([&, p] {
        for (unsigned n = 0;; ++n) {
          const size_t k = next.fetch_add(1);
          if (k >= chunks.size()) return;
          const unsigned s = (p + n * producers) % slots;
          const io::ReadRequest request{chunks[k].file,
                                        chunks[k].offset,
                                        {(*pinned)->data() + s * slot, chunks[k].length},
                                        -1};
          if (!engine.Execute({&request, 1}).ok()) failed = true;
        }
      });
    }
    for (std::thread& t : threads) t.join();
    if (failed) Die("read failed");
    return static_cast<double>(total) / Seconds(start) / 1e9;
  };
  // Copy alone: every chunk from a slot to its device place, round-robin over the streams.
  auto copy_alone = [&] {
    const cuda::RuntimeApi& api = runtime->api();
    const Clock::time_point start = Clock::now();
    for (size_t k = 0; k < chunks.size(); ++k) {
      const std::byte* src = (*pinned)->data() + (k % slots) * slot;
      if (api.cudaMemcpyAsync(chunks[k].dst, src, chunks[k].length, cuda::kMemcpyHostToDevice,
                              streams[k % producers].get()) != cuda::kSuccess) {
        Die("cudaMemcpyAsync failed");
      }
    }
    for (const cuda::UniqueStream& s : streams) {
      if (api.cudaStreamSynchronize(s.get()) != cuda::kSuccess) Die("copy failed");
    }
    return static_cast<double>(total) / Seconds(start) / 1e9;
  };
  auto run_pipeline = [&] {
    const Clock::time_point start = Clock::now();
    Check((*pipeline)->Run(tasks, engine, buffer->get()), "pipeline run");
    return static_cast<double>(total) / Seconds(start) / 1e9;
  };

  const std::string load_before = LoadAverage();
  if (!o.json) {
    std::printf("tf_device_overlap_bench: %s, %u cores, load %s\n", CpuModel().c_str(),
                std::thread::hardware_concurrency(), load_before.c_str());
#ifndef NDEBUG
    std::printf(
        "WARNING: built without NDEBUG (not a release build): numbers are not meaningful\n");
#endif
    std::printf(
        "%u files of %llu MiB (page cache), %zu chunks of %llu MiB, %u slots, %u producers/"
        "streams; read link %s, copy engine %s\n",
        o.files, static_cast<unsigned long long>(file_size / mib), chunks.size(),
        static_cast<unsigned long long>(slot / mib), slots, producers, Rate(o.read_gbps).c_str(),
        Rate(o.copy_gbps).c_str());
    std::printf("%-6s %10s %10s %10s %10s\n", "round", "read", "copy", "pipeline", "overlap");
  }
  // A warm-up round (page cache, first touches of pinned and device memory), then the rounds;
  // the order of the three measurements rotates from round to round.
  read_alone();
  copy_alone();
  run_pipeline();
  std::vector<double> reads, copies, pipes, ratios;
  for (unsigned r = 0; r < o.rounds; ++r) {
    double rd = 0, cp = 0, pl = 0;
    for (unsigned i = 0; i < 3; ++i) {
      switch ((i + r) % 3) {
        case 0: rd = read_alone(); break;
        case 1: cp = copy_alone(); break;
        default: pl = run_pipeline(); break;
      }
    }
    reads.push_back(rd);
    copies.push_back(cp);
    pipes.push_back(pl);
    ratios.push_back(pl / std::min(rd, cp));
    if (!o.json) {
      std::printf("%-6u %10.3f %10.3f %10.3f %9.1f%%\n", r + 1, rd, cp, pl, 100 * ratios.back());
    }
  }

  // One more (untimed) pipeline run, then every byte must be in its place.
  run_pipeline();
  for (unsigned f = 0; f < o.files; ++f) {
    if (fake->ReadDevice(device + f * file_size, file_size) != testing::ReadBytes(paths[f])) {
      Die("device bytes of " + paths[f] + " differ from the file");
    }
  }
  if (fake->ViolationCount() != 0) Die("the fake recorded violations: " + fake->Violations());

  const double figure = Median(ratios);
  if (o.json) {
    std::printf(
        "{\"read_gbps\": %.4f, \"copy_gbps\": %.4f, \"pipeline_gbps\": %.4f, \"overlap\": %.4f, "
        "\"rounds\": %u, \"bytes\": %llu, \"chunks\": %zu, \"slot_size\": %llu, \"slots\": %u, "
        "\"producers\": %u, \"read_limit_gbps\": %g, \"copy_limit_gbps\": %g, "
        "\"cores\": %u, \"load_before\": \"%s\", \"load_after\": \"%s\"}\n",
        Median(reads), Median(copies), Median(pipes), figure, o.rounds,
        static_cast<unsigned long long>(total), chunks.size(),
        static_cast<unsigned long long>(slot), slots, producers, o.read_gbps, o.copy_gbps,
        std::thread::hardware_concurrency(), load_before.c_str(), LoadAverage().c_str());
  } else {
    std::printf("%-6s %10.3f %10.3f %10.3f %9.1f%%   (GB/s; medians over %u rounds)\n", "median",
                Median(reads), Median(copies), Median(pipes), 100 * figure, o.rounds);
    std::printf(
        "overlap: pipeline / min(read, copy) = %.1f%% (median of the rounds' ratios); "
        "load %s -> %s; device bytes verified\n",
        100 * figure, load_before.c_str(), LoadAverage().c_str());
  }
  return 0;
}

}  // namespace
}  // namespace tensorferry::device

int main(int argc, char** argv) {
  return tensorferry::device::Main(argc, argv);
}
