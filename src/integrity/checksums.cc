// Implements the checksum half of integrity.h: the two-level XXH3 hash, its metadata and manifest
// text. The parsers are pure functions over untrusted text (fuzz/checksums_fuzz.cc).
#include <simdjson.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "integrity/xxh3_isa.h"
#include "tensorferry/integrity.h"
#include "util/json_dom.h"
#include "util/json_writer.h"
#include "util/macros.h"
#include "util/parallel.h"

// xxHash from Debian's libxxhash-dev, compiled inline (XXH_INLINE_ALL): no library to link for
// tensorferry or its consumers. Whole chunks, the hot loop of verification, are hashed with the
// widest vectors the CPU has (xxh3_isa.h).
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tensorferry {

struct ChecksumBuilder::State {
  integrity_internal::Xxh3Stream xxh;
};

namespace {

void PutBigEndian(uint64_t v, unsigned char out[8]) {
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<unsigned char>(v & 0xff);
    v >>= 8;
  }
}

Status Invalid(std::string_view source, std::string message) {
  return json::WithSource(Code::kChecksumsInvalid, source, std::move(message));
}

std::optional<uint64_t> ParseHex(std::string_view hex) {
  if (hex.size() != 16) return std::nullopt;
  uint64_t v = 0;
  for (char c : hex) {
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v |= static_cast<uint64_t>(c - 'a' + 10);
    } else {
      return std::nullopt;
    }
  }
  return v;
}

void AppendTensors(std::string& out, const FileChecksums& checksums) {
  out += '{';
  bool first = true;
  for (const auto& [name, sum] : checksums.tensors) {
    if (!first) out += ',';
    first = false;
    json::AppendString(out, name);
    out += ":{\"digest\":\"";
    out += DigestHex(sum.digest);
    out += "\",\"chunks\":\"";
    for (uint64_t c : sum.chunks) out += DigestHex(c);
    out += "\"}";
  }
  out += '}';
}

Status CheckNoDuplicates(simdjson::dom::object object, std::string_view source,
                         std::string_view where) {
  if (auto dup = json::FindDuplicateKey(object)) {
    return Invalid(source, std::string(where) + ": duplicate key " + json::Quote(*dup));
  }
  return Status::Ok();
}

Result<uint64_t> ParseChunkSize(simdjson::dom::element e, std::string_view source) {
  uint64_t v = 0;
  if (e.get_uint64().get(v) != simdjson::SUCCESS) {
    return Invalid(source, std::string("\"chunk_size\" is ") + json::TypeName(e.type()) +
                               ", expected an unsigned integer");
  }
  if (v < kMinChecksumChunkSize || v > kMaxChecksumChunkSize) {
    return Invalid(source, "\"chunk_size\" " + std::to_string(v) + " is outside [" +
                               std::to_string(kMinChecksumChunkSize) + ", " +
                               std::to_string(kMaxChecksumChunkSize) + "]");
  }
  return v;
}

Status CheckAlgorithm(simdjson::dom::element e, std::string_view source) {
  std::string_view algorithm;
  if (e.get_string().get(algorithm) != simdjson::SUCCESS) {
    return Invalid(source, std::string("\"algorithm\" is ") + json::TypeName(e.type()) +
                               ", expected a string");
  }
  if (algorithm != kChecksumAlgorithm) {
    return json::WithSource(Code::kUnsupported, source,
                            "checksum algorithm " + json::Quote(algorithm) +
                                " is not supported (this version knows \"" +
                                std::string(kChecksumAlgorithm) + "\")");
  }
  return Status::Ok();
}

// {"<name>": {"digest": "...", "chunks": "..."}, ...}
Status ParseTensors(simdjson::dom::element e, std::string_view source,
                    std::map<std::string, TensorChecksum>& out) {
  simdjson::dom::object tensors;
  if (e.get_object().get(tensors) != simdjson::SUCCESS) {
    return Invalid(
        source, std::string("\"tensors\" is ") + json::TypeName(e.type()) + ", expected an object");
  }
  TF_RETURN_IF_ERROR(CheckNoDuplicates(tensors, source, "\"tensors\""));
  for (auto [key, value] : tensors) {
    const std::string label = "tensor " + json::Quote(key);
    simdjson::dom::object entry;
    if (value.get_object().get(entry) != simdjson::SUCCESS) {
      return Invalid(source,
                     label + " is " + json::TypeName(value.type()) + ", expected an object");
    }
    TF_RETURN_IF_ERROR(CheckNoDuplicates(entry, source, label));
    std::optional<std::string_view> digest_hex, chunks_hex;
    for (auto [field, v] : entry) {
      std::string_view text;
      if (field != "digest" && field != "chunks") {
        return Invalid(source, label + ": unknown key " + json::Quote(field));
      }
      if (v.get_string().get(text) != simdjson::SUCCESS) {
        return Invalid(source, label + ": " + json::Quote(field) + " is " +
                                   json::TypeName(v.type()) + ", expected a string");
      }
      (field == "digest" ? digest_hex : chunks_hex) = text;
    }
    if (!digest_hex || !chunks_hex) {
      return Invalid(source, label + ": needs both \"digest\" and \"chunks\"");
    }
    TensorChecksum sum;
    auto digest = ParseHex(*digest_hex);
    if (!digest) {
      return Invalid(source, label + ": \"digest\" is not 16 lowercase hex digits");
    }
    sum.digest = *digest;
    if (chunks_hex->size() % 16 != 0) {
      return Invalid(source, label + ": \"chunks\" is not a sequence of 16-hex-digit digests");
    }
    sum.chunks.reserve(chunks_hex->size() / 16);
    for (size_t i = 0; i < chunks_hex->size(); i += 16) {
      auto c = ParseHex(chunks_hex->substr(i, 16));
      if (!c) {
        return Invalid(source, label + ": chunk digest " + std::to_string(i / 16) +
                                   " is not 16 lowercase hex digits");
      }
      sum.chunks.push_back(*c);
    }
    if (CombineChunkDigests(sum.chunks) != sum.digest) {
      return Invalid(source, label + ": \"digest\" " + std::string(*digest_hex) +
                                 " does not match its chunk digests (expected " +
                                 DigestHex(CombineChunkDigests(sum.chunks)) + ")");
    }
    out.emplace(std::string(key), std::move(sum));
  }
  return Status::Ok();
}

Result<simdjson::dom::object> ParseObject(simdjson::dom::parser& parser,
                                          const simdjson::padded_string& padded,
                                          std::string_view source) {
  simdjson::dom::element root;
  if (auto err = parser.parse(padded).get(root); err != simdjson::SUCCESS) {
    return Invalid(source, std::string("not valid JSON: ") + simdjson::error_message(err));
  }
  simdjson::dom::object object;
  if (root.get_object().get(object) != simdjson::SUCCESS) {
    return Invalid(source, std::string("top level is ") + json::TypeName(root.type()) +
                               ", expected an object");
  }
  TF_RETURN_IF_ERROR(CheckNoDuplicates(object, source, "top level"));
  return object;
}

bool SafeRelativeName(std::string_view name) {
  if (name.empty() || name.front() == '/') return false;
  if (name.find('\0') != std::string_view::npos || name.find('\\') != std::string_view::npos) {
    return false;
  }
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string_view::npos) end = name.size();
    const std::string_view part = name.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

}  // namespace

uint64_t ChecksumChunkCount(uint64_t size, uint64_t chunk_size) noexcept {
  return size / chunk_size + (size % chunk_size != 0 ? 1 : 0);
}

uint64_t ChecksumChunk(std::span<const std::byte> chunk) noexcept {
  return integrity_internal::Xxh3Widest(chunk.data(), chunk.size());
}

namespace integrity_internal {

static_assert(sizeof(XXH3_state_t) <= sizeof(Xxh3State) &&
                  alignof(XXH3_state_t) <= alignof(Xxh3State),
              "Xxh3State must hold xxHash's XXH3_state_t");

uint64_t Xxh3Baseline(const void* data, size_t size) noexcept {
  return XXH3_64bits(data, size);
}
TF_XXH3_STREAM_DEFINE(Baseline)

namespace {

struct Xxh3Choice {
  uint64_t (*fn)(const void*, size_t) noexcept;
  void (*reset)(Xxh3State*) noexcept;
  void (*update)(Xxh3State*, const void*, size_t) noexcept;
  uint64_t (*digest)(const Xxh3State*) noexcept;
  const char* name;
};

Xxh3Choice ChooseXxh3() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (__builtin_cpu_supports("avx512f")) {
    return {&Xxh3Avx512, &Xxh3Avx512Reset, &Xxh3Avx512Update, &Xxh3Avx512Digest, "avx512"};
  }
  if (__builtin_cpu_supports("avx2")) {
    return {&Xxh3Avx2, &Xxh3Avx2Reset, &Xxh3Avx2Update, &Xxh3Avx2Digest, "avx2"};
  }
#endif
  return {&Xxh3Baseline, &Xxh3BaselineReset, &Xxh3BaselineUpdate, &Xxh3BaselineDigest, "baseline"};
}

const Xxh3Choice& Xxh3Chosen() noexcept {
  static const Xxh3Choice choice = ChooseXxh3();
  return choice;
}

}  // namespace

uint64_t Xxh3Widest(const void* data, size_t size) noexcept {
  return Xxh3Chosen().fn(data, size);
}
const char* Xxh3WidestName() noexcept {
  return Xxh3Chosen().name;
}

void Xxh3Stream::Reset() noexcept {
  Xxh3Chosen().reset(&state_);
}
void Xxh3Stream::Update(const void* data, size_t size) noexcept {
  Xxh3Chosen().update(&state_, data, size);
}
uint64_t Xxh3Stream::Digest() const noexcept {
  return Xxh3Chosen().digest(&state_);
}

}  // namespace integrity_internal

uint64_t CombineChunkDigests(std::span<const uint64_t> chunks) noexcept {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (uint64_t c : chunks) {
    unsigned char be[8];
    PutBigEndian(c, be);
    XXH3_64bits_update(&state, be, sizeof be);
  }
  return XXH3_64bits_digest(&state);
}

TensorChecksum ComputeTensorChecksum(std::span<const std::byte> bytes, uint64_t chunk_size,
                                     unsigned threads) {
  TensorChecksum sum;
  const uint64_t n = ChecksumChunkCount(bytes.size(), chunk_size);
  sum.chunks.resize(n);
  ParallelFor(n, threads, [&](size_t i) {
    const uint64_t begin = i * chunk_size;
    sum.chunks[i] =
        ChecksumChunk(bytes.subspan(begin, std::min<uint64_t>(chunk_size, bytes.size() - begin)));
  });
  sum.digest = CombineChunkDigests(sum.chunks);
  return sum;
}

ChecksumBuilder::ChecksumBuilder(uint64_t chunk_size)
    : chunk_size_(chunk_size), state_(new State) {}
ChecksumBuilder::~ChecksumBuilder() {
  delete state_;
}
ChecksumBuilder::ChecksumBuilder(ChecksumBuilder&& other) noexcept
    : chunk_size_(other.chunk_size_),
      in_chunk_(other.in_chunk_),
      chunks_(std::move(other.chunks_)),
      state_(std::exchange(other.state_, nullptr)) {}
ChecksumBuilder& ChecksumBuilder::operator=(ChecksumBuilder&& other) noexcept {
  if (this != &other) {
    delete state_;
    chunk_size_ = other.chunk_size_;
    in_chunk_ = other.in_chunk_;
    chunks_ = std::move(other.chunks_);
    state_ = std::exchange(other.state_, nullptr);
  }
  return *this;
}

void ChecksumBuilder::Update(std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const uint64_t take = std::min<uint64_t>(bytes.size(), chunk_size_ - in_chunk_);
    state_->xxh.Update(bytes.data(), take);
    in_chunk_ += take;
    bytes = bytes.subspan(take);
    if (in_chunk_ == chunk_size_) {
      chunks_.push_back(state_->xxh.Digest());
      state_->xxh.Reset();
      in_chunk_ = 0;
    }
  }
}

TensorChecksum ChecksumBuilder::Finish() {
  if (in_chunk_ > 0) chunks_.push_back(state_->xxh.Digest());
  TensorChecksum sum;
  sum.chunks = std::move(chunks_);
  sum.digest = CombineChunkDigests(sum.chunks);
  chunks_.clear();
  in_chunk_ = 0;
  state_->xxh.Reset();
  return sum;
}

std::string DigestHex(uint64_t digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i) {
    out[static_cast<size_t>(i)] = kHex[digest & 0xf];
    digest >>= 4;
  }
  return out;
}

std::string SerializeFileChecksums(const FileChecksums& checksums) {
  std::string out = "{\"algorithm\":\"";
  out += kChecksumAlgorithm;
  out += "\",\"chunk_size\":";
  json::AppendUint(out, checksums.chunk_size);
  out += ",\"tensors\":";
  AppendTensors(out, checksums);
  out += '}';
  return out;
}

Result<FileChecksums> ParseFileChecksums(std::string_view text, std::string_view source) {
  simdjson::dom::parser parser;
  const simdjson::padded_string padded(text.data(), text.size());
  TF_ASSIGN_OR_RETURN(simdjson::dom::object object, ParseObject(parser, padded, source));
  FileChecksums out;
  std::optional<simdjson::dom::element> algorithm, chunk_size, tensors;
  for (auto [key, value] : object) {
    if (key == "algorithm") {
      algorithm = value;
    } else if (key == "chunk_size") {
      chunk_size = value;
    } else if (key == "tensors") {
      tensors = value;
    } else {
      return Invalid(source, "unknown key " + json::Quote(key));
    }
  }
  if (!algorithm || !chunk_size || !tensors) {
    return Invalid(source, "needs \"algorithm\", \"chunk_size\" and \"tensors\"");
  }
  TF_RETURN_IF_ERROR(CheckAlgorithm(*algorithm, source));
  TF_ASSIGN_OR_RETURN(out.chunk_size, ParseChunkSize(*chunk_size, source));
  TF_RETURN_IF_ERROR(ParseTensors(*tensors, source, out.tensors));
  return out;
}

Result<std::optional<FileChecksums>> EmbeddedChecksums(
    std::span<const std::pair<std::string, std::string>> metadata, std::string_view source) {
  for (const auto& [key, value] : metadata) {
    if (key != kChecksumsMetadataKey) continue;
    // Named as the metadata entry it is, so that it does not read like a broken header.
    const std::string where = std::string(source) + ": __metadata__[" + json::Quote(key) + "]";
    TF_ASSIGN_OR_RETURN(FileChecksums sums, ParseFileChecksums(value, where));
    return std::optional<FileChecksums>(std::move(sums));
  }
  return std::optional<FileChecksums>();
}

namespace {

// A chunk size no record holds (ParseFileChecksums refuses it): a caller's mistake, not a crash.
Status ZeroChunkSize(std::string_view file, std::string_view tensor) {
  return Status(Code::kChecksumsInvalid,
                std::string(file) + ": tensor " + json::Quote(tensor) + ": checksum chunk size 0");
}

}  // namespace

Status CheckChecksumShape(const TensorChecksum& expected, uint64_t chunk_size, uint64_t size,
                          std::string_view file, std::string_view tensor) {
  if (chunk_size == 0) return ZeroChunkSize(file, tensor);
  const uint64_t want = ChecksumChunkCount(size, chunk_size);
  if (expected.chunks.size() != want) {
    return Status(Code::kChecksumsInvalid,
                  std::string(file) + ": tensor " + json::Quote(tensor) + ": checksum has " +
                      std::to_string(expected.chunks.size()) + " chunks, the tensor's " +
                      std::to_string(size) + " bytes make " + std::to_string(want));
  }
  return Status::Ok();
}

Status VerifyChunk(const TensorChecksum& expected, uint64_t chunk_size, uint64_t tensor_size,
                   uint64_t index, std::span<const std::byte> bytes, std::string_view file,
                   std::string_view tensor, uint64_t file_offset) {
  return CheckChunkDigest(expected, chunk_size, tensor_size, index, bytes.size(),
                          ChecksumChunk(bytes), file, tensor, file_offset);
}

namespace {

// For a mismatch in `file` that is a link into a Hugging Face hub cache (snapshots/<commit>/...
// -> blobs/<digest>): which blob holds the damaged bytes and how to get it again (the cache's
// copy is not replaced by a later load: it is read as it is). "" for other files.
std::string HubBlobAdvice(std::string_view file) {
  std::error_code ec;
  const std::filesystem::path link(file);
  if (!std::filesystem::is_symlink(link, ec)) return "";
  const std::filesystem::path blob = std::filesystem::canonical(link, ec);
  if (ec || blob.parent_path().filename() != "blobs") return "";
  const std::string name = blob.filename().string();
  if (name.size() != 64 || name.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return "";
  }
  return "; the file is the hub cache's blob " + blob.string() +
         ": remove it and the link to download it again (tensorferry verify of the snapshot "
         "checks every blob against its name)";
}

// What a mismatch may mean beyond damage: a hub blob to fetch again, or bytes rewritten after
// the record was made (a tool that copies a file's metadata copies tensorferry's record with it).
std::string MismatchAdvice(std::string_view file) {
  std::string hub = HubBlobAdvice(file);
  if (!hub.empty()) return hub;
  return "; the bytes are damaged, or were rewritten after the checksums were recorded (a tool "
         "that copies a file's metadata copies the record too): verify=off loads them unchecked";
}

}  // namespace

Status CheckChunkDigest(const TensorChecksum& expected, uint64_t chunk_size, uint64_t tensor_size,
                        uint64_t index, uint64_t length, uint64_t got, std::string_view file,
                        std::string_view tensor, uint64_t file_offset) {
  if (chunk_size == 0) return ZeroChunkSize(file, tensor);
  const uint64_t count = ChecksumChunkCount(tensor_size, chunk_size);
  const uint64_t begin = index * chunk_size;
  if (index >= count || index >= expected.chunks.size() ||
      length != std::min<uint64_t>(chunk_size, tensor_size - begin)) {
    return Status(Code::kChecksumsInvalid, std::string(file) + ": tensor " + json::Quote(tensor) +
                                               ": chunk " + std::to_string(index) +
                                               " does not fit");
  }
  if (got == expected.chunks[index]) return Status::Ok();
  const uint64_t end = begin + length;
  return Status(Code::kChecksumMismatch,
                std::string(file) + ": tensor " + json::Quote(tensor) +
                    ": checksum mismatch in chunk " + std::to_string(index) + " of " +
                    std::to_string(count) + " (tensor bytes [" + std::to_string(begin) + ", " +
                    std::to_string(end) + "), file bytes [" + std::to_string(file_offset + begin) +
                    ", " + std::to_string(file_offset + end) + ")): xxh3 " + DigestHex(got) +
                    ", expected " + DigestHex(expected.chunks[index]) + MismatchAdvice(file));
}

Status VerifyTensor(const TensorChecksum& expected, uint64_t chunk_size,
                    std::span<const std::byte> bytes, std::string_view file,
                    std::string_view tensor, uint64_t file_offset, unsigned threads) {
  TF_RETURN_IF_ERROR(CheckChecksumShape(expected, chunk_size, bytes.size(), file, tensor));
  const uint64_t n = expected.chunks.size();
  return ParallelForUntilError(n, threads, [&](size_t i) {
    const uint64_t begin = i * chunk_size;
    const uint64_t len = std::min<uint64_t>(chunk_size, bytes.size() - begin);
    return VerifyChunk(expected, chunk_size, bytes.size(), i, bytes.subspan(begin, len), file,
                       tensor, file_offset);
  });
}

Result<uint64_t> VerifyTensorRange(const TensorChecksum& expected, uint64_t chunk_size,
                                   uint64_t tensor_size, uint64_t begin,
                                   std::span<const std::byte> bytes, std::string_view file,
                                   std::string_view tensor, uint64_t file_offset) {
  TF_RETURN_IF_ERROR(CheckChecksumShape(expected, chunk_size, tensor_size, file, tensor));
  if (begin > tensor_size || bytes.size() > tensor_size - begin) {
    return Status(Code::kInvalidArgument,
                  std::string(file) + ": tensor " + json::Quote(tensor) + ": bytes [" +
                      std::to_string(begin) + ", " + std::to_string(begin + bytes.size()) +
                      ") pass its end (" + std::to_string(tensor_size) + " bytes)");
  }
  const uint64_t end = begin + bytes.size();
  uint64_t checked = 0;
  // The first chunk starting at or after `begin`, then each one that ends by `end`.
  for (uint64_t i = (begin + chunk_size - 1) / chunk_size; i * chunk_size < end; ++i) {
    const uint64_t from = i * chunk_size;
    const uint64_t to = std::min(from + chunk_size, tensor_size);
    if (to > end) break;
    TF_RETURN_IF_ERROR(VerifyChunk(expected, chunk_size, tensor_size, i,
                                   bytes.subspan(from - begin, to - from), file, tensor,
                                   file_offset));
    checked += to - from;
  }
  return checked;
}

std::string SerializeChecksumManifest(const ChecksumManifest& manifest) {
  std::string out = "{\n  \"algorithm\": \"";
  out += kChecksumAlgorithm;
  out += "\",\n  \"chunk_size\": ";
  json::AppendUint(out, manifest.chunk_size);
  out += ",\n  \"files\": {";
  bool first = true;
  for (const auto& [name, file] : manifest.files) {
    out += first ? "\n    " : ",\n    ";
    first = false;
    json::AppendString(out, name);
    out += ": {\"size\": ";
    json::AppendUint(out, file.size);
    out += ", \"tensors\": ";
    AppendTensors(out, file.checksums);
    out += '}';
  }
  out += first ? "}\n}\n" : "\n  }\n}\n";
  return out;
}

Result<ChecksumManifest> ParseChecksumManifest(std::string_view text, std::string_view source) {
  simdjson::dom::parser parser;
  const simdjson::padded_string padded(text.data(), text.size());
  TF_ASSIGN_OR_RETURN(simdjson::dom::object object, ParseObject(parser, padded, source));
  ChecksumManifest out;
  std::optional<simdjson::dom::element> algorithm, chunk_size, files;
  for (auto [key, value] : object) {
    if (key == "algorithm") {
      algorithm = value;
    } else if (key == "chunk_size") {
      chunk_size = value;
    } else if (key == "files") {
      files = value;
    } else {
      return Invalid(source, "unknown key " + json::Quote(key));
    }
  }
  if (!algorithm || !chunk_size || !files) {
    return Invalid(source, "needs \"algorithm\", \"chunk_size\" and \"files\"");
  }
  TF_RETURN_IF_ERROR(CheckAlgorithm(*algorithm, source));
  TF_ASSIGN_OR_RETURN(out.chunk_size, ParseChunkSize(*chunk_size, source));
  simdjson::dom::object file_map;
  if (files->get_object().get(file_map) != simdjson::SUCCESS) {
    return Invalid(source, std::string("\"files\" is ") + json::TypeName(files->type()) +
                               ", expected an object");
  }
  TF_RETURN_IF_ERROR(CheckNoDuplicates(file_map, source, "\"files\""));
  for (auto [name, value] : file_map) {
    const std::string label = "file " + json::Quote(name);
    if (!SafeRelativeName(name)) {
      return Invalid(source, label + ": not a relative path inside the checkpoint");
    }
    simdjson::dom::object entry;
    if (value.get_object().get(entry) != simdjson::SUCCESS) {
      return Invalid(source,
                     label + " is " + json::TypeName(value.type()) + ", expected an object");
    }
    TF_RETURN_IF_ERROR(CheckNoDuplicates(entry, source, label));
    ManifestFile file;
    file.checksums.chunk_size = out.chunk_size;
    bool have_size = false, have_tensors = false;
    for (auto [field, v] : entry) {
      if (field == "size") {
        if (v.get_uint64().get(file.size) != simdjson::SUCCESS) {
          return Invalid(source, label + ": \"size\" is " + json::TypeName(v.type()) +
                                     ", expected an unsigned integer");
        }
        have_size = true;
      } else if (field == "tensors") {
        TF_RETURN_IF_ERROR(ParseTensors(v, source, file.checksums.tensors));
        have_tensors = true;
      } else {
        return Invalid(source, label + ": unknown key " + json::Quote(field));
      }
    }
    if (!have_size || !have_tensors) {
      return Invalid(source, label + ": needs \"size\" and \"tensors\"");
    }
    out.files.emplace(std::string(name), std::move(file));
  }
  return out;
}

}  // namespace tensorferry
