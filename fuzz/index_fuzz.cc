// libFuzzer target: the bytes are a model.safetensors.index.json. ParseIndexJson must never crash,
// hang or read outside the input; whatever it accepts must satisfy the documented invariants.
// The file names it accepts also go through the listing rule of numbered shard series
// (CheckShardSeries), which must hold the same way: no crash, an error only of its own code.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/shard_series.h"
#include "tensorferry/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view json(reinterpret_cast<const char*>(data), size);
  tensorferry::IndexLimits limits;
  limits.max_index_size = 1 << 20;
  auto doc = tensorferry::ParseIndexJson(json, "fuzz", limits);
  if (!doc.ok()) {
    // Every error names its source and says something.
    if (doc.status().message().rfind("fuzz: ", 0) != 0) std::abort();
    return 0;
  }
  const auto& map = doc->weight_map;
  // Sorted by tensor name with no duplicates; every file non-empty, relative, without "..".
  for (size_t i = 0; i < map.size(); ++i) {
    if (i > 0 && !(map[i - 1].first < map[i].first)) std::abort();
    const std::string& file = map[i].second;
    if (file.empty() || file[0] == '/' || file.find('\\') != std::string::npos ||
        file.find('\0') != std::string::npos || file == ".." || file.rfind("../", 0) == 0 ||
        file.find("/../") != std::string::npos ||
        (file.size() >= 3 && file.compare(file.size() - 3, 3, "/..") == 0)) {
      std::abort();
    }
  }
  std::vector<std::string> files;
  for (const auto& entry : map) files.push_back(entry.second);
  const tensorferry::Status series = tensorferry::CheckShardSeries(files, "fuzz");
  if (!series.ok() && (series.code() != tensorferry::Code::kCheckpointIncomplete ||
                       series.message().rfind("fuzz: ", 0) != 0)) {
    std::abort();
  }
  const auto& meta = doc->metadata;
  for (size_t i = 1; i < meta.size(); ++i) {
    if (!(meta[i - 1].first < meta[i].first)) std::abort();
  }
  return 0;
}
