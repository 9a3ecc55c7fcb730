#include "objstore/s3_xml.h"

#include <gtest/gtest.h>

#include <string>

namespace tensorferry::objstore {
namespace {

TEST(S3Xml, ParsesAnErrorBody) {
  const std::string body =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message>"
      "<Key>models/a&amp;b.safetensors</Key><RequestId>4442587FB7D0A2F9</RequestId>"
      "<HostId>x</HostId></Error>\n";
  auto error = ParseS3Error(body);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->code, "NoSuchKey");
  EXPECT_EQ(error->message, "The specified key does not exist.");
  EXPECT_EQ(error->request_id, "4442587FB7D0A2F9");

  // Pretty-printed, with a BOM, a comment and no message.
  auto pretty =
      ParseS3Error("\xEF\xBB\xBF<!-- x -->\n<Error>\n  <Code> AccessDenied </Code>\n</Error>");
  ASSERT_TRUE(pretty.has_value());
  EXPECT_EQ(pretty->code, "AccessDenied");
  EXPECT_EQ(pretty->message, "");
  // Wrapped, as some S3-compatible servers send it.
  auto wrapped = ParseS3Error(
      "<ErrorResponse xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Error>"
      "<Code>SignatureDoesNotMatch</Code><Message>a &lt;b&gt;</Message></Error></ErrorResponse>");
  ASSERT_TRUE(wrapped.has_value());
  EXPECT_EQ(wrapped->code, "SignatureDoesNotMatch");
  EXPECT_EQ(wrapped->message, "a <b>");
  // A request signed for the wrong region names the bucket's.
  auto region = ParseS3Error(
      "<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region 'us-east-1' is "
      "wrong; expecting 'eu-west-1'</Message><Region>eu-west-1</Region></Error>");
  ASSERT_TRUE(region.has_value());
  EXPECT_EQ(region->region, "eu-west-1");
}

TEST(S3Xml, NotAnErrorBodyIsNullopt) {
  for (const char* body : {
           "",
           "   ",
           "<html><body><h1>502 Bad Gateway</h1></body></html>",
           "<!DOCTYPE html><html></html>",
           "<Error><Code>NoSuchKey</Code><Message>trunc",    // truncated
           "<Error><Code>NoSuchKey</Code></Error><Error/>",  // two roots
           "<Error><Code>NoSuchKey</Code></Error>trailing",
           "<Error><Message>no code</Message></Error>",
           "<Error><Code>  </Code></Error>",
           "<Error><Code>X</Cod></Error>",  // mismatched end tag
           "<ListBucketResult><Name>b</Name></ListBucketResult>",
           "Internal Server Error",
       }) {
    EXPECT_FALSE(ParseS3Error(body).has_value()) << body;
  }
}

constexpr const char* kListPage = R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>models</Name>
  <Prefix>llama/</Prefix>
  <KeyCount>3</KeyCount>
  <MaxKeys>1000</MaxKeys>
  <Delimiter>/</Delimiter>
  <IsTruncated>true</IsTruncated>
  <Contents>
    <Key>llama/model-00001-of-00002.safetensors</Key>
    <LastModified>2024-01-01T00:00:00.000Z</LastModified>
    <ETag>&quot;9b2cf535f27731c974343645a3985328&quot;</ETag>
    <Size>5368709120</Size>
    <Owner><ID>x</ID><DisplayName>y</DisplayName></Owner>
    <StorageClass>STANDARD</StorageClass>
  </Contents>
  <Contents>
    <Key> spaced &amp; &#x263A;.json </Key>
    <Size>0</Size>
  </Contents>
  <CommonPrefixes><Prefix>llama/sub/</Prefix></CommonPrefixes>
  <CommonPrefixes><Prefix>llama/other/</Prefix></CommonPrefixes>
  <NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
</ListBucketResult>
)";

TEST(S3Xml, ParsesAListPage) {
  auto page = ParseListObjectsV2(kListPage);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  ASSERT_EQ(page->objects.size(), 2U);
  EXPECT_EQ(page->objects[0].key, "llama/model-00001-of-00002.safetensors");
  EXPECT_EQ(page->objects[0].size, 5368709120ULL);
  EXPECT_EQ(page->objects[0].etag, "\"9b2cf535f27731c974343645a3985328\"");
  EXPECT_EQ(page->objects[1].key, " spaced & \xE2\x98\xBA.json ");  // kept exactly
  EXPECT_EQ(page->objects[1].size, 0U);
  EXPECT_EQ(page->objects[1].etag, "");
  EXPECT_EQ(page->common_prefixes, (std::vector<std::string>{"llama/sub/", "llama/other/"}));
  EXPECT_TRUE(page->truncated);
  EXPECT_EQ(page->next_token, "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=");

  auto empty = ParseListObjectsV2(
      "<ListBucketResult><Name>b</Name><IsTruncated>false</IsTruncated><Empty/></"
      "ListBucketResult>");
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE(empty->objects.empty());
  EXPECT_FALSE(empty->truncated);
  EXPECT_TRUE(empty->next_token.empty());
  // CDATA and attributes with either quote.
  auto cdata = ParseListObjectsV2(
      "<ListBucketResult a='1' b = \"2\"><Contents><Key><![CDATA[a<b>&amp;]]></Key>"
      "<Size>7</Size></Contents></ListBucketResult>");
  ASSERT_TRUE(cdata.ok()) << cdata.status().ToString();
  EXPECT_EQ(cdata->objects.at(0).key, "a<b>&amp;");
}

// The message of the error ParseListObjectsV2 must give for `body`.
std::string ListError(std::string_view body) {
  auto page = ParseListObjectsV2(body);
  EXPECT_FALSE(page.ok()) << body;
  if (page.ok()) return "";
  EXPECT_EQ(page.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(page.status().message().rfind("ListObjectsV2 response: ", 0), 0U);
  return page.status().message();
}

TEST(S3Xml, RefusesBadListPages) {
  EXPECT_NE(ListError("").find("no root element"), std::string::npos);
  EXPECT_NE(ListError("<html><body>Gateway Timeout</body></html>").find("not <ListBucketResult>"),
            std::string::npos);
  EXPECT_NE(ListError("<Error><Code>AccessDenied</Code></Error>").find("<Error>"),
            std::string::npos);
  const std::string page = kListPage;
  EXPECT_NE(ListError(page.substr(0, page.size() / 2)).find("unexpected end"), std::string::npos);
  EXPECT_NE(ListError("<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>")
                .find("<Contents> #1 has no <Key>"),
            std::string::npos);
  EXPECT_NE(ListError("<ListBucketResult><Contents><Key>k</Key></Contents></ListBucketResult>")
                .find("(key \"k\") has no <Size>"),
            std::string::npos);
  for (const char* size : {"-1", "1e3", "", "18446744073709551616", "0x10", "1 2"}) {
    const std::string body = std::string("<ListBucketResult><Contents><Key>k</Key><Size>") + size +
                             "</Size></Contents></ListBucketResult>";
    EXPECT_NE(ListError(body).find("<Size> that is not a number"), std::string::npos) << size;
  }
  EXPECT_TRUE(ParseListObjectsV2("<ListBucketResult><Contents><Key>k</Key><Size> "
                                 "18446744073709551615 </Size></Contents></ListBucketResult>")
                  .ok());
  EXPECT_NE(ListError("<ListBucketResult><IsTruncated>yes</IsTruncated></ListBucketResult>")
                .find("<IsTruncated> is neither true nor false"),
            std::string::npos);
  EXPECT_NE(ListError("<ListBucketResult><a></b></ListBucketResult>").find("does not match <a>"),
            std::string::npos);
  EXPECT_NE(ListError("<ListBucketResult x=1></ListBucketResult>").find("without quotes"),
            std::string::npos);
  EXPECT_NE(ListError("<ListBucketResult></ListBucketResult><x/>").find("after the root"),
            std::string::npos);
  EXPECT_NE(ListError("<ListBucketResult><!-- x </ListBucketResult>").find("unterminated comment"),
            std::string::npos);
}

TEST(S3Xml, BoundsDepthAndSize) {
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += "<a>";
  EXPECT_NE(ListError("<ListBucketResult>" + deep).find("nested too deeply"), std::string::npos);
  // 16 levels are fine.
  std::string ok = "<ListBucketResult>";
  for (int i = 1; i < kMaxXmlDepth; ++i) ok += "<a>";
  for (int i = 1; i < kMaxXmlDepth; ++i) ok += "</a>";
  EXPECT_TRUE(ParseListObjectsV2(ok + "</ListBucketResult>").ok());
  std::string many = "<ListBucketResult>";
  for (size_t i = 0; i <= kMaxXmlElements; ++i) many += "<a/>";
  EXPECT_NE(ListError(many + "</ListBucketResult>").find("too many elements"), std::string::npos);
  EXPECT_NE(ListError(std::string(kMaxXmlBodySize + 1, ' ')).find("larger than 16 MiB"),
            std::string::npos);
}

TEST(S3Xml, XmlUnescape) {
  EXPECT_EQ(XmlUnescape("a &amp; b &lt;c&gt; &quot;d&quot; &apos;e&apos;"), "a & b <c> \"d\" 'e'");
  EXPECT_EQ(XmlUnescape("&#65;&#x42;&#X43;&#233;&#x1F600;"), "ABC\xC3\xA9\xF0\x9F\x98\x80");
  // Kept as written: unknown, unterminated, out of range, NUL, surrogates, malformed.
  for (const char* kept : {"&nbsp;", "&amp", "a & b", "&#x110000;", "&#0;", "&#xD800;", "&#;",
                           "&#x;", "&#12a;", "&#99999999999;", "&;", "&&amp"}) {
    EXPECT_EQ(XmlUnescape(kept), kept);
  }
  EXPECT_EQ(XmlUnescape("&&amp;"), "&&");
  EXPECT_EQ(XmlUnescape(""), "");
  EXPECT_EQ(XmlUnescape("plain"), "plain");
}

}  // namespace
}  // namespace tensorferry::objstore
