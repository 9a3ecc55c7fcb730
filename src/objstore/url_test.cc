#include "objstore/url.h"

#include <gtest/gtest.h>

#include <string>

namespace tensorferry::objstore {
namespace {

ObjectUrl MustParse(std::string_view url) {
  auto parsed = ParseObjectUrl(url);
  EXPECT_TRUE(parsed.ok()) << url << ": " << parsed.status().ToString();
  return parsed.ok() ? *parsed : ObjectUrl{};
}

// The problem ParseObjectUrl reports for `url` (it must fail with kInvalidArgument naming it as
// RedactUrl shows it).
std::string Problem(std::string_view url) {
  auto parsed = ParseObjectUrl(url);
  EXPECT_FALSE(parsed.ok()) << url << " was accepted";
  if (parsed.ok()) return "";
  EXPECT_EQ(parsed.status().code(), Code::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("\"" + RedactUrl(url) + "\""), std::string::npos)
      << parsed.status().ToString();
  return parsed.status().message();
}

TEST(ObjectUrl, IsObjectUrl) {
  for (const char* yes : {"s3://b/k", "S3://b", "http://h/x", "HTTPS://h", "hTtP://h"}) {
    EXPECT_TRUE(IsObjectUrl(yes)) << yes;
  }
  for (const char* no : {"", "s3:/b", "/tmp/s3://x", "model.safetensors", "ftp://h/x", "s3"}) {
    EXPECT_FALSE(IsObjectUrl(no)) << no;
  }
}

TEST(ObjectUrl, ParsesS3) {
  ObjectUrl url = MustParse("s3://my-bucket.v2/models/llama/model.safetensors");
  EXPECT_EQ(url.scheme, Scheme::kS3);
  EXPECT_EQ(url.bucket, "my-bucket.v2");
  EXPECT_EQ(url.key, "models/llama/model.safetensors");
  EXPECT_TRUE(url.origin.empty());
  EXPECT_EQ(url.ToString(), "s3://my-bucket.v2/models/llama/model.safetensors");

  EXPECT_EQ(MustParse("S3://bucket").key, "");
  EXPECT_EQ(MustParse("s3://bucket/").key, "");
  EXPECT_EQ(MustParse("s3://bucket/prefix/").key, "prefix/");
  EXPECT_EQ(MustParse("s3://bucket").ToString(), "s3://bucket/");
  // s3 keys are raw: '?', '#', '%' and non-ASCII bytes are part of the key.
  EXPECT_EQ(MustParse("s3://bucket/a?b#c%20d\xc3\xa9").key, "a?b#c%20d\xc3\xa9");
  EXPECT_EQ(MustParse("s3://old_style_bucket/k").bucket, "old_style_bucket");
}

TEST(ObjectUrl, RefusesBadS3) {
  EXPECT_NE(Problem("s3://").find("empty bucket"), std::string::npos);
  EXPECT_NE(Problem("s3:///key").find("empty bucket"), std::string::npos);
  EXPECT_NE(Problem("s3://MyBucket/k").find("[a-z0-9.-_]"), std::string::npos);
  EXPECT_NE(Problem("s3://b:1/k").find("[a-z0-9.-_]"), std::string::npos);
  EXPECT_NE(Problem("s3://" + std::string(256, 'a') + "/k").find("longer than 255"),
            std::string::npos);
  EXPECT_TRUE(ParseObjectUrl("s3://" + std::string(255, 'a') + "/k").ok());
  EXPECT_NE(Problem("s3://b//k").find("starts with '/'"), std::string::npos);
}

TEST(ObjectUrl, ParsesHttp) {
  ObjectUrl url = MustParse("HTTP://Example.com:8080/repo/resolve/main/model%20a.safetensors");
  EXPECT_EQ(url.scheme, Scheme::kHttp);
  EXPECT_EQ(url.origin, "http://Example.com:8080");
  EXPECT_EQ(url.key, "repo/resolve/main/model%20a.safetensors");
  EXPECT_TRUE(url.bucket.empty());
  EXPECT_EQ(url.ToString(), "http://Example.com:8080/repo/resolve/main/model%20a.safetensors");

  ObjectUrl bare = MustParse("https://host");
  EXPECT_EQ(bare.scheme, Scheme::kHttps);
  EXPECT_EQ(bare.origin, "https://host");
  EXPECT_EQ(bare.key, "");
  EXPECT_EQ(MustParse("https://host/").key, "");
  EXPECT_EQ(MustParse("http://127.0.0.1:65535/a").origin, "http://127.0.0.1:65535");
  EXPECT_EQ(MustParse("http://[::1]:8080/a/b").origin, "http://[::1]:8080");
  EXPECT_EQ(MustParse("http://[::1]/a").key, "a");
}

TEST(ObjectUrl, RefusesBadHttp) {
  EXPECT_NE(Problem("http://").find("empty host"), std::string::npos);
  EXPECT_NE(Problem("http:///path").find("empty host"), std::string::npos);
  EXPECT_NE(Problem("https://:443/x").find("empty host"), std::string::npos);
  EXPECT_NE(Problem("https://user:secret@host/x").find("credentials"), std::string::npos);
  EXPECT_NE(Problem("https://host/x?versionId=3").find("query"), std::string::npos);
  EXPECT_NE(Problem("https://host/x#frag").find("fragment"), std::string::npos);
  for (const char* port : {"http://h:/x", "http://h:0/x", "http://h:65536/x", "http://h:8a/x",
                           "http://h:-1/x", "http://h:123456/x", "http://h:1:2/x"}) {
    EXPECT_NE(Problem(port).find("port"), std::string::npos) << port;
  }
  EXPECT_NE(Problem("http://[::1/x").find("IPv6"), std::string::npos);
  EXPECT_NE(Problem("http://[::1]x/x").find("IPv6"), std::string::npos);
  EXPECT_NE(Problem("http://ho\\st/x").find("host"), std::string::npos);
}

// Found by a review: the refusal of a URL with a password or a signed link's query named the
// URL as given (`tensorferry doctor` printed the password twice). Every message names the URL as
// RedactUrl shows it, with the precise problem.
TEST(ObjectUrl, RefusalsNeverShowPasswordsOrQueries) {
  const std::string userinfo = Problem("https://user:hunter2@example.invalid/x.safetensors");
  EXPECT_EQ(userinfo.find("hunter2"), std::string::npos) << userinfo;
  EXPECT_NE(userinfo.find("\"https://***@example.invalid/x.safetensors\": credentials (user@host)"),
            std::string::npos)
      << userinfo;
  const std::string query = Problem("https://h/x.safetensors?X-Amz-Signature=s3cr3t");
  EXPECT_EQ(query.find("s3cr3t"), std::string::npos) << query;
  EXPECT_NE(query.find("\"https://h/x.safetensors?***\": a '?query' is not allowed"),
            std::string::npos)
      << query;
  // Both: neither is shown (the first problem of what is shown is named).
  const std::string both = Problem("http://u:pw@h:8080/x?token=t0k");
  EXPECT_EQ(both.find("pw"), std::string::npos) << both;
  EXPECT_EQ(both.find("t0k"), std::string::npos) << both;
  EXPECT_NE(both.find("\"http://***@h:8080/x?***\""), std::string::npos) << both;
  // A control character in the password: the message names what is shown, not the offset of a
  // hidden byte.
  const std::string hidden = Problem(std::string("https://u:p\x01w@h/x"));
  EXPECT_NE(hidden.find("credentials"), std::string::npos) << hidden;
  // A bad port is named as such, the URL as given (nothing to hide).
  EXPECT_NE(Problem("https://h:99999/x").find("\"https://h:99999/x\": the port"),
            std::string::npos);
  // Userinfo in a bucket URL is hidden too; the rest of the bucket is named.
  const std::string s3 = Problem("s3://AKIA:wJalr@bucket/k");
  EXPECT_EQ(s3.find("wJalr"), std::string::npos) << s3;
  EXPECT_NE(s3.find("s3://***@bucket/k"), std::string::npos) << s3;
}

TEST(ObjectUrl, ExcerptHidesQueriesAndControlBytes) {
  EXPECT_EQ(Excerpt("missing m.safetensors?X-Amz-Signature=SECRET&t=1 (try again)"),
            "missing m.safetensors?*** (try again)");
  EXPECT_EQ(Excerpt("<a href=\"https://h/x?sig=S\">x</a>"), "<a href=\"https://h/x?***\">x</a>");
  EXPECT_EQ(Excerpt("Not found? Sorry"), "Not found? Sorry");  // a question, nothing hidden
  EXPECT_EQ(Excerpt("a\nb\x01"
                    "c\xff"),
            "a b c ");
  EXPECT_EQ(Excerpt(std::string(300, 'x')).size(), 160u);
  EXPECT_EQ(Excerpt("abcdef", 3), "abc");
}

TEST(ObjectUrl, RedactUrl) {
  EXPECT_EQ(RedactUrl("https://u:p@h/x?a=b#c"), "https://***@h/x?***");
  EXPECT_EQ(RedactUrl("https://h/x#tok"), "https://h/x#***");
  EXPECT_EQ(RedactUrl("http://h?q=a@b"), "http://h?***");  // '@' in the query is not userinfo
  EXPECT_EQ(RedactUrl("https://h/a@b"), "https://h/a@b");  // nor in the path
  EXPECT_EQ(RedactUrl("https://u:p@ss@h:1/x"), "https://***@h:1/x");
  // A password with an unescaped '/' (no URL, but shown in its refusal): all of it hidden.
  EXPECT_EQ(RedactUrl("http://user:pa/ssWORD@h/m.safetensors"), "http://***@h/m.safetensors");
  EXPECT_EQ(RedactUrl("http://u:p/q@h"), "http://***@h");
  EXPECT_EQ(RedactUrl("https://h:8080/a@b"), "https://h:8080/a@b");  // a port, then a path
  EXPECT_EQ(RedactUrl("https://h:8080/a?x=u:p/q@z"), "https://h:8080/a?***");
  // s3 and gs keys may hold '?' and '#': part of the object's name, kept.
  EXPECT_EQ(RedactUrl("s3://bucket/a?b.safetensors"), "s3://bucket/a?b.safetensors");
  EXPECT_EQ(RedactUrl("gs://bucket/a#b"), "gs://bucket/a#b");
  EXPECT_EQ(RedactUrl("ftp://u:p@h/x?y"), "ftp://***@h/x?***");
  EXPECT_EQ(RedactUrl("/local/path?x"), "/local/path?x");
  EXPECT_EQ(RedactUrl("hf://org/model"), "hf://org/model");
  // What ParseObjectUrl accepts is shown as it is.
  for (const char* ok : {"s3://b/k?v", "https://h:443/a/b.safetensors", "gs://b/"}) {
    ASSERT_TRUE(ParseObjectUrl(ok).ok()) << ok;
    EXPECT_EQ(RedactUrl(ok), ok);
  }
}

TEST(ObjectUrl, RefusesControlCharactersAndWhitespace) {
  EXPECT_NE(Problem(std::string("s3://b/k\0x", 10)).find("NUL"), std::string::npos);
  // A bucket key may hold spaces (percent-encoded in the request); an http(s) URL may not.
  EXPECT_EQ(MustParse("s3://b/a b/m.safetensors").key, "a b/m.safetensors");
  EXPECT_EQ(MustParse("gs://b/a b").key, "a b");
  EXPECT_NE(Problem("http://h/a b").find("space"), std::string::npos);
  for (const char* bad : {"s3://b/a\tb", "http://h/a\nb", "http://h/a\rb", "s3://b/\x7f"}) {
    EXPECT_NE(Problem(bad).find("control"), std::string::npos) << bad;
  }
}

// A key's "." or ".." segment would be resolved as a path step by programs and servers (so
// "s3://b/p/../../other/x" could read another bucket's key): refused; "..." or ".x" are names.
TEST(ObjectUrl, BucketKeysWithDotSegmentsAreRefused) {
  for (const char* bad : {"s3://b/p/../../other/x", "s3://b/a/./m.safetensors", "s3://b/..",
                          "gs://b/./x", "s3://b/a/.", "s3://b/a/../"}) {
    EXPECT_NE(Problem(bad).find("segment (a path step, not a name)"), std::string::npos) << bad;
  }
  for (const char* ok :
       {"s3://b/.../x", "s3://b/.hidden/x", "s3://b/a..b", "s3://b/a/", "s3://b"}) {
    EXPECT_TRUE(ParseObjectUrl(ok).ok()) << ok;
  }
  // An index's "./x" means x, as for local files.
  EXPECT_EQ(Join(MustParse("s3://b/m"), "./x.safetensors").key, "m/x.safetensors");
  EXPECT_EQ(Join(MustParse("s3://b/m/"), "sub/./x").key, "m/sub/x");
}

TEST(ObjectUrl, RefusesOtherSchemes) {
  for (const char* bad : {"", "/tmp/model.safetensors", "ftp://h/x", "s3:/b/k", "az://b/k"}) {
    EXPECT_NE(Problem(bad).find("not an s3://, gs://, http:// or https:// URL"), std::string::npos);
  }
}

TEST(ObjectUrl, GoogleCloudStorageUrlsNameABucketAndAKey) {
  const ObjectUrl u = MustParse("GS://weights/llama/model.safetensors");
  EXPECT_EQ(u.scheme, Scheme::kGs);
  EXPECT_TRUE(IsBucketScheme(u.scheme));
  EXPECT_FALSE(IsBucketScheme(Scheme::kHttps));
  EXPECT_EQ(u.bucket, "weights");
  EXPECT_EQ(u.key, "llama/model.safetensors");
  EXPECT_EQ(u.ToString(), "gs://weights/llama/model.safetensors");
  EXPECT_TRUE(IsObjectUrl("gs://b/k"));
  // Same bucket and key rules as s3://; keys stay raw when joined.
  EXPECT_NE(Problem("gs://Bucket/k").find("lower-case"), std::string::npos);
  EXPECT_NE(Problem("gs:///k").find("empty bucket"), std::string::npos);
  EXPECT_NE(Problem("gs://b//k").find("starts with '/'"), std::string::npos);
  EXPECT_EQ(Join(MustParse("gs://b/m"), "x y.safetensors").ToString(), "gs://b/m/x y.safetensors");
  EXPECT_EQ(Parent(u).ToString(), "gs://weights/llama");
}

TEST(ObjectUrl, JoinPutsExactlyOneSlash) {
  ObjectUrl dir = MustParse("s3://b/models/llama");
  EXPECT_EQ(Join(dir, "model-00001.safetensors").ToString(),
            "s3://b/models/llama/model-00001.safetensors");
  EXPECT_EQ(Join(MustParse("s3://b/models/llama/"), "x").key, "models/llama/x");
  EXPECT_EQ(Join(MustParse("s3://b"), "x").key, "x");
  EXPECT_EQ(Join(dir, "sub/x y").key, "models/llama/sub/x y");  // s3 keys stay raw
  // http(s): the file name is encoded into the URL path.
  ObjectUrl http = MustParse("http://h:1/repo/main/");
  EXPECT_EQ(Join(http, "sub/model a#1.safetensors").ToString(),
            "http://h:1/repo/main/sub/model%20a%231.safetensors");
  EXPECT_EQ(Join(MustParse("http://h"), "m.safetensors").ToString(), "http://h/m.safetensors");
}

TEST(ObjectUrl, Parent) {
  EXPECT_EQ(Parent(MustParse("s3://b/a/b/model.safetensors.index.json")).key, "a/b");
  EXPECT_EQ(Parent(MustParse("s3://b/model.safetensors")).key, "");
  EXPECT_EQ(Parent(MustParse("s3://b/a/")).key, "a");
  ObjectUrl http = Parent(MustParse("https://h/x/y.json"));
  EXPECT_EQ(http.origin, "https://h");
  EXPECT_EQ(http.key, "x");
  // Parent then Join gives the file back.
  ObjectUrl file = MustParse("s3://b/a/b/c.safetensors");
  EXPECT_EQ(Join(Parent(file), "c.safetensors"), file);
}

TEST(ObjectUrl, KeyEndsWith) {
  EXPECT_TRUE(KeyEndsWith(MustParse("s3://b/m.safetensors.index.json"), ".json"));
  EXPECT_FALSE(KeyEndsWith(MustParse("s3://b/m.JSON"), ".json"));
  EXPECT_FALSE(KeyEndsWith(MustParse("s3://b/"), ".json"));
  EXPECT_TRUE(KeyEndsWith(MustParse("http://h/m.safetensors"), ".safetensors"));
}

TEST(ObjectUrl, PercentEncode) {
  EXPECT_EQ(PercentEncode("AZaz09-_.~", false), "AZaz09-_.~");
  EXPECT_EQ(PercentEncode("a/b c", true), "a/b%20c");
  EXPECT_EQ(PercentEncode("a/b c", false), "a%2Fb%20c");
  EXPECT_EQ(PercentEncode("+=&?#%*", true), "%2B%3D%26%3F%23%25%2A");
  EXPECT_EQ(PercentEncode("\xc3\xa9", true), "%C3%A9");
  EXPECT_EQ(PercentEncode(std::string("\0\xff", 2), true), "%00%FF");
  EXPECT_EQ(PercentEncode("", true), "");
}

}  // namespace
}  // namespace tensorferry::objstore
