// libFuzzer target: the bytes are an object-store URL (ParseObjectUrl: every s3://, gs:// and
// http(s):// path a user or an index gives), and the same bytes as an HTTP Content-Range header
// value (HttpResponse::TotalSize / RangeStart: what a server sends back). Neither may crash, hang
// or read outside the input. ParseObjectUrl errors name the URL; what it accepts can go in a
// request line as is (http(s): no control characters or whitespace; s3/gs: no control
// characters and no "." or ".." key segment, the key being encoded), reads back the same from its
// ToString,
// and Join/Parent/PercentEncode keep their documented shapes. And the same bytes as an hf:// path
// (ResolveHubPath against a cache that does not exist), and after the hub's address as a resolve
// URL (HubFileOfUrl, whose answer names places in the hub cache: a folder and paths that cannot
// leave it), and as an ETag (HubBlobName: a plain file name or nothing).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "objstore/http.h"
#include "objstore/hub_cache.h"
#include "objstore/url.h"
#include "tensorferry/hub.h"

namespace {

using tensorferry::objstore::ObjectUrl;
using tensorferry::objstore::Scheme;

bool RequestLineSafe(std::string_view s) {
  for (char c : s) {
    const auto b = static_cast<unsigned char>(c);
    if (b <= 0x20 || b == 0x7f) return false;
  }
  return true;
}

bool Unreserved(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.' || c == '~';
}

void CheckPercentEncode(std::string_view s, bool keep_slash) {
  const std::string e = tensorferry::objstore::PercentEncode(s, keep_slash);
  // Decoding gives the input back; only unreserved bytes (and '/' when kept) stay as they are.
  std::string decoded;
  for (size_t i = 0; i < e.size(); ++i) {
    if (e[i] == '%') {
      if (i + 2 >= e.size()) std::abort();
      auto hex = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        std::abort();  // upper-case hex only
      };
      decoded += static_cast<char>(hex(e[i + 1]) * 16 + hex(e[i + 2]));
      i += 2;
    } else {
      if (!Unreserved(e[i]) && !(keep_slash && e[i] == '/')) std::abort();
      decoded += e[i];
    }
  }
  if (decoded != s) std::abort();
}

void CheckUrl(std::string_view text) {
  auto url = tensorferry::objstore::ParseObjectUrl(text);
  if (!url.ok()) {
    // The message names the URL as shown (RedactUrl: no user name, password or query).
    const std::string shown = tensorferry::objstore::RedactUrl(text);
    if (url.status().code() != tensorferry::Code::kInvalidArgument ||
        url.status().message().rfind("object URL \"" + shown + "\": ", 0) != 0) {
      std::abort();
    }
    return;
  }
  if (!tensorferry::objstore::IsObjectUrl(text)) std::abort();
  const std::string s = url->ToString();
  if (tensorferry::objstore::IsBucketScheme(url->scheme)) {
    // A bucket key may hold spaces (percent-encoded in the request), never a control character,
    // nor a "." or ".." segment (a path step to libcurl and some servers).
    for (char c : s) {
      const auto b = static_cast<unsigned char>(c);
      if (b < 0x20 || b == 0x7f) std::abort();
    }
    for (size_t start = 0; start <= url->key.size();) {
      size_t end = url->key.find('/', start);
      if (end == std::string::npos) end = url->key.size();
      const std::string_view part = std::string_view(url->key).substr(start, end - start);
      if (part == "." || part == "..") std::abort();
      start = end + 1;
    }
    const std::string_view prefix = url->scheme == Scheme::kS3 ? "s3://" : "gs://";
    if (s.rfind(prefix, 0) != 0) std::abort();
    if (url->bucket.empty() || url->bucket.size() > 255 || !url->origin.empty()) std::abort();
    if (!url->key.empty() && url->key[0] == '/') std::abort();
  } else {
    if (!RequestLineSafe(s)) std::abort();
    const std::string_view prefix = url->scheme == Scheme::kHttp ? "http://" : "https://";
    if (url->origin.rfind(prefix, 0) != 0 || url->origin.size() == prefix.size() ||
        url->origin.back() == '/' || !url->bucket.empty()) {
      std::abort();
    }
    if (url->key.find_first_of("?#") != std::string::npos) std::abort();
  }
  // ToString reads back as the same URL.
  auto again = tensorferry::objstore::ParseObjectUrl(s);
  if (!again.ok() || !(*again == *url) || again->ToString() != s) std::abort();

  // Parent drops the last '/'-separated part; Join puts one '/' between directory and name.
  const ObjectUrl parent = tensorferry::objstore::Parent(*url);
  if (parent.scheme != url->scheme || parent.bucket != url->bucket ||
      parent.origin != url->origin || url->key.rfind(parent.key, 0) != 0) {
    std::abort();
  }
  const ObjectUrl joined = tensorferry::objstore::Join(parent, "model.safetensors");
  const std::string want = parent.key.empty() || parent.key.back() == '/'
                               ? parent.key + "model.safetensors"
                               : parent.key + "/model.safetensors";
  if (joined.key != want || !tensorferry::objstore::KeyEndsWith(joined, ".safetensors")) {
    std::abort();
  }
  // A joined name is encoded for http(s) (so it stays a request-line-safe URL), raw for s3/gs.
  const ObjectUrl named = tensorferry::objstore::Join(*url, url->key);
  if (!tensorferry::objstore::IsBucketScheme(url->scheme) && !RequestLineSafe(named.ToString())) {
    std::abort();
  }
}

void CheckContentRange(std::string_view text) {
  tensorferry::objstore::HttpResponse r;
  r.content_range = std::string(text);
  const auto total = r.TotalSize();
  const auto start = r.RangeStart();
  if (start && text.rfind("bytes ", 0) != 0) std::abort();
  if (total && text.find('/') == std::string_view::npos) std::abort();
  // The digits it read are there in the text.
  if (start && text.find(std::to_string(*start)) == std::string_view::npos) std::abort();
  if (total &&
      text.substr(text.rfind('/')).find(std::to_string(*total)) == std::string_view::npos) {
    std::abort();
  }
}

// The bytes after "hf://": a hub path (hub.h). With no cache there, nothing resolves: the error is
// kInvalidArgument (malformed) or kNotFound (not cached), its message starting with the path.
void CheckHubPath(std::string_view text) {
  const std::string path = "hf://" + std::string(text);
  const auto r = tensorferry::ResolveHubPath(path, "/nonexistent/tensorferry-fuzz-hub-cache");
  if (r.ok()) std::abort();
  const tensorferry::Code code = r.status().code();
  if (code != tensorferry::Code::kInvalidArgument && code != tensorferry::Code::kNotFound) {
    std::abort();
  }
  if (r.status().message().rfind(path + ": ", 0) != 0) std::abort();
}

// The bytes after "https://huggingface.co/" (HF_ENDPOINT is not set by the fuzzer) as a resolve
// URL: what HubFileOfUrl accepts stays inside the hub cache.
void CheckHubUrl(std::string_view text) {
  namespace o = tensorferry::objstore;
  const auto f = o::HubFileOfUrl("https://huggingface.co/" + std::string(text));
  if (f) {
    if (f->folder.find('/') != std::string::npos || f->folder.rfind("models--", 0) != 0 &&
                                                        f->folder.rfind("datasets--", 0) != 0 &&
                                                        f->folder.rfind("spaces--", 0) != 0) {
      std::abort();
    }
    if (!o::IsSafeRelative(f->path) || !o::IsSafeRelative(f->revision)) std::abort();
    for (const std::string* s : {&f->path, &f->revision}) {
      for (char c : *s) {
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) std::abort();
      }
    }
  }
  const std::string blob = o::HubBlobName("", text);
  if (!blob.empty() && (blob.find('/') != std::string::npos || blob[0] == '.')) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  CheckUrl(text);
  CheckPercentEncode(text, true);
  CheckPercentEncode(text, false);
  CheckContentRange(text);
  CheckHubPath(text);
  CheckHubUrl(text);
  return 0;
}
