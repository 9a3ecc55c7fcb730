#include "objstore/gcs_auth.h"

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rsa.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "io/read_engine.h"

namespace tensorferry::objstore {
namespace {

class GcsConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("tf_gcs_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    env_["HOME"] = (dir_ / "home").string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  GetEnv Env() const {
    return [this](const char* name) -> std::optional<std::string> {
      auto it = env_.find(name);
      if (it == env_.end()) return std::nullopt;
      return it->second;
    };
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::filesystem::path p = dir_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }
  Result<GcsConfig> Resolve(const GcsRequest& r = {}, const std::string& dmi = "") const {
    return ResolveGcsConfig(r, Env(), dmi);
  }

  std::filesystem::path dir_;
  std::map<std::string, std::string> env_;
};

TEST_F(GcsConfigTest, DefaultsAreGooglesEndpointPathStyleAndAnonymous) {
  // AWS settings never apply to gs:// URLs.
  env_["AWS_ACCESS_KEY_ID"] = "AKIA";
  env_["AWS_SECRET_ACCESS_KEY"] = "secret";
  env_["AWS_ENDPOINT_URL"] = "http://127.0.0.1:1";
  Result<GcsConfig> c = Resolve();
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->s3.endpoint, "https://storage.googleapis.com");
  EXPECT_EQ(c->s3.endpoint_from, "GCS default");
  EXPECT_EQ(c->s3.region, "auto");
  GcsRequest with_region;
  with_region.region = "us-east-1";
  EXPECT_EQ(Resolve(with_region)->s3.region, "us-east-1");
  EXPECT_TRUE(c->s3.anonymous);
  EXPECT_TRUE(c->s3.access_key_id.empty());
  EXPECT_EQ(c->token_kind, GcsTokenKind::kNone);
  EXPECT_EQ(c->s3.credentials_from, "none found: anonymous");
  ObjectUrl url;
  url.scheme = Scheme::kGs;
  url.bucket = "my.bucket";
  url.key = "a b/model.safetensors";
  EXPECT_EQ(c->s3.ObjectRequestUrl(url),
            "https://storage.googleapis.com/my.bucket/a%20b/model.safetensors");
}

TEST_F(GcsConfigTest, EndpointFromOptionsIsChecked) {
  GcsRequest r;
  r.endpoint = "http://127.0.0.1:8333/";
  Result<GcsConfig> c = Resolve(r);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->s3.endpoint, "http://127.0.0.1:8333");
  r.endpoint = "gs://bucket";
  c = Resolve(r);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("GCS endpoint \"gs://bucket\" from options"),
            std::string::npos)
      << c.status().message();
}

TEST_F(GcsConfigTest, ExplicitSettingsComeFirst) {
  env_["GOOGLE_OAUTH_ACCESS_TOKEN"] = "env-token";
  GcsRequest r;
  r.anonymous = 1;
  r.token = "option-token";
  r.access_key_id = "GOOG1E";
  r.secret_access_key = "hmac-secret";
  Result<GcsConfig> c = Resolve(r);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->s3.anonymous);
  EXPECT_EQ(c->token_kind, GcsTokenKind::kNone);
  EXPECT_EQ(c->s3.credentials_from, "options: anonymous");

  r.anonymous = -1;  // HMAC keys before a token
  c = Resolve(r);
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->s3.anonymous);
  EXPECT_EQ(c->s3.access_key_id, "GOOG1E");
  EXPECT_EQ(c->s3.secret_access_key, "hmac-secret");
  EXPECT_EQ(c->token_kind, GcsTokenKind::kNone);
  EXPECT_EQ(c->s3.credentials_from, "options (HMAC key)");

  r.access_key_id.clear();
  c = Resolve(r);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("give both"), std::string::npos);

  r.secret_access_key.clear();  // the token option before the environment's
  c = Resolve(r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->token_kind, GcsTokenKind::kStatic);
  EXPECT_EQ(c->token, "option-token");
  EXPECT_EQ(c->s3.credentials_from, "options (token)");

  r.token.clear();
  c = Resolve(r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->token, "env-token");
  EXPECT_EQ(c->s3.credentials_from, "environment (GOOGLE_OAUTH_ACCESS_TOKEN)");
  // A token read from a file keeps its newline: dropped; a break inside it would add a header.
  env_["GOOGLE_OAUTH_ACCESS_TOKEN"] = "ya29.file-token\n";
  c = Resolve(r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->token, "ya29.file-token");
  env_["GOOGLE_OAUTH_ACCESS_TOKEN"] = "ya29.secret\nX-Injected: yes";
  c = Resolve(r);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
  EXPECT_NE(c.status().message().find("GOOGLE_OAUTH_ACCESS_TOKEN"), std::string::npos);
  EXPECT_EQ(c.status().message().find("secret"), std::string::npos) << "the token was printed";
}

TEST_F(GcsConfigTest, ApplicationDefaultCredentialsFiles) {
  // gcloud's file in $HOME/.config/gcloud is read when nothing else is set ...
  const std::string user =
      Write("home/.config/gcloud/application_default_credentials.json",
            R"({"type": "authorized_user", "client_id": "id.apps", "client_secret": "cs",
          "refresh_token": "1//rt", "quota_project_id": "p", "universe_domain": "googleapis.com"})");
  Result<GcsConfig> c = Resolve();
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->token_kind, GcsTokenKind::kAuthorizedUser);
  EXPECT_EQ(c->client_id, "id.apps");
  EXPECT_EQ(c->client_secret, "cs");
  EXPECT_EQ(c->refresh_token, "1//rt");
  EXPECT_EQ(c->token_uri, "https://oauth2.googleapis.com/token");
  EXPECT_EQ(c->credentials_file, user);
  EXPECT_NE(c->s3.credentials_from.find("authorized_user " + user), std::string::npos);
  EXPECT_TRUE(c->s3.anonymous);  // no Signature V4: the token authorizes

  // ... CLOUDSDK_CONFIG moves it ...
  env_["CLOUDSDK_CONFIG"] = (dir_ / "elsewhere").string();
  c = Resolve();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->token_kind, GcsTokenKind::kNone);

  // ... and GOOGLE_APPLICATION_CREDENTIALS comes before it.
  const std::string sa = Write("sa.json", R"({"type": "service_account", "project_id": "p",
      "private_key_id": "kid1", "private_key": "-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----\n",
      "client_email": "loader@p.iam.gserviceaccount.com", "token_uri": "http://127.0.0.1:9/token"})");
  env_["GOOGLE_APPLICATION_CREDENTIALS"] = sa;
  c = Resolve();
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->token_kind, GcsTokenKind::kServiceAccount);
  EXPECT_EQ(c->client_email, "loader@p.iam.gserviceaccount.com");
  EXPECT_EQ(c->private_key_id, "kid1");
  EXPECT_EQ(c->token_uri, "http://127.0.0.1:9/token");
  EXPECT_NE(c->private_key.find("BEGIN PRIVATE KEY"), std::string::npos);
  EXPECT_NE(
      c->s3.credentials_from.find("service_account " + sa + " (GOOGLE_APPLICATION_CREDENTIALS)"),
      std::string::npos)
      << c->s3.credentials_from;
}

TEST_F(GcsConfigTest, CredentialsFileErrorsNameTheFileAndWhatIsWrong) {
  env_["GOOGLE_APPLICATION_CREDENTIALS"] = (dir_ / "missing.json").string();
  Result<GcsConfig> c = Resolve();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kNotFound);
  EXPECT_NE(c.status().message().find("missing.json, which does not exist"), std::string::npos);

  const struct {
    const char* text;
    Code code;
    const char* says;
  } cases[] = {
      {"{not json", Code::kInvalidArgument, "not valid JSON"},
      {"[1]", Code::kInvalidArgument, "not an object"},
      {R"({"client_id": "x"})", Code::kInvalidArgument, "no \"type\""},
      {R"({"type": "external_account", "audience": "x"})", Code::kUnsupported,
       "\"external_account\" are not read"},
      {R"({"type": "authorized_user", "client_id": "x", "client_secret": "y"})",
       Code::kInvalidArgument, "needs \"refresh_token\""},
      {R"({"type": "service_account", "private_key": "k"})", Code::kInvalidArgument,
       "needs \"client_email\""},
      {R"({"type": "authorized_user", "client_id": "x", "client_secret": "y",
           "refresh_token": "z", "token_uri": "file:///etc/passwd"})",
       Code::kInvalidArgument, "token_uri \"file:///etc/passwd\" is not an http(s) URL"},
  };
  for (const auto& k : cases) {
    const std::string path = Write("bad.json", k.text);
    env_["GOOGLE_APPLICATION_CREDENTIALS"] = path;
    c = Resolve();
    ASSERT_FALSE(c.ok()) << k.text;
    EXPECT_EQ(c.status().code(), k.code) << k.text;
    EXPECT_NE(c.status().message().find(path), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find(k.says), std::string::npos) << c.status().message();
    // Secrets never appear in messages.
    EXPECT_EQ(c.status().message().find("\"y\""), std::string::npos);
  }
}

TEST_F(GcsConfigTest, MetadataServerOnGoogleVmsOrWhenNamed) {
  const std::string dmi = Write("product_name", "Google Compute Engine\n");
  Result<GcsConfig> c = Resolve({}, dmi);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->token_kind, GcsTokenKind::kMetadata);
  EXPECT_EQ(c->metadata_host, "metadata.google.internal");
  EXPECT_EQ(c->s3.credentials_from,
            "metadata server metadata.google.internal (a Google Compute Engine VM)");

  const std::string other = Write("other_product", "Standard PC (Q35 + ICH9, 2009)\n");
  c = Resolve({}, other);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->token_kind, GcsTokenKind::kNone);

  env_["GCE_METADATA_HOST"] = "127.0.0.1:8080";
  c = Resolve({}, other);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->token_kind, GcsTokenKind::kMetadata);
  EXPECT_EQ(c->metadata_host, "127.0.0.1:8080");

  env_.erase("GCE_METADATA_HOST");
  GcsRequest r;
  r.anonymous = 0;
  c = Resolve(r, other);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("no GCS credentials found"), std::string::npos);
}

TEST(GcsJwt, Base64UrlHasNoPaddingAndTheUrlAlphabet) {
  EXPECT_EQ(Base64Url(""), "");
  EXPECT_EQ(Base64Url("f"), "Zg");
  EXPECT_EQ(Base64Url("fo"), "Zm8");
  EXPECT_EQ(Base64Url("foo"), "Zm9v");
  EXPECT_EQ(Base64Url("foob"), "Zm9vYg");
  EXPECT_EQ(Base64Url("fooba"), "Zm9vYmE");
  EXPECT_EQ(Base64Url("foobar"), "Zm9vYmFy");
  EXPECT_EQ(Base64Url("\xfb\xff\xbf"), "-_-_");
}

std::string Base64UrlDecode(std::string_view s) {
  static const std::string kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    acc = (acc << 6) | static_cast<uint32_t>(kAlphabet.find(c));
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

// A fresh RSA key as PKCS#8 PEM, and its public half.
std::pair<std::string, std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>> NewRsaKey() {
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_RSA_gen(2048), &EVP_PKEY_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), &BIO_free);
  PEM_write_bio_PrivateKey(bio.get(), key.get(), nullptr, nullptr, 0, nullptr, nullptr);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return {std::string(data, static_cast<size_t>(n)), std::move(key)};
}

bool Verifies(EVP_PKEY* key, std::string_view input, std::string_view signature) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  return EVP_DigestVerifyInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key) == 1 &&
         EVP_DigestVerify(ctx.get(), reinterpret_cast<const unsigned char*>(signature.data()),
                          signature.size(), reinterpret_cast<const unsigned char*>(input.data()),
                          input.size()) == 1;
}

TEST(GcsJwt, ServiceAccountAssertionIsAnRs256JwtForTheTokenUri) {
  auto [pem, key] = NewRsaKey();
  GcsConfig c;
  c.client_email = "loader@p.iam.gserviceaccount.com";
  c.private_key = pem;
  c.private_key_id = "kid1";
  c.token_uri = "https://oauth2.googleapis.com/token";
  Result<std::string> jwt = ServiceAccountAssertion(c, 1'700'000'000);
  ASSERT_TRUE(jwt.ok()) << jwt.status().message();
  const size_t dot1 = jwt->find('.');
  const size_t dot2 = jwt->rfind('.');
  ASSERT_NE(dot1, dot2);
  EXPECT_EQ(Base64UrlDecode(jwt->substr(0, dot1)), R"({"alg":"RS256","typ":"JWT","kid":"kid1"})");
  EXPECT_EQ(Base64UrlDecode(jwt->substr(dot1 + 1, dot2 - dot1 - 1)),
            R"({"iss":"loader@p.iam.gserviceaccount.com",)"
            R"("scope":"https://www.googleapis.com/auth/devstorage.read_only",)"
            R"("aud":"https://oauth2.googleapis.com/token","iat":1700000000,"exp":1700003600})");
  const std::string signature = Base64UrlDecode(jwt->substr(dot2 + 1));
  EXPECT_EQ(signature.size(), 256u);
  EXPECT_TRUE(Verifies(key.get(), jwt->substr(0, dot2), signature));
  EXPECT_FALSE(Verifies(key.get(), jwt->substr(0, dot2) + "x", signature));
}

TEST(GcsJwt, KeysThatCannotSignAreNamed) {
  GcsConfig c;
  c.client_email = "x@y";
  c.token_uri = "https://oauth2.googleapis.com/token";
  c.credentials_file = "/secrets/sa.json";
  c.private_key = "-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n";
  Result<std::string> jwt = ServiceAccountAssertion(c, 1);
  ASSERT_FALSE(jwt.ok());
  EXPECT_EQ(jwt.status().code(), Code::kInvalidArgument);
  EXPECT_NE(jwt.status().message().find("/secrets/sa.json"), std::string::npos);
  EXPECT_NE(jwt.status().message().find("not a PEM private key"), std::string::npos);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> ec(EVP_EC_gen("P-256"), &EVP_PKEY_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), &BIO_free);
  PEM_write_bio_PrivateKey(bio.get(), ec.get(), nullptr, nullptr, 0, nullptr, nullptr);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  c.private_key.assign(data, static_cast<size_t>(n));
  jwt = ServiceAccountAssertion(c, 1);
  ASSERT_FALSE(jwt.ok());
  EXPECT_NE(jwt.status().message().find("not an RSA key"), std::string::npos);
  // An encrypted key: refused at once, never a passphrase prompt on the terminal.
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> rsa(EVP_RSA_gen(2048), &EVP_PKEY_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> enc(BIO_new(BIO_s_mem()), &BIO_free);
  char pass[] = "secret";
  ASSERT_EQ(PEM_write_bio_PrivateKey(enc.get(), rsa.get(), EVP_aes_256_cbc(),
                                     reinterpret_cast<unsigned char*>(pass), 6, nullptr, nullptr),
            1);
  const long m = BIO_get_mem_data(enc.get(), &data);
  c.private_key.assign(data, static_cast<size_t>(m));
  jwt = ServiceAccountAssertion(c, 1);
  ASSERT_FALSE(jwt.ok());
  EXPECT_NE(jwt.status().message().find("an encrypted (passphrase-protected) PEM key"),
            std::string::npos)
      << jwt.status().ToString();
}

TEST(GcsTokens, TokenAnswersAreCheckedBeforeTheyGoIntoAHeader) {
  auto ok = ParseTokenAnswer(
      R"({"access_token":"ya29.a-b_c","expires_in":3599,"token_type":"Bearer"})", "where");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->first, "ya29.a-b_c");
  EXPECT_EQ(ok->second.count(), 3599);
  EXPECT_EQ(ParseTokenAnswer(R"({"access_token":"t"})", "w")->second.count(), 3600);
  EXPECT_EQ(ParseTokenAnswer(R"({"access_token":"t","expires_in":-5})", "w")->second.count(), 3600);
  EXPECT_EQ(ParseTokenAnswer(R"({"access_token":"t","expires_in":99999999})", "w")->second.count(),
            86400);
  for (const char* bad : {"", "{}", "[1]", R"({"access_token":""})", R"({"access_token":7})",
                          R"({"access_token":"a b"})", R"({"access_token":"a
X-Evil: 1"})"}) {
    auto r = ParseTokenAnswer(bad, "token request to http://x/token");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), Code::kIoError);
    EXPECT_EQ(r.status().message().rfind("token request to http://x/token: ", 0), 0u)
        << r.status().message();
  }
}

TEST(GcsTokens, AGivenTokenIsSentAsIsAndNeverReplaced) {
  GcsConfig c;
  c.token_kind = GcsTokenKind::kStatic;
  c.token = "ya29.given";
  Result<std::shared_ptr<BearerTokens>> tokens = BearerTokens::Make(c, HttpSettings{});
  ASSERT_TRUE(tokens.ok());
  ASSERT_NE(*tokens, nullptr);
  EXPECT_EQ((*tokens)->Get().value(), "ya29.given");
  EXPECT_FALSE((*tokens)->Refuse("ya29.given"));
  EXPECT_EQ((*tokens)->fetches(), 0u);
  // The same credentials share one object (and so one token) in the process; others do not.
  Result<std::shared_ptr<BearerTokens>> again = BearerTokens::Make(c, HttpSettings{});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), tokens->get());
  GcsConfig other = c;
  other.token = "ya29.other";
  Result<std::shared_ptr<BearerTokens>> different = BearerTokens::Make(other, HttpSettings{});
  ASSERT_TRUE(different.ok());
  EXPECT_NE(different->get(), tokens->get());
  EXPECT_EQ((*different)->Get().value(), "ya29.other");
  c.token_kind = GcsTokenKind::kNone;
  tokens = BearerTokens::Make(c, HttpSettings{});
  ASSERT_TRUE(tokens.ok());
  EXPECT_EQ(*tokens, nullptr);
}

// A metadata server that accepts connections and never answers (a token fetch that hangs).
class SilentServer {
 public:
  SilentServer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd_, 16) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      ADD_FAILURE() << "cannot listen on loopback";
    }
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      for (;;) {
        const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) return;  // shut down
        accepted_.push_back(c);
      }
    });
  }
  ~SilentServer() {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
    for (int c : accepted_) ::close(c);
  }
  std::string host() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
  std::vector<int> accepted_;
};

// A token fetch cancelled by its caller's load is kCancelled, and another caller waiting for that
// fetch does not take it as its own error: it fetches for itself (and is cancelled by its own
// load here, later).
TEST(GcsTokens, ACancelledTokenFetchIsCancelledForItsCallerOnly) {
  SilentServer server;
  GcsConfig c;
  c.token_kind = GcsTokenKind::kMetadata;
  c.metadata_host = server.host();
  c.s3.credentials_from = "the metadata server (test)";
  Result<std::shared_ptr<BearerTokens>> tokens = BearerTokens::Make(c, HttpSettings{});
  ASSERT_TRUE(tokens.ok()) << tokens.status().ToString();
  ASSERT_NE(*tokens, nullptr);
  std::atomic<bool> first_cancel{false}, second_cancel{false};
  Status first, second;
  std::chrono::steady_clock::time_point second_cancelled_at{}, second_ended{};
  std::thread a([&] {
    const io::CancelScope scope(&first_cancel);
    first = (*tokens)->Get().status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a's fetch is under way
  std::thread b([&] {
    const io::CancelScope scope(&second_cancel);
    second = (*tokens)->Get().status();
    second_ended = std::chrono::steady_clock::now();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // b waits for a's fetch
  first_cancel = true;
  a.join();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // b fetches for itself
  second_cancelled_at = std::chrono::steady_clock::now();
  second_cancel = true;
  b.join();
  EXPECT_EQ(first.code(), Code::kCancelled) << first.ToString();
  EXPECT_EQ(second.code(), Code::kCancelled) << second.ToString();
  EXPECT_GE(second_ended, second_cancelled_at);  // not a's error, handed on when a's fetch ended
}

}  // namespace
}  // namespace tensorferry::objstore
