// AWS credentials fetched from STS, a process, a container endpoint or the instance metadata
// service (aws_credentials.h).
#include "objstore/aws_credentials.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <simdjson.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <utility>

#include "io/read_engine.h"
#include "objstore/s3_xml.h"
#include "objstore/url.h"
#include "util/macros.h"

extern char** environ;

namespace tensorferry::objstore {
namespace {

constexpr size_t kMaxAnswer = 64 << 10;          // a credentials endpoint's answer
constexpr size_t kMaxProcessOutput = 1 << 20;    // a credential_process's stdout
constexpr size_t kStderrKept = 2048;             // the end of its stderr, for messages
constexpr uint32_t kMetadataTimeoutMs = 1'000;   // IMDS answers at once or not at all
constexpr uint32_t kContainerTimeoutMs = 5'000;  // a node-local agent (EKS Pod Identity, ECS)

using Clock = std::chrono::system_clock;

// Whether `value` can be sent in an HTTP header (no control characters, no line breaks).
bool HeaderSafe(std::string_view value) {
  return std::all_of(value.begin(), value.end(),
                     [](char ch) { return static_cast<unsigned char>(ch) >= 32 && ch != 127; });
}

// "HTTP 403 AccessDenied: message" from an AWS XML error, else "HTTP 403: excerpt".
std::string HttpProblem(const HttpResponse& r) {
  std::string out = "HTTP " + std::to_string(r.status);
  if (auto error = ParseS3Error(r.text)) {
    out += " " + Excerpt(error->code, 80);
    if (!error->message.empty()) out += ": " + Excerpt(error->message);
    return out;
  }
  const std::string excerpt = Excerpt(r.text);
  return excerpt.empty() ? out : out + ": " + excerpt;
}

Status NoAnswer(const std::string& where, const HttpResponse& r) {
  if (r.cancelled) return Status(Code::kCancelled, where + ": the load was cancelled");
  return Status(Code::kIoError, where + ": no answer (" + r.curl_error + ")");
}

Status Refused(const std::string& where, const HttpResponse& r) {
  return Status(Code::kIoError, where + ": " + HttpProblem(r));
}

// The first line of a small file, trimmed (a token file). Errors name `what`.
Result<std::string> ReadTokenFile(const std::string& path, const std::string& prefix,
                                  std::string_view what) {
  Result<std::string> text = ReadSmallFile(path, what);
  if (!text.ok()) return Status(text.status().code(), prefix + ": " + text.status().message());
  std::string_view t = *text;
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) {
    t.remove_suffix(1);
  }
  while (!t.empty() && (t.front() == ' ' || t.front() == '\n')) t.remove_prefix(1);
  if (t.empty()) return Status(Code::kInvalidArgument, prefix + ": " + path + " is empty");
  return std::string(t);
}

std::optional<std::chrono::seconds> LifeOf(const TimedAwsKeys& k) {
  if (!k.expiration) return std::nullopt;
  return *k.expiration - std::chrono::time_point_cast<std::chrono::seconds>(Clock::now());
}

}  // namespace

// --- parsing -------------------------------------------------------------------------------------

std::optional<std::chrono::sys_seconds> ParseIso8601(std::string_view s) {
  const auto number = [&](size_t at, size_t n) -> std::optional<int> {
    if (at + n > s.size()) return std::nullopt;
    int v = 0;
    for (size_t i = at; i < at + n; ++i) {
      if (s[i] < '0' || s[i] > '9') return std::nullopt;
      v = v * 10 + (s[i] - '0');
    }
    return v;
  };
  if (s.size() < 20 || s[4] != '-' || s[7] != '-' || (s[10] != 'T' && s[10] != 't') ||
      s[13] != ':' || s[16] != ':') {
    return std::nullopt;
  }
  const auto year = number(0, 4), month = number(5, 2), day = number(8, 2), hour = number(11, 2),
             minute = number(14, 2), second = number(17, 2);
  if (!year || !month || !day || !hour || !minute || !second || *month < 1 || *month > 12 ||
      *day < 1 || *day > 31 || *hour > 23 || *minute > 59 || *second > 60) {
    return std::nullopt;
  }
  size_t at = 19;
  if (at < s.size() && s[at] == '.') {
    ++at;
    const size_t digits = at;
    while (at < s.size() && s[at] >= '0' && s[at] <= '9') ++at;
    if (at == digits) return std::nullopt;
  }
  int64_t offset = 0;
  if (at < s.size() && (s[at] == 'Z' || s[at] == 'z')) {
    ++at;
  } else if (at < s.size() && (s[at] == '+' || s[at] == '-')) {
    const auto oh = number(at + 1, 2), om = number(at + 4, 2);
    if (!oh || !om || at + 3 >= s.size() || s[at + 3] != ':' || *oh > 23 || *om > 59) {
      return std::nullopt;
    }
    offset = (s[at] == '+' ? 1 : -1) * (int64_t{*oh} * 3600 + int64_t{*om} * 60);
    at += 6;
  } else {
    return std::nullopt;
  }
  if (at != s.size()) return std::nullopt;
  std::tm tm{};
  tm.tm_year = *year - 1900;
  tm.tm_mon = *month - 1;
  tm.tm_mday = *day;
  tm.tm_hour = *hour;
  tm.tm_min = *minute;
  tm.tm_sec = *second;
  const time_t t = timegm(&tm);
  return std::chrono::sys_seconds(std::chrono::seconds(int64_t{t} - offset));
}

Result<TimedAwsKeys> ParseAwsCredentialsJson(std::string_view text, const std::string& where,
                                             bool process) {
  Result<std::map<std::string, std::string>> members = StringMembers(text, where);
  if (!members.ok()) return Status(Code::kIoError, members.status().message());
  const auto get = [&](const char* name) {
    auto it = members->find(name);
    return it == members->end() ? std::string() : it->second;
  };
  if (process) {
    simdjson::dom::parser parser;
    simdjson::dom::element root;
    int64_t version = 0;
    if (ParseJson(parser, text, root) != simdjson::SUCCESS ||
        root["Version"].get(version) != simdjson::SUCCESS || version != 1) {
      return Status(Code::kIoError, where + ": the output has no \"Version\": 1");
    }
  } else if (const std::string code = get("Code"); !code.empty() && code != "Success") {
    return Status(Code::kIoError,
                  where + ": the answer's Code is \"" + Excerpt(code, 64) + "\", not \"Success\"");
  }
  TimedAwsKeys out;
  out.keys.access_key_id = get("AccessKeyId");
  out.keys.secret_access_key = get("SecretAccessKey");
  out.keys.session_token = get(process ? "SessionToken" : "Token");
  if (out.keys.access_key_id.empty() || out.keys.secret_access_key.empty()) {
    return Status(Code::kIoError, where + ": the " + (process ? "output" : "answer") +
                                      " lacks \"AccessKeyId\" or \"SecretAccessKey\"");
  }
  if (!HeaderSafe(out.keys.access_key_id) || !HeaderSafe(out.keys.secret_access_key) ||
      !HeaderSafe(out.keys.session_token)) {
    return Status(Code::kIoError,
                  where + ": a key or token has a character not allowed in an HTTP header");
  }
  if (const std::string expiration = get("Expiration"); !expiration.empty()) {
    out.expiration = ParseIso8601(expiration);
    if (!out.expiration) {
      return Status(Code::kIoError, where + ": \"Expiration\" \"" + Excerpt(expiration, 64) +
                                        "\" is not an ISO 8601 time");
    }
  }
  return out;
}

// --- the process ---------------------------------------------------------------------------------

Result<std::string> RunCredentialProcess(const std::string& command, const std::string& where,
                                         std::chrono::milliseconds timeout) {
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
    return Status(Code::kIoError, where + ": cannot make a pipe: " + std::strerror(errno));
  }
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(out_pipe[0]), ::close(out_pipe[1]);
    return Status(Code::kIoError, where + ": cannot make a pipe: " + std::strerror(e));
  }
  // As the AWS SDKs run it: stdin and the process group are the caller's (a helper may ask for
  // an MFA code on the terminal), stdout and stderr are read.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], 2);
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);  // no descriptor of ours leaks into it
#endif
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t all;
  sigfillset(&all);
  posix_spawnattr_setsigdefault(&attr, &all);  // handlers and ignored signals reset
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  // With a terminal, the caller's process group (a helper may prompt on /dev/tty, which needs
  // the foreground group); without one, a group of its own, so that a timeout or a cancel kills
  // what it started too.
  const bool own_group = ::isatty(STDIN_FILENO) == 0;
  short flags = POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK;
  if (own_group) {
    posix_spawnattr_setpgroup(&attr, 0);
    flags |= POSIX_SPAWN_SETPGROUP;
  }
  posix_spawnattr_setflags(&attr, flags);
  const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
  pid_t pid = -1;
  const int spawned =
      posix_spawn(&pid, "/bin/sh", &actions, &attr, const_cast<char**>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (spawned != 0) {
    ::close(out_pipe[0]), ::close(err_pipe[0]);
    return Status(Code::kIoError, where + ": cannot start /bin/sh: " + std::strerror(spawned));
  }
  std::string out, err;
  std::string problem;  // why the process was killed, if it was
  bool cancelled = false;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  int status = 0;
  bool exited = false;
  bool status_lost = false;  // SIGCHLD ignored here: the kernel reaped it, its status is gone
  char buf[16384];
  // Until it has exited and both pipes are closed (a process may close them and go on, or exit
  // leaving a child that holds them), the output is too long, the time is up, or the load is
  // cancelled.
  while (problem.empty() && !(exited && open_fds == 0)) {
    if (open_fds > 0) {
      const int ready = ::poll(fds, 2, 50);
      if (ready < 0 && errno != EINTR) {
        problem = std::string("cannot wait for its output: ") + std::strerror(errno);
        break;
      }
      for (pollfd& p : fds) {
        if (p.fd < 0 || (p.revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const ssize_t n = ::read(p.fd, buf, sizeof buf);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n <= 0) {
          ::close(p.fd);
          p.fd = -1;
          --open_fds;
          continue;
        }
        if (p.fd == out_pipe[0]) {
          out.append(buf, static_cast<size_t>(n));
          if (out.size() > kMaxProcessOutput) problem = "it wrote more than 1 MiB to stdout";
        } else {
          err.append(buf, static_cast<size_t>(n));
          if (err.size() > 2 * kStderrKept) err.erase(0, err.size() - kStderrKept);
        }
      }
    } else {
      ::usleep(20'000);
    }
    if (!exited) {
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        exited = true;
        // Its output is whole once it exited and nothing else holds the pipes; what a child it
        // left behind holds them for is not waited for.
        if (open_fds > 0) {
          for (pollfd& p : fds) {
            if (p.fd < 0) continue;
            // What is there now, without waiting for a writer that lives on, and at most a
            // pipe's worth more than the limits (such a writer may never stop).
            for (size_t drained = 0; drained <= kMaxProcessOutput;) {
              pollfd q = {p.fd, POLLIN, 0};
              if (::poll(&q, 1, 0) <= 0) break;
              const ssize_t n = ::read(p.fd, buf, sizeof buf);
              if (n <= 0) break;
              drained += static_cast<size_t>(n);
              (p.fd == out_pipe[0] ? out : err).append(buf, static_cast<size_t>(n));
              if (err.size() > 2 * kStderrKept) err.erase(0, err.size() - kStderrKept);
              if (out.size() > kMaxProcessOutput) break;
            }
            ::close(p.fd);
            p.fd = -1;
            --open_fds;
          }
          if (out.size() > kMaxProcessOutput) problem = "it wrote more than 1 MiB to stdout";
        }
      } else if (r < 0 && errno == ECHILD) {
        exited = true, status_lost = true;
      }
    }
    if (problem.empty() && std::chrono::steady_clock::now() >= deadline) {
      problem = "it ran longer than " +
                std::to_string(std::chrono::duration_cast<std::chrono::seconds>(timeout).count()) +
                " s";
    }
    if (problem.empty() && io::CancelScope::Requested()) {
      problem = "the load was cancelled";
      cancelled = true;
    }
  }
  for (pollfd& p : fds) {
    if (p.fd >= 0) ::close(p.fd);
  }
  if (!exited) {
    ::kill(own_group ? -pid : pid, SIGKILL);
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  if (cancelled) return Status(Code::kCancelled, where + ": the load was cancelled");
  if (!problem.empty()) return Status(Code::kIoError, where + ": killed: " + problem);
  if (status_lost) {
    return Status(Code::kIoError, where +
                                      ": its exit status is lost (SIGCHLD is ignored in this "
                                      "process), so its output cannot be trusted");
  }
  if (err.size() > kStderrKept) err.erase(0, err.size() - kStderrKept);
  std::string_view tail = err;
  while (!tail.empty() && (tail.back() == '\n' || tail.back() == ' ')) tail.remove_suffix(1);
  const std::string said =
      tail.empty() ? std::string() : "; its stderr ends: " + Excerpt(tail, kStderrKept);
  if (WIFSIGNALED(status)) {
    return Status(Code::kIoError,
                  where + ": killed by signal " + std::to_string(WTERMSIG(status)) + said);
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Status(Code::kIoError,
                  where + ": exited with status " + std::to_string(WEXITSTATUS(status)) + said);
  }
  return out;
}

// --- AwsCredentials ------------------------------------------------------------------------------

Result<std::shared_ptr<AwsCredentials>> AwsCredentials::Make(const S3Config& config,
                                                             const HttpSettings& transport) {
  using Source = S3Config::CredentialSource;
  if (config.credential_source == Source::kKeys) return std::shared_ptr<AwsCredentials>();
  return SharedPerProcess<AwsCredentials>(
      {&config.web_identity_token_file, &config.role_arn, &config.role_session_name,
       &config.sts_endpoint, &config.source_access_key_id, &config.source_secret_access_key,
       &config.source_session_token, &config.external_id, &config.duration_seconds, &config.region,
       &config.credential_process, &config.container_uri, &config.container_token,
       &config.container_token_file, &config.imds_endpoint, &config.credentials_from},
      static_cast<int>(config.credential_source) * 2 + (config.unsigned_allowed ? 1 : 0), transport,
      [&]() -> Result<std::shared_ptr<AwsCredentials>> {
        std::unique_ptr<HttpClient> client;
        if (config.credential_source == Source::kAssumeRole) {
          // Signed with the source keys, for STS in the configured region.
          HttpSettings hs = CredentialsSettings(transport);
          hs.access_key_id = config.source_access_key_id;
          hs.secret_access_key = config.source_secret_access_key;
          hs.session_token = config.source_session_token;
          hs.region = config.region;
          hs.sign_service = "sts";
          TF_ASSIGN_OR_RETURN(client, HttpClient::Make(std::move(hs)));
        } else if (config.credential_source != Source::kProcess) {
          const uint32_t cap =
              config.credential_source == Source::kInstanceMetadata ? kMetadataTimeoutMs
              : config.credential_source == Source::kContainer      ? kContainerTimeoutMs
                                                                    : UINT32_MAX;
          TF_ASSIGN_OR_RETURN(client, CredentialsClient(transport, cap));
        }
        return std::shared_ptr<AwsCredentials>(new AwsCredentials(config, std::move(client)));
      });
}

AwsCredentials::AwsCredentials(S3Config config, std::unique_ptr<HttpClient> client)
    : config_(std::move(config)), client_(std::move(client)) {}

AwsCredentials::~AwsCredentials() = default;

Result<AwsKeys> AwsCredentials::Get() {
  return keys_.Get([this]() -> Result<Refreshing<AwsKeys>::Fetched> {
    TF_ASSIGN_OR_RETURN(TimedAwsKeys fetched, Fetch());
    std::optional<std::chrono::seconds> life = LifeOf(fetched);
    if (life && life->count() <= 0) {
      // Used, they would be refused, fetched again and refused again at every request.
      return Status(Code::kIoError, "S3 credentials from " + config_.credentials_from +
                                        ": the keys it gave " + "expired " +
                                        std::to_string(-life->count()) +
                                        " s ago (is this machine's clock right?)");
    }
    return Refreshing<AwsKeys>::Fetched{std::move(fetched.keys), life};
  });
}

bool AwsCredentials::Refuse(const AwsKeys& keys) {
  const auto same = [&](const AwsKeys& a) {
    return a.access_key_id == keys.access_key_id && a.session_token == keys.session_token;
  };
  std::lock_guard<std::mutex> lock(refused_mu_);
  // Keys refused, fetched again and refused again within a minute: the source keeps giving them
  // (a cache of its own, keys for another store), so fetching again at once cannot help; a
  // minute later it may (keys rotated meanwhile).
  const auto now = std::chrono::steady_clock::now();
  if (same(refused_) && now - refused_at_ < std::chrono::seconds(60)) return false;
  if (keys_.ForgetIf(same)) refused_ = keys, refused_at_ = now;
  return true;
}

uint64_t AwsCredentials::fetches() const {
  return keys_.fetches();
}

Result<TimedAwsKeys> AwsCredentials::Fetch() const {
  switch (config_.credential_source) {
    case S3Config::CredentialSource::kWebIdentity: return FetchWebIdentity();
    case S3Config::CredentialSource::kAssumeRole: return FetchAssumeRole();
    case S3Config::CredentialSource::kProcess: return FetchProcess();
    case S3Config::CredentialSource::kContainer: return FetchContainer();
    case S3Config::CredentialSource::kInstanceMetadata: return FetchInstanceMetadata();
    case S3Config::CredentialSource::kKeys: break;
  }
  return Status(Code::kInternal, "S3 credentials: nothing to fetch");
}

Result<TimedAwsKeys> AwsCredentials::AskSts(const std::string& action, std::string form) const {
  HttpRequest req;
  req.url = config_.sts_endpoint + "/";
  req.text_limit = kMaxAnswer;
  req.headers.push_back("Content-Type: application/x-www-form-urlencoded");
  req.headers.push_back("Accept: application/xml");
  req.post_body = std::move(form);
  const std::string where = "S3 credentials from " + config_.credentials_from + ": " + action +
                            " at " + config_.sts_endpoint;
  const HttpResponse r = AskCredentialsEndpoint(*client_, req);
  if (r.status == 0 || r.cancelled) return NoAnswer(where, r);
  if (r.status != 200) return Refused(where, r);
  Result<StsCredentials> sts = ParseStsCredentials(r.text);
  if (!sts.ok()) return Status(Code::kIoError, where + ": " + sts.status().message());
  TimedAwsKeys out;
  out.keys = {sts->access_key_id, sts->secret_access_key, sts->session_token};
  if (!HeaderSafe(out.keys.access_key_id) || !HeaderSafe(out.keys.secret_access_key) ||
      !HeaderSafe(out.keys.session_token)) {
    return Status(Code::kIoError,
                  where + ": a key or token has a character not allowed in an HTTP header");
  }
  if (!sts->expiration.empty()) {
    out.expiration = ParseIso8601(sts->expiration);
    if (!out.expiration) {
      return Status(Code::kIoError, where + ": <Expiration> \"" + Excerpt(sts->expiration, 64) +
                                        "\" is not an ISO 8601 time");
    }
  }
  return out;
}

Result<TimedAwsKeys> AwsCredentials::FetchWebIdentity() const {
  TF_ASSIGN_OR_RETURN(
      const std::string token,
      ReadTokenFile(config_.web_identity_token_file,
                    "S3 credentials from " + config_.credentials_from, "web identity token file"));
  // Unsigned: the token is the proof.
  return AskSts("AssumeRoleWithWebIdentity",
                FormEncode({{"Action", "AssumeRoleWithWebIdentity"},
                            {"RoleArn", config_.role_arn},
                            {"RoleSessionName", config_.role_session_name},
                            {"Version", "2011-06-15"},
                            {"WebIdentityToken", token}}));
}

Result<TimedAwsKeys> AwsCredentials::FetchAssumeRole() const {
  // Signed with the source keys (the client's settings).
  std::string form = FormEncode({{"Action", "AssumeRole"},
                                 {"Version", "2011-06-15"},
                                 {"RoleArn", config_.role_arn},
                                 {"RoleSessionName", config_.role_session_name}});
  if (!config_.external_id.empty()) {
    form += "&" + FormEncode({{"ExternalId", config_.external_id}});
  }
  if (!config_.duration_seconds.empty()) {
    form += "&" + FormEncode({{"DurationSeconds", config_.duration_seconds}});
  }
  return AskSts("AssumeRole", std::move(form));
}

Result<TimedAwsKeys> AwsCredentials::FetchProcess() const {
  const std::string where = "S3 credentials from " + config_.credentials_from;
  TF_ASSIGN_OR_RETURN(const std::string output,
                      RunCredentialProcess(config_.credential_process, where, kProcessTimeout));
  return ParseAwsCredentialsJson(output, where, /*process=*/true);
}

Result<TimedAwsKeys> AwsCredentials::FetchContainer() const {
  const std::string where = "S3 credentials from " + config_.credentials_from;
  HttpRequest req;
  req.url = config_.container_uri;
  req.text_limit = kMaxAnswer;
  std::string token = config_.container_token;
  if (!config_.container_token_file.empty()) {
    TF_ASSIGN_OR_RETURN(token, ReadTokenFile(config_.container_token_file,
                                             where + " (AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE)",
                                             "authorization token file"));
  }
  if (!token.empty()) {
    if (!HeaderSafe(token)) {
      return Status(Code::kInvalidArgument,
                    where +
                        ": the authorization token has a character not allowed in an HTTP "
                        "header");
    }
    req.headers.push_back("Authorization: " + token);
  }
  const HttpResponse r = AskCredentialsEndpoint(*client_, req);
  if (r.status == 0 || r.cancelled) return NoAnswer(where, r);
  if (r.status != 200) return Refused(where, r);
  return ParseAwsCredentialsJson(r.text, where, /*process=*/false);
}

Result<TimedAwsKeys> AwsCredentials::FetchInstanceMetadata() const {
  const std::string where = "S3 credentials from " + config_.credentials_from;
  // IMDSv2: a session token first (PUT); a 403/404/405 means IMDSv1 only, asked without it.
  HttpRequest put;
  put.url = config_.imds_endpoint + "/latest/api/token";
  put.method = "PUT";
  put.text_limit = 4096;
  put.headers.push_back("X-aws-ec2-metadata-token-ttl-seconds: 21600");
  // One attempt each, 1 s at most (botocore's): off EC2, or in a container the token's answer
  // does not reach (a hop limit of 1), nothing waits long.
  const HttpResponse t = AskCredentialsEndpoint(*client_, put, 1);
  if (t.cancelled) return NoAnswer(where, t);
  // No credentials here: unsigned requests, asked again in 5 minutes; an error when unsigned
  // requests are not allowed (anonymous = 0).
  const auto none = [&](const std::string& why) -> Result<TimedAwsKeys> {
    if (!config_.unsigned_allowed) {
      return Status(Code::kIoError,
                    where + ": " + why + ", and unsigned requests are turned off (anonymous = 0)");
    }
    TimedAwsKeys keys;
    keys.expiration = std::chrono::time_point_cast<std::chrono::seconds>(Clock::now()) +
                      std::chrono::seconds(600);
    return keys;
  };
  std::vector<std::string> headers;  // IMDSv1 (no session token) when the PUT got no answer
  if (t.status == 200) {
    std::string_view session = t.text;
    while (!session.empty() && (session.back() == '\n' || session.back() == '\r')) {
      session.remove_suffix(1);
    }
    if (session.empty() || !HeaderSafe(session)) {
      return Status(Code::kIoError, where + ": the IMDSv2 session token it answered is not usable");
    }
    headers.push_back("X-aws-ec2-metadata-token: " + std::string(session));
  } else if (t.status != 0 && t.status != 403 && t.status != 404 && t.status != 405) {
    return Refused(where + ": PUT " + put.url, t);
  }
  HttpRequest list;
  list.url = config_.imds_endpoint + "/latest/meta-data/iam/security-credentials/";
  list.text_limit = 4096;
  list.headers = headers;
  const HttpResponse roles = AskCredentialsEndpoint(*client_, list, 1);
  if (roles.cancelled) return NoAnswer(where, roles);
  if (roles.status == 0 && imds_answered_keys_.load())
    return NoAnswer(where + ": GET " + list.url, roles);
  if (roles.status == 0) return none("no instance metadata service answered");
  if (roles.status == 404) return none("no IAM role is attached to this instance");
  if (roles.status != 200) return Refused(where + ": GET " + list.url, roles);
  std::string_view role = roles.text;
  role = role.substr(0, role.find_first_of("\r\n"));
  if (role.empty()) return none("no IAM role is attached to this instance");
  if (role.find_first_of("/?#% ") != std::string_view::npos || !HeaderSafe(role)) {
    return Status(Code::kIoError, where + ": the role name it answered (\"" + Excerpt(role, 64) +
                                      "\") is not usable");
  }
  HttpRequest get;
  get.url = list.url + std::string(role);
  get.text_limit = kMaxAnswer;
  get.headers = headers;
  const HttpResponse r = AskCredentialsEndpoint(*client_, get);
  const std::string at = where + ": GET " + get.url;
  if (r.status == 0 || r.cancelled) return NoAnswer(at, r);
  if (r.status != 200) return Refused(at, r);
  Result<TimedAwsKeys> keys = ParseAwsCredentialsJson(r.text, at, /*process=*/false);
  if (keys.ok()) imds_answered_keys_.store(true);
  return keys;
}

}  // namespace tensorferry::objstore
