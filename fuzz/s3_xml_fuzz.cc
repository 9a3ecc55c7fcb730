// libFuzzer target: the bytes are an S3 or STS response body (an error document, a ListObjectsV2
// page, STS credentials, or anything a proxy or a truncated transfer can produce). The parsers must
// never crash, hang or read outside the input; what they accept must satisfy the documented
// invariants.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "objstore/s3_xml.h"

namespace {

bool Trimmed(const std::string& s) {
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  return s.empty() || (!space(s.front()) && !space(s.back()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensorferry::objstore;
  const std::string_view body(reinterpret_cast<const char*>(data), size);

  // Unescaping never lengthens.
  if (XmlUnescape(body).size() > size) std::abort();

  if (auto error = ParseS3Error(body)) {
    if (error->code.empty() || !Trimmed(error->code) || !Trimmed(error->message)) std::abort();
    if (error->code.size() + error->message.size() + error->request_id.size() > size) std::abort();
  }

  auto sts = ParseStsCredentials(body);
  if (!sts.ok()) {
    if (sts.status().message().rfind("STS response: ", 0) != 0) std::abort();
  } else {
    if (sts->access_key_id.empty() || sts->secret_access_key.empty()) std::abort();
    if (!Trimmed(sts->access_key_id) || !Trimmed(sts->session_token)) std::abort();
    if (sts->access_key_id.size() + sts->secret_access_key.size() + sts->session_token.size() +
            sts->expiration.size() >
        size) {
      std::abort();
    }
  }

  auto page = ParseListObjectsV2(body);
  if (!page.ok()) {
    // Every error says what it was parsing.
    if (page.status().message().rfind("ListObjectsV2 response: ", 0) != 0) std::abort();
    return 0;
  }
  // Everything listed came out of the body: no more bytes than it holds.
  size_t total = page->next_token.size();
  for (const ListedObject& object : page->objects) total += object.key.size() + object.etag.size();
  for (const std::string& prefix : page->common_prefixes) total += prefix.size();
  if (total > size) std::abort();
  return 0;
}
