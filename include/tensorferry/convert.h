// tensorferry/convert.h: reading PyTorch checkpoints without running them, and converting them to
// safetensors.
//
// A torch.save checkpoint ("pytorch_model.bin", "*.pt") is a Python pickle plus raw storage bytes.
// Loading one with torch.load (or pickle) runs whatever code the pickle names. TorchCheckpoint
// never does: its unpickler is a small virtual machine that knows the opcodes torch.save emits and
// builds only an allowlist of objects (dicts, lists, tuples, scalars, strings, OrderedDict,
// torch.Size, storages and tensors rebuilt by torch._utils._rebuild_tensor*/_rebuild_parameter*).
// Every other global, call or opcode is refused with its name and the pickle offset, before
// anything else happens. Nothing is imported, called or evaluated. docs/convert.md has the full
// allowlist, the limits and the naming rules.
//
// Formats read: the zip container of torch >= 1.6 ("<archive>/data.pkl", "<archive>/data/<key>",
// "<archive>/byteorder", "<archive>/version"), the legacy stream (torch.save(...,
// _use_new_zipfile_serialization=False): magic number, protocol, system info, the object pickle,
// the storage key list, then each storage's bytes after an 8-byte element count), and sharded
// checkpoints described by "pytorch_model.bin.index.json" ({"metadata":..., "weight_map": {tensor:
// file}}).
//
// Nested containers are flattened into dotted names: {"model": {"w": t}} gives "model.w", list and
// tuple items and integer keys give their decimal index ("optimizer.state.0.exp_avg"). Values
// that are not tensors (numbers, strings, ...) are kept as TorchValue entries with their Python
// str() text.
//
// Ownership: Open returns a uniquely owned TorchCheckpoint that keeps its files open until it is
// destroyed. Its tables are immutable. Thread-safety: the tables may be read from any thread;
// ReadTensor may be called from several threads (calls on one checkpoint are serialized).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/env.h"
#include "tensorferry/format.h"
#include "tensorferry/status.h"
#include "tensorferry/writer.h"

namespace tensorferry {

inline constexpr std::string_view kTorchIndexFileName = "pytorch_model.bin.index.json";
inline constexpr std::string_view kTorchFileName = "pytorch_model.bin";

// Bounds on what one pickle may make the unpickler hold, whatever its bytes. Exceeding any is
// kPickleLimitExceeded naming the limit and the pickle offset. The defaults fit checkpoints with
// millions of tensors; a pickle can never make the unpickler use much more memory than
// max_pickle_size + max_objects x ~100 bytes + max_total_items x 16 bytes.
struct PickleLimits {
  uint64_t max_pickle_size = 1ull << 30;  // bytes of one pickle (data.pkl, or a legacy prefix)
  uint64_t max_stack = 1u << 20;          // values on the VM stack at once
  uint64_t max_marks = 1u << 16;          // MARKs open at once
  uint64_t max_memo = 1u << 24;           // memo entries
  uint64_t max_memo_index = 1ull << 32;   // largest memo key (LONG_BINPUT takes 32 bits)
  uint64_t max_string = 64u << 20;        // bytes of one string, bytes object or integer
  // Bytes of one LONG1/LONG4 integer: 1786 bytes hold every integer of up to 4,300 decimal
  // digits, the limit Python itself puts on int <-> str conversion (whose cost is quadratic).
  uint64_t max_int_bytes = 1786;
  // Items and bytes the emulated calls copy (OrderedDict's pairs, torch.Size's dims,
  // _codecs.encode's bytes; each call of a memoized argument copies again), in total: at most
  // the pickle's size plus this allowance. A pickle that builds each argument once stays far
  // below it; one that calls the same large argument again and again is refused.
  uint64_t copy_allowance = 1u << 16;
  uint64_t max_container = 1u << 26;    // items of one list, tuple, set or dict
  uint64_t max_objects = 1u << 24;      // heap objects (strings, containers, tensors, ...)
  uint64_t max_total_items = 1u << 27;  // container items over all containers
  uint32_t max_rank = 64;               // dimensions of one tensor
};

struct TorchLimits {
  PickleLimits pickle;
  uint64_t max_zip_entries = 1u << 20;  // entries of one zip archive
  uint32_t max_depth = 64;              // nesting of containers when flattening names
  // Names and containers visited while flattening (a dict shared under many names counts once
  // per name).
  uint64_t max_entries = 1u << 22;
  // Work and memory of flattening one pickle, bounded by its size: every name and container
  // visited costs its dotted name's length plus 64 bytes, and one pickle's visits may cost at
  // most flatten_base + flatten_per_pickle_byte x the pickle's size. A tree-shaped state dict
  // costs a few times its pickle at most; a container shared under many names (a DAG, whose
  // names multiply with its depth) is refused.
  uint64_t flatten_base = 16u << 20;
  uint64_t flatten_per_pickle_byte = 16;
  // A conversion writes at most twice the bytes of the storages its tensors view, plus this:
  // room for views that overlap (w beside w.T or w[:2], written as copies) and for small views
  // that expand their storage (stride 0: torch's expand()). Beyond it, kTorchBadTensor naming
  // the tensor, its shape, strides and storage, before anything is written.
  uint64_t max_view_expansion = 64u << 20;
  uint64_t max_index_size = 256u << 20;  // bytes of pytorch_model.bin.index.json
};

enum class TorchFormat : uint8_t {
  kZip,     // torch >= 1.6 default
  kLegacy,  // _use_new_zipfile_serialization=False
};
std::string_view TorchFormatName(TorchFormat format) noexcept;  // "zip", "legacy"

struct TorchFileInfo {
  std::string path;
  TorchFormat format = TorchFormat::kZip;
  uint64_t file_size = 0;
  std::string archive;       // zip: the record prefix ("archive", "pytorch_model"); legacy: empty
  std::string version;       // zip: the "version" record, trimmed; legacy: the protocol number
  bool big_endian = false;   // the storages' byte order ("byteorder" record); bytes are swapped
  uint64_t pickle_size = 0;  // bytes of the object pickle
};

struct TorchStorage {
  std::string key;       // zip: "<archive>/data/<key>"; legacy: the key in the storage list
  std::string type;      // "FloatStorage", "UntypedStorage", ...
  std::string location;  // as recorded: "cpu", "cuda:0", ...
  uint64_t nbytes = 0;
  uint32_t file = 0;  // index into files()
};

struct TorchTensor {
  std::string name;  // flattened, dotted
  DType dtype = DType::kU8;
  std::string torch_dtype;  // "float32", "bfloat16", ...
  std::vector<uint64_t> shape;
  std::vector<uint64_t> stride;  // in elements
  uint64_t storage_offset = 0;   // in elements
  uint32_t storage = 0;          // index into storages()
  uint64_t byte_size = 0;        // of the materialized (contiguous) tensor
  // Row-major contiguous: the bytes are one range of the storage.
  bool contiguous = true;
  bool parameter = false;  // rebuilt as torch.nn.Parameter
};

// A leaf of the object tree that is not a tensor.
struct TorchValue {
  std::string name;  // flattened, dotted
  std::string type;  // Python type name: "int", "float", "str", "bool", "NoneType", "list", ...
  std::string text;  // str(value) as Python prints it; empty when !representable
  bool representable = false;
  std::string note;  // why it is not representable
};

struct TorchOpenOptions {
  // Where files are read from. nullptr means Env::Default(). Not owned; must outlive the
  // TorchCheckpoint. With a custom Env a path is a file or an index (".json") by its name.
  Env* env = nullptr;
  TorchLimits limits;
};

class TorchCheckpoint {
 public:
  // Opens a torch.save file (zip or legacy, told apart by their first bytes), a
  // pytorch_model.bin.index.json, or a directory holding one of those (the index first, then
  // pytorch_model.bin). Reads and runs every pickle, reads no storage bytes (except that legacy
  // files are scanned for where each storage lies).
  // Errors: kNotFound, kIoError, kUnexpectedEof; kPickleTruncated, kPickleMalformed,
  // kPickleUnsupportedOpcode, kPickleRefusedGlobal, kPickleRefusedCall, kPickleLimitExceeded,
  // kPickleBadPersistentId; kZipInvalid, kZipBadEntry, kTorchBadArchive, kTorchLegacyInvalid;
  // kTorchBadTensor, kTorchUnsupportedDtype, kTorchMissingStorage, kTorchNameConflict,
  // kTorchNotStateDict; the index errors of ParseIndexJson and kIndexMissingTensor,
  // kIndexUnlistedTensor, kIndexDuplicateTensor, kIndexMissingFile. Messages name the file, the
  // entry and the pickle offset.
  static Result<std::unique_ptr<TorchCheckpoint>> Open(const std::string& path,
                                                       const TorchOpenOptions& options = {});

  ~TorchCheckpoint();
  TorchCheckpoint(const TorchCheckpoint&) = delete;
  TorchCheckpoint& operator=(const TorchCheckpoint&) = delete;

  const std::vector<TorchFileInfo>& files() const noexcept;
  const std::vector<TorchStorage>& storages() const noexcept;
  // In the order the pickles hold them (file by file).
  const std::vector<TorchTensor>& tensors() const noexcept;
  const std::vector<TorchValue>& values() const noexcept;
  // nullptr when absent.
  const TorchTensor* Find(std::string_view name) const noexcept;
  // The index's path and "metadata" entries (each value as JSON text); empty without an index.
  const std::string& index_path() const noexcept;
  const std::vector<std::pair<std::string, std::string>>& index_metadata() const noexcept;

  // Fills `out` with bytes [offset, offset + out.size()) of tensors()[index] materialized as
  // safetensors stores it: contiguous, row-major, little-endian. Views with strides are gathered,
  // big-endian storages swapped.
  // REQUIRES: index < tensors().size(), offset + out.size() <= byte_size.
  // Errors: kInvalidArgument (arguments out of range), kIoError, kUnexpectedEof, kZipBadEntry,
  // kTorchMissingStorage (the storage's bytes are shorter than its tensors need).
  Status ReadTensor(size_t index, uint64_t offset, std::span<std::byte> out) const;

  // Checks the CRC-32 of every zip entry (storage) ReadTensor read that no read checked: a read
  // checks an entry's CRC only when it read the entry whole, in order, so a tensor viewing part
  // of its storage, or views read out of order, leave it unchecked; each such entry is read once
  // more whole. Call it before handing out what was read (ConvertTorchCheckpoint does, before its
  // output is put in place). Errors: kZipBadEntry (a CRC mismatch: the bytes read may be wrong),
  // kIoError.
  Status CheckStoragesRead() const;

  // The same for the storage of tensors()[index] alone: for a caller that hands out each tensor
  // as soon as it is read (call it after reading the tensor whole, before handing it out). Costs
  // nothing when the read checked the entry (a tensor viewing its whole storage, read in order);
  // else the entry is read once more whole (once: later calls find it checked). Legacy files
  // carry no CRC: nothing to check. A set `*cancel` (another thread's Ctrl-C) stops the re-read
  // between 1 MiB steps, the storage left unchecked. Errors: kInvalidArgument (index out of
  // range), kZipBadEntry, kIoError, kCancelled.
  Status CheckTensorRead(size_t index, const std::atomic<bool>* cancel = nullptr) const;

 private:
  friend class TorchCheckpointOpener;
  struct Impl;
  explicit TorchCheckpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// --- conversion ---------------------------------------------------------------------------------

struct ConvertOptions {
  TorchOpenOptions open;
  // 0: one file at the destination, unless the source is sharded. Else a directory of shards of
  // at most this many data bytes (a tensor larger than this gets its own shard) plus
  // model.safetensors.index.json. A sharded source gives a sharded output whose shards are at
  // most as large as the source's largest shard, unless this is set.
  uint64_t max_shard_size = 0;
  // Keep representable non-tensor values as "__metadata__" entries (name -> str(value)). When
  // false they are all reported as skipped.
  bool keep_values = true;
  WriteOptions write;
};

struct ConvertReport {
  std::vector<std::string> outputs;  // files written: shards, then the index when sharded
  bool sharded = false;
  uint64_t tensors = 0;       // tensors written
  uint64_t tensor_bytes = 0;  // data bytes written
  uint64_t source_bytes = 0;  // size of the source files
  // (alias, kept): tensors identical to another view of the same storage, written once. Each
  // is recorded as "__metadata__" entry alias -> kept, as safetensors.torch.save_model does.
  std::vector<std::pair<std::string, std::string>> aliases;
  // (name, why): tensors written as copies although they share bytes with another tensor: views
  // that overlap another view of their storage without being identical to it (safetensors
  // cannot express partial sharing), and an alias that could not be recorded as one.
  std::vector<std::pair<std::string, std::string>> copied_views;
  std::vector<std::pair<std::string, std::string>> kept_values;  // (name, text) in metadata
  std::vector<std::pair<std::string, std::string>> skipped;      // (name, why)
  std::vector<std::pair<std::string, std::string>> metadata;     // what "__metadata__" holds
};

// Converts the checkpoint at `src` (anything TorchCheckpoint::Open takes) to safetensors at
// `dst`: a file path when the output is one file (an existing directory gets "model.safetensors"
// inside), a directory otherwise (created if missing; shards "model-0000i-of-0000n.safetensors"
// and "model.safetensors.index.json"). Output into a directory is WriteSharded's, all or nothing:
// an older checkpoint there is replaced as a whole or left exactly as it was (writer.h); a file
// path is written atomically. Every output file's "__metadata__" holds {"format": "pt"}, the alias
// entries and the kept values.
// Errors: those of TorchCheckpoint::Open and of WriteFile/WriteSharded (kBadTensorName for a
// tensor named "__metadata__"); kInvalidArgument when an output file would replace a source file;
// kTorchBadTensor when the tensors to write exceed twice their storages' bytes plus
// TorchLimits::max_view_expansion (naming the tensor, its shape, strides and storage).
Result<ConvertReport> ConvertTorchCheckpoint(const std::string& src, const std::string& dst,
                                             const ConvertOptions& options = {});

struct VerifyConversionReport {
  uint64_t tensors = 0;  // names compared (aliases included)
  uint64_t bytes = 0;    // tensor bytes compared
};

// Re-reads both sides from disk and compares them: the source with a fresh TorchCheckpoint, the
// output with Checkpoint::Open (checkpoint.h). Every source tensor must be present in the output
// under its name or as an alias whose "__metadata__" entry names a tensor holding the same
// dtype, shape and bytes; every output tensor must come from the source.
// Errors: those of TorchCheckpoint::Open and Checkpoint::Open, kIoError, and
// kConvertVerifyMismatch naming the tensor and the first differing byte.
Result<VerifyConversionReport> VerifyConversion(const std::string& src, const std::string& dst,
                                                const ConvertOptions& options = {});

}  // namespace tensorferry
