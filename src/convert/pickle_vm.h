// A restricted unpickler for torch.save pickles.
//
// The VM runs the opcodes of pickle protocols 2 to 5 that torch.save and plain containers use and
// builds objects into an arena. It never imports or calls anything: the only globals it accepts
// are an allowlist (RunPickle's comment), each of which it emulates itself; REDUCE, NEWOBJ and
// BUILD work only on those. Everything else is an error naming the global, opcode or call and the
// pickle offset of the opcode. Every size read from the input is checked against the bytes left
// and against PickleLimits before anything is allocated; the VM has no recursion.
//
// The arena owns every object and objects refer to each other by index, so cycles (a list
// appended to itself through the memo) and deep nesting cost nothing to build or destroy;
// consumers walking the graph must bound their own depth (torch_checkpoint.cc does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/convert.h"
#include "tensorferry/format.h"
#include "tensorferry/status.h"

namespace tensorferry::convert {

// --- torch dtypes ------------------------------------------------------------------------------

struct TorchDtypeInfo {
  std::string_view name;          // "float32"
  std::string_view storage_name;  // "FloatStorage"; empty when torch has no typed storage class
  std::optional<DType> dtype;     // the safetensors dtype; nullopt: not representable
  uint32_t element_size = 0;      // bytes
};

// Every dtype the VM knows, by index. Index kUntypedStorageDtype is "uint8" (UntypedStorage).
std::span<const TorchDtypeInfo> TorchDtypes() noexcept;
// Index of a torch dtype by its name or alias ("float", "half", ...), or of a storage class name.
std::optional<uint8_t> TorchDtypeByName(std::string_view name) noexcept;
std::optional<uint8_t> TorchDtypeByStorageName(std::string_view storage_name) noexcept;
uint8_t TorchUint8Dtype() noexcept;

// --- values and objects
// ----------------------------------------------------------------------------

enum class Tag : uint8_t { kNone, kBool, kInt, kFloat, kRef };

// A Python value: scalars inline, everything else a reference into the arena.
// 16 bytes: the member read is the one `tag` names.
struct Value {
  Tag tag = Tag::kNone;
  union {
    int64_t i = 0;
    bool b;
    double f;
    uint32_t ref;
  };

  static Value None() { return {}; }
  static Value Bool(bool v) {
    Value x;
    x.tag = Tag::kBool;
    x.b = v;
    return x;
  }
  static Value Int(int64_t v) {
    Value x;
    x.tag = Tag::kInt;
    x.i = v;
    return x;
  }
  static Value Float(double v) {
    Value x;
    x.tag = Tag::kFloat;
    x.f = v;
    return x;
  }
  static Value Ref(uint32_t r) {
    Value x;
    x.tag = Tag::kRef;
    x.ref = r;
    return x;
  }
};

enum class Kind : uint8_t {
  kStr,
  kBytes,
  kBigInt,  // an integer wider than 64 bits: `str` holds its little-endian two's complement bytes
  kTuple,
  kList,
  kDict,  // items: key0, value0, key1, value1, ...
  kSet,
  kFrozenSet,
  kGlobal,
  kStorage,
  kTensor,
};

enum class GlobalId : uint8_t {
  kOrderedDict,                // collections.OrderedDict
  kRebuildTensor,              // torch._utils._rebuild_tensor
  kRebuildTensorV2,            // torch._utils._rebuild_tensor_v2
  kRebuildTensorV3,            // torch._utils._rebuild_tensor_v3
  kRebuildParameter,           // torch._utils._rebuild_parameter
  kRebuildParameterWithState,  // torch._utils._rebuild_parameter_with_state
  kTorchSize,                  // torch.Size
  kStorageType,                // torch.FloatStorage, ..., torch.storage.UntypedStorage
  kTorchDtype,                 // torch.float32, ...
  kCodecsEncode,               // _codecs.encode (bytes in protocol 2)
  // builtins (__builtin__ in protocol 2): set, frozenset, bytes and bytearray called on what
  // protocols below 4 pickle them from (set([...]), bytes() for b'', bytearray(b'...')).
  kBuiltinSet,
  kBuiltinFrozenSet,
  kBuiltinBytes,
  kBuiltinByteArray,
};

struct Object {
  Kind kind = Kind::kStr;
  GlobalId global = GlobalId::kOrderedDict;
  bool ordered = false;      // kDict made by OrderedDict
  bool torch_size = false;   // kTuple made by torch.Size
  bool untyped = false;      // kGlobal kStorageType: UntypedStorage
  bool bytearray = false;    // kBytes made by bytearray
  uint8_t dtype = 0;         // kGlobal kStorageType/kTorchDtype: index into TorchDtypes()
  uint32_t index = 0;        // kStorage/kTensor: index into PickleResult storages/tensors
  std::string str;           // kStr (UTF-8), kBytes, kBigInt; kGlobal: "module.name"
  std::vector<Value> items;  // kTuple, kList, kSet, kFrozenSet, kDict
};

struct StorageRecord {
  std::string key;
  std::string location;
  uint8_t dtype = 0;  // of the storage class (uint8 for UntypedStorage)
  bool untyped = false;
  uint64_t numel = 0;   // as recorded: elements of the storage class
  uint64_t nbytes = 0;  // numel x element size
  uint64_t pickle_offset = 0;
};

struct TensorRecord {
  uint32_t storage = 0;
  uint8_t dtype = 0;    // index into TorchDtypes()
  uint64_t offset = 0;  // elements
  std::vector<uint64_t> shape;
  std::vector<uint64_t> stride;
  bool parameter = false;
  uint64_t pickle_offset = 0;
};

enum class PersistentIds : uint8_t {
  kNone,    // any BINPERSID is an error
  kZip,     // ('storage', storage_type, key, location, numel)
  kLegacy,  // ('storage', storage_type, key, location, numel, None)
};

struct PickleResult {
  Value root;
  std::vector<Object> objects;
  std::vector<StorageRecord> storages;
  std::vector<TensorRecord> tensors;
  uint64_t end = 0;  // offset just past STOP
  int protocol = 0;  // from PROTO; 0 without it

  const Object& object(const Value& v) const { return objects[v.ref]; }
  // nullptr unless `v` is a reference to an object of `kind`.
  const Object* As(const Value& v, Kind kind) const {
    return v.tag == Tag::kRef && objects[v.ref].kind == kind ? &objects[v.ref] : nullptr;
  }
};

// Runs the pickle at the start of `bytes` up to its STOP. `source` starts every error message
// ("<file>: <archive>/data.pkl"). Bytes after STOP are not read (result.end tells where it was).
//
// Allowlist: collections.OrderedDict (called with nothing or a list of pairs; BUILD with a dict
// of attributes, which are dropped); torch._utils._rebuild_tensor, _rebuild_tensor_v2,
// _rebuild_tensor_v3, _rebuild_parameter, _rebuild_parameter_with_state; torch.Size (a tuple of
// ints); the torch storage classes (torch.FloatStorage, ..., torch.UntypedStorage,
// torch.storage.UntypedStorage) and dtypes (torch.float32, ...), which are values and may not
// be called; _codecs.encode(str, "latin1"). Persistent ids are storage references of the form
// `persistent_ids` names; one key always denotes one storage.
//
// Errors: kPickleTruncated, kPickleMalformed, kPickleUnsupportedOpcode, kPickleRefusedGlobal,
// kPickleRefusedCall, kPickleLimitExceeded, kPickleBadPersistentId, kTorchBadTensor.
Result<PickleResult> RunPickle(std::span<const std::byte> bytes, const PickleLimits& limits,
                               PersistentIds persistent_ids, std::string_view source);

// type(v).__name__ as Python prints it: "NoneType", "int", "str", "OrderedDict", "Size",
// "Tensor", "type" (OrderedDict, torch.Size, storage classes), "dtype", "function". The one
// type-name function of the converter: messages and reports use it alike.
std::string PyTypeName(const PickleResult& r, const Value& v);

// Python's repr() of a float ("0.1", "1e-05", "1.0", "inf", "nan").
std::string PythonFloatRepr(double v);
// Decimal text of a little-endian two's complement integer of any width.
std::string BigIntToDecimal(std::string_view le_bytes);

}  // namespace tensorferry::convert
