// Internal: the numbered shards of a checkpoint found by listing (a directory or an object-store
// prefix without model.safetensors.index.json) must all be there.
//
// transformers, huggingface_hub and our writer name the shards of a sharded checkpoint
// "<prefix>-<i>-of-<n>.safetensors" (i from 1 to n, both zero-padded to 5 digits by them; a
// series with a file numbered 0 is taken as numbered from 0 to n - 1). Without
// an index nothing else says which files make the checkpoint, so a shard lost in a copy or a
// download would silently leave its tensors out of the load. CheckShardSeries refuses a listing
// in which a series is incomplete, has a number outside 1..n or twice, or where one prefix has
// series of two sizes (the leftovers of another download).
//
// Pure: no I/O. Thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "tensorferry/status.h"

namespace tensorferry {

// "<prefix>-<index>-of-<count>.safetensors", parsed from a file name (no directory part).
// The views point into the name parsed.
struct ShardName {
  std::string_view prefix;      // may be empty ("-00001-of-00002.safetensors")
  uint32_t index = 0;           // as written (CheckShardSeries: 1..count, or 0..count-1)
  uint32_t count = 0;           // never 0
  std::string_view index_text;  // the digits as written ("00002"), for names of missing shards
  std::string_view count_text;  // ("00007")
};

// The series name of `file_name`, or nullopt when it is not one (numbers of ASCII digits that
// fit 32 bits; a count of 0 is not a series).
std::optional<ShardName> ParseShardName(std::string_view file_name);

// `paths`: every *.safetensors file (or object URL) the listing of `where` found; names are their
// last '/'-separated component. Files that are not named as a series are not checked.
// Errors: kCheckpointIncomplete, naming `where`, the series and the missing file names (the
// first few), or the two files or sizes that conflict.
Status CheckShardSeries(std::span<const std::string> paths, std::string_view where);

}  // namespace tensorferry
