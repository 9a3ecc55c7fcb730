// ZipReader over libzip: a zip_source_function_create source that reads the RandomAccessFile with
// positional reads, so libzip never opens a file descriptor of its own and tests can inject
// faults. ZIP_CHECKCONS makes libzip compare every local header with the central directory.
#include "convert/zip_reader.h"

#include <zip.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "util/json_writer.h"
#include "util/macros.h"

namespace tensorferry::convert {

struct ZipReader::Source {
  const RandomAccessFile* file = nullptr;
  uint64_t size = 0;
  uint64_t pos = 0;
  zip_error_t error{};
  Status io_status;  // the first I/O failure, reported instead of libzip's generic read error

  Source() { zip_error_init(&error); }
  ~Source() { zip_error_fini(&error); }
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;

  static zip_int64_t Callback(void* userdata, void* data, zip_uint64_t len, zip_source_cmd_t cmd) {
    auto* self = static_cast<Source*>(userdata);
    switch (cmd) {
      case ZIP_SOURCE_OPEN: self->pos = 0; return 0;
      case ZIP_SOURCE_READ: {
        if (self->pos >= self->size || len == 0) return 0;
        const uint64_t n = std::min<uint64_t>(len, self->size - self->pos);
        auto got = self->file->Read(
            self->pos, std::span<std::byte>(static_cast<std::byte*>(data), static_cast<size_t>(n)));
        if (!got.ok()) {
          if (self->io_status.ok()) self->io_status = got.status();
          zip_error_set(&self->error, ZIP_ER_READ, 5 /* EIO */);
          return -1;
        }
        self->pos += *got;
        return static_cast<zip_int64_t>(*got);
      }
      case ZIP_SOURCE_CLOSE: return 0;
      case ZIP_SOURCE_STAT: {
        auto* st = ZIP_SOURCE_GET_ARGS(zip_stat_t, data, len, &self->error);
        if (st == nullptr) return -1;
        zip_stat_init(st);
        st->size = self->size;
        st->valid |= ZIP_STAT_SIZE;
        return sizeof(zip_stat_t);
      }
      case ZIP_SOURCE_ERROR: return zip_error_to_data(&self->error, data, len);
      case ZIP_SOURCE_FREE: return 0;  // the ZipReader owns this object
      case ZIP_SOURCE_SEEK: {
        const zip_int64_t pos =
            zip_source_seek_compute_offset(self->pos, self->size, data, len, &self->error);
        if (pos < 0) return -1;
        self->pos = static_cast<uint64_t>(pos);
        return 0;
      }
      case ZIP_SOURCE_TELL: return static_cast<zip_int64_t>(self->pos);
      case ZIP_SOURCE_SUPPORTS:
        return zip_source_make_command_bitmap(
            ZIP_SOURCE_OPEN, ZIP_SOURCE_READ, ZIP_SOURCE_CLOSE, ZIP_SOURCE_STAT, ZIP_SOURCE_ERROR,
            ZIP_SOURCE_FREE, ZIP_SOURCE_SEEK, ZIP_SOURCE_TELL, ZIP_SOURCE_SUPPORTS, -1);
      default: zip_error_set(&self->error, ZIP_ER_OPNOTSUPP, 0); return -1;
    }
  }
};

// An open entry and the position of its next byte: stored entries seek, compressed ones are
// read forward (and reopened to go back).
struct ZipReader::Cursor {
  size_t index = 0;
  zip_file_t* file = nullptr;
  uint64_t pos = 0;
  bool seekable = false;
  bool in_order = true;  // read from the start without a seek: libzip checks the CRC at the end

  ~Cursor() {
    if (file != nullptr) zip_fclose(file);
  }
};

namespace {

zip_t* Archive(void* p) {
  return static_cast<zip_t*>(p);
}

// A name held by two entries of the archive in `file`, found by opening it again without
// ZIP_CHECKCONS (with it, libzip refuses duplicate names with only "File already exists").
// Empty when none is found.
std::string DuplicateEntryName(zip_source_callback callback, void* source) {
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* zs = zip_source_function_create(callback, source, &error);
  zip_t* za = zs == nullptr ? nullptr : zip_open_from_source(zs, ZIP_RDONLY, &error);
  zip_error_fini(&error);
  if (za == nullptr) {
    if (zs != nullptr) zip_source_free(zs);
    return "";
  }
  std::vector<std::string> names;
  const zip_int64_t n = zip_get_num_entries(za, 0);
  for (zip_int64_t i = 0; i < n; ++i) {
    const char* name = zip_get_name(za, static_cast<zip_uint64_t>(i), ZIP_FL_ENC_RAW);
    if (name != nullptr) names.emplace_back(name);
  }
  zip_discard(za);
  std::sort(names.begin(), names.end());
  const auto dup = std::adjacent_find(names.begin(), names.end());
  return dup == names.end() ? "" : *dup;
}

}  // namespace

Result<std::unique_ptr<ZipReader>> ZipReader::Open(const RandomAccessFile& file,
                                                   uint64_t max_entries) {
  std::unique_ptr<ZipReader> reader(new ZipReader());
  reader->source_ = std::make_unique<Source>();
  Source& src = *reader->source_;
  src.file = &file;
  auto size = file.Size();
  if (!size.ok()) return size.status();
  src.size = *size;

  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* zs = zip_source_function_create(&Source::Callback, &src, &error);
  if (zs == nullptr) {
    std::string msg = zip_error_strerror(&error);
    zip_error_fini(&error);
    return Status(Code::kZipInvalid, file.path() + ": cannot create a zip source: " + msg);
  }
  zip_t* za = zip_open_from_source(zs, ZIP_RDONLY | ZIP_CHECKCONS, &error);
  if (za == nullptr) {
    zip_source_free(zs);
    std::string msg = zip_error_strerror(&error);
    const int code = zip_error_code_zip(&error);
    zip_error_fini(&error);
    if (!src.io_status.ok()) return src.io_status;
    if (code == ZIP_ER_EXISTS) {
      const std::string dup = DuplicateEntryName(&Source::Callback, &src);
      if (!src.io_status.ok()) return src.io_status;
      return Status(Code::kZipInvalid,
                    file.path() + ": the zip archive has a duplicate entry" +
                        (dup.empty() ? std::string(" name") : " " + json::Quote(dup)) +
                        " (two entries of one name; which one holds the data is ambiguous)");
    }
    return Status(Code::kZipInvalid, file.path() + ": not a readable zip archive: " + msg);
  }
  zip_error_fini(&error);
  reader->archive_ = za;

  const zip_int64_t n = zip_get_num_entries(za, 0);
  if (n < 0 || static_cast<uint64_t>(n) > max_entries) {
    return Status(Code::kZipInvalid, file.path() + ": the zip archive has " + std::to_string(n) +
                                         " entries, more than the limit of " +
                                         std::to_string(max_entries));
  }
  reader->entries_.reserve(static_cast<size_t>(n));
  // Entries whose data overlap (each valid alone: libzip's consistency check compares headers,
  // not extents) could make a small archive hold terabytes of storages: every entry takes its
  // local header (30 bytes and its name at least) and its data in the archive, and together
  // they fit in it.
  uint64_t occupied = 0;
  for (zip_int64_t i = 0; i < n; ++i) {
    zip_stat_t st;
    if (zip_stat_index(za, static_cast<zip_uint64_t>(i), ZIP_FL_ENC_RAW, &st) != 0 ||
        (st.valid & ZIP_STAT_NAME) == 0 || st.name == nullptr) {
      return Status(Code::kZipInvalid, file.path() + ": zip entry " + std::to_string(i) +
                                           " cannot be listed: " + zip_strerror(za));
    }
    ZipEntry e;
    e.name = st.name;
    e.size = (st.valid & ZIP_STAT_SIZE) ? st.size : 0;
    e.compressed_size = (st.valid & ZIP_STAT_COMP_SIZE) ? st.comp_size : 0;
    e.method = (st.valid & ZIP_STAT_COMP_METHOD) ? st.comp_method : 0;
    e.encrypted = (st.valid & ZIP_STAT_ENCRYPTION_METHOD) && st.encryption_method != ZIP_EM_NONE;
    // The sizes an entry records are what the converter's bounds (the output's size, the buffers
    // of strided views) stand on: a few hundred bytes claiming terabytes are refused here, not
    // found out after terabytes were written. Bytes beyond the archive cannot be in it; a stored
    // entry holds exactly its bytes; deflate expands at most 1032 times.
    const std::string where =
        file.path() + ": zip entry " + json::Quote(e.name.substr(0, 200)) + " records ";
    if (e.compressed_size > src.size) {
      return Status(Code::kZipInvalid, where + std::to_string(e.compressed_size) +
                                           " bytes in an archive of " + std::to_string(src.size));
    }
    if (e.method == ZIP_CM_STORE && !e.encrypted && e.size != e.compressed_size) {
      return Status(Code::kZipInvalid, where + std::to_string(e.size) + " bytes, stored (not " +
                                           "compressed) in " + std::to_string(e.compressed_size));
    }
    constexpr uint64_t kMaxDeflateRatio = 1032;
    if (e.method != ZIP_CM_STORE && e.size / kMaxDeflateRatio > e.compressed_size) {
      return Status(Code::kZipInvalid, where + std::to_string(e.size) + " bytes compressed into " +
                                           std::to_string(e.compressed_size) +
                                           ", more than deflate's largest " + "ratio (1032:1)");
    }
    occupied += 30 + e.name.size() + e.compressed_size;  // each term below the archive's size
    if (occupied > src.size) {
      return Status(Code::kZipInvalid,
                    file.path() + ": the zip archive's entries up to " +
                        json::Quote(e.name.substr(0, 200)) + " take " + std::to_string(occupied) +
                        " bytes or more (local headers and data), more than the archive's " +
                        std::to_string(src.size) + ": their data overlap");
    }
    if (e.method != ZIP_CM_STORE || e.encrypted) reader->skip_budget_ += 8 * e.size;
    reader->entries_.push_back(std::move(e));
  }
  reader->skip_budget_ += uint64_t{256} << 20;
  reader->checked_.assign(reader->entries_.size(), 0);
  reader->by_name_.reserve(reader->entries_.size());
  for (size_t i = 0; i < reader->entries_.size(); ++i) {
    reader->by_name_.emplace_back(reader->entries_[i].name, i);
  }
  std::sort(reader->by_name_.begin(), reader->by_name_.end());
  for (size_t i = 1; i < reader->by_name_.size(); ++i) {
    if (reader->by_name_[i].first == reader->by_name_[i - 1].first) {
      return Status(
          Code::kZipInvalid,
          file.path() + ": zip entry " + json::Quote(reader->by_name_[i].first) + " appears twice");
    }
  }
  return reader;
}

ZipReader::~ZipReader() {
  cursor_.reset();
  if (archive_ != nullptr) zip_discard(Archive(archive_));
}

const std::string& ZipReader::path() const {
  return source_->file->path();
}

std::optional<size_t> ZipReader::Find(std::string_view name) const {
  auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                             [](const auto& a, std::string_view b) { return a.first < b; });
  if (it == by_name_.end() || it->first != name) return std::nullopt;
  return it->second;
}

Status ZipReader::EntryError(size_t index, std::string_view what,
                             const char* libzip_message) const {
  if (!source_->io_status.ok()) {
    Status s = source_->io_status;
    source_->io_status = Status();
    return s;
  }
  std::string msg = path() + ": zip entry " + json::Quote(entries_[index].name) + ": ";
  msg += what;
  if (libzip_message != nullptr) {
    msg += ": ";
    msg += libzip_message;
  }
  return Status(Code::kZipBadEntry, std::move(msg));
}

Result<std::string> ZipReader::ReadAll(size_t index, uint64_t max_size) {
  const ZipEntry& e = entries_.at(index);
  if (e.size > max_size) {
    return EntryError(index,
                      "holds " + std::to_string(e.size) + " bytes, more than the limit of " +
                          std::to_string(max_size),
                      nullptr);
  }
  zip_file_t* zf = zip_fopen_index(Archive(archive_), index, 0);
  if (zf == nullptr) return EntryError(index, "cannot be opened", zip_strerror(Archive(archive_)));
  std::string out(static_cast<size_t>(e.size), '\0');
  uint64_t done = 0;
  Status status;
  while (status.ok()) {
    // Reading until libzip reports the end lets it check the CRC and the length.
    char probe;
    char* dst = done < e.size ? out.data() + done : &probe;
    const uint64_t want = done < e.size ? e.size - done : 1;
    const zip_int64_t got = zip_fread(zf, dst, want);
    if (got < 0) {
      status = EntryError(index, "read failed", zip_error_strerror(zip_file_get_error(zf)));
    } else if (got == 0) {
      if (done < e.size) {
        status = EntryError(
            index,
            "ends after " + std::to_string(done) + " of " + std::to_string(e.size) + " bytes",
            nullptr);
      }
      break;
    } else if (done >= e.size) {
      status = EntryError(index, "holds more bytes than its recorded size", nullptr);
    } else {
      done += static_cast<uint64_t>(got);
    }
  }
  zip_fclose(zf);
  if (!status.ok()) return status;
  checked_[index] = 2;
  return out;
}

Status ZipReader::CheckEntriesRead() {
  for (size_t index = 0; index < entries_.size(); ++index) {
    TF_RETURN_IF_ERROR(CheckEntryRead(index));
  }
  return Status::Ok();
}

Status ZipReader::CheckEntryRead(size_t index, const std::atomic<bool>* cancel) {
  if (index >= entries_.size() || checked_[index] != 1) return Status::Ok();
  const ZipEntry& e = entries_[index];
  zip_file_t* zf = zip_fopen_index(Archive(archive_), index, 0);
  if (zf == nullptr) return EntryError(index, "cannot be opened", zip_strerror(Archive(archive_)));
  std::vector<std::byte> buffer(
      static_cast<size_t>(std::min<uint64_t>(e.size + 1, uint64_t{1} << 20)));
  uint64_t done = 0;
  Status status;
  for (;;) {  // to libzip's end of the entry, where it compares the CRC
    if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) {
      zip_fclose(zf);
      return Status(Code::kCancelled, path() + ": zip entry " + json::Quote(e.name) +
                                          ": checking its CRC-32 cancelled after " +
                                          std::to_string(done) + " of " + std::to_string(e.size) +
                                          " bytes");
    }
    const zip_int64_t got = zip_fread(zf, buffer.data(), buffer.size());
    if (got < 0) {
      status = EntryError(index,
                          "read failed (checking its CRC-32 after a read in part or "
                          "out of order)",
                          zip_error_strerror(zip_file_get_error(zf)));
      break;
    }
    if (got == 0) break;
    done += static_cast<uint64_t>(got);
  }
  zip_fclose(zf);
  TF_RETURN_IF_ERROR(status);
  if (done != e.size) {
    return EntryError(
        index,
        "holds " + std::to_string(done) + " bytes, not its recorded " + std::to_string(e.size),
        nullptr);
  }
  checked_[index] = 2;
  return Status::Ok();
}

Status ZipReader::ReadAt(size_t index, uint64_t offset, std::span<std::byte> out) {
  const ZipEntry& e = entries_.at(index);
  if (offset > e.size || out.size() > e.size - offset) {
    return Status(Code::kInvalidArgument, path() + ": zip entry " + json::Quote(e.name) +
                                              ": range [" + std::to_string(offset) + ", +" +
                                              std::to_string(out.size()) + ") outside its " +
                                              std::to_string(e.size) + " bytes");
  }
  if (out.empty()) return Status::Ok();
  if (checked_[index] == 0) checked_[index] = 1;
  const bool reuse =
      cursor_ && cursor_->index == index && (cursor_->seekable || cursor_->pos <= offset);
  if (!reuse) {
    cursor_.reset();
    zip_file_t* zf = zip_fopen_index(Archive(archive_), index, 0);
    if (zf == nullptr) {
      return EntryError(index, "cannot be opened", zip_strerror(Archive(archive_)));
    }
    cursor_ = std::make_unique<Cursor>();
    cursor_->index = index;
    cursor_->file = zf;
    cursor_->seekable = e.method == ZIP_CM_STORE && !e.encrypted;
  }
  Cursor& c = *cursor_;
  if (c.seekable && c.pos != offset) {
    c.in_order = false;
    if (zip_fseek(c.file, static_cast<zip_int64_t>(offset), SEEK_SET) != 0) {
      Status s = EntryError(index, "seek to " + std::to_string(offset) + " failed",
                            zip_error_strerror(zip_file_get_error(c.file)));
      cursor_.reset();
      return s;
    }
    c.pos = offset;
  }
  // Reads exactly `n` bytes at the cursor into `dst`; on failure the cursor is dropped.
  auto read_exactly = [&](std::byte* dst, uint64_t n) -> Status {
    for (uint64_t done = 0; done < n;) {
      const zip_int64_t got = zip_fread(c.file, dst + done, n - done);
      if (got <= 0) {
        Status s = EntryError(
            index, "read failed at " + std::to_string(c.pos),
            got < 0 ? zip_error_strerror(zip_file_get_error(c.file)) : "unexpected end of entry");
        cursor_.reset();
        return s;
      }
      done += static_cast<uint64_t>(got);
      c.pos += static_cast<uint64_t>(got);
    }
    return Status::Ok();
  };
  // Compressed: read forward to `offset`.
  std::byte skip[16384];
  while (c.pos < offset) {
    const uint64_t n = std::min<uint64_t>(sizeof skip, offset - c.pos);
    skipped_ += n;
    if (skipped_ > skip_budget_) {
      cursor_.reset();
      return EntryError(
          index,
          "is compressed and read out of order: reaching byte " + std::to_string(offset) +
              " would make the reads inflate more than " + std::to_string(skip_budget_) +
              " bytes only to skip them (8 x the compressed entries' sizes + 256 MiB); save the "
              "checkpoint uncompressed (torch.save stores its entries) or convert it in order",
          nullptr);
    }
    TF_RETURN_IF_ERROR(read_exactly(skip, n));
  }
  TF_RETURN_IF_ERROR(read_exactly(out.data(), out.size()));
  if (c.pos == e.size) {
    // At the end: one more read lets libzip compare the CRC it computed while the entry was
    // read in order (after a seek backwards it has none to compare, and says nothing).
    char probe;
    const zip_int64_t got = zip_fread(c.file, &probe, 1);
    if (got != 0) {
      Status s = EntryError(
          index, got < 0 ? "read failed at its end" : "holds more bytes than its recorded size",
          got < 0 ? zip_error_strerror(zip_file_get_error(c.file)) : nullptr);
      cursor_.reset();
      return s;
    }
    if (c.in_order) checked_[index] = 2;
  }
  return Status::Ok();
}

}  // namespace tensorferry::convert
