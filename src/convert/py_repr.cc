#include "convert/py_repr.h"

#include <string_view>
#include <vector>

namespace tensorferry::convert {

std::optional<std::string> PyKeyText(const PickleResult& r, const Value& v) {
  switch (v.tag) {
    case Tag::kNone: return "None";
    case Tag::kBool: return v.b ? "True" : "False";
    case Tag::kInt: return std::to_string(v.i);
    case Tag::kFloat: return PythonFloatRepr(v.f);
    case Tag::kRef: break;
  }
  const Object& o = r.objects[v.ref];
  if (o.kind == Kind::kStr) return o.str;
  if (o.kind == Kind::kBigInt) return BigIntToDecimal(o.str);
  return std::nullopt;
}

std::vector<uint8_t> HoldersOfTensorsOrDicts(const PickleResult& r) {
  const auto is_seq = [](Kind k) {
    return k == Kind::kList || k == Kind::kTuple || k == Kind::kSet || k == Kind::kFrozenSet;
  };
  // Reverse edges (item -> containing sequence) as a CSR table, then a walk up from every tensor
  // and dict.
  const size_t n = r.objects.size();
  std::vector<uint32_t> start(n + 1, 0);
  for (const Object& o : r.objects) {
    if (!is_seq(o.kind)) continue;
    for (const Value& item : o.items) {
      if (item.tag == Tag::kRef) ++start[item.ref + 1];
    }
  }
  for (size_t i = 0; i < n; ++i) start[i + 1] += start[i];
  std::vector<uint32_t> parents(start[n]);
  std::vector<uint32_t> fill(start.begin(), start.end() - 1);
  for (uint32_t c = 0; c < n; ++c) {
    if (!is_seq(r.objects[c].kind)) continue;
    for (const Value& item : r.objects[c].items) {
      if (item.tag == Tag::kRef) parents[fill[item.ref]++] = c;
    }
  }
  std::vector<uint8_t> holds(n, 0);
  std::vector<uint32_t> todo;
  for (uint32_t i = 0; i < n; ++i) {
    if (r.objects[i].kind == Kind::kTensor || r.objects[i].kind == Kind::kDict) todo.push_back(i);
  }
  while (!todo.empty()) {
    const uint32_t i = todo.back();
    todo.pop_back();
    for (uint32_t k = start[i]; k < start[i + 1]; ++k) {
      const uint32_t p = parents[k];
      if (!holds[p]) {
        holds[p] = 1;
        todo.push_back(p);
      }
    }
  }
  return holds;
}

namespace {

// CPython's repr of str and bytes: single quotes unless the text has a single quote and no double
// quote; \n \r \t and the quote escaped; other control bytes (and, for bytes, every byte from
// 0x7f up; for str only 0x7f, as UTF-8 text is printable) as \xNN.
std::string QuotedRepr(const std::string& s, std::string_view prefix, bool escape_high) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(prefix);
  out.push_back(q);
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == q || ch == '\\') {
      out.push_back('\\');
      out.push_back(ch);
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f || (escape_high && c > 0x7f)) {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    } else {
      out.push_back(ch);
    }
  }
  out.push_back(q);
  return out;
}

}  // namespace

std::string PyStringRepr(const std::string& s) {
  return QuotedRepr(s, "", false);
}

namespace {

std::string BytesRepr(const std::string& s) {
  return QuotedRepr(s, "b", true);
}

class Printer {
 public:
  Printer(const PickleResult& r, uint32_t max_depth, size_t max_text)
      : r_(r), max_depth_(max_depth), max_text_(max_text) {}

  bool Repr(const Value& v, uint32_t depth, std::string& out) {
    if (out.size() > max_text_) {
      why_ = "its text is longer than " + std::to_string(max_text_) + " bytes";
      return false;
    }
    switch (v.tag) {
      case Tag::kNone: out += "None"; return true;
      case Tag::kBool: out += v.b ? "True" : "False"; return true;
      case Tag::kInt: out += std::to_string(v.i); return true;
      case Tag::kFloat: out += PythonFloatRepr(v.f); return true;
      case Tag::kRef: break;
    }
    const Object& o = r_.objects[v.ref];
    switch (o.kind) {
      case Kind::kStr: out += PyStringRepr(o.str); return true;
      case Kind::kBytes:
        if (o.bytearray) {
          out += "bytearray(" + BytesRepr(o.str) + ")";
        } else {
          out += BytesRepr(o.str);
        }
        return true;
      case Kind::kBigInt: out += BigIntToDecimal(o.str); return true;
      case Kind::kGlobal: out += GlobalText(o); return true;
      case Kind::kStorage: why_ = "a storage outside any tensor is not converted"; return false;
      case Kind::kTensor: why_ = "a tensor inside a value"; return false;
      default: break;
    }
    if (depth >= max_depth_) {
      why_ = "nested deeper than TorchLimits::max_depth (" + std::to_string(max_depth_) +
             "), or contains itself";
      return false;
    }
    const char* open = "(";
    const char* close = ")";
    std::string empty;
    switch (o.kind) {
      case Kind::kTuple:
        if (o.torch_size) {
          open = "torch.Size([";
          close = "])";
        }
        break;
      case Kind::kList:
        open = "[";
        close = "]";
        break;
      case Kind::kSet:
        open = "{";
        close = "}";
        empty = "set()";
        break;
      case Kind::kFrozenSet:
        open = "frozenset({";
        close = "})";
        empty = "frozenset()";
        break;
      case Kind::kDict:
        open = o.ordered ? "OrderedDict({" : "{";
        close = o.ordered ? "})" : "}";
        empty = o.ordered ? "OrderedDict()" : "{}";
        break;
      default: break;
    }
    if (o.items.empty() && !empty.empty()) {
      out += empty;
      return true;
    }
    out += open;
    const bool dict = o.kind == Kind::kDict;
    for (size_t i = 0; i < o.items.size(); ++i) {
      if (i > 0) out += (dict && i % 2 == 1) ? ": " : ", ";
      if (!Repr(o.items[i], depth + 1, out)) return false;
    }
    if (o.kind == Kind::kTuple && !o.torch_size && o.items.size() == 1) out += ",";
    out += close;
    return true;
  }

  std::string why_;

 private:
  static std::string GlobalText(const Object& o) {
    switch (o.global) {
      case GlobalId::kTorchDtype: return "torch." + std::string(TorchDtypes()[o.dtype].name);
      case GlobalId::kStorageType:
      case GlobalId::kOrderedDict:
      case GlobalId::kTorchSize: return "<class '" + o.str + "'>";
      case GlobalId::kBuiltinSet:
      case GlobalId::kBuiltinFrozenSet:
      case GlobalId::kBuiltinBytes:
      case GlobalId::kBuiltinByteArray:  // "builtins.set" or "__builtin__.set": <class 'set'>
        return "<class '" + o.str.substr(o.str.find('.') + 1) + "'>";
      default: return "<function " + o.str + ">";
    }
  }

  const PickleResult& r_;
  uint32_t max_depth_;
  size_t max_text_;
};

}  // namespace

std::optional<std::string> PyStr(const PickleResult& r, const Value& v, uint32_t max_depth,
                                 std::string& why, size_t max_text, size_t* produced) {
  const std::string too_long = "its text is longer than " + std::to_string(max_text) + " bytes";
  if (v.tag == Tag::kRef && r.objects[v.ref].kind == Kind::kStr) {
    const std::string& s = r.objects[v.ref].str;
    if (produced != nullptr) *produced = s.size();
    if (s.size() > max_text) {
      why = too_long;
      return std::nullopt;
    }
    return s;
  }
  Printer p(r, max_depth, max_text);
  std::string out;
  const bool ok = p.Repr(v, 0, out);
  if (produced != nullptr) *produced = out.size();
  if (!ok || out.size() > max_text) {
    why = p.why_.empty() ? too_long : p.why_;
    return std::nullopt;
  }
  return out;
}

}  // namespace tensorferry::convert
