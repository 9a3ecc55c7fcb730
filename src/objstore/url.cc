#include "objstore/url.h"

#include <cstdint>
#include <optional>

#include "util/decimal.h"

namespace tensorferry::objstore {
namespace {

constexpr size_t kMaxBucketLength = 255;

Status Bad(std::string_view url, std::string_view problem) {
  return Status(Code::kInvalidArgument,
                "object URL \"" + std::string(url) + "\": " + std::string(problem));
}

char Lower(char c) {
  return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
}

bool StartsWithNoCase(std::string_view s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i) {
    if (Lower(s[i]) != prefix[i]) return false;
  }
  return true;
}

bool IsAlnum(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

// A description of the first NUL or control byte in `s` (or space, unless `space_ok`: a bucket
// key may hold spaces, percent-encoded in the request), or nullopt.
std::optional<std::string> ControlProblem(std::string_view s, bool space_ok) {
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == 0) return "contains a NUL byte at offset " + std::to_string(i);
    if (c == ' ' && !space_ok) return "contains a space at offset " + std::to_string(i);
    if (c < 0x20 || c == 0x7f) {
      return "contains a control character or whitespace at offset " + std::to_string(i);
    }
  }
  return std::nullopt;
}

// s3://bucket/key and gs://bucket/key (Google Cloud Storage's bucket names are a subset).
Result<ObjectUrl> ParseBucketUrl(std::string_view url, Scheme scheme, std::string_view rest) {
  const size_t slash = rest.find('/');
  ObjectUrl out;
  out.scheme = scheme;
  out.bucket = std::string(rest.substr(0, slash));
  if (slash != std::string_view::npos) out.key = std::string(rest.substr(slash + 1));
  if (out.bucket.empty()) return Bad(url, "empty bucket name");
  if (out.bucket.size() > kMaxBucketLength) {
    return Bad(url, "bucket name longer than " + std::to_string(kMaxBucketLength) + " characters");
  }
  for (char c : out.bucket) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-' || c == '_')) {
      return Bad(url, "bucket name \"" + out.bucket +
                          "\" has a character outside [a-z0-9.-_] (bucket names are lower-case)");
    }
  }
  if (!out.key.empty() && out.key[0] == '/') return Bad(url, "the key starts with '/'");
  // Keys are opaque to the store ("a/../b" is a key of its own), but programs that build URLs
  // from a prefix and a name, and some servers, resolve such steps: refused, so no URL reads
  // another key than it appears to.
  for (size_t start = 0; start <= out.key.size();) {
    size_t end = out.key.find('/', start);
    if (end == std::string::npos) end = out.key.size();
    const std::string_view part = std::string_view(out.key).substr(start, end - start);
    if (part == "." || part == "..") {
      return Bad(url, "the key has a \"" + std::string(part) +
                          "\" segment (a path step, not a name); name the key without it");
    }
    start = end + 1;
  }
  return out;
}

// Checks "host[:port]" (the authority without userinfo) and returns a problem, or nullopt.
std::optional<std::string> AuthorityProblem(std::string_view authority) {
  std::string_view host = authority;
  std::optional<std::string_view> port;
  if (!authority.empty() && authority[0] == '[') {
    const size_t close = authority.find(']');
    if (close == std::string_view::npos) return "unterminated IPv6 literal in the host";
    host = authority.substr(1, close - 1);
    for (char c : host) {
      if (!(IsAlnum(c) || c == ':' || c == '.')) return "invalid IPv6 literal in the host";
    }
    const std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return "unexpected characters after the IPv6 literal";
      port = after.substr(1);
    }
  } else {
    const size_t colon = authority.find(':');
    if (colon != std::string_view::npos) {
      host = authority.substr(0, colon);
      port = authority.substr(colon + 1);
    }
    for (char c : host) {
      if (!(IsAlnum(c) || c == '.' || c == '-' || c == '_' || c == '~' || c == '%')) {
        return "the host has a character outside [A-Za-z0-9.-_~%]: '" + std::string(1, c) + "'";
      }
    }
  }
  if (host.empty()) return "empty host";
  if (port.has_value()) {
    const std::optional<uint64_t> value = ParseDecimal(*port, 65535);
    if (!value || *value == 0) return "the port is not a number from 1 to 65535";
  }
  return std::nullopt;
}

Result<ObjectUrl> ParseHttp(std::string_view url, Scheme scheme, std::string_view rest) {
  if (rest.find('#') != std::string_view::npos) {
    return Bad(url, "a '#fragment' is not allowed in an object URL");
  }
  if (rest.find('?') != std::string_view::npos) {
    return Bad(url, "a '?query' is not allowed (it would change what a ranged GET reads)");
  }
  const size_t slash = rest.find('/');
  const std::string_view authority = rest.substr(0, slash);
  if (authority.find('@') != std::string_view::npos) {
    return Bad(url, "credentials (user@host) are not allowed in URLs; use the options instead");
  }
  if (auto problem = AuthorityProblem(authority)) return Bad(url, *problem);
  ObjectUrl out;
  out.scheme = scheme;
  out.origin =
      std::string(scheme == Scheme::kHttp ? "http://" : "https://") + std::string(authority);
  if (slash != std::string_view::npos) out.key = std::string(rest.substr(slash + 1));
  return out;
}

}  // namespace

bool IsBucketScheme(Scheme scheme) {
  return scheme == Scheme::kS3 || scheme == Scheme::kGs;
}

std::string ObjectUrl::ToString() const {
  if (scheme == Scheme::kS3) return "s3://" + bucket + "/" + key;
  if (scheme == Scheme::kGs) return "gs://" + bucket + "/" + key;
  return origin + "/" + key;
}

bool IsObjectUrl(std::string_view path) {
  return StartsWithNoCase(path, "s3://") || StartsWithNoCase(path, "gs://") ||
         StartsWithNoCase(path, "http://") || StartsWithNoCase(path, "https://");
}

namespace {

// ParseObjectUrl, its messages naming `url` as given.
Result<ObjectUrl> ParseShown(std::string_view url) {
  const bool bucket = StartsWithNoCase(url, "s3://") || StartsWithNoCase(url, "gs://");
  if (auto problem = ControlProblem(url, bucket)) return Bad(url, *problem);
  if (StartsWithNoCase(url, "s3://")) return ParseBucketUrl(url, Scheme::kS3, url.substr(5));
  if (StartsWithNoCase(url, "gs://")) return ParseBucketUrl(url, Scheme::kGs, url.substr(5));
  if (StartsWithNoCase(url, "http://")) return ParseHttp(url, Scheme::kHttp, url.substr(7));
  if (StartsWithNoCase(url, "https://")) return ParseHttp(url, Scheme::kHttps, url.substr(8));
  return Bad(url, "not an s3://, gs://, http:// or https:// URL");
}

}  // namespace

std::string RedactUrl(std::string_view url) {
  const size_t sep = url.find("://");
  if (sep == std::string_view::npos || sep == 0) return std::string(url);
  const size_t start = sep + 3;
  const bool bucket = StartsWithNoCase(url, "s3://") || StartsWithNoCase(url, "gs://");
  // The authority ends at the path, or (not for buckets) at the query or fragment.
  size_t end = url.find_first_of(bucket ? "/" : "/?#", start);
  if (end == std::string_view::npos) end = url.size();
  if (url.substr(start, end - start).find('@') == std::string_view::npos) {
    // "user:pa/ss@host": a password holding an unescaped '/' (not a URL: refused when parsed,
    // but shown in that refusal) reads as the host "user" with the port "pa"; a port is digits,
    // so a non-digit after the ':' and an '@' before the query are userinfo.
    const std::string_view head = url.substr(start, end - start);
    const size_t colon = head.find(':');
    const size_t stop = url.find_first_of(bucket ? "" : "?#", end);
    const size_t at = url.substr(0, stop == std::string_view::npos ? url.size() : stop).rfind('@');
    if (colon != std::string_view::npos && at != std::string_view::npos && at > end &&
        head.substr(colon + 1).find_first_not_of("0123456789") != std::string_view::npos) {
      end = url.find_first_of(bucket ? "/" : "/?#", at);
      if (end == std::string_view::npos) end = url.size();
    }
  }
  std::string out(url.substr(0, start));
  const std::string_view authority = url.substr(start, end - start);
  const size_t at = authority.rfind('@');
  if (at == std::string_view::npos) {
    out += authority;
  } else {
    out += "***";
    out += authority.substr(at);
  }
  const std::string_view rest = url.substr(end);
  if (!bucket) {
    const size_t q = rest.find_first_of("?#");
    if (q != std::string_view::npos) {
      out += rest.substr(0, q + 1);
      out += "***";
      return out;
    }
  }
  out += rest;
  return out;
}

std::string Excerpt(std::string_view text, size_t limit) {
  std::string out;
  bool query = false;   // inside a word's query (after its '?')
  bool hidden = false;  // and "***" written for it
  for (char c : text.substr(0, limit)) {
    if (c < 32 || c >= 127) c = ' ';
    const bool ends_word = c == ' ' || c == '"' || c == '\'' || c == '<' || c == '>';
    if (query && !ends_word) {
      if (!hidden) out += "***";
      hidden = true;
      continue;
    }
    query = c == '?';
    hidden = false;
    out += c;
  }
  return out;
}

Result<ObjectUrl> ParseObjectUrl(std::string_view url) {
  Result<ObjectUrl> parsed = ParseShown(url);
  if (parsed.ok()) return parsed;
  const std::string shown = RedactUrl(url);
  if (shown == url) return parsed;
  // A problem found in the part redaction hides (a control character in the password) would
  // name what is not shown: the redacted URL's problem is named instead. Redaction only replaces
  // userinfo, queries and fragments, which ParseShown refuses, so the shown URL is refused too.
  Result<ObjectUrl> again = ParseShown(shown);
  if (!again.ok()) return again.status();
  return Bad(shown, "not a URL tensorferry reads");
}

ObjectUrl Join(const ObjectUrl& dir, std::string_view relative) {
  ObjectUrl out = dir;
  std::string rel;
  if (IsBucketScheme(dir.scheme)) {
    // "./x" in an index means x, as for local files; the request sends the key as is.
    for (size_t start = 0; start <= relative.size();) {
      size_t end = relative.find('/', start);
      if (end == std::string_view::npos) end = relative.size();
      const std::string_view part = relative.substr(start, end - start);
      if (part != ".") {
        if (!rel.empty()) rel += '/';
        rel += part;
      }
      start = end + 1;
    }
  } else {
    rel = PercentEncode(relative, true);
  }
  if (!out.key.empty() && out.key.back() != '/') out.key += '/';
  out.key += rel;
  return out;
}

ObjectUrl Parent(const ObjectUrl& file) {
  ObjectUrl out = file;
  const size_t slash = file.key.rfind('/');
  out.key = slash == std::string::npos ? std::string() : file.key.substr(0, slash);
  return out;
}

bool KeyEndsWith(const ObjectUrl& url, std::string_view suffix) {
  return std::string_view(url.key).ends_with(suffix);
}

std::string PercentEncode(std::string_view s, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (IsAlnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += c;
    } else {
      const auto b = static_cast<unsigned char>(c);
      out += '%';
      out += kHex[b >> 4];
      out += kHex[b & 0xf];
    }
  }
  return out;
}

}  // namespace tensorferry::objstore
