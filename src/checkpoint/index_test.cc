#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tensorferry/checkpoint.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

using ::tensorferry::testing::Contains;

Status ParseError(std::string_view json, const IndexLimits& limits = {}) {
  auto r = ParseIndexJson(json, "dir/model.safetensors.index.json", limits);
  EXPECT_FALSE(r.ok()) << json;
  return r.status();
}

std::string WithMap(const std::string& entries) {
  return "{\"weight_map\":{" + entries + "}}";
}

TEST(IndexTest, ParsesWeightMapAndMetadataSorted) {
  auto r = ParseIndexJson(R"({
    "metadata": {"total_size": 123, "format": "pt", "nested": {"a": [1, 2]}},
    "weight_map": {
      "model.layers.1.w": "model-00002-of-00002.safetensors",
      "model.embed": "model-00001-of-00002.safetensors",
      "lm_head": "sub/model-00002-of-00002.safetensors"
    },
    "unknown_key": [1, 2, 3]
  })");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const IndexDocument& doc = *r;
  ASSERT_EQ(doc.weight_map.size(), 3u);
  EXPECT_EQ(doc.weight_map[0].first, "lm_head");
  EXPECT_EQ(doc.weight_map[0].second, "sub/model-00002-of-00002.safetensors");
  EXPECT_EQ(doc.weight_map[1].first, "model.embed");
  EXPECT_EQ(doc.weight_map[2].first, "model.layers.1.w");
  EXPECT_EQ(doc.weight_map[2].second, "model-00002-of-00002.safetensors");
  ASSERT_EQ(doc.metadata.size(), 3u);
  EXPECT_EQ(doc.metadata[0], std::make_pair(std::string("format"), std::string("\"pt\"")));
  EXPECT_EQ(doc.metadata[1], std::make_pair(std::string("nested"), std::string("{\"a\":[1,2]}")));
  EXPECT_EQ(doc.metadata[2], std::make_pair(std::string("total_size"), std::string("123")));
}

TEST(IndexTest, MetadataOptionalAndEmptyMapAccepted) {
  auto r = ParseIndexJson(R"({"weight_map": {}})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->weight_map.empty());
  EXPECT_TRUE(r->metadata.empty());
  // Leading and trailing whitespace is fine.
  EXPECT_TRUE(ParseIndexJson(" \n{\"weight_map\": {\"a\": \"x.safetensors\"}}\n ").ok());
  // "metadata": null is as absent (as the header's "__metadata__": null); other non-objects not.
  auto null_metadata =
      ParseIndexJson(R"({"metadata": null, "weight_map": {"a": "x.safetensors"}})");
  ASSERT_TRUE(null_metadata.ok()) << null_metadata.status().ToString();
  EXPECT_TRUE(null_metadata->metadata.empty());
  EXPECT_FALSE(ParseIndexJson(R"({"metadata": 1, "weight_map": {}})").ok());
}

TEST(IndexTest, AcceptsInnocentPaths) {
  for (const char* file : {"sub/model.safetensors", "./a.safetensors", "..a.safetensors",
                           "a..b.safetensors", "sub/...", "a/b/c/d.safetensors"}) {
    auto r = ParseIndexJson(WithMap("\"t\": \"" + std::string(file) + "\""));
    EXPECT_TRUE(r.ok()) << file << ": " << r.status().ToString();
  }
}

TEST(IndexTest, TooLarge) {
  IndexLimits limits;
  limits.max_index_size = 10;
  Status s = ParseError(WithMap(""), limits);
  EXPECT_EQ(s.code(), Code::kIndexTooLarge);
  EXPECT_TRUE(Contains(s.message(), "dir/model.safetensors.index.json: "));
  EXPECT_TRUE(Contains(s.message(), "limit of 10"));
  limits.max_index_size = WithMap("").size();
  EXPECT_TRUE(ParseIndexJson(WithMap(""), "", limits).ok());
}

TEST(IndexTest, InvalidJson) {
  for (std::string json : {std::string(""), std::string("{"), std::string("{\"weight_map\":{}"),
                           std::string("{\"weight_map\":{}} x"), std::string("{'a': 1}"),
                           std::string("{\"weight_map\":{\"a\":\"b\",}}"),
                           std::string("\xEF\xBB\xBF{\"weight_map\":{}}")}) {
    Status s = ParseError(json);
    EXPECT_EQ(s.code(), Code::kIndexInvalidJson) << json << ": " << s.ToString();
    EXPECT_EQ(s.message().rfind("dir/model.safetensors.index.json: ", 0), 0u) << s.message();
  }
}

TEST(IndexTest, NotUtf8) {
  Status s = ParseError("{\"weight_map\":{\"a\xff\":\"b.safetensors\"}}");
  EXPECT_EQ(s.code(), Code::kIndexInvalidJson);
  EXPECT_TRUE(Contains(s.message(), "UTF-8"));
  // An overlong encoding and a lone surrogate.
  EXPECT_EQ(ParseError("{\"weight_map\":{\"\xc0\xaf\":\"b\"}}").code(), Code::kIndexInvalidJson);
  EXPECT_EQ(ParseError("{\"weight_map\":{\"\xed\xa0\x80\":\"b\"}}").code(),
            Code::kIndexInvalidJson);
}

TEST(IndexTest, TopLevelNotObject) {
  for (const char* json : {"[]", "\"weight_map\"", "1", "null", "true"}) {
    Status s = ParseError(json);
    EXPECT_EQ(s.code(), Code::kIndexInvalidJson) << json;
    EXPECT_TRUE(Contains(s.message(), "not an object"));
  }
}

TEST(IndexTest, TooDeep) {
  std::string deep(100, '[');
  deep += std::string(100, ']');
  Status s = ParseError("{\"metadata\":{\"x\":" + deep + "},\"weight_map\":{}}");
  EXPECT_EQ(s.code(), Code::kIndexInvalidJson);
  EXPECT_TRUE(Contains(s.message(), "deeper than the limit of 64"));

  // Depth counts containers: {"weight_map":{"a":"b"}} nests 2, {"metadata":{"a":[1]}} nests 3.
  IndexLimits limits;
  limits.max_depth = 2;
  EXPECT_TRUE(ParseIndexJson(WithMap("\"a\":\"b\""), "", limits).ok());
  EXPECT_EQ(ParseError("{\"metadata\":{\"a\":[1]},\"weight_map\":{}}", limits).code(),
            Code::kIndexInvalidJson);
  limits.max_depth = 3;
  EXPECT_TRUE(ParseIndexJson("{\"metadata\":{\"a\":[1]},\"weight_map\":{}}", "", limits).ok());
  limits.max_depth = 1;
  EXPECT_EQ(ParseError(WithMap("\"a\":\"b\""), limits).code(), Code::kIndexInvalidJson);
  limits.max_depth = 0;  // nothing fits
  EXPECT_EQ(ParseError(WithMap(""), limits).code(), Code::kIndexInvalidJson);
}

TEST(IndexTest, MetadataNotObject) {
  for (const char* meta : {"[]", "\"x\"", "1"}) {
    Status s = ParseError("{\"metadata\":" + std::string(meta) + ",\"weight_map\":{}}");
    EXPECT_EQ(s.code(), Code::kIndexInvalidJson) << meta;
    EXPECT_TRUE(Contains(s.message(), "\"metadata\" is"));
  }
}

TEST(IndexTest, NoWeightMap) {
  for (const char* json :
       {"{}", "{\"metadata\":{}}", "{\"weight_map\":[]}", "{\"weight_map\":\"model.safetensors\"}",
        "{\"weight_map\":null}", "{\"Weight_map\":{}}"}) {
    Status s = ParseError(json);
    EXPECT_EQ(s.code(), Code::kIndexNoWeightMap) << json;
    EXPECT_TRUE(Contains(s.message(), "weight_map"));
  }
}

TEST(IndexTest, BadEntry) {
  for (const char* value : {"1", "null", "\"\"", "{}", "[\"a.safetensors\"]", "true"}) {
    Status s = ParseError(WithMap("\"ok\":\"a.safetensors\",\"layer.0.w\":" + std::string(value)));
    EXPECT_EQ(s.code(), Code::kIndexBadEntry) << value;
    EXPECT_TRUE(Contains(s.message(), "weight_map[\"layer.0.w\"]"));
  }
}

TEST(IndexTest, DuplicateKeys) {
  Status s = ParseError(WithMap("\"a\":\"x.safetensors\",\"a\":\"x.safetensors\""));
  EXPECT_EQ(s.code(), Code::kDuplicateKey);
  EXPECT_TRUE(Contains(s.message(), "\"weight_map\": key \"a\""));

  s = ParseError("{\"metadata\":{\"k\":1,\"k\":2},\"weight_map\":{}}");
  EXPECT_EQ(s.code(), Code::kDuplicateKey);
  EXPECT_TRUE(Contains(s.message(), "\"metadata\": key \"k\""));

  s = ParseError("{\"weight_map\":{},\"weight_map\":{\"a\":\"b\"}}");
  EXPECT_EQ(s.code(), Code::kDuplicateKey);
  EXPECT_TRUE(Contains(s.message(), "top level: key \"weight_map\""));

  // Unknown top-level keys are ignored but must still be unique.
  EXPECT_EQ(ParseError("{\"x\":1,\"x\":1,\"weight_map\":{}}").code(), Code::kDuplicateKey);
  // Escapes are decoded before comparing: "\u0061" is "a".
  EXPECT_EQ(ParseError(WithMap("\"a\":\"x\",\"\\u0061\":\"x\"")).code(), Code::kDuplicateKey);
}

TEST(IndexTest, PathEscape) {
  for (const char* file :
       {"../x.safetensors", "/abs/path.safetensors", "a/../../x.safetensors", "..", "a/..",
        "sub/../x.safetensors", "//x", "a/b/../../../c", "..\\\\x.safetensors",
        "sub\\\\x.safetensors", "a\\u0000b", "\\u002e\\u002e/x"}) {
    Status s = ParseError(WithMap("\"t.w\":\"" + std::string(file) + "\""));
    EXPECT_EQ(s.code(), Code::kIndexPathEscape) << file << ": " << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "weight_map[\"t.w\"]: file"));
    EXPECT_EQ(s.message().rfind("dir/model.safetensors.index.json: ", 0), 0u);
  }
}

TEST(IndexTest, NoSourceNoPrefix) {
  auto r = ParseIndexJson("[]");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().rfind("index top level", 0), 0u) << r.status().message();
}

TEST(IndexTest, EscapedNamesAreDecoded) {
  auto r = ParseIndexJson(WithMap("\"a\\nb\":\"x\\u002esafetensors\""));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->weight_map[0].first, "a\nb");
  EXPECT_EQ(r->weight_map[0].second, "x.safetensors");
}

// The fuzz seed corpus doubles as test vectors: valid_* files parse, every other one fails.
TEST(IndexTest, FuzzSeedCorpus) {
  const std::filesystem::path dir =
      std::filesystem::path(TENSORFERRY_SOURCE_DIR) / "fuzz" / "corpus" / "index";
  // The hand-written seeds say in their names whether they are valid; the inputs a fuzz campaign
  // kept (named by libFuzzer with their SHA-1, scripts/fuzz_campaign.sh) may be either, and must
  // parse or fail with an error naming their source.
  const auto is_sha1 = [](const std::string& name) {
    return name.size() == 40 && name.find_first_not_of("0123456789abcdef") == std::string::npos;
  };
  int seeds = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    auto r = ParseIndexJson(testing::ReadBytes(entry.path().string()), name);
    if (is_sha1(name)) {
      if (!r.ok()) {
        EXPECT_EQ(r.status().message().rfind(name + ": ", 0), 0u) << r.status().ToString();
      }
      continue;
    }
    EXPECT_EQ(r.ok(), name.rfind("valid_", 0) == 0) << name << ": " << r.status().ToString();
    ++seeds;
  }
  EXPECT_GE(seeds, 10);
}

}  // namespace
}  // namespace tensorferry
