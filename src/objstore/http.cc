// HttpClient (http.h): GETs through libcurl easy handles.
#include "objstore/http.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <string_view>
#include <utility>

#include "io/read_engine.h"
#include "objstore/aws_credentials.h"
#include "objstore/curl_api.h"
#include "objstore/gcs_auth.h"
#include "objstore/s3_xml.h"
#include "objstore/url.h"
#include "util/decimal.h"
#include "util/macros.h"

namespace tensorferry::objstore {

namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool HeaderIs(std::string_view name, std::string_view want) {
  if (name.size() != want.size()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(name[i])) != want[i]) return false;
  }
  return true;
}

using Clock = std::chrono::steady_clock;

// What one transfer collects; the callbacks' user data.
struct Transfer {
  const HttpRequest* request = nullptr;
  HttpResponse* response = nullptr;
  bool body_checked = false;  // the first body byte decided where the body goes
  bool into_body = false;
  // The stall watchdog (OnProgress): when the last header or body byte arrived, and the bytes
  // (headers and body) received since `window_start`.
  Clock::time_point last_byte = Clock::now();
  Clock::time_point window_start = last_byte;
  uint64_t window_bytes = 0;
  uint32_t timeout_ms = 0;
  bool stalled = false;
  bool too_slow = false;
  bool text_cut = false;  // a body for `text` ran past request.text_limit: the transfer stopped
  // The body bytes the response may bring: a 206's Content-Range length (else no bound beyond
  // the request's buffer).
  uint64_t body_limit = UINT64_MAX;
};

// The slowest transfer kept: fewer bytes than this a second, over a whole timeout_ms, abandon it
// (and the caller retries, resuming). A server that sends a byte now and then would otherwise
// hold a load for ever, each byte resetting the stall watchdog.
constexpr uint64_t kMinBytesPerSecond = 4096;

// Aborts a transfer that has received nothing for timeout_ms, or less than kMinBytesPerSecond
// over a timeout_ms, or whose reading thread's load was cancelled (io::CancelScope). (libcurl's
// LOW_SPEED_LIMIT/TIME average the speed over a window of several seconds, so after a burst of
// bytes a stall went unnoticed for up to ~6 s more than asked: 8 s for a 1.5 s timeout.) libcurl
// calls this at least once a second while a transfer runs, and more often while bytes flow.
int OnProgress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  auto* t = static_cast<Transfer*>(user);
  if (io::CancelScope::Requested()) {
    t->response->cancelled = true;
    return 1;  // CURLE_ABORTED_BY_CALLBACK
  }
  const Clock::time_point now = Clock::now();
  const std::chrono::milliseconds timeout(t->timeout_ms);
  if (now - t->last_byte >= timeout) {
    t->stalled = true;
    return 1;
  }
  // Too slow, unless nothing came for half a timeout: then a stall, said so within that half.
  if (now - t->window_start >= timeout && now - t->last_byte < timeout / 2) {
    if (t->window_bytes * 1000 < kMinBytesPerSecond * t->timeout_ms) {
      t->too_slow = true;
      return 1;
    }
    t->window_start = now;
    t->window_bytes = 0;
  }
  return 0;
}

size_t OnHeader(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  t->last_byte = Clock::now();
  t->window_bytes += n;
  std::string_view line(data, n);
  if (line.rfind("HTTP/", 0) == 0) {
    // A new response (after a redirect or a 100 Continue): forget the previous one's headers.
    const size_t sp = line.find(' ');
    HttpResponse& r = *t->response;
    r.status =
        sp == std::string_view::npos ? 0 : std::atol(std::string(line.substr(sp + 1, 3)).c_str());
    r.etag.clear();
    r.content_range.clear();
    r.last_modified.clear();
    r.content_encoding.clear();
    r.error_code.clear();
    r.error_message.clear();
    return n;
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) return n;
  const std::string_view name = line.substr(0, colon);
  const std::string_view value = Trim(line.substr(colon + 1));
  if (HeaderIs(name, "etag")) t->response->etag = value;
  if (HeaderIs(name, "content-range")) t->response->content_range = value;
  if (HeaderIs(name, "last-modified")) t->response->last_modified = value;
  if (HeaderIs(name, "content-encoding")) t->response->content_encoding = value;
  if (HeaderIs(name, "x-error-code")) t->response->error_code = value;
  if (HeaderIs(name, "x-error-message")) t->response->error_message = value;
  if (HeaderIs(name, "x-amz-bucket-region")) t->response->bucket_region = value;
  // Kept across redirects: the hub sends them, the CDN it redirects to does not.
  if (HeaderIs(name, "x-linked-etag") && t->response->linked_etag.empty()) {
    t->response->linked_etag = value;
  }
  if (HeaderIs(name, "x-repo-commit") && t->response->repo_commit.empty()) {
    t->response->repo_commit = value;
  }
  return n;
}

// Decides, at the first body byte, whether the body is the requested bytes.
void CheckBody(Transfer& t) {
  t.body_checked = true;
  HttpResponse& r = *t.response;
  const HttpRequest& q = *t.request;
  if (q.body.empty() || r.status < 200 || r.status > 299) return;
  if (!r.content_encoding.empty() && !HeaderIs(r.content_encoding, "identity")) {
    // Not the stored bytes (none was asked for: libcurl sends no Accept-Encoding here).
    r.rejected = "the server encoded the body (Content-Encoding: " + r.content_encoding +
                 "), not the object's bytes as stored";
    return;
  }
  const uint64_t first = q.range ? q.range->first : 0;
  if (r.status == 206) {
    const std::optional<uint64_t> start = r.RangeStart();
    const std::optional<uint64_t> end = r.RangeEnd();
    if (!start || *start != first) {
      r.rejected = "206 response for " + (r.content_range.empty() ? "no range" : r.content_range) +
                   ", not for the range starting at byte " + std::to_string(first);
      return;
    }
    // Its bytes are those its Content-Range names: a last byte before the first, or past the
    // range asked, is not an answer to this request; a body longer than it names is refused as
    // it arrives (OnBody).
    if (!end || *end < *start || (q.range && *end > q.range->second)) {
      r.rejected = "206 response for " + r.content_range + ", not within the range asked (bytes " +
                   std::to_string(first) + "-" +
                   (q.range ? std::to_string(q.range->second) : std::string()) + ")";
      return;
    }
    t.body_limit = *end - *start + 1;
  } else if (first != 0) {
    r.rejected = "the server ignored the Range header (HTTP " + std::to_string(r.status) + ")";
    return;
  }
  t.into_body = true;
}

size_t OnBody(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  t->last_byte = Clock::now();
  t->window_bytes += n;
  if (!t->body_checked) CheckBody(*t);
  HttpResponse& r = *t->response;
  if (t->into_body) {
    const std::span<std::byte> dst = t->request->body;
    if (r.body_bytes + n > t->body_limit) {
      r.rejected = "the server sent more than the " + std::to_string(t->body_limit) +
                   " bytes its Content-Range (" + r.content_range + ") names";
      return 0;  // aborts the transfer (CURLE_WRITE_ERROR)
    }
    if (r.body_bytes + n > dst.size()) {
      r.rejected =
          r.status == 200 && t->request->range
              ? "the server ignored the Range header (HTTP 200 with more than the " +
                    std::to_string(dst.size()) + " bytes asked for)"
              : "the server sent more than the " + std::to_string(dst.size()) + " bytes asked for";
      return 0;  // aborts the transfer (CURLE_WRITE_ERROR)
    }
    std::memcpy(dst.data() + r.body_bytes, data, n);
    r.body_bytes += n;
    io::LandingScope::Landed(dst.data() + r.body_bytes);  // checks as bytes land (read_engine.h)
    if (t->request->on_body != nullptr) (*t->request->on_body)(n);
    return n;
  }
  if (!r.rejected.empty() && r.status >= 200 && r.status <= 299) return 0;  // not our bytes
  const size_t room =
      t->request->text_limit > r.text.size() ? t->request->text_limit - r.text.size() : 0;
  r.text.append(data, std::min(n, room));
  if (n > room) {
    // Past what is kept: the rest is not read (an endless or huge error page, or listing, would
    // hold the request for as long as the server sends it; no transfer timeout bounds a body
    // that keeps coming). An error is judged by what was kept; a 2xx answer is refused.
    t->text_cut = true;
    if (r.status >= 200 && r.status <= 299 && r.rejected.empty()) {
      r.rejected = "the server sent more than the " + std::to_string(t->request->text_limit) +
                   " bytes kept of such an answer";
    }
    return 0;  // aborts the transfer (CURLE_WRITE_ERROR)
  }
  return n;
}

}  // namespace

std::optional<uint64_t> HttpResponse::TotalSize() const {
  const size_t slash = content_range.rfind('/');
  if (slash == std::string::npos) return std::nullopt;
  return ParseDecimal(Trim(std::string_view(content_range).substr(slash + 1)));
}

std::optional<uint64_t> HttpResponse::RangeEnd() const {
  std::string_view s = content_range;
  if (s.rfind("bytes ", 0) != 0) return std::nullopt;
  const size_t dash = s.find('-');
  const size_t slash = s.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || slash < dash) {
    return std::nullopt;
  }
  return ParseDecimal(Trim(s.substr(dash + 1, slash - dash - 1)));
}

std::optional<uint64_t> HttpResponse::RangeStart() const {
  std::string_view s = content_range;
  if (s.rfind("bytes ", 0) != 0) return std::nullopt;
  s.remove_prefix(6);
  const size_t dash = s.find('-');
  if (dash == std::string_view::npos) return std::nullopt;
  return ParseDecimal(Trim(s.substr(0, dash)));
}

Result<std::unique_ptr<HttpClient>> HttpClient::Make(HttpSettings settings) {
  TF_ASSIGN_OR_RETURN(const CurlApi* api, Curl());
  if ((!settings.access_key_id.empty() || settings.aws_credentials != nullptr) && !api->has_sigv4) {
    return Status(Code::kUnsupported,
                  api->path + " is libcurl " + api->version +
                      ": signed S3 requests need libcurl 7.87 or later (earlier versions do not "
                      "sign the x-amz-content-sha256 header S3 requires)");
  }
  return std::unique_ptr<HttpClient>(new HttpClient(api, std::move(settings)));
}

HttpClient::HttpClient(const CurlApi* api, HttpSettings settings)
    : api_(api), settings_(std::move(settings)) {}

HttpClient::~HttpClient() {
  for (void* h : idle_) api_->easy_cleanup(static_cast<CURL*>(h));
}

void* HttpClient::Take() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      void* h = idle_.back();
      idle_.pop_back();
      return h;
    }
  }
  return api_->easy_init();
}

void HttpClient::Give(void* handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  idle_.push_back(handle);
}

HttpResponse HttpClient::Get(const HttpRequest& request) const {
  HttpResponse response;
  CURL* h = static_cast<CURL*>(Take());
  if (h == nullptr) {
    response.curl_code = CURLE_OUT_OF_MEMORY;
    response.curl_error = "curl_easy_init failed";
    return response;
  }
  const CurlApi& c = *api_;
  c.easy_reset(h);  // options only: the connection cache stays
  Transfer t{&request, &response};
  t.timeout_ms = std::max<uint32_t>(1, settings_.timeout_ms);
  char error[CURL_ERROR_SIZE] = {0};
  const HttpSettings& s = settings_;
  c.easy_setopt(h, CURLOPT_URL, request.url.c_str());
  if (s.path_as_is) c.easy_setopt(h, CURLOPT_PATH_AS_IS, 1L);
  c.easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  c.easy_setopt(h, CURLOPT_ERRORBUFFER, error);
  c.easy_setopt(h, CURLOPT_HEADERFUNCTION, &OnHeader);
  c.easy_setopt(h, CURLOPT_HEADERDATA, &t);
  c.easy_setopt(h, CURLOPT_WRITEFUNCTION, &OnBody);
  c.easy_setopt(h, CURLOPT_WRITEDATA, &t);
  c.easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(s.timeout_ms));
  // A transfer that receives nothing for the timeout is abandoned (and retried by the caller).
  c.easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  c.easy_setopt(h, CURLOPT_XFERINFOFUNCTION, &OnProgress);
  c.easy_setopt(h, CURLOPT_XFERINFODATA, &t);
  c.easy_setopt(h, CURLOPT_BUFFERSIZE, 512L << 10);
  c.easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
  c.easy_setopt(h, CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_2TLS));
  c.easy_setopt(h, CURLOPT_USERAGENT, "tensorferry");
  c.easy_setopt(h, CURLOPT_SSL_VERIFYPEER, s.verify_tls ? 1L : 0L);
  c.easy_setopt(h, CURLOPT_SSL_VERIFYHOST, s.verify_tls ? 2L : 0L);
  if (!s.ca_bundle.empty()) c.easy_setopt(h, CURLOPT_CAINFO, s.ca_bundle.c_str());
  if (s.follow_redirects) {
    c.easy_setopt(h, CURLOPT_FOLLOWLOCATION, 1L);
    c.easy_setopt(h, CURLOPT_MAXREDIRS, 8L);
    // Where a redirect may lead: the web's two schemes (libcurl's default also allows FTP), and
    // from an https:// URL only https:// (a downgrade would hand the bytes to anyone on the path).
    const bool tls = request.url.rfind("https://", 0) == 0;
    if (c.easy_setopt(h, CURLOPT_REDIR_PROTOCOLS_STR, tls ? "https" : "http,https") != CURLE_OK) {
      // libcurl before 7.85 knows only the bitmask.
      const long mask = tls ? CURLPROTO_HTTPS : (CURLPROTO_HTTP | CURLPROTO_HTTPS);
      c.easy_setopt(h, static_cast<CURLoption>(182), mask);  // CURLOPT_REDIR_PROTOCOLS
    }
  }
  curl_slist* headers = nullptr;
  for (const std::string& hdr : request.headers) headers = c.slist_append(headers, hdr.c_str());
  std::string range;
  if (request.range) {
    range = "Range: bytes=" + std::to_string(request.range->first) + "-" +
            std::to_string(request.range->second);
    headers = c.slist_append(headers, range.c_str());
  }
  std::string bearer;
  if (s.bearer != nullptr) {
    Result<std::string> token = s.bearer->Get();
    if (!token.ok()) {
      c.slist_free_all(headers);
      Give(h);
      response.no_token = true;
      response.cancelled = token.status().code() == Code::kCancelled;
      response.curl_code = CURLE_LOGIN_DENIED;
      response.curl_error = token.status().message();
      return response;
    }
    bearer = *std::move(token);
    headers = c.slist_append(headers, ("Authorization: Bearer " + bearer).c_str());
  }
  static const std::string kNoBody;
  if (request.post_body || request.method == "PUT") {
    const std::string& body = request.post_body ? *request.post_body : kNoBody;
    c.easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
    c.easy_setopt(h, CURLOPT_POSTFIELDS, body.c_str());
  }
  if (request.method == "PUT") c.easy_setopt(h, CURLOPT_CUSTOMREQUEST, "PUT");
  AwsKeys keys{s.access_key_id, s.secret_access_key, s.session_token};
  if (s.aws_credentials != nullptr) {
    Result<AwsKeys> fetched = s.aws_credentials->Get();
    if (!fetched.ok()) {
      c.slist_free_all(headers);
      Give(h);
      response.no_token = true;
      response.cancelled = fetched.status().code() == Code::kCancelled;
      response.curl_code = CURLE_LOGIN_DENIED;
      response.curl_error = fetched.status().message();
      return response;
    }
    keys = *std::move(fetched);
  }
  const std::string aws = "aws:amz:" + s.region + ":" + s.sign_service;
  std::string security_token;
  if (!keys.access_key_id.empty()) {
    // S3 takes an unsigned payload; other services get the body's SHA-256 (libcurl's, of the
    // POST fields).
    if (s.sign_service == "s3") {
      headers = c.slist_append(headers, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    }
    if (!keys.session_token.empty()) {
      security_token = "x-amz-security-token: " + keys.session_token;
      headers = c.slist_append(headers, security_token.c_str());
    }
    c.easy_setopt(h, CURLOPT_AWS_SIGV4, aws.c_str());
    c.easy_setopt(h, CURLOPT_USERNAME, keys.access_key_id.c_str());
    c.easy_setopt(h, CURLOPT_PASSWORD, keys.secret_access_key.c_str());
  }
  c.easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  // The stall watchdog counts from here: fetching a token or keys above (STS, a credential
  // process waiting for an MFA code, another thread's fetch) is not the transfer's silence.
  t.last_byte = t.window_start = Clock::now();
  const CURLcode code = c.easy_perform(h);
  c.slist_free_all(headers);
  long status = 0;
  if (c.easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status) == CURLE_OK && status != 0) {
    response.status = status;
  }
  if (response.status == 401 && s.bearer != nullptr) {
    response.token_replaced = s.bearer->Refuse(bearer);
  }
  if ((response.status == 400 || response.status == 403) && s.aws_credentials != nullptr &&
      !keys.access_key_id.empty()) {
    // Keys that expired early (revoked, a clock skewed) or were never valid here: fetch again.
    const std::optional<S3ErrorBody> e = ParseS3Error(response.text);
    if (e && (e->code == "ExpiredToken" || e->code == "InvalidToken" ||
              e->code == "InvalidAccessKeyId" || e->code == "TokenRefreshRequired")) {
      response.token_replaced = s.aws_credentials->Refuse(keys);
    }
  }
  char* peer = nullptr;
  if (c.easy_getinfo(h, CURLINFO_PRIMARY_IP, &peer) == CURLE_OK && peer != nullptr) {
    response.peer = peer;
  }
  long redirects = 0;
  char* effective = nullptr;
  if (s.follow_redirects && c.easy_getinfo(h, CURLINFO_REDIRECT_COUNT, &redirects) == CURLE_OK &&
      redirects > 0 && c.easy_getinfo(h, CURLINFO_EFFECTIVE_URL, &effective) == CURLE_OK &&
      effective != nullptr) {
    response.redirected_to = effective;
  }
  if (code != CURLE_OK) {
    response.curl_code = code;
    response.curl_error = error[0] != '\0' ? error : c.easy_strerror(code);
    if (t.stalled) {
      response.curl_error = "stalled: no byte received for " + std::to_string(t.timeout_ms) + " ms";
    }
    if (t.text_cut) {
      response.curl_error = "the body is longer than the " + std::to_string(request.text_limit) +
                            " bytes kept: cut off";
    }
    if (t.too_slow) {
      response.curl_error = "too slow: fewer than " + std::to_string(kMinBytesPerSecond) +
                            " bytes a second received over " + std::to_string(t.timeout_ms) + " ms";
    }
    if (response.cancelled) response.curl_error = "cancelled";
    char* next = nullptr;
    if (code == CURLE_UNSUPPORTED_PROTOCOL && s.follow_redirects &&
        (!response.redirected_to.empty() ||
         (c.easy_getinfo(h, CURLINFO_REDIRECT_URL, &next) == CURLE_OK && next != nullptr))) {
      // A redirect to a scheme not allowed above. Named without its query: a signed link's
      // signature is a credential.
      const std::string to =
          response.redirected_to.empty() ? std::string(next) : response.redirected_to;
      response.redirected_to.clear();  // nothing answered there
      response.curl_error =
          "refused to follow the redirect to " + RedactUrl(to) +
          (request.url.rfind("https://", 0) == 0 ? " (from https:// only to https://)"
                                                 : " (only to http:// and https://)");
    }
  }
  c.easy_setopt(h, CURLOPT_ERRORBUFFER, static_cast<char*>(nullptr));
  c.easy_setopt(h, CURLOPT_HTTPHEADER, static_cast<curl_slist*>(nullptr));
  Give(h);
  return response;
}

}  // namespace tensorferry::objstore
