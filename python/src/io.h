// Whole safetensors files in memory or on disk across the Python boundary (tensorferry/writer.h):
// serialize (to bytes), serialize_file and deserialize, the engines of tensorferry.numpy and
// tensorferry.torch save/load. Tensors to write come as (name, dtype name, shape, data address,
// byte length) entries whose memory the caller keeps alive and unchanged for the call.
#pragma once

#include <nanobind/nanobind.h>

namespace tensorferry::python {

// Binds serialize, serialize_file and deserialize into `m`.
void RegisterIo(nanobind::module_& m);

}  // namespace tensorferry::python
