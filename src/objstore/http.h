// Internal: one HTTP request at a time per call, over a pool of reusable libcurl handles.
//
// HttpClient::Get sends one GET (or a POST with a form body: OAuth token requests) and returns what
// happened: the status, the headers the object layer needs (ETag, Content-Range, Last-Modified),
// and the body, written either straight into a caller buffer (a ranged GET's destination: only when
// the response is a 206 starting at the requested byte, or a 200 when the request started at 0;
// anything else goes to `text`) or into `text` (bounded). It never retries: object_source.cc
// decides what to repeat.
//
// Signing: with S3 credentials, requests carry AWS Signature V4 (libcurl's CURLOPT_AWS_SIGV4 over
// every header we send, plus x-amz-content-sha256: UNSIGNED-PAYLOAD and x-amz-security-token for
// session credentials); with a BearerTokens source (Google Cloud Storage's OAuth tokens) they carry
// "Authorization: Bearer <token>"; without either, they go unsigned.
//
// Connections: each handle keeps its connections alive; a handle is used by one request at a
// time and returned to the pool after it, so N concurrent callers reuse N connections.
// Thread-safety: Perform may be called from any number of threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tensorferry/status.h"

namespace tensorferry::objstore {

struct CurlApi;
class AwsCredentials;
class BearerTokens;

struct HttpSettings {
  // AWS Signature V4 when access_key_id is set, for `sign_service` ("s3": with
  // x-amz-content-sha256: UNSIGNED-PAYLOAD; others, such as "sts", sign the body's hash).
  std::string access_key_id, secret_access_key, session_token, region;
  std::string sign_service = "s3";
  uint32_t timeout_ms = 30'000;  // connect timeout, and the longest time without a byte received
  bool verify_tls = true;
  std::string ca_bundle;
  // Plain HTTP(S) sources follow redirects (a hub to its CDN), at most 8, to http:// or https://
  // only, and from an https:// URL to https:// only (never a downgrade to plain text).
  bool follow_redirects = false;
  // AWS keys fetched rather than given (aws_credentials.h): asked for before each request and
  // used as access_key_id/secret_access_key/session_token are (which must then be empty); an
  // answer refusing them as expired or unknown makes the next request fetch new ones. Null for
  // none.
  std::shared_ptr<AwsCredentials> aws_credentials;
  // OAuth 2 tokens (gcs_auth.h) sent as "Authorization: Bearer"; null for none.
  std::shared_ptr<BearerTokens> bearer;
  // The path is sent (and signed) as given, "." and ".." segments included: a bucket store's
  // keys are opaque, and "a/../b" is another key than "b" (libcurl would resolve it).
  bool path_as_is = false;
};

// Told of the bytes of a body as they land in HttpRequest::body (on the thread of HttpClient::Get,
// a piece at a time): must be cheap and must not throw.
using BodyProgress = std::function<void(size_t bytes)>;

struct HttpRequest {
  std::string url;                   // fully encoded
  std::vector<std::string> headers;  // "Name: value"
  // Bytes [first, last] of the object (a Range header), or the whole object when unset.
  std::optional<std::pair<uint64_t, uint64_t>> range;
  std::span<std::byte> body;              // where a matching 2xx body goes (empty: into `text`)
  const BodyProgress* on_body = nullptr;  // told of the bytes landing in `body`; borrowed
  size_t text_limit = 1 << 20;            // bytes of other bodies kept
  // Sent as a POST with this body when set (headers name its Content-Type).
  std::optional<std::string> post_body;
  // "PUT": sent as a PUT with post_body (or nothing) as its body. "": GET, or POST with post_body.
  std::string method;
};

struct HttpResponse {
  long status = 0;            // 0 when no response came
  int curl_code = 0;          // CURLcode; 0 = the transfer completed
  std::string curl_error;     // libcurl's message for curl_code
  std::string etag;           // the ETag header as sent (quotes included)
  std::string content_range;  // "bytes 0-99/1234"
  std::string last_modified;
  std::string content_encoding;  // as sent ("" without one)
  // The transfer was abandoned because the reading thread's load was cancelled (io::CancelScope).
  bool cancelled = false;
  // The Hugging Face hub's error headers (X-Error-Code "RepositoryNotFound", "GatedRepo", ...;
  // X-Error-Message), "" without them.
  std::string error_code, error_message;
  std::string bucket_region;  // S3's x-amz-bucket-region (a wrong-region answer names the right)
  // The Hugging Face hub's X-Linked-Etag (a weight file's SHA-256) and X-Repo-Commit, from the
  // first response of a redirected request that sent them (the hub's, not its CDN's); "" if none.
  std::string linked_etag, repo_commit;
  uint64_t body_bytes = 0;  // bytes written into request.body
  std::string text;         // a body not written into request.body (error documents, listings)
  std::string rejected;     // why a 2xx body was not accepted into request.body, if it was not
  std::string peer;  // the address the connection went to ("127.0.0.1", "::1"); "" if none was made
  // The URL that answered when the request was redirected (follow_redirects), else "".
  std::string redirected_to;
  // Bearer tokens and fetched AWS keys only: none could be had (curl_error says why; nothing was
  // sent), or the server refused them (401; for AWS keys an ExpiredToken, InvalidToken or
  // InvalidAccessKeyId answer) and others will be fetched for the next attempt.
  bool no_token = false;
  bool token_replaced = false;
  // Total size from Content-Range ("bytes a-b/TOTAL", "bytes */TOTAL"); nullopt without one.
  std::optional<uint64_t> TotalSize() const;
  // First byte of a "bytes a-b/total" Content-Range; nullopt without one.
  std::optional<uint64_t> RangeStart() const;
  // Last byte of a "bytes a-b/total" Content-Range; nullopt without one.
  std::optional<uint64_t> RangeEnd() const;
};

class HttpClient {
 public:
  // Loads libcurl (curl_api.h). Errors: kUnsupported.
  static Result<std::unique_ptr<HttpClient>> Make(HttpSettings settings);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  HttpResponse Get(const HttpRequest& request) const;
  const HttpSettings& settings() const noexcept { return settings_; }
  const CurlApi& api() const noexcept { return *api_; }

 private:
  HttpClient(const CurlApi* api, HttpSettings settings);
  void* Take() const;
  void Give(void* handle) const;

  const CurlApi* api_;
  HttpSettings settings_;
  mutable std::mutex mu_;
  mutable std::vector<void*> idle_;  // CURL* easy handles not in use
};

}  // namespace tensorferry::objstore
