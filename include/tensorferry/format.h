// tensorferry/format.h: the safetensors format: dtypes and the header parser/validator.
//
// A safetensors file is: an 8-byte little-endian length N, N bytes of UTF-8 JSON (the header),
// then the data buffer. The header maps tensor names to {dtype, shape, data_offsets}, plus an
// optional "__metadata__" object of string -> string. docs/format.md lists every rule enforced.
//
// The parser is a pure function over bytes: no I/O, no globals, no allocation beyond its result
// and a scratch JSON parser. It never reads outside the span it is given, whatever the bytes.
// Every rejection returns its own Code (see status.h) and a message naming the source, the
// tensor and the offending values.
//
// Thread-safety: all functions here are reentrant and may run concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorferry/status.h"

namespace tensorferry {

// Element types, in the reference's order (the writer sorts tensors by this order, descending).
enum class DType : uint8_t {
  kBool,
  kF4,
  kF6_E2M3,
  kF6_E3M2,
  kU8,
  kI8,
  kF8_E5M2,
  kF8_E4M3,
  kF8_E8M0,
  kF8_E4M3FNUZ,
  kF8_E5M2FNUZ,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kC64,
  kF64,
  kI64,
  kU64,
};
inline constexpr int kNumDTypes = 22;

// The name used in headers, e.g. "BF16", "F8_E4M3".
std::string_view DTypeName(DType dtype) noexcept;
// A shape as messages and tables print it: "[4096, 11008]", "[]" for a scalar.
std::string ShapeText(std::span<const uint64_t> shape);
// Case-sensitive lookup of a header name; nullopt when unknown.
std::optional<DType> DTypeFromName(std::string_view name) noexcept;
// Width of one element in bits: 4 (F4), 6 (F6_*), 8, 16, 32 or 64.
unsigned DTypeBits(DType dtype) noexcept;

// Number of elements of a shape (1 for a scalar), or nullopt on 64-bit overflow.
std::optional<uint64_t> NumElements(std::span<const uint64_t> shape) noexcept;
// Bytes taken by `shape` elements of `dtype`. Errors: kOverflow, kPartialByte (sub-byte dtypes
// whose total bit count is not a multiple of 8).
Result<uint64_t> TensorByteSize(DType dtype, std::span<const uint64_t> shape);

// Capacity limits of the parser. The defaults accept every file the reference implementation
// (huggingface/safetensors) accepts except where docs/format.md says we are stricter.
struct ParseLimits {
  // Largest header (the JSON) in bytes. The reference's own limit.
  uint64_t max_header_size = 100'000'000;
  // Most tensors in one file (each costs about 0.6 KB while open; real checkpoints hold at most
  // tens of thousands per file).
  uint64_t max_tensors = 1'000'000;
  // Most "__metadata__" entries in one file (real files hold a handful).
  uint64_t max_metadata_entries = 65'536;
  // Deepest JSON nesting. A well-formed header nests 3 deep (object, tensor, shape).
  uint32_t max_depth = 64;
  // Most dimensions of one tensor (NumPy's limit).
  uint32_t max_rank = 64;
};

// One tensor of one file as its header describes it.
struct TensorEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  // Byte range within the data buffer (relative to Header::data_offset()).
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t byte_size() const noexcept { return end - begin; }
};

// A parsed and fully validated header.
struct Header {
  uint64_t header_size = 0;  // N, the JSON length (including any padding)
  uint64_t data_size = 0;    // bytes of the data buffer: file size - 8 - N
  // Tensors sorted by data offset (file order), which for a valid file tiles [0, data_size).
  std::vector<TensorEntry> tensors;
  // "__metadata__" entries sorted by key; empty when absent.
  std::vector<std::pair<std::string, std::string>> metadata;
  bool has_metadata = false;  // "__metadata__" was present (possibly empty)

  uint64_t data_offset() const noexcept { return 8 + header_size; }
};

// Checks the 8-byte length prefix against the file size.
// `prefix` holds the first min(8, file_size) bytes of the file.
// Returns N. Errors: kFileTooSmall, kHeaderTooLarge, kHeaderOutOfBounds.
// `source` (usually the file path) only appears in messages.
Result<uint64_t> ParseHeaderLength(std::span<const std::byte> prefix, uint64_t file_size,
                                   const ParseLimits& limits = {}, std::string_view source = "");

// Parses and validates a whole header.
// `file_start` holds the first bytes of the file: at least 8 + N of them (the length prefix and
// the JSON), or all of them when the file is shorter. `file_size` is the size of the whole file;
// the data buffer need not be present in `file_start`.
// Errors: those of ParseHeaderLength, then kHeaderBom, kHeaderNotUtf8, kHeaderInvalidJson,
// kHeaderNotObject, kHeaderTooDeep, kTooManyTensors, kDuplicateKey, kMetadataNotObject,
// kMetadataNotString, kTensorNotObject, kMissingField, kUnknownDtype, kInvalidShape,
// kRankTooLarge, kInvalidOffsets, kOffsetsReversed, kPartialByte, kSizeMismatch, kOverflow,
// kDataGap, kDataOverlap, kDataTrailing, kDataTruncated; kInvalidArgument when `file_start` is
// shorter than 8 + N while the file is not.
Result<Header> ParseHeader(std::span<const std::byte> file_start, uint64_t file_size,
                           const ParseLimits& limits = {}, std::string_view source = "");

// Same, with the JSON given on its own: `json` is the N header bytes and data_size the length of
// the data buffer that follows them.
Result<Header> ParseHeaderJson(std::string_view json, uint64_t data_size,
                               const ParseLimits& limits = {}, std::string_view source = "");

}  // namespace tensorferry
