// The restricted unpickler (pickle_vm.h). One opcode at a time over a byte span: every read is
// bounds-checked first, every allocation is counted against PickleLimits first, and nothing the
// input names is ever looked up in a real module or called.
#include "convert/pickle_vm.h"

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "util/json_writer.h"
#include "util/macros.h"

namespace tensorferry::convert {

static_assert(sizeof(Value) == 16, "stack, memo and container items are Values");

namespace {

// --- dtypes --------------------------------------------------------------------------------------

constexpr std::array<TorchDtypeInfo, 27> kTorchDtypes = {{
    {"float64", "DoubleStorage", DType::kF64, 8},
    {"float32", "FloatStorage", DType::kF32, 4},
    {"float16", "HalfStorage", DType::kF16, 2},
    {"bfloat16", "BFloat16Storage", DType::kBF16, 2},
    {"int64", "LongStorage", DType::kI64, 8},
    {"int32", "IntStorage", DType::kI32, 4},
    {"int16", "ShortStorage", DType::kI16, 2},
    {"int8", "CharStorage", DType::kI8, 1},
    {"uint8", "ByteStorage", DType::kU8, 1},
    {"bool", "BoolStorage", DType::kBool, 1},
    {"complex64", "ComplexFloatStorage", DType::kC64, 8},
    {"complex128", "ComplexDoubleStorage", std::nullopt, 16},
    {"complex32", "ComplexHalfStorage", std::nullopt, 4},
    {"uint16", "", DType::kU16, 2},
    {"uint32", "", DType::kU32, 4},
    {"uint64", "", DType::kU64, 8},
    {"float8_e4m3fn", "", DType::kF8_E4M3, 1},
    {"float8_e5m2", "", DType::kF8_E5M2, 1},
    {"float8_e4m3fnuz", "", DType::kF8_E4M3FNUZ, 1},
    {"float8_e5m2fnuz", "", DType::kF8_E5M2FNUZ, 1},
    {"float8_e8m0fnu", "", DType::kF8_E8M0, 1},
    {"float4_e2m1fn_x2", "", std::nullopt, 1},
    {"qint8", "QInt8Storage", std::nullopt, 1},
    {"quint8", "QUInt8Storage", std::nullopt, 1},
    {"qint32", "QInt32Storage", std::nullopt, 4},
    {"quint4x2", "QUInt4x2Storage", std::nullopt, 1},
    {"quint2x4", "QUInt2x4Storage", std::nullopt, 1},
}};
constexpr uint8_t kUint8Index = 8;

// torch's dtype aliases (torch.float is torch.float32, ...).
constexpr std::array<std::pair<std::string_view, std::string_view>, 9> kDtypeAliases = {{
    {"float", "float32"},
    {"double", "float64"},
    {"half", "float16"},
    {"long", "int64"},
    {"int", "int32"},
    {"short", "int16"},
    {"cfloat", "complex64"},
    {"cdouble", "complex128"},
    {"chalf", "complex32"},
}};

}  // namespace

std::span<const TorchDtypeInfo> TorchDtypes() noexcept {
  return kTorchDtypes;
}
uint8_t TorchUint8Dtype() noexcept {
  return kUint8Index;
}

std::optional<uint8_t> TorchDtypeByName(std::string_view name) noexcept {
  for (const auto& [alias, canonical] : kDtypeAliases) {
    if (name == alias) name = canonical;
  }
  for (size_t i = 0; i < kTorchDtypes.size(); ++i) {
    if (kTorchDtypes[i].name == name) return static_cast<uint8_t>(i);
  }
  return std::nullopt;
}

std::optional<uint8_t> TorchDtypeByStorageName(std::string_view storage_name) noexcept {
  if (storage_name.empty()) return std::nullopt;
  for (size_t i = 0; i < kTorchDtypes.size(); ++i) {
    if (kTorchDtypes[i].storage_name == storage_name) return static_cast<uint8_t>(i);
  }
  return std::nullopt;
}

// --- number text ---------------------------------------------------------------------------------

std::string PythonFloatRepr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  // Shortest round-trip digits, then Python's layout: exponent form when the decimal point
  // would sit more than 16 places right or 4 places left of the first digit.
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, std::fabs(v), std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(r.ptr - buf));
  const size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e)) {
    if (c != '.') digits.push_back(c);
  }
  int exp = 0;
  std::string_view exp_text = sci.substr(e + 1);
  if (!exp_text.empty() && exp_text[0] == '+') exp_text.remove_prefix(1);
  std::from_chars(exp_text.data(), exp_text.data() + exp_text.size(), exp);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  const int decpt = exp + 1;
  std::string out = std::signbit(v) ? "-" : "";
  const int n = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out += digits.substr(0, 1);
    if (n > 1) {
      out += '.';
      out += digits.substr(1);
    }
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += eb;
  } else if (decpt <= 0) {
    out += "0.";
    out.append(static_cast<size_t>(-decpt), '0');
    out += digits;
  } else if (decpt >= n) {
    out += digits;
    out.append(static_cast<size_t>(decpt - n), '0');
    out += ".0";
  } else {
    out += digits.substr(0, static_cast<size_t>(decpt));
    out += '.';
    out += digits.substr(static_cast<size_t>(decpt));
  }
  return out;
}

std::string BigIntToDecimal(std::string_view le_bytes) {
  if (le_bytes.empty()) return "0";
  std::vector<uint8_t> mag(le_bytes.begin(), le_bytes.end());
  const bool negative = (mag.back() & 0x80) != 0;
  if (negative) {  // two's complement: invert and add one
    unsigned carry = 1;
    for (auto& b : mag) {
      const unsigned x = static_cast<uint8_t>(~b) + carry;
      b = static_cast<uint8_t>(x);
      carry = x >> 8;
    }
  }
  // The magnitude in 32-bit limbs, most significant first, divided in place by 10^9 per pass:
  // nine digits a pass, no allocation (a crafted pickle names thousands of keys by such numbers).
  std::vector<uint32_t> limbs((mag.size() + 3) / 4, 0);
  for (size_t i = 0; i < mag.size(); ++i) {
    limbs[limbs.size() - 1 - i / 4] |= static_cast<uint32_t>(mag[i]) << (8 * (i % 4));
  }
  size_t first = 0;    // limbs before it are zero
  std::string digits;  // least significant first
  while (first < limbs.size()) {
    uint64_t rem = 0;
    for (size_t k = first; k < limbs.size(); ++k) {
      const uint64_t cur = (rem << 32) | limbs[k];
      limbs[k] = static_cast<uint32_t>(cur / 1000000000u);
      rem = cur % 1000000000u;
    }
    while (first < limbs.size() && limbs[first] == 0) ++first;
    for (int d = 0; d < 9 && (first < limbs.size() || rem != 0); ++d) {
      digits.push_back(static_cast<char>('0' + rem % 10));
      rem /= 10;
    }
  }
  if (digits.empty()) digits = "0";
  if (negative) digits.push_back('-');
  return std::string(digits.rbegin(), digits.rend());
}

namespace {

// --- opcodes -------------------------------------------------------------------------------------

// Names of every opcode of protocols 0-5, for messages.
std::string_view OpcodeName(uint8_t op) {
  switch (op) {
    case '(': return "MARK";
    case '.': return "STOP";
    case '0': return "POP";
    case '1': return "POP_MARK";
    case '2': return "DUP";
    case 'F': return "FLOAT";
    case 'I': return "INT";
    case 'J': return "BININT";
    case 'K': return "BININT1";
    case 'L': return "LONG";
    case 'M': return "BININT2";
    case 'N': return "NONE";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 'R': return "REDUCE";
    case 'S': return "STRING";
    case 'T': return "BINSTRING";
    case 'U': return "SHORT_BINSTRING";
    case 'V': return "UNICODE";
    case 'X': return "BINUNICODE";
    case 'a': return "APPEND";
    case 'b': return "BUILD";
    case 'c': return "GLOBAL";
    case 'd': return "DICT";
    case '}': return "EMPTY_DICT";
    case 'e': return "APPENDS";
    case 'g': return "GET";
    case 'h': return "BINGET";
    case 'i': return "INST";
    case 'j': return "LONG_BINGET";
    case 'l': return "LIST";
    case ']': return "EMPTY_LIST";
    case 'o': return "OBJ";
    case 'p': return "PUT";
    case 'q': return "BINPUT";
    case 'r': return "LONG_BINPUT";
    case 's': return "SETITEM";
    case 't': return "TUPLE";
    case ')': return "EMPTY_TUPLE";
    case 'u': return "SETITEMS";
    case 'G': return "BINFLOAT";
    case 'B': return "BINBYTES";
    case 'C': return "SHORT_BINBYTES";
    case 0x80: return "PROTO";
    case 0x81: return "NEWOBJ";
    case 0x82: return "EXT1";
    case 0x83: return "EXT2";
    case 0x84: return "EXT4";
    case 0x85: return "TUPLE1";
    case 0x86: return "TUPLE2";
    case 0x87: return "TUPLE3";
    case 0x88: return "NEWTRUE";
    case 0x89: return "NEWFALSE";
    case 0x8a: return "LONG1";
    case 0x8b: return "LONG4";
    case 0x8c: return "SHORT_BINUNICODE";
    case 0x8d: return "BINUNICODE8";
    case 0x8e: return "BINBYTES8";
    case 0x8f: return "EMPTY_SET";
    case 0x90: return "ADDITEMS";
    case 0x91: return "FROZENSET";
    case 0x92: return "NEWOBJ_EX";
    case 0x93: return "STACK_GLOBAL";
    case 0x94: return "MEMOIZE";
    case 0x95: return "FRAME";
    case 0x96: return "BYTEARRAY8";
    case 0x97: return "NEXT_BUFFER";
    case 0x98: return "READONLY_BUFFER";
    default: return "";
  }
}

std::string Hex2(uint8_t b) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s = "0x";
  s.push_back(kHex[b >> 4]);
  s.push_back(kHex[b & 15]);
  return s;
}

// Pops into a new local `name`, or returns the underflow status.
#define TF_VM_POP(name)                \
  Value name;                          \
  do {                                 \
    Status tf_pop_ = Pop(name);        \
    if (!tf_pop_.ok()) return tf_pop_; \
  } while (0)

class Vm {
 public:
  Vm(std::span<const std::byte> bytes, const PickleLimits& limits, PersistentIds pids,
     std::string_view source)
      : data_(reinterpret_cast<const uint8_t*>(bytes.data())),
        // Only the first max_pickle_size bytes are ever read; running into that bound is the
        // limit error, not truncation.
        size_(std::min<uint64_t>(bytes.size(), limits.max_pickle_size)),
        limited_(bytes.size() > limits.max_pickle_size),
        limits_(limits),
        pids_(pids),
        source_(source) {}

  Result<PickleResult> Run() {
    while (true) {
      if (pos_ >= size_) {
        op_pos_ = pos_;
        if (limited_) return Limit("max_pickle_size", limits_.max_pickle_size);
        return Fail(Code::kPickleTruncated, "the pickle ends without STOP");
      }
      op_pos_ = pos_;
      const uint8_t op = data_[pos_++];
      if (op == '.') {
        TF_VM_POP(root);
        r_.root = root;
        r_.end = pos_;
        return std::move(r_);
      }
      Status s = Step(op);
      if (!s.ok()) return s;
    }
  }

 private:
  // --- errors ------------------------------------------------------------------------------------
  Status Fail(Code code, const std::string& what) const {
    std::string msg(source_);
    if (!msg.empty()) msg += ": ";
    msg += what;
    msg += " at pickle offset " + std::to_string(op_pos_);
    return Status(code, std::move(msg));
  }
  Status Truncated(std::string_view what) const {
    if (limited_) return Limit("max_pickle_size", limits_.max_pickle_size);
    return Fail(Code::kPickleTruncated, "the pickle ends inside " + std::string(what) + " (" +
                                            std::to_string(size_ - pos_) + " bytes left)");
  }
  Status Malformed(const std::string& what) const { return Fail(Code::kPickleMalformed, what); }
  Status Limit(std::string_view name, uint64_t limit) const {
    return Fail(Code::kPickleLimitExceeded,
                "PickleLimits::" + std::string(name) + " (" + std::to_string(limit) + ") exceeded");
  }
  Status OpError(uint8_t op, const std::string& what) const {
    return Malformed(std::string(OpcodeName(op)) + ": " + what);
  }

  // --- input -------------------------------------------------------------------------------------
  bool Has(uint64_t n) const { return n <= size_ - pos_; }
  uint64_t ReadLe(unsigned n) {
    uint64_t v = 0;
    for (unsigned i = 0; i < n; ++i) v |= static_cast<uint64_t>(data_[pos_ + i]) << (8 * i);
    pos_ += n;
    return v;
  }
  Status Need(uint64_t n, uint8_t op) const {
    if (!Has(n)) return Truncated(OpcodeName(op));
    return Status::Ok();
  }
  // A length-prefixed payload: checks the limit and the bytes left before anything else.
  Status ReadPayload(uint8_t op, unsigned len_bytes, std::string_view& out) {
    TF_RETURN_IF_ERROR(Need(len_bytes, op));
    const uint64_t len = ReadLe(len_bytes);
    if (len_bytes == 4 && (op == 'T' || op == 0x8b) && (len & 0x80000000u)) {
      return OpError(op, "negative length");
    }
    if (len > limits_.max_string) return Limit("max_string", limits_.max_string);
    if (!Has(len)) return Truncated(OpcodeName(op));
    out = std::string_view(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += len;
    return Status::Ok();
  }
  // A '\n'-terminated line (GLOBAL and INST operands).
  Status ReadLine(uint8_t op, std::string_view& out) {
    const uint64_t max = std::min<uint64_t>(size_ - pos_, limits_.max_string);
    for (uint64_t i = 0; i < max; ++i) {
      if (data_[pos_ + i] == '\n') {
        out = std::string_view(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(i));
        pos_ += i + 1;
        return Status::Ok();
      }
    }
    if (max == limits_.max_string && size_ - pos_ > max) {
      return Limit("max_string", limits_.max_string);
    }
    return Truncated(OpcodeName(op));
  }

  // --- stack, marks, memo, arena -------------------------------------------------------------
  Status Push(Value v) {
    if (stack_.size() >= limits_.max_stack) return Limit("max_stack", limits_.max_stack);
    stack_.push_back(v);
    return Status::Ok();
  }
  // Pops the top value; never crosses the innermost MARK.
  Status Pop(Value& v) {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) return Malformed("stack underflow");
    v = stack_.back();
    stack_.pop_back();
    return Status::Ok();
  }
  Status Top(Value*& v) {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) return Malformed("stack underflow");
    v = &stack_.back();
    return Status::Ok();
  }
  // The values pushed since the innermost MARK, which is removed.
  Status PopMark(std::vector<Value>& items) {
    if (marks_.empty()) return Malformed("no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    items.assign(stack_.begin() + static_cast<ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return Status::Ok();
  }
  // Charges `n` items or bytes that an emulated call copies from an existing object.
  Status CountCopied(uint64_t n) {
    const uint64_t allowed = size_ + limits_.copy_allowance;
    if (n > allowed - std::min(copied_, allowed)) {
      return Fail(Code::kPickleLimitExceeded,
                  "the emulated calls copy more than the pickle's size plus "
                  "PickleLimits::copy_allowance (" +
                      std::to_string(allowed) +
                      " items and bytes; a large argument called again "
                      "and again?)");
    }
    copied_ += n;
    return Status::Ok();
  }
  Status CountItems(uint64_t n) {
    if (n > limits_.max_container) return Limit("max_container", limits_.max_container);
    if (n > limits_.max_total_items - total_items_) {
      return Limit("max_total_items", limits_.max_total_items);
    }
    total_items_ += n;
    return Status::Ok();
  }
  Result<uint32_t> NewObject(Kind kind) {
    if (r_.objects.size() >= limits_.max_objects) return Limit("max_objects", limits_.max_objects);
    r_.objects.emplace_back();
    r_.objects.back().kind = kind;
    return static_cast<uint32_t>(r_.objects.size() - 1);
  }
  Status PushObject(Kind kind, std::vector<Value> items = {}) {
    TF_RETURN_IF_ERROR(CountItems(items.size()));
    TF_ASSIGN_OR_RETURN(const uint32_t ref, NewObject(kind));
    r_.objects[ref].items = std::move(items);
    return Push(Value::Ref(ref));
  }
  Status PushString(Kind kind, std::string_view bytes) {
    TF_ASSIGN_OR_RETURN(const uint32_t ref, NewObject(kind));
    r_.objects[ref].str.assign(bytes);
    return Push(Value::Ref(ref));
  }
  Status MemoPut(uint64_t index) {
    Value* top = nullptr;
    TF_RETURN_IF_ERROR(Top(top));
    if (index >= limits_.max_memo_index) return Limit("max_memo_index", limits_.max_memo_index);
    if (index < memo_dense_.size()) {
      memo_dense_[index] = *top;
      return Status::Ok();
    }
    auto it = memo_sparse_.find(index);
    if (it != memo_sparse_.end() && index != memo_dense_.size()) {
      it->second = *top;
      return Status::Ok();
    }
    if (it == memo_sparse_.end() && MemoSize() >= limits_.max_memo) {
      return Limit("max_memo", limits_.max_memo);
    }
    if (index == memo_dense_.size()) {  // the usual case (MEMOIZE, BINPUT 0, 1, 2, ...)
      if (it != memo_sparse_.end()) memo_sparse_.erase(it);
      memo_dense_.push_back(*top);
      // Keys put out of order that now follow on move over (each key in one place only).
      for (auto next = memo_sparse_.find(memo_dense_.size()); next != memo_sparse_.end();
           next = memo_sparse_.find(memo_dense_.size())) {
        memo_dense_.push_back(next->second);
        memo_sparse_.erase(next);
      }
    } else {
      memo_sparse_.emplace(index, *top);
    }
    return Status::Ok();
  }
  Status MemoGet(uint64_t index) {
    if (index < memo_dense_.size()) return Push(memo_dense_[index]);
    auto it = memo_sparse_.find(index);
    if (it == memo_sparse_.end()) {
      return Malformed("memo key " + std::to_string(index) + " was never set");
    }
    return Push(it->second);
  }
  // len(memo): its keys, dense and sparse (no key is in both).
  uint64_t MemoSize() const { return memo_dense_.size() + memo_sparse_.size(); }

  Object* Obj(const Value& v, Kind kind) {
    return v.tag == Tag::kRef && r_.objects[v.ref].kind == kind ? &r_.objects[v.ref] : nullptr;
  }
  // What a message calls `v`: an allowlisted global by its own name ("torch.FloatStorage"),
  // anything else by its Python type name.
  std::string Type(const Value& v) const {
    if (v.tag == Tag::kRef && r_.objects[v.ref].kind == Kind::kGlobal) return r_.objects[v.ref].str;
    return PyTypeName(r_, v);
  }

  // --- one opcode ----------------------------------------------------------------------------
  Status Step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        TF_RETURN_IF_ERROR(Need(1, op));
        const uint8_t v = data_[pos_++];
        if (v > 5) {
          return Fail(Code::kPickleUnsupportedOpcode,
                      "unsupported pickle protocol " + std::to_string(v));
        }
        r_.protocol = v;
        return Status::Ok();
      }
      case 0x95: {  // FRAME: framing only; the bytes follow inline
        TF_RETURN_IF_ERROR(Need(8, op));
        const uint64_t n = ReadLe(8);
        if (!Has(n)) return Truncated("FRAME");
        return Status::Ok();
      }
      case '(':
        if (marks_.size() >= limits_.max_marks) return Limit("max_marks", limits_.max_marks);
        marks_.push_back(stack_.size());
        return Status::Ok();
      case '}': return PushObject(Kind::kDict);
      case ']': return PushObject(Kind::kList);
      case ')': return PushObject(Kind::kTuple);
      case 0x8f: return PushObject(Kind::kSet);
      case 'N': return Push(Value::None());
      case 0x88: return Push(Value::Bool(true));
      case 0x89: return Push(Value::Bool(false));
      case 'J': {
        TF_RETURN_IF_ERROR(Need(4, op));
        return Push(Value::Int(static_cast<int32_t>(static_cast<uint32_t>(ReadLe(4)))));
      }
      case 'K':
        TF_RETURN_IF_ERROR(Need(1, op));
        return Push(Value::Int(static_cast<int64_t>(ReadLe(1))));
      case 'M':
        TF_RETURN_IF_ERROR(Need(2, op));
        return Push(Value::Int(static_cast<int64_t>(ReadLe(2))));
      case 0x8a:
      case 0x8b: {  // LONG1, LONG4
        const unsigned n = op == 0x8a ? 1 : 4;
        TF_RETURN_IF_ERROR(Need(n, op));
        uint64_t len = 0;
        for (unsigned i = 0; i < n; ++i) len |= static_cast<uint64_t>(data_[pos_ + i]) << (8 * i);
        // Refused before anything is done with the digits: printing a huge integer (as a value
        // or a key) costs time quadratic in its size. A negative LONG4 length is ReadPayload's.
        if (len > limits_.max_int_bytes && !(n == 4 && (len & 0x80000000u))) {
          return Fail(Code::kPickleLimitExceeded,
                      std::string(OpcodeName(op)) + ": an integer of " + std::to_string(len) +
                          " bytes exceeds PickleLimits::max_int_bytes (" +
                          std::to_string(limits_.max_int_bytes) +
                          "; integers of more than 4300 decimal digits are refused, as Python "
                          "refuses to convert them to text)");
        }
        std::string_view b;
        TF_RETURN_IF_ERROR(ReadPayload(op, n, b));
        return PushLong(b);
      }
      case 'G': {
        TF_RETURN_IF_ERROR(Need(8, op));
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | data_[pos_ + static_cast<uint64_t>(i)];
        pos_ += 8;
        return Push(Value::Float(std::bit_cast<double>(bits)));
      }
      case 'X':
      case 0x8c:
      case 0x8d:
      case 'T':
      case 'U': {  // text
        std::string_view s;
        const unsigned n = (op == 0x8c || op == 'U') ? 1 : (op == 0x8d ? 8 : 4);
        TF_RETURN_IF_ERROR(ReadPayload(op, n, s));
        if (!json::IsValidUtf8(s)) return OpError(op, "string is not valid UTF-8");
        return PushString(Kind::kStr, s);
      }
      case 'B':
      case 'C':
      case 0x8e:
      case 0x96: {  // bytes
        std::string_view s;
        const unsigned n = op == 'C' ? 1 : (op == 'B' ? 4 : 8);
        TF_RETURN_IF_ERROR(ReadPayload(op, n, s));
        TF_RETURN_IF_ERROR(PushString(Kind::kBytes, s));
        // BYTEARRAY8 (protocol 5): a bytearray, as builtins.bytearray(...) is below 5.
        if (op == 0x96) r_.objects[stack_.back().ref].bytearray = true;
        return Status::Ok();
      }
      case 't': {
        std::vector<Value> items;
        TF_RETURN_IF_ERROR(PopMark(items));
        return PushObject(Kind::kTuple, std::move(items));
      }
      case 0x85:
      case 0x86:
      case 0x87: {
        const size_t n = static_cast<size_t>(op - 0x84);
        std::vector<Value> items(n);
        for (size_t i = n; i-- > 0;) {
          Status s = Pop(items[i]);
          if (!s.ok()) return s;
        }
        return PushObject(Kind::kTuple, std::move(items));
      }
      case 'l': {
        std::vector<Value> items;
        TF_RETURN_IF_ERROR(PopMark(items));
        return PushObject(Kind::kList, std::move(items));
      }
      case 'd': {
        std::vector<Value> items;
        TF_RETURN_IF_ERROR(PopMark(items));
        if (items.size() % 2 != 0) return OpError(op, "odd number of items for a dict");
        return PushObject(Kind::kDict, std::move(items));
      }
      case 0x91: {
        std::vector<Value> items;
        TF_RETURN_IF_ERROR(PopMark(items));
        return PushObject(Kind::kFrozenSet, std::move(items));
      }
      case 'a': {
        TF_VM_POP(v);
        return Extend(op, {&v, 1});
      }
      case 'e':
      case 0x90: {  // APPENDS, ADDITEMS
        std::vector<Value> items;
        TF_RETURN_IF_ERROR(PopMark(items));
        return Extend(op, items);
      }
      case 's': {
        TF_VM_POP(v);
        TF_VM_POP(k);
        const Value kv[2] = {k, v};
        return Extend(op, kv);
      }
      case 'u': {
        std::vector<Value> items;
        TF_RETURN_IF_ERROR(PopMark(items));
        if (items.size() % 2 != 0) return OpError(op, "odd number of items for a dict");
        return Extend(op, items);
      }
      case '0': {  // POP: the top value, or the innermost MARK when nothing is above it
        if (!marks_.empty() && stack_.size() == marks_.back()) {
          marks_.pop_back();
          return Status::Ok();
        }
        TF_VM_POP(v);
        return Status::Ok();
      }
      case '1': {
        std::vector<Value> items;
        return PopMark(items);
      }
      case '2': {
        Value* top = nullptr;
        TF_RETURN_IF_ERROR(Top(top));
        return Push(*top);
      }
      case 'q': TF_RETURN_IF_ERROR(Need(1, op)); return MemoPut(ReadLe(1));
      case 'r': TF_RETURN_IF_ERROR(Need(4, op)); return MemoPut(ReadLe(4));
      case 0x94: return MemoPut(MemoSize());  // MEMOIZE: Python uses len(memo)
      case 'h': TF_RETURN_IF_ERROR(Need(1, op)); return MemoGet(ReadLe(1));
      case 'j': TF_RETURN_IF_ERROR(Need(4, op)); return MemoGet(ReadLe(4));
      case 'c': {
        std::string_view module, name;
        TF_RETURN_IF_ERROR(ReadLine(op, module));
        TF_RETURN_IF_ERROR(ReadLine(op, name));
        return PushGlobal(module, name, "global");
      }
      case 0x93: {  // STACK_GLOBAL
        TF_VM_POP(name);
        TF_VM_POP(module);
        const Object* m = Obj(module, Kind::kStr);
        const Object* n = Obj(name, Kind::kStr);
        if (m == nullptr || n == nullptr) {
          return OpError(op,
                         "module and name must be str, not " + Type(module) + " and " + Type(name));
        }
        // Copies: PushGlobal may grow the arena.
        const std::string ms = m->str, ns = n->str;
        return PushGlobal(ms, ns, "global");
      }
      case 'i': {  // INST: imports and calls in one opcode
        std::string_view module, name;
        TF_RETURN_IF_ERROR(ReadLine(op, module));
        TF_RETURN_IF_ERROR(ReadLine(op, name));
        auto g = Resolve(module, name);
        if (!g.ok()) return RefuseGlobal(module, name, "INST");
        return Fail(Code::kPickleRefusedCall,
                    "refused INST " + Shown(module) + "." + Shown(name) +
                        ": objects are only built through REDUCE of the allowlist");
      }
      case 'o':
        return Fail(Code::kPickleRefusedCall,
                    "refused OBJ: it calls the class below the MARK, which the VM never does");
      case 0x82:
      case 0x83:
      case 0x84: {  // EXT1/2/4
        const unsigned n = op == 0x82 ? 1 : (op == 0x83 ? 2 : 4);
        TF_RETURN_IF_ERROR(Need(n, op));
        const uint64_t code = ReadLe(n);
        return Fail(Code::kPickleRefusedGlobal,
                    "refused global from the copyreg extension registry (" +
                        std::string(OpcodeName(op)) + " code " + std::to_string(code) + ")");
      }
      case 'R': {
        TF_VM_POP(args);
        TF_VM_POP(callable);
        return Call("REDUCE", callable, args);
      }
      case 0x81: {  // NEWOBJ
        TF_VM_POP(args);
        TF_VM_POP(cls);
        return NewObj("NEWOBJ", cls, args);
      }
      case 0x92: {  // NEWOBJ_EX
        TF_VM_POP(kwargs);
        TF_VM_POP(args);
        TF_VM_POP(cls);
        const Object* kw = Obj(kwargs, Kind::kDict);
        if (kw == nullptr || !kw->items.empty()) {
          return Fail(Code::kPickleRefusedCall,
                      "refused NEWOBJ_EX on " + Type(cls) + " with keyword arguments");
        }
        return NewObj("NEWOBJ_EX", cls, args);
      }
      case 'b': {
        TF_VM_POP(state);
        Value* inst = nullptr;
        TF_RETURN_IF_ERROR(Top(inst));
        return Build(*inst, state);
      }
      case 'Q': {
        TF_VM_POP(pid);
        return PersistentLoad(pid);
      }
      default: break;
    }
    const std::string_view name = OpcodeName(op);
    if (name.empty()) {
      return Fail(Code::kPickleUnsupportedOpcode, "unknown opcode " + Hex2(op));
    }
    return Fail(Code::kPickleUnsupportedOpcode,
                "unsupported opcode " + std::string(name) + " (" + Hex2(op) + ")");
  }

  Status PushLong(std::string_view b) {
    if (b.size() <= 8) {
      uint64_t v = 0;
      for (size_t i = 0; i < b.size(); ++i) {
        v |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
      }
      if (!b.empty() && b.size() < 8 && (static_cast<uint8_t>(b.back()) & 0x80)) {
        v |= ~uint64_t{0} << (8 * b.size());  // sign-extend
      }
      return Push(Value::Int(static_cast<int64_t>(v)));
    }
    // Wider: fits 64 bits when every byte past the eighth repeats the sign of bit 63.
    const uint8_t sign = (static_cast<uint8_t>(b[7]) & 0x80) ? 0xff : 0x00;
    bool fits = true;
    for (size_t i = 8; i < b.size(); ++i) fits = fits && static_cast<uint8_t>(b[i]) == sign;
    if (fits) return PushLong(b.substr(0, 8));
    return PushString(Kind::kBigInt, b);
  }

  // APPEND(S), ADDITEMS, SETITEM(S): adds to the container on top of the stack.
  Status Extend(uint8_t op, std::span<const Value> items) {
    Value* target = nullptr;
    TF_RETURN_IF_ERROR(Top(target));
    const bool wants_list = op == 'a' || op == 'e';
    const bool wants_set = op == 0x90;
    const Kind kind = wants_list ? Kind::kList : (wants_set ? Kind::kSet : Kind::kDict);
    Object* o = Obj(*target, kind);
    if (o == nullptr) {
      return OpError(op, "expects a " +
                             std::string(wants_list ? "list" : (wants_set ? "set" : "dict")) +
                             " below its operands, found " + Type(*target));
    }
    if (o->items.size() + items.size() > limits_.max_container) {
      return Limit("max_container", limits_.max_container);
    }
    TF_RETURN_IF_ERROR(CountItems(items.size()));
    o->items.insert(o->items.end(), items.begin(), items.end());
    return Status::Ok();
  }

  // --- the allowlist --------------------------------------------------------------------------
  struct Resolved {
    GlobalId id;
    uint8_t dtype = 0;
    bool untyped = false;
  };

  static Result<Resolved> Resolve(std::string_view module, std::string_view name) {
    if (module == "collections" && name == "OrderedDict") return Resolved{GlobalId::kOrderedDict};
    if (module == "torch._utils") {
      if (name == "_rebuild_tensor") return Resolved{GlobalId::kRebuildTensor};
      if (name == "_rebuild_tensor_v2") return Resolved{GlobalId::kRebuildTensorV2};
      if (name == "_rebuild_tensor_v3") return Resolved{GlobalId::kRebuildTensorV3};
      if (name == "_rebuild_parameter") return Resolved{GlobalId::kRebuildParameter};
      if (name == "_rebuild_parameter_with_state") {
        return Resolved{GlobalId::kRebuildParameterWithState};
      }
    }
    if (module == "torch") {
      if (name == "Size") return Resolved{GlobalId::kTorchSize};
      if (name == "UntypedStorage") return Resolved{GlobalId::kStorageType, kUint8Index, true};
      if (auto d = TorchDtypeByStorageName(name)) return Resolved{GlobalId::kStorageType, *d};
      if (auto d = TorchDtypeByName(name)) return Resolved{GlobalId::kTorchDtype, *d};
    }
    if (module == "torch.storage" && name == "UntypedStorage") {
      return Resolved{GlobalId::kStorageType, kUint8Index, true};
    }
    if (module == "_codecs" && name == "encode") return Resolved{GlobalId::kCodecsEncode};
    if (module == "builtins" || module == "__builtin__") {
      if (name == "set") return Resolved{GlobalId::kBuiltinSet};
      if (name == "frozenset") return Resolved{GlobalId::kBuiltinFrozenSet};
      if (name == "bytes") return Resolved{GlobalId::kBuiltinBytes};
      if (name == "bytearray") return Resolved{GlobalId::kBuiltinByteArray};
    }
    return Status(Code::kPickleRefusedGlobal, "");
  }

  // A module or class name as a message shows it: its first 200 bytes (cut at a UTF-8 character),
  // then its length; a pickle may name a global of megabytes.
  static std::string Shown(std::string_view s) {
    constexpr size_t kMax = 200;
    if (s.size() <= kMax) return std::string(s);
    size_t cut = kMax;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
    return std::string(s.substr(0, cut)) + "... (" + std::to_string(s.size()) + " bytes)";
  }

  Status RefuseGlobal(std::string_view module, std::string_view name, std::string_view how) {
    return Fail(Code::kPickleRefusedGlobal,
                "refused " + std::string(how) + " " + Shown(module) + "." + Shown(name));
  }

  Status PushGlobal(std::string_view module, std::string_view name, std::string_view how) {
    auto g = Resolve(module, name);
    if (!g.ok()) return RefuseGlobal(module, name, how);
    TF_ASSIGN_OR_RETURN(const uint32_t ref, NewObject(Kind::kGlobal));
    Object& o = r_.objects[ref];
    o.global = g->id;
    o.dtype = g->dtype;
    o.untyped = g->untyped;
    o.str.assign(module);
    o.str += ".";
    o.str.append(name);
    return Push(Value::Ref(ref));
  }

  Status RefuseCall(std::string_view how, const Value& callable, const std::string& why) {
    return Fail(Code::kPickleRefusedCall,
                "refused " + std::string(how) + " of " + Type(callable) + ": " + why);
  }

  // REDUCE: callable(*args), for the allowlisted callables only.
  Status Call(std::string_view how, const Value& callable, const Value& args_value) {
    const Object* g = Obj(callable, Kind::kGlobal);
    if (g == nullptr) return RefuseCall(how, callable, "only allowlisted globals are called");
    const Object* args_obj = Obj(args_value, Kind::kTuple);
    if (args_obj == nullptr) {
      return RefuseCall(how, callable, "arguments must be a tuple, not " + Type(args_value));
    }
    // No allowlisted callable takes more than 8 arguments; refused before anything is copied.
    if (args_obj->items.size() > 8) {
      return RefuseCall(how, callable,
                        "takes at most 8 arguments, got " + std::to_string(args_obj->items.size()));
    }
    const std::vector<Value> args = args_obj->items;  // copy: the arena may grow below
    switch (g->global) {
      case GlobalId::kOrderedDict: return MakeOrderedDict(how, callable, args);
      case GlobalId::kRebuildTensor:
      case GlobalId::kRebuildTensorV2:
      case GlobalId::kRebuildTensorV3: return RebuildTensor(g->global, callable, args);
      case GlobalId::kRebuildParameter:
      case GlobalId::kRebuildParameterWithState:
        return RebuildParameter(how, callable, g->global, args);
      case GlobalId::kTorchSize: return MakeTorchSize(how, callable, args);
      case GlobalId::kCodecsEncode: return CodecsEncode(how, callable, args);
      case GlobalId::kBuiltinSet:
      case GlobalId::kBuiltinFrozenSet: return MakeSet(how, callable, g->global, args);
      case GlobalId::kBuiltinBytes:
      case GlobalId::kBuiltinByteArray: return MakeBytes(how, callable, g->global, args);
      case GlobalId::kStorageType:
      case GlobalId::kTorchDtype:
        return RefuseCall(how, callable, "storage classes and dtypes are values, never called");
    }
    return RefuseCall(how, callable, "not callable");
  }

  // torch._utils._rebuild_parameter(data, requires_grad, backward_hooks[, state]): marks the
  // tensor as a parameter and pushes it.
  Status RebuildParameter(std::string_view how, const Value& callable, GlobalId id,
                          const std::vector<Value>& args) {
    const size_t want = id == GlobalId::kRebuildParameter ? 3 : 4;
    if (args.size() != want) {
      return RefuseCall(
          how, callable,
          "expects " + std::to_string(want) + " arguments, got " + std::to_string(args.size()));
    }
    Object* t = Obj(args[0], Kind::kTensor);
    if (t == nullptr)
      return RefuseCall(how, callable, "data must be a tensor, not " + Type(args[0]));
    if (args[1].tag != Tag::kBool) {
      return RefuseCall(how, callable, "requires_grad must be a bool, not " + Type(args[1]));
    }
    TF_RETURN_IF_ERROR(CheckHooks(callable, args[2]));
    r_.tensors[t->index].parameter = true;
    return Push(args[0]);
  }

  // torch.Size(tuple or list of ints): pushes a tuple marked torch_size.
  Status MakeTorchSize(std::string_view how, const Value& callable,
                       const std::vector<Value>& args) {
    if (args.size() != 1) return RefuseCall(how, callable, "expects one argument");
    const Object* dims = Obj(args[0], Kind::kTuple);
    if (dims == nullptr) dims = Obj(args[0], Kind::kList);
    if (dims == nullptr) return RefuseCall(how, callable, "expects a tuple of ints");
    TF_RETURN_IF_ERROR(CountCopied(dims->items.size()));
    std::vector<Value> items = dims->items;
    for (const Value& v : items) {
      if (v.tag != Tag::kInt) return RefuseCall(how, callable, "expects a tuple of ints");
    }
    TF_RETURN_IF_ERROR(PushObject(Kind::kTuple, std::move(items)));
    r_.objects[stack_.back().ref].torch_size = true;
    return Status::Ok();
  }

  // _codecs.encode(str, 'latin1'): pushes the bytes of a str whose characters are all <= U+00FF.
  Status CodecsEncode(std::string_view how, const Value& callable, const std::vector<Value>& args) {
    if (args.size() != 2) return RefuseCall(how, callable, "expects (str, 'latin1')");
    std::string bytes;
    TF_RETURN_IF_ERROR(Latin1(how, callable, args[0], args[1], bytes));
    return PushString(Kind::kBytes, bytes);
  }

  // The bytes of `text` encoded as latin1 (`encoding` naming it), for encode(str, 'latin1').
  Status Latin1(std::string_view how, const Value& callable, const Value& text_value,
                const Value& encoding, std::string& bytes) {
    const Object* text = Obj(text_value, Kind::kStr);
    const Object* enc = Obj(encoding, Kind::kStr);
    if (text == nullptr || enc == nullptr || (enc->str != "latin1" && enc->str != "latin-1")) {
      return RefuseCall(how, callable, "only encode(str, 'latin1') is emulated");
    }
    TF_RETURN_IF_ERROR(CountCopied(text->str.size()));
    const std::string& s = text->str;  // valid UTF-8 (checked when read)
    for (size_t i = 0; i < s.size();) {
      const auto c = static_cast<uint8_t>(s[i]);
      if (c < 0x80) {
        bytes.push_back(static_cast<char>(c));
        i += 1;
      } else if (c == 0xC2 || c == 0xC3) {  // U+0080..U+00FF (C4..DF lead U+0100..U+07FF)
        bytes.push_back(
            static_cast<char>(((c & 0x1F) << 6) | (static_cast<uint8_t>(s[i + 1]) & 0x3F)));
        i += 2;
      } else {
        return RefuseCall(how, callable, "a character above U+00FF is not latin1");
      }
    }
    return Status::Ok();
  }

  // set(items) and frozenset(items) of a list, tuple, set or frozenset; set() and frozenset().
  Status MakeSet(std::string_view how, const Value& callable, GlobalId id,
                 const std::vector<Value>& args) {
    std::vector<Value> items;
    if (args.size() > 1) return RefuseCall(how, callable, "expects at most one argument");
    if (args.size() == 1) {
      const Object* from = nullptr;
      for (const Kind k : {Kind::kList, Kind::kTuple, Kind::kSet, Kind::kFrozenSet}) {
        if (from == nullptr) from = Obj(args[0], k);
      }
      if (from == nullptr) {
        return RefuseCall(how, callable,
                          "expects a list, tuple, set or frozenset, not " + Type(args[0]));
      }
      TF_RETURN_IF_ERROR(CountCopied(from->items.size()));
      items = from->items;
    }
    return PushObject(id == GlobalId::kBuiltinSet ? Kind::kSet : Kind::kFrozenSet,
                      std::move(items));
  }

  // bytes() and bytearray() of nothing, of bytes, or of (str, 'latin1') as protocol 2 pickles
  // them; bytearray's keep that they are one (their repr).
  Status MakeBytes(std::string_view how, const Value& callable, GlobalId id,
                   const std::vector<Value>& args) {
    std::string bytes;
    if (args.size() == 1) {
      const Object* from = Obj(args[0], Kind::kBytes);
      if (from == nullptr) return RefuseCall(how, callable, "expects bytes, not " + Type(args[0]));
      TF_RETURN_IF_ERROR(CountCopied(from->str.size()));
      bytes = from->str;
    } else if (args.size() == 2) {
      TF_RETURN_IF_ERROR(Latin1(how, callable, args[0], args[1], bytes));
    } else if (!args.empty()) {
      return RefuseCall(how, callable, "expects (), (bytes,) or (str, 'latin1')");
    }
    TF_RETURN_IF_ERROR(PushString(Kind::kBytes, bytes));
    r_.objects[stack_.back().ref].bytearray = id == GlobalId::kBuiltinByteArray;
    return Status::Ok();
  }

  Status MakeOrderedDict(std::string_view how, const Value& callable,
                         const std::vector<Value>& args) {
    std::vector<Value> items;
    if (args.size() == 1) {
      const Object* pairs = Obj(args[0], Kind::kList);
      if (pairs == nullptr) pairs = Obj(args[0], Kind::kTuple);
      if (pairs == nullptr)
        return RefuseCall(how, callable, "expects a list of (key, value) pairs");
      TF_RETURN_IF_ERROR(CountCopied(2 * pairs->items.size()));
      for (const Value& p : pairs->items) {
        const Object* kv = Obj(p, Kind::kTuple);
        if (kv == nullptr) kv = Obj(p, Kind::kList);
        if (kv == nullptr || kv->items.size() != 2) {
          return RefuseCall(how, callable, "expects a list of (key, value) pairs");
        }
        items.push_back(kv->items[0]);
        items.push_back(kv->items[1]);
      }
    } else if (!args.empty()) {
      return RefuseCall(how, callable, "expects no argument or a list of pairs");
    }
    TF_RETURN_IF_ERROR(PushObject(Kind::kDict, std::move(items)));
    r_.objects[stack_.back().ref].ordered = true;
    return Status::Ok();
  }

  Status NewObj(std::string_view how, const Value& cls, const Value& args) {
    const Object* g = Obj(cls, Kind::kGlobal);
    if (g == nullptr || g->global != GlobalId::kOrderedDict) {
      return RefuseCall(how, cls, "only collections.OrderedDict is instantiated");
    }
    const Object* a = Obj(args, Kind::kTuple);
    if (a == nullptr || !a->items.empty()) {
      return RefuseCall(how, cls, "expects an empty argument tuple");
    }
    return MakeOrderedDict(how, cls, {});
  }

  // BUILD: only an OrderedDict's attributes (torch's state_dict._metadata), which are dropped.
  Status Build(const Value& inst, const Value& state) {
    const Object* d = Obj(inst, Kind::kDict);
    if (d == nullptr || !d->ordered) {
      return Fail(Code::kPickleRefusedCall,
                  "refused BUILD on " + Type(inst) + ": only OrderedDict attributes are accepted");
    }
    if (state.tag != Tag::kNone && Obj(state, Kind::kDict) == nullptr) {
      return Fail(Code::kPickleRefusedCall,
                  "refused BUILD on OrderedDict with a " + Type(state) + " state");
    }
    return Status::Ok();
  }

  Status CheckHooks(const Value& callable, const Value& hooks) {
    if (hooks.tag == Tag::kNone) return Status::Ok();
    const Object* d = Obj(hooks, Kind::kDict);
    if (d == nullptr || !d->items.empty()) {
      return RefuseCall("REDUCE", callable, "backward hooks must be empty, got " + Type(hooks));
    }
    return Status::Ok();
  }

  Status BadTensor(const std::string& what) const { return Fail(Code::kTorchBadTensor, what); }

  Status ReadDims(const Value& callable, const Value& v, std::string_view what,
                  std::vector<uint64_t>& out) {
    const Object* t = Obj(v, Kind::kTuple);
    if (t == nullptr) t = Obj(v, Kind::kList);
    if (t == nullptr) {
      return RefuseCall("REDUCE", callable,
                        std::string(what) + " must be a tuple of ints, not " + Type(v));
    }
    if (t->items.size() > limits_.max_rank) return Limit("max_rank", limits_.max_rank);
    out.clear();
    for (const Value& d : t->items) {
      if (d.tag != Tag::kInt) {
        return RefuseCall("REDUCE", callable,
                          std::string(what) + " must be a tuple of ints, holds " + Type(d));
      }
      if (d.i < 0)
        return BadTensor(std::string(what) + " holds the negative value " + std::to_string(d.i));
      out.push_back(static_cast<uint64_t>(d.i));
    }
    return Status::Ok();
  }

  // Checks the v2/v3 arguments after stride (requires_grad, backward_hooks, dtype, metadata);
  // a v3 dtype replaces t.dtype.
  Status ReadRebuildExtras(GlobalId id, const Value& callable, const std::vector<Value>& args,
                           TensorRecord& t) {
    if (id != GlobalId::kRebuildTensor) {
      if (args[4].tag != Tag::kBool) {
        return RefuseCall("REDUCE", callable, "requires_grad must be a bool, not " + Type(args[4]));
      }
      TF_RETURN_IF_ERROR(CheckHooks(callable, args[5]));
    }
    size_t meta_index = 6;
    if (id == GlobalId::kRebuildTensorV3) {
      const Object* d = Obj(args[6], Kind::kGlobal);
      if (d == nullptr || d->global != GlobalId::kTorchDtype) {
        return RefuseCall("REDUCE", callable, "dtype must be a torch dtype, not " + Type(args[6]));
      }
      t.dtype = d->dtype;
      meta_index = 7;
    }
    if (args.size() > meta_index) {
      const Value& meta = args[meta_index];
      const Object* d = Obj(meta, Kind::kDict);
      if (meta.tag != Tag::kNone && (d == nullptr || !d->items.empty())) {
        return RefuseCall("REDUCE", callable,
                          "tensor metadata (conjugate or negative bits, ...) is not supported");
      }
    }
    return Status::Ok();
  }

  // Checks that the (non-empty) view t lies inside storage st, without 64-bit overflow.
  Status CheckViewInStorage(const TensorRecord& t, const StorageRecord& st) const {
    const uint64_t elem = kTorchDtypes[t.dtype].element_size;
    bool empty = false;
    uint64_t last = t.offset;
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (t.shape[i] == 0) empty = true;
    }
    if (!empty) {
      for (size_t i = 0; i < t.shape.size(); ++i) {
        uint64_t step;
        if (__builtin_mul_overflow(t.shape[i] - 1, t.stride[i], &step) ||
            __builtin_add_overflow(last, step, &last)) {
          return BadTensor("the view's extent overflows 64 bits");
        }
      }
      uint64_t end_bytes;
      if (__builtin_add_overflow(last, uint64_t{1}, &end_bytes) ||
          __builtin_mul_overflow(end_bytes, elem, &end_bytes)) {
        return BadTensor("the view's extent overflows 64 bits");
      }
      if (end_bytes > st.nbytes) {
        return BadTensor("a view of storage " + json::Quote(st.key) + " (" +
                         std::to_string(st.nbytes) + " bytes) reaches byte " +
                         std::to_string(end_bytes) + " (offset " + std::to_string(t.offset) +
                         " elements of " + std::to_string(elem) + " bytes)");
      }
    }
    return Status::Ok();
  }

  // _rebuild_tensor(storage, offset, size, stride)
  // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks[, metadata])
  // _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, backward_hooks, dtype[,
  //                    metadata])
  Status RebuildTensor(GlobalId id, const Value& callable, const std::vector<Value>& args) {
    const size_t min =
        id == GlobalId::kRebuildTensor ? 4 : (id == GlobalId::kRebuildTensorV2 ? 6 : 7);
    const size_t max = id == GlobalId::kRebuildTensor ? 4 : min + 1;
    if (args.size() < min || args.size() > max) {
      return RefuseCall("REDUCE", callable,
                        "expects " + std::to_string(min) +
                            (max > min ? " or " + std::to_string(max) : "") + " arguments, got " +
                            std::to_string(args.size()));
    }
    const Object* storage = Obj(args[0], Kind::kStorage);
    if (storage == nullptr) {
      return RefuseCall("REDUCE", callable,
                        "storage must be a persistent storage, not " + Type(args[0]));
    }
    if (args[1].tag != Tag::kInt) {
      return RefuseCall("REDUCE", callable, "storage_offset must be an int, not " + Type(args[1]));
    }
    if (args[1].i < 0) return BadTensor("negative storage offset " + std::to_string(args[1].i));
    TensorRecord t;
    t.storage = storage->index;
    t.offset = static_cast<uint64_t>(args[1].i);
    t.pickle_offset = op_pos_;
    TF_RETURN_IF_ERROR(ReadDims(callable, args[2], "size", t.shape));
    TF_RETURN_IF_ERROR(ReadDims(callable, args[3], "stride", t.stride));
    if (t.shape.size() != t.stride.size()) {
      return BadTensor("size has " + std::to_string(t.shape.size()) + " dimensions but stride " +
                       std::to_string(t.stride.size()));
    }
    const StorageRecord& st = r_.storages[storage->index];
    t.dtype = st.dtype;
    TF_RETURN_IF_ERROR(ReadRebuildExtras(id, callable, args, t));
    TF_RETURN_IF_ERROR(CheckViewInStorage(t, st));
    if (r_.tensors.size() >= limits_.max_objects) return Limit("max_objects", limits_.max_objects);
    TF_RETURN_IF_ERROR(CountItems(t.shape.size() * 2));
    TF_ASSIGN_OR_RETURN(const uint32_t ref, NewObject(Kind::kTensor));
    r_.objects[ref].index = static_cast<uint32_t>(r_.tensors.size());
    r_.tensors.push_back(std::move(t));
    return Push(Value::Ref(ref));
  }

  Status BadPid(const std::string& what) const {
    return Fail(Code::kPickleBadPersistentId, "persistent id " + what);
  }

  Status PersistentLoad(const Value& pid) {
    if (pids_ == PersistentIds::kNone) return BadPid("where none may appear");
    const Object* t = Obj(pid, Kind::kTuple);
    if (t == nullptr) return BadPid("is a " + Type(pid) + ", not a tuple");
    const size_t want = pids_ == PersistentIds::kZip ? 5 : 6;
    if (t->items.size() > want) {
      return BadPid("has " + std::to_string(t->items.size()) + " fields, expected " +
                    std::to_string(want));
    }
    const std::vector<Value> f = t->items;
    const Object* tag = f.empty() ? nullptr : Obj(f[0], Kind::kStr);
    if (tag == nullptr || tag->str != "storage") {
      return BadPid("must start with 'storage' (a " +
                    std::string(pids_ == PersistentIds::kZip ? "zip" : "legacy") +
                    " checkpoint refers to nothing else)");
    }
    if (f.size() != want) {
      return BadPid("has " + std::to_string(f.size()) + " fields, expected " +
                    std::to_string(want));
    }
    const Object* type = Obj(f[1], Kind::kGlobal);
    if (type == nullptr || type->global != GlobalId::kStorageType) {
      return BadPid("storage type must be a torch storage class, not " + Type(f[1]));
    }
    const Object* key = Obj(f[2], Kind::kStr);
    const Object* location = Obj(f[3], Kind::kStr);
    if (key == nullptr || key->str.empty() || location == nullptr) {
      return BadPid("key and location must be non-empty str");
    }
    // torch.save numbers its storages ("0", "1", ...; the legacy format uses ids): a key is
    // short. Bounded, since every reference to a storage looks its key up (a long key memoized
    // once and referenced by every tensor would cost its length each time).
    constexpr size_t kMaxStorageKey = 1024;
    if (key->str.size() > kMaxStorageKey) {
      return BadPid("storage key of " + std::to_string(key->str.size()) + " bytes, more than " +
                    std::to_string(kMaxStorageKey));
    }
    if (f[4].tag != Tag::kInt || f[4].i < 0) return BadPid("numel must be a non-negative int");
    if (want == 6 && f[5].tag != Tag::kNone) {
      return BadPid("has view metadata (storage views of torch < 0.4 are not supported)");
    }
    const auto numel = static_cast<uint64_t>(f[4].i);
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, uint64_t{kTorchDtypes[type->dtype].element_size}, &nbytes)) {
      return BadPid("numel " + std::to_string(numel) + " overflows 64 bits in bytes");
    }
    auto it = storage_by_key_.find(key->str);
    if (it != storage_by_key_.end()) {
      const StorageRecord& s = r_.storages[r_.objects[it->second].index];
      if (s.dtype != type->dtype || s.untyped != type->untyped || s.numel != numel) {
        return BadPid("reuses storage key " + json::Quote(key->str) + " with another type or size");
      }
      return Push(Value::Ref(it->second));
    }
    StorageRecord s;
    s.key = key->str;
    s.location = location->str;
    s.dtype = type->dtype;
    s.untyped = type->untyped;
    s.numel = numel;
    s.nbytes = nbytes;
    s.pickle_offset = op_pos_;
    TF_ASSIGN_OR_RETURN(const uint32_t ref, NewObject(Kind::kStorage));
    r_.objects[ref].index = static_cast<uint32_t>(r_.storages.size());
    r_.storages.push_back(std::move(s));
    storage_by_key_.emplace(r_.storages.back().key, ref);
    return Push(Value::Ref(ref));
  }

#undef TF_VM_POP

  const uint8_t* data_;
  uint64_t size_;
  bool limited_;
  const PickleLimits& limits_;
  PersistentIds pids_;
  std::string_view source_;
  uint64_t pos_ = 0;
  uint64_t op_pos_ = 0;
  std::vector<Value> stack_;
  std::vector<size_t> marks_;
  // The memo: keys 0 .. n-1 in a vector (16 bytes a key: pickles memoize in order, and a map's
  // ~64 bytes a key let a 16 MB pickle of MEMOIZEs take a GB), other keys in a map.
  std::vector<Value> memo_dense_;
  std::map<uint64_t, Value> memo_sparse_;
  uint64_t total_items_ = 0;
  uint64_t copied_ = 0;  // CountCopied
  std::map<std::string, uint32_t, std::less<>> storage_by_key_;
  PickleResult r_;
};

}  // namespace

std::string PyTypeName(const PickleResult& r, const Value& v) {
  switch (v.tag) {
    case Tag::kNone: return "NoneType";
    case Tag::kBool: return "bool";
    case Tag::kInt: return "int";
    case Tag::kFloat: return "float";
    case Tag::kRef: break;
  }
  const Object& o = r.objects[v.ref];
  switch (o.kind) {
    case Kind::kStr: return "str";
    case Kind::kBytes: return o.bytearray ? "bytearray" : "bytes";
    case Kind::kBigInt: return "int beyond 64 bits";  // "must be an int, not int" otherwise
    case Kind::kTuple: return o.torch_size ? "Size" : "tuple";
    case Kind::kList: return "list";
    case Kind::kDict: return o.ordered ? "OrderedDict" : "dict";
    case Kind::kSet: return "set";
    case Kind::kFrozenSet: return "frozenset";
    case Kind::kGlobal:
      if (o.global == GlobalId::kTorchDtype) return "dtype";
      return o.global == GlobalId::kCodecsEncode || o.global == GlobalId::kRebuildTensor ||
                     o.global == GlobalId::kRebuildTensorV2 ||
                     o.global == GlobalId::kRebuildTensorV3 ||
                     o.global == GlobalId::kRebuildParameter ||
                     o.global == GlobalId::kRebuildParameterWithState
                 ? "function"
                 : "type";
    case Kind::kStorage: return "storage";
    case Kind::kTensor: return "Tensor";
  }
  return "object";
}

Result<PickleResult> RunPickle(std::span<const std::byte> bytes, const PickleLimits& limits,
                               PersistentIds persistent_ids, std::string_view source) {
  Vm vm(bytes, limits, persistent_ids, source);
  return vm.Run();
}

}  // namespace tensorferry::convert
