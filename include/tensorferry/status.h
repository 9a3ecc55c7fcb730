// tensorferry/status.h: errors as values.
//
// Every fallible call in tensorferry returns a Status or a Result<T>. A Status is either OK or
// carries a Code (one per distinct failure, so tests and callers can tell them apart) and a
// message that names the place: file, tensor, byte offset and the offending values.
//
// Codes are grouped into Categories (I/O, corrupt input, invalid argument, ...). The Python layer
// maps categories to exception classes and the CLI maps them to exit codes; the fine-grained Code
// is kept for tests and for callers that want to react to one case.
//
// Thread-safety: Status and Result are values. Distinct objects may be used from different threads
// freely; a const Status may be read from several threads at once (its state is immutable and
// shared by copies).
//
// The library never throws across its API except from Result<T>::ValueOrThrow(), which a caller
// chooses to call, and never aborts or prints.
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace tensorferry {

// Broad classes of failure. Stable; new ones may be added at the end.
enum class Category : uint8_t {
  kOk = 0,
  kIo,               // the operating system refused or failed a read/write/open
  kNotFound,         // a file or tensor that was asked for does not exist
  kCorrupt,          // the bytes of a file (header, index, data) break the format's rules
  kInvalidArgument,  // the caller passed something unusable
  kUnsupported,      // valid, but this build or machine cannot do it
  kBudget,           // the request does not fit the configured memory budget
  kCuda,             // the CUDA runtime or cuFile reported an error
  kInternal,         // a bug in tensorferry
  kCancelled,        // the caller cancelled the operation (LoadOptions::cancel)
};

// One code per distinct failure. Stable: values are never renumbered.
enum class Code : uint16_t {
  kOk = 0,

  // --- generic -----------------------------------------------------------------------------
  kIoError = 1,          // category kIo
  kNotFound = 2,         // category kNotFound
  kInvalidArgument = 3,  // category kInvalidArgument
  kUnsupported = 4,      // category kUnsupported
  kBudgetExceeded = 5,   // category kBudget
  kCudaError = 6,        // category kCuda
  kInternal = 7,         // category kInternal
  kUnexpectedEof = 8,    // category kIo: a file ended before a byte the format promised
  kCancelled = 9,        // category kCancelled
  kAccessDenied = 10,    // category kIo: a store or server refused access (HTTP 401/403)

  // --- safetensors header (category kCorrupt) -------------------------------------------------
  kFileTooSmall = 100,       // fewer than 8 bytes: no length prefix
  kHeaderTooLarge = 101,     // length prefix above ParseLimits::max_header_size
  kHeaderOutOfBounds = 102,  // 8 + length prefix runs past the end of the file
  kHeaderBom = 103,          // header starts with a UTF-8 byte-order mark
  kHeaderNotUtf8 = 104,      // header bytes are not valid UTF-8
  kHeaderInvalidJson = 105,  // header is not one valid JSON document
  kHeaderNotObject = 106,    // JSON top level is not an object
  kHeaderTooDeep = 107,      // JSON nesting beyond ParseLimits::max_depth
  kTooManyTensors = 108,     // more entries than ParseLimits::max_tensors
  kDuplicateKey = 109,       // a key appears twice in one JSON object (identical values too)
  kReservedName = 110,       // a tensor named "__metadata__"
  kMetadataNotObject = 111,  // "__metadata__" is not an object
  kMetadataNotString = 112,  // a "__metadata__" value is not a string
  kTensorNotObject = 113,    // a tensor entry is not an object
  kMissingField = 114,       // dtype, shape or data_offsets absent
  kUnknownDtype = 115,       // dtype not a string naming a known type (case-sensitive)
  kInvalidShape = 116,       // shape not an array of non-negative 64-bit integers
  kRankTooLarge = 117,       // more dimensions than ParseLimits::max_rank
  kInvalidOffsets = 118,     // data_offsets not exactly two non-negative 64-bit integers
  kOffsetsReversed = 119,    // data_offsets end < begin
  kPartialByte = 120,        // element count x bit width is not a whole number of bytes
  kSizeMismatch = 121,       // byte size from dtype and shape differs from end - begin
  kOverflow = 122,           // an element count, byte count or offset does not fit 64 bits
  kDataGap = 123,            // a hole between tensors (or the first does not start at 0)
  kDataOverlap = 124,        // two tensors share bytes
  kDataTrailing = 125,       // bytes after the last tensor, up to the end of the file
  kDataTruncated = 126,      // the tensors extend past the end of the file
  kTooManyMetadataEntries =
      127,                    // "__metadata__" holds more than ParseLimits::max_metadata_entries
  kCheckpointTooLarge = 128,  // a checkpoint's headers together exceed an OpenOptions::max_total_*

  // --- sharded checkpoints: model.safetensors.index.json (category kCorrupt) -------------------
  kIndexInvalidJson = 200,      // not valid UTF-8 JSON, too deep, or top level not an object
  kIndexNoWeightMap = 201,      // "weight_map" missing or not an object
  kIndexBadEntry = 202,         // a weight_map value is not a non-empty string
  kIndexPathEscape = 203,       // a file path leaves the checkpoint directory
  kIndexMissingTensor = 204,    // weight_map names a tensor its file does not contain
  kIndexUnlistedTensor = 205,   // a shard holds a tensor the weight_map does not list
  kIndexDuplicateTensor = 206,  // one tensor name in two files
  kIndexMissingFile = 207,      // weight_map names a file that does not exist
  kIndexTooLarge = 208,         // index file above the size limit
  // A directory or prefix read without an index lacks a shard of a "<prefix>-<i>-of-<n>"
  // series, numbers one twice or beyond n, holds series of two sizes, or lists a *.safetensors
  // entry that is a dangling symbolic link.
  kCheckpointIncomplete = 209,

  // --- writer (category kInvalidArgument) ------------------------------------------------------
  kBadTensorName = 300,  // a name the format cannot hold (e.g. "__metadata__", duplicate)
  kBadTensorData = 301,  // data length differs from dtype x shape, or no data source given

  // --- PyTorch checkpoints: pickle, zip, torch.save layout (convert.h) --------------------------
  // Category kCorrupt unless noted.
  kPickleTruncated = 400,          // the pickle ends inside an opcode or before STOP
  kPickleMalformed = 401,          // stack underflow, missing MARK, wrong operand types, bad memo
  kPickleUnsupportedOpcode = 402,  // category kUnsupported: an opcode the VM does not run
  kPickleRefusedGlobal = 403,      // category kUnsupported: a global outside the allowlist
  kPickleRefusedCall = 404,        // category kUnsupported: REDUCE/NEWOBJ/BUILD not allowlisted
  kPickleLimitExceeded = 405,      // a PickleLimits bound (stack, memo, sizes, objects) is hit
  kPickleBadPersistentId = 406,    // a persistent id that is not a torch storage reference
  kTorchBadTensor = 407,           // a tensor's view (offset, shape, stride) leaves its storage
  kTorchUnsupportedDtype = 408,    // category kUnsupported: no safetensors dtype for it
  kTorchMissingStorage = 409,      // a storage's bytes are absent or of the wrong size
  kZipInvalid = 410,               // not a readable zip archive, or inconsistent
  kZipBadEntry = 411,              // an entry cannot be read (CRC, compression, encryption)
  kTorchBadArchive = 412,          // no data.pkl, several archives, bad byteorder or version
  kTorchNameConflict = 413,        // two entries flatten to one name, or a name is unusable
  kTorchLegacyInvalid = 414,       // legacy (non-zip) layout: magic, protocol, storage records
  kTorchNotStateDict = 415,        // category kUnsupported: the top level holds no named tensors
  kConvertVerifyMismatch = 416,    // --verify: the output differs from the source
  // --- device loading: CUDA runtime, cuFile (docs/gpu.md) ---------------------------------------
  kCudaNotFound = 500,       // category kUnsupported: no CUDA runtime library could be loaded
  kCudaSymbolMissing = 501,  // category kUnsupported: a loaded library lacks a function we need
  kCudaNoDevice = 502,       // category kUnsupported: no usable device (or index out of range)
  kDeviceOutOfMemory = 503,  // category kCuda: cudaMalloc (or pinned host allocation) failed
  kGdsUnavailable = 504,     // category kUnsupported: GPUDirect Storage forced on but not usable
  kCufileError = 505,        // category kCuda: a cuFile call failed
  // --- integrity checksums (integrity.h, docs/integrity.md) ------------------------------------
  kChecksumMismatch = 600,  // category kCorrupt: a chunk's bytes differ from its recorded digest
  kChecksumsInvalid = 601,  // category kCorrupt: checksum metadata or manifest is malformed
};

// The category a code belongs to.
Category CategoryOf(Code code) noexcept;

// Short stable identifiers, e.g. "kDuplicateKey" -> "duplicate_key", "kIo" -> "io".
std::string_view CodeName(Code code) noexcept;
std::string_view CategoryName(Category category) noexcept;

class [[nodiscard]] Status {
 public:
  // An OK status. Cheap: holds no allocation.
  Status() noexcept = default;
  Status(Code code, std::string message);

  static Status Ok() noexcept { return Status(); }

  bool ok() const noexcept { return rep_ == nullptr; }
  Code code() const noexcept { return rep_ ? rep_->code : Code::kOk; }
  Category category() const noexcept { return CategoryOf(code()); }
  // The message without the code; empty when ok().
  const std::string& message() const noexcept;
  // "<code name>: <message>", or "ok".
  std::string ToString() const;

  // A copy with "prefix: " in front of the message (same code). No-op on OK.
  Status WithPrefix(std::string_view prefix) const;

 private:
  struct Rep {
    Code code;
    std::string message;
  };
  std::shared_ptr<const Rep> rep_;
};

// Thrown only by Result<T>::ValueOrThrow() and ThrowIfError().
class Error : public std::runtime_error {
 public:
  explicit Error(Status status)
      : std::runtime_error(status.ToString()), status_(std::move(status)) {}
  const Status& status() const noexcept { return status_; }

 private:
  Status status_;
};

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw Error(status);
}

// Either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "Result<Status> is not meaningful");

 public:
  // REQUIRES: !status.ok(). An OK status here becomes kInternal (a bug in the caller).
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) v_ = Status(Code::kInternal, "Result built from an OK status");
  }
  Result(const T& value) : v_(value) {}        // NOLINT(google-explicit-constructor)
  Result(T&& value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  template <typename U, typename = std::enable_if_t<std::is_constructible_v<T, U&&> &&
                                                    !std::is_same_v<std::decay_t<U>, Status> &&
                                                    !std::is_same_v<std::decay_t<U>, T>>>
  Result(U&& value) : v_(T(std::forward<U>(value))) {}  // NOLINT(google-explicit-constructor)

  bool ok() const noexcept { return std::holds_alternative<T>(v_); }
  // OK status when ok().
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }

  // REQUIRES: ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  // The value, or throws tensorferry::Error.
  T ValueOrThrow() && {
    if (!ok()) throw Error(std::get<Status>(v_));
    return std::get<T>(std::move(v_));
  }

 private:
  std::variant<T, Status> v_;
};

}  // namespace tensorferry
