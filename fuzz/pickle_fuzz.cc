// libFuzzer target: the bytes are a pickle (data.pkl of a torch.save archive). The restricted
// unpickler must never crash, hang, read outside the input or exceed its limits; whatever it
// accepts must be a consistent object graph (every reference inside the arena, every tensor view
// inside its storage).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "convert/pickle_vm.h"
#include "convert/py_repr.h"

namespace {

using tensorferry::convert::Kind;
using tensorferry::convert::Tag;
using tensorferry::convert::Value;

void CheckValue(const tensorferry::convert::PickleResult& r, const Value& v) {
  if (v.tag == Tag::kRef && v.ref >= r.objects.size()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  tensorferry::PickleLimits limits;
  limits.max_pickle_size = 1 << 20;
  limits.max_objects = 1 << 16;
  limits.max_total_items = 1 << 18;
  limits.max_memo = 1 << 16;
  limits.max_string = 1 << 16;
  // The first byte picks the persistent-id form, so both torch layouts are explored.
  const auto pids = size > 0 && (data[0] & 1) ? tensorferry::convert::PersistentIds::kLegacy
                                              : tensorferry::convert::PersistentIds::kZip;
  auto r = tensorferry::convert::RunPickle(bytes, limits, pids, "fuzz");
  if (!r.ok()) {
    if (r.status().message().rfind("fuzz: ", 0) != 0) std::abort();
    return 0;
  }
  if (r->end == 0 || r->end > size || r->objects.size() > limits.max_objects) std::abort();
  CheckValue(*r, r->root);
  for (const auto& o : r->objects) {
    for (const Value& v : o.items) CheckValue(*r, v);
    if (o.kind == Kind::kTensor && o.index >= r->tensors.size()) std::abort();
    if (o.kind == Kind::kStorage && o.index >= r->storages.size()) std::abort();
  }
  for (const auto& t : r->tensors) {
    if (t.storage >= r->storages.size() || t.shape.size() != t.stride.size()) std::abort();
    const auto& s = r->storages[t.storage];
    bool empty = false;
    uint64_t last = t.offset;
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (t.shape[i] == 0) empty = true;
      last += (t.shape[i] == 0 ? 0 : t.shape[i] - 1) * t.stride[i];
    }
    const uint64_t elem = tensorferry::convert::TorchDtypes()[t.dtype].element_size;
    if (!empty && (last + 1) * elem > s.nbytes) std::abort();
  }
  // Rendering values must terminate (cycles, depth) too.
  std::string why;
  (void)tensorferry::convert::PyStr(*r, r->root, 16, why);
  const auto holds = tensorferry::convert::HoldersOfTensorsOrDicts(*r);
  if (holds.size() != r->objects.size()) std::abort();
  return 0;
}
