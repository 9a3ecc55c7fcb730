// The parser against the reference implementation: tests/data/reference holds files written by
// huggingface/safetensors (tests/python/make_reference_vectors.py) and a manifest of the tensors
// that produced them; each must parse back to the manifest. (The writer's side of the same vectors
// is WriterReference.ByteIdenticalToReferenceFiles in writer_test.cc.)
#include <gtest/gtest.h>
#include <simdjson.h>

#include <string>
#include <vector>

#include "tensorferry/format.h"
#include "tensorferry/writer.h"  // TensorToWrite, Metadata: the manifest's shape
#include "testing/test_util.h"

namespace tensorferry {
namespace {

const std::string kDir = std::string(TENSORFERRY_SOURCE_DIR) + "/tests/data/reference";

struct Case {
  std::string name;
  std::vector<TensorToWrite> tensors;
  std::vector<std::string> data;  // owns the bytes the tensors point at
  Metadata metadata;
};

std::vector<Case> LoadManifest() {
  simdjson::dom::parser parser;
  simdjson::padded_string json = simdjson::padded_string::load(kDir + "/manifest.json");
  simdjson::dom::element doc = parser.parse(json);
  std::vector<Case> cases;
  for (auto file : doc["files"].get_object()) {
    Case c;
    c.name = std::string(file.key);
    simdjson::dom::array tensors = file.value["tensors"].get_array();
    c.data.reserve(tensors.size());
    for (simdjson::dom::element t : tensors) {
      TensorToWrite w;
      w.name = std::string(std::string_view(t["name"]));
      w.dtype = *DTypeFromName(std::string_view(t["dtype"]));
      for (simdjson::dom::element d : t["shape"].get_array()) w.shape.push_back(uint64_t(d));
      std::string_view hex = t["data"];
      std::string bytes;
      for (size_t i = 0; i + 1 < hex.size(); i += 2) {
        bytes.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
      }
      c.data.push_back(std::move(bytes));
      w.data = std::as_bytes(std::span<const char>(c.data.back()));
      c.tensors.push_back(std::move(w));
    }
    for (auto kv : file.value["metadata"].get_object()) {
      c.metadata.emplace_back(std::string(kv.key), std::string(std::string_view(kv.value)));
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

TEST(HeaderReference, ParsesFilesWrittenByTheReference) {
  auto cases = LoadManifest();
  ASSERT_GE(cases.size(), 7u);
  for (const auto& c : cases) {
    std::string file = testing::ReadBytes(kDir + "/" + c.name + ".safetensors");
    auto bytes = testing::ToBytes(file);
    auto h = ParseHeader(bytes, bytes.size(), {}, c.name);
    ASSERT_TRUE(h.ok()) << c.name << ": " << h.status().ToString();
    ASSERT_EQ(h->tensors.size(), c.tensors.size()) << c.name;
    for (size_t i = 0; i < c.tensors.size(); ++i) {
      const TensorToWrite& want = c.tensors[i];
      const TensorEntry* got = nullptr;
      for (const auto& t : h->tensors) {
        if (t.name == want.name) got = &t;
      }
      ASSERT_NE(got, nullptr) << c.name << ": " << want.name;
      EXPECT_EQ(got->dtype, want.dtype);
      EXPECT_EQ(got->shape, want.shape);
      std::string data = file.substr(h->data_offset() + got->begin, got->byte_size());
      EXPECT_EQ(data, c.data[i]) << c.name << ": " << want.name;
    }
    EXPECT_EQ(h->metadata, c.metadata) << c.name;
  }
}

}  // namespace
}  // namespace tensorferry
