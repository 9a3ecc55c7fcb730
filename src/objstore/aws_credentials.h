// Internal: AWS credentials that are fetched rather than given, as the AWS SDKs fetch them: web
// identity (STS AssumeRoleWithWebIdentity: EKS IRSA), a role a profile assumes with static keys
// (STS AssumeRole, signed), a profile's credential_process, container
// credentials (EKS Pod Identity, ECS) and the EC2 instance metadata service (IMDSv2).
// ResolveS3Config (aws_config.h) decides which, without I/O; AwsCredentials fetches the keys when
// first needed and again before they expire, for every request of every source that shares them.
//
// Contract:
//   * AwsCredentials is thread-safe; one fetch at a time (Refreshing: others go on with the keys
//     it replaces while they are good). Fetches go through an HttpClient of its own (unsigned;
//     the transport's TLS settings; 1 s and one attempt per request for the instance metadata
//     service, 5 s for container endpoints) or a child process (credential_process: /bin/sh -c
//     with the caller's stdin (and its process group when stdin is a terminal, else one of its
//     own), its stdout read, at most 1 MiB; done when it
//     exits; killed after kProcessTimeout or when the calling thread's load is cancelled,
//     io::CancelScope).
//   * The web identity token file and the container authorization token file are read at each
//     fetch (Kubernetes rotates them).
//   * Errors are values: kIoError naming where the keys were
//     asked for (the STS endpoint and "AssumeRoleWithWebIdentity" or "AssumeRole", the container
//     URI, the command's exit status and the end of its stderr, the metadata endpoint), the HTTP
//     status and the service's error code; keys, session tokens and identity or authorization
//     tokens never appear in messages.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "objstore/aws_config.h"
#include "objstore/credentials_common.h"
#include "objstore/http.h"
#include "tensorferry/status.h"

namespace tensorferry::objstore {

inline constexpr std::chrono::seconds kProcessTimeout{300};

struct AwsKeys {
  std::string access_key_id, secret_access_key, session_token;  // no key id: send unsigned
};

// Keys and when they expire (nullopt: never).
struct TimedAwsKeys {
  AwsKeys keys;
  std::optional<std::chrono::sys_seconds> expiration;
};

class AwsCredentials {
 public:
  // Null for a configuration whose keys are given (or anonymous). The same configuration and
  // transport get the same object for the life of the process, so every source opened with them
  // shares one set of keys. Errors: those of HttpClient::Make.
  static Result<std::shared_ptr<AwsCredentials>> Make(const S3Config& config,
                                                      const HttpSettings& transport);
  ~AwsCredentials();
  AwsCredentials(const AwsCredentials&) = delete;
  AwsCredentials& operator=(const AwsCredentials&) = delete;

  // The keys to sign with; an empty key id when the instance metadata service has no role for
  // this machine (requests then go unsigned, as with no credentials anywhere).
  Result<AwsKeys> Get();
  // The store refused `keys` as expired or unknown (ExpiredToken, InvalidAccessKeyId, ...):
  // forget them so that the next Get fetches new ones. False when that cannot help: the same
  // keys were refused before, fetched again, and came back.
  bool Refuse(const AwsKeys& keys);
  uint64_t fetches() const;  // how many times keys were fetched (tests, stats)

 private:
  AwsCredentials(S3Config config, std::unique_ptr<HttpClient> client);
  Result<TimedAwsKeys> Fetch() const;
  // POSTs `form` to the STS endpoint (the client signs it or not) and reads the credentials.
  Result<TimedAwsKeys> AskSts(const std::string& action, std::string form) const;
  Result<TimedAwsKeys> FetchWebIdentity() const;
  Result<TimedAwsKeys> FetchAssumeRole() const;
  Result<TimedAwsKeys> FetchProcess() const;
  Result<TimedAwsKeys> FetchContainer() const;
  Result<TimedAwsKeys> FetchInstanceMetadata() const;

  const S3Config config_;
  const std::unique_ptr<HttpClient> client_;  // null for kProcess
  Refreshing<AwsKeys> keys_;
  // The instance metadata service answered keys once: from then on, no answer from it (a
  // throttled or briefly unreachable service) is an error, so that the keys held are kept until
  // they expire (Refreshing), not replaced by "no credentials here" (unsigned requests).
  mutable std::atomic<bool> imds_answered_keys_{false};
  std::mutex refused_mu_;
  AwsKeys refused_;  // the keys last refused and forgotten, and when
  std::chrono::steady_clock::time_point refused_at_{};
};

// "2026-11-30T20:14:49Z", with optional fractional seconds and a "+HH:MM"/"-HH:MM" offset in
// place of "Z"; nullopt for anything else.
std::optional<std::chrono::sys_seconds> ParseIso8601(std::string_view text);

// The keys of a JSON credentials document: a credential_process's output ({"Version": 1,
// "AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration"}) when `process`, else a
// container or instance metadata answer ({"AccessKeyId", "SecretAccessKey", "Token",
// "Expiration"}, and "Code" "Success" when present). Errors: kIoError "<where>: ..." (not JSON,
// a missing key id or secret, a Version other than 1, an Expiration that is not ISO 8601, a
// value that cannot go in an HTTP header). Exposed for tests and the fuzzer.
Result<TimedAwsKeys> ParseAwsCredentialsJson(std::string_view text, const std::string& where,
                                             bool process);

// Runs `command` with /bin/sh -c (the caller's stdin; signals at their defaults; no other
// descriptor of ours) and returns its stdout once it has exited (what a child it left behind
// writes later is not waited for); kIoError "<where>: ..." when it cannot be started, exits other
// than 0 (its status and the end of its stderr), writes more than 1 MiB, runs past `timeout`
// (killed), or its exit status is lost (SIGCHLD ignored); kCancelled when the calling thread's
// load is cancelled. Exposed for tests.
Result<std::string> RunCredentialProcess(const std::string& command, const std::string& where,
                                         std::chrono::milliseconds timeout);

}  // namespace tensorferry::objstore
