// JSON text writing (util/json_writer.h).
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

}  // namespace
}  // namespace tensorferry::json
