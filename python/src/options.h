// Load options and load statistics across the Python boundary (tensorferry._core).
//
// The options dict of _core.Reader goes key by key through LoadOptions::Set (options.h), the one
// place that reads and checks options: Python values become its text (an int its digits, a bool
// "true"/"false", which only boolean options accept). Errors are InvalidArgumentError naming the
// key and the value.
#pragma once

#include <nanobind/nanobind.h>

#include "tensorferry/options.h"
#include "tensorferry/stats.h"

namespace tensorferry::python {

// LoadOptions from TENSORFERRY_* defaults, overridden by the keys present in `options` (None
// values skipped): the keys of LoadOptions::Set, plus "placement" ([(name prefix, device)], as
// accelerate's device_map; tensors matching none go to `device`) and "shard_rules" as a bound
// ShardSpec. Checked with LoadOptions::Validate. Throws StatusError.
LoadOptions MakeLoadOptions(const nanobind::dict& options);

// The options in effect as a dict with the keys MakeLoadOptions reads (Reader.options()).
nanobind::dict OptionsDict(const LoadOptions& options);

// Every LoadStats field (VisitLoadStats) by name.
nanobind::dict StatsDict(const LoadStats& stats);

// Bytes from an int >= 0 or a str such as "256MB" (tensorferry::ParseSize); InvalidArgumentError
// otherwise (a bool, a negative int, a float, text that is not a size).
uint64_t ParseSizeValue(nanobind::handle value);

// Binds parse_size, parse_option (one option through LoadOptions::Set) and stats_fields (StatsDict
// of a zero LoadStats: the one list of the fields, which tensorferry.LoadStats is built from) into
// `m`.
void RegisterOptions(nanobind::module_& m);

}  // namespace tensorferry::python
