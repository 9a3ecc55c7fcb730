// The object-store Source (tensorferry/object_store.h): S3, GCS and HTTP(S) URLs read by ranged
// GETs with retries, resume and ETag pinning.
#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <unistd.h>

#include "io/read_engine.h"
#include "objstore/aws_config.h"
#include "objstore/aws_credentials.h"
#include "objstore/checkpoint_objects.h"
#include "objstore/curl_api.h"
#include "objstore/gcs_auth.h"
#include "objstore/http.h"
#include "objstore/http_auth.h"
#include "objstore/hub_cache.h"
#include "objstore/object_cache.h"
#include "objstore/s3_xml.h"
#include "objstore/transport.h"
#include "objstore/url.h"
#include "tensorferry/hub.h"
#include "tensorferry/object_store.h"
#include "util/macros.h"

namespace tensorferry {

bool IsObjectUrl(std::string_view path) {
  return objstore::IsObjectUrl(path);
}

std::string RedactUrl(std::string_view url) {
  return objstore::RedactUrl(url);
}

namespace objstore {
namespace {

// Where one object is and how to ask for it.
struct Target {
  ObjectUrl url;
  std::string name;         // url.ToString(): what messages call it
  std::string request_url;  // the URL to GET
  Scheme scheme = Scheme::kHttps;
};

uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

std::string RangeText(uint64_t first, uint64_t last) {
  return "bytes " + std::to_string(first) + "-" + std::to_string(last);
}

// A short, printable excerpt of a body that is not an S3 error document.
// True when `url` is on `origin` ("scheme://host[:port]"): the same scheme, host and port,
// compared case-insensitively (a hub's redirect to a path of its own, such as a cache of small
// files, stays on the origin; a CDN does not).
bool SameOrigin(std::string_view url, std::string_view origin) {
  if (url.size() < origin.size()) return false;
  for (size_t i = 0; i < origin.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(url[i])) !=
        std::tolower(static_cast<unsigned char>(origin[i])))
      return false;
  }
  return url.size() == origin.size() || url[origin.size()] == '/' || url[origin.size()] == '?';
}

bool RetryableS3Code(std::string_view code) {
  return code == "SlowDown" || code == "InternalError" || code == "RequestTimeout" ||
         code == "ServiceUnavailable" || code == "Throttling";
}

// libcurl errors that another attempt cannot fix: TLS verification and setup, unusable URLs.
bool PermanentTransportError(int curl_code) {
  switch (curl_code) {
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_URL_MALFORMAT:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_CRL_BADFILE:
    case CURLE_SSL_ISSUER_ERROR:
    case CURLE_SSL_PINNEDPUBKEYNOTMATCH: return true;
    default: return false;
  }
}

}  // namespace

class ObjectSource;

// What went wrong with one response, and whether trying again may help.
struct Verdict {
  bool retryable = false;
  long status = 0;  // the response's HTTP status; 0 without one
  Code code = Code::kIoError;
  std::string why;  // "HTTP 503 SlowDown: Please reduce your request rate." or a curl error
};

Verdict Judge(const HttpResponse& r) {
  Verdict v;
  std::string s3code;
  if (r.no_token) {  // no OAuth token could be had: BearerTokens already retried
    v.why = r.curl_error;
    return v;
  }
  if (r.status == 0) {
    // Connections that failed (refused, reset, timed out) may work next time; a certificate
    // that does not verify, or a URL libcurl cannot use, will not: retrying only delays the
    // error (by ~6 s with the default retries).
    // A response that begins with no status line on a reused connection (the rest of an earlier
    // body a server sent past its Content-Length: "Received HTTP/0.9 when not allowed") is
    // the connection's fault; libcurl closes it, so asking again is a fresh start.
    v.retryable =
        !PermanentTransportError(r.curl_code) || r.curl_error.find("HTTP/0.9") != std::string::npos;
    v.why = "no response (" + r.curl_error + ")";
    return v;
  }
  v.status = r.status;
  v.why = "HTTP " + std::to_string(r.status);
  if (std::optional<S3ErrorBody> e = ParseS3Error(r.text)) {
    // (the server's text, shown shortened and without control characters)
    s3code = e->code;
    v.why += " " + Excerpt(e->code, 80);
    if (!e->message.empty()) v.why += ": " + Excerpt(e->message);
    if (!e->request_id.empty()) v.why += " (request id " + Excerpt(e->request_id, 80) + ")";
    if (e->code == "RequestTimeTooSkewed") {  // signed with this machine's clock: not retried
      v.why += " (this machine's clock is more than 15 minutes off the store's: set it right)";
    }
    // A bucket asked for in another region than its own: where it is, and how to say so.
    const std::string region = !r.bucket_region.empty() ? r.bucket_region : e->region;
    if (!region.empty() && (e->code == "PermanentRedirect" ||
                            e->code == "AuthorizationHeaderMalformed" || r.status == 301)) {
      v.why += " (the bucket is in region " + Excerpt(region) +
               ": set AWS_REGION or the s3_region option to it)";
    }
  } else if (!r.error_code.empty()) {
    // A model hub's error headers: "HTTP 401 RepositoryNotFound: Repository not found".
    s3code = Excerpt(r.error_code);
    v.why += " " + s3code;
    const std::string message = Excerpt(r.error_message.empty() ? r.text : r.error_message);
    if (!message.empty()) v.why += ": " + message;
  } else if (r.status >= 300 && !r.text.empty()) {
    v.why += ": " + Excerpt(r.text);
  }
  if (!r.rejected.empty()) v.why += " (" + r.rejected + ")";
  // The transfer broken off because the body was refused: libcurl's "Failure writing output to
  // destination" would read like a local disk's failure.
  if (r.curl_code != 0 && r.rejected.empty()) v.why += " (" + r.curl_error + ")";
  // Where a redirect led, redacted (a signed link's signature is a credential).
  if (!r.redirected_to.empty()) v.why += " (redirected to " + RedactUrl(r.redirected_to) + ")";
  if (r.status >= 200 && r.status <= 299) {
    // A good status whose body broke off (reset, truncated, stalled) or was not the range asked.
    v.retryable = r.rejected.empty() || r.rejected.find("more than") == std::string::npos;
    if (r.rejected.find("ignored the Range") != std::string::npos ||
        r.rejected.find("Content-Encoding") != std::string::npos) {
      v.retryable = false;
    }
    return v;
  }
  // Missing: S3's codes, and the hub's (which answers 401 RepositoryNotFound for a repository
  // that does not exist, or is private and the request had no token for it).
  if (r.status == 404 || s3code == "NoSuchKey" || s3code == "NoSuchBucket" ||
      s3code == "RepositoryNotFound" || s3code == "RevisionNotFound" || s3code == "EntryNotFound") {
    v.code = Code::kNotFound;
  } else if (r.status == 401 || r.status == 403) {
    v.code = Code::kAccessDenied;
  }
  v.retryable = r.status == 429 || r.status == 500 || r.status == 502 || r.status == 503 ||
                r.status == 504 || RetryableS3Code(s3code) || r.token_replaced;
  return v;
}

// The version of an object a file reads, seen at open: every ranged GET is pinned to it. Its
// ETag when the server sent one (If-Match; a weak one compared with each response's); else its
// Last-Modified (If-Unmodified-Since, and each response's compared: a change within the same
// second of the same size goes unnoticed); with neither, nothing but the size.
struct Version {
  std::string etag;
  std::string last_modified;  // only when there is no ETag

  static Version Of(const HttpResponse& r) {
    return r.etag.empty() ? Version{"", r.last_modified} : Version{r.etag, ""};
  }
  // What the doctor says of it.
  std::string Text() const {
    if (!etag.empty()) return "ETag " + etag;
    if (!last_modified.empty()) return "no ETag: pinned to Last-Modified " + last_modified;
    return "no ETag nor Last-Modified (a change of the same size during a load goes unnoticed)";
  }
};

class ObjectFile final : public SourceFile {
 public:
  ObjectFile(std::shared_ptr<const ObjectSource> source, Target target, FileIdentity identity,
             Version version, std::vector<std::byte> prefix)
      : source_(source),
        target_(std::move(target)),
        identity_(identity),
        version_(std::move(version)),
        prefix_(std::move(prefix)) {}

  Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const override;
  Result<uint64_t> Size() const override { return identity_.size; }
  const std::string& path() const noexcept override { return target_.name; }
  const FileIdentity& identity() const noexcept override { return identity_; }
  const Version& version() const noexcept { return version_; }
  // Every read is pinned to the version seen at open (If-Match): nothing to check up front.
  Status CheckUnchanged() const override { return Status::Ok(); }

 private:
  bool FromPrefix(uint64_t offset, std::span<std::byte> dst) const;

  const std::shared_ptr<const ObjectSource> source_;  // a file may outlive its checkpoint
  const Target target_;
  const FileIdentity identity_;
  const Version version_;
  mutable std::mutex mu_;
  // The first bytes, fetched at open: they serve the header reads, then are released.
  mutable std::vector<std::byte> prefix_;
};

class ObjectSource final : public Source, public std::enable_shared_from_this<ObjectSource> {
 public:
  explicit ObjectSource(ObjectStoreOptions options) : options_(std::move(options)) {
    if (!options_.cache_dir.empty()) {
      cache_ = std::make_unique<ObjectCache>(
          options_.cache_dir, options_.cache_max, ObjectCache::Layout::kObjects,
          static_cast<size_t>(options_.cache_write_behind), options_.cache_fetch_once);
    }
    if (options_.hub_cache) {  // its folder is made at its first download
      hub_cache_ = std::make_unique<ObjectCache>(HubCacheDir(), 0, ObjectCache::Layout::kHub,
                                                 static_cast<size_t>(options_.cache_write_behind),
                                                 options_.cache_fetch_once);
    }
  }
  // The caches' downloads still running use this source: they end first.
  ~ObjectSource() override {
    cache_.reset();
    hub_cache_.reset();
  }
  // True in a process forked from the one that made this source (which has its threads).
  bool Inherited() const { return made_by_ != ::getpid(); }
  // True while a cache's downloads are queued or running (they call this source).
  bool Copying() const { return (cache_ && cache_->Busy()) || (hub_cache_ && hub_cache_->Busy()); }
  // The failures each cache has counted so far (stats().errors; cache_, then hub_cache_).
  std::array<uint64_t, 2> CacheErrors() const {
    return {cache_ ? cache_->stats().errors : 0, hub_cache_ ? hub_cache_->stats().errors : 0};
  }
  // Waits for the caches' downloads, then describes the failures counted after `before`.
  std::vector<std::string> FinishCopies(const std::array<uint64_t, 2>& before) const {
    std::vector<std::string> failures;
    size_t i = 0;
    for (ObjectCache* cache : {cache_.get(), hub_cache_.get()}) {
      if (cache != nullptr) {
        cache->Drain();
        for (std::string& why : cache->ErrorsSince(before[i])) failures.push_back(std::move(why));
      }
      ++i;
    }
    return failures;
  }

  Result<std::unique_ptr<SourceFile>> Open(const std::string& path,
                                           const FileIdentity* expected) override;
  Result<std::vector<std::string>> List(const std::string& dir, std::string_view suffix) override;
  // DescribeObjectStore's report for `url` (object_store.h).
  ObjectStoreReport Describe(const std::string& url);
  SourceStats stats() const override;
  SourceReadHints hints() const override;
  // hints(), with the reason's text only when `explain` (every read and every cache download
  // asks for the rest).
  SourceReadHints Transport(bool explain = false) const;
  uint64_t PartSize() const { return Transport().read_size; }

  // Reads [first, first + dst.size()) of `target` into dst, pinned to `version` and `size`,
  // retrying and resuming; `on_body` (when set) is told of the bytes as they land.
  Status ReadRange(const Target& target, const Version& version, uint64_t size, uint64_t first,
                   std::span<std::byte> dst, const BodyProgress* on_body = nullptr) const;

 private:
  Result<Target> Resolve(const std::string& path) const;
  Result<const HttpClient*> Client(Scheme scheme) const;
  // The bucket store's settings for s3:// or gs:// (after Client(scheme) succeeded).
  const S3Config& BucketConfig(Scheme scheme) const {
    return scheme == Scheme::kGs ? gcs_config_->s3 : *s3_config_;
  }
  // Sends `request` until it succeeds, fails for good or runs out of attempts. `accept` says
  // whether a response is the answer (then returned, whatever its status).
  template <class Accept>
  Result<HttpResponse> Send(const Target& target, HttpRequest request, const std::string& what,
                            Accept accept) const;
  // One GET of `request` (to request.url) for `target`. A plain HTTP(S) URL that was
  // redirected before (a model hub's resolver sending each GET to a signed CDN link) is asked at
  // the URL it was redirected to: one request instead of two, and the hub's resolver (often
  // rate-limited) is asked once per object rather than once per part. When that URL stops
  // answering (401, 403, 404, 410: the link expired or was withdrawn), the original URL is asked
  // again at once and its new redirect remembered; the pinned ETag (If-Match) holds throughout.
  HttpResponse Fetch(const HttpClient& client, const Target& target, HttpRequest& request) const;
  std::string Context(const Target& target) const;
  // Waits before a retry; false when the reading thread's load was cancelled meanwhile (the wait
  // is cut short: io::CancelScope).
  bool Backoff(unsigned attempt) const;
  Status Failed(const Target& target, const std::string& what, const Verdict& v,
                unsigned attempts) const;

  const ObjectStoreOptions options_;
  const pid_t made_by_ = ::getpid();
  std::unique_ptr<ObjectCache> cache_;      // options_.cache_dir; null without one
  std::unique_ptr<ObjectCache> hub_cache_;  // options_.hub_cache: HubCacheDir(); null without
  // Every request, and (CountRequest, CountBytes) the reader's scope's too (SourceStatsScope).
  mutable SourceCounters counters_;
  void CountRequest(unsigned attempt) const {
    for (SourceCounters* c : {&counters_, SourceStatsScope::Current()}) {
      if (c == nullptr) continue;
      if (attempt > 0) c->retries.fetch_add(1, std::memory_order_relaxed);
      c->requests.fetch_add(1, std::memory_order_relaxed);
    }
  }
  void CountBytes(uint64_t n) const {
    for (SourceCounters* c : {&counters_, SourceStatsScope::Current()}) {
      if (c != nullptr) c->bytes.fetch_add(n, std::memory_order_relaxed);
    }
  }
  // Where the objects opened so far were served from (HttpResponse::peer), for the automatic
  // transport (ObjectStoreOptions::concurrency/part_size 0): the first address of each kind.
  void NotePeer(const std::string& peer) const;
  mutable std::mutex peers_mu_;
  mutable std::string local_peer_, remote_peer_;
  // Fetch's memory: a URL -> where its last successful GET was redirected to, and the hub's
  // headers on the way (HttpResponse::linked_etag, repo_commit: a GET sent straight to the
  // link does not see them).
  struct Direct {
    std::string url, linked_etag, repo_commit;
  };
  mutable std::mutex direct_mu_;
  mutable std::unordered_map<std::string, Direct> direct_;

  mutable std::once_flag s3_once_, gcs_once_, http_once_;
  mutable Result<S3Config> s3_config_ = Status(Code::kInternal, "unresolved");
  mutable Result<std::unique_ptr<HttpClient>> s3_client_ = Status(Code::kInternal, "unmade");
  mutable Result<GcsConfig> gcs_config_ = Status(Code::kInternal, "unresolved");
  mutable Result<std::unique_ptr<HttpClient>> gcs_client_ = Status(Code::kInternal, "unmade");
  mutable Result<std::unique_ptr<HttpClient>> http_client_ = Status(Code::kInternal, "unmade");
  mutable HttpToken http_token_;  // plain HTTP(S) origins' token (with http_client_)
};

// --- ObjectSource ------------------------------------------------------------------------------

namespace {

// Timeouts and TLS, the same for every store.
HttpSettings TransportSettings(const ObjectStoreOptions& o) {
  HttpSettings hs;
  hs.timeout_ms = o.timeout_ms;
  hs.verify_tls = o.verify_tls;
  hs.ca_bundle = o.ca_bundle;
  return hs;
}

// A bucket store's: Signature V4 with its keys unless it is anonymous (no keys, or a bearer token).
HttpSettings BucketSettings(const S3Config& c, const ObjectStoreOptions& o) {
  HttpSettings hs = TransportSettings(o);
  if (!c.anonymous) {
    hs.access_key_id = c.access_key_id;
    hs.secret_access_key = c.secret_access_key;
    hs.session_token = c.session_token;
  }
  hs.region = c.region;
  hs.path_as_is = true;
  return hs;
}

}  // namespace

Result<const HttpClient*> ObjectSource::Client(Scheme scheme) const {
  if (scheme == Scheme::kGs) {
    std::call_once(gcs_once_, [this] {
      GcsRequest req;
      req.endpoint = options_.endpoint;
      req.region = options_.region;
      req.access_key_id = options_.access_key_id;
      req.secret_access_key = options_.secret_access_key;
      req.token = options_.gcs_token;
      req.anonymous = options_.anonymous;
      gcs_config_ = ResolveGcsConfig(req);
      if (!gcs_config_.ok()) {
        gcs_client_ = gcs_config_.status();
        return;
      }
      HttpSettings hs = BucketSettings(gcs_config_->s3, options_);  // HMAC keys, when given
      Result<std::shared_ptr<BearerTokens>> bearer = BearerTokens::Make(*gcs_config_, hs);
      if (!bearer.ok()) {
        gcs_client_ = bearer.status();
        return;
      }
      hs.bearer = *std::move(bearer);
      gcs_client_ = HttpClient::Make(std::move(hs));
    });
    if (!gcs_client_.ok()) return gcs_client_.status();
    return gcs_client_->get();
  }
  if (scheme == Scheme::kS3) {
    std::call_once(s3_once_, [this] {
      S3Request req;
      req.endpoint = options_.endpoint;
      req.region = options_.region;
      req.profile = options_.profile;
      req.access_key_id = options_.access_key_id;
      req.secret_access_key = options_.secret_access_key;
      req.session_token = options_.session_token;
      req.anonymous = options_.anonymous;
      req.path_style = options_.path_style;
      s3_config_ = ResolveS3Config(req);
      if (!s3_config_.ok()) {
        s3_client_ = s3_config_.status();
        return;
      }
      HttpSettings hs = BucketSettings(*s3_config_, options_);
      // Keys fetched from STS, a process, a container endpoint or the instance metadata service.
      Result<std::shared_ptr<AwsCredentials>> fetched = AwsCredentials::Make(*s3_config_, hs);
      if (!fetched.ok()) {
        s3_client_ = fetched.status();
        return;
      }
      hs.aws_credentials = *std::move(fetched);
      s3_client_ = HttpClient::Make(std::move(hs));
    });
    if (!s3_client_.ok()) return s3_client_.status();
    return s3_client_->get();
  }
  std::call_once(http_once_, [this] {
    Result<HttpToken> token = ResolveHttpToken(options_.http_token);
    if (!token.ok()) {
      http_client_ = token.status();
      return;
    }
    http_token_ = *std::move(token);
    HttpSettings hs = TransportSettings(options_);
    hs.follow_redirects = true;
    http_client_ = HttpClient::Make(std::move(hs));
  });
  if (!http_client_.ok()) return http_client_.status();
  return http_client_->get();
}

Result<Target> ObjectSource::Resolve(const std::string& path) const {
  TF_ASSIGN_OR_RETURN(ObjectUrl url, ParseObjectUrl(path));
  Target t;
  t.scheme = url.scheme;
  t.name = url.ToString();
  if (IsBucketScheme(t.scheme)) {
    TF_RETURN_IF_ERROR(Client(t.scheme).status());
    if (url.key.empty() || url.key.back() == '/') {
      return Status(Code::kInvalidArgument,
                    t.name + ": names no object (the key is empty or ends with '/')");
    }
    t.request_url = BucketConfig(t.scheme).ObjectRequestUrl(url);
  } else {
    t.request_url = url.origin + "/" + url.key;
  }
  t.url = std::move(url);
  return t;
}

std::string ObjectSource::Context(const Target& target) const {
  if (target.scheme == Scheme::kGs && gcs_config_.ok()) {
    const S3Config& c = gcs_config_->s3;
    return " [endpoint " + c.endpoint + " (" + c.endpoint_from +
           "), credentials: " + c.credentials_from + "]";
  }
  if (target.scheme != Scheme::kS3 || !s3_config_.ok()) return "";
  const S3Config& c = *s3_config_;
  return " [endpoint " + c.endpoint + " (" + c.endpoint_from + "), region " + c.region +
         ", credentials: " + c.credentials_from + "]";
}

bool ObjectSource::Backoff(unsigned attempt) const {
  // Exponential with "equal jitter": half the delay fixed, half random, capped at 10 s.
  const uint64_t cap = 10'000;
  const uint64_t base = std::max<uint32_t>(1, options_.backoff_ms);
  const uint64_t delay = std::min<uint64_t>(cap, base << std::min(attempt, 16u));
  thread_local std::minstd_rand rng(std::random_device{}());
  uint64_t ms = delay / 2 + std::uniform_int_distribution<uint64_t>(0, delay / 2)(rng);
  for (; ms > 0; ms -= std::min<uint64_t>(ms, 20)) {  // a cancel is seen within 20 ms
    if (io::CancelScope::Requested()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min<uint64_t>(ms, 20)));
  }
  return !io::CancelScope::Requested();
}

namespace {

Status CancelledRead(const std::string& name, const std::string& what) {
  return Status(Code::kCancelled, name + ": " + what + ": the load was cancelled");
}

}  // namespace

Status ObjectSource::Failed(const Target& target, const std::string& what, const Verdict& v,
                            unsigned attempts) const {
  std::string message = target.name + ": " + what + ": " + v.why;
  if (attempts > 1) {
    message += "; gave up after " + std::to_string(attempts) + " attempts";
  }
  if (!IsBucketScheme(target.scheme) && (v.status == 401 || v.status == 403)) {
    // A gated or private model on a hub: say which token went, never the token.
    const bool sent = !http_token_.For(target.url.origin).empty();
    message += sent ? "; the access token from " + http_token_.from + " was sent"
                    : "; no access token was sent (the http_token option, or HF_TOKEN for the "
                      "Hugging Face hub)";
  }
  message += Context(target);
  return Status(v.code, std::move(message));
}

template <class Accept>
Result<HttpResponse> ObjectSource::Send(const Target& target, HttpRequest request,
                                        const std::string& what, Accept accept) const {
  TF_ASSIGN_OR_RETURN(const HttpClient* client, Client(target.scheme));
  for (unsigned attempt = 0;; ++attempt) {
    CountRequest(attempt);
    HttpResponse r = Fetch(*client, target, request);
    CountBytes(r.body_bytes + r.text.size());
    if (accept(r)) return r;
    if (r.cancelled) return CancelledRead(target.name, what);
    const Verdict v = Judge(r);
    if (!v.retryable || attempt >= options_.retries) return Failed(target, what, v, attempt + 1);
    if (!Backoff(attempt)) return CancelledRead(target.name, what);
  }
}

HttpResponse ObjectSource::Fetch(const HttpClient& client, const Target& target,
                                 HttpRequest& request) const {
  const std::string origin = request.url;
  Direct known;
  if (!IsBucketScheme(target.scheme)) {
    std::lock_guard<std::mutex> lock(direct_mu_);
    const auto it = direct_.find(origin);
    if (it != direct_.end()) known = it->second;
  }
  const std::string& direct = known.url;
  // The origin's token (http_auth.h), to the origin's scheme, host and port only: libcurl drops
  // it on a redirect elsewhere, and a remembered redirect target elsewhere is asked without it.
  const std::string token =
      IsBucketScheme(target.scheme) ? std::string() : http_token_.For(target.url.origin);
  const size_t headers = request.headers.size();
  const auto ask = [&](const std::string& url) {
    request.url = url;
    if (!token.empty() && SameOrigin(url, target.url.origin)) {
      request.headers.push_back("Authorization: Bearer " + token);
    }
    HttpResponse answer = client.Get(request);
    request.headers.resize(headers);
    return answer;
  };
  HttpResponse r;
  bool answered_directly = false;  // by the remembered target, without a redirect
  if (direct.empty()) {
    r = ask(origin);
  } else {
    r = ask(direct);
    answered_directly = true;
    if (r.status == 401 || r.status == 403 || r.status == 404 || r.status == 410) {
      answered_directly = false;
      {
        std::lock_guard<std::mutex> lock(direct_mu_);
        const auto it = direct_.find(origin);
        if (it != direct_.end() && it->second.url == direct) direct_.erase(it);
      }
      CountBytes(r.text.size());  // the refusal's body; its request was counted by the caller
      CountRequest(0);
      r = ask(origin);
    }
  }
  request.url = origin;
  if (!r.redirected_to.empty() && r.status >= 200 && r.status <= 299) {
    std::lock_guard<std::mutex> lock(direct_mu_);
    direct_[origin] = Direct{r.redirected_to, r.linked_etag, r.repo_commit};
  } else if (r.redirected_to.empty() && !direct.empty()) {
    if (r.linked_etag.empty()) r.linked_etag = known.linked_etag;
    if (r.repo_commit.empty()) r.repo_commit = known.repo_commit;
  }
  // A failure of the remembered target is named as a redirect's would be ("(redirected to
  // ...)", redacted), not as the origin's, which was not asked (not remembered again: a 2xx
  // only is).
  if (answered_directly && r.redirected_to.empty() && (r.status < 200 || r.status > 299)) {
    r.redirected_to = direct;
  }
  return r;
}

void ObjectSource::NotePeer(const std::string& peer) const {
  std::lock_guard<std::mutex> lock(peers_mu_);
  // Each new address is looked up once (IsAddressOfThisHost lists the host's interfaces).
  if (peer.empty() || peer == local_peer_ || peer == remote_peer_) return;
  std::string& slot = IsAddressOfThisHost(peer) ? local_peer_ : remote_peer_;
  if (slot.empty()) slot = peer;
}

SourceReadHints ObjectSource::hints() const {
  return Transport(/*explain=*/true);
}

SourceStats ObjectSource::stats() const {
  SourceStats s = counters_.Snapshot();
  for (const ObjectCache* cache : {cache_.get(), hub_cache_.get()}) {
    if (cache == nullptr) continue;
    const ObjectCacheStats c = cache->stats();
    const bool hub = cache == hub_cache_.get();
    if (hub && c.hits + c.fills + c.errors + c.unlinked == 0) continue;  // no hub file was read
    s.cache_hits += c.hits;
    s.cache_fills += c.fills;
    s.cache_fill_bytes += c.fill_bytes;
    s.cache_refetch_bytes += c.given_back;
    s.cache_errors += c.errors;
    if (c.errors > 0 && s.cache_last_error.empty()) s.cache_last_error = c.last_error;
    if (!s.cache_summary.empty()) s.cache_summary += "; ";
    s.cache_summary += (hub ? "hub cache " : "object cache ") + cache->dir() + ": " +
                       std::to_string(c.hits) + (c.hits == 1 ? " file" : " files") +
                       " read from it, " + std::to_string(c.fills) + " downloaded into it";
    if (c.given_back > 0) {
      s.cache_summary += " (" + std::to_string(c.given_back) +
                         " bytes the local disk could not take in time fetched again after the "
                         "load; object_cache_fetch_once waits for the disk instead)";
    }
    if (c.errors > 0) {
      s.cache_summary += ", " + std::to_string(c.errors) + (c.errors == 1 ? " file" : " files") +
                         " read from the store because " + c.last_error;
    }
    if (c.unlinked > 0) {  // read from the cache all the same
      s.cache_summary += ", " + std::to_string(c.unlinked) +
                         (c.unlinked == 1 ? " file" : " files") +
                         " not linked into their snapshot because " + c.last_unlinked;
    }
  }
  return s;
}

SourceReadHints ObjectSource::Transport(bool explain) const {
  std::lock_guard<std::mutex> lock(peers_mu_);
  return ChooseTransport(options_.concurrency, options_.part_size, local_peer_, remote_peer_,
                         explain);
}

Result<std::unique_ptr<SourceFile>> ObjectSource::Open(const std::string& path,
                                                       const FileIdentity* expected) {
  TF_ASSIGN_OR_RETURN(Target target, Resolve(path));
  // One speculative ranged GET: the size (Content-Range), the ETag and the first bytes.
  std::vector<std::byte> prefix(static_cast<size_t>(std::max<uint64_t>(options_.header_bytes, 8)));
  HttpRequest req;
  req.url = target.request_url;
  req.range = std::make_pair(uint64_t{0}, uint64_t{prefix.size() - 1});
  req.body = prefix;
  const auto complete = [](const HttpResponse& r) {
    return (r.status == 206 || r.status == 200 || r.status == 416) && r.curl_code == 0 &&
           r.rejected.empty();
  };
  TF_ASSIGN_OR_RETURN(
      HttpResponse r,
      Send(target, req, "open (GET " + RangeText(0, prefix.size() - 1) + ")", complete));
  FileIdentity id;
  if (r.status == 206) {
    const std::optional<uint64_t> total = r.TotalSize();
    if (!total) {
      return Status(Code::kIoError, target.name +
                                        ": 206 response without a total size (Content-Range \"" +
                                        r.content_range + "\")" + Context(target));
    }
    id.size = *total;
  } else if (r.status == 416) {
    // An empty object has no byte 0: "bytes */0". Without a Content-Range the size is unknown.
    if (!r.TotalSize()) {
      return Status(Code::kIoError,
                    target.name + ": HTTP 416 for bytes 0-" + std::to_string(prefix.size() - 1) +
                        " without a Content-Range (the object's size unknown)" + Context(target));
    }
    id.size = *r.TotalSize();
    if (id.size != 0) {
      return Status(Code::kIoError, target.name + ": HTTP 416 for bytes 0-" +
                                        std::to_string(prefix.size() - 1) + " of a " +
                                        std::to_string(id.size) + "-byte object" + Context(target));
    }
  } else {
    id.size = r.body_bytes;  // 200: the whole object fitted the prefix
  }
  prefix.resize(static_cast<size_t>(std::min<uint64_t>(r.body_bytes, id.size)));
  NotePeer(r.peer);
  const Version version = Version::Of(r);
  id.inode = Fnv1a(version.etag.empty() ? version.last_modified : version.etag);
  if (expected != nullptr && id != *expected) {
    return Status(Code::kIoError,
                  target.name + ": file changed since the checkpoint was opened: " +
                      (id.size != expected->size
                           ? std::to_string(expected->size) + " bytes then, " +
                                 std::to_string(id.size) + " now"
                           : (version.etag.empty() ? "Last-Modified now " + version.last_modified
                                                   : "ETag now " + version.etag)));
  }
  // The local caches: objects with a strong ETag (the hub's files also when the first GET held
  // them whole: the snapshot needs its index and configs). Their downloads run on the cache's
  // thread, which the source's destructor joins first: they may call this source as long as it
  // lives.
  const bool strong = !r.etag.empty() && r.etag.rfind("W/", 0) != 0;
  CachedObject object;
  object.name = target.name;
  object.request_url = target.request_url;
  object.etag = r.etag;
  object.size = id.size;
  ObjectCache* cache = cache_.get();
  if (hub_cache_ && strong && !IsBucketScheme(target.scheme)) {
    if (std::optional<HubFile> hub = HubFileOfUrl(target.request_url)) {
      object.hub_folder = std::move(hub->folder);
      object.hub_path = std::move(hub->path);
      object.hub_commit = IsHubCommit(hub->revision) ? hub->revision : r.repo_commit;
      object.hub_blob = HubBlobName(r.linked_etag, r.etag);
      if (IsHubCommit(object.hub_commit) && !object.hub_blob.empty()) {
        cache = hub_cache_.get();
        if (id.size <= prefix.size()) cache->Keep(object, prefix);
      }
    }
  }
  if (cache != nullptr && strong && id.size > prefix.size()) {
    FetchRange fetch = [this, target, version, size = id.size](
                           uint64_t offset, std::span<std::byte> dst, const BodyProgress* on_body) {
      return ReadRange(target, version, size, offset, dst, on_body);
    };
    const SourceReadHints transport = Transport();
    return cache->Open(object, id, std::move(prefix), std::move(fetch), transport.concurrency,
                       transport.read_size, shared_from_this());
  }
  if (cache != nullptr && !strong && id.size > prefix.size()) {
    cache->Skip(target.name, r.etag.empty() ? "the server sent no ETag (a copy could not be told "
                                              "from a changed object)"
                                            : "its ETag " + Excerpt(r.etag, 80) +
                                                  " is weak (a copy could not be told from a "
                                                  "changed object)");
  }
  return std::unique_ptr<SourceFile>(
      new ObjectFile(shared_from_this(), std::move(target), id, version, std::move(prefix)));
}

// The fewest bytes a 206 cut short of the range asked must bring for the rest to be asked for at
// once, as no retry (a server or gateway capping its responses caps them at megabytes), but for
// the first kShortCappedResponses of a range; shorter ones after those are failures, retried
// and counted, so a server dripping a few bytes per response ends in an error, not in millions
// of requests.
constexpr uint64_t kMinCappedResponse = 64 << 10;
constexpr unsigned kShortCappedResponses = 4;

Status ObjectSource::ReadRange(const Target& target, const Version& version, uint64_t size,
                               uint64_t first, std::span<std::byte> dst,
                               const BodyProgress* on_body) const {
  const std::string& etag = version.etag;
  const std::string& modified = version.last_modified;
  TF_ASSIGN_OR_RETURN(const HttpClient* client, Client(target.scheme));
  const uint64_t last = first + dst.size() - 1;
  const std::string what = "GET " + RangeText(first, last);
  uint64_t received = 0;
  unsigned attempt = 0;       // failures retried so far
  bool retry = false;         // this request repeats a failed one
  unsigned short_capped = 0;  // 206s cut short at fewer than kMinCappedResponse bytes
  for (;;) {
    CountRequest(retry ? 1 : 0);
    retry = false;
    HttpRequest req;
    req.url = target.request_url;
    req.range = std::make_pair(first + received, last);  // resume after the bytes received
    req.body = dst.subspan(static_cast<size_t>(received));
    req.on_body = on_body;
    // If-Match compares strongly: a weak ETag (W/"...") would never match, so it is only
    // compared with each response's below.
    if (!etag.empty() && etag.rfind("W/", 0) != 0) req.headers.push_back("If-Match: " + etag);
    if (!modified.empty()) req.headers.push_back("If-Unmodified-Since: " + modified);
    HttpResponse r = Fetch(*client, target, req);
    CountBytes(r.body_bytes);
    // Whether the response's headers are all here: the transfer completed, or its body began. A
    // connection reset or stalled within the headers leaves a status without the headers after
    // it: a transport failure, retried, not an answer without validators.
    const bool headers_whole = r.curl_code == 0 || r.body_bytes > 0;
    // Pinned: the object answering must be the one opened. A 2xx without an ETag cannot be
    // confirmed to be it (a server or proxy ignoring If-Match could serve another version of
    // the same size): never taken.
    if (headers_whole && !etag.empty() && r.etag.empty() && r.status >= 200 && r.status <= 299) {
      return Status(Code::kIoError,
                    target.name + ": HTTP " + std::to_string(r.status) +
                        " without an ETag: the bytes cannot be confirmed to be those of the "
                        "object opened (ETag " +
                        etag + "), so they are not used (" + what + ")");
    }
    if (headers_whole && !modified.empty() && r.last_modified.empty() && r.status >= 200 &&
        r.status <= 299) {
      return Status(Code::kIoError,
                    target.name + ": HTTP " + std::to_string(r.status) +
                        " without a Last-Modified: the bytes cannot be confirmed to be those of "
                        "the object opened (Last-Modified " +
                        modified + ", no ETag), so they are not used (" + what + ")");
    }
    // Validators of an answer with the object's bytes only: an error page (a proxy's 502 with an
    // ETag of its own) says nothing about the object, and is judged (retried) as an error.
    const bool object_answer = r.status >= 200 && r.status <= 299;
    const bool other_etag = object_answer && !etag.empty() && !r.etag.empty() && r.etag != etag;
    const bool other_time = object_answer && !modified.empty() && !r.last_modified.empty() &&
                            r.last_modified != modified;
    if (r.status == 412 || other_etag || other_time ||
        (r.status == 206 && r.TotalSize() && *r.TotalSize() != size)) {
      std::string detail =
          r.status == 412
              ? (etag.empty() ? "If-Unmodified-Since " + modified : "If-Match " + etag) +
                    " failed (HTTP 412)"
          : other_time ? "Last-Modified " + modified + " then, " + r.last_modified + " now"
                       : "ETag " + etag + " then, " + r.etag + " now";
      if (r.status == 206 && r.TotalSize() && *r.TotalSize() != size) {
        detail = std::to_string(size) + " bytes then, " + std::to_string(*r.TotalSize()) + " now";
      }
      return Status(Code::kIoError,
                    target.name + ": file changed since the checkpoint was opened: " + detail +
                        " (" + what + ")");
    }
    received += r.body_bytes;
    // Every byte, checked against the version opened: done, also when the transfer failed after
    // the last one (a stream reset after the last frame, a lost end of a chunked body); asking
    // again would ask for an empty, inverted range.
    if (received == dst.size() && r.rejected.empty()) return Status::Ok();
    if (r.cancelled) return CancelledRead(target.name, what);
    const bool capped = r.status == 206 && r.curl_code == 0 && r.rejected.empty();
    if (capped && r.body_bytes > 0 &&
        (r.body_bytes >= kMinCappedResponse || short_capped++ < kShortCappedResponses)) {
      // A well-formed 206 for the start of the range asked (a server or gateway that caps its
      // responses): not a failure; the rest is asked for at once, as no retry. Each such
      // response brings at least kMinCappedResponse bytes, but for a few (a cap at aligned
      // boundaries cuts the first response of a range anywhere), so this ends soon.
      continue;
    }
    Verdict v = Judge(r);
    if (r.status >= 200 && r.status <= 299 && r.curl_code == 0 && r.rejected.empty()) {
      // A complete response with fewer bytes than asked; a capped one with fewer than
      // kMinCappedResponse after kShortCappedResponses such (a server dripping a few bytes per
      // response would otherwise be asked again without end): retried, each time counted.
      v.retryable = true;
      v.why += " (body ended after " + std::to_string(received) + " of " +
               std::to_string(dst.size()) + " bytes";
      if (capped && r.body_bytes > 0) {
        v.why += "; a 206 of " + std::to_string(r.body_bytes) + " bytes for " +
                 std::to_string(dst.size() - (received - r.body_bytes)) +
                 " asked: a server capping its responses must send at least " +
                 std::to_string(kMinCappedResponse) + " bytes each";
      }
      v.why += ")";
    }
    if (!v.retryable || attempt >= options_.retries) {
      if (received > 0 && received < dst.size()) {
        v.why += "; " + std::to_string(received) + " of " + std::to_string(dst.size()) +
                 " bytes received";
      }
      return Failed(target, what, v, attempt + 1);
    }
    if (!Backoff(attempt)) return CancelledRead(target.name, what);
    ++attempt;
    retry = true;
  }
}

Result<std::vector<std::string>> ObjectSource::List(const std::string& dir,
                                                    std::string_view suffix) {
  TF_ASSIGN_OR_RETURN(ObjectUrl url, ParseObjectUrl(dir));
  if (!IsBucketScheme(url.scheme)) {
    return Status(Code::kNotFound, url.ToString() +
                                       ": an HTTP server cannot be listed: give the URL of its "
                                       "model.safetensors.index.json or of a .safetensors file");
  }
  TF_ASSIGN_OR_RETURN(const HttpClient* client, Client(url.scheme));
  (void)client;
  std::string prefix = url.key;
  if (!prefix.empty() && prefix.back() != '/') prefix += '/';
  Target target;
  target.scheme = url.scheme;
  target.url = url;
  target.name = url.ToString();
  std::vector<std::string> out;
  std::string token;
  std::set<std::string> tokens;  // a token given twice would list the same pages forever
  for (int page = 0;; ++page) {
    if (page == 100000) {
      return Status(Code::kIoError,
                    target.name + ": listing \"" + prefix + "\" did not end after 100000 pages");
    }
    // SigV4 signs the query as sent: parameters in byte order, values encoded.
    const std::string query = ListObjectsV2Query(prefix, token, "/");
    ObjectUrl bucket = url;
    bucket.key.clear();
    HttpRequest req;
    req.url = BucketConfig(url.scheme).ObjectRequestUrl(bucket, query);
    req.text_limit = 64u << 20;
    TF_ASSIGN_OR_RETURN(
        HttpResponse r,
        Send(target, req, "list (ListObjectsV2 prefix \"" + prefix + "\")",
             [](const HttpResponse& x) { return x.status == 200 && x.curl_code == 0; }));
    Result<ListPage> listed = ParseListObjectsV2(r.text);
    if (!listed.ok()) return listed.status().WithPrefix(target.name);
    for (const ListedObject& o : listed->objects) {
      if (o.key.size() < prefix.size() + suffix.size() ||
          o.key.compare(0, prefix.size(), prefix) != 0)
        continue;
      const std::string_view rest = std::string_view(o.key).substr(prefix.size());
      if (rest.find('/') != std::string_view::npos || rest.size() < suffix.size() ||
          rest.substr(rest.size() - suffix.size()) != suffix)
        continue;
      ObjectUrl found = url;
      found.key = o.key;
      out.push_back(found.ToString());
    }
    if (!listed->truncated) break;
    if (listed->next_token.empty()) {
      // (a server answering in ListObjects version 1's way, with a NextMarker: the rest of the
      // listing cannot be asked for, and a partial listing would pass for the whole)
      return Status(Code::kIoError,
                    target.name + ": listing \"" + prefix + "\": page " + std::to_string(page + 1) +
                        " is truncated but carries no NextContinuationToken (does the store "
                        "answer ListObjectsV2?); the rest of the listing cannot be asked for");
    }
    if (!tokens.insert(listed->next_token).second) {
      return Status(Code::kIoError, target.name + ": listing \"" + prefix + "\": the store gave " +
                                        "the same continuation token twice (page " +
                                        std::to_string(page + 1) + "); the listing would not end");
    }
    token = listed->next_token;
  }
  std::sort(out.begin(), out.end());
  return out;
}

// --- ObjectFile --------------------------------------------------------------------------------

bool ObjectFile::FromPrefix(uint64_t offset, std::span<std::byte> dst) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (prefix_.empty()) return false;
  if (offset + dst.size() > prefix_.size()) {
    std::vector<std::byte>().swap(prefix_);  // data reads have begun: the prefix is done
    return false;
  }
  std::memcpy(dst.data(), prefix_.data() + offset, dst.size());
  // The header's second read (the whole header from byte 0) is the prefix's last use.
  if (offset == 0 && dst.size() > 8) std::vector<std::byte>().swap(prefix_);
  return true;
}

Result<size_t> ObjectFile::Read(uint64_t offset, std::span<std::byte> dst) const {
  if (offset >= identity_.size || dst.empty()) return size_t{0};
  const size_t n = static_cast<size_t>(std::min<uint64_t>(dst.size(), identity_.size - offset));
  dst = dst.first(n);
  if (FromPrefix(offset, dst)) return n;
  const uint64_t part = std::max<uint64_t>(source_->PartSize(), 1u << 20);
  for (uint64_t at = 0; at < n; at += part) {
    const size_t len = static_cast<size_t>(std::min<uint64_t>(part, n - at));
    TF_RETURN_IF_ERROR(source_->ReadRange(target_, version_, identity_.size, offset + at,
                                          dst.subspan(static_cast<size_t>(at), len)));
  }
  return n;
}

namespace {

// The sources whose last user let go while their caches were still copying: each is destroyed
// (~ObjectCache waits for its downloads) on a thread of its own, so that closing a checkpoint
// does not wait for the local disk. WaitForObjectCaches waits for them; so does the process's
// exit (atexit, registered at the first source handed over: after libcurl's and OpenSSL's, whose
// handlers thus run after it), in the process that handed them over only (not in a forked
// child, which has none of its threads). A source let go once that exit handler has run is
// destroyed at once (waiting for its copies: nothing waits for a later thread). A source made by
// another process (inherited through fork) is left alone: its caches' threads and locks are that
// process's. Never destroyed: a thread may still be returning from its work when the process
// exits.
class Finisher {
 public:
  static Finisher& Get() {
    static Finisher* const finisher = new Finisher;
    return *finisher;
  }
  // Destroys `source` now when its caches are idle, else in the background.
  void Release(ObjectSource* source) {
    if (source->Inherited()) return;  // never used here: its memory is all it costs
    if (!source->Copying()) {
      delete source;
      return;
    }
    bool exiting = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pid_ != ::getpid()) {  // the first, or the first in a forked child
        pid_ = ::getpid();
        pending_ = 0;
        exiting_ = false;
        if (!registered_) {
          std::atexit([] {
            Finisher& f = Get();
            {
              std::lock_guard<std::mutex> held(f.mu_);
              f.exiting_ = f.pid_ == ::getpid();
            }
            f.Wait();
          });
        }
        registered_ = true;
      }
      exiting = exiting_;
      if (!exiting) ++pending_;
    }
    const std::array<uint64_t, 2> before = source->CacheErrors();
    if (exiting) {
      Finish(source, before);
      return;
    }
    try {
      std::thread([this, source, before] {
        Finish(source, before);
        Done();
      }).detach();
    } catch (const std::system_error&) {  // no thread to be had (a process at its limit)
      Finish(source, before);
      Done();
    }
  }
  // The failures recorded since the last call (TakeObjectCacheFailures).
  std::vector<std::string> TakeFailures() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    if (failures_dropped_ > 0) {
      std::string note = std::to_string(failures_dropped_);
      note.append(" earlier failures not kept");
      out.push_back(std::move(note));
      failures_dropped_ = 0;
    }
    out.insert(out.end(), failures_.begin(), failures_.end());
    failures_.clear();
    return out;
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (pid_ != ::getpid()) return;
    done_.wait(lock, [this] { return pending_ == 0; });
  }
  bool WaitFor(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (pid_ != ::getpid()) return true;
    return done_.wait_for(lock, timeout, [this] { return pending_ == 0; });
  }
  bool Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return pid_ == ::getpid() && pending_ != 0;
  }

 private:
  static constexpr size_t kMaxFailures = 256;
  // Lets `source`'s copies end, records how they failed, destroys it.
  void Finish(ObjectSource* source, const std::array<uint64_t, 2>& before) {
    std::vector<std::string> failures = source->FinishCopies(before);
    delete source;
    if (failures.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (std::string& why : failures) {
      if (failures_.size() == kMaxFailures) {
        failures_.pop_front();
        ++failures_dropped_;
      }
      failures_.push_back(std::move(why));
    }
  }
  void Done() {
    std::lock_guard<std::mutex> lock(mu_);
    --pending_;
    done_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable done_;
  pid_t pid_ = 0;
  size_t pending_ = 0;  // sources being destroyed
  bool registered_ = false;
  bool exiting_ = false;              // the exit handler has run (in pid_)
  std::deque<std::string> failures_;  // copies that failed in the background, not yet taken
  uint64_t failures_dropped_ = 0;     // the oldest of them, not kept (over kMaxFailures)
};

}  // namespace

}  // namespace objstore

// --- diagnosis ---------------------------------------------------------------------------------

namespace objstore {

namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

ObjectStoreReport ObjectSource::Describe(const std::string& url) {
  ObjectStoreReport report;
  report.url = RedactUrl(url);  // no password, no signed link's query
  if (IsHubPath(url)) {
    report.settings =
        Status(Code::kUnsupported,
               report.url +
                   ": a Hugging Face hub path: doctor does not probe hub paths (a load reads it "
                   "from the local hub cache " +
                   HubCacheDir() + ", else from the hub " + RedactUrl(HubEndpoint()) +
                   " at <repo>/resolve/<commit>/<path>: give that https:// URL to probe the hub)");
    return report;
  }
  Result<ObjectUrl> parsed = ParseObjectUrl(url);  // its message names the URL redacted
  if (!parsed.ok()) {
    report.settings = parsed.status();
    return report;
  }
  const Scheme scheme = parsed->scheme;
  report.store = scheme == Scheme::kS3 ? "s3" : scheme == Scheme::kGs ? "gs" : "http";
  Result<const HttpClient*> client = Client(scheme);
  if (!client.ok()) {
    report.settings = client.status();
    return report;
  }
  // The request a load sends for `asked` (a listing: the bucket's, its query naming the prefix).
  const auto request_url = [&](const ObjectRequest& asked) -> std::string {
    Result<ObjectUrl> object = ParseObjectUrl(asked.url);
    if (!object.ok()) return RedactUrl(asked.url);
    if (!IsBucketScheme(scheme)) return object->ToString();
    if (asked.list) object->key.clear();
    return BucketConfig(scheme).ObjectRequestUrl(*object);
  };
  if (IsBucketScheme(scheme)) {
    const S3Config& c = BucketConfig(scheme);
    report.endpoint = c.endpoint;
    report.endpoint_from = c.endpoint_from;
    report.region = c.region;
    report.region_from = c.region_from;
    report.addressing = c.UsesPathStyle(*parsed) ? "path-style" : "virtual-hosted";
    report.credentials_from = c.credentials_from;
  } else {
    report.credentials_from = http_token_.For(parsed->origin).empty()
                                  ? "none"
                                  : "a bearer token from " + http_token_.from;
  }
  // Keys or tokens that are fetched: once now, timed.
  const HttpSettings& hs = (*client)->settings();
  const auto start = std::chrono::steady_clock::now();
  if (hs.aws_credentials != nullptr) {
    Result<AwsKeys> keys = hs.aws_credentials->Get();
    report.credentials_seconds = SecondsSince(start);
    if (!keys.ok()) {
      report.credentials_status = keys.status();
    } else if (keys->access_key_id.empty()) {
      report.credentials = "none (no role for this instance): unsigned requests";
    } else {
      const std::string& id = keys->access_key_id;
      report.credentials = "key ****" + id.substr(id.size() > 4 ? id.size() - 4 : 0) +
                           (keys->session_token.empty() ? "" : " with a session token");
    }
  } else if (hs.bearer != nullptr) {
    Result<std::string> token = hs.bearer->Get();
    report.credentials_seconds = SecondsSince(start);
    if (!token.ok()) {
      report.credentials_status = token.status();
    } else {
      report.credentials = "an OAuth 2 access token";
    }
  }
  if (!report.credentials_status.ok()) return report;  // the probe would fail the same way
  // The requests a load makes first (FindCheckpointObjects: one resolution for both), then, for
  // an index or a file named by the URL, its first GET as a load's open makes it.
  const auto asked_at = std::chrono::steady_clock::now();
  std::vector<ObjectRequest> asked;
  Result<CheckpointObjects> found = FindCheckpointObjects(*this, *parsed, &asked);
  std::unique_ptr<SourceFile> file;
  if (found.ok() && !found->listed && found->opened == nullptr) {
    const std::string& object = found->index.empty() ? found->files.front() : found->index;
    asked.push_back(ObjectRequest{object, false});
    Result<std::unique_ptr<SourceFile>> opened = Open(object, nullptr);
    if (opened.ok()) {
      file = std::move(opened).value();
    } else {
      found = opened.status();
    }
  } else if (found.ok()) {
    file = std::move(found->opened);
  }
  report.probe_seconds = SecondsSince(asked_at);
  // Each request in order; the answer is that of the last. What the earlier ones did not find
  // (a prefix's index) is said first.
  for (size_t i = 0; i < asked.size(); ++i) {
    if (i > 0) report.request_url += " then ";
    report.request_url += request_url(asked[i]);
    if (i + 1 < asked.size()) report.probe += "no " + asked[i].url + "; ";
  }
  if (!found.ok()) {
    report.probe_status = found.status();
    report.probe.clear();
    return report;
  }
  if (found->listed) {
    report.probe += std::to_string(found->files.size()) + " *.safetensors object" +
                    (found->files.size() == 1 ? "" : "s") +
                    " directly under the prefix (ListObjectsV2)";
    return report;
  }
  report.probe += "object of " + std::to_string(file->identity().size) + " bytes";
  if (const auto* object = dynamic_cast<const ObjectFile*>(file.get())) {
    report.probe += ", " + object->version().Text();
  }
  return report;
}

}  // namespace objstore

ObjectStoreReport DescribeObjectStore(const std::string& url, const ObjectStoreOptions& options,
                                      const std::atomic<bool>* cancel) {
  // Its requests and credential fetches run on this thread.
  const io::CancelScope cancelled(cancel);
  ObjectStoreOptions direct = options;  // the store itself is asked, never a local copy
  direct.cache_dir.clear();
  direct.hub_cache = false;
  Result<std::shared_ptr<Source>> source = MakeObjectSource(direct);
  if (!source.ok()) {
    ObjectStoreReport report;
    report.url = objstore::RedactUrl(url);
    report.settings = source.status();
    return report;
  }
  return static_cast<objstore::ObjectSource&>(**source).Describe(url);
}

Result<std::shared_ptr<Source>> MakeObjectSource(const ObjectStoreOptions& options) {
  if (options.part_size != 0 && options.part_size < 4096) {
    return Status(Code::kInvalidArgument,
                  "object_part_size must be at least 4096 bytes (or 0: automatic)");
  }
  // Its last owner lets the caches' copies finish in the background (Finisher).
  return std::shared_ptr<Source>(new objstore::ObjectSource(options), [](Source* source) {
    objstore::Finisher::Get().Release(static_cast<objstore::ObjectSource*>(source));
  });
}

void WaitForObjectCaches() {
  objstore::Finisher::Get().Wait();
}

bool WaitForObjectCaches(std::chrono::milliseconds timeout) {
  return objstore::Finisher::Get().WaitFor(timeout);
}

void AbandonObjectCaches() {
  objstore::AbandonDownloads();
}

std::vector<std::string> TakeObjectCacheFailures() {
  return objstore::Finisher::Get().TakeFailures();
}

bool ObjectCachesCopying() {
  return objstore::Finisher::Get().Pending();
}

namespace {

Result<std::unique_ptr<SourceFile>> OpenObject(const std::string& url,
                                               const ObjectStoreOptions& options) {
  if (!IsObjectUrl(url)) {
    return Status(Code::kInvalidArgument,
                  "\"" + RedactUrl(url) + "\" is not an s3://, gs://, http:// or https:// URL");
  }
  TF_ASSIGN_OR_RETURN(std::shared_ptr<Source> source, MakeObjectSource(options));
  // The file keeps its source alive (ObjectFile holds it).
  return source->Open(url);
}

// The whole of an opened object, unless it is larger than `max_bytes`.
Result<std::vector<std::byte>> ReadWhole(const SourceFile& file, const std::string& url,
                                         uint64_t max_bytes) {
  TF_ASSIGN_OR_RETURN(const uint64_t size, file.Size());
  if (size > max_bytes) {
    return Status(Code::kInvalidArgument, url + ": the object is " + std::to_string(size) +
                                              " bytes, more than the " + std::to_string(max_bytes) +
                                              " this read allows");
  }
  std::vector<std::byte> bytes(static_cast<size_t>(size));
  TF_RETURN_IF_ERROR(ReadFully(file, 0, bytes));
  return bytes;
}

}  // namespace

Result<uint64_t> ObjectSize(const std::string& url, const ObjectStoreOptions& options,
                            const std::atomic<bool>* cancel) {
  const io::CancelScope cancelled(cancel);
  TF_ASSIGN_OR_RETURN(std::unique_ptr<SourceFile> file, OpenObject(url, options));
  return file->Size();
}

Result<std::vector<std::byte>> ReadObject(const std::string& url, const ObjectStoreOptions& options,
                                          uint64_t max_bytes, const std::atomic<bool>* cancel) {
  const io::CancelScope cancelled(cancel);
  TF_ASSIGN_OR_RETURN(std::unique_ptr<SourceFile> file, OpenObject(url, options));
  return ReadWhole(*file, url, max_bytes);
}

Result<std::vector<std::string>> ListObjects(const std::string& dir, std::string_view suffix,
                                             const ObjectStoreOptions& options,
                                             const std::atomic<bool>* cancel) {
  const io::CancelScope cancelled(cancel);
  TF_ASSIGN_OR_RETURN(std::shared_ptr<Source> source, MakeObjectSource(options));
  return source->List(dir, suffix);
}

Result<std::vector<std::byte>> ReadObject(Source& source, const std::string& url,
                                          uint64_t max_bytes) {
  TF_ASSIGN_OR_RETURN(std::unique_ptr<SourceFile> file, source.Open(url));
  return ReadWhole(*file, url, max_bytes);
}

}  // namespace tensorferry
