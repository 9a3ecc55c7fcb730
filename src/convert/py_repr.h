// Python's text for the values a pickle built: str() and repr() of scalars, strings, bytes and
// containers, as CPython 3.12 prints them (non-ASCII characters are kept as they are), for
// metadata and messages. Pure functions over a PickleResult.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "convert/pickle_vm.h"

namespace tensorferry::convert {

// Longest text PyStr produces; longer values are not representable.
inline constexpr size_t kMaxValueText = 1u << 20;

// The text a dict key contributes to a flattened name: str, int, bool, None, float; nullopt for
// any other key type.
std::optional<std::string> PyKeyText(const PickleResult& r, const Value& v);

// For every object: 1 when it is a list, tuple, set or frozenset that holds a tensor or a dict
// anywhere inside it (through other such containers, cycles included). One pass over all items:
// O(objects + items), whatever the graph's shape.
std::vector<uint8_t> HoldersOfTensorsOrDicts(const PickleResult& r);

// str(v), or nullopt with `why` set: for storages and tensors, values nested deeper than
// `max_depth` (recursive ones included) and texts longer than `max_text` bytes. The work done is
// bounded by max_text, however much the graph shares (a DAG of lists can have 2^depth paths);
// `produced` (optional) receives the bytes of text built, kept or not, to charge a budget with.
std::optional<std::string> PyStr(const PickleResult& r, const Value& v, uint32_t max_depth,
                                 std::string& why, size_t max_text = kMaxValueText,
                                 size_t* produced = nullptr);

// repr() of a str.
std::string PyStringRepr(const std::string& s);

}  // namespace tensorferry::convert
