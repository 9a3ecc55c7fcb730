// Internal: Google Cloud Storage (gs://bucket/key) settings and credentials.
//
// gs:// objects are read through GCS's S3-compatible XML API (path-style GETs with Range and
// If-Match; errors are the same <Error><Code>..</Code> documents; listings ListObjectsV2), so the
// object source treats them like s3:// objects with a different endpoint and different credentials.
//
// Credentials, first found wins (Google's "Application Default Credentials" order, plus the two
// explicit forms the XML API takes):
//   1. anonymous = 1 (options): unsigned requests (public buckets).
//   2. HMAC keys (options access_key_id + secret_access_key): AWS Signature V4, region "auto"
//      (or the region option: a server that checks the region signed, like SeaweedFS).
//   3. An OAuth 2 access token (options token, else GOOGLE_OAUTH_ACCESS_TOKEN): sent as is.
//   4. GOOGLE_APPLICATION_CREDENTIALS (a file that must exist), else gcloud's
//      application_default_credentials.json ($CLOUDSDK_CONFIG, else $HOME/.config/gcloud) when
//      present: "authorized_user" (a refresh token, exchanged at its token_uri) or
//      "service_account" (a private key: a signed JWT exchanged at its token_uri). Other types
//      (external_account, impersonated_service_account, ...) are kUnsupported naming the file.
//   5. The metadata server of a Google Cloud VM or GKE pod, asked when GCE_METADATA_HOST is set or
//      the machine says it is a Google Compute Engine VM (/sys/class/dmi/id/product_name).
//   6. Nothing: anonymous requests, and credentials_from says so.
// The AWS_* variables and ~/.aws files never apply to gs:// URLs.
//
// Endpoint: options endpoint, else https://storage.googleapis.com; always path-style.
//
// Contract:
//   * ResolveGcsConfig reads the environment only through the GetEnv given and reads only the
//     credentials file it names (and the DMI product file); no network I/O.
//   * BearerTokens fetches tokens over HTTP (its own HttpClient) and caches them; thread-safe.
//   * Errors are values naming the file, URL, HTTP status and the server's error text; secrets
//     (tokens, keys, refresh tokens) never appear in messages.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "objstore/aws_config.h"
#include "objstore/credentials_common.h"
#include "objstore/http.h"
#include "tensorferry/status.h"

namespace tensorferry::objstore {

inline constexpr const char* kGcsDefaultEndpoint = "https://storage.googleapis.com";
inline constexpr const char* kGcsReadScope = "https://www.googleapis.com/auth/devstorage.read_only";
inline constexpr const char* kGoogleTokenUri = "https://oauth2.googleapis.com/token";

struct GcsRequest {  // what the user set explicitly; empty / -1 = not set
  std::string endpoint, region, access_key_id, secret_access_key, token;
  int anonymous = -1;
};

enum class GcsTokenKind { kNone, kStatic, kAuthorizedUser, kServiceAccount, kMetadata };

struct GcsConfig {
  // Endpoint, path-style addressing, region "auto", HMAC keys (or anonymous), and where each came
  // from (credentials_from names the token's source too): what ObjectRequestUrl and messages use.
  S3Config s3;
  GcsTokenKind token_kind = GcsTokenKind::kNone;
  std::string token;                                      // kStatic
  std::string token_uri;                                  // kAuthorizedUser, kServiceAccount
  std::string client_id, client_secret, refresh_token;    // kAuthorizedUser
  std::string client_email, private_key, private_key_id;  // kServiceAccount (PEM private key)
  std::string metadata_host;                              // kMetadata: "host[:port]"
  std::string credentials_file;                           // the ADC file, when one was read
};

// Errors: kInvalidArgument (a bad endpoint, half an HMAC pair, a malformed credentials file or a
// field it lacks, anonymous=0 with nothing found), kNotFound (GOOGLE_APPLICATION_CREDENTIALS names
// no file), kIoError (a file that cannot be read), kUnsupported (a credentials type not read).
Result<GcsConfig> ResolveGcsConfig(
    const GcsRequest& request, const GetEnv& env = ProcessEnv(),
    const std::string& dmi_product_file = "/sys/class/dmi/id/product_name");

// OAuth 2 access tokens for one GcsConfig, fetched when first needed and again 5 minutes before
// they expire (or after the server refused one). One fetch at a time; other callers wait for it.
class BearerTokens {
 public:
  // Null for configurations without tokens (HMAC keys, anonymous). `transport`: timeouts and TLS
  // for the token requests. The same credentials and transport get the same object for the life
  // of the process, so every source opened with them shares one token.
  static Result<std::shared_ptr<BearerTokens>> Make(const GcsConfig& config,
                                                    const HttpSettings& transport);
  ~BearerTokens();

  // The token to send. Errors name where it was asked for (URL, status, the server's error).
  Result<std::string> Get();
  // The server answered 401 to `token`: forget it so that the next Get fetches a new one. Returns
  // false when that cannot help (a token given by the user).
  bool Refuse(const std::string& token);
  // How many tokens were fetched (tests, stats).
  uint64_t fetches() const;

 private:
  BearerTokens(GcsConfig config, std::unique_ptr<HttpClient> client);
  Result<std::pair<std::string, std::chrono::seconds>> Fetch() const;

  const GcsConfig config_;
  const std::unique_ptr<HttpClient> client_;  // null for kStatic
  Refreshing<std::string> tokens_;
};

// Reads one Application Default Credentials JSON document (`source` names it in errors) into
// `c`: token_kind, token_uri and the fields of its type, credentials_from. Errors as
// ResolveGcsConfig's for a file; never quoting a secret. Exposed for tests and the fuzzer.
Status ParseGcsCredentials(std::string_view text, const std::string& source, GcsConfig& c);

// The access token and its lifetime (expires_in, default 3600 s, at most a day) of a token
// endpoint's 200 answer; kIoError "<where>: ..." when it has none or one that cannot go in a
// header. Exposed for tests and the fuzzer.
Result<std::pair<std::string, std::chrono::seconds>> ParseTokenAnswer(std::string_view text,
                                                                      const std::string& where);

// base64url without padding (RFC 7515), as JWTs use.
std::string Base64Url(std::string_view bytes);
// The RS256 signature (base64url) of `signing_input` with the PEM private key `pem`
// (PKCS#8 "BEGIN PRIVATE KEY" or PKCS#1 "BEGIN RSA PRIVATE KEY"). Errors: kInvalidArgument.
Result<std::string> SignRs256(std::string_view pem, std::string_view signing_input);
// The JWT a service account exchanges for a token: header {alg RS256, typ JWT, kid}, claims
// {iss: client_email, scope: read-only storage, aud: token_uri, iat: now, exp: now + 3600}.
Result<std::string> ServiceAccountAssertion(const GcsConfig& config, int64_t now_seconds);

}  // namespace tensorferry::objstore
