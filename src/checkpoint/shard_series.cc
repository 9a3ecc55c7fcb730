#include "checkpoint/shard_series.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "util/decimal.h"
#include "util/json_writer.h"

namespace tensorferry {
namespace {

constexpr std::string_view kSuffix = ".safetensors";
constexpr std::string_view kOf = "-of-";
constexpr size_t kMaxNamed = 5;  // missing files named in a message

std::optional<uint32_t> Number(std::string_view digits) {
  const std::optional<uint64_t> value = ParseDecimal(digits, UINT32_MAX);
  if (!value) return std::nullopt;
  return static_cast<uint32_t>(*value);
}

std::string_view BaseName(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

// One file of a series, as found.
struct Member {
  ShardName shard;
  std::string_view name;  // the file name
};

std::string SeriesPattern(std::string_view prefix, std::string_view count_text) {
  return std::string(prefix) + "-*-of-" + std::string(count_text) + std::string(kSuffix);
}

std::string Padded(uint32_t value, size_t width) {
  std::string text = std::to_string(value);
  if (text.size() < width) text.insert(0, width - text.size(), '0');
  return text;
}

}  // namespace

std::optional<ShardName> ParseShardName(std::string_view name) {
  if (!name.ends_with(kSuffix)) return std::nullopt;
  name.remove_suffix(kSuffix.size());
  const size_t of = name.rfind(kOf);
  if (of == std::string_view::npos) return std::nullopt;
  const std::string_view count_text = name.substr(of + kOf.size());
  const std::optional<uint32_t> count = Number(count_text);
  if (!count || *count == 0) return std::nullopt;
  const std::string_view head = name.substr(0, of);  // "<prefix>-<index>"
  const size_t dash = head.rfind('-');
  if (dash == std::string_view::npos) return std::nullopt;
  const std::string_view index_text = head.substr(dash + 1);
  const std::optional<uint32_t> index = Number(index_text);
  if (!index) return std::nullopt;
  return ShardName{head.substr(0, dash), *index, *count, index_text, count_text};
}

Status CheckShardSeries(std::span<const std::string> paths, std::string_view where) {
  // prefix -> count -> members
  std::map<std::string_view, std::map<uint32_t, std::vector<Member>>> series;
  for (const std::string& path : paths) {
    const std::string_view name = BaseName(path);
    const std::optional<ShardName> shard = ParseShardName(name);
    if (shard) series[shard->prefix][shard->count].push_back(Member{*shard, name});
  }
  const std::string at(where);
  for (auto& [prefix, by_count] : series) {
    if (by_count.size() > 1) {
      const Member& a = by_count.begin()->second.front();
      const Member& b = std::next(by_count.begin())->second.front();
      return Status(Code::kCheckpointIncomplete,
                    at + ": files of two shard series: " + json::Quote(a.name) + " is one of " +
                        std::to_string(by_count.begin()->first) + ", " + json::Quote(b.name) +
                        " one of " + std::to_string(std::next(by_count.begin())->first) +
                        " (left over from another download or copy?); without " +
                        "model.safetensors.index.json nothing says which is the checkpoint: " +
                        "remove the other, or give the files to load");
    }
    const auto& [count, members] = *by_count.begin();
    // Numbered from 1 (transformers, huggingface_hub) or, when one file is numbered 0, from 0.
    const uint32_t first_number = std::any_of(members.begin(), members.end(),
                                              [](const Member& m) { return m.shard.index == 0; })
                                      ? 0
                                      : 1;
    const uint32_t last_number = count - 1 + first_number;
    // Sorted by number. Nothing here is sized by the count, which comes from a name (a key of a
    // listing the store's owner chose: "-of-999999999" must not cost memory).
    std::vector<const Member*> sorted;
    sorted.reserve(members.size());
    for (const Member& m : members) sorted.push_back(&m);
    std::sort(sorted.begin(), sorted.end(),
              [](const Member* a, const Member* b) { return a->shard.index < b->shard.index; });
    for (size_t k = 0; k < sorted.size(); ++k) {
      const Member& m = *sorted[k];
      if (m.shard.index > last_number) {
        return Status(Code::kCheckpointIncomplete,
                      at + ": " + json::Quote(m.name) + " is numbered " +
                          std::to_string(m.shard.index) + " in a series of " +
                          std::to_string(count) + " shards, whose numbers run from " +
                          std::to_string(first_number) + " to " + std::to_string(last_number));
      }
      if (k > 0 && sorted[k - 1]->shard.index == m.shard.index) {
        return Status(Code::kCheckpointIncomplete,
                      at + ": " + json::Quote(sorted[k - 1]->name) + " and " + json::Quote(m.name) +
                          " are both shard " + std::to_string(m.shard.index) + " of " +
                          std::to_string(count));
      }
    }
    if (members.size() == count) continue;
    const ShardName& first = members.front().shard;
    // Missing names written as the first one found writes its number: zero-padded to the
    // width it has when that is the count's width (transformers' "00001-of-00007"), else plain.
    const size_t width =
        first.index_text.size() == first.count_text.size() ? first.index_text.size() : 0;
    std::string missing;
    size_t named = 0;
    // The first few gaps: numbers before each present one, then after the last.
    uint64_t next = first_number;
    const std::string head = std::string(prefix) + "-";  // (a structured binding: not captured)
    auto name_up_to = [&](uint64_t end) {  // names next..end-1, at most kMaxNamed in all
      for (; next < end && named < kMaxNamed; ++next) {
        missing += (named++ == 0 ? "" : ", ") +
                   json::Quote(head + Padded(static_cast<uint32_t>(next), width) + "-of-" +
                               std::string(first.count_text) + std::string(kSuffix));
      }
    };
    for (const Member* m : sorted) {
      name_up_to(m->shard.index);
      next = uint64_t{m->shard.index} + 1;
    }
    name_up_to(uint64_t{last_number} + 1);
    const size_t absent = count - members.size();
    if (absent > named) missing += " and " + std::to_string(absent - named) + " more";
    return Status(Code::kCheckpointIncomplete,
                  at + ": incomplete checkpoint: " + std::to_string(absent) + " of the " +
                      std::to_string(count) + " shards " +
                      json::Quote(SeriesPattern(prefix, first.count_text)) +
                      (absent == 1 ? " is" : " are") + " missing: " + missing);
  }
  return Status::Ok();
}

}  // namespace tensorferry
