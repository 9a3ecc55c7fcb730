// Internal: the XML documents tensorferry reads from S3 (errors, listings) and from STS (web
// identity credentials), parsed strictly and boundedly.
//
// Contract:
//   * Pure functions over the bytes of a response body: no I/O, no globals, safe from any thread.
//   * The bodies are untrusted (a proxy, a misbehaving server, a truncated transfer): parsing
//     never crashes, never reads outside `body`, and its memory and stack are bounded (at most
//     kMaxXmlBodySize bytes, kMaxXmlDepth nested elements, kMaxXmlElements elements; beyond them
//     the document is refused).
//   * No XML library: a small scanner for flat documents. It accepts an optional UTF-8 BOM, an
//     <?xml ...?> prolog, comments, processing instructions, attributes (xmlns on the root),
//     CDATA sections and elements it does not know (skipped). It refuses anything else: DOCTYPE,
//     mismatched or missing end tags, text outside the root, bytes after the root.
//   * Element text is XML-unescaped (XmlUnescape). Keys and tokens are kept exactly (no trimming:
//     a key may begin or end with a space); codes, sizes and booleans are trimmed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/status.h"

namespace tensorferry::objstore {

inline constexpr size_t kMaxXmlBodySize = size_t{16} << 20;
inline constexpr int kMaxXmlDepth = 16;
inline constexpr size_t kMaxXmlElements = 200000;

struct S3ErrorBody {
  std::string code, message, request_id;
  std::string region;  // <Region> (AuthorizationHeaderMalformed names the bucket's region)
};
// <Error><Code>NoSuchKey</Code><Message>..</Message><RequestId>..</RequestId>...</Error> (also
// wrapped in <ErrorResponse>, as some S3-compatible servers send it); nullopt when the body is not
// such a document with a non-empty <Code> (HTML from a proxy, empty, truncated...).
std::optional<S3ErrorBody> ParseS3Error(std::string_view body);

struct ListedObject {
  std::string key;
  uint64_t size = 0;
  std::string etag;  // as sent, quotes included ("\"9b2cf535f27731c974343645a3985328\""); may be ""
};
struct ListPage {
  std::vector<ListedObject> objects;         // <Contents>
  std::vector<std::string> common_prefixes;  // <CommonPrefixes><Prefix>
  bool truncated = false;                    // <IsTruncated>true
  std::string next_token;                    // <NextContinuationToken>
};
// A ListObjectsV2 response. Errors: kInvalidArgument ("ListObjectsV2 response: ...") for a body
// that is not a well-formed ListBucketResult, a <Contents> without a <Key> or without a numeric
// <Size> (digits only, fitting 64 bits), or an <IsTruncated> other than true/false.
Result<ListPage> ParseListObjectsV2(std::string_view body);

// The credentials of an STS AssumeRoleWithWebIdentityResponse (or AssumeRoleResponse):
// <...Response><...Result><Credentials><AccessKeyId/><SecretAccessKey/><SessionToken/>
// <Expiration/></Credentials>. Values kept exactly (trimmed of white space). Errors:
// kInvalidArgument ("STS response: ...") for a body that is not such a document or lacks the
// key id or the secret.
struct StsCredentials {
  std::string access_key_id, secret_access_key, session_token, expiration;  // ISO 8601
};
Result<StsCredentials> ParseStsCredentials(std::string_view body);

// "&amp;" "&lt;" "&gt;" "&quot;" "&apos;" "&#NN;" "&#xNN;" (as UTF-8) decoded; others kept as
// written (an unknown entity, a character reference to NUL, a surrogate or past U+10FFFF). The
// result is never longer than `s`.
std::string XmlUnescape(std::string_view s);

}  // namespace tensorferry::objstore
