// JSON text writing (tensorferry/json.h and util/json_writer.h).
#include "util/json_writer.h"

#include <gtest/gtest.h>

#include <string>

namespace tensorferry::json {
namespace {

TEST(JsonWriter, EscapesAsSerdeJson) {
  EXPECT_EQ(Quote("plain"), "\"plain\"");
  EXPECT_EQ(Quote("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(Quote("\b\f\n\r\t"), "\"\\b\\f\\n\\r\\t\"");
  EXPECT_EQ(Quote(std::string("\x01\x1f", 2)), "\"\\u0001\\u001f\"");
  EXPECT_EQ(Quote(std::string("\0", 1)), "\"\\u0000\"");
  // Copied as is: '/', DEL, UTF-8.
  EXPECT_EQ(Quote("/\x7f\xc3\xa9"), "\"/\x7f\xc3\xa9\"");
}

TEST(JsonWriter, AppendsToWhatIsThere) {
  std::string out = "x=";
  AppendString(out, "y");
  AppendUint(out, 0);
  AppendUint(out, 18446744073709551615ull);
  EXPECT_EQ(out, "x=\"y\"018446744073709551615");
}

TEST(JsonWriter, Utf8Validation) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("ascii"));
  EXPECT_TRUE(IsValidUtf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"));  // é € 😀
  EXPECT_TRUE(IsValidUtf8("\xf4\x8f\xbf\xbf"));                      // U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));                             // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));                         // a surrogate
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));                     // above U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xc3"));                                 // cut short
  EXPECT_FALSE(IsValidUtf8("\x80"));                                 // a lone continuation
}

// Utf8SequenceLength reads one sequence; IsValidUtf8 is built on it.
TEST(JsonWriter, Utf8SequenceLength) {
  EXPECT_EQ(Utf8SequenceLength(""), 0u);
  EXPECT_EQ(Utf8SequenceLength("a\xff"), 1u);
  EXPECT_EQ(Utf8SequenceLength("\xc3\xa9x"), 2u);
  EXPECT_EQ(Utf8SequenceLength("\xe2\x82\xac"), 3u);
  EXPECT_EQ(Utf8SequenceLength("\xf0\x9f\x98\x80"), 4u);
  EXPECT_EQ(Utf8SequenceLength("\xe2\x82"), 0u);      // cut short
  EXPECT_EQ(Utf8SequenceLength("\xe0\x80\xaf"), 0u);  // overlong
  EXPECT_EQ(Utf8SequenceLength("\xf5\x80\x80\x80"), 0u);
}

// kReplace writes each byte that starts no valid sequence as \ufffd and copies valid sequences;
// escapes are the same in both modes.
TEST(JsonWriter, ReplacesInvalidUtf8OnRequest) {
  const std::string s("a\xff\xc3\xa9\xc3\n\xed\xa0\x80\"");
  std::string replaced;
  AppendJsonString(replaced, s, InvalidUtf8::kReplace);
  EXPECT_EQ(replaced, "\"a\\ufffd\xc3\xa9\\ufffd\\n\\ufffd\\ufffd\\ufffd\\\"\"");
  EXPECT_TRUE(IsValidUtf8(replaced));
  std::string copied;
  AppendJsonString(copied, s);
  EXPECT_EQ(copied, "\"a\xff\xc3\xa9\xc3\\n\xed\xa0\x80\\\"\"");
}

}  // namespace
}  // namespace tensorferry::json
