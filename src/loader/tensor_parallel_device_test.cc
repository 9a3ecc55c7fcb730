// Tensor-parallel slices loaded onto a (fake) CUDA device: every rank's device tensors, copied
// back with CopyToHost, equal byte for byte the host sliced load and an element-by-element slice
// of the full tensor, for world sizes 1, 2, 3, 4, 8, splits on dims 0, 1 and 2, fused parts (given
// and equal), uneven sizes, rows longer than a staging slot, both engines kinds (copying, mmap),
// GDS off and auto; streamed under a device budget; placed partly on the host; tied aliases; and
// LoadInto of slices. Every test also proves that nothing leaked and that the fake saw no misuse
// (FakeCudaTest).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/cuda_api.h"
#include "cuda/cufile_api.h"
#include "tensorferry/device.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"
#include "tensorferry/writer.h"
#include "testing/fake_cuda.h"
#include "testing/shard_fixture.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using testing::NaiveSlice;
using testing::TempDir;

// Tensors for every layout the device path has: dim-0 splits (contiguous), dim-1 and dim-2 splits
// (strided 2D copies), fused dim-0 parts (one contiguous task per part), fused dim-1 equal parts
// (one 2D copy per part), rows longer than a staging slot, replicated, scalar and empty tensors,
// uneven sizes everywhere, over several files.
struct DeviceTpFixture : testing::TestCheckpoint {
  DeviceTpFixture() {
    Add("embed.weight", DType::kBF16, {539, 24}, ShardRule::Split(0));
    Add("layers.0.q.weight", DType::kF32, {323, 17}, ShardRule::Split(0));
    Add("layers.0.o.weight", DType::kBF16, {24, 331}, ShardRule::Split(1));
    Add("layers.0.o.bias", DType::kBF16, {24}, ShardRule::Replicate());
    Add("layers.0.conv.weight", DType::kF16, {5, 9, 131}, ShardRule::Split(2));
    Add("layers.0.mid.weight", DType::kI32, {6, 155, 5}, ShardRule::Split(1));
    Add("layers.0.qkv.weight", DType::kBF16, {144, 12}, ShardRule::Split(0, {128, 8, 8}));
    Add("layers.0.c_attn.weight", DType::kF32, {10, 195}, ShardRule::SplitEqual(1, 3));
    Add("layers.0.wide.weight", DType::kF32, {3, 10001}, ShardRule::Split(1));  // 40 KB rows
    Add("layers.0.scalar", DType::kI8, {}, ShardRule::Replicate());
    Add("layers.0.empty", DType::kF32, {0, 16}, ShardRule::Split(1));
    Add("head.weight", DType::kF64, {73, 8}, ShardRule::Split(0));
    Write(64 << 10);
  }

  // Sum of every tensor's local bytes on `rank` of `world`.
  uint64_t SliceBytes(uint32_t rank, uint32_t world) const {
    uint64_t sum = 0;
    for (const TensorToWrite& t : tensors) {
      TensorInfo info;
      info.name = t.name;
      info.dtype = t.dtype;
      info.shape = t.shape;
      info.size = TensorByteSize(t.dtype, t.shape).value();
      sum += SliceOf(info, spec.RuleFor(t.name), rank, world).value().bytes;
    }
    return sum;
  }
};

class TensorParallelDeviceTest : public testing::FakeCudaProcessTest {
 protected:
  // The bytes of a tensor wherever it is, through the public CopyToHost.
  static std::string Bytes(const Tensor& t) {
    std::string out(t.size(), '\0');
    const Status s = CopyToHost(t.device(), t.data(),
                                std::as_writable_bytes(std::span<char>(out.data(), out.size())));
    EXPECT_TRUE(s.ok()) << t.name() << ": " << s.ToString();
    return out;
  }

  static LoadOptions DeviceOptions(const DeviceTpFixture& f, uint32_t rank, uint32_t world) {
    LoadOptions o;
    o.device = Device::CUDA(0);
    o.threads = 3;
    o.staging_bytes = 64 << 10;
    o.staging_slot = 16 << 10;  // the wide tensor's rows (up to 40 KB) span several slots
    o.gds = GdsMode::kOff;
    o.tensor_parallel = TensorParallelOptions{f.spec, rank, world};
    return o;
  }
};

TEST_F(TensorParallelDeviceTest, EveryRankEqualsTheHostSliceAndSlicingTheFullTensor) {
  DeviceTpFixture f;
  for (uint32_t world : {1u, 2u, 3u, 4u, 8u}) {
    for (uint32_t rank = 0; rank < world; ++rank) {
      // The host sliced load of this rank: the reference the device must equal.
      LoadOptions host_options;
      host_options.engine = Engine::kPread;
      host_options.tensor_parallel = TensorParallelOptions{f.spec, rank, world};
      auto host_loader = Loader::Open(f.dir.path(), host_options).value();
      const std::vector<Tensor> host = host_loader->Load().value();
      ASSERT_EQ(host.size(), f.tensors.size());
      // The files were just written, so they are in the page cache: exact_when_cached gathers
      // strided rows from a mapping; without it the covering ranges are read and staged.
      for (auto [engine, gds, exact] : {std::tuple{Engine::kPread, GdsMode::kOff, true},
                                        std::tuple{Engine::kPread, GdsMode::kOff, false},
                                        std::tuple{Engine::kPread, GdsMode::kAuto, true},
                                        std::tuple{Engine::kMmap, GdsMode::kOff, false},
                                        std::tuple{Engine::kMmap, GdsMode::kAuto, true}}) {
        {
          SCOPED_TRACE("rank " + std::to_string(rank) + " of " + std::to_string(world) + ", " +
                       std::string(EngineName(engine)) + ", gds " + std::string(GdsModeName(gds)) +
                       (exact ? ", gathered" : ", covering reads"));
          const uint64_t copies_2d_before = fake_->Stats().copies_2d;
          LoadOptions o = DeviceOptions(f, rank, world);
          o.engine = engine;
          o.gds = gds;
          o.tensor_parallel->exact_when_cached = exact;
          auto loader = Loader::Open(f.dir.path(), o);
          ASSERT_TRUE(loader.ok()) << loader.status().ToString();
          auto tensors = (*loader)->Load();
          ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
          ASSERT_EQ(tensors->size(), host.size());
          const Checkpoint& ckpt = *(*loader)->checkpoint();
          for (size_t i = 0; i < tensors->size(); ++i) {
            const Tensor& t = (*tensors)[i];
            ASSERT_EQ(t.name(), host[i].name());
            EXPECT_EQ(t.device(), Device::CUDA(0)) << t.name();
            EXPECT_EQ(t.shape(), host[i].shape()) << t.name();
            EXPECT_EQ(t.dtype(), host[i].dtype()) << t.name();
            const std::string got = Bytes(t);
            EXPECT_EQ(got, Bytes(host[i])) << t.name();
            const TensorInfo& info = *ckpt.Find(t.name());
            EXPECT_EQ(got,
                      NaiveSlice(info, f.spec.RuleFor(t.name()), rank, world, f.Full(t.name())))
                << t.name();
            const TensorSlice slice = SliceOf(info, f.spec.RuleFor(t.name()), rank, world).value();
            EXPECT_EQ(t.shape(), slice.shape) << t.name();
          }
          const LoadStats s = (*loader)->stats();
          const uint64_t want = f.SliceBytes(rank, world);
          EXPECT_EQ(s.device_bytes, want);
          EXPECT_EQ(s.device_tensors, f.tensors.size());
          // The device buffer holds the slices only (no covered gaps): alignment padding aside,
          // less than 64 bytes per tensor with GDS off, 4 KiB with GDS possible.
          const uint64_t pad = gds == GdsMode::kOff ? 64 : 4096;
          EXPECT_GE(s.device_buffer_bytes, want);
          EXPECT_LT(s.device_buffer_bytes, want + pad * f.tensors.size());
          // Rows of the dim-1/dim-2 splits are never all read when world > 1: bytes read stay
          // below the whole checkpoint's; gathered, exactly the slices' bytes are read.
          EXPECT_GE(s.bytes_read, want);
          EXPECT_EQ(s.staged_bytes + s.gds_bytes, s.bytes_read);
          if (world > 1) {
            EXPECT_LT(s.bytes_read, ckpt.total_tensor_bytes());
            EXPECT_GT(fake_->Stats().copies_2d, copies_2d_before) << "strided slices: 2D copies";
            if (exact) {
              EXPECT_GT(s.gathered_bytes, 0u);
            } else {
              EXPECT_EQ(s.gathered_bytes, 0u);
              EXPECT_GT(s.bytes_read, want) << "covering reads read the gaps between rows";
            }
          }
          if (exact) {
            EXPECT_EQ(s.bytes_read, want);
          }
        }
      }
    }
  }
}

// Mappings of this process whose path lies under `dir` (/proc/self/maps).
size_t MappingsUnder(const std::string& dir) {
  std::ifstream maps("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find(dir) != std::string::npos) ++n;
  }
  return n;
}

// Rows gathered for the device need their file's mapping only while they are copied: it is gone
// when the load ends (no pages left in the process, no read lease on the file), and the next load
// maps the file again. A host mmap load's views keep theirs.
TEST_F(TensorParallelDeviceTest, GatherMappingsAreReleasedWhenTheLoadEnds) {
  DeviceTpFixture f;
  auto loader = Loader::Open(f.dir.path(), DeviceOptions(f, 1, 4)).value();
  for (int run = 0; run < 2; ++run) {
    auto tensors = loader->Load();
    ASSERT_TRUE(tensors.ok()) << tensors.status().ToString();
    EXPECT_GT(loader->stats().gathered_bytes, 0u) << "the files are cached: rows gathered";
    EXPECT_EQ(MappingsUnder(f.dir.path()), 0u) << "run " << run;
    const Checkpoint& ckpt = *loader->checkpoint();
    for (const Tensor& t : *tensors) {
      EXPECT_EQ(Bytes(t),
                NaiveSlice(*ckpt.Find(t.name()), f.spec.RuleFor(t.name()), 1, 4, f.Full(t.name())))
          << t.name();
    }
  }
  LoadOptions host;
  host.engine = Engine::kMmap;
  auto mapped = Loader::Open(f.dir.path(), host).value();
  const std::vector<Tensor> views = mapped->Load().value();
  EXPECT_GT(MappingsUnder(f.dir.path()), 0u) << "the views are the mapping";
}

TEST_F(TensorParallelDeviceTest, StreamedUnderADeviceBudget) {
  DeviceTpFixture f;
  for (uint32_t world : {2u, 3u}) {
    for (uint32_t rank = 0; rank < world; ++rank) {
      LoadOptions o = DeviceOptions(f, rank, world);
      o.device_budget = 128 << 10;  // batches of at most 64 KiB: the largest slice fits one
      auto loader = Loader::Open(f.dir.path(), o).value();
      size_t batches = 0;
      std::map<std::string, std::string> got;
      Status s = loader->Stream(Selection::All(), [&](Batch b) {
        ++batches;
        EXPECT_EQ(b.device, Device::CUDA(0));
        for (const Tensor& t : b.tensors) got[t.name()] = Bytes(t);
        return Status::Ok();  // every batch dropped before the next
      });
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_GT(batches, 1u);
      ASSERT_EQ(got.size(), f.tensors.size());
      const Checkpoint& ckpt = *loader->checkpoint();
      for (const auto& [name, bytes] : got) {
        EXPECT_EQ(bytes,
                  NaiveSlice(*ckpt.Find(name), f.spec.RuleFor(name), rank, world, f.Full(name)))
            << name << " rank " << rank << " of " << world;
      }
      EXPECT_LE(loader->stats().peak_device_bytes, 128u << 10);
    }
  }
}

// A placement sends some slices to the host, some to the device; both sides slice alike.
TEST_F(TensorParallelDeviceTest, PlacementSplitsSlicesBetweenHostAndDevice) {
  DeviceTpFixture f;
  LoadOptions o = DeviceOptions(f, 1, 3);
  o.placement = Placement({{"layers.0", Device::CUDA(0)}}, Device::CPU());
  auto loader = Loader::Open(f.dir.path(), o).value();
  const std::vector<Tensor> tensors = loader->Load().value();
  ASSERT_EQ(tensors.size(), f.tensors.size());
  const Checkpoint& ckpt = *loader->checkpoint();
  for (const Tensor& t : tensors) {
    const bool on_device = t.name().rfind("layers.0", 0) == 0;
    EXPECT_EQ(t.device(), on_device ? Device::CUDA(0) : Device::CPU()) << t.name();
    EXPECT_EQ(Bytes(t),
              NaiveSlice(*ckpt.Find(t.name()), f.spec.RuleFor(t.name()), 1, 3, f.Full(t.name())))
        << t.name();
  }
  EXPECT_EQ(loader->stats().device, "mixed");
}

// A tied alias absent from the files comes back on the device sharing its target's slice.
TEST_F(TensorParallelDeviceTest, TiedAliasSharesTheDeviceSlice) {
  DeviceTpFixture f;
  f.spec.Tie("lm_head.weight", "embed.weight");
  LoadOptions o = DeviceOptions(f, 2, 4);
  auto loader = Loader::Open(f.dir.path(), o).value();
  const std::vector<Tensor> tensors = loader->Load().value();
  ASSERT_EQ(tensors.size(), f.tensors.size() + 1);
  const Tensor* embed = nullptr;
  const Tensor* head = nullptr;
  for (const Tensor& t : tensors) {
    if (t.name() == "embed.weight") embed = &t;
    if (t.name() == "lm_head.weight") head = &t;
  }
  ASSERT_NE(embed, nullptr);
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->device(), Device::CUDA(0));
  EXPECT_EQ(head->data(), embed->data());
  EXPECT_EQ(head->shape(), embed->shape());
  const TensorInfo& info = *loader->checkpoint()->Find("embed.weight");
  EXPECT_EQ(Bytes(*head), NaiveSlice(info, ShardRule::Split(0), 2, 4, f.Full("embed.weight")));
}

// LoadInto with tensor parallelism reads each tensor's slice into the caller's memory, host or
// device.
TEST_F(TensorParallelDeviceTest, LoadIntoReadsSlicesIntoCallerMemory) {
  DeviceTpFixture f;
  for (uint32_t world : {1u, 3u, 8u}) {
    const uint32_t rank = world - 1;
    LoadOptions o = DeviceOptions(f, rank, world);
    auto loader = Loader::Open(f.dir.path(), o).value();
    const Checkpoint& ckpt = *loader->checkpoint();
    std::vector<Destination> destinations;
    std::vector<std::string> host_memory;  // host destinations (every other tensor)
    host_memory.reserve(f.tensors.size());
    std::vector<void*> device_memory;
    for (size_t i = 0; i < f.tensors.size(); ++i) {
      const std::string& name = f.tensors[i].name;
      const uint64_t bytes =
          SliceOf(*ckpt.Find(name), f.spec.RuleFor(name), rank, world).value().bytes;
      Destination d;
      d.name = name;
      d.capacity = bytes;
      if (i % 2 == 0) {
        host_memory.emplace_back(std::max<uint64_t>(bytes, 1), '\0');
        d.device = Device::CPU();
        d.data = host_memory.back().data();
      } else {
        void* p = nullptr;
        ASSERT_EQ(runtime_->api().cudaMalloc(&p, std::max<uint64_t>(bytes, 1)), cuda::kSuccess);
        device_memory.push_back(p);
        d.device = Device::CUDA(0);
        d.data = p;
      }
      destinations.push_back(d);
    }
    Status s = loader->LoadInto(destinations);
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (const Destination& d : destinations) {
      const TensorInfo& info = *ckpt.Find(d.name);
      std::string got(d.capacity, '\0');
      ASSERT_TRUE(CopyToHost(d.device, d.data,
                             std::as_writable_bytes(std::span<char>(got.data(), got.size())))
                      .ok());
      EXPECT_EQ(got, NaiveSlice(info, f.spec.RuleFor(d.name), rank, world, f.Full(d.name)))
          << d.name << " rank " << rank << " of " << world;
    }
    EXPECT_EQ(loader->stats().bytes, f.SliceBytes(rank, world));
    // A destination sized for the slice but one byte short is refused before any read, naming
    // the tensor and the slice's size.
    if (world > 1) {
      std::vector<Destination> short_one = {destinations[2]};
      short_one[0].capacity -= 1;
      const Status e = loader->LoadInto(short_one);
      EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.ToString();
      EXPECT_NE(e.message().find(short_one[0].name), std::string::npos) << e.ToString();
    }
    for (void* p : device_memory) ASSERT_EQ(runtime_->api().cudaFree(p), cuda::kSuccess);
  }
}

}  // namespace
}  // namespace tensorferry
