// ZipReader: read-only access to the entries of a zip archive (libzip) through a
// RandomAccessFile, so tests and fuzzers can feed archives from memory and inject faults.
//
// Only what a torch.save archive needs: list entries, read a small entry whole (bounded), read a
// range of any entry. Stored entries are read with a seek (pread underneath); compressed ones are
// decompressed from the start, kept as a cursor so that increasing offsets cost one pass.
//
// Thread-safety: none; the owner serializes calls (libzip handles are not thread-safe).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/env.h"
#include "tensorferry/status.h"

namespace tensorferry::convert {

struct ZipEntry {
  std::string name;   // raw bytes as stored
  uint64_t size = 0;  // uncompressed
  uint64_t compressed_size = 0;
  uint16_t method = 0;  // 0 stored, 8 deflate, ...
  bool encrypted = false;
};

class ZipReader {
 public:
  // Opens the archive in `file` (borrowed: must outlive the reader). `max_entries` bounds the
  // central directory. Errors: kZipInvalid naming the file and libzip's reason; kIoError from
  // the file.
  static Result<std::unique_ptr<ZipReader>> Open(const RandomAccessFile& file,
                                                 uint64_t max_entries);
  ~ZipReader();
  ZipReader(const ZipReader&) = delete;
  ZipReader& operator=(const ZipReader&) = delete;

  const std::vector<ZipEntry>& entries() const { return entries_; }
  // Index of the entry named exactly `name`, or nullopt.
  std::optional<size_t> Find(std::string_view name) const;

  // The whole entry, CRC checked. Errors: kZipBadEntry (unreadable, CRC mismatch, encrypted,
  // unknown compression, larger than max_size), kIoError.
  Result<std::string> ReadAll(size_t index, uint64_t max_size);

  // Bytes [offset, offset + out.size()) of the entry (a compressed entry read behind its last
  // read is inflated again from its start: kZipBadEntry once such skipping has inflated more than
  // 8 x the archive's compressed entries' sizes + 256 MiB). When an entry has been read from its
  // start to its end in order (the usual way, chunk after chunk), the read that reaches the end
  // also checks the entry's CRC-32; CheckEntriesRead checks the others. Errors: kInvalidArgument
  // (range outside the entry), kZipBadEntry (CRC mismatch included), kIoError.
  Status ReadAt(size_t index, uint64_t offset, std::span<std::byte> out);

  // Checks the CRC-32 of every entry ReadAt read that no read checked (read in part, or out of
  // order: after a seek libzip has no CRC to compare), by reading each such entry once more from
  // its start to its end. For callers that hand out bytes only once this returned ok (a
  // conversion, before its output is put in place). Errors: as ReadAt's.
  Status CheckEntriesRead();
  // The same for one entry: nothing to do when ReadAt has not read it, or a read checked it.
  // (An out-of-range index has nothing to check.) A set `*cancel` stops the re-read between
  // 1 MiB steps with kCancelled, the entry left unchecked. Errors: as ReadAt's, kCancelled.
  Status CheckEntryRead(size_t index, const std::atomic<bool>* cancel = nullptr);

  const std::string& path() const;

 private:
  struct Source;
  struct Cursor;
  ZipReader() = default;
  Status EntryError(size_t index, std::string_view what, const char* libzip_message) const;

  std::unique_ptr<Source> source_;
  void* archive_ = nullptr;  // zip_t*
  std::vector<ZipEntry> entries_;
  std::vector<std::pair<std::string_view, size_t>> by_name_;  // sorted by name
  std::unique_ptr<Cursor> cursor_;
  // Per entry: 0 not read by ReadAt, 1 read but its CRC not checked, 2 checked.
  std::vector<uint8_t> checked_;
  // Bytes of compressed entries inflated only to reach the bytes asked for (a read behind the
  // cursor starts the entry again), and the most allowed: kSkipFactor x the compressed entries'
  // sizes + kSkipBase. Many small reads going backwards through a large compressed entry would
  // otherwise inflate it again for each (a crafted archive: hours of work from a small file).
  uint64_t skipped_ = 0;
  uint64_t skip_budget_ = 0;
};

}  // namespace tensorferry::convert
