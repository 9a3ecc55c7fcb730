#include "objstore/http_auth.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "testing/test_util.h"

namespace tensorferry::objstore {
namespace {

// An environment whose HOME is a fresh temporary directory: the real one is never read.
class FakeEnv {
 public:
  FakeEnv() { vars_["HOME"] = home_.path(); }
  void Set(const std::string& name, const std::string& value) { vars_[name] = value; }
  std::string Write(const std::string& relative, const std::string& text) {
    const std::string path = home_.Join(relative);
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    testing::WriteBytes(path, text);
    return path;
  }
  GetEnv Env() const {
    return [vars = vars_](const char* name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    };
  }
  HttpToken Must(const std::string& option = "") const {
    Result<HttpToken> t = ResolveHttpToken(option, Env());
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? *t : HttpToken{};
  }

 private:
  testing::TempDir home_;
  std::map<std::string, std::string> vars_;
};

TEST(HttpToken, NoneAnywhereIsNoToken) {
  FakeEnv env;
  const HttpToken t = env.Must();
  EXPECT_EQ(t.token, "");
  EXPECT_EQ(t.For("https://huggingface.co"), "");
}

TEST(HttpToken, TheOptionGoesToEveryOriginAndWinsOverHfToken) {
  FakeEnv env;
  env.Set("HF_TOKEN", "hf_env");
  const HttpToken t = env.Must(" opt-token\n");
  EXPECT_EQ(t.token, "opt-token");
  EXPECT_EQ(t.from, "the http_token option");
  EXPECT_EQ(t.For("http://127.0.0.1:8080"), "opt-token");
  EXPECT_EQ(t.For("https://huggingface.co"), "opt-token");
}

TEST(HttpToken, HfTokenGoesToTheHubsOriginsOnly) {
  FakeEnv env;
  env.Set("HF_TOKEN", "hf_abc");
  const HttpToken t = env.Must();
  EXPECT_EQ(t.from, "HF_TOKEN");
  EXPECT_EQ(t.For("https://huggingface.co"), "hf_abc");
  EXPECT_EQ(t.For("HTTPS://HuggingFace.co"), "hf_abc");
  EXPECT_EQ(t.For("https://hf.co"), "hf_abc");
  EXPECT_EQ(t.For("http://huggingface.co"), "");  // not over plain text
  EXPECT_EQ(t.For("https://huggingface.co.evil.example"), "");
  EXPECT_EQ(t.For("https://cas-bridge.xethub.hf.co"), "");  // the CDN: signed links
  EXPECT_EQ(t.For("http://127.0.0.1:9000"), "");
}

TEST(HttpToken, HfEndpointAddsTheMirrorsOrigin) {
  FakeEnv env;
  env.Set("HF_TOKEN", "hf_abc");
  env.Set("HF_ENDPOINT", "http://127.0.0.1:9000/");
  EXPECT_EQ(env.Must().For("http://127.0.0.1:9000"), "hf_abc");
  env.Set("HF_ENDPOINT", "https://mirror.example/hub");  // a path: its origin counts
  EXPECT_EQ(env.Must().For("https://mirror.example"), "hf_abc");
  EXPECT_EQ(env.Must().For("http://127.0.0.1:9000"), "");
  env.Set("HF_ENDPOINT", "not a url");  // adds nothing, fails nothing
  EXPECT_EQ(env.Must().origins.size(), 2u);
}

TEST(HttpToken, TokenFilesAsHuggingfaceHubFindsThem) {
  FakeEnv env;
  // ~/.cache/huggingface/token
  env.Write(".cache/huggingface/token", "hf_default\n");
  HttpToken t = env.Must();
  EXPECT_EQ(t.token, "hf_default");
  EXPECT_NE(t.from.find(".cache/huggingface/token"), std::string::npos);
  // $XDG_CACHE_HOME/huggingface/token
  const std::string xdg = env.Write("xdg/huggingface/token", "hf_xdg");
  env.Set("XDG_CACHE_HOME", std::filesystem::path(xdg).parent_path().parent_path().string());
  EXPECT_EQ(env.Must().token, "hf_xdg");
  // $HF_HOME/token
  const std::string home = env.Write("hfhome/token", "hf_home");
  env.Set("HF_HOME", std::filesystem::path(home).parent_path().string());
  EXPECT_EQ(env.Must().token, "hf_home");
  // HF_TOKEN_PATH
  env.Set("HF_TOKEN_PATH", env.Write("elsewhere/t", "  hf_path  "));
  EXPECT_EQ(env.Must().token, "hf_path");
  // HF_TOKEN first.
  env.Set("HF_TOKEN", "hf_var");
  EXPECT_EQ(env.Must().token, "hf_var");
}

TEST(HttpToken, AMissingTokenFileIsNoTokenAnUnreadableOneAnError) {
  FakeEnv env;
  env.Set("HF_TOKEN_PATH", "/nonexistent/dir/token");
  EXPECT_EQ(env.Must().token, "");
  testing::TempDir dir;
  env.Set("HF_TOKEN_PATH", dir.path());  // a directory
  Result<HttpToken> t = ResolveHttpToken("", env.Env());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find(dir.path()), std::string::npos) << t.status().message();
}

TEST(HttpToken, ATokenThatWouldBreakTheHeaderIsRefusedWithoutQuotingIt) {
  FakeEnv env;
  env.Set("HF_TOKEN", "hf_a\r\nX-Injected: 1");
  Result<HttpToken> t = ResolveHttpToken("", env.Env());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kInvalidArgument);
  EXPECT_NE(t.status().message().find("HF_TOKEN"), std::string::npos);
  EXPECT_EQ(t.status().message().find("hf_a"), std::string::npos);
  EXPECT_FALSE(ResolveHttpToken("tok en", env.Env()).ok());
}

}  // namespace
}  // namespace tensorferry::objstore
