#include "objstore/aws_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "objstore/url.h"
#include "testing/test_util.h"

namespace tensorferry::objstore {
namespace {

// A fake environment whose HOME is a fresh temporary directory; the real environment is never
// read.
class FakeAws {
 public:
  FakeAws() { vars_["HOME"] = home_.path(); }
  void Set(const std::string& name, const std::string& value) { vars_[name] = value; }
  void Unset(const std::string& name) { vars_.erase(name); }
  void Credentials(const std::string& text) { Write(".aws/credentials", text); }
  void Config(const std::string& text) { Write(".aws/config", text); }
  void Write(const std::string& relative, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(home_.Join(relative)).parent_path());
    testing::WriteBytes(home_.Join(relative), text);
  }
  std::string Path(const std::string& relative) const { return home_.Join(relative); }
  GetEnv Env() const {
    return [vars = vars_](const char* name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    };
  }
  Result<S3Config> Resolve(const S3Request& request = {}) const {
    return ResolveS3Config(request, Env(), home_.Join("dmi"));
  }
  S3Config MustResolve(const S3Request& request = {}) const {
    auto config = Resolve(request);
    EXPECT_TRUE(config.ok()) << config.status().ToString();
    return config.ok() ? *config : S3Config{};
  }
  // The message of the kInvalidArgument error resolving `request` must give.
  std::string Error(const S3Request& request = {}) const {
    auto config = Resolve(request);
    EXPECT_FALSE(config.ok());
    if (config.ok()) return "";
    EXPECT_EQ(config.status().code(), Code::kInvalidArgument) << config.status().ToString();
    return config.status().message();
  }

 private:
  testing::TempDir home_;
  std::map<std::string, std::string> vars_;
};

S3Request WithKeys(const std::string& id, const std::string& secret) {
  S3Request r;
  r.access_key_id = id;
  r.secret_access_key = secret;
  return r;
}

TEST(AwsConfig, NothingConfiguredIsAnonymousOnAwsDefaults) {
  FakeAws aws;
  const S3Config c = aws.MustResolve();
  EXPECT_TRUE(c.anonymous);
  EXPECT_EQ(c.credentials_from, "none found: anonymous");
  EXPECT_TRUE(c.access_key_id.empty());
  EXPECT_EQ(c.region, "us-east-1");
  EXPECT_EQ(c.region_from, "default");
  EXPECT_EQ(c.endpoint, "https://s3.us-east-1.amazonaws.com");
  EXPECT_EQ(c.endpoint_from, "AWS default");
  EXPECT_FALSE(c.path_style);
  EXPECT_TRUE(c.path_style_auto);
  // No HOME at all: no files, same result.
  auto no_home = ResolveS3Config({}, [](const char*) { return std::optional<std::string>(); });
  ASSERT_TRUE(no_home.ok()) << no_home.status().ToString();
  EXPECT_TRUE(no_home->anonymous);
}

TEST(AwsConfig, CredentialsPrecedence) {
  FakeAws aws;
  aws.Config("[default]\naws_access_key_id = CFG_ID\naws_secret_access_key = CFG_SECRET\n");
  S3Config c = aws.MustResolve();
  EXPECT_EQ(c.access_key_id, "CFG_ID");
  EXPECT_EQ(c.secret_access_key, "CFG_SECRET");
  EXPECT_EQ(c.credentials_from, "profile \"default\" in " + aws.Path(".aws/config"));
  EXPECT_FALSE(c.anonymous);

  aws.Credentials(
      "[default]\naws_access_key_id=FILE_ID\naws_secret_access_key=FILE_SECRET\n"
      "aws_session_token=FILE_TOKEN\n");
  c = aws.MustResolve();
  EXPECT_EQ(c.access_key_id, "FILE_ID");
  EXPECT_EQ(c.session_token, "FILE_TOKEN");
  EXPECT_EQ(c.credentials_from, "profile \"default\" in " + aws.Path(".aws/credentials"));

  aws.Set("AWS_ACCESS_KEY_ID", "ENV_ID");
  aws.Set("AWS_SECRET_ACCESS_KEY", "ENV_SECRET");
  aws.Set("AWS_SESSION_TOKEN", "ENV_TOKEN");
  c = aws.MustResolve();
  EXPECT_EQ(c.access_key_id, "ENV_ID");
  EXPECT_EQ(c.secret_access_key, "ENV_SECRET");
  EXPECT_EQ(c.session_token, "ENV_TOKEN");
  EXPECT_EQ(c.credentials_from, "environment (AWS_ACCESS_KEY_ID)");
  // The token's legacy name, as botocore reads it: first (botocore's EnvProvider.TOKENS).
  aws.Set("AWS_SECURITY_TOKEN", "LEGACY_TOKEN");
  EXPECT_EQ(aws.MustResolve().session_token, "LEGACY_TOKEN");
  aws.Unset("AWS_SESSION_TOKEN");
  EXPECT_EQ(aws.MustResolve().session_token, "LEGACY_TOKEN");
  aws.Unset("AWS_SECURITY_TOKEN");

  c = aws.MustResolve(WithKeys("OPT_ID", "OPT_SECRET"));
  EXPECT_EQ(c.access_key_id, "OPT_ID");
  EXPECT_EQ(c.secret_access_key, "OPT_SECRET");
  EXPECT_EQ(c.session_token, "");  // the environment's token does not go with other keys
  EXPECT_EQ(c.credentials_from, "options");
  EXPECT_FALSE(c.anonymous);
}

// A profile's session token under its legacy name (aws_security_token), as botocore reads it:
// the legacy name first.
TEST(AwsConfig, ProfileTokenUnderItsLegacyName) {
  FakeAws aws;
  aws.Credentials(
      "[default]\naws_access_key_id=ID\naws_secret_access_key=S\n"
      "aws_security_token=LEGACY\n");
  EXPECT_EQ(aws.MustResolve().session_token, "LEGACY");
  aws.Credentials(
      "[default]\naws_access_key_id=ID\naws_secret_access_key=S\n"
      "aws_security_token=LEGACY\naws_session_token=TOKEN\n");
  EXPECT_EQ(aws.MustResolve().session_token, "LEGACY");
  aws.Credentials(
      "[default]\naws_access_key_id=ID\naws_secret_access_key=S\n"
      "aws_session_token=TOKEN\n");
  EXPECT_EQ(aws.MustResolve().session_token, "TOKEN");
}

TEST(AwsConfig, HalfAPairOfKeysIsAnError) {
  FakeAws aws;
  EXPECT_NE(aws.Error(WithKeys("ID", "")).find("access_key_id is set without secret_access_key"),
            std::string::npos);
  S3Request token_only;
  token_only.session_token = "T";
  EXPECT_NE(aws.Error(token_only).find("session_token"), std::string::npos);

  FakeAws env;
  env.Set("AWS_SECRET_ACCESS_KEY", "S");
  EXPECT_NE(env.Error().find("AWS_SECRET_ACCESS_KEY is set without AWS_ACCESS_KEY_ID"),
            std::string::npos);

  FakeAws file;
  file.Credentials("[default]\naws_access_key_id = ID\n");
  const std::string message = file.Error();
  EXPECT_NE(message.find("aws_access_key_id is set without aws_secret_access_key"),
            std::string::npos);
  EXPECT_NE(message.find(file.Path(".aws/credentials")), std::string::npos) << message;
}

TEST(AwsConfig, AnonymousWinsWhenAskedFor) {
  FakeAws aws;
  aws.Set("AWS_ACCESS_KEY_ID", "ENV_ID");
  aws.Set("AWS_SECRET_ACCESS_KEY", "ENV_SECRET");
  S3Request anonymous = WithKeys("OPT_ID", "OPT_SECRET");
  anonymous.anonymous = 1;
  S3Config c = aws.MustResolve(anonymous);
  EXPECT_TRUE(c.anonymous);
  EXPECT_TRUE(c.access_key_id.empty());
  EXPECT_EQ(c.credentials_from, "options: anonymous");

  for (const char* yes : {"true", "TRUE", "1"}) {
    aws.Set("AWS_NO_SIGN_REQUEST", yes);
    c = aws.MustResolve();
    EXPECT_TRUE(c.anonymous) << yes;
    EXPECT_EQ(c.credentials_from, "environment (AWS_NO_SIGN_REQUEST)");
  }
  aws.Set("AWS_NO_SIGN_REQUEST", "false");
  EXPECT_FALSE(aws.MustResolve().anonymous);

  // An explicit "not anonymous" overrides the environment, and needs credentials.
  aws.Set("AWS_NO_SIGN_REQUEST", "true");
  S3Request signed_request;
  signed_request.anonymous = 0;
  c = aws.MustResolve(signed_request);
  EXPECT_FALSE(c.anonymous);
  EXPECT_EQ(c.access_key_id, "ENV_ID");
  FakeAws none;
  const std::string message = none.Error(signed_request);
  EXPECT_NE(message.find("no S3 credentials found"), std::string::npos) << message;
  EXPECT_NE(message.find(none.Path(".aws/credentials")), std::string::npos) << message;
}

TEST(AwsConfig, CredentialSourcesWeDoNotImplementAreNamed) {
  FakeAws aws;
  aws.Config(
      "[profile sso]\nsso_session = corp\nregion = eu-west-1\n"
      "[profile both]\nrole_arn = arn:x\naws_access_key_id = K\naws_secret_access_key = S\n");
  S3Request request;
  request.profile = "sso";
  auto config = aws.Resolve(request);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), Code::kUnsupported);
  EXPECT_NE(config.status().message().find("profile \"sso\" in " + aws.Path(".aws/config") +
                                           " gets its credentials through sso_session"),
            std::string::npos)
      << config.status().ToString();
  // Static keys in the profile are used as they are.
  request.profile = "both";
  EXPECT_EQ(aws.MustResolve(request).access_key_id, "K");
  // Keys in the options make the profile's source irrelevant.
  request.profile = "sso";
  request.access_key_id = "O";
  request.secret_access_key = "OS";
  EXPECT_EQ(aws.MustResolve(request).access_key_id, "O");
  // A profile named in the options wins over the environment's keys (botocore: an explicit
  // profile drops the environment provider); one named by AWS_PROFILE does not.
  request = S3Request();
  request.profile = "both";
  aws.Set("AWS_ACCESS_KEY_ID", "E");
  aws.Set("AWS_SECRET_ACCESS_KEY", "ES");
  EXPECT_EQ(aws.MustResolve(request).access_key_id, "K");
  request.profile.clear();
  aws.Set("AWS_PROFILE", "both");
  EXPECT_EQ(aws.MustResolve(request).access_key_id, "E");
  // Half of web identity (EKS) in the environment: an error naming what is missing.
  FakeAws pod;
  pod.Set("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/token");
  EXPECT_NE(pod.Error().find("a web identity token file is set (AWS_WEB_IDENTITY_TOKEN_FILE) "
                             "without a role (AWS_ROLE_ARN, or role_arn in profile \"default\")"),
            std::string::npos)
      << pod.Error();
  // A role alone is no web identity (botocore skips it too).
  FakeAws role_only;
  role_only.Set("AWS_ROLE_ARN", "arn:aws:iam::1:role/x");
  EXPECT_TRUE(role_only.MustResolve().anonymous);
}

TEST(AwsConfig, ARoleAssumedWithAnotherProfilesKeysOrTheEnvironments) {
  using Source = S3Config::CredentialSource;
  FakeAws aws;
  aws.Credentials("[base]\naws_access_key_id = BASE\naws_secret_access_key = BS\n");
  aws.Config(
      "[profile r]\nrole_arn = arn:aws:iam::1:role/x\nsource_profile = base\n"
      "role_session_name = loader\nexternal_id = ext-7\nduration_seconds = 1800\n"
      // Keys of its own do not matter: the role is assumed (botocore's order).
      "aws_access_key_id = OWN\naws_secret_access_key = OS\n"
      "[profile env]\nrole_arn = arn:aws:iam::1:role/y\ncredential_source = Environment\n"
      "[profile mfa]\nrole_arn = arn:r\nsource_profile = base\nmfa_serial = arn:mfa\n"
      "[profile chain]\nrole_arn = arn:r2\nsource_profile = env\n"
      "[profile keyed]\nrole_arn = arn:r8\nsource_profile = r\n"
      "[profile self]\nrole_arn = arn:r9\nsource_profile = self\n"
      "aws_access_key_id = SELF\naws_secret_access_key = SS\n"
      "[profile webid]\nrole_arn = arn:r10\nsource_profile = base\n"
      "web_identity_token_file = /t\n"
      "[profile nokeys]\nrole_arn = arn:r3\nsource_profile = plain\n"
      "[profile plain]\nregion = eu-west-1\n"
      "[profile gone]\nrole_arn = arn:r4\nsource_profile = nowhere\n"
      "[profile ec2]\nrole_arn = arn:r5\ncredential_source = Ec2InstanceMetadata\n"
      "[profile both]\nrole_arn = arn:r6\nsource_profile = base\n"
      "credential_source = Environment\n"
      "[profile long]\nrole_arn = arn:r7\nsource_profile = base\nduration_seconds = 99\n");
  S3Request r;
  r.profile = "r";
  S3Config c = aws.MustResolve(r);
  EXPECT_EQ(c.credential_source, Source::kAssumeRole);
  EXPECT_TRUE(c.access_key_id.empty());
  EXPECT_EQ(c.role_arn, "arn:aws:iam::1:role/x");
  EXPECT_EQ(c.role_session_name, "loader");
  EXPECT_EQ(c.external_id, "ext-7");
  EXPECT_EQ(c.duration_seconds, "1800");
  EXPECT_EQ(c.source_access_key_id, "BASE");
  EXPECT_EQ(c.source_secret_access_key, "BS");
  EXPECT_EQ(c.sts_endpoint, "https://sts.us-east-1.amazonaws.com");
  EXPECT_EQ(c.credentials_from,
            "role arn:aws:iam::1:role/x assumed with the keys of profile "
            "\"base\" in " +
                aws.Path(".aws/credentials") + " (profile \"r\" in " + aws.Path(".aws/config") +
                ") via STS https://sts.us-east-1.amazonaws.com");
  // credential_source = Environment: the environment's keys sign the request.
  r.profile = "env";
  EXPECT_NE(aws.Error(r).find("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not both set"),
            std::string::npos);
  aws.Set("AWS_ACCESS_KEY_ID", "ENVK");
  aws.Set("AWS_SECRET_ACCESS_KEY", "ENVS");
  c = aws.MustResolve(r);
  EXPECT_EQ(c.credential_source, Source::kAssumeRole);
  EXPECT_EQ(c.source_access_key_id, "ENVK");
  EXPECT_EQ(c.role_session_name.rfind("tensorferry-", 0), 0u);
  // What is not supported says so, naming the setting.
  for (const auto& [profile, says] : std::vector<std::pair<std::string, std::string>>{
           {"mfa", "sets mfa_serial"},
           {"chain", "source_profile \"env\" assumes a role itself"},
           {"nokeys", "source_profile \"plain\" has no aws_access_key_id"},
           {"ec2", "credential_source = Ec2InstanceMetadata is not supported"}}) {
    r.profile = profile;
    auto config = aws.Resolve(r);
    ASSERT_FALSE(config.ok()) << profile;
    EXPECT_EQ(config.status().code(), Code::kUnsupported) << profile;
    EXPECT_NE(config.status().message().find(says), std::string::npos)
        << config.status().ToString();
  }
  // A source with static keys gives them, even one that assumes a role itself (botocore's
  // rule), and a profile may assume its role with its own keys.
  r.profile = "keyed";
  EXPECT_EQ(aws.MustResolve(r).source_access_key_id, "OWN");
  r.profile = "self";
  EXPECT_EQ(aws.MustResolve(r).source_access_key_id, "SELF");
  // A web identity token file makes it web identity.
  r.profile = "webid";
  EXPECT_EQ(aws.MustResolve(r).credential_source, Source::kWebIdentity);
  r.profile = "gone";
  EXPECT_NE(aws.Error(r).find("source_profile \"nowhere\" is in neither"), std::string::npos);
  r.profile = "both";
  EXPECT_NE(aws.Error(r).find("sets both source_profile and credential_source"), std::string::npos);
  r.profile = "long";
  EXPECT_NE(aws.Error(r).find("duration_seconds \"99\" is not 900 to 43200"), std::string::npos);
  // The environment's keys come first when the profile is not named in the options.
  aws.Set("AWS_PROFILE", "r");
  EXPECT_EQ(aws.MustResolve().access_key_id, "ENVK");
}

TEST(AwsConfig, WebIdentityFromTheEnvironmentAndTheProfile) {
  using Source = S3Config::CredentialSource;
  FakeAws pod;
  pod.Set("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/eks/token");
  pod.Set("AWS_ROLE_ARN", "arn:aws:iam::123:role/reader");
  pod.Set("AWS_REGION", "eu-west-3");
  S3Config c = pod.MustResolve();
  EXPECT_EQ(c.credential_source, Source::kWebIdentity);
  EXPECT_FALSE(c.anonymous);
  EXPECT_TRUE(c.access_key_id.empty());
  EXPECT_EQ(c.web_identity_token_file, "/var/run/secrets/eks/token");
  EXPECT_EQ(c.role_arn, "arn:aws:iam::123:role/reader");
  EXPECT_EQ(c.role_session_name.rfind("tensorferry-", 0), 0u) << c.role_session_name;
  EXPECT_EQ(c.sts_endpoint, "https://sts.eu-west-3.amazonaws.com");
  EXPECT_NE(c.credentials_from.find("web identity (AWS_WEB_IDENTITY_TOKEN_FILE, role "
                                    "arn:aws:iam::123:role/reader) via STS "
                                    "https://sts.eu-west-3.amazonaws.com"),
            std::string::npos)
      << c.credentials_from;
  // The STS endpoint: AWS_ENDPOINT_URL_STS, else AWS_ENDPOINT_URL (a local S3 server's STS).
  pod.Set("AWS_ENDPOINT_URL", "http://127.0.0.1:8333/");
  EXPECT_EQ(pod.MustResolve().sts_endpoint, "http://127.0.0.1:8333");
  pod.Set("AWS_ENDPOINT_URL_STS", "https://sts.example.com");
  EXPECT_EQ(pod.MustResolve().sts_endpoint, "https://sts.example.com");
  pod.Set("AWS_ROLE_SESSION_NAME", "x");
  EXPECT_NE(pod.Error().find("is not 2 to 64 characters long"), std::string::npos);
  pod.Set("AWS_ROLE_SESSION_NAME", "loader-7");
  EXPECT_EQ(pod.MustResolve().role_session_name, "loader-7");
  // Keys in the environment come first.
  pod.Set("AWS_ACCESS_KEY_ID", "E");
  pod.Set("AWS_SECRET_ACCESS_KEY", "ES");
  c = pod.MustResolve();
  EXPECT_EQ(c.credential_source, Source::kKeys);
  EXPECT_EQ(c.access_key_id, "E");
  // From a profile, ahead of the profile's own keys (botocore's order).
  FakeAws profile;
  profile.Config(
      "[default]\nweb_identity_token_file = /t\nrole_arn = arn:r\nrole_session_name = sess\n"
      "aws_access_key_id = K\naws_secret_access_key = S\n"
      "[profile half]\nweb_identity_token_file = /t\n");
  c = profile.MustResolve();
  EXPECT_EQ(c.credential_source, Source::kWebIdentity);
  EXPECT_EQ(c.role_session_name, "sess");
  EXPECT_NE(c.credentials_from.find("profile \"default\" in " + profile.Path(".aws/config")),
            std::string::npos)
      << c.credentials_from;
  S3Request half;
  half.profile = "half";
  EXPECT_NE(profile.Error(half).find("(web_identity_token_file)) without a role"),
            std::string::npos)
      << profile.Error(half);
  // Key by key: the environment's token file with the profile's role (botocore's rule).
  FakeAws mixed;
  mixed.Config("[default]\nrole_arn = arn:profile-role\n");
  mixed.Set("AWS_WEB_IDENTITY_TOKEN_FILE", "/env/token");
  c = mixed.MustResolve();
  EXPECT_EQ(c.web_identity_token_file, "/env/token");
  EXPECT_EQ(c.role_arn, "arn:profile-role");
  // A profile named in the options: the environment's web identity is not read (botocore drops
  // the environment's providers), so every IRSA pod's variables do not override it.
  FakeAws irsa;
  irsa.Credentials("[dev]\naws_access_key_id = DEV\naws_secret_access_key = DS\n");
  irsa.Set("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/eks/token");
  irsa.Set("AWS_ROLE_ARN", "arn:aws:iam::123:role/reader");
  S3Request dev;
  dev.profile = "dev";
  c = irsa.MustResolve(dev);
  EXPECT_EQ(c.credential_source, Source::kKeys);
  EXPECT_EQ(c.access_key_id, "DEV");
}

TEST(AwsConfig, CredentialProcessSitsBetweenTheTwoFilesKeys) {
  using Source = S3Config::CredentialSource;
  FakeAws aws;
  aws.Config(
      "[default]\ncredential_process = /usr/bin/creds --json\n"
      "aws_access_key_id = CK\naws_secret_access_key = CS\n");
  S3Config c = aws.MustResolve();
  EXPECT_EQ(c.credential_source, Source::kProcess);
  EXPECT_EQ(c.credential_process, "/usr/bin/creds --json");
  EXPECT_EQ(c.credentials_from,
            "credential_process of profile \"default\" in " + aws.Path(".aws/config"));
  aws.Credentials("[default]\naws_access_key_id = FK\naws_secret_access_key = FS\n");
  c = aws.MustResolve();
  EXPECT_EQ(c.credential_source, Source::kKeys);
  EXPECT_EQ(c.access_key_id, "FK");
}

TEST(AwsConfig, ContainerCredentials) {
  using Source = S3Config::CredentialSource;
  FakeAws aws;
  aws.Set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/credentials/abc");
  aws.Set("AWS_CONTAINER_AUTHORIZATION_TOKEN", "secret-token");
  S3Config c = aws.MustResolve();
  EXPECT_EQ(c.credential_source, Source::kContainer);
  EXPECT_EQ(c.container_uri, "http://169.254.170.2/v2/credentials/abc");
  EXPECT_EQ(c.container_token, "secret-token");
  EXPECT_EQ(c.credentials_from.find("secret-token"), std::string::npos);
  // RELATIVE wins over FULL (botocore's order).
  aws.Set("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://127.0.0.1:9911/full");
  EXPECT_EQ(aws.MustResolve().container_uri, "http://169.254.170.2/v2/credentials/abc");
  aws.Unset("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI");
  // Plain http only to loopback and the ECS/EKS link-local addresses.
  for (const char* ok :
       {"http://127.0.0.1:9911/creds", "http://localhost/c", "http://169.254.170.23/v1/credentials",
        "http://[fd00:ec2::23]/c", "http://[::1]:80/c", "https://creds.example.com/c"}) {
    aws.Set("AWS_CONTAINER_CREDENTIALS_FULL_URI", ok);
    c = aws.MustResolve();
    EXPECT_EQ(c.container_uri, ok);
  }
  for (const char* bad :
       {"http://10.1.2.3/creds", "http://127.0.0.1.evil.com/c", "ftp://127.0.0.1/c", "http:///c"}) {
    aws.Set("AWS_CONTAINER_CREDENTIALS_FULL_URI", bad);
    const std::string message = aws.Error();
    EXPECT_NE(message.find(std::string("AWS_CONTAINER_CREDENTIALS_FULL_URI \"") + bad),
              std::string::npos)
        << message;
  }
  // A user name and password in the URI are refused, and not shown.
  aws.Set("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://user:hunter2@127.0.0.1/c");
  const std::string userinfo = aws.Error();
  EXPECT_NE(userinfo.find("\"http://***@127.0.0.1/c\": must not carry a user name or password"),
            std::string::npos)
      << userinfo;
  EXPECT_EQ(userinfo.find("hunter2"), std::string::npos);
  // The token file wins over the token.
  aws.Set("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://127.0.0.1/c");
  aws.Set("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "/var/run/token");
  c = aws.MustResolve();
  EXPECT_EQ(c.container_token_file, "/var/run/token");
  EXPECT_TRUE(c.container_token.empty());
}

TEST(AwsConfig, InstanceMetadataWhenNamedOrOnEc2) {
  using Source = S3Config::CredentialSource;
  FakeAws aws;
  EXPECT_TRUE(aws.MustResolve().anonymous);  // not EC2, nothing named: not asked
  aws.Write("dmi/sys_vendor", "Amazon EC2\n");
  S3Config c = aws.MustResolve();
  EXPECT_EQ(c.credential_source, Source::kInstanceMetadata);
  EXPECT_EQ(c.imds_endpoint, "http://169.254.169.254");
  EXPECT_FALSE(c.anonymous);
  aws.Set("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:1338/");
  EXPECT_EQ(aws.MustResolve().imds_endpoint, "http://127.0.0.1:1338");
  aws.Set("AWS_EC2_METADATA_DISABLED", "true");
  c = aws.MustResolve();
  EXPECT_TRUE(c.anonymous);
  EXPECT_EQ(c.credential_source, Source::kKeys);
  // Xen-era instances say so in the BIOS version; container credentials come first.
  FakeAws xen;
  xen.Write("dmi/bios_version", "4.11.amazon\n");
  EXPECT_EQ(xen.MustResolve().credential_source, Source::kInstanceMetadata);
  xen.Set("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://127.0.0.1/c");
  EXPECT_EQ(xen.MustResolve().credential_source, Source::kContainer);
}

TEST(AwsConfig, ProfileSelectionAndSections) {
  FakeAws aws;
  aws.Credentials(
      "[default]\naws_access_key_id = D\naws_secret_access_key = DS\n"
      "[env]\naws_access_key_id = E\naws_secret_access_key = ES\n"
      "[envdefault]\naws_access_key_id = ED\naws_secret_access_key = EDS\n");
  // In the config file a named profile is "[profile NAME]": "[opt]" is not profile "opt".
  aws.Config(
      "[opt]\nregion = wrong\n[profile opt]\naws_access_key_id = O\n"
      "aws_secret_access_key = OS\nregion = eu-west-3\n");
  EXPECT_EQ(aws.MustResolve().access_key_id, "D");
  aws.Set("AWS_PROFILE", "env");
  EXPECT_EQ(aws.MustResolve().access_key_id, "E");
  // Both set: AWS_DEFAULT_PROFILE, as botocore (and so boto3 and the AWS CLI) read them.
  aws.Set("AWS_DEFAULT_PROFILE", "envdefault");
  EXPECT_EQ(aws.MustResolve().access_key_id, "ED");
  S3Request request;
  request.profile = "opt";
  const S3Config c = aws.MustResolve(request);
  EXPECT_EQ(c.access_key_id, "O");
  EXPECT_EQ(c.region, "eu-west-3");
  EXPECT_EQ(c.region_from, "profile \"opt\" in " + aws.Path(".aws/config"));
  EXPECT_EQ(c.credentials_from, "profile \"opt\" in " + aws.Path(".aws/config"));
}

TEST(AwsConfig, MissingExplicitProfileIsAnError) {
  FakeAws aws;
  aws.Credentials("[default]\naws_access_key_id = D\naws_secret_access_key = DS\n");
  S3Request request;
  request.profile = "nope";
  std::string message = aws.Error(request);
  EXPECT_NE(message.find("AWS profile \"nope\" (from options)"), std::string::npos) << message;
  EXPECT_NE(message.find(aws.Path(".aws/credentials")), std::string::npos) << message;
  EXPECT_NE(message.find(aws.Path(".aws/config")), std::string::npos) << message;
  aws.Set("AWS_PROFILE", "gone");
  message = aws.Error();
  EXPECT_NE(message.find("\"gone\" (from AWS_PROFILE)"), std::string::npos) << message;
  // The implicit "default" may be missing.
  FakeAws empty;
  EXPECT_TRUE(empty.Resolve().ok());
}

TEST(AwsConfig, FileLocationsFromTheEnvironment) {
  FakeAws aws;
  aws.Credentials("[default]\naws_access_key_id = HOME_ID\naws_secret_access_key = S\n");
  aws.Write("elsewhere/creds",
            "[default]\naws_access_key_id = ENV_FILE_ID\naws_secret_access_key = S\n");
  aws.Write("elsewhere/conf", "[default]\nregion = ap-south-1\n");
  aws.Set("AWS_SHARED_CREDENTIALS_FILE", aws.Path("elsewhere/creds"));
  aws.Set("AWS_CONFIG_FILE", "~/elsewhere/conf");  // "~/" is $HOME
  const S3Config c = aws.MustResolve();
  EXPECT_EQ(c.access_key_id, "ENV_FILE_ID");
  EXPECT_EQ(c.region, "ap-south-1");
  // Files that do not exist are fine.
  aws.Set("AWS_SHARED_CREDENTIALS_FILE", aws.Path("missing/creds"));
  aws.Set("AWS_CONFIG_FILE", aws.Path("missing/conf"));
  EXPECT_TRUE(aws.MustResolve().anonymous);
  // /dev/null turns a file off, as for the AWS CLI.
  aws.Set("AWS_SHARED_CREDENTIALS_FILE", "/dev/null");
  aws.Set("AWS_CONFIG_FILE", "/dev/null");
  EXPECT_TRUE(aws.MustResolve().anonymous);
  // A directory where the file should be cannot be read.
  aws.Set("AWS_CONFIG_FILE", aws.Path("elsewhere"));
  auto dir = aws.Resolve();
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.status().code(), Code::kIoError);
  EXPECT_NE(dir.status().message().find(aws.Path("elsewhere")), std::string::npos);
}

TEST(AwsConfig, RegionPrecedence) {
  FakeAws aws;
  aws.Config("[default]\nregion = from-profile\n");
  EXPECT_EQ(aws.MustResolve().region, "from-profile");
  aws.Set("AWS_DEFAULT_REGION", "from-default-env");
  EXPECT_EQ(aws.MustResolve().region, "from-default-env");
  aws.Set("AWS_REGION", "from-env");
  S3Config c = aws.MustResolve();
  EXPECT_EQ(c.region, "from-env");
  EXPECT_EQ(c.region_from, "AWS_REGION");
  EXPECT_EQ(c.endpoint, "https://s3.from-env.amazonaws.com");
  S3Request request;
  request.region = "cn-north-1";
  c = aws.MustResolve(request);
  EXPECT_EQ(c.region, "cn-north-1");
  EXPECT_EQ(c.region_from, "options");
  EXPECT_EQ(c.endpoint, "https://s3.cn-north-1.amazonaws.com.cn");
  request.region = "us-east-1:evil";
  EXPECT_NE(aws.Error(request).find("S3 region \"us-east-1:evil\" from options"),
            std::string::npos);
}

TEST(AwsConfig, EndpointPrecedence) {
  FakeAws aws;
  aws.Config("[default]\nendpoint_url = http://all-profile:1\n");
  S3Config c = aws.MustResolve();
  EXPECT_EQ(c.endpoint, "http://all-profile:1");
  EXPECT_EQ(c.endpoint_from, "profile \"default\" (endpoint_url) in " + aws.Path(".aws/config"));
  aws.Config(
      "[default]\nendpoint_url = http://all-profile:1\ns3 =\n  endpoint_url = "
      "http://s3-profile:2/\n");
  c = aws.MustResolve();
  EXPECT_EQ(c.endpoint, "http://s3-profile:2");
  EXPECT_EQ(c.endpoint_from, "profile \"default\" (s3.endpoint_url) in " + aws.Path(".aws/config"));
  // The AWS way: the profile names a [services NAME] section holding the service's endpoint.
  aws.Config(
      "[default]\nendpoint_url = http://all-profile:1\ns3 =\n  endpoint_url = "
      "http://s3-profile:2/\nservices = local\n[services local]\ns3 =\n  endpoint_url = "
      "http://services-s3:5\n");
  c = aws.MustResolve();
  EXPECT_EQ(c.endpoint, "http://services-s3:5");
  EXPECT_EQ(c.endpoint_from, "[services local] (s3.endpoint_url) in " + aws.Path(".aws/config") +
                                 ", named by profile \"default\"");
  aws.Config("[default]\nservices = missing\n");
  EXPECT_NE(aws.Error().find("there is no [services missing] section"), std::string::npos)
      << aws.Error();
  aws.Config(
      "[default]\nservices = local\n[services local]\ns3 =\n  endpoint_url = "
      "http://services-s3:5\n");
  aws.Set("AWS_ENDPOINT_URL", "http://all-env:3");
  EXPECT_EQ(aws.MustResolve().endpoint, "http://all-env:3");
  aws.Set("AWS_ENDPOINT_URL_S3", "https://s3-env:4");
  c = aws.MustResolve();
  EXPECT_EQ(c.endpoint, "https://s3-env:4");
  EXPECT_EQ(c.endpoint_from, "AWS_ENDPOINT_URL_S3");
  S3Request request;
  request.endpoint = "HTTP://127.0.0.1:8333/";
  c = aws.MustResolve(request);
  EXPECT_EQ(c.endpoint, "http://127.0.0.1:8333");
  EXPECT_EQ(c.endpoint_from, "options");
  // Ignoring configured endpoints leaves the explicit one, or the AWS default.
  aws.Set("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true");
  EXPECT_EQ(aws.MustResolve(request).endpoint, "http://127.0.0.1:8333");
  c = aws.MustResolve();
  EXPECT_EQ(c.endpoint, "https://s3.us-east-1.amazonaws.com");
  EXPECT_EQ(c.endpoint_from, "AWS default");
}

TEST(AwsConfig, EndpointValidation) {
  FakeAws aws;
  S3Request request;
  for (const char* bad : {"s3.example.com", "ftp://h", "http://h/path", "http://h//",
                          "http://h?x=1", "http://user:pw@h", "http://h:99999", "s3://b"}) {
    request.endpoint = bad;
    const std::string message = aws.Error(request);
    // Named as shown: no password, no query (RedactUrl).
    EXPECT_NE(message.find(std::string("S3 endpoint \"") + RedactUrl(bad) + "\" from options"),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find("pw"), std::string::npos) << message;
    EXPECT_EQ(message.find("x=1"), std::string::npos) << message;
  }
  aws.Set("AWS_ENDPOINT_URL", "localhost:9000");
  EXPECT_NE(aws.Error().find("from AWS_ENDPOINT_URL"), std::string::npos);
}

TEST(AwsConfig, PathStyle) {
  FakeAws aws;
  // Auto: virtual-hosted on AWS, path-style elsewhere.
  EXPECT_FALSE(aws.MustResolve().path_style);
  S3Request custom;
  custom.endpoint = "http://127.0.0.1:8333";
  S3Config c = aws.MustResolve(custom);
  EXPECT_TRUE(c.path_style);
  EXPECT_TRUE(c.path_style_auto);
  custom.endpoint = "https://bucket-host.S3.eu-west-1.AmazonAWS.com";
  EXPECT_FALSE(aws.MustResolve(custom).path_style);
  // The profile's s3.addressing_style.
  aws.Config("[default]\ns3 =\n    addressing_style = path\n");
  c = aws.MustResolve();
  EXPECT_TRUE(c.path_style);
  EXPECT_FALSE(c.path_style_auto);
  aws.Config("[default]\ns3 =\n    addressing_style = virtual\n");
  custom.endpoint = "http://127.0.0.1:8333";
  c = aws.MustResolve(custom);
  EXPECT_FALSE(c.path_style);
  EXPECT_FALSE(c.path_style_auto);
  aws.Config("[default]\ns3 =\n    addressing_style = auto\n");
  EXPECT_TRUE(aws.MustResolve(custom).path_style_auto);
  aws.Config("[default]\ns3 =\n    addressing_style = sideways\n");
  const std::string message = aws.Error();
  EXPECT_NE(message.find("\"sideways\" is not path, virtual or auto"), std::string::npos);
  EXPECT_NE(message.find(aws.Path(".aws/config")), std::string::npos) << message;
  // The request beats the profile.
  S3Request path;
  path.path_style = 1;
  EXPECT_TRUE(aws.MustResolve(path).path_style);
  aws.Config("[default]\ns3 =\n    addressing_style = path\n");
  path.path_style = 0;
  EXPECT_FALSE(aws.MustResolve(path).path_style);
}

ObjectUrl S3Url(const std::string& url) {
  auto parsed = ParseObjectUrl(url);
  EXPECT_TRUE(parsed.ok()) << parsed.status().ToString();
  return parsed.ok() ? *parsed : ObjectUrl{};
}

TEST(AwsConfig, ObjectRequestUrl) {
  S3Config c;
  c.endpoint = "http://127.0.0.1:8333";
  c.path_style = true;
  // (A URL with a space is refused by ParseObjectUrl, but keys listed or joined may hold one.)
  ObjectUrl url;
  url.bucket = "models";
  url.key = "llama 3/model+1.safetensors";
  EXPECT_EQ(c.ObjectRequestUrl(url),
            "http://127.0.0.1:8333/models/llama%203/model%2B1.safetensors");
  EXPECT_EQ(c.ObjectRequestUrl(S3Url("s3://models/prefix/"), "list-type=2&prefix=a%2Fb"),
            "http://127.0.0.1:8333/models/prefix/?list-type=2&prefix=a%2Fb");
  EXPECT_EQ(c.ObjectRequestUrl(S3Url("s3://models"), "list-type=2"),
            "http://127.0.0.1:8333/models?list-type=2");

  c.endpoint = "https://s3.eu-west-1.amazonaws.com";
  c.path_style = false;
  c.path_style_auto = true;
  EXPECT_FALSE(c.UsesPathStyle(url));
  EXPECT_EQ(c.ObjectRequestUrl(url),
            "https://models.s3.eu-west-1.amazonaws.com/llama%203/model%2B1.safetensors");
  EXPECT_EQ(c.ObjectRequestUrl(S3Url("s3://models"), "list-type=2"),
            "https://models.s3.eu-west-1.amazonaws.com/?list-type=2");
  // A bucket with a '.' (or '_') cannot be a host-name label under a wildcard certificate.
  const ObjectUrl dotted = S3Url("s3://my.models/a~b");
  EXPECT_TRUE(c.UsesPathStyle(dotted));
  EXPECT_EQ(c.ObjectRequestUrl(dotted), "https://s3.eu-west-1.amazonaws.com/my.models/a~b");
  c.path_style_auto = false;  // explicitly virtual-hosted: kept
  EXPECT_EQ(c.ObjectRequestUrl(dotted), "https://my.models.s3.eu-west-1.amazonaws.com/a~b");
  // Virtual-hosted with a port.
  c.endpoint = "http://minio.local:9000";
  EXPECT_EQ(c.ObjectRequestUrl(S3Url("s3://b/k")), "http://b.minio.local:9000/k");
  // http(s) URLs go as they are.
  auto http = ParseObjectUrl("https://hub.example/x/m%20a.safetensors");
  ASSERT_TRUE(http.ok());
  EXPECT_EQ(c.ObjectRequestUrl(*http), "https://hub.example/x/m%20a.safetensors");
}

TEST(AwsConfig, ListObjectsV2Query) {
  EXPECT_EQ(ListObjectsV2Query(""), "list-type=2");
  EXPECT_EQ(ListObjectsV2Query("llama 3/"), "list-type=2&prefix=llama%203%2F");
  EXPECT_EQ(ListObjectsV2Query("p/", "1ueG+cx/L=", "/"),
            "continuation-token=1ueG%2Bcx%2FL%3D&delimiter=%2F&list-type=2&prefix=p%2F");
  S3Config c;
  c.endpoint = "http://127.0.0.1:8333";
  c.path_style = true;
  EXPECT_EQ(c.ObjectRequestUrl(S3Url("s3://models"), ListObjectsV2Query("a/")),
            "http://127.0.0.1:8333/models?list-type=2&prefix=a%2F");
}

TEST(AwsIni, CommentsWhitespaceAndNestedSections) {
  const std::string text =
      "# a comment\n"
      "; another\n"
      "[default]\r\n"
      "region=us-west-2   \n"
      "output   =   json  # inline comment\n"
      "secret = abc#not-a-comment\n"
      "Upper_Case = kept\n"
      "\n"
      "[ profile   dev ]  ; comment after the header\n"
      "s3 =\n"
      "    endpoint_url = http://localhost:8333\n"
      "\n"
      "    addressing_style = path\n"
      "region = eu-central-1\n"
      "multi = first\n"
      "   second\n"
      "[empty]\n";
  auto ini = ParseAwsIni(text, "cfg");
  ASSERT_TRUE(ini.ok()) << ini.status().ToString();
  auto& d = ini->at("default");
  EXPECT_EQ(d.at("upper_case"), "kept");  // names lower-cased, values kept
  EXPECT_EQ(d.at("region"), "us-west-2");
  // No inline comments, as botocore's parser (RawConfigParser) reads values: a
  // credential_process "a ; b" is run whole.
  EXPECT_EQ(d.at("output"), "json  # inline comment");
  EXPECT_EQ(d.at("secret"), "abc#not-a-comment");
  auto& dev = ini->at("profile dev");
  EXPECT_EQ(dev.at("s3.endpoint_url"), "http://localhost:8333");
  EXPECT_EQ(dev.at("s3.addressing_style"), "path");
  EXPECT_EQ(dev.count("s3"), 0U);
  EXPECT_EQ(dev.at("region"), "eu-central-1");
  EXPECT_EQ(dev.at("multi"), "first\nsecond");
  EXPECT_TRUE(ini->at("empty").empty());
}

TEST(AwsIni, IndentedFileReadsAsTheAwsCliReadsIt) {
  // Properties at one indentation are siblings; only deeper lines continue one.
  auto ini =
      ParseAwsIni("[default]\n  region = a\n  s3 =\n    addressing_style = path\n  x = y\n", "cfg");
  ASSERT_TRUE(ini.ok()) << ini.status().ToString();
  EXPECT_EQ(ini->at("default").at("region"), "a");
  EXPECT_EQ(ini->at("default").at("s3.addressing_style"), "path");
  EXPECT_EQ(ini->at("default").at("x"), "y");
}

TEST(AwsIni, MalformedLinesNameFileAndLine) {
  const std::pair<std::string, std::string> cases[] = {
      {"region = x\n", "cfg:1: a property before any [section]"},
      {"[default]\nregion\n", "cfg:2: expected \"key = value\""},
      {"[default]\n = x\n", "cfg:2: expected \"key = value\""},
      {"[default\n", "cfg:1: a '[' section without ']'"},
      {"[]\n", "cfg:1: an empty section name"},
      {"[a] b\n", "cfg:1: unexpected text after the section's ']'"},
      {"[a]\n\n# c\ns3 =\n  no equals sign\n", "cfg:5: expected an indented \"key = value\""},
  };
  for (const auto& [text, expected] : cases) {
    auto ini = ParseAwsIni(text, "cfg");
    ASSERT_FALSE(ini.ok()) << text;
    EXPECT_EQ(ini.status().code(), Code::kInvalidArgument);
    EXPECT_EQ(ini.status().message().rfind(expected, 0), 0U) << ini.status().message();
  }
  // Through ResolveS3Config, the message names the real file.
  FakeAws aws;
  aws.Config("[default]\nregion = x\nthis is not a property\n");
  const std::string message = aws.Error();
  EXPECT_NE(message.find(aws.Path(".aws/config") + ":3:"), std::string::npos) << message;
}

}  // namespace
}  // namespace tensorferry::objstore
