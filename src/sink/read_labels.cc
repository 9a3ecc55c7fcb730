// What a failed read held, named for its error (sink.h: TensorsIn, AboutTensors).
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "sink/sink.h"
#include "util/json_writer.h"

namespace tensorferry::sink {

std::string TensorsIn(const Checkpoint& checkpoint, uint32_t file, uint64_t offset,
                      uint64_t length) {
  constexpr size_t kNamed = 3;
  const std::vector<TensorInfo>& tensors = checkpoint.tensors();
  const uint64_t end = length > UINT64_MAX - offset ? UINT64_MAX : offset + length;
  // tensors() is ordered by (file, offset) and a file's tensors do not overlap, so their ends are
  // ordered too: the first tensor of `file` ending after `offset` is the first that can overlap.
  auto it = std::partition_point(tensors.begin(), tensors.end(), [&](const TensorInfo& t) {
    return t.file < file || (t.file == file && t.offset + t.size <= offset);
  });
  std::vector<const TensorInfo*> named;
  uint64_t count = 0;
  for (; it != tensors.end() && it->file == file && it->offset < end; ++it) {
    if (it->size == 0) continue;  // holds no bytes
    if (named.size() < kNamed) named.push_back(&*it);
    ++count;
  }
  if (count == 0) return std::string();
  std::string out = count == 1 ? "tensor " : "tensors ";
  for (size_t i = 0; i < named.size(); ++i) {
    if (i > 0) out += (i + 1 == named.size() && count == named.size()) ? " and " : ", ";
    out += json::Quote(named[i]->name);
  }
  if (count > named.size()) out += " and " + std::to_string(count - named.size()) + " more";
  return out;
}

std::function<std::string(const io::ReadRequest&)> AboutTensors(
    const Checkpoint& checkpoint, const std::vector<io::FileSet::Pin>& pins) {
  return [&checkpoint, &pins](const io::ReadRequest& request) {
    for (size_t f = 0; f < pins.size(); ++f) {
      if (pins[f].file && pins[f].file.get() == request.file) {
        return TensorsIn(checkpoint, static_cast<uint32_t>(f), request.offset, request.dst.size());
      }
    }
    return std::string();
  };
}

Status MappedFaultError(const Checkpoint& checkpoint, uint32_t file, const io::MappedFile& map) {
  Status status = map.FaultError();
  if (status.ok()) return status;
  // The faulted page's bytes (a page may hold the end of one tensor and the start of the next).
  const long page = ::sysconf(_SC_PAGESIZE);
  return LabelTensors(std::move(status), checkpoint, file, map.first_fault_offset(),
                      page > 0 ? static_cast<uint64_t>(page) : 4096);
}

Status LabelTensors(Status status, const Checkpoint& checkpoint, uint32_t file, uint64_t offset,
                    uint64_t length) {
  if (status.ok()) return status;
  return io::WithReadHeld(std::move(status), TensorsIn(checkpoint, file, offset, length));
}

}  // namespace tensorferry::sink
