// The device sink: one device buffer per batch from the device's budgeted allocator, read through
// the device's pipeline (staged copies or GDS); tensors are views co-owning the buffer.
#include <algorithm>
#include <string>
#include <utility>

#include "sink/sink.h"

namespace tensorferry::sink {
namespace {

class DeviceSink final : public BatchSink {
 public:
  DeviceSink(const SinkContext& context, const Plan& plan,
             const std::vector<std::vector<StridedRead>>& strided, Device device, DeviceSlot& slot)
      : c_(context), plan_(plan), strided_(strided), device_(device), slot_(slot) {}

  Result<std::optional<Reservation>> Reserve(const PlanBatch& batch) override {
    Result<std::shared_ptr<device::DeviceBuffer>> buffer =
        slot_.allocator->Allocate(batch.buffer_size, c_.options->allow_oversized);
    if (!buffer.ok()) {
      if (buffer.status().code() == Code::kBudgetExceeded) return std::optional<Reservation>();
      return buffer.status();
    }
    return std::optional<Reservation>(Reservation{{}, std::move(buffer).value()});
  }

  Status BudgetError(const PlanBatch& batch, size_t k, size_t n) const override {
    const device::DeviceAllocator& a = *slot_.allocator;
    const std::string head = "batch " + std::to_string(k + 1) + " of " + std::to_string(n) +
                             " needs " + std::to_string(batch.buffer_size) + " bytes of " +
                             DeviceName(device_) + " memory";
    if (a.in_use() == 0) {
      return Status(Code::kBudgetExceeded,
                    head + " (alignment padding included), more than the whole " +
                        std::to_string(a.budget()) +
                        "-byte device budget: raise it, or set allow_oversized");
    }
    return Status(Code::kBudgetExceeded,
                  head + " but " + std::to_string(a.in_use()) + " of the " +
                      std::to_string(a.budget()) +
                      "-byte device budget are still held by tensors of earlier batches: drop "
                      "them before the next batch, or raise the device budget");
  }

  // Reads batch `b` into the reserved device buffer and makes its tensors: views co-owning it.
  Result<Batch> Complete(size_t b, Reservation memory) override {
    const PlanBatch& batch = plan_.batches[b];
    const std::shared_ptr<device::DeviceBuffer>& buffer = memory.device;
    std::vector<device::DeviceTask> tasks;  // file pointers filled in per window
    std::vector<uint32_t> task_file;
    const std::atomic<bool>* cancel = c_.options->cancel.get();
    // Checksums (LoadOptions::verify): whole tensors hashed in the staging slots, each piece as
    // it lands there, before the slot is copied to the device; a mismatch fails the batch before
    // any of it is handed out. Bytes read with GDS never pass through host memory: under
    // verify=auto their tensors are counted as skipped; under verify=on they are staged.
    std::unique_ptr<LandingCheck> check;
    if (c_.checksums != nullptr && !c_.checksums->empty()) {
      check = LandingCheck::Make(*c_.checkpoint, batch.tensors, *c_.checksums, buffer->data(),
                                 *c_.verify_counts);
    }
    // Under verify=on every tensor is checked: its reads are staged, never GDS (options.h).
    const bool host_only = c_.options->verify == VerifyMode::kOn;
    for (const ReadTask& t : batch.tasks) {
      tasks.push_back(DeviceTaskOf(AsRead(t), buffer->data(), cancel));
      if (check) {
        tasks.back().passed = check->passed_hook();
        tasks.back().host_only = host_only;
      }
      task_file.push_back(t.file);
    }
    std::vector<const io::MappedFile*> gathered;  // the mappings rows are gathered from
    std::vector<uint32_t> gathered_file;          // and their files
    if (b < strided_.size()) {
      for (const StridedRead& r : strided_[b]) {
        device::DeviceTask task = DeviceTaskOf(r, buffer->data(), cancel);
        if (check) task.passed = check->passed_hook();  // row by row (the pipeline)
        if (r.gather) {
          // A file that cannot be mapped (the mapping table full, mmap refused) is read as
          // covering ranges instead: slower, not wrong; errors of the file itself surface there.
          Result<const io::MappedFile*> map = GatherMappingOf(c_, r.file);
          if (map.ok()) {
            task.source = (*map)->data();
            task.source_size = (*map)->size();
            task.source_map = *map;
            if (std::find(gathered.begin(), gathered.end(), *map) == gathered.end()) {
              gathered.push_back(*map);
              gathered_file.push_back(r.file);
            }
          }
        }
        tasks.push_back(task);
        task_file.push_back(r.file);
      }
    }
    std::vector<uint64_t> faults;
    for (const io::MappedFile* map : gathered) faults.push_back(map->faults());
    const Status ran = RunDeviceTasks(c_, slot_, tasks, task_file, buffer.get());
    for (size_t i = 0; i < gathered.size(); ++i) {
      const io::MappedFile& map = *gathered[i];
      if (map.faults() != faults[i]) {
        // Rows read as zeros (the file shrank under the mapping, or an I/O error): not handed
        // out, and said first (their checksums, checked in the slots, fail too).
        return MappedFaultError(*c_.checkpoint, gathered_file[i], map);
      }
    }
    TF_RETURN_IF_ERROR(ran);
    if (check) check->Count();
    return BatchInBuffer(*c_.checkpoint, batch, buffer->data(), buffer, device_);
  }

 private:
  const SinkContext& c_;
  const Plan& plan_;
  const std::vector<std::vector<StridedRead>>& strided_;
  const Device device_;
  DeviceSlot& slot_;
};

}  // namespace

std::unique_ptr<BatchSink> MakeDeviceSink(const SinkContext& context, const Plan& plan,
                                          const std::vector<std::vector<StridedRead>>& strided,
                                          Device device, DeviceSlot& slot) {
  return std::make_unique<DeviceSink>(context, plan, strided, device, slot);
}

device::DeviceTask DeviceTaskOf(const StridedRead& r, std::byte* base,
                                const std::atomic<bool>* cancel) {
  device::DeviceTask task;
  task.file_offset = r.file_offset;
  task.length = r.length();
  task.dst = base + r.buffer_offset;
  if (r.rows > 1) {  // a slice on a dimension other than 0: a 2D copy
    task.rows = r.rows;
    task.row_bytes = r.row_bytes;
    task.src_pitch = r.src_pitch;
    task.dst_pitch = r.dst_pitch;
  }
  task.cancel = cancel;
  return task;
}

Status RunDeviceTasks(const SinkContext& context, const DeviceSlot& slot,
                      const std::vector<device::DeviceTask>& tasks,
                      const std::vector<uint32_t>& task_file, device::DeviceBuffer* buffer) {
  return context.windows(
      DistinctFiles(task_file, context.checkpoint->files().size()), context.want_direct,
      [&](const std::vector<io::FileSet::Pin>& pins) {
        const std::function<std::string(const io::ReadRequest&)> about =
            AboutTensors(*context.checkpoint, pins);
        const std::vector<device::DeviceTask> window = WindowOf(tasks, task_file, pins, &about);
        return buffer != nullptr ? slot.pipeline->Run(window, *context.engine, buffer)
                                 : slot.pipeline->Run(window, *context.engine);
      });
}

}  // namespace tensorferry::sink
