#include "testing/torch_builder.h"

#include <zip.h>

#include <array>
#include <bit>
#include <cstring>
#include <stdexcept>

namespace tensorferry::testing {

PickleBuilder& PickleBuilder::Proto(int version) {
  Op(0x80);
  return U8(static_cast<uint8_t>(version));
}
PickleBuilder& PickleBuilder::Op(uint8_t op) {
  out_.push_back(static_cast<char>(op));
  return *this;
}
PickleBuilder& PickleBuilder::Raw(std::string_view bytes) {
  out_.append(bytes);
  return *this;
}
PickleBuilder& PickleBuilder::U8(uint8_t v) {
  return Op(v);
}
PickleBuilder& PickleBuilder::U32(uint32_t v) {
  for (int i = 0; i < 4; ++i) U8(static_cast<uint8_t>(v >> (8 * i)));
  return *this;
}
PickleBuilder& PickleBuilder::U64(uint64_t v) {
  for (int i = 0; i < 8; ++i) U8(static_cast<uint8_t>(v >> (8 * i)));
  return *this;
}

PickleBuilder& PickleBuilder::Int(int64_t v) {
  if (v >= 0 && v < 256) return Op('K').U8(static_cast<uint8_t>(v));
  if (v >= 0 && v < 65536) {
    Op('M');
    U8(static_cast<uint8_t>(v));
    return U8(static_cast<uint8_t>(v >> 8));
  }
  if (v >= INT32_MIN && v <= INT32_MAX) return Op('J').U32(static_cast<uint32_t>(v));
  std::string le;
  for (int i = 0; i < 8; ++i) le.push_back(static_cast<char>(static_cast<uint64_t>(v) >> (8 * i)));
  return Long1(le);
}

PickleBuilder& PickleBuilder::Long1(std::string_view le_bytes) {
  Op(0x8a).U8(static_cast<uint8_t>(le_bytes.size()));
  return Raw(le_bytes);
}

PickleBuilder& PickleBuilder::Float(double v) {
  const auto bits = std::bit_cast<uint64_t>(v);
  Op('G');
  for (int i = 7; i >= 0; --i) U8(static_cast<uint8_t>(bits >> (8 * i)));
  return *this;
}

PickleBuilder& PickleBuilder::Str(std::string_view s) {
  Op('X').U32(static_cast<uint32_t>(s.size()));
  return Raw(s);
}
PickleBuilder& PickleBuilder::ShortStr(std::string_view s) {
  Op(0x8c).U8(static_cast<uint8_t>(s.size()));
  return Raw(s);
}
PickleBuilder& PickleBuilder::Bytes(std::string_view s) {
  Op('B').U32(static_cast<uint32_t>(s.size()));
  return Raw(s);
}
PickleBuilder& PickleBuilder::Tuple(int n) {
  if (n == 0) return EmptyTuple();
  return Op(static_cast<uint8_t>(0x84 + n));
}
PickleBuilder& PickleBuilder::Put(uint32_t i) {
  if (i < 256) return Op('q').U8(static_cast<uint8_t>(i));
  return Op('r').U32(i);
}
PickleBuilder& PickleBuilder::Get(uint32_t i) {
  if (i < 256) return Op('h').U8(static_cast<uint8_t>(i));
  return Op('j').U32(i);
}
PickleBuilder& PickleBuilder::Global(std::string_view module, std::string_view name) {
  Op('c');
  Raw(module);
  Raw("\n");
  Raw(name);
  return Raw("\n");
}
PickleBuilder& PickleBuilder::StackGlobal(std::string_view module, std::string_view name) {
  ShortStr(module);
  ShortStr(name);
  return Op(0x93);
}
PickleBuilder& PickleBuilder::OrderedDict() {
  Global("collections", "OrderedDict");
  EmptyTuple();
  return Reduce();
}

PickleBuilder& PickleBuilder::Storage(std::string_view storage_type, std::string_view key,
                                      int64_t numel, bool legacy, std::string_view location) {
  Mark();
  Str("storage");
  if (storage_type == "UntypedStorage") {
    Global("torch.storage", "UntypedStorage");
  } else {
    Global("torch", storage_type);
  }
  Str(key);
  Str(location);
  Int(numel);
  if (legacy) None();
  Tuple();
  return PersId();
}

PickleBuilder& PickleBuilder::Tensor(std::string_view storage_type, std::string_view key,
                                     int64_t numel, int64_t offset,
                                     const std::vector<int64_t>& shape,
                                     const std::vector<int64_t>& stride, bool legacy) {
  Global("torch._utils", "_rebuild_tensor_v2");
  Mark();
  Storage(storage_type, key, numel, legacy);
  Int(offset);
  Mark();
  for (int64_t d : shape) Int(d);
  Tuple();
  Mark();
  for (int64_t d : stride) Int(d);
  Tuple();
  Bool(false);
  OrderedDict();
  Tuple();
  return Reduce();
}

std::vector<int64_t> PickleBuilder::Contiguous(const std::vector<int64_t>& shape) {
  std::vector<int64_t> stride(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    stride[i] = s;
    s *= shape[i];
  }
  return stride;
}

uint32_t Crc32(std::string_view data) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (char ch : data) c = table[(c ^ static_cast<uint8_t>(ch)) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

namespace {

void Le(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

}  // namespace

std::string MakeZip(const std::vector<ZipSpec>& entries) {
  std::string out, central;
  for (const ZipSpec& e : entries) {
    const uint32_t crc = Crc32(e.data) ^ (e.bad_crc ? 0x5a5a5a5au : 0);
    const auto offset = static_cast<uint32_t>(out.size());
    Le(out, 0x04034b50, 4);
    Le(out, 20, 2);    // version needed
    Le(out, 0, 2);     // flags
    Le(out, 0, 2);     // stored
    Le(out, 0, 2);     // time
    Le(out, 0x21, 2);  // date
    const uint64_t size = e.claimed_size != 0 ? e.claimed_size : e.data.size();
    Le(out, crc, 4);
    Le(out, e.data.size(), 4);
    Le(out, size, 4);
    Le(out, e.name.size(), 2);
    Le(out, 0, 2);
    out += e.name;
    out += e.data;

    Le(central, 0x02014b50, 4);
    Le(central, 20, 2);  // made by
    Le(central, 20, 2);  // needed
    Le(central, 0, 2);
    Le(central, 0, 2);
    Le(central, 0, 2);
    Le(central, 0x21, 2);
    Le(central, crc, 4);
    Le(central, e.data.size(), 4);
    Le(central, size, 4);
    Le(central, e.name.size(), 2);
    Le(central, 0, 2);  // extra
    Le(central, 0, 2);  // comment
    Le(central, 0, 2);  // disk
    Le(central, 0, 2);  // internal attributes
    Le(central, 0, 4);  // external attributes
    Le(central, offset, 4);
    central += e.name;
  }
  const auto cd_offset = static_cast<uint32_t>(out.size());
  out += central;
  Le(out, 0x06054b50, 4);
  Le(out, 0, 2);
  Le(out, 0, 2);
  Le(out, entries.size(), 2);
  Le(out, entries.size(), 2);
  Le(out, central.size(), 4);
  Le(out, cd_offset, 4);
  Le(out, 0, 2);
  return out;
}

void WriteDeflatedZip(const std::string& path, const std::vector<ZipSpec>& entries) {
  int err = 0;
  zip_t* za = zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, &err);
  if (za == nullptr) throw std::runtime_error("zip_open failed");
  for (const ZipSpec& e : entries) {
    zip_source_t* src = zip_source_buffer(za, e.data.data(), e.data.size(), 0);
    const zip_int64_t i = zip_file_add(za, e.name.c_str(), src, ZIP_FL_ENC_UTF_8);
    if (i < 0) throw std::runtime_error("zip_file_add failed");
    zip_set_file_compression(za, static_cast<zip_uint64_t>(i), ZIP_CM_DEFLATE, 9);
  }
  if (zip_close(za) != 0) throw std::runtime_error("zip_close failed");
}

std::string MakeTorchZip(const std::string& pickle, const std::map<std::string, std::string>& data,
                         std::string_view archive, std::string_view byteorder) {
  const std::string a(archive);
  std::vector<ZipSpec> entries;
  entries.push_back({a + "/data.pkl", pickle});
  if (!byteorder.empty()) entries.push_back({a + "/byteorder", std::string(byteorder)});
  for (const auto& [key, bytes] : data) entries.push_back({a + "/data/" + key, bytes});
  entries.push_back({a + "/version", "3\n"});
  return MakeZip(entries);
}

std::string MakeLegacy(const std::string& pickle, const std::vector<LegacyStorage>& storages) {
  PickleBuilder magic;
  magic.Proto(2).Long1(std::string("\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 10)).Stop();
  PickleBuilder protocol;
  protocol.Proto(2).Int(1001).Stop();
  PickleBuilder sys;
  sys.Proto(2).EmptyDict().Mark().Str("protocol_version").Int(1001).Str("little_endian").Bool(true);
  sys.Str("type_sizes").EmptyDict().Mark().Str("short").Int(2).Str("int").Int(4).Str("long").Int(4);
  sys.SetItems().SetItems().Stop();
  PickleBuilder keys;
  keys.Proto(2).EmptyList().Mark();
  for (const auto& s : storages) keys.Str(s.key);
  keys.Appends().Stop();
  std::string out = magic.bytes() + protocol.bytes() + sys.bytes() + pickle + keys.bytes();
  for (const auto& s : storages) {
    Le(out, s.numel, 8);
    out += s.bytes;
  }
  return out;
}

std::string F32Bytes(const std::vector<float>& values) {
  std::string out(values.size() * 4, '\0');
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

}  // namespace tensorferry::testing
