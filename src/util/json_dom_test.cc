// Helpers over simdjson's DOM (util/json_dom.h).
#include "util/json_dom.h"

#include <gtest/gtest.h>

#include <string>

namespace tensorferry::json {
namespace {

simdjson::dom::element Parse(simdjson::dom::parser& parser, const std::string& text) {
  simdjson::dom::element e;
  EXPECT_EQ(parser.parse(text).get(e), simdjson::SUCCESS) << text;
  return e;
}

TEST(JsonDom, TypeNamesForMessages) {
  simdjson::dom::parser parser;
  const std::pair<const char*, const char*> cases[] = {{"[1]", "an array"},
                                                       {"{}", "an object"},
                                                       {"-1", "a signed integer"},
                                                       {"\"s\"", "a string"},
                                                       {"true", "a boolean"},
                                                       {"null", "null"},
                                                       {"1.5", "a floating-point number"}};
  for (const auto& [text, name] : cases) {
    EXPECT_STREQ(TypeName(Parse(parser, text).type()), name) << text;
  }
  // Unsigned integers above INT64_MAX, and ordinary ones.
  const std::string big = "18446744073709551615";
  EXPECT_NE(std::string(TypeName(Parse(parser, big).type())).find("integer"), std::string::npos);
  EXPECT_NE(std::string(TypeName(Parse(parser, "7").type())).find("integer"), std::string::npos);
}

TEST(JsonDom, FindsTheFirstDuplicateKeyInDocumentOrder) {
  simdjson::dom::parser parser;
  simdjson::dom::object o;
  ASSERT_EQ(Parse(parser, R"({"a": 1, "b": 2, "b": 3, "a": 4})").get(o), simdjson::SUCCESS);
  auto dup = FindDuplicateKey(o);
  ASSERT_TRUE(dup.has_value());
  EXPECT_EQ(*dup, "b");
  ASSERT_EQ(Parse(parser, R"({"a": 1, "ab": 2})").get(o), simdjson::SUCCESS);
  EXPECT_FALSE(FindDuplicateKey(o).has_value());
  ASSERT_EQ(Parse(parser, "{}").get(o), simdjson::SUCCESS);
  EXPECT_FALSE(FindDuplicateKey(o).has_value());
}

TEST(JsonDom, WithSourcePrefixesTheMessage) {
  const Status s = WithSource(Code::kIndexInvalidJson, "model.json", "bad");
  EXPECT_EQ(s.code(), Code::kIndexInvalidJson);
  EXPECT_EQ(s.message(), "model.json: bad");
  EXPECT_EQ(WithSource(Code::kIndexInvalidJson, "", "bad").message(), "bad");
}

}  // namespace
}  // namespace tensorferry::json
