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

#include "objstore/credentials_common.h"
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
  // False when unsigned requests are refused (anonymous = 0): fetched keys that turn out to be
  // none (an instance without a role) are then an error.
  bool unsigned_allowed = true;
  std::string access_key_id, secret_access_key, session_token;
  std::string
      credentials_from;  // where the keys came from, for messages: "options",
                         // "environment (AWS_ACCESS_KEY_ID)", "profile \"x\" in
                         // /root/.aws/credentials", or "none found: anonymous" (no credentials
                         // anywhere -> unsigned requests, not an error); "options: anonymous" /
                         // "environment (AWS_NO_SIGN_REQUEST)" when asked for.
  // Where temporary keys are fetched from when none are given (aws_credentials.h fetches them,
  // and again before they expire): kKeys means the keys above (or anonymous).
  enum class CredentialSource {
    kKeys,
    kWebIdentity,
    kAssumeRole,
    kProcess,
    kContainer,
    kInstanceMetadata
  };
  CredentialSource credential_source = CredentialSource::kKeys;
  // kWebIdentity: STS AssumeRoleWithWebIdentity at sts_endpoint ("scheme://host[:port]") with the
  // token in web_identity_token_file (read at each fetch), for role_arn, as role_session_name.
  std::string web_identity_token_file, role_arn, role_session_name, sts_endpoint;
  // kAssumeRole: STS AssumeRole at sts_endpoint for role_arn as role_session_name, signed with
  // the source keys (the source_profile's, or the environment's for credential_source =
  // Environment); external_id and duration_seconds ("" when unset) sent when set.
  std::string source_access_key_id, source_secret_access_key, source_session_token;
  std::string external_id, duration_seconds;
  std::string credential_process;  // kProcess: the command, run by /bin/sh -c
  // kContainer: GET container_uri with "Authorization: " + the contents of container_token_file
  // (read at each fetch) when set, else container_token (when set).
  std::string container_uri, container_token, container_token_file;
  std::string imds_endpoint;  // kInstanceMetadata: "scheme://host[:port]" of IMDSv2
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

// Precedence for every setting: explicit request, then environment, then the profile (config file
// `[profile NAME]` / `[default]` and credentials file `[NAME]`; for a key in both, the
// credentials file wins, as in the AWS CLI), then the default.
// - credentials, first found wins (botocore's order, less the sources not implemented):
//   1. anonymous=1 (request, or AWS_NO_SIGN_REQUEST=true/1 when the request leaves it unset).
//   2. Request keys. (A profile named in the request then wins over the environment's keys.)
//   3. AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN).
//   3b. A role the profile assumes (role_arn with source_profile, whose static keys sign STS
//      AssumeRole, or with credential_source = Environment: the environment's keys); mfa_serial,
//      a source that assumes a role itself or has no static keys, and other credential_sources
//      are kUnsupported. STS endpoint as for web identity.
//   4. Web identity (EKS IRSA): AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN (+
//      AWS_ROLE_SESSION_NAME), else the profile's web_identity_token_file + role_arn (+
//      role_session_name); one without the other is an error. STS endpoint: AWS_ENDPOINT_URL_STS,
//      AWS_ENDPOINT_URL, the profile's sts.endpoint_url / endpoint_url ([services] too), else
//      https://sts.<region>.amazonaws.com (".amazonaws.com.cn" for cn-*).
//   5. The profile's aws_access_key_id/aws_secret_access_key/aws_session_token in the
//      credentials file; 6. its credential_process; 7. its keys in the config file.
//   8. Container credentials (EKS Pod Identity, ECS): AWS_CONTAINER_CREDENTIALS_FULL_URI (http://
//      only to a loopback address or 169.254.170.2, 169.254.170.23, [fd00:ec2::23]; else
//      kInvalidArgument), else http://169.254.170.2 + AWS_CONTAINER_CREDENTIALS_RELATIVE_URI;
//      Authorization from AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE, else
//      AWS_CONTAINER_AUTHORIZATION_TOKEN.
//   9. The EC2 instance metadata service (IMDSv2), unless AWS_EC2_METADATA_DISABLED=true/1, when
//      AWS_EC2_METADATA_SERVICE_ENDPOINT or the profile's ec2_metadata_service_endpoint names
//      it, or the machine says it is an EC2 instance (ec2_probe_dir: DMI sys_vendor or
//      bios_vendor "Amazon EC2", bios_version "*amazon"); else http://169.254.169.254.
//   10. Nothing: anonymous (unsigned requests), and credentials_from says so; anonymous=0 then
//      is an error.
//   A key id without its secret (or the reverse), in any one place, is an error. A profile that
//   names only a source not implemented (sso_session, sso_start_url; role_arn with nothing to
//   assume it with) is kUnsupported. Sources 3b, 4, 6, 8 and 9 are fetched later, by
//   AwsCredentials (aws_credentials.h): credential_source says which, keys stay empty.
// - profile: request, AWS_DEFAULT_PROFILE, AWS_PROFILE (botocore's order), "default". A profile
// named explicitly (request or
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
Result<S3Config> ResolveS3Config(const S3Request& request, const GetEnv& env = ProcessEnv(),
                                 const std::string& ec2_probe_dir = "/sys/class/dmi/id");

// One parsed AWS INI file: section name (as written between the brackets, whitespace-trimmed and
// inner runs of whitespace collapsed to one space: "profile x") -> key -> value. Keys are
// lower-cased (as configparser does; sub-keys are kept as written), values trimmed. Nested
// sub-section keys are "parent.key" ("s3.endpoint_url"). Later duplicates win. Exposed for tests.
using AwsIni = std::map<std::string, std::map<std::string, std::string>>;
// Errors: kInvalidArgument "<file>:<line>: <problem>" for a malformed line.
Result<AwsIni> ParseAwsIni(std::string_view text, std::string_view file);

}  // namespace tensorferry::objstore
