// The device pipeline against the fake CUDA runtime and cuFile: byte-exact results, the bounds on
// pinned memory and slots, ordering (the fake checks that no slot is overwritten under a pending
// copy), strided copies, error propagation without leaks or hangs, and GDS selection.
#include "device/pipeline.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "device/device_memory.h"
#include "io/read_engine.h"
#include "testing/fake_cuda.h"
#include "testing/test_util.h"

namespace tensorferry::device {
namespace {

using testing::MemoryEnv;
using testing::TempDir;

constexpr unsigned char kUntouched = 0xCD;  // the fake's fresh device memory

using ::tensorferry::testing::Contains;

// Bytes that differ per file and position, so a chunk from the wrong place shows.
std::string Pattern(size_t size, unsigned seed) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i) {
    s[i] = static_cast<char>((i * 131 + seed * 17 + (i >> 9) * 7) & 0xff);
  }
  return s;
}

// Files, the tasks over them, and the device image the tasks must produce.
struct Workload {
  std::vector<std::string> contents;
  std::vector<std::unique_ptr<RandomAccessFile>> files;
  std::vector<DeviceTask> tasks;
  std::string expected;  // the destination buffer after the run (kUntouched where no task wrote)
  std::shared_ptr<DeviceBuffer> buffer;
};

class DevicePipelineTest : public testing::FakeCudaTest {
 protected:
  void SetUp() override {
    FakeCudaTest::SetUp();
    auto engine = io::MakePreadEngine(3);
    ASSERT_TRUE(engine.ok());
    engine_ = std::move(engine).value();
    allocator_ = DeviceAllocator::Create(runtime_, 0, 0);
  }
  void TearDown() override {
    engine_.reset();
    allocator_.reset();
    FakeCudaTest::TearDown();
  }

  Result<std::unique_ptr<DevicePipeline>> MakePipeline(const DevicePipelineOptions& options) {
    return DevicePipeline::Create(runtime_, options, fake_->cufile());
  }

  // Opens `count` files of odd sizes, in memory (MemoryEnv) or on disk (dir).
  void AddFiles(Workload& w, size_t count, size_t size, TempDir* dir) {
    for (size_t f = 0; f < count; ++f) {
      const std::string content = Pattern(size + f * 4099 + 3, static_cast<unsigned>(f));
      std::string path;
      Env* env = &memory_env_;
      if (dir != nullptr) {
        path = dir->Join("shard" + std::to_string(f) + ".safetensors");
        testing::WriteBytes(path, content);
        env = Env::Default();
      } else {
        path = "/mem/shard" + std::to_string(f) + ".safetensors";
        memory_env_.AddFile(path, content);
      }
      auto file = env->OpenRandomAccess(path);
      ASSERT_TRUE(file.ok()) << file.status().ToString();
      w.contents.push_back(content);
      w.files.push_back(std::move(file).value());
    }
  }

  // Random contiguous tasks (odd sizes, unaligned offsets, some empty, some many slots long)
  // packed into one device buffer with random gaps between them.
  void AddRandomTasks(Workload& w, size_t count, uint64_t max_length, unsigned seed) {
    std::mt19937_64 rng(seed);
    struct Placed {
      size_t file;
      uint64_t offset, length, dst;
    };
    std::vector<Placed> placed;
    uint64_t at = 0;
    for (size_t i = 0; i < count; ++i) {
      const size_t f = i % w.files.size();
      const uint64_t size = w.contents[f].size();
      const uint64_t length = i % 11 == 0 ? 0 : 1 + rng() % std::min<uint64_t>(max_length, size);
      const uint64_t offset = rng() % (size - length + 1);
      at += rng() % 3 == 0 ? rng() % 300 : 0;  // a gap the pipeline must leave alone
      placed.push_back({f, offset, length, at});
      at += length;
    }
    Allocate(w, at);
    for (const Placed& p : placed) {
      DeviceTask t;
      t.file = w.files[p.file].get();
      t.file_offset = p.offset;
      t.length = p.length;
      t.dst = w.buffer->data() + p.dst;
      w.tasks.push_back(t);
      std::memcpy(w.expected.data() + p.dst, w.contents[p.file].data() + p.offset, p.length);
    }
  }

  struct Strided {
    uint64_t offset, rows, row_bytes, src_pitch, dst_pitch;
  };
  // One strided task per case over w's first file, 17 bytes apart in a new destination buffer;
  // gathered from the file's bytes (DeviceTask::source) when `gather`.
  void AddStridedTasks(Workload& w, const std::vector<Strided>& cases, bool gather) {
    const std::string& src = w.contents[0];
    uint64_t size = 0;
    for (const Strided& c : cases) size += (c.rows - 1) * c.dst_pitch + c.row_bytes + 17;
    Allocate(w, size);
    uint64_t at = 0;
    for (const Strided& c : cases) {
      DeviceTask t;
      t.file = w.files[0].get();
      t.file_offset = c.offset;
      t.length = (c.rows - 1) * c.src_pitch + c.row_bytes;
      t.dst = w.buffer->data() + at;
      t.rows = c.rows;
      t.row_bytes = c.row_bytes;
      t.src_pitch = c.src_pitch;
      t.dst_pitch = c.dst_pitch;
      if (gather) {
        t.source = reinterpret_cast<const std::byte*>(src.data());
        t.source_size = src.size();
      }
      w.tasks.push_back(t);
      for (uint64_t r = 0; r < c.rows; ++r) {
        std::memcpy(w.expected.data() + at + r * c.dst_pitch,
                    src.data() + c.offset + r * c.src_pitch, c.row_bytes);
      }
      at += (c.rows - 1) * c.dst_pitch + c.row_bytes + 17;
    }
  }

  // 30 random tasks (seed `seed`) over two files through a pipeline with `ring`, the fake
  // configured by `config`: the failed run's status, every slot free again.
  Status RunFaultyRandomTasks(const TfFakeCudaConfig& config, const DevicePipelineOptions& ring,
                              unsigned seed) {
    Configure(config);
    Workload w;
    AddFiles(w, 2, 100'000, nullptr);
    AddRandomTasks(w, 30, 10'000, seed);
    auto pipeline = MakePipeline(ring);
    EXPECT_TRUE(pipeline.ok()) << pipeline.status().ToString();
    if (!pipeline.ok()) return pipeline.status();
    const Status status = (*pipeline)->Run(w.tasks, *engine_, w.buffer.get());
    EXPECT_FALSE(status.ok());
    EXPECT_EQ((*pipeline)->slots_in_use(), 0u);
    return status;
  }

  // `slots` slots of 4 KiB and `producers` producers (0: the default).
  static DevicePipelineOptions Ring(unsigned slots, unsigned producers = 0) {
    DevicePipelineOptions options;
    options.slot_size = 4096;
    options.staging_bytes = slots * 4096;
    options.producers = producers;
    return options;
  }

  void Allocate(Workload& w, uint64_t size) {
    auto buffer = allocator_->Allocate(size);
    ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
    w.buffer = std::move(buffer).value();
    w.expected.assign(size, static_cast<char>(kUntouched));
  }

  ::testing::AssertionResult DeviceMatches(const Workload& w) {
    const std::string actual = fake_->ReadDevice(w.buffer->data(), w.buffer->size());
    if (actual == w.expected) return ::testing::AssertionSuccess();
    size_t i = 0;
    while (actual[i] == w.expected[i]) ++i;
    return ::testing::AssertionFailure()
           << "device bytes differ first at " << i << " of " << actual.size();
  }

  MemoryEnv memory_env_;
  std::unique_ptr<io::ReadEngine> engine_;
  std::shared_ptr<DeviceAllocator> allocator_;
};

TEST_F(DevicePipelineTest, ManyOddTasksArriveByteExact) {
  struct Case {
    uint64_t slot_size, staging_bytes;
    unsigned producers;
    uint32_t delay_us;
  };
  const Case cases[] = {{4096, 8192, 1, 0},
                        {4096, 4 * 4096, 3, 100},
                        {64 << 10, 256 << 10, 0, 0},
                        {8192, 5 * 8192, 6, 30}};
  unsigned seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE("slot " + std::to_string(c.slot_size) + ", staging " +
                 std::to_string(c.staging_bytes) + ", producers " + std::to_string(c.producers));
    auto config = DefaultConfig();
    config.copy_delay_us = c.delay_us;
    Configure(config);
    Workload w;
    AddFiles(w, 3, 200'000, nullptr);
    AddRandomTasks(w, 120, 3 * c.slot_size + 123, seed++);
    DevicePipelineOptions options;
    options.slot_size = c.slot_size;
    options.staging_bytes = c.staging_bytes;
    options.producers = c.producers;
    auto pipeline = MakePipeline(options);
    ASSERT_TRUE(pipeline.ok()) << pipeline.status().ToString();
    ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
    EXPECT_TRUE(DeviceMatches(w));
    const DevicePipelineStats stats = (*pipeline)->stats();
    uint64_t total = 0;
    for (const DeviceTask& t : w.tasks) total += t.length;
    EXPECT_EQ(stats.staged_bytes, total);
    EXPECT_EQ(stats.gds_bytes, 0u);
    EXPECT_LE(stats.pinned_bytes, c.staging_bytes);
    EXPECT_LE(stats.peak_slots_in_use, stats.slots);
    EXPECT_EQ((*pipeline)->slots_in_use(), 0u);
    const TfFakeCudaStats fake = fake_->Stats();
    EXPECT_LE(fake.peak_pinned_bytes, c.staging_bytes) << "staging budget exceeded";
    EXPECT_LE(fake.max_copies_pending, stats.slots) << "more copies in flight than slots";
    EXPECT_EQ(fake.copies_executed, stats.copies);
    EXPECT_EQ(fake.bytes_copied_to_device, total);
    EXPECT_EQ(fake.pageable_copies, 0u);
    EXPECT_EQ(fake_->ViolationCount(), 0u) << fake_->Violations();
  }
}

// Two slots, slow copies, several producers: reads must wait for slots, never overwrite one.
TEST_F(DevicePipelineTest, ATinyRingUnderSlowCopiesStaysCorrect) {
  auto config = DefaultConfig();
  config.copy_delay_us = 300;
  Configure(config);
  Workload w;
  AddFiles(w, 2, 100'000, nullptr);
  AddRandomTasks(w, 40, 20'000, 7);
  auto pipeline = MakePipeline(Ring(2, 3));
  ASSERT_TRUE(pipeline.ok());
  EXPECT_EQ((*pipeline)->stats().slots, 2u);
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  EXPECT_LE((*pipeline)->stats().peak_slots_in_use, 2u);
  EXPECT_LE(fake_->Stats().max_copies_pending, 2u);
  // The ring is reused across runs: its two slots, pinned once.
  EXPECT_EQ(fake_->Stats().pinned_allocations_live, 2u);
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  EXPECT_EQ(fake_->Stats().pinned_allocations_live, 2u);
}

TEST_F(DevicePipelineTest, ChunksAfterTheFirstStartOnPageBoundariesOfTheFile) {
  Workload w;
  AddFiles(w, 1, 100'000, nullptr);
  Allocate(w, 50'000);
  DeviceTask t{w.files[0].get(), 1000, 50'000, w.buffer->data()};
  w.tasks.push_back(t);
  std::memcpy(w.expected.data(), w.contents[0].data() + 1000, 50'000);
  DevicePipelineOptions options;
  options.slot_size = 16384;
  options.staging_bytes = 4 * 16384;
  auto pipeline = MakePipeline(options);
  ASSERT_TRUE(pipeline.ok());
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  // [1000, 16384), [16384, 32768), [32768, 49152), [49152, 51000)
  EXPECT_EQ((*pipeline)->stats().chunks, 4u);
}

// With an O_DIRECT descriptor, chunks sit in their slots congruent to their file offsets, so the
// engine reads their aligned middles directly.
TEST_F(DevicePipelineTest, DirectReadsGoStraightIntoTheSlots) {
  TempDir dir;
  Workload w;
  AddFiles(w, 2, 300'000, &dir);
  AddRandomTasks(w, 40, 50'000, 13);
  std::vector<std::unique_ptr<io::DirectFile>> direct;
  for (const auto& file : w.files) {
    auto d = io::DirectFile::Open(*file);
    if (!d.ok()) GTEST_SKIP() << d.status().ToString();
    if (!*d) GTEST_SKIP() << "O_DIRECT cannot be had now (descriptors or memory exhausted)";
    direct.push_back(std::move(d).value());
  }
  for (DeviceTask& t : w.tasks) {
    for (size_t f = 0; f < w.files.size(); ++f) {
      if (t.file == w.files[f].get()) t.direct_fd = direct[f]->fd();
    }
  }
  DevicePipelineOptions options;
  options.slot_size = 16384;
  options.staging_bytes = 4 * 16384;
  options.gds = GdsMode::kOff;
  auto pipeline = MakePipeline(options);
  ASSERT_TRUE(pipeline.ok());
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  const io::EngineStats engine = engine_->stats();
  EXPECT_GT(engine.direct_bytes, engine.bytes_read / 2)
      << "most bytes should have been read with O_DIRECT";
}

TEST_F(DevicePipelineTest, StridedTasksLandRowByRow) {
  Workload w;
  AddFiles(w, 1, 300'000, nullptr);
  // Many rows per chunk; rows longer than a slot; a padded destination pitch; one row.
  AddStridedTasks(w,
                  {{13, 50, 40, 100, 40},
                   {5000, 3, 10'000, 12'000, 10'000},
                   {777, 20, 33, 501, 48},
                   {3, 1, 999, 999, 999}},
                  false);
  auto pipeline = MakePipeline(Ring(3, 2));
  ASSERT_TRUE(pipeline.ok());
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  EXPECT_GT((*pipeline)->stats().copies_2d, 0u);
  EXPECT_GT((*pipeline)->stats().copies, 0u);  // the long rows went as plain copies
  EXPECT_EQ((*pipeline)->stats().gathered_bytes, 0u);
}

// With a source (the file's bytes in memory, e.g. its page-cache mapping), a strided task's rows
// are gathered into the slot packed: the engine reads nothing, only the rows are staged, and packed
// destinations take one plain copy per chunk.
TEST_F(DevicePipelineTest, GatheredStridedTasksStageOnlyTheirRows) {
  Workload w;
  AddFiles(w, 1, 300'000, nullptr);
  const std::vector<Strided> cases = {{13, 500, 40, 100, 40},   // many chunks, packed
                                      {777, 200, 33, 501, 48},  // padded destination: 2D copies
                                      {3, 1, 999, 999, 999},    // one row
                                      {4096, 2, 4096, 8192, 4096}};  // one whole slot per row
  AddStridedTasks(w, cases, true);
  uint64_t rows_bytes = 0;
  for (const Strided& c : cases) rows_bytes += c.rows * c.row_bytes;
  auto pipeline = MakePipeline(Ring(3, 2));
  ASSERT_TRUE(pipeline.ok());
  const uint64_t copies_2d = fake_->Stats().copies_2d;
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  const DevicePipelineStats s = (*pipeline)->stats();
  EXPECT_EQ(memory_env_.reads("/mem/shard0.safetensors"), 0u) << "gathered: nothing read";
  EXPECT_EQ(s.staged_bytes, rows_bytes);
  EXPECT_EQ(s.gathered_bytes, rows_bytes);
  EXPECT_GT(s.copies, 0u);                         // the packed ones
  EXPECT_GT(fake_->Stats().copies_2d, copies_2d);  // the padded one
  EXPECT_EQ((*pipeline)->slots_in_use(), 0u);

  // Rows longer than a slot still go through the engine, row piece by row piece (exact).
  Workload wide;
  AddFiles(wide, 1, 300'000, nullptr);
  AddStridedTasks(wide, {{5000, 3, 10'000, 12'000, 10'000}}, true);
  ASSERT_TRUE((*pipeline)->Run(wide.tasks, *engine_, wide.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(wide));
  EXPECT_GT(memory_env_.reads("/mem/shard0.safetensors"), 0u);
  EXPECT_EQ((*pipeline)->stats().gathered_bytes, rows_bytes);

  // A source shorter than the task's bytes is refused before anything is staged; a set cancel
  // flag stops gathered chunks like read ones.
  DeviceTask short_source = w.tasks[0];
  short_source.source_size = short_source.file_offset + short_source.length - 1;
  Status refused = (*pipeline)->Run(std::span<const DeviceTask>(&short_source, 1), *engine_);
  EXPECT_EQ(refused.code(), Code::kInvalidArgument) << refused.ToString();
  EXPECT_NE(refused.message().find("beyond its source's"), std::string::npos) << refused.ToString();
  std::atomic<bool> cancel{true};
  DeviceTask cancelled = w.tasks[0];
  cancelled.cancel = &cancel;
  Status stopped = (*pipeline)->Run(std::span<const DeviceTask>(&cancelled, 1), *engine_);
  EXPECT_EQ(stopped.code(), Code::kCancelled) << stopped.ToString();
  EXPECT_EQ((*pipeline)->slots_in_use(), 0u);
}

// Rows gathered from a transient mapping (DeviceTask::source_map) leave the process once they are
// in their slot: after the run the mapping holds almost none of the pages it was read through,
// and the bytes on the device are the file's.
TEST_F(DevicePipelineTest, GatheredRowsFromATransientMappingAreDroppedAsTheyAreStaged) {
  TempDir dir;
  Workload w;
  AddFiles(w, 1, 8 << 20, &dir);
  // 16 KiB of each 64 KiB row (a quarter, as a rank of 4 reads a dim-1 split): 128 rows, 2 MiB.
  AddStridedTasks(w, {{4096, 128, 16 << 10, 64 << 10, 16 << 10}}, true);
  auto map =
      io::MappedFile::Map(*w.files[0], w.contents[0].size(), io::MappedFile::Use::kTransient);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  w.tasks[0].source = (*map)->data();
  w.tasks[0].source_size = (*map)->size();
  w.tasks[0].source_map = map->get();
  DevicePipelineOptions options;
  options.slot_size = 256 << 10;
  options.staging_bytes = 4 * options.slot_size;
  options.producers = 2;
  auto pipeline = MakePipeline(options);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status().ToString();
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  EXPECT_EQ((*pipeline)->stats().gathered_bytes, 2u << 20);
  // What stays mapped: at most the pages around the last chunk's end that the kernel mapped
  // ahead of the faults (fault-around), far from the 2 MiB of rows read.
  EXPECT_LT(testing::MappedRss((*map)->data()), 256u << 10);
}

TEST_F(DevicePipelineTest, AReadErrorNamesFileAndOffsetAndLeavesNothingBehind) {
  auto config = DefaultConfig();
  config.copy_delay_us = 200;
  Configure(config);
  Workload w;
  AddFiles(w, 3, 100'000, nullptr);
  AddRandomTasks(w, 60, 9000, 3);
  MemoryEnv::Faults faults;
  faults.eio_at = 50'000;
  memory_env_.SetFaults("/mem/shard1.safetensors", faults);
  auto pipeline = MakePipeline(Ring(3, 2));
  ASSERT_TRUE(pipeline.ok());
  // Make sure some task covers the failing offset.
  DeviceTask covering{w.files[1].get(), 49'000, 2000, w.buffer->data()};
  w.tasks.insert(w.tasks.begin() + 30, covering);
  const Status status = (*pipeline)->Run(w.tasks, *engine_, w.buffer.get());
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), Code::kIoError);
  EXPECT_TRUE(Contains(status.message(), "/mem/shard1.safetensors")) << status.ToString();
  EXPECT_FALSE(Contains(status.message(), "the read held")) << "no DeviceTask::about: no label";
  EXPECT_EQ((*pipeline)->slots_in_use(), 0u);
  EXPECT_EQ(fake_->Stats().copies_executed, fake_->Stats().copies_enqueued)
      << "Run returned with copies still in flight";

  // With DeviceTask::about, the error says what the failed read held, from the failing offset
  // on (the bytes before the bad sector were read).
  std::vector<uint64_t> asked;
  std::mutex asked_mu;
  const std::function<std::string(const io::ReadRequest&)> about = [&](const io::ReadRequest& r) {
    const std::lock_guard<std::mutex> lock(asked_mu);
    asked.push_back(r.offset);
    return std::string("tensor \"x\"");
  };
  for (DeviceTask& t : w.tasks) t.about = &about;
  const Status labelled = (*pipeline)->Run(w.tasks, *engine_, w.buffer.get());
  ASSERT_FALSE(labelled.ok());
  EXPECT_TRUE(
      Contains(labelled.message(), "injected EIO at offset 50000; the read held tensor \"x\""))
      << labelled.ToString();
  ASSERT_FALSE(asked.empty());
  for (uint64_t at : asked) EXPECT_EQ(at, 50'000u) << "the failing read's offset";
  for (DeviceTask& t : w.tasks) t.about = nullptr;
  EXPECT_EQ((*pipeline)->slots_in_use(), 0u);

  // The same pipeline still works once the fault is gone.
  memory_env_.SetFaults("/mem/shard1.safetensors", MemoryEnv::Faults{});
  w.tasks.erase(w.tasks.begin() + 30);
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
}

TEST_F(DevicePipelineTest, AFileShorterThanItsTaskIsUnexpectedEof) {
  Workload w;
  AddFiles(w, 1, 10'000, nullptr);
  Allocate(w, 5000);
  DeviceTask t{w.files[0].get(), 8000, 5000, w.buffer->data()};
  auto pipeline = MakePipeline(Ring(2));
  ASSERT_TRUE(pipeline.ok());
  const Status status = (*pipeline)->Run(std::span(&t, 1), *engine_, w.buffer.get());
  EXPECT_EQ(status.code(), Code::kUnexpectedEof);
  EXPECT_TRUE(Contains(status.message(), "/mem/shard0.safetensors: unexpected end of file"));
  EXPECT_EQ((*pipeline)->slots_in_use(), 0u);
}

TEST_F(DevicePipelineTest, ACopyThatCannotBeQueuedNamesItsBytes) {
  auto config = DefaultConfig();
  config.fail_copy_enqueue_at = 5;
  config.copy_delay_us = 100;
  const Status status = RunFaultyRandomTasks(config, Ring(4, 3), 5);
  EXPECT_EQ(status.code(), Code::kCudaError);
  EXPECT_TRUE(Contains(status.message(), "copy of /mem/shard")) << status.ToString();
  EXPECT_TRUE(Contains(status.message(), ") to device 0x"));
  EXPECT_TRUE(Contains(status.message(), "cudaErrorUnknown"));
  EXPECT_EQ(fake_->Stats().copies_executed, fake_->Stats().copies_enqueued);
}

TEST_F(DevicePipelineTest, AnAsynchronousCopyFailureSurfacesWithoutHanging) {
  auto config = DefaultConfig();
  config.fail_copy_execute_at = 4;
  config.copy_delay_us = 200;
  const Status status = RunFaultyRandomTasks(config, Ring(3, 2), 9);
  EXPECT_EQ(status.code(), Code::kCudaError);
  EXPECT_TRUE(Contains(status.message(), "cudaErrorIllegalAddress")) << status.ToString();
  EXPECT_TRUE(Contains(status.message(), "copy of /mem/shard"));
}

// Pinned memory running out after the first slot: the load completes byte-exact with the slots
// the ring could pin.
TEST_F(DevicePipelineTest, ALoadGoesOnWithTheSlotsThatCouldBePinned) {
  auto config = DefaultConfig();
  config.fail_host_alloc_at = 3;
  config.copy_delay_us = 50;
  Configure(config);
  Workload w;
  AddFiles(w, 2, 100'000, nullptr);
  AddRandomTasks(w, 40, 10'000, 11);
  auto pipeline = MakePipeline(Ring(6, 4));
  ASSERT_TRUE(pipeline.ok()) << pipeline.status().ToString();
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  // The third pinning failed; producers already pinning another slot at that moment may have
  // finished theirs, so between 2 and 5 of the 6 slots are pinned.
  const DevicePipelineStats stats = (*pipeline)->stats();
  EXPECT_GE(stats.pinned_bytes, 2u * 4096);
  EXPECT_LT(stats.pinned_bytes, 6u * 4096);
  EXPECT_LE(stats.peak_slots_in_use, stats.pinned_bytes / 4096);
  EXPECT_EQ(fake_->Stats().pinned_bytes_in_use, stats.pinned_bytes);
  EXPECT_EQ(fake_->ViolationCount(), 0u) << fake_->Violations();
  // A second run pins nothing more.
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  EXPECT_EQ((*pipeline)->stats().pinned_bytes, stats.pinned_bytes);
  EXPECT_EQ(fake_->Stats().pinned_bytes_in_use, stats.pinned_bytes);
}

TEST_F(DevicePipelineTest, CreationFailuresLeakNothing) {
  auto config = DefaultConfig();
  config.fail_host_alloc_at = 1;
  Configure(config);
  DevicePipelineOptions options;
  auto pipeline = MakePipeline(options);
  ASSERT_FALSE(pipeline.ok());
  EXPECT_EQ(pipeline.status().code(), Code::kDeviceOutOfMemory);

  Configure(DefaultConfig());
  options.staging_bytes = options.slot_size;
  pipeline = MakePipeline(options);
  EXPECT_EQ(pipeline.status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(pipeline.status().message(), "at least 2 slots"));

  options = DevicePipelineOptions{};
  options.device = 3;
  pipeline = MakePipeline(options);
  EXPECT_EQ(pipeline.status().code(), Code::kCudaNoDevice);

  config = DefaultConfig();
  config.device_count = 0;
  Configure(config);
  pipeline = MakePipeline(DevicePipelineOptions{});
  EXPECT_EQ(pipeline.status().code(), Code::kCudaNoDevice);
}

TEST_F(DevicePipelineTest, MalformedTasksAreRefusedBeforeAnyIo) {
  Workload w;
  AddFiles(w, 1, 10'000, nullptr);
  Allocate(w, 4096);
  auto pipeline = MakePipeline(Ring(2));
  ASSERT_TRUE(pipeline.ok());
  std::vector<DeviceTask> tasks(3, DeviceTask{w.files[0].get(), 0, 16, w.buffer->data()});
  tasks[1].file = nullptr;
  Status status = (*pipeline)->Run(tasks, *engine_);
  EXPECT_EQ(status.code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(status.message(), "device task 1: no file"));
  tasks[1] = tasks[0];
  tasks[2].dst = nullptr;
  status = (*pipeline)->Run(tasks, *engine_);
  EXPECT_TRUE(Contains(status.message(), "device task 2: no device destination"));
  tasks[2] = tasks[0];
  tasks[2].rows = 2;
  tasks[2].row_bytes = 8;
  tasks[2].src_pitch = 10;
  tasks[2].dst_pitch = 8;  // length should be 18
  status = (*pipeline)->Run(tasks, *engine_);
  EXPECT_TRUE(Contains(status.message(), "device task 2: strided layout"));
  EXPECT_EQ(memory_env_.reads("/mem/shard0.safetensors"), 0u);
  EXPECT_EQ(fake_->Stats().copies_enqueued, 0u);
  EXPECT_TRUE((*pipeline)->Run({}, *engine_).ok());
}

// --- GDS ----------------------------------------------------------------------------------------

class DevicePipelineGdsTest : public DevicePipelineTest {
 protected:
  // Tasks over one file on disk: aligned ones (file offset and device address multiples of 4096)
  // and unaligned ones.
  void AddMixedTasks(Workload& w, size_t* aligned, size_t* unaligned) {
    AddFiles(w, 1, 300'000, &dir_);
    Allocate(w, 200'000);
    struct Range {
      uint64_t offset, length, dst;
    };
    const Range ranges[] = {
        {0, 50'000, 0},           {8192, 4096, 53'248},        {100, 3000, 60'000},
        {65'536, 70'000, 65'536}, {4096 * 50, 777, 4096 * 40}, {12'345, 4096, 180'000}};
    *aligned = *unaligned = 0;
    for (const Range& r : ranges) {
      w.tasks.push_back(DeviceTask{w.files[0].get(), r.offset, r.length, w.buffer->data() + r.dst});
      std::memcpy(w.expected.data() + r.dst, w.contents[0].data() + r.offset, r.length);
      (r.offset % 4096 == 0 && r.dst % 4096 == 0 ? *aligned : *unaligned) += 1;
    }
  }
  DevicePipelineOptions Options(GdsMode mode) {
    DevicePipelineOptions options;
    options.slot_size = 16384;
    options.staging_bytes = 4 * 16384;
    options.gds = mode;
    return options;
  }
  TempDir dir_;
};

TEST_F(DevicePipelineGdsTest, AlignedTasksGoStraightToTheDeviceOthersThroughTheRing) {
  Workload w;
  size_t aligned = 0, unaligned = 0;
  AddMixedTasks(w, &aligned, &unaligned);
  auto pipeline = MakePipeline(Options(GdsMode::kAuto));
  ASSERT_TRUE(pipeline.ok()) << pipeline.status().ToString();
  EXPECT_TRUE((*pipeline)->stats().gds_enabled);
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  DevicePipelineStats stats = (*pipeline)->stats();
  EXPECT_EQ(stats.gds_tasks, aligned);
  EXPECT_EQ(stats.staged_tasks, unaligned);
  EXPECT_EQ(stats.gds_bytes, 50'000u + 4096 + 70'000 + 777);
  EXPECT_EQ(stats.staged_bytes, 3000u + 4096);
  EXPECT_TRUE(Contains(stats.gds_reason, "2 tasks not aligned to 4096 bytes"));
  EXPECT_TRUE(w.buffer->cufile_registered());
  const TfFakeCudaStats fake = fake_->Stats();
  EXPECT_EQ(fake.cufile_bytes_read, stats.gds_bytes);
  EXPECT_EQ(fake.cufile_buf_register_calls, 1u);
  EXPECT_EQ(fake.cufile_handles_live, 0u) << "file handles outlived the run";

  // A second run into the same buffer reuses the registration.
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_EQ(fake_->Stats().cufile_buf_register_calls, 1u);
  // Without a destination buffer, cuFile reads unregistered memory (its own bounce buffers).
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_).ok());
  EXPECT_TRUE(DeviceMatches(w));
  w.buffer.reset();  // deregistered before cudaFree (the fake would flag it otherwise)
}

TEST_F(DevicePipelineGdsTest, ForcedOnReadsUnalignedTasksWithCufileToo) {
  Workload w;
  size_t aligned = 0, unaligned = 0;
  AddMixedTasks(w, &aligned, &unaligned);
  auto pipeline = MakePipeline(Options(GdsMode::kOn));
  ASSERT_TRUE(pipeline.ok());
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  EXPECT_EQ((*pipeline)->stats().gds_tasks, aligned + unaligned);
  EXPECT_EQ((*pipeline)->stats().staged_bytes, 0u);
  EXPECT_EQ((*pipeline)->stats().gds_reason, "");
  // A set cancel flag stops cuFile reads as it stops staged ones: nothing more is read.
  std::atomic<bool> cancel{true};
  std::vector<DeviceTask> cancelled = w.tasks;
  for (DeviceTask& t : cancelled) t.cancel = &cancel;
  const uint64_t read_before = fake_->Stats().cufile_bytes_read;
  const Status stopped = (*pipeline)->Run(cancelled, *engine_, w.buffer.get());
  EXPECT_EQ(stopped.code(), Code::kCancelled) << stopped.ToString();
  EXPECT_EQ(fake_->Stats().cufile_bytes_read, read_before);
  w.buffer.reset();
}

TEST_F(DevicePipelineGdsTest, OffAndInMemoryFilesUseTheRingAndSayWhy) {
  Workload w;
  size_t aligned = 0, unaligned = 0;
  AddMixedTasks(w, &aligned, &unaligned);
  auto off = MakePipeline(Options(GdsMode::kOff));
  ASSERT_TRUE(off.ok());
  ASSERT_TRUE((*off)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  EXPECT_EQ((*off)->stats().gds_bytes, 0u);
  EXPECT_EQ((*off)->stats().gds_reason, "GDS off (option)");
  EXPECT_EQ(fake_->Stats().cufile_drivers_open, 0u);

  // Files without a descriptor (test doubles) cannot use cuFile.
  Workload in_memory;
  AddFiles(in_memory, 1, 50'000, nullptr);
  AddRandomTasks(in_memory, 10, 9000, 11);
  auto memory = MakePipeline(Options(GdsMode::kAuto));
  ASSERT_TRUE(memory.ok());
  ASSERT_TRUE((*memory)->Run(in_memory.tasks, *engine_, in_memory.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(in_memory));
  EXPECT_TRUE(Contains((*memory)->stats().gds_reason,
                       "/mem/shard0.safetensors: not used with GDS: no file descriptor"));
  auto forced_memory = MakePipeline(Options(GdsMode::kOn));
  ASSERT_TRUE(forced_memory.ok());
  EXPECT_EQ((*forced_memory)->Run(in_memory.tasks, *engine_).code(), Code::kGdsUnavailable);

  // Without cuFile installed.
  auto missing = DevicePipeline::Create(runtime_, Options(GdsMode::kAuto),
                                        Status(Code::kCudaNotFound, "libcufile.so.0 not found"));
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ((*missing)->stats().gds_reason, "GDS not used: libcufile.so.0 not found");
  auto forced = DevicePipeline::Create(runtime_, Options(GdsMode::kOn),
                                       Status(Code::kCudaNotFound, "libcufile.so.0 not found"));
  EXPECT_EQ(forced.status().code(), Code::kGdsUnavailable);
  EXPECT_TRUE(Contains(forced.status().message(), "GDS forced on but unusable"));

  // cuFile installed on a machine whose kernel cannot do GDS (no nvidia-fs, no NVMe): auto does
  // not pay for opening the driver; on still tries it.
  testing::TempDir root;
  const std::shared_ptr<const cuda::Cufile> platformless = std::make_shared<const cuda::Cufile>(
      fake_->cufile()->path(), fake_->cufile()->api(), root.path());
  const uint64_t open_before = fake_->Stats().cufile_drivers_open;
  auto skipped = DevicePipeline::Create(runtime_, Options(GdsMode::kAuto), platformless);
  ASSERT_TRUE(skipped.ok()) << skipped.status().ToString();
  EXPECT_TRUE(Contains((*skipped)->stats().gds_reason,
                       "GDS not used: the nvidia-fs kernel module is not loaded"));
  EXPECT_FALSE((*skipped)->stats().gds_enabled);
  EXPECT_EQ(fake_->Stats().cufile_drivers_open, open_before);
  {
    auto tried = DevicePipeline::Create(runtime_, Options(GdsMode::kOn), platformless);
    ASSERT_TRUE(tried.ok()) << tried.status().ToString();
    EXPECT_TRUE((*tried)->stats().gds_enabled);
    EXPECT_EQ(fake_->Stats().cufile_drivers_open, open_before + 1);
  }
}

TEST(GdsPlatformProblem, NeedsNvidiaFsOrNvme) {
  testing::TempDir root;
  EXPECT_TRUE(Contains(cuda::GdsPlatformProblem(root.path()),
                       "no " + root.path() + "/proc/driver/nvidia-fs"));
  ASSERT_EQ(::mkdir(root.Join("sys").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(root.Join("sys/class").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(root.Join("sys/class/nvme").c_str(), 0755), 0);
  EXPECT_NE(cuda::GdsPlatformProblem(root.path() + "/"), "");  // an empty class: no NVMe
  ASSERT_EQ(::mkdir(root.Join("sys/class/nvme/nvme0").c_str(), 0755), 0);
  EXPECT_EQ(cuda::GdsPlatformProblem(root.path()), "");
  testing::TempDir other;
  ASSERT_EQ(::mkdir(other.Join("proc").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(other.Join("proc/driver").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(other.Join("proc/driver/nvidia-fs").c_str(), 0755), 0);
  EXPECT_EQ(cuda::GdsPlatformProblem(other.path()), "");
}

TEST_F(DevicePipelineGdsTest, ADriverThatDoesNotOpenMeansTheRing) {
  auto config = DefaultConfig();
  config.cufile_driver_open_error = 5007;
  Configure(config);
  Workload w;
  size_t aligned = 0, unaligned = 0;
  AddMixedTasks(w, &aligned, &unaligned);
  auto pipeline = MakePipeline(Options(GdsMode::kAuto));
  ASSERT_TRUE(pipeline.ok());
  EXPECT_FALSE((*pipeline)->stats().gds_enabled);
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  EXPECT_TRUE(Contains((*pipeline)->stats().gds_reason,
                       "cuFileDriverOpen: CU_FILE_PLATFORM_NOT_SUPPORTED (5007)"));
  auto forced = MakePipeline(Options(GdsMode::kOn));
  ASSERT_FALSE(forced.ok());
  EXPECT_EQ(forced.status().code(), Code::kGdsUnavailable);
  EXPECT_TRUE(Contains(forced.status().message(), "CU_FILE_PLATFORM_NOT_SUPPORTED"));
}

TEST_F(DevicePipelineGdsTest, AFileCufileRefusesFallsBackAndIsNamed) {
  auto config = DefaultConfig();
  config.cufile_handle_register_error = 5008;
  Configure(config);
  Workload w;
  size_t aligned = 0, unaligned = 0;
  AddMixedTasks(w, &aligned, &unaligned);
  auto pipeline = MakePipeline(Options(GdsMode::kAuto));
  ASSERT_TRUE(pipeline.ok());
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  const DevicePipelineStats stats = (*pipeline)->stats();
  EXPECT_EQ(stats.gds_bytes, 0u);
  EXPECT_TRUE(Contains(stats.gds_reason,
                       "shard0.safetensors: cuFileHandleRegister: "
                       "CU_FILE_IO_NOT_SUPPORTED (5008)"));
  EXPECT_TRUE(Contains(stats.gds_reason, "6 tasks of files cuFile refused"));

  auto forced = MakePipeline(Options(GdsMode::kOn));
  ASSERT_TRUE(forced.ok());
  const Status status = (*forced)->Run(w.tasks, *engine_, w.buffer.get());
  EXPECT_EQ(status.code(), Code::kGdsUnavailable);
  EXPECT_TRUE(Contains(status.message(), "CU_FILE_IO_NOT_SUPPORTED"));
}

TEST_F(DevicePipelineGdsTest, ACufileReadErrorNamesFileAndOffset) {
  auto config = DefaultConfig();
  config.cufile_fail_read_at = 2;
  Configure(config);
  Workload w;
  size_t aligned = 0, unaligned = 0;
  AddMixedTasks(w, &aligned, &unaligned);
  auto pipeline = MakePipeline(Options(GdsMode::kOn));
  ASSERT_TRUE(pipeline.ok());
  const Status status = (*pipeline)->Run(w.tasks, *engine_, w.buffer.get());
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), Code::kCufileError);
  EXPECT_TRUE(Contains(status.message(), "shard0.safetensors: cuFileRead at offset "));
  EXPECT_TRUE(Contains(status.message(), std::strerror(EIO)));
  EXPECT_EQ((*pipeline)->slots_in_use(), 0u);
  w.buffer.reset();
}

// Under auto, a cuFileRead that fails once the file was accepted does not end the load: that
// chunk's rest and the file's later chunks go through the staging ring, byte-exact, and the reason
// says what failed.
TEST_F(DevicePipelineGdsTest, ACufileReadErrorUnderAutoFallsBackToTheRing) {
  auto config = DefaultConfig();
  config.cufile_fail_read_at = 2;
  Configure(config);
  Workload w;
  size_t aligned = 0, unaligned = 0;
  AddMixedTasks(w, &aligned, &unaligned);
  auto pipeline = MakePipeline(Options(GdsMode::kAuto));
  ASSERT_TRUE(pipeline.ok()) << pipeline.status().ToString();
  const Status status = (*pipeline)->Run(w.tasks, *engine_, w.buffer.get());
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_TRUE(DeviceMatches(w));
  const DevicePipelineStats stats = (*pipeline)->stats();
  EXPECT_EQ(stats.gds_bytes + stats.staged_bytes, 50'000u + 4096 + 70'000 + 777 + 3000 + 4096);
  EXPECT_GT(stats.staged_bytes, 3000u + 4096) << "the failed chunk's bytes were staged";
  EXPECT_LT(stats.gds_bytes, 50'000u + 4096 + 70'000 + 777);
  EXPECT_EQ(fake_->Stats().cufile_bytes_read, stats.gds_bytes);
  EXPECT_TRUE(Contains(stats.gds_reason, "shard0.safetensors: cuFileRead at offset "))
      << stats.gds_reason;
  EXPECT_TRUE(Contains(stats.gds_reason, "GDS given up for the file")) << stats.gds_reason;
  EXPECT_EQ((*pipeline)->slots_in_use(), 0u);

  // The load's next batch (another Run): the file's tasks are staged from the start, and the
  // reason still names the failure.
  const uint64_t cufile_before = fake_->Stats().cufile_bytes_read;
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  const DevicePipelineStats next = (*pipeline)->stats();
  EXPECT_EQ(next.gds_bytes, stats.gds_bytes) << "no GDS read of that file any more";
  EXPECT_EQ(fake_->Stats().cufile_bytes_read, cufile_before);
  EXPECT_TRUE(Contains(next.gds_reason, "6 tasks of files whose cuFileRead failed before"))
      << next.gds_reason;
  EXPECT_TRUE(Contains(next.gds_reason, "shard0.safetensors: cuFileRead at offset "))
      << next.gds_reason;

  // Handed to a new owner (ResetCounters): cuFile is asked again.
  (*pipeline)->ResetCounters();
  ASSERT_TRUE((*pipeline)->Run(w.tasks, *engine_, w.buffer.get()).ok());
  EXPECT_TRUE(DeviceMatches(w));
  EXPECT_EQ((*pipeline)->stats().gds_bytes, 50'000u + 4096 + 70'000 + 777);
  EXPECT_FALSE(Contains((*pipeline)->stats().gds_reason, "cuFileRead"));
  w.buffer.reset();
}

TEST_F(DevicePipelineGdsTest, AShortFileIsUnexpectedEofUnderGdsToo) {
  Workload w;
  AddFiles(w, 1, 10'000, &dir_);
  Allocate(w, 8192);
  DeviceTask t{w.files[0].get(), 8192, 8192, w.buffer->data()};
  auto pipeline = MakePipeline(Options(GdsMode::kOn));
  ASSERT_TRUE(pipeline.ok());
  const Status status = (*pipeline)->Run(std::span(&t, 1), *engine_, w.buffer.get());
  EXPECT_EQ(status.code(), Code::kUnexpectedEof);
  EXPECT_TRUE(Contains(status.message(), "shard0.safetensors: unexpected end of file"));
  w.buffer.reset();
}

TEST(DevicePipelineOptionsTest, GdsModeNames) {
  for (GdsMode mode : {GdsMode::kAuto, GdsMode::kOn, GdsMode::kOff}) {
    auto parsed = ParseGdsMode(GdsModeName(mode));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, mode);
  }
  EXPECT_EQ(ParseGdsMode("yes").status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace tensorferry::device
