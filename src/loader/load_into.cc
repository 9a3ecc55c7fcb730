// Loader::LoadInto (loader.h): the selected tensors' reads (TensorReads) into caller memory, host
// destinations through the read engine, device ones through the device pipeline.
#include <algorithm>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

#include "loader/loader_impl.h"
#include "sink/landing_check.h"
#include "tensorferry/mapping.h"
#include "tensorferry/size.h"
#include "util/macros.h"

namespace tensorferry {

namespace {

// A destination of LoadInto for output `o`: a valid device, room for the tensor (its slice), not
// null unless the tensor is empty.
Status CheckDestination(const Destination& d, const OutputInfo& o,
                        const std::optional<TensorParallelOptions>& tensor_parallel) {
  const std::string what =
      o.slice ? " (the slice of rank " + std::to_string(tensor_parallel->rank) + " of " +
                    std::to_string(tensor_parallel->world) + ", " + o.slice->rule.ToString() + ")"
              : "";
  if (d.device.is_cuda() && d.device.index < 0) {
    return Status(Code::kInvalidArgument,
                  "tensor \"" + d.name + "\": CUDA device index " + std::to_string(d.device.index));
  }
  if (d.capacity < o.bytes) {
    return Status(Code::kInvalidArgument,
                  "tensor \"" + d.name + "\" needs " + std::to_string(o.bytes) + " bytes (" +
                      FormatBytes(o.bytes) + ")" + what + " but its destination on " +
                      DeviceName(d.device) + " holds " + std::to_string(d.capacity) + " bytes");
  }
  if (o.bytes > 0 && d.data == nullptr) {
    return Status(Code::kInvalidArgument, "tensor \"" + d.name + "\" (" + std::to_string(o.bytes) +
                                              " bytes" + what + "): null destination");
  }
  return Status::Ok();
}

// No two destinations may overlap on one device (the bytes each tensor occupies).
Status CheckOverlaps(std::span<const Destination> destinations,
                     const std::vector<const OutputInfo*>& outputs) {
  std::vector<size_t> by_address;
  for (size_t i = 0; i < destinations.size(); ++i) {
    if (outputs[i]->bytes > 0) by_address.push_back(i);
  }
  auto addr = [&](size_t i) { return reinterpret_cast<uintptr_t>(destinations[i].data); };
  std::sort(by_address.begin(), by_address.end(), [&](size_t a, size_t b) {
    const Device& da = destinations[a].device;
    const Device& db = destinations[b].device;
    return da == db ? addr(a) < addr(b) : da < db;
  });
  for (size_t j = 1; j < by_address.size(); ++j) {
    const size_t a = by_address[j - 1], b = by_address[j];
    const uint64_t size = outputs[a]->bytes;
    if (destinations[a].device == destinations[b].device && addr(a) + size > addr(b)) {
      return Status(Code::kInvalidArgument, "destinations of tensors \"" + destinations[a].name +
                                                "\" (" + std::to_string(size) + " bytes) and \"" +
                                                destinations[b].name + "\" overlap on " +
                                                DeviceName(destinations[a].device));
    }
  }
  return Status::Ok();
}

// Per file, the span [lo, hi) of the tensors `outputs` read (hi 0: not read).
std::pair<std::vector<uint64_t>, std::vector<uint64_t>> ReadSpans(
    const Checkpoint& ckpt, const std::vector<const OutputInfo*>& outputs) {
  const size_t nfiles = ckpt.files().size();
  std::vector<uint64_t> lo(nfiles, UINT64_MAX), hi(nfiles, 0);
  for (const OutputInfo* o : outputs) {
    const TensorInfo& t = ckpt.tensors()[o->tensor];
    if (t.size == 0) continue;
    lo[t.file] = std::min(lo[t.file], t.offset);
    hi[t.file] = std::max(hi[t.file], t.offset + t.size);
  }
  return {std::move(lo), std::move(hi)};
}

// The reads of LoadInto: host requests and, per CUDA device, device tasks (file and O_DIRECT
// descriptor filled in per window; element i reads file *_file[i]).
struct IntoReads {
  std::vector<io::ReadRequest> host;
  std::vector<uint32_t> host_file;
  std::map<int, std::vector<device::DeviceTask>> device_tasks;
  std::map<int, std::vector<uint32_t>> device_task_file;
  std::map<int, uint64_t> device_tensors, device_bytes;
};

IntoReads MakeIntoReads(const Checkpoint& ckpt, const std::vector<const OutputInfo*>& outputs,
                        std::span<const Destination> destinations, const LoadOptions& options) {
  IntoReads out;
  const std::atomic<bool>* cancel = options.cancel.get();
  for (size_t i = 0; i < destinations.size(); ++i) {
    const OutputInfo& o = *outputs[i];
    const TensorInfo& t = ckpt.tensors()[o.tensor];
    const Destination& d = destinations[i];
    if (o.bytes == 0) continue;
    auto* dst = static_cast<std::byte*>(d.data);
    // What lands where: the whole tensor, or the slice's blocks (contiguous or strided).
    const std::vector<StridedRead> reads = TensorReads(t, o.slice);
    if (d.device.is_cuda()) {
      for (const StridedRead& r : reads) {
        out.device_tasks[d.device.index].push_back(sink::DeviceTaskOf(r, dst, cancel));
        out.device_task_file[d.device.index].push_back(t.file);
      }
      out.device_tensors[d.device.index] += 1;
      out.device_bytes[d.device.index] += o.bytes;
      continue;
    }
    // Host: every row exactly (no covered gaps: the destination holds the slice only), cut into
    // chunk_size reads so one large tensor is read by every worker.
    for (const StridedRead& r : reads) {
      for (uint64_t row = 0; row < r.rows; ++row) {
        std::byte* to = dst + r.buffer_offset + row * r.dst_pitch;
        const uint64_t from = r.file_offset + row * r.src_pitch;
        for (uint64_t at = 0; at < r.row_bytes; at += options.chunk_size) {
          const uint64_t len = std::min(options.chunk_size, r.row_bytes - at);
          out.host.push_back({nullptr, from + at,
                              std::span<std::byte>(to + at, static_cast<size_t>(len)), -1, cancel});
          out.host_file.push_back(t.file);
        }
      }
    }
  }
  return out;
}

}  // namespace

Status Loader::LoadInto(std::span<const Destination> destinations) {
  TF_RETURN_IF_ERROR(CheckMappedFiles());
  Impl& m = *impl_;
  m.ResetStats();
  const auto start = Clock::now();
  const Checkpoint& ckpt = *m.checkpoint;

  // Every check before any read. With LoadOptions::tensor_parallel each tensor's slice is what is
  // read (and what the destination must hold); a tied alias reads its target (Describe).
  std::vector<std::string> names;
  names.reserve(destinations.size());
  std::set<std::string_view> seen;
  for (const Destination& d : destinations) {
    if (!seen.insert(d.name).second) {
      return Status(Code::kInvalidArgument, "tensor \"" + d.name + "\" has two destinations");
    }
    names.push_back(d.name);
  }
  TF_ASSIGN_OR_RETURN(const Description description, m.Describe(Selection::Names(names)));
  std::unordered_map<std::string_view, const OutputInfo*> output_of;
  for (const OutputInfo& o : description.outputs) output_of.emplace(o.name, &o);
  std::vector<const OutputInfo*> outputs;  // per destination
  std::set<Device> devices;
  for (const Destination& d : destinations) {
    const OutputInfo& o = *output_of.at(d.name);
    TF_RETURN_IF_ERROR(CheckDestination(d, o, m.options.tensor_parallel));
    outputs.push_back(&o);
    if (o.bytes > 0) devices.insert(d.device);
  }
  TF_RETURN_IF_ERROR(CheckOverlaps(destinations, outputs));
  TF_RETURN_IF_ERROR(m.OpenFiles());
  for (const Device& d : devices) {
    if (d.is_cuda()) TF_RETURN_IF_ERROR(m.Slot(d.index).status());
  }
  TF_ASSIGN_OR_RETURN(io::ReadEngine * engine, m.CopyEngine());
  std::map<int, device::DevicePipelineStats> pipeline0;
  for (const auto& [index, slot] : m.slots) {
    pipeline0[index] = slot.pipeline->stats();
    slot.allocator->ResetPeak();
  }
  const uint64_t direct0 = engine->stats().direct_bytes;
  const uint64_t read0 = engine->stats().bytes_read;
  const SourceStats source0 = m.SourceNow();
  TF_ASSIGN_OR_RETURN(std::vector<bool> want_direct, m.ChooseDirect(ReadSpans(ckpt, outputs)));

  IntoReads reads = MakeIntoReads(ckpt, outputs, destinations, m.options);
  // Checksums (LoadOptions::verify): whole host destinations are hashed as their bytes land, as a
  // batch buffer is, and whole device destinations in the staging slots on their way (bytes read
  // with GDS: skipped); slices are counted as skipped.
  sink::VerifyCounts verified;
  std::unique_ptr<sink::LandingCheck> check, device_check;
  if (!m.checksums.empty()) {
    std::vector<PlannedTensor> host, device;
    for (size_t i = 0; i < destinations.size(); ++i) {
      (destinations[i].device.is_cuda() ? device : host)
          .push_back({outputs[i]->tensor, reinterpret_cast<uintptr_t>(destinations[i].data),
                      outputs[i]->slice});
    }
    check = sink::LandingCheck::Make(ckpt, host, m.checksums, nullptr, verified);
    if (check) {
      for (io::ReadRequest& r : reads.host) r.landed = check->hook();
    }
    device_check = sink::LandingCheck::Make(ckpt, device, m.checksums, nullptr, verified);
    if (device_check) {
      for (auto& [index, tasks] : reads.device_tasks) {
        for (device::DeviceTask& t : tasks) {
          t.passed = device_check->passed_hook();
          // verify=on: checked in host memory, so not read with GDS (as the device sink's)
          t.host_only = m.options.verify == VerifyMode::kOn;
        }
      }
    }
  }
  std::set<uint32_t> counted;  // a tied alias and its target are one stored tensor's bytes
  for (const OutputInfo* o : outputs) {
    m.stats.tensors += 1;
    if (counted.insert(o->tensor).second) m.stats.bytes += o->bytes;
  }
  for (const auto& [index, tasks] : reads.device_tasks) {
    m.stats.device_tensors += reads.device_tensors.at(index);
    m.stats.device_bytes += reads.device_bytes.at(index);
  }
  const sink::SinkContext context = m.Context(std::move(want_direct), engine);
  if (!reads.host.empty()) {
    TF_RETURN_IF_ERROR(context.windows(
        sink::DistinctFiles(reads.host_file, ckpt.files().size()), context.want_direct,
        [&](const std::vector<io::FileSet::Pin>& pins) {
          const std::function<std::string(const io::ReadRequest&)> about =
              sink::AboutTensors(ckpt, pins);
          return engine->Execute(sink::WindowOf(reads.host, reads.host_file, pins, &about));
        }));
  }
  if (check) {
    TF_RETURN_IF_ERROR(check->VerifyAll(m.VerifyThreads()));  // none left unless a read had no hook
    check->Count();
  }
  for (const auto& [index, tasks] : reads.device_tasks) {
    TF_RETURN_IF_ERROR(sink::RunDeviceTasks(context, m.slots.at(index), tasks,
                                            reads.device_task_file.at(index), nullptr));
  }
  if (device_check) device_check->Count();
  // A file rewritten during the reads: the destinations may hold both versions' bytes.
  TF_RETURN_IF_ERROR(m.CheckFilesAfterReads());
  m.CollectVerifyStats(verified);
  m.stats.batches = (reads.host.empty() ? 0 : 1) + reads.device_tasks.size();
  m.stats.device_batches = reads.device_tasks.size();
  m.stats.device = devices.size() == 1 ? DeviceName(*devices.begin())
                   : devices.empty()   ? DeviceName(Device::CPU())
                                       : "mixed";
  m.stats.direct_bytes = engine->stats().direct_bytes - direct0;
  m.stats.bytes_read = engine->stats().bytes_read - read0;
  m.CollectDeviceStats(pipeline0);
  m.CollectSourceStats(source0);
  m.stats.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<bool> read(ckpt.files().size(), false);
  for (const OutputInfo* o : outputs) read[ckpt.tensors()[o->tensor].file] = true;
  return m.DropReadFiles(read);
}

}  // namespace tensorferry
