#include "objstore/s3_xml.h"

#include <algorithm>
#include <utility>

#include "util/decimal.h"

namespace tensorferry::objstore {
namespace {

struct Element {
  std::string name;
  std::string text;  // the element's own text (unescaped), children's excluded
  std::vector<Element> children;

  const Element* Child(std::string_view child_name) const {
    for (const Element& child : children) {
      if (child.name == child_name) return &child;
    }
    return nullptr;
  }
};

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == ':' || c == '.' || c == '-' || static_cast<unsigned char>(c) >= 0x80;
}

// A recursive-descent scanner over one document. Every read is bounds-checked against s_; the
// first failure is kept in error_.
class Scanner {
 public:
  explicit Scanner(std::string_view s) : s_(s) {}

  // The root element, or nullopt with error() set.
  std::optional<Element> Document() {
    Element root;
    if (!Root(root)) return std::nullopt;
    return root;
  }
  const std::string& error() const { return error_; }

 private:
  bool Fail(std::string_view what) {
    if (error_.empty()) error_ = std::string(what) + " at byte " + std::to_string(pos_);
    return false;
  }
  bool StartsWith(std::string_view prefix) const { return s_.substr(pos_).starts_with(prefix); }
  // Moves past the next `end`, or fails.
  bool SkipPast(std::string_view end, std::string_view what) {
    const size_t at = s_.find(end, pos_);
    if (at == std::string_view::npos) return Fail(std::string("unterminated ") + std::string(what));
    pos_ = at + end.size();
    return true;
  }
  void SkipSpace() {
    while (pos_ < s_.size() && IsSpace(s_[pos_])) ++pos_;
  }
  // Whitespace, comments and processing instructions (the prolog) outside the root.
  bool SkipMisc() {
    for (;;) {
      SkipSpace();
      if (StartsWith("<!--")) {
        if (!SkipPast("-->", "comment")) return false;
      } else if (StartsWith("<?")) {
        if (!SkipPast("?>", "processing instruction")) return false;
      } else {
        return true;
      }
    }
  }
  std::string_view Name() {
    const size_t start = pos_;
    while (pos_ < s_.size() && IsNameChar(s_[pos_])) ++pos_;
    return s_.substr(start, pos_ - start);
  }
  // After the element's name: attributes, then "/>" (sets *empty) or ">".
  bool StartTagRest(bool* empty) {
    for (;;) {
      SkipSpace();
      if (pos_ >= s_.size()) return Fail("unterminated start tag");
      if (StartsWith("/>") || s_[pos_] == '>') {
        *empty = s_[pos_] == '/';
        pos_ += *empty ? 2 : 1;
        return true;
      }
      if (Name().empty()) return Fail("unexpected character in a start tag");
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '=') return Fail("attribute without '='");
      ++pos_;
      SkipSpace();
      if (pos_ >= s_.size() || (s_[pos_] != '"' && s_[pos_] != '\'')) {
        return Fail("attribute value without quotes");
      }
      const char quote = s_[pos_++];
      if (!SkipPast(std::string_view(&quote, 1), "attribute value")) return false;
    }
  }
  bool EndTag(const Element& e) {
    pos_ += 2;  // "</"
    if (Name() != e.name) return Fail("end tag does not match <" + e.name + ">");
    SkipSpace();
    if (pos_ >= s_.size() || s_[pos_] != '>') return Fail("unterminated end tag");
    ++pos_;
    return true;
  }
  bool Root(Element& root) {
    if (s_.size() > kMaxXmlBodySize) return Fail("larger than 16 MiB");
    if (s_.starts_with("\xEF\xBB\xBF")) pos_ = 3;
    if (!SkipMisc()) return false;
    if (pos_ >= s_.size() || s_[pos_] != '<') return Fail("no root element");
    if (!ParseElement(root, 1) || !SkipMisc()) return false;
    if (pos_ != s_.size()) return Fail("bytes after the root element");
    return true;
  }
  bool Content(Element& e, int depth);
  bool ParseElement(Element& e, int depth);

  std::string_view s_;
  size_t pos_ = 0;
  size_t elements_ = 0;
  std::string error_;
};

bool Scanner::ParseElement(Element& e, int depth) {
  if (depth > kMaxXmlDepth) return Fail("elements nested too deeply");
  if (++elements_ > kMaxXmlElements) return Fail("too many elements");
  ++pos_;  // '<'
  e.name = std::string(Name());
  if (e.name.empty()) return Fail("a '<' not followed by an element name");
  bool empty = false;
  if (!StartTagRest(&empty)) return false;
  return empty || Content(e, depth);
}

bool Scanner::Content(Element& e, int depth) {
  for (;;) {
    if (pos_ >= s_.size()) return Fail("unexpected end of the body inside <" + e.name + ">");
    if (s_[pos_] != '<') {
      const size_t end = std::min(s_.find('<', pos_), s_.size());
      e.text += XmlUnescape(s_.substr(pos_, end - pos_));
      pos_ = end;
    } else if (StartsWith("</")) {
      return EndTag(e);
    } else if (StartsWith("<!--")) {
      if (!SkipPast("-->", "comment")) return false;
    } else if (StartsWith("<![CDATA[")) {
      const size_t start = pos_ + 9;
      if (!SkipPast("]]>", "CDATA section")) return false;
      e.text += s_.substr(start, pos_ - 3 - start);
    } else if (StartsWith("<?")) {
      if (!SkipPast("?>", "processing instruction")) return false;
    } else {
      e.children.emplace_back();
      if (!ParseElement(e.children.back(), depth + 1)) return false;
    }
  }
}

std::optional<uint64_t> ParseU64(std::string_view s) {
  return ParseDecimal(Trim(s));
}

Status ListError(std::string_view problem) {
  return Status(Code::kInvalidArgument, "ListObjectsV2 response: " + std::string(problem));
}

Result<ListedObject> ParseContents(const Element& contents, size_t index) {
  const std::string where = "<Contents> #" + std::to_string(index + 1);
  const Element* key = contents.Child("Key");
  if (key == nullptr) return ListError(where + " has no <Key>");
  ListedObject object;
  object.key = key->text;
  const Element* size = contents.Child("Size");
  if (size == nullptr) return ListError(where + " (key \"" + object.key + "\") has no <Size>");
  const auto value = ParseU64(size->text);
  if (!value) {
    return ListError(where + " (key \"" + object.key + "\") has a <Size> that is not a number: \"" +
                     size->text.substr(0, 64) + "\"");
  }
  object.size = *value;
  if (const Element* etag = contents.Child("ETag")) object.etag = std::string(Trim(etag->text));
  return object;
}

Status AddChild(ListPage& page, const Element& child) {
  if (child.name == "Contents") {
    auto object = ParseContents(child, page.objects.size());
    if (!object.ok()) return object.status();
    page.objects.push_back(std::move(*object));
  } else if (child.name == "CommonPrefixes") {
    for (const Element& prefix : child.children) {
      if (prefix.name == "Prefix") page.common_prefixes.push_back(prefix.text);
    }
  } else if (child.name == "IsTruncated") {
    const std::string_view value = Trim(child.text);
    if (value != "true" && value != "false") {
      return ListError("<IsTruncated> is neither true nor false: \"" +
                       std::string(value.substr(0, 64)) + "\"");
    }
    page.truncated = value == "true";
  } else if (child.name == "NextContinuationToken") {
    page.next_token = child.text;
  }
  return Status::Ok();
}

void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// The code point of a character reference body ("#65", "#x41"), or nullopt when it is not a
// valid, non-NUL, non-surrogate one.
std::optional<uint32_t> CharacterReference(std::string_view ref) {
  const bool hex = ref.size() > 1 && (ref[1] == 'x' || ref[1] == 'X');
  const std::string_view digits = ref.substr(hex ? 2 : 1);
  if (digits.empty() || digits.size() > 8) return std::nullopt;
  uint32_t cp = 0;
  for (char c : digits) {
    uint32_t d;
    if (c >= '0' && c <= '9') {
      d = static_cast<uint32_t>(c - '0');
    } else if (hex && c >= 'a' && c <= 'f') {
      d = static_cast<uint32_t>(c - 'a' + 10);
    } else if (hex && c >= 'A' && c <= 'F') {
      d = static_cast<uint32_t>(c - 'A' + 10);
    } else {
      return std::nullopt;
    }
    cp = cp * (hex ? 16 : 10) + d;
    if (cp > 0x10FFFF) return std::nullopt;
  }
  if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) return std::nullopt;
  return cp;
}

}  // namespace

std::string XmlUnescape(std::string_view s) {
  static constexpr std::pair<std::string_view, char> kNamed[] = {
      {"amp", '&'}, {"lt", '<'}, {"gt", '>'}, {"quot", '"'}, {"apos", '\''}};
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const size_t amp = s.find('&', i);
    out += s.substr(i, amp == std::string_view::npos ? std::string_view::npos : amp - i);
    if (amp == std::string_view::npos) break;
    i = amp + 1;
    const size_t semi = s.find(';', i);
    // The longest reference we decode, "#x0010FFFF", has 10 characters.
    if (semi == std::string_view::npos || semi - i > 10) {
      out += '&';
      continue;
    }
    const std::string_view ref = s.substr(i, semi - i);
    bool decoded = false;
    for (const auto& [name, c] : kNamed) {
      if (ref == name) {
        out += c;
        decoded = true;
      }
    }
    if (!decoded && !ref.empty() && ref[0] == '#') {
      if (auto cp = CharacterReference(ref)) {
        AppendUtf8(out, *cp);
        decoded = true;
      }
    }
    if (decoded) {
      i = semi + 1;
    } else {
      out += '&';
    }
  }
  return out;
}

std::optional<S3ErrorBody> ParseS3Error(std::string_view body) {
  Scanner scanner(body);
  const std::optional<Element> root = scanner.Document();
  if (!root) return std::nullopt;
  const Element* error = root->name == "Error" ? &*root : nullptr;
  if (root->name == "ErrorResponse") error = root->Child("Error");
  if (error == nullptr) return std::nullopt;
  const Element* code = error->Child("Code");
  if (code == nullptr || Trim(code->text).empty()) return std::nullopt;
  S3ErrorBody out;
  out.code = std::string(Trim(code->text));
  if (const Element* message = error->Child("Message")) {
    out.message = std::string(Trim(message->text));
  }
  if (const Element* id = error->Child("RequestId")) out.request_id = std::string(Trim(id->text));
  if (const Element* region = error->Child("Region")) out.region = std::string(Trim(region->text));
  return out;
}

Result<ListPage> ParseListObjectsV2(std::string_view body) {
  Scanner scanner(body);
  const std::optional<Element> root = scanner.Document();
  if (!root) return ListError("not a well-formed XML document: " + scanner.error());
  if (root->name != "ListBucketResult") {
    return ListError("the root element is <" + root->name.substr(0, 64) +
                     ">, not <ListBucketResult>");
  }
  ListPage page;
  for (const Element& child : root->children) {
    const Status status = AddChild(page, child);
    if (!status.ok()) return status;
  }
  return page;
}

Result<StsCredentials> ParseStsCredentials(std::string_view body) {
  const auto error = [](const std::string& what) {
    return Status(Code::kInvalidArgument, "STS response: " + what);
  };
  Scanner scanner(body);
  const std::optional<Element> root = scanner.Document();
  if (!root) return error("not a well-formed XML document: " + scanner.error());
  const std::string_view name = root->name;
  if (!name.starts_with("AssumeRole") || !name.ends_with("Response")) {
    return error("the root element is <" + root->name.substr(0, 64) +
                 ">, not <AssumeRoleWithWebIdentityResponse>");
  }
  const std::string result_name =
      std::string(name.substr(0, name.size() - std::string_view("Response").size())) + "Result";
  const Element* result = root->Child(result_name);
  const Element* credentials = result != nullptr ? result->Child("Credentials") : nullptr;
  if (credentials == nullptr) return error("no <" + result_name + "><Credentials>");
  StsCredentials out;
  const auto text = [&](const char* child) {
    const Element* e = credentials->Child(child);
    return e == nullptr ? std::string() : std::string(Trim(e->text));
  };
  out.access_key_id = text("AccessKeyId");
  out.secret_access_key = text("SecretAccessKey");
  out.session_token = text("SessionToken");
  out.expiration = text("Expiration");
  if (out.access_key_id.empty() || out.secret_access_key.empty()) {
    return error("<Credentials> lacks <AccessKeyId> or <SecretAccessKey>");
  }
  return out;
}

}  // namespace tensorferry::objstore
