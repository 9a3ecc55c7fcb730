// The Loader's device sink against the fake CUDA runtime (docs/gpu.md): byte-exact tensors in
// (fake) device memory for every engine, direct and GDS mode, the pipeline made once per loader,
// the device budget and the peak device memory, ownership of device buffers, per-tensor placement,
// caller-provided destinations and error paths. Every test also proves that nothing leaked and
// that the fake saw no misuse (FakeCudaTest).
//
// The loader reaches CUDA through the process-wide runtime (cuda::ProcessRuntime), selected here
// with TENSORFERRY_CUDA_RUNTIME / TENSORFERRY_CUFILE_LIBRARY = the fake before its first use (CTest
// runs every test in a process of its own).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_api.h"
#include "cuda/cufile_api.h"
#include "tensorferry/device.h"
#include "tensorferry/loader.h"
#include "tensorferry/writer.h"
#include "testing/fake_cuda.h"
#include "testing/shard_fixture.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using testing::TempDir;

constexpr char kUntouched = static_cast<char>(0xCD);  // the fake's fresh device memory

using ::tensorferry::testing::Contains;

// A sharded checkpoint of `layers` layers of odd-sized tensors, each filled with a pattern from
// its name.
struct LayeredCheckpoint : testing::TestCheckpoint {
  LayeredCheckpoint(int layers, uint64_t rows, uint64_t shard)
      : TestCheckpoint([](uint64_t i, size_t h) {
          return static_cast<char>((i * 131 + h + (i >> 12)) & 0xff);
        }) {
    testing::AddLayeredModel(*this, layers, rows);
    Write(shard);
  }
};

class LoaderDeviceTest : public testing::FakeCudaProcessTest {
 protected:
  // The bytes of a loaded tensor, wherever it is.
  std::string Bytes(const Tensor& t) const {
    if (t.device().is_cpu()) return std::string(reinterpret_cast<const char*>(t.data()), t.size());
    return fake_->ReadDevice(t.data(), t.size());
  }

  static LoadOptions DeviceOptions() {
    LoadOptions o;
    o.device = Device::CUDA(0);
    o.threads = 3;
    o.staging_bytes = 64 << 10;
    o.staging_slot = 16 << 10;
    o.gds = GdsMode::kOff;
    return o;
  }

  // DeviceOptions for every engine, O_DIRECT mode and GDS mode, reads split at 20000 bytes (some
  // start aligned, and GDS (auto) takes those).
  struct ReadPath {
    std::string what;
    LoadOptions options;
  };
  static std::vector<ReadPath> EveryReadPath() {
    std::vector<ReadPath> out;
    for (Engine engine : {Engine::kPread, Engine::kIoUring, Engine::kMmap}) {
      for (DirectIO direct : {DirectIO::kOff, DirectIO::kOn}) {
        for (GdsMode gds : {GdsMode::kOff, GdsMode::kAuto}) {
          LoadOptions o = DeviceOptions();
          o.engine = engine;
          o.direct = direct;
          o.gds = gds;
          o.chunk_size = 20000;
          out.push_back({std::string(EngineName(engine)) + " direct " +
                             std::string(DirectIOName(direct)) + " gds " +
                             std::string(GdsModeName(gds)),
                         o});
        }
      }
    }
    return out;
  }
};

TEST_F(LoaderDeviceTest, ByteExactForEveryEngineDirectAndGdsMode) {
  LayeredCheckpoint c(4, 700, 64 << 10);  // ~250 KB over several shards
  for (const ReadPath& path : EveryReadPath()) {
    SCOPED_TRACE(path.what);
    const GdsMode gds = path.options.gds;
    auto loader = Loader::Open(c.dir.path(), path.options);
    if (!loader.ok() && loader.status().code() == Code::kUnsupported) continue;  // no io_uring
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    auto tensors = (*loader)->Load();
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    ASSERT_EQ(tensors->size(), c.tensors.size());
    for (const Tensor& t : *tensors) {
      EXPECT_EQ(t.device(), Device::CUDA(0)) << t.name();
      EXPECT_EQ(Bytes(t), c.Full(t.name())) << t.name();
    }
    const LoadStats s = (*loader)->stats();
    EXPECT_EQ(s.device, "cuda:0");
    EXPECT_EQ(s.device_bytes, c.total);
    EXPECT_EQ(s.device_tensors, c.tensors.size());
    EXPECT_EQ(s.staged_bytes + s.gds_bytes, c.total);
    // The ring's slots (16 KiB) are pinned as the load needs them: at least one, at most 64 KiB.
    EXPECT_GE(s.pinned_bytes, 16u << 10);
    EXPECT_LE(s.pinned_bytes, 64u << 10);
    EXPECT_EQ(s.pinned_bytes % (16u << 10), 0u);
    EXPECT_GE(s.peak_device_bytes, c.total);
    EXPECT_EQ(s.peak_device_bytes, s.device_buffer_bytes);
    if (gds == GdsMode::kOff) {
      EXPECT_EQ(s.gds_bytes, 0u);
      EXPECT_TRUE(Contains(s.gds_reason, "off")) << s.gds_reason;
    } else {
      // The fake's cuFile works: aligned tasks go through it.
      EXPECT_GT(s.gds_bytes, 0u) << s.gds_reason;
    }
  }
}

TEST_F(LoaderDeviceTest, PipelineAndPinnedMemoryAreMadeOncePerLoader) {
  LayeredCheckpoint c(4, 200, 16 << 10);
  auto loader = Loader::Open(c.dir.path(), DeviceOptions());
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  // Made at Open, before any load, with the ring's first slot pinned.
  EXPECT_EQ(fake_->Stats().pinned_allocations_live, 1u);
  const uint64_t streams = fake_->Stats().streams_live;
  EXPECT_GT(streams, 0u);
  uint64_t pinned_before = 1;
  for (int run = 0; run < 3; ++run) {
    auto tensors = (*loader)->Load();
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    for (const Tensor& t : *tensors) EXPECT_EQ(Bytes(t), c.Full(t.name()));
    // The slots earlier loads pinned serve this one (the ring grows as a load needs more slots:
    // on a busy machine a later load may need one the first did not); none is freed.
    const uint64_t pinned = fake_->Stats().pinned_allocations_live;
    EXPECT_GE(pinned, pinned_before) << "one ring for every load";
    pinned_before = pinned;
  }
  const TfFakeCudaStats s = fake_->Stats();
  EXPECT_LE(s.pinned_allocations_live, 4u);  // 64 KiB of 16 KiB slots
  EXPECT_LE(s.peak_pinned_bytes, 64u << 10);
  EXPECT_EQ(s.pinned_bytes_in_use, (*loader)->stats().pinned_bytes);
  EXPECT_EQ(s.streams_live, streams);
  EXPECT_EQ(s.pageable_copies, 0u);
}

// A Loader per file (load_file per shard) makes its pipeline once: the next Loader takes the one
// the last left (LoadOptions::keep_staging), its ring still pinned as that load grew it, its
// counters its own.
TEST_F(LoaderDeviceTest, ALoaderPerFileTakesThePipelineTheLastOneLeft) {
  LayeredCheckpoint c(4, 700, 64 << 10);  // ~250 KB over several shards
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(c.dir.path())) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 3u);
  uint64_t pinned_slots = 0;
  uint64_t streams = 0;
  uint64_t loaded = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    SCOPED_TRACE(files[i]);
    auto loader = Loader::Open(files[i], DeviceOptions());
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    // Taken off the shelf (a new pipeline would leave the kept one there).
    EXPECT_EQ(IdleStagingBytes(), 0u);
    if (i > 0) {
      // The ring as the last load left it, not a new one beside it.
      EXPECT_EQ(fake_->Stats().pinned_allocations_live, pinned_slots);
      EXPECT_EQ(fake_->Stats().streams_live, streams);
    }
    auto tensors = (*loader)->Load();
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    uint64_t bytes = 0;
    for (const Tensor& t : *tensors) {
      EXPECT_EQ(Bytes(t), c.Full(t.name())) << t.name();
      bytes += t.size();
    }
    loaded += bytes;
    const LoadStats s = (*loader)->stats();
    EXPECT_EQ(s.staged_bytes, bytes) << "this Loader's bytes only";
    EXPECT_EQ(s.pinned_bytes, fake_->Stats().pinned_bytes_in_use);
    // The ring as this load left it (grown as far as its reads overlapped), for the next Loader.
    pinned_slots = fake_->Stats().pinned_allocations_live;
    if (i == 0) streams = fake_->Stats().streams_live;
    tensors->clear();
    loader->reset();
    EXPECT_EQ(IdleStagingBytes(), fake_->Stats().pinned_bytes_in_use) << "kept after the Loader";
  }
  EXPECT_EQ(loaded, c.total);
  EXPECT_EQ(ReleaseIdleStaging(), 1u);
  const TfFakeCudaStats s = fake_->Stats();
  EXPECT_EQ(s.pinned_allocations_live, 0u);
  EXPECT_EQ(s.streams_live, 0u);
  EXPECT_EQ(IdleStagingBytes(), 0u);
}

TEST_F(LoaderDeviceTest, WithoutKeepStagingTheLoaderFreesItsPipeline) {
  LayeredCheckpoint c(2, 200, 1 << 20);
  LoadOptions options = DeviceOptions();
  ASSERT_TRUE(options.Set("keep_staging", "off").ok());
  {
    auto loader = Loader::Open(c.dir.path(), options);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    auto tensors = (*loader)->Load();
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
  }
  EXPECT_EQ(IdleStagingBytes(), 0u);
  EXPECT_EQ(fake_->Stats().pinned_allocations_live, 0u);
  EXPECT_EQ(fake_->Stats().streams_live, 0u);
  // A pipeline of another configuration is not taken: a Loader with other staging options makes
  // its own.
  {
    auto loader = Loader::Open(c.dir.path(), DeviceOptions());
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  }
  ASSERT_EQ(fake_->Stats().pinned_allocations_live, 1u);  // kept: one slot, as Open pinned it
  LoadOptions bigger = DeviceOptions();
  bigger.staging_slot = 32 << 10;
  {
    auto loader = Loader::Open(c.dir.path(), bigger);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    EXPECT_EQ(fake_->Stats().pinned_allocations_live, 2u) << "its own ring beside the kept one";
  }
  EXPECT_EQ(ReleaseIdleStaging(), 2u);
}

// The device budget bounds the peak device memory of a streamed load whatever the shard size:
// the fake counts every cudaMalloc byte.
TEST_F(LoaderDeviceTest, DeviceBudgetBoundsPeakDeviceMemoryIndependentOfShardSize) {
  LayeredCheckpoint c(16, 100, 1 << 20);  // one shard of ~690 KB, no tensor above 46 KB
  ASSERT_GT(c.total, 600u << 10);
  const uint64_t budget = 96 << 10;
  LoadOptions o = DeviceOptions();
  o.device_budget = budget;
  auto loader = Loader::Open(c.dir.path(), o);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  size_t batches = 0;
  uint64_t most_live = 0;
  std::map<std::string, int> seen;
  Status s = (*loader)->Stream(Selection::All(), [&](Batch b) {
    EXPECT_EQ(b.device, Device::CUDA(0));
    ++batches;
    // Double buffering: the next batch's buffer is already allocated (and being read).
    most_live = std::max(most_live, fake_->Stats().device_allocations_live);
    for (const Tensor& t : b.tensors) {
      ++seen[t.name()];
      EXPECT_EQ(Bytes(t), c.Full(t.name())) << t.name();
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GT(batches, 5u);
  EXPECT_EQ(seen.size(), c.tensors.size());
  EXPECT_EQ(most_live, 2u) << "batch k + 1 is read while the caller handles batch k";
  const TfFakeCudaStats f = fake_->Stats();
  EXPECT_LE(f.peak_device_bytes, budget);
  EXPECT_LE((*loader)->stats().peak_device_bytes, budget);
  EXPECT_GT((*loader)->stats().peak_device_bytes, budget / 4);
  EXPECT_EQ(f.device_bytes_in_use, 0u);

  // All at once without a budget: the device memory is the tensors plus padding, not shards.
  LoadOptions all = DeviceOptions();
  auto loader2 = Loader::Open(c.dir.path(), all);
  ASSERT_TRUE(loader2.ok());
  Configure(DefaultConfig());  // peaks restart
  auto some = (*loader2)->Load(Selection::Layers(3, 4));
  ASSERT_TRUE(some.ok()) << some.status().ToString();
  uint64_t selected = 0;
  for (const Tensor& t : *some) selected += t.size();
  const uint64_t peak = fake_->Stats().peak_device_bytes;
  EXPECT_GE(peak, selected);
  // GDS off: ranges are 64-byte aligned, so padding is below 64 bytes per range (<= tensors).
  EXPECT_LE(peak, selected + 64 * some->size()) << "extra device memory beyond the tensors";
  EXPECT_EQ((*loader2)->stats().peak_device_bytes, peak);
}

// A read-ahead that finds the device full is not an error: the batch is read after the caller
// dropped the previous one.
TEST_F(LoaderDeviceTest, ReadAheadThatFindsTheDeviceFullWaitsForTheCaller) {
  LayeredCheckpoint c(4, 100, 1 << 20);  // layer batches of ~40 KB, the first (no layer) ~46 KB
  auto config = DefaultConfig();
  config.device_memory = 64 << 10;  // one batch fits, two do not
  Configure(config);
  LoadOptions o = DeviceOptions();
  o.order = DeliveryOrder::kLayer;
  auto loader = Loader::Open(c.dir.path(), o);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  size_t batches = 0;
  Status s = (*loader)->Stream(Selection::All(), [&](Batch b) {
    ++batches;
    EXPECT_EQ(fake_->Stats().device_allocations_live, 1u);
    for (const Tensor& t : b.tensors) EXPECT_EQ(Bytes(t), c.Full(t.name()));
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(batches, 5u);
  // Holding a batch makes the next one fail for real, with the device's own numbers.
  std::vector<Tensor> kept;
  s = (*loader)->Stream(Selection::All(), [&](Batch b) {
    for (Tensor& t : b.tensors) kept.push_back(std::move(t));
    return Status::Ok();
  });
  EXPECT_EQ(s.code(), Code::kDeviceOutOfMemory) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "free of")) << s.message();
}

TEST_F(LoaderDeviceTest, HoldingDeviceBatchesIsAClearBudgetError) {
  LayeredCheckpoint c(16, 100, 1 << 20);
  LoadOptions o = DeviceOptions();
  o.device_budget = 96 << 10;
  auto loader = Loader::Open(c.dir.path(), o);
  ASSERT_TRUE(loader.ok());
  std::vector<Tensor> kept;
  Status s = (*loader)->Stream(Selection::All(), [&](Batch b) {
    for (Tensor& t : b.tensors) kept.push_back(std::move(t));
    return Status::Ok();
  });
  EXPECT_EQ(s.code(), Code::kBudgetExceeded);
  EXPECT_TRUE(Contains(s.message(), "cuda:0 memory")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "device budget")) << s.message();
  EXPECT_LE(fake_->Stats().peak_device_bytes, 96u << 10);
  // Load of everything at once cannot fit at all: said before any read.
  auto all = (*loader)->Load();
  EXPECT_EQ(all.status().code(), Code::kBudgetExceeded);
  EXPECT_TRUE(Contains(all.status().message(), "device budget")) << all.status().message();
}

// Found by a review: Load's check before any read compared the tensors' bytes with the device
// budget, but the device allocator charges each batch's buffer, alignment padding included (with
// gds=auto, 4 KiB per range): a load that passed failed part-way, after batches were read. It
// is said before any read now, and a budget that holds the buffers loads.
TEST_F(LoaderDeviceTest, LoadChecksTheDeviceBuffersAgainstTheDeviceBudgetBeforeAnyRead) {
  testing::TestCheckpoint c;
  for (int i = 0; i < 8; ++i) c.Add("t" + std::to_string(i), DType::kU8, {1000004});
  c.Write(1 << 30);
  LoadOptions o = DeviceOptions();
  o.gds = GdsMode::kAuto;
  o.device_budget = c.total;
  {
    auto loader = Loader::Open(c.dir.path(), o);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    auto all = (*loader)->Load();
    EXPECT_EQ(all.status().code(), Code::kBudgetExceeded) << all.status().ToString();
    EXPECT_TRUE(Contains(all.status().message(), "Load returns every tensor at once"))
        << all.status().message();
    EXPECT_EQ(fake_->Stats().copies_enqueued, 0u) << "refused before any read";
  }
  o.device_budget = c.total + 8 * 8192;
  auto loader = Loader::Open(c.dir.path(), o);
  ASSERT_TRUE(loader.ok());
  auto all = (*loader)->Load();
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  for (const Tensor& t : *all) EXPECT_EQ(Bytes(t), c.Full(t.name())) << t.name();
}

// A load onto cuda:1 never creates a context on GPU 0: not on the producer threads (which
// never chose a device: "restoring" their device 0 would create one), not when the last tensor
// is dropped on a thread that never used CUDA (cudaFree on its own device).
TEST_F(LoaderDeviceTest, ALoadOntoAnotherGpuLeavesGpu0Alone) {
  auto config = DefaultConfig();
  config.device_count = 2;
  Configure(config);
  LayeredCheckpoint c(4, 700, 64 << 10);
  ASSERT_EQ(runtime_->api().cudaSetDevice(1), cuda::kSuccess);  // as torch.cuda.set_device(1)
  Configure(config);                                            // the counters from here on
  std::vector<Tensor> tensors;
  for (GdsMode gds : {GdsMode::kOff, GdsMode::kAuto}) {
    LoadOptions o = DeviceOptions();
    o.device = Device::CUDA(1);
    o.gds = gds;
    o.device_producers = 4;
    auto loader = Loader::Open(c.dir.path(), o);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    auto got = (*loader)->Load();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    for (const Tensor& t : *got) EXPECT_EQ(Bytes(t), c.Full(t.name())) << t.name();
    tensors = std::move(got).value();
  }
  std::thread([&tensors] { tensors.clear(); }).join();  // freed by a thread new to CUDA
  EXPECT_GE(ReleaseIdleStaging(), 1u);
  EXPECT_EQ(fake_->Stats().device_allocations_live, 0u);
  EXPECT_EQ(fake_->Stats().contexts_active_mask, 0b10u) << "a context was created on GPU 0";
  int current = -1;
  ASSERT_EQ(runtime_->api().cudaGetDevice(&current), cuda::kSuccess);
  EXPECT_EQ(current, 1);
  ASSERT_EQ(runtime_->api().cudaSetDevice(0), cuda::kSuccess);
}

TEST_F(LoaderDeviceTest, TensorsCoOwnTheDeviceBufferAfterTheLoaderIsGone) {
  LayeredCheckpoint c(2, 100, 1 << 20);
  std::vector<Tensor> tensors;
  {
    auto loader = Loader::Open(c.dir.path(), DeviceOptions());
    ASSERT_TRUE(loader.ok());
    auto got = (*loader)->Load();
    ASSERT_TRUE(got.ok());
    tensors = std::move(got).value();
  }
  // The loader's ring is kept for the next Loader (keep_staging), and freed on request.
  EXPECT_GT(fake_->Stats().pinned_allocations_live, 0u);
  EXPECT_EQ(ReleaseIdleStaging(), 1u);
  EXPECT_EQ(fake_->Stats().pinned_allocations_live, 0u) << "the loader's ring went";
  EXPECT_EQ(fake_->Stats().device_allocations_live, 1u) << "one buffer for the one batch";
  Tensor keep = tensors[3];
  tensors.clear();
  EXPECT_EQ(fake_->Stats().device_allocations_live, 1u);
  EXPECT_EQ(Bytes(keep), c.Full(keep.name()));
  keep = Tensor();
  EXPECT_EQ(fake_->Stats().device_allocations_live, 0u) << "cudaFree with the last tensor";
}

TEST_F(LoaderDeviceTest, PlacementPutsEachTensorWhereTheMapSaysAndNeverMixesBatches) {
  LayeredCheckpoint c(4, 100, 8 << 10);
  LoadOptions o = DeviceOptions();
  o.device = Device::CPU();
  o.placement = Placement({{"model.layers.1", Device::CUDA(0)},
                           {"model.layers.2", Device::CUDA(0)},
                           {"lm_head", Device::CUDA(0)},
                           {"model.layers.2.scalar", Device::CPU()}});
  auto loader = Loader::Open(c.dir.path(), o);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  EXPECT_EQ(fake_->Stats().pinned_allocations_live, 0u) << "no ring before a device is used";
  auto expected_device = [](const std::string& name) {
    if (name == "model.layers.2.scalar") return Device::CPU();
    if (name.rfind("model.layers.1.", 0) == 0 || name.rfind("model.layers.2.", 0) == 0 ||
        name == "lm_head.weight") {
      return Device::CUDA(0);
    }
    return Device::CPU();
  };
  std::vector<Device> order;
  size_t host_tensors = 0, device_tensors = 0;
  Status s = (*loader)->Stream(Selection::All(), [&](Batch b) {
    order.push_back(b.device);
    for (const Tensor& t : b.tensors) {
      EXPECT_EQ(t.device(), b.device) << t.name() << ": a batch mixes devices";
      EXPECT_EQ(t.device(), expected_device(t.name())) << t.name();
      EXPECT_EQ(Bytes(t), c.Full(t.name())) << t.name();
      (t.device().is_cpu() ? host_tensors : device_tensors) += 1;
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(device_tensors, 8u);  // layers 1 and 2 (less one scalar) and lm_head
  EXPECT_EQ(host_tensors, c.tensors.size() - 8);
  ASSERT_EQ(order.size(), 2u);
  EXPECT_EQ(order[0], Device::CPU()) << "host batches first";
  EXPECT_EQ(order[1], Device::CUDA(0));
  const LoadStats st = (*loader)->stats();
  EXPECT_EQ(st.device, "mixed");
  EXPECT_EQ(st.device_tensors, 8u);
  EXPECT_EQ(st.device_batches, 1u);

  // A placement naming a device that does not exist: kCudaNoDevice before any read.
  LoadOptions bad = DeviceOptions();
  bad.device = Device::CPU();
  bad.placement = Placement({{"lm_head", Device::CUDA(5)}});
  auto loader2 = Loader::Open(c.dir.path(), bad);
  ASSERT_TRUE(loader2.ok());
  auto got = (*loader2)->Load();
  EXPECT_EQ(got.status().code(), Code::kCudaNoDevice);
  EXPECT_TRUE(Contains(got.status().message(), "CUDA device 5 does not exist"));
}

TEST(LoaderPlacement, LongestPrefixOnComponentBoundaries) {
  auto place = Placement({{"model.layers.1", Device::CUDA(1)},
                          {"model.layers.1.mlp", Device::CUDA(2)},
                          {"model.", Device::CUDA(3)}},
                         Device::CPU());
  auto at = [&](const std::string& name) {
    TensorInfo t;
    t.name = name;
    return place(t);
  };
  EXPECT_EQ(at("model.layers.1.attn.w"), Device::CUDA(1));
  EXPECT_EQ(at("model.layers.1"), Device::CUDA(1));
  EXPECT_EQ(at("model.layers.1.mlp.up"), Device::CUDA(2));
  EXPECT_EQ(at("model.layers.10.attn.w"), Device::CUDA(3)) << "not a component boundary";
  EXPECT_EQ(at("lm_head.weight"), Device::CPU());
  EXPECT_EQ(Placement({{"", Device::CUDA(0)}})(TensorInfo{}), Device::CUDA(0));
}

TEST_F(LoaderDeviceTest, LoadIntoCallerDestinationsHostAndDevice) {
  LayeredCheckpoint c(2, 300, 1 << 20);
  auto loader = Loader::Open(c.dir.path(), DeviceOptions());
  ASSERT_TRUE(loader.ok());
  const std::string a = "model.layers.0.mlp.up_proj.weight";
  const std::string b = "model.layers.1.self_attn.q_proj.weight";
  const std::string h = "model.embed_tokens.weight";
  const uint64_t na = c.Full(a).size(), nb = c.Full(b).size(), nh = c.Full(h).size();
  // One device allocation holding both, with a gap: bytes past each tensor stay untouched.
  void* dev = nullptr;
  ASSERT_EQ(runtime_->api().cudaMalloc(&dev, na + nb + 100), cuda::kSuccess);
  auto* base = static_cast<std::byte*>(dev);
  std::string host(nh + 10, 'x');
  std::vector<Destination> dsts = {
      {a, Device::CUDA(0), base, na + 50},
      {b, Device::CUDA(0), base + na + 50, nb},
      {h, Device::CPU(), host.data(), host.size()},
  };
  Status s = (*loader)->LoadInto(dsts);
  ASSERT_TRUE(s.ok()) << s.ToString();
  const std::string image = fake_->ReadDevice(dev, na + nb + 100);
  EXPECT_EQ(image.substr(0, na), c.Full(a));
  EXPECT_EQ(image.substr(na, 50), std::string(50, kUntouched));
  EXPECT_EQ(image.substr(na + 50, nb), c.Full(b));
  EXPECT_EQ(host.substr(0, nh), c.Full(h));
  EXPECT_EQ(host.substr(nh), std::string(10, 'x'));
  const LoadStats st = (*loader)->stats();
  EXPECT_EQ(st.tensors, 3u);
  EXPECT_EQ(st.device_tensors, 2u);
  EXPECT_EQ(st.device_bytes, na + nb);
  EXPECT_EQ(st.device, "mixed");

  // Capacity, overlap, duplicates, unknown names: errors that name the tensor, before any read.
  Configure(DefaultConfig());  // counters restart
  std::vector<Destination> small = {{b, Device::CUDA(0), base, nb - 1}};
  s = (*loader)->LoadInto(small);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "tensor \"" + b + "\" needs " + std::to_string(nb) + " bytes"))
      << s.message();
  EXPECT_TRUE(Contains(s.message(), "on cuda:0 holds " + std::to_string(nb - 1) + " bytes"));
  std::vector<Destination> overlap = {{a, Device::CUDA(0), base, na},
                                      {b, Device::CUDA(0), base + na - 1, nb}};
  s = (*loader)->LoadInto(overlap);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "overlap on cuda:0")) << s.message();
  std::vector<Destination> same_address_other_device = {{a, Device::CUDA(0), base, na},
                                                        {b, Device::CPU(), nullptr, nb}};
  s = (*loader)->LoadInto(same_address_other_device);
  EXPECT_TRUE(Contains(s.message(), "null destination")) << s.message();
  std::vector<Destination> twice = {{a, Device::CUDA(0), base, na},
                                    {a, Device::CPU(), host.data(), host.size()}};
  EXPECT_EQ((*loader)->LoadInto(twice).code(), Code::kInvalidArgument);
  std::vector<Destination> missing = {{"nope", Device::CUDA(0), base, 1}};
  EXPECT_EQ((*loader)->LoadInto(missing).code(), Code::kNotFound);
  EXPECT_EQ(fake_->Stats().copies_enqueued, 0u) << "no read after a failed check";
  ASSERT_EQ(runtime_->api().cudaFree(dev), cuda::kSuccess);
}

// Checksums of device loads are checked in the staging slots, piece by piece before each slot's
// copy (checksum chunks of 1 KiB straddle the 16 KiB slots, which three producers fill out of
// order): every tensor staged is verified, bytes read with GDS are counted as skipped, and a
// flipped byte fails the load naming the tensor and chunk, with no batch handed out.
TEST_F(LoaderDeviceTest, ChecksumsAreCheckedInTheStagingSlots) {
  testing::TestCheckpoint c(
      [](uint64_t i, size_t h) { return static_cast<char>((i * 131 + h + (i >> 12)) & 0xff); });
  testing::AddLayeredModel(c, 3, 400);
  c.checksum_chunk_size = 1024;
  c.Write(64 << 10);
  const uint64_t n = c.tensors.size();
  for (const ReadPath& path : EveryReadPath()) {
    SCOPED_TRACE(path.what);
    LoadOptions o = path.options;
    o.verify = VerifyMode::kOn;
    auto loader = Loader::Open(c.dir.path(), o);
    if (!loader.ok() && loader.status().code() == Code::kUnsupported) continue;  // no io_uring
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    auto tensors = (*loader)->Load();
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    for (const Tensor& t : *tensors) EXPECT_EQ(Bytes(t), c.Full(t.name())) << t.name();
    const LoadStats s = (*loader)->stats();
    // verify=on: every tensor checked, so none read with GDS (their bytes would never pass
    // through the host: they were counted as skipped, and the load succeeded).
    EXPECT_EQ(s.verified_tensors, n);
    EXPECT_EQ(s.verified_bytes, c.total);
    EXPECT_EQ(s.gds_bytes, 0u);
    if (o.gds == GdsMode::kAuto && o.engine != Engine::kMmap) {
      EXPECT_TRUE(Contains(s.gds_reason, "checked against checksums (verify=on) used the staging"))
          << s.gds_reason;
      // verify=auto: read with GDS, those tensors unchecked (counted), every byte read once
      // (bytes_read counts cuFile's reads: it left them out).
      LoadOptions a = o;
      a.verify = VerifyMode::kAuto;
      auto gds = Loader::Open(c.dir.path(), a);
      ASSERT_TRUE(gds.ok()) << gds.status().ToString();
      ASSERT_TRUE((*gds)->Load().ok());
      const LoadStats g = (*gds)->stats();
      EXPECT_GT(g.gds_bytes, 0u);
      EXPECT_GT(g.verify_skipped_tensors, 0u) << "GDS bytes never pass through the host";
      EXPECT_EQ(g.verified_tensors + g.verify_skipped_tensors, n);
      EXPECT_EQ(g.bytes_read, c.total);
      // gds=on and verify=on cannot both be had: refused, saying so.
      LoadOptions on = o;
      on.gds = GdsMode::kOn;
      auto forced = Loader::Open(c.dir.path(), on);
      ASSERT_TRUE(forced.ok()) << forced.status().ToString();
      const auto refused = (*forced)->Load();
      EXPECT_EQ(refused.status().code(), Code::kInvalidArgument) << refused.status().ToString();
      EXPECT_TRUE(Contains(refused.status().message(), "set gds=auto"))
          << refused.status().ToString();
    }
  }
  const std::string name = "model.layers.1.mlp.up_proj.weight";
  const uint64_t size = c.Full(name).size();
  void* dev = nullptr;
  ASSERT_EQ(runtime_->api().cudaMalloc(&dev, size), cuda::kSuccess);
  const std::vector<Destination> dsts = {{name, Device::CUDA(0), dev, size}};
  {
    auto loader = Loader::Open(c.dir.path(), DeviceOptions());
    ASSERT_TRUE(loader.ok());
    ASSERT_TRUE((*loader)->LoadInto(dsts).ok());
    EXPECT_EQ(fake_->ReadDevice(dev, size), c.Full(name));
    EXPECT_EQ((*loader)->stats().verified_tensors, 1u);
    EXPECT_EQ((*loader)->stats().verified_bytes, size);
  }
  {
    // With GDS on hand and verify=on, a caller's device destination is staged and checked too
    // (it was read with GDS, counted as skipped); gds=on with verify=on is refused.
    LoadOptions o = DeviceOptions();
    o.gds = GdsMode::kAuto;
    o.verify = VerifyMode::kOn;
    auto loader = Loader::Open(c.dir.path(), o);
    ASSERT_TRUE(loader.ok());
    ASSERT_TRUE((*loader)->LoadInto(dsts).ok());
    EXPECT_EQ(fake_->ReadDevice(dev, size), c.Full(name));
    EXPECT_EQ((*loader)->stats().verified_tensors, 1u);
    EXPECT_EQ((*loader)->stats().gds_bytes, 0u);
    o.gds = GdsMode::kOn;
    auto forced = Loader::Open(c.dir.path(), o);
    ASSERT_TRUE(forced.ok());
    EXPECT_EQ((*forced)->LoadInto(dsts).code(), Code::kInvalidArgument);
  }
  // A flipped byte in the middle of an up projection: its 1 KiB chunk fails.
  {
    auto ckpt = tensorferry::Checkpoint::Open(c.dir.path());
    ASSERT_TRUE(ckpt.ok());
    const TensorInfo* info = nullptr;
    for (const TensorInfo& t : (*ckpt)->tensors()) {
      if (t.name == name) info = &t;
    }
    ASSERT_NE(info, nullptr);
    const std::string path = (*ckpt)->files()[info->file].path;
    std::string bytes = testing::ReadBytes(path);
    bytes[info->offset + 5000] ^= 0x08;  // offsets are the file's
    testing::WriteBytes(path, bytes);
  }
  for (Engine engine : {Engine::kPread, Engine::kIoUring}) {
    LoadOptions o = DeviceOptions();
    o.engine = engine;
    o.device_budget = 256 << 10;  // several batches
    auto loader = Loader::Open(c.dir.path(), o);
    if (!loader.ok() && loader.status().code() == Code::kUnsupported) continue;
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    std::vector<std::string> delivered;
    const Status s = (*loader)->Stream(Selection::All(), [&](Batch batch) {
      for (const Tensor& t : batch.tensors) delivered.push_back(t.name());
      return Status::Ok();
    });
    EXPECT_EQ(s.code(), Code::kChecksumMismatch) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "tensor \"" + name + "\": checksum mismatch in chunk 4 of "))
        << s.message();
    EXPECT_EQ(std::count(delivered.begin(), delivered.end(), name), 0);
    // Caller destinations on the device are checked the same way.
    const Status into = (*loader)->LoadInto(dsts);
    EXPECT_EQ(into.code(), Code::kChecksumMismatch) << into.ToString();
    // Tensor-parallel halves along dim 0 (2000 rows of 44 bytes): the chunks each holds whole are
    // checked in the slots; rank 0 holds the flipped chunk and fails, rank 1 loads, its half
    // counted as partial (32 bytes at its start are in a chunk cut between the ranks).
    for (uint32_t rank : {0u, 1u}) {
      LoadOptions t = o;
      t.device_budget = 0;  // Load returns every tensor at once
      TensorParallelOptions tp;
      tp.spec = ShardSpec::None();
      tp.spec.Set(name, ShardRule::Split(0));
      tp.rank = rank;
      tp.world = 2;
      t.tensor_parallel = tp;
      auto sliced = Loader::Open(c.dir.path(), t);
      ASSERT_TRUE(sliced.ok()) << sliced.status().ToString();
      auto got = (*sliced)->Load();
      if (rank == 0) {
        ASSERT_FALSE(got.ok());
        EXPECT_EQ(got.status().code(), Code::kChecksumMismatch) << got.status().ToString();
        EXPECT_TRUE(Contains(got.status().message(), "chunk 4 of ")) << got.status().message();
      } else {
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        EXPECT_EQ((*sliced)->stats().verify_partial_tensors, 1u);
        EXPECT_EQ((*sliced)->stats().verified_tensors, n - 1);
      }
    }
  }
  ASSERT_EQ(runtime_->api().cudaFree(dev), cuda::kSuccess);
}

// Found by a review: a slice split on dim 1 read to the device was never checked (its rows go
// through the staging slots without the hash), so verify=on let a flipped byte through, counted
// as skipped. Its rows are now hashed in the slots, row by row: where a row range holds whole
// checksum chunks, they are checked, read (pread, io_uring: the rows with the gaps between them)
// or gathered (mmap).
TEST_F(LoaderDeviceTest, ChecksumsOfStridedSlicesAreCheckedInTheStagingSlots) {
  testing::TestCheckpoint c;
  c.Add("w", DType::kF32, {16, 1024});  // rows of 4096 bytes: a rank's half row holds 2 chunks
  c.Add("n", DType::kF32, {64});
  c.checksum_chunk_size = 1024;
  c.Write(1 << 20);
  const std::string path = c.dir.Join("model.safetensors");
  ASSERT_TRUE(std::filesystem::exists(path));
  auto load = [&](Engine engine, uint32_t rank) {
    LoadOptions o = DeviceOptions();
    o.engine = engine;
    o.verify = VerifyMode::kOn;
    TensorParallelOptions tp;
    tp.spec = ShardSpec::None();
    tp.spec.Set("w", ShardRule::Split(1));
    tp.rank = rank;
    tp.world = 2;
    o.tensor_parallel = tp;
    std::pair<Status, LoadStats> out{Status::Ok(), {}};
    auto loader = Loader::Open(c.dir.path(), o);
    if (!loader.ok()) {
      out.first = loader.status();
      return out;
    }
    auto got = (*loader)->Load();
    out.first = got.status();
    out.second = (*loader)->stats();
    if (got.ok()) {
      const TensorInfo w{"w", DType::kF32, {16, 1024}, 0, 0, 16 * 1024 * 4};
      for (const Tensor& t : *got) {
        if (t.name() == "w") {
          EXPECT_EQ(Bytes(t), testing::NaiveSlice(w, ShardRule::Split(1), rank, 2, c.Full("w")));
        }
      }
    }
    return out;
  };
  for (Engine engine : testing::AvailableEngines()) {
    SCOPED_TRACE(EngineName(engine));
    for (uint32_t rank : {0u, 1u}) {
      const auto [status, stats] = load(engine, rank);
      ASSERT_TRUE(status.ok()) << status.ToString();
      EXPECT_EQ(stats.verified_tensors, 2u) << "both, every byte: whole chunks of each half row";
      EXPECT_EQ(stats.verify_skipped_tensors, 0u);
      EXPECT_EQ(stats.verified_bytes, 16u * 2048 + 256);
    }
  }
  // A flipped byte in rank 0's half of row 5: rank 0 fails naming the chunk, rank 1 loads.
  std::string bytes = testing::ReadBytes(path);
  auto ckpt = tensorferry::Checkpoint::Open(c.dir.path());
  ASSERT_TRUE(ckpt.ok());
  uint64_t w_offset = 0;
  for (const TensorInfo& t : (*ckpt)->tensors()) {
    if (t.name == "w") w_offset = t.offset;
  }
  bytes[w_offset + 5 * 4096 + 1500] ^= 0x10;  // chunk 21: [5 * 4096 + 1024, 5 * 4096 + 2048)
  testing::WriteBytes(path, bytes);
  for (Engine engine : testing::AvailableEngines()) {
    SCOPED_TRACE(EngineName(engine));
    const auto [bad, unused] = load(engine, 0);
    EXPECT_EQ(bad.code(), Code::kChecksumMismatch) << bad.ToString();
    EXPECT_TRUE(Contains(bad.message(), "tensor \"w\": checksum mismatch in chunk 21 of 64"))
        << bad.message();
    const auto [good, stats] = load(engine, 1);
    EXPECT_TRUE(good.ok()) << good.ToString();
  }
}

TEST_F(LoaderDeviceTest, CopyFailureIsReportedAndLeavesNothingBehind) {
  LayeredCheckpoint c(4, 300, 16 << 10);
  auto config = DefaultConfig();
  config.fail_copy_execute_at = 5;
  Configure(config);
  {
    auto loader = Loader::Open(c.dir.path(), DeviceOptions());
    ASSERT_TRUE(loader.ok());
    auto got = (*loader)->Load();
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), Code::kCudaError) << got.status().ToString();
    EXPECT_TRUE(Contains(got.status().message(), ".safetensors")) << got.status().message();
    EXPECT_EQ(fake_->Stats().device_allocations_live, 0u) << "the failed batch's buffer is freed";
  }
}

TEST_F(LoaderDeviceTest, MissingDeviceIsAClearErrorAtOpen) {
  LayeredCheckpoint c(1, 10, 1 << 20);
  LoadOptions o = DeviceOptions();
  o.device = Device::CUDA(2);
  auto loader = Loader::Open(c.dir.path(), o);
  ASSERT_FALSE(loader.ok());
  EXPECT_EQ(loader.status().code(), Code::kCudaNoDevice);
  EXPECT_TRUE(Contains(loader.status().message(), "CUDA device 2 does not exist (1 device)"));

  auto config = DefaultConfig();
  config.device_count = 0;
  Configure(config);
  auto none = Loader::Open(c.dir.path(), DeviceOptions());
  EXPECT_EQ(none.status().code(), Code::kCudaNoDevice) << none.status().ToString();

  Configure(DefaultConfig());
  LoadOptions one_slot = DeviceOptions();
  one_slot.staging_bytes = one_slot.staging_slot;
  EXPECT_EQ(Loader::Open(c.dir.path(), one_slot).status().code(), Code::kInvalidArgument);
}

TEST(LoaderDeviceOptions, ParseDeviceGdsAndEnvironment) {
  EXPECT_EQ(ParseDevice("cpu").value(), Device::CPU());
  EXPECT_EQ(ParseDevice("cuda").value(), Device::CUDA(0));
  EXPECT_EQ(ParseDevice("cuda:3").value(), Device::CUDA(3));
  EXPECT_EQ(ParseDevice("gpu:1").value(), Device::CUDA(1));
  for (const char* bad : {"", "cuda:", "cuda:x", "cuda3", "tpu", "cuda:-1"}) {
    EXPECT_EQ(ParseDevice(bad).status().code(), Code::kInvalidArgument) << bad;
  }
  EXPECT_EQ(DeviceName(Device::CUDA(7)), "cuda:7");
  EXPECT_EQ(DeviceName(Device::CPU()), "cpu");
  EXPECT_EQ(ParseGdsMode("on").value(), GdsMode::kOn);
  EXPECT_FALSE(ParseGdsMode("maybe").ok());

  testing::ScopedEnv d("TENSORFERRY_DEVICE", "cuda:1");
  testing::ScopedEnv g("TENSORFERRY_GDS", "off");
  testing::ScopedEnv s("TENSORFERRY_STAGING_BYTES", "32MiB");
  testing::ScopedEnv slot("TENSORFERRY_STAGING_SLOT", "4MiB");
  testing::ScopedEnv b("TENSORFERRY_DEVICE_BUDGET", "2GiB");
  auto o = LoadOptions::FromEnvironment();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->device, Device::CUDA(1));
  EXPECT_EQ(o->gds, GdsMode::kOff);
  EXPECT_EQ(o->staging_bytes, 32u << 20);
  EXPECT_EQ(o->staging_slot, 4u << 20);
  EXPECT_EQ(o->device_budget, 2ull << 30);
  testing::ScopedEnv wrong("TENSORFERRY_DEVICE", "cuda:zero");
  auto bad = LoadOptions::FromEnvironment();
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), "TENSORFERRY_DEVICE")) << bad.status().message();
}

TEST(LoaderDeviceOptions, CopyToHostFromTheHostIsAMemcpy) {
  const std::string src = "abcdef";
  std::string dst(6, '\0');
  ASSERT_TRUE(
      CopyToHost(Device::CPU(), src.data(), std::as_writable_bytes(std::span<char>(dst))).ok());
  EXPECT_EQ(dst, src);
}

}  // namespace
}  // namespace tensorferry
