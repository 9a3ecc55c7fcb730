// Test-only builders for PyTorch checkpoints: pickles opcode by opcode, zip archives (stored
// entries, written by hand so tests can also break them), torch.save zip and legacy layouts.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tensorferry::testing {

// Emits pickle opcodes. Methods push what Python's pickler would for the value named.
class PickleBuilder {
 public:
  PickleBuilder& Proto(int version = 2);
  PickleBuilder& Op(uint8_t op);
  PickleBuilder& Raw(std::string_view bytes);
  PickleBuilder& U8(uint8_t v);
  PickleBuilder& U32(uint32_t v);
  PickleBuilder& U64(uint64_t v);

  PickleBuilder& Mark() { return Op('('); }
  PickleBuilder& Stop() { return Op('.'); }
  PickleBuilder& None() { return Op('N'); }
  PickleBuilder& Bool(bool v) { return Op(v ? 0x88 : 0x89); }
  PickleBuilder& Int(int64_t v);  // BININT1/BININT2/BININT/LONG1, as Python chooses
  PickleBuilder& Long1(std::string_view le_bytes);
  PickleBuilder& Float(double v);
  PickleBuilder& Str(std::string_view s);       // BINUNICODE
  PickleBuilder& ShortStr(std::string_view s);  // SHORT_BINUNICODE
  PickleBuilder& Bytes(std::string_view s);     // BINBYTES
  PickleBuilder& EmptyDict() { return Op('}'); }
  PickleBuilder& EmptyList() { return Op(']'); }
  PickleBuilder& EmptyTuple() { return Op(')'); }
  PickleBuilder& Tuple() { return Op('t'); }  // items since MARK
  PickleBuilder& Tuple(int n);                // TUPLE1..3 of the n values on top
  PickleBuilder& SetItem() { return Op('s'); }
  PickleBuilder& SetItems() { return Op('u'); }
  PickleBuilder& Append() { return Op('a'); }
  PickleBuilder& Appends() { return Op('e'); }
  PickleBuilder& Reduce() { return Op('R'); }
  PickleBuilder& Build() { return Op('b'); }
  PickleBuilder& NewObj() { return Op(0x81); }
  PickleBuilder& PersId() { return Op('Q'); }
  PickleBuilder& Put(uint32_t i);  // BINPUT or LONG_BINPUT
  PickleBuilder& Get(uint32_t i);  // BINGET or LONG_BINGET
  PickleBuilder& Memoize() { return Op(0x94); }
  PickleBuilder& Global(std::string_view module, std::string_view name);  // GLOBAL
  PickleBuilder& StackGlobal(std::string_view module, std::string_view name);
  PickleBuilder& OrderedDict();  // collections.OrderedDict() via REDUCE

  // ('storage', torch.<storage_type>, key, location, numel) then BINPERSID. Legacy adds None.
  PickleBuilder& Storage(std::string_view storage_type, std::string_view key, int64_t numel,
                         bool legacy = false, std::string_view location = "cpu");
  // torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict()).
  PickleBuilder& Tensor(std::string_view storage_type, std::string_view key, int64_t numel,
                        int64_t offset, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& stride, bool legacy = false);
  // Row-major strides of `shape`.
  static std::vector<int64_t> Contiguous(const std::vector<int64_t>& shape);

  const std::string& bytes() const { return out_; }
  size_t size() const { return out_.size(); }

 private:
  std::string out_;
};

uint32_t Crc32(std::string_view data);

struct ZipSpec {
  std::string name;
  std::string data;
  bool bad_crc = false;       // record a wrong CRC-32
  uint64_t claimed_size = 0;  // record this uncompressed size instead of the data's (0: the data's)
};

// A zip archive of stored (uncompressed) entries: local headers, data, central directory, end
// record. No zip64, no data descriptors.
std::string MakeZip(const std::vector<ZipSpec>& entries);

// Deflate-compressed entries, written with libzip to `path`.
void WriteDeflatedZip(const std::string& path, const std::vector<ZipSpec>& entries);

// A torch.save zip: "<archive>/data.pkl", "<archive>/data/<key>", "<archive>/byteorder",
// "<archive>/version".
std::string MakeTorchZip(const std::string& pickle, const std::map<std::string, std::string>& data,
                         std::string_view archive = "archive",
                         std::string_view byteorder = "little");

// A legacy torch.save file: magic, protocol, sys_info pickles, `pickle` (using legacy persistent
// ids), the key list, then each storage as an 8-byte element count and its bytes.
struct LegacyStorage {
  std::string key;
  uint64_t numel = 0;
  std::string bytes;
};
std::string MakeLegacy(const std::string& pickle, const std::vector<LegacyStorage>& storages);

// Bytes of float32 values, little-endian.
std::string F32Bytes(const std::vector<float>& values);

}  // namespace tensorferry::testing
