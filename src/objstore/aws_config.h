// Internal: S3 settings (endpoint, region, addressing style, credentials) resolved as the AWS CLI
// and SDKs resolve them, from what the user set explicitly, the environment and the two shared
// files (~/.aws/credentials, ~/.aws/config).
//
// Contract:
//   * ResolveS3Config reads the environment only through the GetEnv it is given (tests inject a
//     map; never the real environment) and does no I/O besides reading the two AWS files.
//   * Precedence for every setting: explicit request, then environment, then the profile, then
//     the default. The result records where the endpoint and the credentials came from, for
//     messages ("credentials from environment (AWS_ACCESS_KEY_ID)").
//   * Errors are values: kInvalidArgument for a bad setting or a malformed file (naming the file
//     and line, or where the setting came from), kIoError for a file that exists but cannot be
//     read. No credentials anywhere is not an error: requests are then sent unsigned.
//   * Thread-safe (no globals), as long as the GetEnv given is.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "objstore/url.h"
#include "tensorferry/status.h"

namespace tensorferry::objstore {

struct S3Request {  // what the user set explicitly (options/CLI/Python); empty/-1 = not set
  std::string endpoint, region, profile, access_key_id, secret_access_key, session_token;
  int anonymous = -1;   // -1 unset, 0 no, 1 yes
  int path_style = -1;  // -1 unset (auto), 0 virtual-hosted, 1 path-style
};

struct S3Config {
  std::string endpoint;  // "scheme://host[:port]" with no trailing '/'
  std::string region;
  // Path-style addressing (endpoint/bucket/key) rather than virtual-hosted (bucket.host/key).
  // With path_style_auto (nothing set it explicitly), path_style is the choice for the endpoint
  // (path-style unless it is an amazonaws.com host) and ObjectRequestUrl still uses path-style
  // for a bucket that cannot be a host-name label (a '.': TLS wildcard certificates; a '_').
  bool path_style = false;
  bool path_style_auto = true;
  bool anonymous = false;  // requests are sent unsigned
  std::string access_key_id, secret_access_key, session_token;
  std::string
      credentials_from;  // where the keys came from, for messages: "options",
                         // "environment (AWS_ACCESS_KEY_ID)", "profile \"x\" in
                         // /root/.aws/credentials", or "none found: anonymous" (no credentials
                         // anywhere -> unsigned requests, not an error); "options: anonymous" /
                         // "environment (AWS_NO_SIGN_REQUEST)" when asked for.
  std::string endpoint_from;  // likewise: "options", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL",
                              // "profile \"x\" (s3.endpoint_url) in <file>", "profile \"x\"
                              // (endpoint_url) in <file>", "AWS default"
  std::string region_from;    // "options", "AWS_REGION", "AWS_DEFAULT_REGION", "profile ...",
                              // "default"

  // True when `url` (s3) is addressed path-style with this configuration.
  bool UsesPathStyle(const ObjectUrl& url) const;
  // The URL to GET: path-style endpoint + "/" + bucket + "/" + PercentEncode(key, true), or
  // virtual-hosted scheme://bucket.host[:port]/ + PercentEncode(key, true). With an empty key
  // (a ListObjectsV2 request) the bucket URL: endpoint + "/" + bucket, or scheme://bucket.host/.
  // Query (already encoded, may be "") appended with '?'. For an http(s) URL: url.ToString()
  // with the query.
  std::string ObjectRequestUrl(const ObjectUrl& url, std::string_view query = "") const;
};

// The query of a ListObjectsV2 request (already encoded, parameters sorted by name as SigV4's
// canonical query wants them): "continuation-token=..&delimiter=..&list-type=2&prefix=..", with
// the empty ones left out (list-type=2 is always there). For S3Config::ObjectRequestUrl with the
// bucket's URL (key "").
std::string ListObjectsV2Query(std::string_view prefix, std::string_view continuation_token = "",
                               std::string_view delimiter = "");

// The whole file at `path`, at most 1 MiB (the AWS and Google credentials files, small system
// files); a character device (/dev/null: a file turned off) reads as empty. Errors name the path
// and `what` ("AWS file"): kNotFound when there is no file, kInvalidArgument over 1 MiB, kIoError
// for one that is not a regular file or cannot be read.
Result<std::string> ReadSmallFile(const std::string& path, std::string_view what);

// `value` ("http(s)://host[:port]", an optional trailing '/' stripped) as "scheme://host[:port]";
// else kInvalidArgument "<store> endpoint \"<value>\" from <from>: <problem>".
Result<std::string> NormalizeEndpoint(const std::string& value, const std::string& from,
                                      std::string_view store);

using GetEnv = std::function<std::optional<std::string>(const char* name)>;  // empty value = unset
GetEnv ProcessEnv();                                                         // std::getenv

// Precedence for every setting: explicit request, then environment, then the profile (config file
// `[profile NAME]` / `[default]` and credentials file `[NAME]`; for a key in both, the
// credentials file wins, as in the AWS CLI), then the default.
// - credentials: request keys; else AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+
// AWS_SESSION_TOKEN);
//   else profile aws_access_key_id/aws_secret_access_key/aws_session_token (credentials file first,
//   then config file); else anonymous. anonymous=1 (request, or AWS_NO_SIGN_REQUEST=true/1 when
//   the request leaves it unset) wins; anonymous=0 with no credentials found is an error. A key id
//   without its secret (or the reverse), in any one place, is an error. Only static keys are
//   read: a profile without keys that names another source (credential_process, role_arn,
//   sso_session, sso_start_url, web_identity_token_file, credential_source) is kUnsupported;
//   web-identity or container credentials in the environment (AWS_WEB_IDENTITY_TOKEN_FILE,
//   AWS_CONTAINER_CREDENTIALS_*) are not fetched, and credentials_from says so; the EC2 instance
//   metadata service is not asked.
// - profile: request, AWS_PROFILE, AWS_DEFAULT_PROFILE, "default". A profile named explicitly
// (request or
//   env) that exists in neither file is an error (kInvalidArgument naming the profile and both
//   files).
// - files: AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE (a leading "~/" is $HOME), else
//   $HOME/.aws/credentials, $HOME/.aws/config. Missing files are fine. INI syntax as the AWS CLI
//   reads it: full-line '#' and ';' comments (and, as the AWS SDKs do, a '#' or ';' preceded by
//   whitespace ends a value), whitespace around '=', nested sub-sections ("s3 =" followed by
//   indented "key = value" lines: s3.endpoint_url, s3.addressing_style = path|virtual|auto). As
//   in the CLI's configparser, a line indented deeper than the property before it continues that
//   property (a sub-property when its value is empty; else a further line of its value), and
//   properties may all be indented alike. A malformed line is an error naming file and line.
// - region: request, AWS_REGION, AWS_DEFAULT_REGION, profile region, "us-east-1". Must be made of
//   [A-Za-z0-9._-] (it goes into host names and the signature scope).
// - endpoint: request, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, profile s3.endpoint_url, profile
//   endpoint_url, else "https://s3.<region>.amazonaws.com" (".amazonaws.com.cn" for cn-*
//   regions). AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true/1 skips the environment and profile
//   endpoints. Must be http(s)://host[:port] with an optional path-less trailing '/' (stripped);
//   else kInvalidArgument naming where it came from.
// - path_style: request; profile s3.addressing_style; else auto = path-style when the endpoint is
//   not an amazonaws.com host (custom endpoints: SeaweedFS, MinIO, GCS interop...) or the bucket
//   has a '.' (TLS wildcard certificates), virtual-hosted otherwise. ObjectRequestUrl takes it.
Result<S3Config> ResolveS3Config(const S3Request& request, const GetEnv& env = ProcessEnv());

// One parsed AWS INI file: section name (as written between the brackets, whitespace-trimmed and
// inner runs of whitespace collapsed to one space: "profile x") -> key -> value. Keys are
// lower-cased (as configparser does; sub-keys are kept as written), values trimmed. Nested
// sub-section keys are "parent.key" ("s3.endpoint_url"). Later duplicates win. Exposed for tests.
using AwsIni = std::map<std::string, std::map<std::string, std::string>>;
// Errors: kInvalidArgument "<file>:<line>: <problem>" for a malformed line.
Result<AwsIni> ParseAwsIni(std::string_view text, std::string_view file);

}  // namespace tensorferry::objstore
