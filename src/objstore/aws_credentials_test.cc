#include "objstore/aws_credentials.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "io/read_engine.h"
#include "objstore/s3_xml.h"
#include "testing/test_util.h"

namespace tensorferry::objstore {
namespace {

TEST(AwsCredentialsParse, Iso8601TimesAsTheServicesWriteThem) {
  const auto t = ParseIso8601("2026-11-30T20:14:49Z");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->time_since_epoch().count(), 1796069689);
  EXPECT_EQ(ParseIso8601("2026-11-30T20:14:49.123Z"), t);
  EXPECT_EQ(ParseIso8601("2026-11-30T21:14:49+01:00"), t);
  EXPECT_EQ(ParseIso8601("2026-11-30T19:44:49-00:30"), t);
  for (const char* bad :
       {"", "2026-11-30", "2026-11-30T20:14:49", "2026-13-30T20:14:49Z", "2026-11-30T24:00:00Z",
        "2026-11-30T20:14:49Zjunk", "2026-11-30T20:14:49.Z", "2026-11-30 20:14:49Z",
        "2026-11-30T20:14:49+0100", "1796069689"}) {
    EXPECT_FALSE(ParseIso8601(bad).has_value()) << bad;
  }
}

TEST(AwsCredentialsParse, ContainerAndMetadataAnswers) {
  const auto k = ParseAwsCredentialsJson(
      R"({"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": "ASIA1", )"
      R"("SecretAccessKey": "sec/ret+1", "Token": "tok==", "Expiration": "2026-11-30T20:14:49Z"})",
      "here", /*process=*/false);
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(k->keys.access_key_id, "ASIA1");
  EXPECT_EQ(k->keys.secret_access_key, "sec/ret+1");
  EXPECT_EQ(k->keys.session_token, "tok==");
  ASSERT_TRUE(k->expiration.has_value());
  EXPECT_EQ(k->expiration->time_since_epoch().count(), 1796069689);
  // Without an Expiration: never fetched again.
  const auto forever =
      ParseAwsCredentialsJson(R"({"AccessKeyId": "A", "SecretAccessKey": "S"})", "here", false);
  ASSERT_TRUE(forever.ok());
  EXPECT_FALSE(forever->expiration.has_value());
  struct Case {
    const char* text;
    const char* says;
  } cases[] = {
      {"not json", "here: not valid JSON"},
      {"[1]", "not an object"},
      {R"({"AccessKeyId": "A"})", "lacks \"AccessKeyId\" or \"SecretAccessKey\""},
      {R"({"Code": "Failure", "AccessKeyId": "A", "SecretAccessKey": "S"})", "Code is \"Failure\""},
      {R"({"AccessKeyId": "A", "SecretAccessKey": "S", "Expiration": "soon"})",
       "\"Expiration\" \"soon\" is not an ISO 8601 time"},
      {R"({"AccessKeyId": "A", "SecretAccessKey": "S\r\nX-Injected: 1"})",
       "a character not allowed in an HTTP header"},
  };
  for (const Case& c : cases) {
    const auto r = ParseAwsCredentialsJson(c.text, "here", false);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), Code::kIoError);
    EXPECT_NE(r.status().message().find(c.says), std::string::npos) << r.status().ToString();
    EXPECT_EQ(r.status().message().find("X-Injected"), std::string::npos);  // no secret quoted
  }
}

TEST(AwsCredentialsParse, ProcessOutputNeedsVersionOne) {
  const auto k = ParseAwsCredentialsJson(
      R"({"Version": 1, "AccessKeyId": "P", "SecretAccessKey": "PS", "SessionToken": "PT"})",
      "proc", /*process=*/true);
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(k->keys.session_token, "PT");
  for (const char* bad : {R"({"AccessKeyId": "P", "SecretAccessKey": "PS"})",
                          R"({"Version": 2, "AccessKeyId": "P", "SecretAccessKey": "PS"})",
                          R"({"Version": "1", "AccessKeyId": "P", "SecretAccessKey": "PS"})"}) {
    const auto r = ParseAwsCredentialsJson(bad, "proc", true);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("no \"Version\": 1"), std::string::npos)
        << r.status().ToString();
  }
}

TEST(AwsCredentialsParse, StsAnswers) {
  const auto sts = ParseStsCredentials(
      "<AssumeRoleWithWebIdentityResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\">"
      "<AssumeRoleWithWebIdentityResult><SubjectFromWebIdentityToken>s</"
      "SubjectFromWebIdentityToken><Credentials><AccessKeyId>ASIAX</AccessKeyId>"
      "<SecretAccessKey>sk&amp;1</SecretAccessKey><SessionToken>\n tok \n</SessionToken>"
      "<Expiration>2026-11-30T20:14:49Z</Expiration></Credentials>"
      "</AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>");
  ASSERT_TRUE(sts.ok()) << sts.status().ToString();
  EXPECT_EQ(sts->access_key_id, "ASIAX");
  EXPECT_EQ(sts->secret_access_key, "sk&1");
  EXPECT_EQ(sts->session_token, "tok");
  EXPECT_EQ(sts->expiration, "2026-11-30T20:14:49Z");
  for (const char* bad :
       {"", "<html>no</html>", "<AssumeRoleWithWebIdentityResponse/>",
        "<AssumeRoleWithWebIdentityResponse><AssumeRoleWithWebIdentityResult><Credentials>"
        "<AccessKeyId>A</AccessKeyId></Credentials></AssumeRoleWithWebIdentityResult>"
        "</AssumeRoleWithWebIdentityResponse>",
        "<AssumeRoleWithWebIdentityResponse><AssumeRoleWithWebIdentityResult>"}) {
    const auto r = ParseStsCredentials(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("STS response: "), std::string::npos);
  }
}

constexpr std::chrono::milliseconds kLong{60'000};

TEST(AwsCredentialsProcess, StdoutOfASuccessfulCommand) {
  const auto out = RunCredentialProcess(
      R"(printf '{"Version": 1, "AccessKeyId": "%s", "SecretAccessKey": "S"}' "$0-id"; )"
      "echo noise >&2",
      "proc", kLong);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, R"({"Version": 1, "AccessKeyId": "/bin/sh-id", "SecretAccessKey": "S"})");
}

TEST(AwsCredentialsProcess, FailuresNameTheStatusAndTheEndOfStderr) {
  auto r = RunCredentialProcess("echo starting >&2; echo boom >&2; exit 3", "proc of x", kLong);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kIoError);
  EXPECT_NE(r.status().message().find("proc of x: exited with status 3; its stderr ends: "),
            std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("boom"), std::string::npos);
  r = RunCredentialProcess("kill -9 $$", "proc", kLong);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("killed by signal 9"), std::string::npos)
      << r.status().ToString();
  r = RunCredentialProcess("/nonexistent/credential-helper", "proc", kLong);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("exited with status 127"), std::string::npos)
      << r.status().ToString();
}

TEST(AwsCredentialsProcess, ACommandIsDoneWhenItExitsNotWhenItsPipesClose) {
  // A child left behind holding stdout does not hold the answer back.
  const auto start = std::chrono::steady_clock::now();
  auto r = RunCredentialProcess("(sleep 30 &); printf done", "proc", kLong);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, "done");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  // One that closes its output and goes on is waited for up to the timeout, then killed.
  r = RunCredentialProcess("exec >&- 2>&-; sleep 30", "proc", std::chrono::milliseconds(300));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("killed: it ran longer than"), std::string::npos)
      << r.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(40));
}

TEST(AwsCredentialsProcess, RunawayCommandsAreKilled) {
  // A command that never ends is killed at the timeout.
  const auto start = std::chrono::steady_clock::now();
  auto r = RunCredentialProcess("sleep 30 & sleep 30", "proc", std::chrono::milliseconds(300));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("killed: it ran longer than"), std::string::npos)
      << r.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  r = RunCredentialProcess("head -c 2000000 /dev/zero", "proc", kLong);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("more than 1 MiB"), std::string::npos)
      << r.status().ToString();
  // A cancelled load stops waiting for it.
  std::atomic<bool> cancel{true};
  const io::CancelScope scope(&cancel);
  r = RunCredentialProcess("sleep 30", "proc", kLong);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kCancelled);
}

TEST(AwsCredentials, GivenKeysNeedNothingFetched) {
  S3Config config;
  config.access_key_id = "K";
  config.secret_access_key = "S";
  const auto made = AwsCredentials::Make(config, HttpSettings{});
  ASSERT_TRUE(made.ok());
  EXPECT_EQ(*made, nullptr);
}

TEST(AwsCredentials, AProcessIsRunOnceWhileItsKeysLastAndSharedByEqualConfigs) {
  testing::TempDir dir;
  const std::string counter = dir.Join("runs");
  S3Config config;
  config.credential_source = S3Config::CredentialSource::kProcess;
  config.credentials_from = "credential_process of profile \"t\"";
  // Keys that last 1 hour (refreshed 5 minutes before), then keys without an end.
  config.credential_process =
      "echo run >> '" + counter +
      "'; printf '{\"Version\": 1, \"AccessKeyId\": \"ID%s\", \"SecretAccessKey\": \"S\", "
      "\"Expiration\": \"2999-01-01T00:00:00Z\"}' $(wc -l < '" +
      counter + "')";
  auto made = AwsCredentials::Make(config, HttpSettings{});
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  std::shared_ptr<AwsCredentials> credentials = *made;
  ASSERT_NE(credentials, nullptr);
  auto keys = credentials->Get();
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(keys->access_key_id, "ID1");
  EXPECT_EQ(credentials->Get()->access_key_id, "ID1");
  EXPECT_EQ(credentials->fetches(), 1u);
  // The same configuration shares the object (and its keys).
  EXPECT_EQ(*AwsCredentials::Make(config, HttpSettings{}), credentials);
  // Refused keys are fetched again.
  credentials->Refuse(*keys);
  EXPECT_EQ(credentials->Get()->access_key_id, "ID2");
  EXPECT_EQ(credentials->fetches(), 2u);
  // Keys that are not the ones held are not forgotten.
  credentials->Refuse(*keys);
  EXPECT_EQ(credentials->Get()->access_key_id, "ID2");
}

TEST(AwsCredentials, KeysRefusedAgainAfterAFetchAreNotFetchedAgain) {
  // A source that keeps giving the same keys: one fetch after the first refusal, then no more.
  S3Config config;
  config.credential_source = S3Config::CredentialSource::kProcess;
  config.credentials_from = "credential_process of profile \"same\"";
  config.credential_process =
      R"(printf '{"Version": 1, "AccessKeyId": "SAME", "SecretAccessKey": "S"}')";
  std::shared_ptr<AwsCredentials> credentials = *AwsCredentials::Make(config, HttpSettings{});
  const AwsKeys keys = *credentials->Get();
  EXPECT_TRUE(credentials->Refuse(keys));
  EXPECT_EQ(credentials->Get()->access_key_id, "SAME");
  EXPECT_EQ(credentials->fetches(), 2u);
  EXPECT_FALSE(credentials->Refuse(keys));
  EXPECT_EQ(credentials->Get()->access_key_id, "SAME");
  EXPECT_EQ(credentials->fetches(), 2u);
}

TEST(AwsCredentials, WaitersGetTheErrorOfTheFetchTheyWaitedForWithoutFetchingAgain) {
  Refreshing<int> value;
  std::atomic<int> fetches{0};
  std::promise<void> started, release;
  std::shared_future<void> go = release.get_future().share();
  const auto failing = [&]() -> Result<Refreshing<int>::Fetched> {
    if (fetches.fetch_add(1) == 0) started.set_value();
    go.wait();
    return Status(Code::kIoError, "down");
  };
  std::vector<std::thread> threads;
  std::vector<Status> got(4);
  threads.emplace_back([&] { got[0] = value.Get(failing).status(); });
  started.get_future().wait();
  for (int i = 1; i < 4; ++i)
    threads.emplace_back([&, i] { got[i] = value.Get(failing).status(); });
  // The three others wait for the running fetch (up to 60 s for them to get there).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (value.waiting() < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(value.waiting(), 3u);
  EXPECT_EQ(fetches.load(), 1);  // nobody fetches while a fetch runs
  release.set_value();
  for (std::thread& t : threads) t.join();
  // Every waiter got that fetch's error, without fetching again.
  for (const Status& status : got) EXPECT_EQ(status.message(), "down");
  EXPECT_EQ(fetches.load(), 1);
  EXPECT_EQ(value.waiting(), 0u);
  EXPECT_EQ(value.fetches(), 0u);
}

TEST(AwsCredentials, AFetchThatThrowsReleasesTheWaiters) {
  Refreshing<int> value;
  EXPECT_THROW(
      (void)value.Get([]() -> Result<Refreshing<int>::Fetched> { throw std::bad_alloc(); }),
      std::bad_alloc);
  // Not stuck: the next caller fetches.
  EXPECT_EQ(*value.Get([]() -> Result<Refreshing<int>::Fetched> {
    return Refreshing<int>::Fetched{7, std::nullopt};
  }),
            7);
}

TEST(AwsCredentials, KeysThatExpiredAlreadyAreAnError) {
  S3Config config;
  config.credential_source = S3Config::CredentialSource::kProcess;
  config.credentials_from = "credential_process of profile \"stale\"";
  config.credential_process = R"(printf '{"Version": 1, "AccessKeyId": "OLD", )"
                              R"("SecretAccessKey": "S", "Expiration": "2001-01-01T00:00:00Z"}')";
  std::shared_ptr<AwsCredentials> credentials = *AwsCredentials::Make(config, HttpSettings{});
  const auto keys = credentials->Get();
  ASSERT_FALSE(keys.ok());
  EXPECT_NE(keys.status().message().find("the keys it gave expired"), std::string::npos)
      << keys.status().ToString();
}

// A clock the test moves (Refreshing's Clock): the schedule checked to the millisecond, whatever
// the machine's load.
struct TestClock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<TestClock>;
  static constexpr bool is_steady = true;
  static time_point now() { return time_point(duration(at.load())); }
  static void Advance(std::chrono::milliseconds by) { at += duration(by).count(); }
  static inline std::atomic<rep> at{0};
};

TEST(AwsCredentials, ShortLivedKeysAreFetchedAgainAfterHalfTheirLife) {
  // Keys living 4 s: fetched again after 2 s; a failing fetch then keeps them until 1 s (a
  // quarter of their life) before their end, and the next fetch after that replaces them.
  using std::chrono::milliseconds;
  Refreshing<int, TestClock> value;
  int calls = 0;
  const auto fetch = [&]() -> Result<Refreshing<int, TestClock>::Fetched> {
    ++calls;
    return Refreshing<int, TestClock>::Fetched{calls, std::chrono::seconds(4)};
  };
  const auto failing = []() -> Result<Refreshing<int, TestClock>::Fetched> {
    return Status(Code::kIoError, "down");
  };
  const auto never = []() -> Result<Refreshing<int, TestClock>::Fetched> {
    ADD_FAILURE() << "a fetch when none is due";
    return Status(Code::kIoError, "no");
  };
  EXPECT_EQ(*value.Get(fetch), 1);
  TestClock::Advance(milliseconds(1999));
  EXPECT_EQ(*value.Get(never), 1);  // not asked before half its life
  TestClock::Advance(milliseconds(1));
  {
    // While one caller fetches (slowly), the others go on with the value it replaces.
    std::promise<void> started, release;
    std::shared_future<void> go = release.get_future().share();
    std::thread slow([&] {
      auto got = value.Get([&]() -> Result<Refreshing<int, TestClock>::Fetched> {
        started.set_value();
        go.wait();
        return Status(Code::kIoError, "slow and down");
      });
      EXPECT_EQ(*got, 1);  // failed, still good: the old value
    });
    started.get_future().wait();
    EXPECT_EQ(*value.Get(never), 1);
    release.set_value();
    slow.join();
  }
  TestClock::Advance(milliseconds(999));  // 2.999 s: the failed fetch is tried again in 10 s,
  auto kept = value.Get(never);           // but no later than the good part's end (3 s)
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(*kept, 1);
  TestClock::Advance(milliseconds(1));
  auto gone = value.Get(failing);  // past the good part: a failed fetch is the caller's error
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().message(), "down");
  EXPECT_EQ(*value.Get(fetch), 2);  // and the next fetch replaces them
  TestClock::Advance(milliseconds(1999));
  EXPECT_EQ(*value.Get(never), 2);
  value.ForgetIf([](int v) { return v == 2; });
  gone = value.Get(failing);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().message(), "down");
  EXPECT_EQ(value.fetches(), 2u);
}

}  // namespace
}  // namespace tensorferry::objstore
