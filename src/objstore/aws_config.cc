#include "objstore/aws_config.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <unistd.h>

#include "objstore/url.h"
#include "util/macros.h"

namespace tensorferry::objstore {
namespace {

// An AWS file larger than this is refused rather than read (they are a few KiB in practice).

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v';
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

// "profile   x" -> "profile x".
std::string CollapseSpaces(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (IsSpace(c)) {
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else {
      out += c;
    }
  }
  if (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

// The state of ParseAwsIni between lines.
struct IniState {
  AwsIni ini;
  std::string section;
  bool in_section = false;
  std::string last_key;      // the last top-level property of the section, "" when none
  bool last_nested = false;  // it had an empty value: indented lines are its sub-properties
  size_t last_indent = 0;    // its indentation
};

Status IniError(std::string_view file, size_t line, std::string_view problem) {
  return Status(Code::kInvalidArgument,
                std::string(file) + ":" + std::to_string(line) + ": " + std::string(problem));
}

// Splits "key = value"; nullopt without '=' or with an empty key.
std::optional<std::pair<std::string, std::string>> SplitProperty(std::string_view line) {
  const size_t eq = line.find('=');
  if (eq == std::string_view::npos) return std::nullopt;
  const std::string_view key = Trim(line.substr(0, eq));
  if (key.empty()) return std::nullopt;
  return std::pair(std::string(key), std::string(Trim(line.substr(eq + 1))));
}

Status IniSectionLine(IniState& state, std::string_view line, std::string_view file, size_t n) {
  const size_t close = line.find(']');
  if (close == std::string_view::npos) return IniError(file, n, "a '[' section without ']'");
  const std::string_view rest = Trim(line.substr(close + 1));
  if (!rest.empty() && rest[0] != '#' && rest[0] != ';') {
    return IniError(file, n, "unexpected text after the section's ']'");
  }
  std::string name = CollapseSpaces(line.substr(1, close - 1));
  if (name.empty()) return IniError(file, n, "an empty section name");
  state.section = std::move(name);
  state.in_section = true;
  state.ini[state.section];  // a section with no properties still exists
  state.last_key.clear();
  return Status::Ok();
}

Status IniIndentedLine(IniState& state, std::string_view line, std::string_view file, size_t n) {
  auto& section = state.ini[state.section];
  if (!state.last_nested) {  // a continuation line of a multi-line value
    section[state.last_key] += "\n" + std::string(Trim(line));
    return Status::Ok();
  }
  auto property = SplitProperty(line);
  if (!property) {
    return IniError(file, n,
                    "expected an indented \"key = value\" under \"" + state.last_key + " =\"");
  }
  section[state.last_key + "." + property->first] = property->second;
  return Status::Ok();
}

// Lines are read as the AWS CLI's configparser reads them: a line indented deeper than the last
// property continues it (a sub-property when its value was empty); any other line is a
// section, a property or a comment, indented or not.
Status IniLine(IniState& state, std::string_view raw, std::string_view file, size_t n) {
  const std::string_view line = Trim(raw);
  if (line.empty() || line[0] == '#' || line[0] == ';') return Status::Ok();
  size_t indent = 0;
  while (indent < raw.size() && IsSpace(raw[indent])) ++indent;
  if (state.in_section && !state.last_key.empty() && indent > state.last_indent) {
    return IniIndentedLine(state, line, file, n);
  }
  if (line[0] == '[') return IniSectionLine(state, line, file, n);
  if (!state.in_section) return IniError(file, n, "a property before any [section]");
  auto property = SplitProperty(line);
  if (!property) {
    return IniError(file, n, "expected \"key = value\", a [section] or a comment");
  }
  state.last_key = Lower(property->first);  // configparser lower-cases property names
  state.last_indent = indent;
  state.last_nested = property->second.empty();
  if (!state.last_nested) state.ini[state.section][state.last_key] = property->second;
  return Status::Ok();
}

// ---- environment and files ----------------------------------------------------------------------

// The path of one AWS file: the variable `var`, else $HOME/<home_relative>; "" when neither.
std::string AwsFilePath(const GetEnv& env, const char* var, const char* home_relative) {
  const auto home = Env(env, "HOME");
  if (auto path = Env(env, var)) {
    if (home && path->rfind("~/", 0) == 0) return *home + path->substr(1);
    return *path;
  }
  return home ? *home + "/" + home_relative : std::string();
}

// The parsed file at `path`; empty when `path` is "" or no file is there.
Result<AwsIni> LoadAwsFile(const std::string& path) {
  if (path.empty()) return AwsIni{};
  Result<std::string> text = ReadSmallFile(path, "AWS file");
  if (text.status().code() == Code::kNotFound) return AwsIni{};
  if (!text.ok()) return text.status();
  return ParseAwsIni(*text, path);
}

// The selected profile: its sections in both files.
struct Profile {
  std::string name;
  std::string named_by;  // "options", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", or "" (default)
  std::string credentials_path, config_path;
  std::map<std::string, std::string> credentials, config;
  // The "[services NAME]" section of the config file the profile names (services = NAME): where
  // the AWS CLI and SDKs read a service's endpoint ("s3 =\n  endpoint_url = ...").
  std::string services_name;
  std::map<std::string, std::string> services;
  // Both files, for the profiles this one names (source_profile).
  std::shared_ptr<const AwsIni> credentials_file, config_file;

  // The value of `key`, credentials file first, and the file it came from.
  std::optional<std::pair<std::string, std::string>> Get(const std::string& key) const {
    if (auto it = credentials.find(key); it != credentials.end()) {
      return std::pair(it->second, credentials_path);
    }
    if (auto it = config.find(key); it != config.end()) return std::pair(it->second, config_path);
    return std::nullopt;
  }
  std::string Where(const std::string& file) const { return "profile \"" + name + "\" in " + file; }

  // Fills `credentials` and `config` with profile `profile_name`'s sections; false when neither
  // file has it.
  bool Select(const std::string& profile_name) {
    name = profile_name;
    credentials.clear(), config.clear();
    bool found = false;
    if (auto it = credentials_file->find(name); it != credentials_file->end()) {
      credentials = it->second, found = true;
    }
    std::vector<std::string> names = {"profile " + name};
    if (name == "default") names.insert(names.begin(), "default");
    for (const std::string& section : names) {
      if (auto it = config_file->find(section); it != config_file->end()) {
        for (const auto& [k, v] : it->second) config[k] = v;
        found = true;
      }
    }
    return found;
  }
};

std::string ShownPath(const std::string& path, const char* what) {
  return path.empty() ? std::string("(no ") + what + " file: HOME is not set)" : path;
}

Result<Profile> LoadProfile(const S3Request& request, const GetEnv& env) {
  Profile p;
  if (!request.profile.empty()) {
    p.name = request.profile, p.named_by = "options";
  } else if (auto d = Env(env, "AWS_DEFAULT_PROFILE")) {  // before AWS_PROFILE, as botocore
    p.name = *d, p.named_by = "AWS_DEFAULT_PROFILE";
  } else if (auto v = Env(env, "AWS_PROFILE")) {
    p.name = *v, p.named_by = "AWS_PROFILE";
  } else {
    p.name = "default";
  }
  p.credentials_path = AwsFilePath(env, "AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials");
  p.config_path = AwsFilePath(env, "AWS_CONFIG_FILE", ".aws/config");
  TF_ASSIGN_OR_RETURN(AwsIni credentials_file, LoadAwsFile(p.credentials_path));
  TF_ASSIGN_OR_RETURN(AwsIni config_file, LoadAwsFile(p.config_path));
  p.credentials_file = std::make_shared<const AwsIni>(std::move(credentials_file));
  p.config_file = std::make_shared<const AwsIni>(std::move(config_file));
  const AwsIni& config = *p.config_file;
  const bool found = p.Select(p.name);
  if (auto it = p.config.find("services"); it != p.config.end()) {
    p.services_name = it->second;
    auto section = config.find("services " + it->second);
    if (section == config.end()) {
      return Status(Code::kInvalidArgument, "AWS profile \"" + p.name + "\" in " + p.config_path +
                                                " names services \"" + it->second +
                                                "\", but there is no [services " + it->second +
                                                "] section in that file");
    }
    p.services = section->second;
  }
  if (!found && !p.named_by.empty()) {
    return Status(Code::kInvalidArgument, "AWS profile \"" + p.name + "\" (from " + p.named_by +
                                              ") is in neither " +
                                              ShownPath(p.credentials_path, "credentials") +
                                              " nor " + ShownPath(p.config_path, "config"));
  }
  return p;
}

// ---- settings ---------------------------------------------------------------------------------

Status SetKeys(S3Config& c, std::string id, std::string secret, std::string token, std::string from,
               std::string_view id_name, std::string_view secret_name) {
  if (id.empty() != secret.empty()) {
    return Status(Code::kInvalidArgument, "S3 credentials from " + from + ": " +
                                              std::string(id.empty() ? secret_name : id_name) +
                                              " is set without " +
                                              std::string(id.empty() ? id_name : secret_name));
  }
  c.access_key_id = std::move(id);
  c.secret_access_key = std::move(secret);
  c.session_token = std::move(token);
  c.credentials_from = std::move(from);
  return Status::Ok();
}

// The keys of the profile's section in one file (p.credentials or p.config); false without.
Result<bool> ProfileKeys(S3Config& c, const Profile& p,
                         const std::map<std::string, std::string>& section) {
  auto value = [&](const char* key) {
    auto it = section.find(key);
    return it == section.end() ? std::string() : it->second;
  };
  std::string id = value("aws_access_key_id"), secret = value("aws_secret_access_key");
  if (id.empty() && secret.empty()) return false;
  const std::string& file = &section == &p.credentials ? p.credentials_path : p.config_path;
  // The session token under its legacy name too, first, as botocore reads it.
  const auto legacy = section.find("aws_security_token");
  std::string token = legacy != section.end() ? legacy->second : value("aws_session_token");
  TF_RETURN_IF_ERROR(SetKeys(c, std::move(id), std::move(secret), std::move(token), p.Where(file),
                             "aws_access_key_id", "aws_secret_access_key"));
  return true;
}

// A profile whose credentials come from a role assumed with other credentials (role_arn with
// source_profile or credential_source) or from SSO names a source tensorferry does not
// implement: an error, rather than other keys or unsigned requests that fail with AccessDenied
// later. With `bare_role`, a role_arn without a web identity token file counts too (a profile
// with nothing else: there is nothing to assume it with).
Status RefuseUnsupportedProfileSource(const Profile& p, bool bare_role) {
  const bool assumed = p.Get("role_arn") && !p.Get("web_identity_token_file") &&
                       (p.Get("source_profile") || p.Get("credential_source") || bare_role);
  for (const char* key : {"role_arn", "sso_session", "sso_start_url"}) {
    auto value = p.Get(key);
    if (!value || (std::string_view(key) == "role_arn" && !assumed)) continue;
    return Status(Code::kUnsupported,
                  p.Where(value->second) + " gets its credentials through " + key +
                      ", which tensorferry does not support: give keys (options, "
                      "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, aws_access_key_id/"
                      "aws_secret_access_key in the profile), web_identity_token_file with "
                      "role_arn, or credential_process");
  }
  return Status::Ok();
}

// Web identity: each of the token file, the role and the session name from the environment,
// else from the profile (botocore's rule, key by key); false without a token file.
Result<bool> WebIdentity(S3Config& c, const GetEnv& env, const Profile& p) {
  struct Setting {
    std::string value, from;
  };
  const auto get = [&](const char* var, const char* key) -> std::optional<Setting> {
    if (auto v = Env(env, var)) return Setting{*v, var};
    if (auto pv = p.Get(key)) return Setting{pv->first, p.Where(pv->second) + " (" + key + ")"};
    return std::nullopt;
  };
  const auto file = get("AWS_WEB_IDENTITY_TOKEN_FILE", "web_identity_token_file");
  if (!file) return false;
  const auto role = get("AWS_ROLE_ARN", "role_arn");
  if (!role) {
    return Status(Code::kInvalidArgument, "S3 credentials: a web identity token file is set (" +
                                              file->from +
                                              ") without a role (AWS_ROLE_ARN, or role_arn in "
                                              "profile \"" +
                                              p.name + "\")");
  }
  c.web_identity_token_file = file->value;
  c.role_arn = role->value;
  if (auto name = get("AWS_ROLE_SESSION_NAME", "role_session_name")) {
    c.role_session_name = name->value;
  } else {
    c.role_session_name = "tensorferry-" + std::to_string(static_cast<long long>(::getpid()));
  }
  c.credentials_from = "web identity (" + file->from + ", role " + role->value + ")";
  if (c.role_session_name.size() < 2 || c.role_session_name.size() > 64) {
    return Status(Code::kInvalidArgument, "S3 credentials from " + c.credentials_from +
                                              ": the role session name \"" + c.role_session_name +
                                              "\" is not 2 to 64 characters long");
  }
  c.credential_source = S3Config::CredentialSource::kWebIdentity;
  return true;
}

// Whether `host` (of an http:// container credentials URI) may be asked over plain HTTP: a
// loopback address or the link-local addresses ECS and EKS serve credentials on.
bool ContainerHostAllowedOverHttp(std::string_view host) {
  if (host == "localhost" || host == "[::1]" || host == "169.254.170.2" ||
      host == "169.254.170.23" || host == "[fd00:ec2::23]") {
    return true;
  }
  if (!host.starts_with("127.")) return false;
  int dots = 0;
  for (char ch : host) {
    if (ch == '.') {
      ++dots;
    } else if (ch < '0' || ch > '9') {
      return false;
    }
  }
  return dots == 3;
}

// Container credentials from the environment; false when it names none.
Result<bool> ContainerCredentials(S3Config& c, const GetEnv& env) {
  std::string uri;
  // RELATIVE first, as botocore reads them.
  if (auto relative = Env(env, "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")) {
    uri = "http://169.254.170.2" + (relative->starts_with('/') ? *relative : "/" + *relative);
    c.credentials_from =
        "container credentials (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI: " + uri + ")";
  } else if (auto full = Env(env, "AWS_CONTAINER_CREDENTIALS_FULL_URI")) {
    uri = *full;
    const bool http = uri.starts_with("http://");
    std::string_view rest = std::string_view(uri).substr(http                          ? 7
                                                         : uri.starts_with("https://") ? 8
                                                                                       : 0);
    rest = rest.substr(0, rest.find_first_of("/?#"));
    const size_t at = rest.rfind('@');
    const std::string shown = RedactUrl(uri);  // no user name and password (a secret)
    const auto invalid = [&](std::string_view why) {
      return Status(Code::kInvalidArgument,
                    "AWS_CONTAINER_CREDENTIALS_FULL_URI \"" + shown + "\": " + std::string(why));
    };
    if (!http && !uri.starts_with("https://")) return invalid("must be an http(s):// URL");
    if (at != std::string_view::npos) return invalid("must not carry a user name or password");
    std::string_view host = rest;
    if (host.starts_with('[')) {
      host = host.substr(0, host.find(']') + 1);
    } else {
      host = host.substr(0, host.find(':'));
    }
    if (host.empty()) return invalid("has no host");
    if (http && !ContainerHostAllowedOverHttp(Lower(host))) {
      return invalid(
          "plain http:// is allowed only to a loopback address, 169.254.170.2, 169.254.170.23 "
          "or [fd00:ec2::23] (as the AWS SDKs allow); use https://");
    }
    c.credentials_from = "container credentials (AWS_CONTAINER_CREDENTIALS_FULL_URI " + uri + ")";
  } else {
    return false;
  }
  c.container_uri = std::move(uri);
  c.container_token_file = Env(env, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE").value_or("");
  if (c.container_token_file.empty()) {
    c.container_token = Env(env, "AWS_CONTAINER_AUTHORIZATION_TOKEN").value_or("");
  }
  c.credential_source = S3Config::CredentialSource::kContainer;
  return true;
}

// Whether the DMI files in `dir` say this machine is an EC2 instance.
bool LooksLikeEc2(const std::string& dir) {
  if (dir.empty()) return false;
  const auto read = [&](const char* name) {
    Result<std::string> text = ReadSmallFile(dir + "/" + name, "DMI file");
    std::string_view t = text.ok() ? std::string_view(*text) : std::string_view();
    while (!t.empty() && (t.back() == '\n' || IsSpace(t.back()))) t.remove_suffix(1);
    return Lower(Trim(t));
  };
  return read("sys_vendor") == "amazon ec2" || read("bios_vendor") == "amazon ec2" ||
         read("bios_version").ends_with("amazon");
}

// The instance metadata service, when it may be asked; false when not.
Result<bool> InstanceMetadata(S3Config& c, const GetEnv& env, const Profile& p,
                              const std::string& ec2_probe_dir) {
  if (EnvTrue(env, "AWS_EC2_METADATA_DISABLED")) return false;
  std::string endpoint, from;
  if (auto e = Env(env, "AWS_EC2_METADATA_SERVICE_ENDPOINT")) {
    endpoint = *e, from = "AWS_EC2_METADATA_SERVICE_ENDPOINT";
  } else if (auto pe = p.Get("ec2_metadata_service_endpoint")) {
    endpoint = pe->first, from = p.Where(pe->second) + " (ec2_metadata_service_endpoint)";
  } else if (LooksLikeEc2(ec2_probe_dir)) {
    endpoint = "http://169.254.169.254", from = "an EC2 instance";
  } else {
    return false;
  }
  TF_ASSIGN_OR_RETURN(c.imds_endpoint,
                      NormalizeEndpoint(endpoint, from, "EC2 instance metadata service"));
  c.credentials_from = "EC2 instance metadata service (" + c.imds_endpoint + ", " + from + ")";
  c.credential_source = S3Config::CredentialSource::kInstanceMetadata;
  return true;
}

// A role the profile assumes with another profile's keys (source_profile) or the environment's
// (credential_source = Environment); false when it names none.
Result<bool> AssumeRole(S3Config& c, const GetEnv& env, const Profile& p) {
  const auto role = p.Get("role_arn");
  const auto source = p.Get("source_profile");
  const auto credential_source = p.Get("credential_source");
  // A web identity token file makes it web identity (botocore skips AssumeRole then).
  if (!role || (!source && !credential_source) || p.Get("web_identity_token_file")) return false;
  const std::string where = p.Where(role->second);
  const auto unsupported = [](const std::string& what) {
    return Status(Code::kUnsupported,
                  what +
                      "; export the role's keys instead (aws configure export-credentials "
                      "--profile NAME --format env)");
  };
  if (auto mfa = p.Get("mfa_serial")) {
    return unsupported(p.Where(mfa->second) +
                       " sets mfa_serial: assuming its role needs an MFA code, which tensorferry "
                       "cannot ask for");
  }
  if (source && credential_source) {
    return Status(Code::kInvalidArgument,
                  where + " sets both source_profile and credential_source (one only)");
  }
  S3Config keys;
  std::string keys_from;
  if (source) {
    Profile base = p;  // shares the files
    if (!base.Select(source->first)) {
      return Status(Code::kInvalidArgument, p.Where(source->second) + ": source_profile \"" +
                                                source->first + "\" is in neither " +
                                                ShownPath(p.credentials_path, "credentials") +
                                                " nor " + ShownPath(p.config_path, "config"));
    }
    // The source's static keys when it has them (itself included: a profile whose role is
    // assumed with its own keys), as botocore takes them; else it would have to assume a role
    // itself.
    TF_ASSIGN_OR_RETURN(bool found, ProfileKeys(keys, base, base.credentials));
    if (!found) {
      TF_ASSIGN_OR_RETURN(found, ProfileKeys(keys, base, base.config));
    }
    if (!found && base.Get("role_arn")) {
      return unsupported(p.Where(source->second) + ": source_profile \"" + source->first +
                         "\" assumes a role itself (a chain of roles is not supported)");
    }
    if (!found) {
      return unsupported(p.Where(source->second) + ": source_profile \"" + source->first +
                         "\" has no aws_access_key_id/aws_secret_access_key: a source profile "
                         "whose keys come otherwise (credential_process, web identity, SSO) is "
                         "not supported");
    }
    keys_from = "the keys of " + keys.credentials_from;
  } else if (credential_source->first == "Environment") {
    const auto id = Env(env, "AWS_ACCESS_KEY_ID"), secret = Env(env, "AWS_SECRET_ACCESS_KEY");
    if (!id || !secret) {
      return Status(Code::kInvalidArgument,
                    p.Where(credential_source->second) +
                        ": credential_source = Environment, but AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY are not both set");
    }
    keys.access_key_id = *id;
    keys.secret_access_key = *secret;
    keys.session_token =  // botocore's order: the legacy name first
        Env(env, "AWS_SECURITY_TOKEN").value_or(Env(env, "AWS_SESSION_TOKEN").value_or(""));
    keys_from = "the environment's keys (credential_source = Environment)";
  } else {
    return unsupported(p.Where(credential_source->second) + ": credential_source = " +
                       credential_source->first + " is not supported (Environment is)");
  }
  c.role_arn = role->first;
  if (auto name = p.Get("role_session_name")) {
    c.role_session_name = name->first;
  } else {
    c.role_session_name = "tensorferry-" + std::to_string(static_cast<long long>(::getpid()));
  }
  if (c.role_session_name.size() < 2 || c.role_session_name.size() > 64) {
    return Status(Code::kInvalidArgument, where + ": the role session name \"" +
                                              c.role_session_name +
                                              "\" is not 2 to 64 characters long");
  }
  if (auto external = p.Get("external_id")) c.external_id = external->first;
  if (auto duration = p.Get("duration_seconds")) {
    const std::string& d = duration->first;
    const bool digits = !d.empty() && d.size() <= 5 && std::all_of(d.begin(), d.end(), [](char ch) {
      return ch >= '0' && ch <= '9';
    });
    if (!digits || std::stoi(d) < 900 || std::stoi(d) > 43200) {
      return Status(Code::kInvalidArgument, p.Where(duration->second) + ": duration_seconds \"" +
                                                d + "\" is not 900 to 43200");
    }
    c.duration_seconds = d;
  }
  c.source_access_key_id = std::move(keys.access_key_id);
  c.source_secret_access_key = std::move(keys.secret_access_key);
  c.source_session_token = std::move(keys.session_token);
  c.credentials_from = "role " + role->first + " assumed with " + keys_from + " (" + where + ")";
  c.credential_source = S3Config::CredentialSource::kAssumeRole;
  return true;
}

Status ResolveCredentials(S3Config& c, const S3Request& r, const GetEnv& env, const Profile& p,
                          const std::string& ec2_probe_dir) {
  c.unsigned_allowed = r.anonymous != 0;
  if (r.anonymous == 1 || (r.anonymous == -1 && EnvTrue(env, "AWS_NO_SIGN_REQUEST"))) {
    c.anonymous = true;
    c.credentials_from =
        r.anonymous == 1 ? "options: anonymous" : "environment (AWS_NO_SIGN_REQUEST)";
    return Status::Ok();
  }
  if (!r.access_key_id.empty() || !r.secret_access_key.empty() || !r.session_token.empty()) {
    if (r.access_key_id.empty() && r.secret_access_key.empty()) {
      return Status(Code::kInvalidArgument,
                    "S3 credentials from options: session_token is set without access_key_id "
                    "and secret_access_key");
    }
    return SetKeys(c, r.access_key_id, r.secret_access_key, r.session_token, "options",
                   "access_key_id", "secret_access_key");
  }
  // A profile named in the options wins over the environment's credentials, as for botocore's
  // Session(profile_name=...) and `aws --profile`; AWS_PROFILE does not (the environment's keys
  // come first then, as there).
  const auto id = Env(env, "AWS_ACCESS_KEY_ID"), secret = Env(env, "AWS_SECRET_ACCESS_KEY");
  if ((id || secret) && r.profile.empty()) {
    // The token under its legacy name too (AWS_SECURITY_TOKEN), first, as botocore reads it.
    return SetKeys(
        c, id.value_or(""), secret.value_or(""),
        Env(env, "AWS_SECURITY_TOKEN").value_or(Env(env, "AWS_SESSION_TOKEN").value_or("")),
        "environment (AWS_ACCESS_KEY_ID)", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY");
  }
  // botocore's order: a role assumed with the profile's source, web identity (the environment's
  // settings not read when a profile was named in the options), the profile's keys and process.
  TF_ASSIGN_OR_RETURN(bool found, AssumeRole(c, env, p));
  if (found) return Status::Ok();
  TF_RETURN_IF_ERROR(RefuseUnsupportedProfileSource(p, /*bare_role=*/false));
  TF_ASSIGN_OR_RETURN(found, WebIdentity(c, r.profile.empty() ? env : GetEnv(), p));
  if (found) return Status::Ok();
  TF_ASSIGN_OR_RETURN(found, ProfileKeys(c, p, p.credentials));
  if (found) return Status::Ok();
  if (auto process = p.Get("credential_process")) {
    c.credential_process = process->first;
    c.credentials_from = "credential_process of " + p.Where(process->second);
    c.credential_source = S3Config::CredentialSource::kProcess;
    return Status::Ok();
  }
  TF_ASSIGN_OR_RETURN(found, ProfileKeys(c, p, p.config));
  if (found) return Status::Ok();
  TF_RETURN_IF_ERROR(RefuseUnsupportedProfileSource(p, /*bare_role=*/true));
  TF_ASSIGN_OR_RETURN(found, ContainerCredentials(c, env));
  if (found) return Status::Ok();
  TF_ASSIGN_OR_RETURN(found, InstanceMetadata(c, env, p, ec2_probe_dir));
  if (found) return Status::Ok();
  if (r.anonymous == 0) {
    return Status(Code::kInvalidArgument,
                  "no S3 credentials found (options, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                  "web identity, profile \"" +
                      p.name + "\" in " + ShownPath(p.credentials_path, "credentials") + " or " +
                      ShownPath(p.config_path, "config") +
                      ", container or EC2 instance credentials) and anonymous access is turned "
                      "off");
  }
  c.anonymous = true;
  c.credentials_from = "none found: anonymous";
  return Status::Ok();
}

Status ResolveRegion(S3Config& c, const S3Request& r, const GetEnv& env, const Profile& p) {
  if (!r.region.empty()) {
    c.region = r.region, c.region_from = "options";
  } else if (auto v = Env(env, "AWS_REGION")) {
    c.region = *v, c.region_from = "AWS_REGION";
  } else if (auto d = Env(env, "AWS_DEFAULT_REGION")) {
    c.region = *d, c.region_from = "AWS_DEFAULT_REGION";
  } else if (auto pr = p.Get("region")) {
    c.region = pr->first, c.region_from = p.Where(pr->second);
  } else {
    c.region = "us-east-1", c.region_from = "default";
  }
  for (char ch : c.region) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                    (ch >= '0' && ch <= '9') || ch == '-' || ch == '_' || ch == '.';
    if (!ok) {
      return Status(Code::kInvalidArgument, "S3 region \"" + c.region + "\" from " + c.region_from +
                                                ": only letters, digits, '-', '_' and '.' allowed");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::string> ReadSmallFile(const std::string& path, std::string_view what) {
  constexpr uintmax_t kMax = 1 << 20;
  const std::string the = "the " + std::string(what);
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (status.type() == std::filesystem::file_type::not_found) {
    return Status(Code::kNotFound, path + ": no such " + std::string(what));
  }
  if (ec) return Status(Code::kIoError, path + ": cannot read " + the + ": " + ec.message());
  // /dev/null is the usual way to turn a file off (the AWS CLI and boto3 read it as empty): a
  // character device is an empty file, never read (a terminal would block).
  if (status.type() == std::filesystem::file_type::character) return std::string();
  if (!std::filesystem::is_regular_file(status)) {
    return Status(Code::kIoError, path + ": " + the + " is not a regular file");
  }
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) return Status(Code::kIoError, path + ": cannot read " + the + ": " + ec.message());
  if (size > kMax)
    return Status(Code::kInvalidArgument, path + ": " + the + " is larger than 1 MiB");
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return Status(Code::kIoError, path + ": cannot open " + the + ": " + std::strerror(errno));
  }
  std::string text(kMax + 1, '\0');
  const size_t n = std::fread(text.data(), 1, text.size(), f);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return Status(Code::kIoError, path + ": cannot read " + the);
  if (n > kMax) return Status(Code::kInvalidArgument, path + ": " + the + " is larger than 1 MiB");
  text.resize(n);
  return text;
}

// `value` as "scheme://host[:port]", or an error naming `from`.
Result<std::string> NormalizeEndpoint(const std::string& value, const std::string& from,
                                      std::string_view store) {
  const auto problem = [&](std::string_view what) {
    return Status(Code::kInvalidArgument, std::string(store) + " endpoint \"" + RedactUrl(value) +
                                              "\" from " + from + ": " + std::string(what));
  };
  std::string_view v = value;
  if (v.ends_with('/')) v.remove_suffix(1);
  auto url = ParseObjectUrl(v);
  if (!url.ok()) return problem(url.status().message());
  if (IsBucketScheme(url->scheme)) return problem("must be an http:// or https:// URL");
  if (!url->key.empty() || v.ends_with('/')) {
    return problem("must be scheme://host[:port] with no path");
  }
  return url->origin;
}

namespace {

Status ResolveEndpoint(S3Config& c, const S3Request& r, const GetEnv& env, const Profile& p) {
  std::string value;
  const auto ignore = p.Get("ignore_configured_endpoint_urls");
  const bool ignore_configured = EnvTrue(env, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS") ||
                                 (ignore && Lower(ignore->first) == "true");
  if (!r.endpoint.empty()) {
    value = r.endpoint, c.endpoint_from = "options";
  } else if (ignore_configured) {
    // Only the explicit endpoint counts.
  } else if (auto s3 = Env(env, "AWS_ENDPOINT_URL_S3")) {
    value = *s3, c.endpoint_from = "AWS_ENDPOINT_URL_S3";
  } else if (auto all = Env(env, "AWS_ENDPOINT_URL")) {
    value = *all, c.endpoint_from = "AWS_ENDPOINT_URL";
  } else if (auto service = p.services.find("s3.endpoint_url"); service != p.services.end()) {
    value = service->second;
    c.endpoint_from = "[services " + p.services_name + "] (s3.endpoint_url) in " + p.config_path +
                      ", named by profile \"" + p.name + "\"";
  } else if (auto ps3 = p.Get("s3.endpoint_url")) {
    value = ps3->first;
    c.endpoint_from = "profile \"" + p.name + "\" (s3.endpoint_url) in " + ps3->second;
  } else if (auto pall = p.Get("endpoint_url")) {
    value = pall->first;
    c.endpoint_from = "profile \"" + p.name + "\" (endpoint_url) in " + pall->second;
  }
  if (value.empty()) {
    const bool china = c.region.rfind("cn-", 0) == 0;
    value = "https://s3." + c.region + (china ? ".amazonaws.com.cn" : ".amazonaws.com");
    c.endpoint_from = "AWS default";
  }
  TF_ASSIGN_OR_RETURN(c.endpoint, NormalizeEndpoint(value, c.endpoint_from, "S3"));
  return Status::Ok();
}

// The STS endpoint web identity credentials are asked at: as ResolveEndpoint's, for "sts".
Status ResolveStsEndpoint(S3Config& c, const GetEnv& env, const Profile& p) {
  std::string value, from;
  const auto ignore = p.Get("ignore_configured_endpoint_urls");
  const bool ignore_configured = EnvTrue(env, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS") ||
                                 (ignore && Lower(ignore->first) == "true");
  if (ignore_configured) {
    // Only the default.
  } else if (auto sts = Env(env, "AWS_ENDPOINT_URL_STS")) {
    value = *sts, from = "AWS_ENDPOINT_URL_STS";
  } else if (auto all = Env(env, "AWS_ENDPOINT_URL")) {
    value = *all, from = "AWS_ENDPOINT_URL";
  } else if (auto service = p.services.find("sts.endpoint_url"); service != p.services.end()) {
    value = service->second;
    from = "[services " + p.services_name + "] (sts.endpoint_url) in " + p.config_path;
  } else if (auto psts = p.Get("sts.endpoint_url")) {
    value = psts->first, from = p.Where(psts->second) + " (sts.endpoint_url)";
  } else if (auto pall = p.Get("endpoint_url")) {
    value = pall->first, from = p.Where(pall->second) + " (endpoint_url)";
  }
  if (value.empty()) {
    const bool china = c.region.rfind("cn-", 0) == 0;
    value = "https://sts." + c.region + (china ? ".amazonaws.com.cn" : ".amazonaws.com");
    from = "AWS default";
  }
  TF_ASSIGN_OR_RETURN(c.sts_endpoint, NormalizeEndpoint(value, from, "STS"));
  c.credentials_from += " via STS " + c.sts_endpoint;
  return Status::Ok();
}

// The host of "scheme://host[:port]", lower-cased.
std::string EndpointHost(const std::string& endpoint) {
  std::string_view rest = endpoint;
  rest.remove_prefix(std::min(rest.size(), rest.find("://") + 3));
  if (!rest.empty() && rest[0] == '[') return Lower(rest.substr(0, rest.find(']') + 1));
  return Lower(rest.substr(0, rest.find(':')));
}

bool IsAmazonHost(const std::string& host) {
  const std::string_view h = host;
  return h == "amazonaws.com" || h.ends_with(".amazonaws.com") || h.ends_with(".amazonaws.com.cn");
}

Status ResolvePathStyle(S3Config& c, const S3Request& r, const Profile& p) {
  if (r.path_style == 0 || r.path_style == 1) {
    c.path_style = r.path_style == 1;
    c.path_style_auto = false;
    return Status::Ok();
  }
  if (auto style = p.Get("s3.addressing_style")) {
    const std::string value = Lower(style->first);
    if (value == "path" || value == "virtual") {
      c.path_style = value == "path";
      c.path_style_auto = false;
      return Status::Ok();
    }
    if (value != "auto") {
      return Status(Code::kInvalidArgument, p.Where(style->second) + ": s3.addressing_style = \"" +
                                                style->first + "\" is not path, virtual or auto");
    }
  }
  c.path_style = !IsAmazonHost(EndpointHost(c.endpoint));
  c.path_style_auto = true;
  return Status::Ok();
}

}  // namespace

Result<AwsIni> ParseAwsIni(std::string_view text, std::string_view file) {
  IniState state;
  size_t line_number = 0;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    const std::string_view line = text.substr(0, eol);
    text = eol == std::string_view::npos ? std::string_view() : text.substr(eol + 1);
    ++line_number;
    TF_RETURN_IF_ERROR(IniLine(state, line, file, line_number));
  }
  return std::move(state.ini);
}

Result<S3Config> ResolveS3Config(const S3Request& request, const GetEnv& env,
                                 const std::string& ec2_probe_dir) {
  TF_ASSIGN_OR_RETURN(const Profile profile, LoadProfile(request, env));
  S3Config config;
  TF_RETURN_IF_ERROR(ResolveCredentials(config, request, env, profile, ec2_probe_dir));
  TF_RETURN_IF_ERROR(ResolveRegion(config, request, env, profile));
  TF_RETURN_IF_ERROR(ResolveEndpoint(config, request, env, profile));
  TF_RETURN_IF_ERROR(ResolvePathStyle(config, request, profile));
  if (config.credential_source == S3Config::CredentialSource::kWebIdentity ||
      config.credential_source == S3Config::CredentialSource::kAssumeRole) {
    TF_RETURN_IF_ERROR(ResolveStsEndpoint(config, env, profile));
  }
  return config;
}

bool S3Config::UsesPathStyle(const ObjectUrl& url) const {
  if (path_style) return true;
  if (!path_style_auto) return false;
  return url.bucket.find_first_of("._") != std::string::npos;
}

std::string S3Config::ObjectRequestUrl(const ObjectUrl& url, std::string_view query) const {
  std::string out;
  if (!IsBucketScheme(url.scheme)) {
    out = url.ToString();
  } else if (UsesPathStyle(url)) {
    out = endpoint + "/" + url.bucket;
    if (!url.key.empty()) out += "/" + PercentEncode(url.key, true);
  } else {
    const size_t host = endpoint.find("://") + 3;
    out = endpoint.substr(0, host) + url.bucket + "." + endpoint.substr(host) + "/" +
          PercentEncode(url.key, true);
  }
  if (!query.empty()) out += "?" + std::string(query);
  return out;
}

std::string ListObjectsV2Query(std::string_view prefix, std::string_view continuation_token,
                               std::string_view delimiter) {
  std::string query;
  if (!continuation_token.empty()) {
    query += "continuation-token=" + PercentEncode(continuation_token, false) + "&";
  }
  if (!delimiter.empty()) query += "delimiter=" + PercentEncode(delimiter, false) + "&";
  query += "list-type=2";
  if (!prefix.empty()) query += "&prefix=" + PercentEncode(prefix, false);
  return query;
}

}  // namespace tensorferry::objstore
