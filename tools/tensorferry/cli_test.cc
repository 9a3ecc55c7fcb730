// End-to-end tests of the tensorferry CLI: the binary is run as a child process and its exit
// code, stdout and stderr are checked.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <simdjson.h>

#include "cli_testing.h"
#include "tensorferry/integrity.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"
#include "tensorferry/writer.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

namespace fs = std::filesystem;
using testing::ReadBytes;
using testing::TempDir;
using testing::WriteBytes;

using testing::Describe;
using testing::RunCli;
using testing::RunResult;

// Generates the tiny preset into `dir` (no fsync: scratch files).
void GenTiny(const std::string& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"gen", dir, "--preset", "tiny", "--no-sync"};
  args.insert(args.end(), extra.begin(), extra.end());
  const RunResult r = RunCli(args);
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
}

// Files of `dir` by name, with their bytes.
std::vector<std::pair<std::string, std::string>> DirContents(const std::string& dir) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    out.emplace_back(e.path().filename().string(), ReadBytes(e.path().string()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> Shards(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Expects the failure shape of verify/inspect: exit 1, nothing on stdout, exactly one line on
// stderr starting with "error: ".
void ExpectOneLineError(const RunResult& r) {
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_EQ(r.out, "") << Describe(r);
  ASSERT_FALSE(r.err.empty()) << Describe(r);
  EXPECT_TRUE(r.err.starts_with("error: ")) << Describe(r);
  EXPECT_EQ(r.err.back(), '\n') << Describe(r);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << Describe(r);
}

// Tensors of the tiny preset: embed, 2 layers x 9, final norm, lm_head.
constexpr uint64_t kTinyTensors = 1 + 2 * 9 + 1 + 1;
// BF16 bytes of the tiny preset: vocab 256, hidden 64, intermediate 128, kv dim 2 * 16 = 32.
constexpr uint64_t kTinyBytes =
    2 * (2 * 256 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64 + 2 * 64) + 64);

// --- gen -------------------------------------------------------------------------------------

TEST(CliGen, TinyIsDeterministic) {
  TempDir t;
  GenTiny(t.Join("a"));
  GenTiny(t.Join("b"));
  GenTiny(t.Join("c"), {"--seed", "1"});
  const auto a = DirContents(t.Join("a"));
  const auto b = DirContents(t.Join("b"));
  const auto c = DirContents(t.Join("c"));
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), c.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, c[i].first);
    if (a[i].first.ends_with(".safetensors")) {
      EXPECT_NE(a[i].second, c[i].second) << a[i].first;
    }
  }
}

TEST(CliGen, ShardsLayerByLayer) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir, {"--shard-size", "40KB"});
  const auto shards = Shards(dir);
  EXPECT_GE(shards.size(), 3u);
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  const RunResult r = RunCli({"inspect", dir, "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(simdjson::padded_string(r.out)).get(doc), simdjson::SUCCESS) << r.out;
  // The embedding is in the first shard, lm_head in the last, layer 0 before layer 1.
  std::map<std::string, std::string> file_of;
  for (simdjson::dom::element tensor : doc["tensors"].get_array()) {
    file_of[std::string(tensor["name"].get_string().value())] =
        std::string(tensor["file"].get_string().value());
  }
  EXPECT_EQ(file_of["model.embed_tokens.weight"], shards.front());
  EXPECT_EQ(file_of["lm_head.weight"], shards.back());
  EXPECT_LE(file_of["model.layers.0.mlp.down_proj.weight"],
            file_of["model.layers.1.mlp.down_proj.weight"]);
}

TEST(CliGen, OptionsAndJsonSummary) {
  TempDir t;
  const std::string dir = t.Join("m");
  const RunResult r = RunCli({"gen", dir, "--preset", "tiny", "--no-sync", "--dtype", "F32",
                              "--layers", "3", "--tie-embeddings", "--metadata", "k=v", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(simdjson::padded_string(r.out)).get(doc), simdjson::SUCCESS) << r.out;
  EXPECT_EQ(uint64_t(doc["tensors"]), uint64_t{1 + 3 * 9 + 1});
  EXPECT_EQ(std::string_view(doc["config"]["dtype"]), "F32");
  EXPECT_EQ(uint64_t(doc["config"]["layers"]), 3u);
  EXPECT_EQ(uint64_t(doc["config"]["hidden"]), 64u);
  EXPECT_EQ(std::string_view(doc["metadata"]["k"]), "v");
  EXPECT_EQ(std::string_view(doc["metadata"]["format"]), "pt");
}

// Dtype names are taken in any case (the file gets the canonical name); the writer's checksum
// record is not a key --metadata may set.
TEST(CliGen, LowercaseDtypeAndReservedMetadataKey) {
  TempDir t;
  const std::string dir = t.Join("m");
  RunResult r = RunCli({"gen", dir, "--preset", "tiny", "--no-sync", "--dtype", "bf16", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("\"dtype\":\"BF16\""), std::string::npos) << r.out;
  r = RunCli({"verify", dir});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = RunCli({"inspect", dir, "--json"});
  EXPECT_NE(r.out.find("\"BF16\""), std::string::npos) << r.out;
  r = RunCli({"gen", t.Join("n"), "--preset", "tiny", "--no-sync", "--dtype", "f8_e4m3"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = RunCli({"gen", t.Join("o"), "--preset", "tiny", "--dtype", "bf17"});
  EXPECT_EQ(r.exit_code, 2) << Describe(r);
  r = RunCli({"gen", t.Join("o"), "--preset", "tiny", "--metadata", "tensorferry.checksums=x"});
  EXPECT_EQ(r.exit_code, 2) << Describe(r);
  EXPECT_NE(r.err.find("the writer's own checksum record"), std::string::npos) << Describe(r);
  EXPECT_FALSE(std::filesystem::exists(t.Join("o")));
}

// Float values are small and finite; norms are near 1.
TEST(CliGen, RealisticFloatValues) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir, {"--dtype", "F32"});
  const RunResult r = RunCli({"inspect", dir, "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(simdjson::padded_string(r.out)).get(doc), simdjson::SUCCESS) << r.out;
  std::map<std::string, std::string> files;
  int checked = 0;
  for (simdjson::dom::element tensor : doc["tensors"].get_array()) {
    const std::string name(tensor["name"].get_string().value());
    const std::string path(tensor["file"].get_string().value());
    if (!files.count(path)) files[path] = ReadBytes(path);
    const std::string& bytes = files[path];
    const uint64_t offset = tensor["offset"], size = tensor["size"];
    ASSERT_LE(offset + size, bytes.size());
    const bool norm = name.find("norm") != std::string::npos;
    double sum = 0, sum_sq = 0;
    for (uint64_t i = 0; i < size; i += 4) {
      float v;
      std::memcpy(&v, bytes.data() + offset + i, 4);
      ASSERT_TRUE(std::isfinite(v)) << name;
      if (norm) {
        ASSERT_NEAR(v, 1.0, 0.051) << name;
      } else {
        ASSERT_LE(std::fabs(v), 0.035) << name;
      }
      sum += v;
      sum_sq += static_cast<double>(v) * v;
    }
    if (!norm) {
      const double n = static_cast<double>(size / 4);
      const double mean = sum / n, stddev = std::sqrt(sum_sq / n - mean * mean);
      EXPECT_NEAR(mean, 0.0, 0.003) << name;
      EXPECT_NEAR(stddev, 0.02, 0.002) << name;
    }
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(kTinyTensors));
}

TEST(CliGen, EveryDtypeVerifies) {
  for (const char* dtype : {"BF16", "F16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
                            "F8_E8M0", "F64", "C64", "I8", "U32", "BOOL", "F4"}) {
    TempDir t;
    const std::string dir = t.Join("m");
    GenTiny(dir, {"--dtype", dtype, "--layers", "1"});
    const RunResult r = RunCli({"verify", dir});
    EXPECT_EQ(r.exit_code, 0) << dtype << "\n" << Describe(r);
  }
}

// --- inspect ---------------------------------------------------------------------------------

TEST(CliInspect, Json) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir, {"--shard-size", "100KB", "--metadata", "owner=test"});
  const RunResult r = RunCli({"inspect", dir, "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.err, "");
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(simdjson::padded_string(r.out)).get(doc), simdjson::SUCCESS) << r.out;
  EXPECT_EQ(std::string_view(doc["path"]), dir);
  const auto shards = Shards(dir);
  simdjson::dom::array files = doc["files"];
  ASSERT_EQ(files.size(), shards.size());
  uint64_t file_bytes = 0, tensors_in_files = 0;
  size_t i = 0;
  for (simdjson::dom::element f : files) {
    EXPECT_EQ(std::string_view(f["path"]), shards[i]);
    EXPECT_EQ(uint64_t(f["size"]), fs::file_size(shards[i]));
    EXPECT_GT(uint64_t(f["header_size"]), 0u);
    EXPECT_EQ(std::string_view(f["metadata"]["format"]), "pt");
    EXPECT_EQ(std::string_view(f["metadata"]["owner"]), "test");
    file_bytes += uint64_t(f["size"]);
    tensors_in_files += uint64_t(f["num_tensors"]);
    ++i;
  }
  simdjson::dom::array tensors = doc["tensors"];
  EXPECT_EQ(tensors.size(), kTinyTensors);
  EXPECT_EQ(tensors_in_files, kTinyTensors);
  bool saw_k = false;
  uint64_t bytes = 0;
  for (simdjson::dom::element tensor : tensors) {
    EXPECT_EQ(std::string_view(tensor["dtype"]), "BF16");
    bytes += uint64_t(tensor["size"]);
    if (std::string_view(tensor["name"]) == "model.layers.1.self_attn.k_proj.weight") {
      saw_k = true;
      simdjson::dom::array shape = tensor["shape"];
      ASSERT_EQ(shape.size(), 2u);
      EXPECT_EQ(uint64_t(shape.at(0)), 32u);
      EXPECT_EQ(uint64_t(shape.at(1)), 64u);
      EXPECT_EQ(uint64_t(tensor["size"]), 32u * 64 * 2);
    }
  }
  EXPECT_TRUE(saw_k);
  EXPECT_EQ(bytes, kTinyBytes);
  EXPECT_EQ(uint64_t(doc["totals"]["tensors"]), kTinyTensors);
  EXPECT_EQ(uint64_t(doc["totals"]["bytes"]), kTinyBytes);
  EXPECT_EQ(uint64_t(doc["totals"]["files"]), shards.size());
  EXPECT_EQ(uint64_t(doc["totals"]["file_bytes"]), file_bytes);
  EXPECT_EQ(uint64_t(doc["dtypes"]["BF16"]["count"]), kTinyTensors);
  EXPECT_EQ(uint64_t(doc["dtypes"]["BF16"]["bytes"]), kTinyBytes);
  EXPECT_EQ(uint64_t(doc["index_metadata"]["total_size"]), kTinyBytes);
}

TEST(CliInspect, Text) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir);
  const RunResult r = RunCli({"inspect", dir});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("model.embed_tokens.weight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[256, 64]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("BF16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(std::to_string(kTinyTensors) + " tensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("format = pt"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("total_size"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("more (use --all)"), std::string::npos) << r.out;
  // Columns are aligned: DTYPE starts at the same column on every tensor row.
  size_t column = std::string::npos;
  size_t rows = 0;
  size_t pos = 0;
  while (pos < r.out.size()) {
    const size_t end = r.out.find('\n', pos);
    const std::string line = r.out.substr(pos, end - pos);
    pos = end == std::string::npos ? r.out.size() : end + 1;
    const size_t c = line.find("BF16");
    if (c == std::string::npos || !(line.starts_with("model.") || line.starts_with("lm_head"))) {
      continue;  // not a tensor row
    }
    if (column == std::string::npos) column = c;
    EXPECT_EQ(c, column) << line;
    ++rows;
  }
  EXPECT_EQ(rows, kTinyTensors);
  // The writer's checksums (kilobytes of metadata per file) are abbreviated, naming their size;
  // --all prints them whole, as --json does.
  EXPECT_NE(r.out.find("tensorferry.checksums = "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("; --all or --json prints it whole)"), std::string::npos) << r.out;
  for (size_t at = 0, end; at < r.out.size(); at = end + 1) {
    end = r.out.find('\n', at);
    if (end == std::string::npos) end = r.out.size();
    EXPECT_LE(end - at, 300u) << r.out.substr(at, 300);
  }
  const RunResult all = RunCli({"inspect", dir, "--all"});
  ASSERT_EQ(all.exit_code, 0) << Describe(all);
  EXPECT_EQ(all.out.find("--all or --json prints it whole"), std::string::npos) << all.out;
  EXPECT_NE(all.out.find("tensorferry.checksums = {"), std::string::npos) << all.out;
}

TEST(CliInspect, ManyTensorsAreElided) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir, {"--layers", "10"});  // 1 + 90 + 2 = 93 tensors
  const RunResult r = RunCli({"inspect", dir});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("... 43 more (use --all)"), std::string::npos) << r.out;
  const RunResult all = RunCli({"inspect", dir, "--all"});
  ASSERT_EQ(all.exit_code, 0) << Describe(all);
  EXPECT_EQ(all.out.find("more (use --all)"), std::string::npos);
  EXPECT_NE(all.out.find("lm_head.weight"), std::string::npos);
}

TEST(CliInspect, SingleFileAndIndexPath) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir, {"--shard-size", "40KB"});
  const auto shards = Shards(dir);
  const RunResult one = RunCli({"inspect", shards[0], "--json"});
  ASSERT_EQ(one.exit_code, 0) << Describe(one);
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(simdjson::padded_string(one.out)).get(doc), simdjson::SUCCESS);
  EXPECT_EQ(simdjson::dom::array(doc["files"]).size(), 1u);
  const RunResult index = RunCli({"inspect", dir + "/model.safetensors.index.json", "--json"});
  ASSERT_EQ(index.exit_code, 0) << Describe(index);
  ASSERT_EQ(parser.parse(simdjson::padded_string(index.out)).get(doc), simdjson::SUCCESS);
  EXPECT_EQ(uint64_t(doc["totals"]["tensors"]), kTinyTensors);
}

// Names with quotes, backslashes, control characters and non-ASCII survive --json, and the text
// table keeps one line per tensor.
TEST(CliInspect, OddTensorNames) {
  TempDir t;
  const std::string path = t.Join("odd.safetensors");
  const std::string name = R"(q\"b\\s\nl\u0001\u00e9)";  // as JSON text
  WriteBytes(path,
             testing::MakeFile(
                 "{\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2));
  const RunResult j = RunCli({"inspect", path, "--json"});
  ASSERT_EQ(j.exit_code, 0) << Describe(j);
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(simdjson::padded_string(j.out)).get(doc), simdjson::SUCCESS) << j.out;
  simdjson::dom::array tensors = doc["tensors"];
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(std::string_view(tensors.at(0)["name"]), "q\"b\\s\nl\x01\xc3\xa9");
  const RunResult text = RunCli({"inspect", path});
  ASSERT_EQ(text.exit_code, 0) << Describe(text);
  EXPECT_NE(text.out.find("q\"b\\s\\x0al\\x01\xc3\xa9  U8"), std::string::npos) << text.out;
}

TEST(CliInspect, MissingPath) {
  TempDir t;
  ExpectOneLineError(RunCli({"inspect", t.Join("nope")}));
}

// --- verify ----------------------------------------------------------------------------------

TEST(CliVerify, OkOnGenerated) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir, {"--shard-size", "40KB"});
  const RunResult r = RunCli({"verify", dir});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_TRUE(r.out.starts_with("ok: " + std::to_string(kTinyTensors) + " tensors, " +
                                std::to_string(Shards(dir).size()) + " files, "))
      << r.out;
  EXPECT_NE(r.out.find("GB/s"), std::string::npos);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1);
  EXPECT_EQ(r.err, "");

  const RunResult j = RunCli({"verify", dir, "--json"});
  ASSERT_EQ(j.exit_code, 0) << Describe(j);
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(simdjson::padded_string(j.out)).get(doc), simdjson::SUCCESS) << j.out;
  EXPECT_TRUE(bool(doc["ok"]));
  EXPECT_EQ(uint64_t(doc["tensors"]), kTinyTensors);
  uint64_t total = 0;
  for (const auto& s : Shards(dir)) total += fs::file_size(s);
  EXPECT_EQ(uint64_t(doc["bytes"]), total);
}

// Every --json command answers on stdout with one document, an error included ({"ok": false,
// "error": {...}}), with nothing else there: --explain goes into the document.
TEST(CliJson, EveryCommandAnswersItsErrorsAsOneDocument) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir);
  const std::string missing = t.Join("missing");
  // Runs `args`, expects `exit_code` and one JSON document on stdout whose "ok" is `ok`.
  const auto document = [](const std::vector<std::string>& args, int exit_code, bool ok) {
    const RunResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, exit_code) << Describe(r);
    simdjson::dom::parser parser;
    simdjson::dom::element doc;
    if (parser.parse(simdjson::padded_string(r.out)).get(doc) != simdjson::SUCCESS) {
      ADD_FAILURE() << args[0] << ": not one JSON document: " << r.out;
      return std::string();
    }
    EXPECT_EQ(bool(doc["ok"]), ok) << args[0];
    std::string_view text;
    if (!ok) {
      EXPECT_FALSE(std::string_view(doc["error"]["message"]).empty()) << args[0];
    }
    if (doc["explain"].get(text) == simdjson::SUCCESS) return std::string(text);
    return std::string();
  };
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"inspect", missing, "--json"},
           {"load", missing, "--json"},
           {"bench", missing, "--json"},
           {"verify", missing, "--json"},
           {"checksum", missing, "--json"},
           {"reshard", missing, t.Join("out"), "--tp", "2", "--json"},
           {"gen", "/proc/no-such/x", "--preset", "tiny", "--json", "--no-sync"}}) {
    document(args, 1, false);
  }
  document({"inspect", dir, "--json"}, 0, true);
  EXPECT_NE(document({"load", dir, "--json", "--explain"}, 0, true).find("plan: "),
            std::string::npos);
}

// An option given an empty value ("--budget \"$UNSET\"") is a usage error, not the default.
TEST(CliFlags, AnEmptyValueIsAUsageError) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir);
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"load", dir, "--budget", ""},
                                             {"load", dir, "--engine", ""},
                                             {"checksum", dir, "--chunk-size", ""},
                                             {"load", dir, "--tp-size", "", "--tp-rank", "0"}}) {
    const RunResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << Describe(r);
    EXPECT_NE(r.err.find("an empty value is not allowed"), std::string::npos) << r.err;
  }
  // A layer range beyond the model selects nothing: an error, not "loaded 0 tensors".
  const RunResult none = RunCli({"load", dir, "--layers", "50"});
  EXPECT_EQ(none.exit_code, 1) << Describe(none);
  EXPECT_NE(none.err.find("--layers 50 selects no tensor"), std::string::npos) << none.err;
  EXPECT_EQ(RunCli({"load", dir, "--repeat", "0"}).exit_code, 2);
  EXPECT_EQ(RunCli({"bench", dir, "--runs", "0"}).exit_code, 2);
  EXPECT_EQ(RunCli({"gen", dir + "-x", "--preset", "tiny", "--seed", "-1"}).exit_code, 2);
  EXPECT_FALSE(fs::exists(dir + "-x"));
  const RunResult big = RunCli({"load", dir, "--budget", "99999999999999999999G"});
  EXPECT_EQ(big.exit_code, 2) << Describe(big);
  EXPECT_NE(big.err.find("is out of range"), std::string::npos) << big.err;
}

class CliVerifyCorrupt : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = t_.Join("m");
    GenTiny(dir_, {"--shard-size", "40KB"});
    shards_ = Shards(dir_);
    ASSERT_GE(shards_.size(), 2u);
  }
  // verify fails on `path`, with --json the error code `code`.
  void ExpectVerifyFails(const std::string& path, std::string_view code) {
    ExpectOneLineError(RunCli({"verify", path}));
    const RunResult j = RunCli({"verify", path, "--json"});
    EXPECT_EQ(j.exit_code, 1) << Describe(j);
    simdjson::dom::parser parser;
    simdjson::dom::element doc;
    ASSERT_EQ(parser.parse(simdjson::padded_string(j.out)).get(doc), simdjson::SUCCESS) << j.out;
    EXPECT_FALSE(bool(doc["ok"]));
    EXPECT_EQ(std::string_view(doc["error"]["code"]), code) << j.out;
  }

  TempDir t_;
  std::string dir_;
  std::vector<std::string> shards_;
};

TEST_F(CliVerifyCorrupt, TruncatedShard) {
  fs::resize_file(shards_[1], fs::file_size(shards_[1]) - 1000);
  ExpectVerifyFails(dir_, "data_truncated");
  ExpectVerifyFails(shards_[1], "data_truncated");
}

TEST_F(CliVerifyCorrupt, CorruptLengthPrefix) {
  std::string bytes = ReadBytes(shards_[0]);
  for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>(0xFF);
  WriteBytes(shards_[0], bytes);
  ExpectVerifyFails(dir_, "header_too_large");
}

TEST_F(CliVerifyCorrupt, GarbageJson) {
  std::string bytes = ReadBytes(shards_[0]);
  // Keep the length prefix; scribble over the start of the JSON.
  bytes.replace(8, 12, "}{garbage\n\x01\xff");
  WriteBytes(shards_[0], bytes);
  ExpectVerifyFails(dir_, "header_not_utf8");  // the 0xff byte is checked first
  // The same scribble in ASCII: invalid JSON.
  bytes.replace(8, 12, "}{garbage\n\x01 ");
  WriteBytes(shards_[0], bytes);
  ExpectVerifyFails(dir_, "header_invalid_json");
}

TEST_F(CliVerifyCorrupt, IndexNamesMissingFile) {
  fs::remove(shards_.back());
  ExpectVerifyFails(dir_, "index_missing_file");
}

TEST_F(CliVerifyCorrupt, PathTraversal) {
  WriteBytes(t_.Join("outside.safetensors"), ReadBytes(shards_[0]));
  const std::string index_path = dir_ + "/model.safetensors.index.json";
  std::string index = ReadBytes(index_path);
  const std::string victim = fs::path(shards_[0]).filename().string();
  size_t pos = 0;
  int replaced = 0;
  while ((pos = index.find("\"" + victim + "\"", pos)) != std::string::npos) {
    index.replace(pos, victim.size() + 2, "\"../outside.safetensors\"");
    ++replaced;
  }
  ASSERT_GT(replaced, 0) << index;
  WriteBytes(index_path, index);
  ExpectVerifyFails(dir_, "index_path_escape");
}

TEST_F(CliVerifyCorrupt, EmptyAndTinyFiles) {
  WriteBytes(shards_[0], "");
  ExpectVerifyFails(dir_, "file_too_small");
  WriteBytes(shards_[0], "abc");
  ExpectVerifyFails(dir_, "file_too_small");
}

// A write past the file-size limit (ulimit -f) is an error that removes what was written, not
// a SIGXFSZ that kills the process and leaves a temporary file.
TEST(CliGen, FileSizeLimitIsAnErrorThatLeavesNothing) {
  TempDir t;
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit small = old;
  small.rlim_cur = 64 * 1024;  // tiny's one shard is ~200 KB
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const RunResult r = RunCli({"gen", t.Join("m"), "--preset", "tiny", "--no-sync"});
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_NE(r.err.find("File too large"), std::string::npos) << Describe(r);
  EXPECT_FALSE(fs::exists(t.Join("m")));
  EXPECT_TRUE(fs::is_empty(t.path()));
}

TEST(CliVerify, GarbageFileAndEmptyDirectory) {
  TempDir t;
  WriteBytes(t.Join("x.safetensors"), std::string(100, '\xAB'));
  ExpectOneLineError(RunCli({"verify", t.Join("x.safetensors")}));
  fs::create_directory(t.Join("empty"));
  ExpectOneLineError(RunCli({"verify", t.Join("empty")}));
  ExpectOneLineError(RunCli({"verify", t.Join("missing")}));
}

// Special files are refused, not waited on: opening a FIFO for reading would block forever.
TEST(CliVerify, FifoIsRefusedWithoutHanging) {
  TempDir t;
  const std::string fifo = t.Join("pipe.safetensors");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ExpectOneLineError(RunCli({"verify", fifo}));
  ExpectOneLineError(RunCli({"inspect", fifo}));
}

// --- common ----------------------------------------------------------------------------------

TEST(CliUsage, ErrorsExitTwo) {
  EXPECT_EQ(RunCli({}).exit_code, 2);
  const RunResult unknown = RunCli({"verfy", "x"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.err.find("unknown command 'verfy' (commands: inspect, verify,"),
            std::string::npos)
      << unknown.err;
  EXPECT_EQ(RunCli({"inspect"}).exit_code, 2);
  EXPECT_EQ(RunCli({"inspect", "x", "--bogus"}).exit_code, 2);
  TempDir t;
  EXPECT_EQ(RunCli({"gen", t.Join("a"), "--dtype", "F17"}).exit_code, 2);
  EXPECT_EQ(RunCli({"gen", t.Join("a"), "--shard-size", "12XB"}).exit_code, 2);
  EXPECT_EQ(RunCli({"gen", t.Join("a"), "--shard-size", "0"}).exit_code, 2);
  EXPECT_EQ(RunCli({"gen", t.Join("a"), "--preset", "huge"}).exit_code, 2);
  EXPECT_EQ(RunCli({"gen", t.Join("a"), "--metadata", "novalue"}).exit_code, 2);
  EXPECT_EQ(RunCli({"gen", t.Join("a"), "--preset", "tiny", "--heads", "3"}).exit_code, 2);
  EXPECT_EQ(RunCli({"gen", t.Join("a"), "--layers", "-1"}).exit_code, 2);
  EXPECT_FALSE(fs::exists(t.Join("a")));
}

TEST(CliUsage, VersionAndHelp) {
  const RunResult v = RunCli({"--version"});
  EXPECT_EQ(v.exit_code, 0) << Describe(v);
  EXPECT_TRUE(v.out.starts_with("tensorferry ")) << v.out;
  for (const char* cmd : {"inspect", "verify", "gen"}) {
    const RunResult h = RunCli({cmd, "--help"});
    EXPECT_EQ(h.exit_code, 0) << Describe(h);
    EXPECT_NE(h.out.find("--json"), std::string::npos) << h.out;
  }
}

// --- load ---------------------------------------------------------------------------------------

std::string JsonString(const std::string& doc, const char* key) {
  simdjson::dom::parser parser;
  simdjson::dom::element e = parser.parse(doc);
  return std::string(std::string_view(e[key]));
}

TEST(CliLoad, ChecksumIndependentOfThreadsBudgetAndOrder) {
  TempDir dir;
  const std::string ckpt = dir.Join("c");
  GenTiny(ckpt, {"--shard-size", "40KB"});
  std::string first;
  for (const std::vector<std::string>& extra : {std::vector<std::string>{},
                                                {"--threads", "1", "--chunk-size", "3000"},
                                                {"--budget", "40KB"},
                                                {"--order", "layer"},
                                                {"--budget", "70KB", "--order", "layer"}}) {
    std::vector<std::string> args = {"load", ckpt, "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    const RunResult r = RunCli(args);
    ASSERT_EQ(r.exit_code, 0) << Describe(r);
    simdjson::dom::parser parser;
    simdjson::dom::element e = parser.parse(r.out);
    EXPECT_EQ(uint64_t(e["tensors"]), kTinyTensors);
    EXPECT_EQ(uint64_t(e["bytes"]), kTinyBytes);
    const uint64_t budget = uint64_t(e["budget"]);
    if (budget) {
      EXPECT_LE(uint64_t(e["peak_budget_bytes"]), budget);
    }
    const std::string sum = JsonString(r.out, "checksum");
    EXPECT_EQ(sum.size(), 16u);
    if (first.empty()) first = sum;
    EXPECT_EQ(sum, first) << "options must not change what is loaded";
  }
  // Another seed gives other bytes, so another checksum.
  const std::string other = dir.Join("o");
  GenTiny(other, {"--seed", "9"});
  const RunResult r = RunCli({"load", other, "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(JsonString(r.out, "checksum"), first);
}

TEST(CliLoad, EveryEngineAndDirectModeGivesTheSameChecksum) {
  TempDir dir;
  const std::string ckpt = dir.Join("c");
  GenTiny(ckpt, {"--shard-size", "40KB"});
  std::string first;
  for (const char* engine : {"auto", "pread", "io_uring", "mmap"}) {
    for (const char* direct : {"off", "on", "auto"}) {
      const RunResult r = RunCli({"load", ckpt, "--json", "--engine", engine, "--direct", direct,
                                  "--populate", "--touch", "--repeat", "2"});
      if (std::string(engine) == "io_uring" && r.exit_code != 0 &&
          r.err.find("io_uring") != std::string::npos) {
        continue;  // the kernel refuses io_uring here; the message says so
      }
      ASSERT_EQ(r.exit_code, 0) << Describe(r);
      const std::string sum = JsonString(r.out, "checksum");
      if (first.empty()) first = sum;
      EXPECT_EQ(sum, first) << engine << " direct " << direct;
      simdjson::dom::parser parser;
      simdjson::dom::element e = parser.parse(r.out);
      EXPECT_EQ(simdjson::dom::array(e["runs_gb_per_s"]).size(), 2u);
      if (std::string(engine) != "auto") {
        EXPECT_EQ(JsonString(r.out, "engine"), engine);
      }
    }
  }
  EXPECT_EQ(RunCli({"load", ckpt, "--engine", "fast"}).exit_code, 2);
  EXPECT_EQ(RunCli({"load", ckpt, "--direct", "maybe"}).exit_code, 2);
}

// Peak resident memory under a budget, measured in a fresh process (VmHWM of the CLI): the
// budget bounds the memory, whatever the checkpoint's size; without one the whole checkpoint is
// resident.
TEST(CliLoad, PeakResidentMemoryStaysWithinTheBudget) {
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "sanitizer shadow memory makes resident memory meaningless";
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
  GTEST_SKIP() << "sanitizer shadow memory makes resident memory meaningless";
#endif
#endif
  TempDir dir;
  const std::string ckpt = dir.Join("c");
  // ~123 MB of tensors in 6 shards (4 layers, hidden 1024, MLP 2816, vocab 8000, BF16).
  const RunResult g = RunCli({"gen", ckpt, "--preset", "tiny", "--layers", "4", "--hidden", "1024",
                              "--intermediate", "2816", "--heads", "8", "--kv-heads", "2",
                              "--vocab", "8000", "--shard-size", "25MB", "--no-sync"});
  ASSERT_EQ(g.exit_code, 0) << Describe(g);
  auto peak_over_start = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"load", ckpt, "--json", "--no-checksum"};
    args.insert(args.end(), extra.begin(), extra.end());
    const RunResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, 0) << Describe(r);
    simdjson::dom::parser parser;
    simdjson::dom::element e = parser.parse(r.out);
    return std::make_pair(uint64_t(e["peak_rss_bytes"]) - uint64_t(e["rss_before_bytes"]),
                          uint64_t(e["bytes"]));
  };
  const auto [unbounded, bytes] = peak_over_start({});
  ASSERT_GT(bytes, 100'000'000u);
  EXPECT_GT(unbounded, bytes * 9 / 10);  // everything was resident at once
  for (const char* engine : {"pread", "io_uring"}) {
    const uint64_t budget = 40'000'000;
    const auto [peak, loaded] = peak_over_start({"--budget", "40MB", "--engine", engine});
    if (loaded == 0) continue;  // io_uring refused by the kernel (exit code checked above)
    EXPECT_EQ(loaded, bytes);
    // The budget plus what the process itself allocates while loading (plan, threads' stacks).
    EXPECT_LE(peak, budget + (16u << 20)) << engine;
  }
}

TEST(CliBench, ReportsReferencesAndEveryEngine) {
  TempDir dir;
  GenTiny(dir.Join("c"));
  const RunResult r =
      RunCli({"bench", dir.Join("c"), "--runs", "1", "--no-cold", "--budget", "64KB", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  simdjson::dom::parser parser;
  simdjson::dom::element e = parser.parse(r.out);
  simdjson::dom::object results = e["results"];
  for (const char* key : {"ref: page-cache copy limit", "ref: page-cache copy, checksummed",
                          "ref: first touch of fresh memory", "ref: 1 thread into fresh memory",
                          "warm, fresh memory: pread", "warm, reused buffers: pread",
                          "warm, zero-copy views, every page touched: mmap",
                          "warm, budget 64KB: auto", "warm, unbounded: auto"}) {
    simdjson::dom::element v;
    ASSERT_EQ(results[key].get(v), simdjson::SUCCESS) << key << " missing in " << r.out;
    EXPECT_GT(double(v["median_gb_per_s"]), 0.0) << key;
  }
  EXPECT_EQ(uint64_t(e["tensors"]), kTinyTensors);
  EXPECT_EQ(RunCli({"bench", dir.Join("c"), "--engines", "warp"}).exit_code, 2);
  // A measured load that fails (here: a budget smaller than a tensor) fails the bench, naming it;
  // it exited 0 with "ok": true and the row missing.
  const RunResult failed =
      RunCli({"bench", dir.Join("c"), "--runs", "1", "--no-cold", "--budget", "100", "--json"});
  EXPECT_EQ(failed.exit_code, 1) << Describe(failed);
  simdjson::dom::element f = parser.parse(failed.out);
  EXPECT_FALSE(bool(f["ok"])) << failed.out;
  const std::string message{std::string_view(f["error"]["message"])};
  EXPECT_NE(message.find("load --engine auto --budget 100: exit 1"), std::string::npos) << message;
}

// The cold runs evict the files and measure the storage with fio: nothing may ever write to the
// checkpoint (fio lays out, i.e. overwrites, files smaller than a --size it is given).
TEST(CliBench, ColdRunsLeaveTheFilesUntouched) {
  TempDir dir;
  GenTiny(dir.Join("c"), {"--shard-size", "40KB"});
  const auto before = DirContents(dir.Join("c"));
  const RunResult r =
      RunCli({"bench", dir.Join("c"), "--runs", "1", "--engines", "pread,mmap", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(DirContents(dir.Join("c")), before);
  simdjson::dom::parser parser;
  simdjson::dom::element e = parser.parse(r.out);
  simdjson::dom::object results = e["results"];
  simdjson::dom::element v;
  EXPECT_EQ(results["cold: pread"].get(v), simdjson::SUCCESS) << r.out;
  EXPECT_EQ(results["cold: mmap"].get(v), simdjson::SUCCESS) << r.out;
}

TEST(CliLoad, TextExplainAndLayers) {
  TempDir dir;
  GenTiny(dir.Join("c"));
  RunResult r = RunCli({"load", dir.Join("c"), "--explain", "--layers", "1"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("batch"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("loaded 9 tensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("GB/s"), std::string::npos) << r.out;
}

TEST(CliLoad, Errors) {
  TempDir dir;
  GenTiny(dir.Join("c"));
  EXPECT_EQ(RunCli({"load", dir.Join("c"), "--budget", "lots"}).exit_code, 2);
  EXPECT_EQ(RunCli({"load", dir.Join("c"), "--order", "random"}).exit_code, 2);
  // A tensor larger than the budget: one error line, unless allowed.
  ExpectOneLineError(RunCli({"load", dir.Join("c"), "--budget", "1KB"}));
  EXPECT_EQ(RunCli({"load", dir.Join("c"), "--budget", "1KB", "--allow-oversized"}).exit_code, 0);
  ExpectOneLineError(RunCli({"load", dir.Join("missing")}));
}

// --memory-limit without --budget: the load streams under a budget of the limit and says so;
// --drop-cache is accepted (its effect is tested in loader_test.cc).
TEST(CliLoad, MemoryLimitStreamsUnderABudgetOfIt) {
  TempDir dir;
  GenTiny(dir.Join("c"));
  const RunResult whole = RunCli({"load", dir.Join("c"), "--engine", "pread"});
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const RunResult bounded = RunCli(
      {"load", dir.Join("c"), "--engine", "pread", "--memory-limit", "4KiB", "--drop-cache"});
  ASSERT_EQ(bounded.exit_code, 0) << bounded.err;
  EXPECT_NE(bounded.out.find("of a budget of 4.10 KB (the memory_limit option)"), std::string::npos)
      << bounded.out;
  const auto checksum = [](const std::string& out) { return out.substr(out.rfind("checksum")); };
  EXPECT_EQ(checksum(bounded.out), checksum(whole.out));
  const RunResult off = RunCli({"load", dir.Join("c"), "--memory-limit", "off", "--json"});
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_NE(off.out.find("\"memory_budget\":\"\""), std::string::npos) << off.out;
  const RunResult bad = RunCli({"load", dir.Join("c"), "--memory-limit", "lots"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--memory-limit: memory_limit = lots is not a size"), std::string::npos)
      << bad.err;
}

// Every flag goes through LoadOptions::Set: the message names the flag, the key and the value,
// as the environment's names the variable (docs/runtime_settings.md, "One options layer").
TEST(CliLoad, OptionErrorsNameTheFlagAndTheValue) {
  TempDir dir;
  GenTiny(dir.Join("c"));
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--budget", "lots"}, "--budget: budget = lots is not a size"},
      {{"--order", "random"}, "--order: order = random: unknown order"},
      {{"--queue-depth", "0"}, "--queue-depth: queue_depth = 0 must be > 0"},
      {{"--max-gap", "1MB"}, "tp_rank and tp_size go together"},
      {{"--tp-rank", "2", "--tp-size", "2"}, "tp_rank 2 is not below tp_size 2"}};
  for (const auto& [flags, words] : cases) {
    std::vector<std::string> args = {"load", dir.Join("c")};
    args.insert(args.end(), flags.begin(), flags.end());
    const RunResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << words;
    EXPECT_NE(r.err.find(words), std::string::npos) << r.err;
  }
  // The environment's value is not the command line's: exit 1 (CliExitCodes below).
  const RunResult env = RunCli({"load", dir.Join("c")}, {{"TENSORFERRY_THREADS", "x"}});
  EXPECT_EQ(env.exit_code, 1) << Describe(env);
  EXPECT_NE(env.err.find("TENSORFERRY_THREADS=\"x\": threads = x is not a count"),
            std::string::npos)
      << env.err;
}

// --- exit codes: one rule for every command (commands.h, README "The CLI") ---------------------

// An invalid TENSORFERRY_* variable exits 1 in every command that reads it, with the same one
// line (the variable and its value, no path in front) or, with --json, the error document; the
// same invalid value given as a flag is a usage error (2, stderr only).
TEST(CliExitCodes, AnInvalidEnvironmentVariableExitsOneInEveryCommand) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir);
  // A URL makes inspect, verify, checksum and reshard read the environment; it fails before any
  // request is sent (nothing listens on port 9 of this host anyway).
  const std::string url = "http://127.0.0.1:9/m/model.safetensors";
  for (const auto& [variable, value] : std::vector<std::pair<std::string, std::string>>{
           {"TENSORFERRY_BUDGET", "lots"}, {"TENSORFERRY_OBJECT_CONCURRENCY", "many"}}) {
    const std::string words = variable + "=\"" + value + "\": ";
    const std::map<std::string, std::optional<std::string>> env = {{variable, value}};
    for (const auto& args : std::vector<std::vector<std::string>>{
             {"load", dir},
             {"bench", dir, "--runs", "1", "--no-cold"},
             {"inspect", url},
             {"verify", url},
             {"checksum", url},
             {"reshard", url, t.Join("out"), "--tp", "2", "--no-sync"}}) {
      const RunResult r = RunCli(args, env);
      ExpectOneLineError(r);
      EXPECT_TRUE(r.err.starts_with("error: " + words)) << args[0] << ": " << r.err;
      std::vector<std::string> json = args;
      json.push_back("--json");
      const RunResult j = RunCli(json, env);
      EXPECT_EQ(j.exit_code, 1) << Describe(j);
      EXPECT_EQ(j.err, "") << Describe(j);
      simdjson::dom::parser parser;
      simdjson::dom::element doc;
      ASSERT_EQ(parser.parse(simdjson::padded_string(j.out)).get(doc), simdjson::SUCCESS)
          << args[0] << ": " << j.out;
      EXPECT_FALSE(bool(doc["ok"])) << args[0];
      EXPECT_EQ(std::string_view(doc["error"]["code"]), "invalid_argument") << j.out;
      EXPECT_TRUE(std::string_view(doc["error"]["message"]).starts_with(words)) << j.out;
    }
    EXPECT_FALSE(fs::exists(t.Join("out")));
    // doctor reports it as what loads would fail on, and exits 0: its report is the result.
    const RunResult doctor = RunCli({"doctor", "--quick"}, env);
    EXPECT_EQ(doctor.exit_code, 0) << Describe(doctor);
    EXPECT_NE(doctor.out.find("loads fail: " + words), std::string::npos) << doctor.out;
    const RunResult doctor_json = RunCli({"doctor", "--quick", "--json"}, env);
    EXPECT_EQ(doctor_json.exit_code, 0) << Describe(doctor_json);
    simdjson::dom::parser parser;
    simdjson::dom::element doc;
    ASSERT_EQ(parser.parse(simdjson::padded_string(doctor_json.out)).get(doc), simdjson::SUCCESS)
        << doctor_json.out;
    EXPECT_TRUE(bool(doc["ok"])) << doctor_json.out;  // as every --json document
  }
  // The same value as a flag: the command line is wrong.
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"load", dir, "--budget", "lots", "--json"},
           {"bench", dir, "--budget", "lots", "--json"},
           {"load", url, "--object-concurrency", "many", "--json"}}) {
    const RunResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << Describe(r);
    EXPECT_EQ(r.out, "") << Describe(r);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << Describe(r);
  }
}

// Settings that contradict each other: the environment's when the variables alone do (1), the
// command line's when a flag makes them (2); a flag overrides the variable it names.
TEST(CliExitCodes, ContradictionsAreTheirSourcesFault) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir);
  const std::map<std::string, std::optional<std::string>> env = {{"TENSORFERRY_ENGINE", "mmap"},
                                                                 {"TENSORFERRY_DROP_CACHE", "1"}};
  const RunResult alone = RunCli({"load", dir}, env);
  ExpectOneLineError(alone);
  EXPECT_TRUE(alone.err.starts_with(
      "error: TENSORFERRY_* environment variables: drop_cache does not go with engine mmap"))
      << alone.err;
  // bench, whose loads all start from those variables, says so before it measures anything.
  const RunResult bench = RunCli({"bench", dir, "--runs", "1", "--no-cold", "--json"}, env);
  EXPECT_EQ(bench.exit_code, 1) << Describe(bench);
  EXPECT_NE(bench.out.find("TENSORFERRY_* environment variables: drop_cache does not go with "
                           "engine mmap"),
            std::string::npos)
      << Describe(bench);
  const RunResult overridden = RunCli({"load", dir, "--engine", "pread"}, env);
  EXPECT_EQ(overridden.exit_code, 0) << Describe(overridden);
  // A switch turned off over its variable ("--drop-cache=false" was dropped: the mmap load
  // stayed refused).
  const RunResult off = RunCli({"load", dir, "--drop-cache=false"}, env);
  EXPECT_EQ(off.exit_code, 0) << Describe(off);
  // Overridden, but the flags contradict each other: theirs.
  const RunResult flags =
      RunCli({"load", dir, "--engine", "pread", "--tp-rank", "2", "--tp-size", "2"}, env);
  EXPECT_EQ(flags.exit_code, 2) << Describe(flags);
  EXPECT_NE(flags.err.find("tp_rank 2 is not below tp_size 2"), std::string::npos) << flags.err;
  const RunResult flag = RunCli({"load", dir, "--drop-cache"}, {{"TENSORFERRY_ENGINE", "mmap"}});
  EXPECT_EQ(flag.exit_code, 2) << Describe(flag);
  EXPECT_NE(flag.err.find("drop_cache does not go with engine mmap"), std::string::npos)
      << flag.err;
}

// --- tensor parallelism: load --tp-*, reshard
// -----------------------------------------------------

std::map<std::string, std::pair<std::vector<uint64_t>, std::string>> LoadAll(
    const std::string& path, std::optional<TensorParallelOptions> tp = std::nullopt) {
  LoadOptions o;
  o.engine = Engine::kPread;
  o.tensor_parallel = std::move(tp);
  auto loader = Loader::Open(path, o);
  EXPECT_TRUE(loader.ok()) << loader.status().ToString();
  std::map<std::string, std::pair<std::vector<uint64_t>, std::string>> out;
  if (!loader.ok()) return out;
  auto tensors = (*loader)->Load();
  EXPECT_TRUE(tensors.ok()) << tensors.status().ToString();
  if (!tensors.ok()) return out;
  for (const Tensor& t : *tensors) {
    out[t.name()] = {t.shape(), std::string(reinterpret_cast<const char*>(t.data()), t.size())};
  }
  return out;
}

TEST(CliReshard, EachRankEqualsTheSlicedLoad) {
  TempDir dir;
  GenTiny(dir.Join("src"));
  const std::string dst = dir.Join("tp3");
  RunResult r = RunCli(
      {"reshard", dir.Join("src"), dst, "--tp", "3", "--max-shard-size", "64KB", "--no-sync"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("3 ranks"), std::string::npos) << r.out;
  for (uint32_t rank = 0; rank < 3; ++rank) {
    const std::string rank_dir = dst + "/rank-0000" + std::to_string(rank) + "-of-00003";
    ASSERT_TRUE(fs::exists(rank_dir + "/model.safetensors.index.json")) << rank_dir;
    EXPECT_EQ(RunCli({"verify", rank_dir}).exit_code, 0) << rank_dir;
    const auto resharded = LoadAll(rank_dir);
    const auto sliced =
        LoadAll(dir.Join("src"), TensorParallelOptions{ShardSpec::Builtin(), rank, 3, 0});
    ASSERT_EQ(resharded.size(), sliced.size());
    for (const auto& [name, value] : sliced) {
      auto it = resharded.find(name);
      ASSERT_NE(it, resharded.end()) << name;
      EXPECT_EQ(it->second.first, value.first) << name;
      EXPECT_TRUE(it->second.second == value.second) << name << " rank " << rank;
    }
    auto ckpt = Checkpoint::Open(rank_dir).value();
    bool has_rank = false;
    for (const auto& [k, v] : ckpt->files()[0].metadata) {
      if (k == "tensorferry.tp_rank") has_rank = v == std::to_string(rank);
    }
    EXPECT_TRUE(has_rank);
  }
  EXPECT_FALSE(fs::exists(dst + "/.rank-00000-of-00003.partial"));
  // Never overwritten, and refused before anything is written.
  ExpectOneLineError(RunCli({"reshard", dir.Join("src"), dst, "--tp", "3", "--no-sync"}));
  fs::create_directories(dir.Join("other/rank-00002-of-00003"));
  ExpectOneLineError(
      RunCli({"reshard", dir.Join("src"), dir.Join("other"), "--tp", "3", "--no-sync"}));
  EXPECT_FALSE(fs::exists(dir.Join("other/rank-00000-of-00003")));
  // --max-shard-size alone: the same tensors in more files.
  const std::string split = dir.Join("split");
  r = RunCli({"reshard", dir.Join("src"), split, "--max-shard-size", "16KB", "--no-sync"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(RunCli({"verify", split}).exit_code, 0);
  EXPECT_GT(Checkpoint::Open(split).value()->files().size(),
            Checkpoint::Open(dir.Join("src")).value()->files().size());
  EXPECT_TRUE(LoadAll(split) == LoadAll(dir.Join("src")));
  EXPECT_EQ(RunCli({"reshard", dir.Join("src"), dir.Join("x")}).exit_code, 2);
  // Rules without --tp would be ignored (a plain re-split slices nothing): a usage error, and
  // nothing written.
  testing::WriteBytes(dir.Join("rules.json"), R"({"overrides":{}})");
  r = RunCli({"reshard", dir.Join("src"), dir.Join("y"), "--max-shard-size", "16KB", "--rules",
              dir.Join("rules.json"), "--no-sync"});
  EXPECT_EQ(r.exit_code, 2) << Describe(r);
  EXPECT_NE(r.err.find("--tp"), std::string::npos) << Describe(r);
  EXPECT_FALSE(fs::exists(dir.Join("y")));
  // Nor with --tp 0 (no tensor parallelism: it was accepted, and the rules ignored).
  r = RunCli({"reshard", dir.Join("src"), dir.Join("y"), "--tp", "0", "--max-shard-size", "16KB",
              "--rules", dir.Join("rules.json"), "--no-sync"});
  EXPECT_EQ(r.exit_code, 2) << Describe(r);
  EXPECT_NE(r.err.find("--rules needs --tp of at least 1"), std::string::npos) << Describe(r);
  EXPECT_FALSE(fs::exists(dir.Join("y")));
}

// Writes `tensors` as DIR/src/model.safetensors (no checksums) and the rules `json` as
// DIR/rules.json, then reshards the source `world` ways with those rules into DIR/<name>.
RunResult ReshardWithRules(const TempDir& dir, const std::vector<TensorToWrite>& tensors,
                           const std::string& json, uint32_t world, const std::string& name) {
  WriteOptions plain;
  plain.checksums = false;
  fs::create_directories(dir.Join("src"));
  EXPECT_TRUE(WriteFile(dir.Join("src/model.safetensors"), tensors, {}, plain).ok());
  testing::WriteBytes(dir.Join("rules.json"), json);
  return RunCli({"reshard", dir.Join("src"), dir.Join(name), "--tp", std::to_string(world),
                 "--rules", dir.Join("rules.json"), "--no-sync"});
}

// Rank `rank`'s folder of a reshard into `dst` for `world` ranks.
std::string RankDir(const std::string& dst, uint32_t rank, uint32_t world) {
  char name[40];
  std::snprintf(name, sizeof name, "/rank-%05u-of-%05u", rank, world);
  return dst + name;
}

// Found by a review: the rows of a dim-1 slice were read together with the other ranks' rows
// between them without bound (a split over W ranks read W times the writer's buffer at once).
// Now one read spans at most max(the writer's piece, 1 MiB): a 2 MiB tensor split 8 ways on dim 1
// (64-byte rows, 448-byte gaps) takes two reads per rank, and every rank's bytes are still the
// sliced load's.
TEST(CliReshard, AStridedSliceIsReadInBoundedSpans) {
  TempDir dir;
  std::vector<std::byte> w(4096 * 128 * 4);
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::byte(static_cast<uint8_t>(i * 7 + (i >> 11)));
  const std::string json = R"({"overrides":{"w":{"split":1}}})";
  RunResult r =
      ReshardWithRules(dir, {{"w", DType::kF32, {4096, 128}, w, nullptr}}, json, 8, "tp8");
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  const ShardSpec spec = ShardSpec::FromJson(json).value();
  for (uint32_t rank = 0; rank < 8; ++rank) {
    const auto resharded = LoadAll(RankDir(dir.Join("tp8"), rank, 8));
    const auto sliced = LoadAll(dir.Join("src"), TensorParallelOptions{spec, rank, 8, 0});
    ASSERT_EQ(resharded.size(), 1u);
    EXPECT_EQ(resharded.at("w").first, (std::vector<uint64_t>{4096, 16}));
    EXPECT_TRUE(resharded == sliced) << "rank " << rank;
  }
#ifndef TF_UNDER_SANITIZER  // (the sanitizers' own memory would hide the bound)
  // The memory: 64 MiB split 32 ways on dim 1 (4-byte rows, 124-byte gaps). Each rank's 2 MiB
  // came from one read of the whole tensor (peak RSS about 90 MB); now from reads of at most
  // 2 MiB (about 25 MB). This test process's children are this test's CLI runs only.
  // (Generated in pieces: a spawned child's peak RSS counts this process's peak before its exec.)
  TensorToWrite wide{"w", DType::kF16, {524288, 64}, {}, nullptr};
  wide.generate = [](uint64_t offset, std::span<std::byte> out) {
    for (size_t i = 0; i < out.size(); ++i) {
      out[i] = std::byte(static_cast<uint8_t>((offset + i) * 13));
    }
    return Status::Ok();
  };
  WriteOptions plain;
  plain.checksums = false;
  fs::create_directories(dir.Join("wide"));
  ASSERT_TRUE(WriteFile(dir.Join("wide/model.safetensors"), std::span(&wide, 1), {}, plain).ok());
  r = RunCli({"reshard", dir.Join("wide"), dir.Join("tp32"), "--tp", "32", "--rules",
              dir.Join("rules.json"), "--no-sync", "--no-verify"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  struct rusage children {};
  ASSERT_EQ(getrusage(RUSAGE_CHILDREN, &children), 0);
  EXPECT_LT(children.ru_maxrss, 48 << 10) << "KiB of peak RSS in reshard --tp 32";
#endif
}

// Found by a review: reshard sliced each tensor by its own rule and ignored the rules' ties, so a
// rank folder's tied alias held other bytes than a sliced load gives, and ties the loader refuses
// were written anyway.
TEST(CliReshard, TiesAreResolvedAsTheLoaderResolvesThem) {
  TempDir dir;
  std::vector<std::byte> emb(8 * 4 * 4), head(8 * 4 * 4), other(6 * 4 * 4);
  for (size_t i = 0; i < emb.size(); ++i) emb[i] = std::byte(static_cast<uint8_t>(i * 3 + 1));
  for (size_t i = 0; i < head.size(); ++i) head[i] = std::byte(static_cast<uint8_t>(i * 5 + 2));
  for (size_t i = 0; i < other.size(); ++i) other[i] = std::byte(static_cast<uint8_t>(i + 9));
  const std::vector<TensorToWrite> tensors = {{"emb", DType::kF32, {8, 4}, emb, nullptr},
                                              {"head", DType::kF32, {8, 4}, head, nullptr},
                                              {"other", DType::kF32, {6, 4}, other, nullptr}};
  const std::string json = R"({"overrides":{"emb":{"split":0}},"ties":{"head":"emb"}})";
  RunResult r = ReshardWithRules(dir, tensors, json, 2, "tp2");
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  const ShardSpec spec = ShardSpec::FromJson(json).value();
  for (uint32_t rank = 0; rank < 2; ++rank) {
    const auto resharded = LoadAll(RankDir(dir.Join("tp2"), rank, 2));
    const auto sliced = LoadAll(dir.Join("src"), TensorParallelOptions{spec, rank, 2, 0});
    ASSERT_EQ(resharded.size(), 3u);
    EXPECT_TRUE(resharded == sliced) << "rank " << rank;
    EXPECT_TRUE(resharded.at("head") == resharded.at("emb")) << "rank " << rank;
  }
  // A tie the loader refuses (its target is not in the checkpoint): refused here too.
  testing::WriteBytes(dir.Join("bad.json"), R"({"ties":{"head":"missing"}})");
  r = RunCli({"reshard", dir.Join("src"), dir.Join("bad"), "--tp", "2", "--rules",
              dir.Join("bad.json"), "--no-sync"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_NE(r.err.find("missing"), std::string::npos) << Describe(r);
}

// Found by a review: --tp 1 wrote each tensor as it is, ignoring the rules' ties (a tied alias
// kept its own bytes, and a tie to a missing tensor was written anyway), while --tp 2 applied
// them. One rank is still tensor parallelism: the rules apply; only a plain re-split (no --tp)
// ignores them.
TEST(CliReshard, OneRankAppliesTheRulesTies) {
  TempDir dir;
  std::vector<std::byte> emb(8 * 4 * 4), head(8 * 4 * 4);
  for (size_t i = 0; i < emb.size(); ++i) emb[i] = std::byte(static_cast<uint8_t>(i * 3 + 1));
  for (size_t i = 0; i < head.size(); ++i) head[i] = std::byte(static_cast<uint8_t>(i * 5 + 2));
  WriteOptions plain;
  plain.checksums = false;
  const std::vector<TensorToWrite> tensors = {{"emb", DType::kF32, {8, 4}, emb, nullptr},
                                              {"head", DType::kF32, {8, 4}, head, nullptr}};
  fs::create_directories(dir.Join("src"));
  ASSERT_TRUE(WriteFile(dir.Join("src/model.safetensors"), tensors, {}, plain).ok());
  const std::string json = R"({"ties":{"head":"emb"}})";
  testing::WriteBytes(dir.Join("rules.json"), json);
  RunResult r = RunCli({"reshard", dir.Join("src"), dir.Join("tp1"), "--tp", "1", "--rules",
                        dir.Join("rules.json"), "--no-sync"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  const ShardSpec spec = ShardSpec::FromJson(json).value();
  const auto resharded = LoadAll(dir.Join("tp1/rank-00000-of-00001"));
  ASSERT_EQ(resharded.size(), 2u);
  EXPECT_TRUE(resharded == LoadAll(dir.Join("src"), TensorParallelOptions{spec, 0, 1, 0}));
  EXPECT_TRUE(resharded.at("head") == resharded.at("emb"));
  // A plain re-split (no --tp) writes every tensor as it is: head keeps its own bytes.
  // (--rules needs --tp: CliReshard.EachRankEqualsTheSlicedLoad.)
  r = RunCli(
      {"reshard", dir.Join("src"), dir.Join("split"), "--max-shard-size", "1MB", "--no-sync"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  const auto split = LoadAll(dir.Join("split"));
  EXPECT_TRUE(split == LoadAll(dir.Join("src")));
  EXPECT_FALSE(split.at("head") == split.at("emb"));
  // A tie the loader refuses is refused with one rank too.
  testing::WriteBytes(dir.Join("bad.json"), R"({"ties":{"head":"missing"}})");
  r = RunCli({"reshard", dir.Join("src"), dir.Join("bad"), "--tp", "1", "--rules",
              dir.Join("bad.json"), "--no-sync"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_NE(r.err.find("missing"), std::string::npos) << Describe(r);
  EXPECT_FALSE(fs::exists(dir.Join("bad/rank-00000-of-00001")));
}

// The .safetensors files of `dir` by name, with their sizes.
std::vector<std::pair<std::string, uint64_t>> ShardSizes(const std::string& dir) {
  std::vector<std::pair<std::string, uint64_t>> out;
  for (const std::string& path : Shards(dir)) {
    out.emplace_back(fs::path(path).filename().string(), fs::file_size(path));
  }
  return out;
}

// Checks reshard's --json document against what is on disk.
void ExpectReshardReport(const RunResult& r, const std::string& src, const std::string& dst,
                         uint64_t tp_size, uint64_t max_shard_size) {
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.err, "") << Describe(r);
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(simdjson::padded_string(r.out)).get(doc), simdjson::SUCCESS) << r.out;
  EXPECT_TRUE(bool(doc["ok"]));
  EXPECT_EQ(std::string_view(doc["src"]), src);
  EXPECT_EQ(std::string_view(doc["dst"]), dst);
  EXPECT_EQ(uint64_t(doc["tp_size"]), tp_size);
  EXPECT_EQ(uint64_t(doc["tensors"]), kTinyTensors);
  EXPECT_EQ(uint64_t(doc["max_shard_size"]), max_shard_size);
  EXPECT_TRUE(bool(doc["source_checksums_checked"]));
  EXPECT_GE(double(doc["seconds"]), 0.0);
  simdjson::dom::array ranks = doc["ranks"];
  ASSERT_EQ(ranks.size(), tp_size);
  uint64_t rank = 0, total = 0;
  for (simdjson::dom::element entry : ranks) {
    const std::string rank_dir{std::string_view(entry["dir"])};
    EXPECT_EQ(uint64_t(entry["rank"]), rank);
    EXPECT_EQ(rank_dir, tp_size > 1 ? dst + "/rank-0000" + std::to_string(rank) + "-of-0000" +
                                          std::to_string(tp_size)
                                    : dst);
    std::vector<std::pair<std::string, uint64_t>> files;
    uint64_t bytes = 0;
    for (simdjson::dom::element f : entry["files"].get_array()) {
      files.emplace_back(std::string_view(f["name"]), uint64_t(f["bytes"]));
      bytes += files.back().second;
    }
    std::sort(files.begin(), files.end());
    EXPECT_EQ(files, ShardSizes(rank_dir)) << rank_dir;
    EXPECT_EQ(uint64_t(entry["bytes"]), bytes);
    EXPECT_TRUE(fs::is_regular_file(rank_dir + "/" + std::string(std::string_view(entry["index"]))))
        << rank_dir;
    EXPECT_EQ(uint64_t(entry["tensors"]), Checkpoint::Open(rank_dir).value()->tensors().size());
    EXPECT_EQ(RunCli({"verify", rank_dir}).exit_code, 0) << rank_dir;
    total += bytes;
    ++rank;
  }
  EXPECT_EQ(uint64_t(doc["bytes"]), total);
}

TEST(CliReshard, JsonReportsWhatIsOnDisk) {
  TempDir t;
  const std::string src = t.Join("src");
  GenTiny(src);
  const std::string tp = t.Join("tp2");
  const RunResult r =
      RunCli({"reshard", src, tp, "--tp", "2", "--max-shard-size", "40KB", "--no-sync", "--json"});
  ExpectReshardReport(r, src, tp, 2, 40'000);
  // Without --tp: the one re-split checkpoint is rank 0, in DST itself.
  const std::string split = t.Join("split");
  const RunResult s =
      RunCli({"reshard", src, split, "--max-shard-size", "16KB", "--no-sync", "--json"});
  ExpectReshardReport(s, src, split, 1, 16'000);
  EXPECT_GT(Shards(split).size(), 1u);
  // Without --json: the one line, as before.
  const RunResult text =
      RunCli({"reshard", src, t.Join("text"), "--max-shard-size", "16KB", "--no-sync"});
  ASSERT_EQ(text.exit_code, 0) << Describe(text);
  EXPECT_TRUE(text.out.starts_with("resharded " + std::to_string(kTinyTensors) + " tensors of " +
                                   src + " into " + t.Join("text") + ": "))
      << text.out;
}

// Reshards into one destination at once: one writes it, the others are refused (the destination
// is held, or its ranks exist once the first is done) without touching what the first wrote.
TEST(CliReshard, ConcurrentReshardsIntoOneDestination) {
  TempDir t;
  const std::string src = t.Join("src");
  GenTiny(src);
  const std::string dst = t.Join("out");
  constexpr int kRuns = 3;
  std::vector<RunResult> runs(kRuns);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRuns; ++i) {
    threads.emplace_back([&, i] {
      runs[i] = RunCli({"reshard", src, dst, "--tp", "2", "--max-shard-size", "16KB", "--no-sync"});
    });
  }
  for (std::thread& th : threads) th.join();
  int ok = 0;
  for (const RunResult& r : runs) {
    if (r.exit_code == 0) {
      ++ok;
      continue;
    }
    EXPECT_EQ(r.exit_code, 1) << Describe(r);
    EXPECT_TRUE(r.err.find("another writer is writing this directory") != std::string::npos ||
                r.err.find("already exists; not overwritten") != std::string::npos)
        << Describe(r);
  }
  EXPECT_EQ(ok, 1);
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(dst)) entries.push_back(e.path().filename());
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries, (std::vector<std::string>{"rank-00000-of-00002", "rank-00001-of-00002"}));
  for (const std::string& rank : entries) {
    const RunResult v = RunCli({"verify", dst + "/" + rank});
    EXPECT_EQ(v.exit_code, 0) << Describe(v);
  }
}

// A failure is the document every --json command answers with (convert's, naming src and dst);
// nothing is left behind. A usage error stays on stderr.
TEST(CliReshard, JsonErrors) {
  TempDir t;
  const std::string src = t.Join("src");
  GenTiny(src);
  fs::create_directories(t.Join("out/rank-00001-of-00002"));
  const RunResult r = RunCli({"reshard", src, t.Join("out"), "--tp", "2", "--no-sync", "--json"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_EQ(r.err, "") << Describe(r);
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  ASSERT_EQ(parser.parse(simdjson::padded_string(r.out)).get(doc), simdjson::SUCCESS) << r.out;
  EXPECT_FALSE(bool(doc["ok"]));
  EXPECT_EQ(std::string_view(doc["src"]), src);
  EXPECT_EQ(std::string_view(doc["dst"]), t.Join("out"));
  EXPECT_EQ(std::string_view(doc["error"]["code"]), "invalid_argument");
  EXPECT_EQ(std::string_view(doc["error"]["message"]),
            t.Join("out/rank-00001-of-00002") + ": already exists; not overwritten");
  EXPECT_FALSE(fs::exists(t.Join("out/rank-00000-of-00002")));
  // The same failure without --json: the same message as one line.
  const RunResult line = RunCli({"reshard", src, t.Join("out"), "--tp", "2", "--no-sync"});
  ExpectOneLineError(line);
  EXPECT_EQ(line.err,
            "error: " + t.Join("out/rank-00001-of-00002") + ": already exists; not overwritten\n");
  // A missing source: not_found, about the source.
  const RunResult missing =
      RunCli({"reshard", t.Join("missing"), t.Join("x"), "--tp", "2", "--no-sync", "--json"});
  EXPECT_EQ(missing.exit_code, 1) << Describe(missing);
  ASSERT_EQ(parser.parse(simdjson::padded_string(missing.out)).get(doc), simdjson::SUCCESS)
      << missing.out;
  EXPECT_EQ(std::string_view(doc["error"]["category"]), "not_found") << missing.out;
  EXPECT_TRUE(std::string_view(doc["error"]["message"]).starts_with(t.Join("missing")))
      << missing.out;
  EXPECT_FALSE(fs::exists(t.Join("x")));
  // Usage errors: exit 2, stderr only.
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"reshard", src, t.Join("y"), "--json"},
           {"reshard", src, t.Join("y"), "--max-shard-size", "big", "--json"},
           {"reshard", src, t.Join("y"), "--tp", "2", "--rules", t.Join("no-rules.json"),
            "--json"}}) {
    const RunResult u = RunCli(args);
    EXPECT_EQ(u.exit_code, 2) << Describe(u);
    EXPECT_EQ(u.out, "") << Describe(u);
    EXPECT_TRUE(u.err.starts_with("error: ")) << Describe(u);
  }
  EXPECT_FALSE(fs::exists(t.Join("y")));
}

TEST(CliReshard, RefusesToWriteOverItsOwnSource) {
  TempDir dir;
  const std::string src = dir.Join("src");
  GenTiny(src);
  fs::create_symlink(src, dir.Join("link"));
  fs::create_directories(dir.Join("sub"));
  // A link elsewhere to one of its files: the write moved that file aside and removed it.
  fs::create_directories(dir.Join("other"));
  fs::create_symlink("../src/model.safetensors", dir.Join("other/link.safetensors"));
  const auto before = DirContents(src);
  // The same directory by any path: itself, a symlink, a ".." detour; and a source given as its
  // index file or one of its files, or a link to one of them.
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {src, src},
           {src, dir.Join("link")},
           {src, dir.Join("sub/../src")},
           {src + "/model.safetensors.index.json", src},
           {dir.Join("link"), src},
           {dir.Join("other/link.safetensors"), src}}) {
    const RunResult r = RunCli({"reshard", from, to, "--max-shard-size", "100KB", "--no-sync"});
    ExpectOneLineError(r);
    EXPECT_NE(r.err.find("source"), std::string::npos) << Describe(r);
    EXPECT_EQ(DirContents(src), before) << from << " -> " << to;
  }
  // An error about the output names the output, not the source.
  fs::create_directories(dir.Join("out/model.safetensors"));
  const RunResult r =
      RunCli({"reshard", src, dir.Join("out"), "--max-shard-size", "100KB", "--no-sync"});
  ExpectOneLineError(r);
  EXPECT_EQ(r.err.rfind("error: " + dir.Join("out/model.safetensors") + ": is a directory", 0), 0u)
      << r.err;
}

TEST(CliGen, RewritingADirectoryRemovesTheOlderLayout) {
  TempDir dir;
  const std::string out = dir.Join("m");
  GenTiny(out, {"--shard-size", "40KB"});
  ASSERT_GE(Shards(out).size(), 3u);
  WriteBytes(out + "/README.md", "mine");
  GenTiny(out);  // one shard now
  std::vector<std::string> names;
  for (const auto& [name, bytes] : DirContents(out)) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"README.md", "model.safetensors",
                                             "model.safetensors.index.json"}));
  EXPECT_EQ(RunCli({"verify", out}).exit_code, 0);
}

// Starts the CLI with `args` (output discarded) and returns its pid.
pid_t SpawnCli(const std::vector<std::string>& args) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  std::vector<std::string> argv_storage = {TENSORFERRY_CLI_PATH};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(rc, 0) << std::strerror(rc);
  return rc == 0 ? pid : -1;
}

// Runs `gen` of ~0.5 GB in 100 MB shards into `out`, sends `sig` as soon as its first temporary
// file appears there (and `then` right after it, unless 0: as `timeout` signals the child, then
// its process group), and checks it died of `sig` (or `then`).
void InterruptGenAtItsFirstTemporary(const std::string& out, int sig, int then = 0) {
  const pid_t pid = SpawnCli({"gen", out, "--preset", "small", "--shard-size", "100MB"});
  ASSERT_GT(pid, 0);
  bool seen = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!seen && std::chrono::steady_clock::now() < deadline) {
    std::error_code ec;  // `out` may not exist yet
    for (fs::directory_iterator it(out, ec), end; !ec && it != end; it.increment(ec)) {
      seen = seen || it->path().filename().string().find(".tmp-") != std::string::npos;
    }
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(seen) << "no temporary file appeared";
  ASSERT_EQ(kill(pid, sig), 0);
  if (then != 0) {
    ASSERT_EQ(kill(pid, then), 0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exited with " << WEXITSTATUS(status);
  // (Two signals pending at once are delivered lowest first: either may be the one handled.)
  if (WTERMSIG(status) != then) {
    EXPECT_EQ(WTERMSIG(status), sig);
  }
}

TEST(CliGen, InterruptedWriteRemovesItsFilesAndDiesOfTheSignal) {
  for (int sig : {SIGINT, SIGTERM}) {
    TempDir dir;
    const std::string out = dir.Join("m");
    GenTiny(out, {"--shard-size", "40KB"});  // an older checkpoint that must survive
    const auto before = DirContents(out);
    InterruptGenAtItsFirstTemporary(out, sig);
    if (::testing::Test::HasFatalFailure()) return;
    // No temporary, no new shard, no backup: exactly the older checkpoint.
    EXPECT_EQ(DirContents(out), before) << strsignal(sig);
  }
}

// A second signal while the first one's cleanup runs (on the same thread or another) waits for
// it instead of ending the process half way: nothing is left either.
TEST(CliGen, SignalledTwiceRemovesItsFilesAndDiesOfASignal) {
  for (const auto& [sig, then] :
       {std::pair{SIGTERM, SIGTERM}, std::pair{SIGINT, SIGTERM}, std::pair{SIGTERM, SIGINT}}) {
    TempDir dir;
    const std::string out = dir.Join("m");
    GenTiny(out, {"--shard-size", "40KB"});
    const auto before = DirContents(out);
    InterruptGenAtItsFirstTemporary(out, sig, then);
    if (::testing::Test::HasFatalFailure()) return;
    EXPECT_EQ(DirContents(out), before) << strsignal(sig) << " then " << strsignal(then);
  }
}

// A folder the interrupted write created goes with its files (reshard --tp's hidden
// .rank-*.partial folders too).
TEST(CliGen, InterruptedWriteIntoANewFolderRemovesIt) {
  TempDir dir;
  const std::string out = dir.Join("new");
  InterruptGenAtItsFirstTemporary(out, SIGINT);
  EXPECT_FALSE(fs::exists(out)) << DirContents(out).size() << " entries left";
}

// The rank folders of reshard --tp are one unit: interrupted after the first is complete, none
// stays, nor the folders the command created for them; a rerun starts clean.
TEST(CliReshard, InterruptedAfterARankRemovesEveryRankAndTheFoldersItMade) {
  TempDir dir;
  const std::string src = dir.Join("src");
  const RunResult g = RunCli({"gen", src, "--preset", "small", "--no-sync"});
  ASSERT_EQ(g.exit_code, 0) << Describe(g);
  const std::string dst = dir.Join("out/tp4");
  const pid_t pid = SpawnCli({"reshard", src, dst, "--tp", "4", "--no-sync"});
  ASSERT_GT(pid, 0);
  const std::string first = dst + "/rank-00000-of-00004";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(first) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(fs::exists(first)) << "the first rank never appeared";
  ASSERT_EQ(kill(pid, SIGINT), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exited with " << WEXITSTATUS(status);
  EXPECT_FALSE(fs::exists(dir.Join("out"))) << DirContents(dir.Join("out")).size();
  const RunResult r = RunCli({"reshard", src, dst, "--tp", "2", "--no-sync"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
}

// A reshard --tp killed where no handler runs (SIGKILL) after rank 0's folder was renamed into
// place leaves rank 0, the unfinished ".rank-00001-of-00002.partial" and the lock file: the rerun
// refuses to overwrite rank 0, says that the set is incomplete and which folders to remove, and
// runs once they are gone.
TEST(CliReshard, ARerunAfterAKilledRunNamesTheIncompleteSet) {
  TempDir dir;
  GenTiny(dir.Join("src"));
  const std::string dst = dir.Join("old out's");  // pasted into a shell, the advice must quote it
  const RunResult done = RunCli({"reshard", dir.Join("src"), dst, "--tp", "2", "--no-sync"});
  ASSERT_EQ(done.exit_code, 0) << Describe(done);
  // What the killed run leaves (kill_reshard.sh): rank 1 still in its hidden folder, half written.
  fs::remove_all(dst + "/rank-00001-of-00002");
  fs::create_directories(dst + "/.rank-00001-of-00002.partial");
  WriteBytes(dst + "/.rank-00001-of-00002.partial/.model.safetensors.tmp-1", "half");
  WriteBytes(dst + "/.tensorferry.lock", "pid 1 (tensorferry) on elsewhere: writing");
  const RunResult refused = RunCli({"reshard", dir.Join("src"), dst, "--tp", "2", "--no-sync"});
  ExpectOneLineError(refused);
  EXPECT_NE(
      refused.err.find("rank-00000-of-00002: already exists; not overwritten; an "
                       "interrupted reshard (killed before it finished) left an incomplete "
                       "set: 1 of the 2 rank folders, and 1 unfinished; remove them (rm -r '" +
                       dir.path() + "/old out'\\''s/rank-00000-of-00002' '" + dir.path() +
                       "/old out'\\''s/.rank-00001-of-00002.partial') and run again"),
      std::string::npos)
      << refused.err;
  EXPECT_TRUE(fs::exists(dst + "/rank-00000-of-00002"));  // refused: nothing removed
  fs::remove_all(dst + "/rank-00000-of-00002");
  fs::remove_all(dst + "/.rank-00001-of-00002.partial");
  const RunResult rerun = RunCli({"reshard", dir.Join("src"), dst, "--tp", "2", "--no-sync"});
  EXPECT_EQ(rerun.exit_code, 0) << Describe(rerun);
  // A complete set is refused as before, without that advice.
  const RunResult complete = RunCli({"reshard", dir.Join("src"), dst, "--tp", "2", "--no-sync"});
  ExpectOneLineError(complete);
  EXPECT_EQ(complete.err.find("incomplete"), std::string::npos) << complete.err;
}

TEST(CliLoad, TensorParallelRankReportsBytesRead) {
  TempDir dir;
  GenTiny(dir.Join("c"));
  RunResult r = RunCli(
      {"load", dir.Join("c"), "--tp-rank", "1", "--tp-size", "4", "--json", "--engine", "pread"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  simdjson::dom::parser parser;
  simdjson::dom::element e = parser.parse(r.out);
  const uint64_t read = e["bytes_read"].get_uint64().value();
  const uint64_t total = Checkpoint::Open(dir.Join("c")).value()->total_tensor_bytes();
  EXPECT_LT(read, total / 2);
  EXPECT_GT(read, 0u);
  EXPECT_EQ(e["tp_size"].get_uint64().value(), 4u);
  r = RunCli(
      {"load", dir.Join("c"), "--tp-rank", "1", "--tp-size", "4", "--explain", "--max-gap", "0"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("tp rank 1 of 4"), std::string::npos) << r.out;
  TempDir rules;
  WriteBytes(rules.Join("r.json"), R"({"rules":[{"pattern":"*.o_proj.weight","split":1}]})");
  r = RunCli({"load", dir.Join("c"), "--tp-rank", "0", "--tp-size", "2", "--rules",
              rules.Join("r.json"), "--max-gap", "1MB", "--explain"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("discarded"), std::string::npos) << r.out;
  EXPECT_EQ(RunCli({"load", dir.Join("c"), "--tp-rank", "2", "--tp-size", "2"}).exit_code, 2);
  EXPECT_EQ(RunCli({"load", dir.Join("c"), "--tp-rank", "0"}).exit_code, 2);
  WriteBytes(rules.Join("bad.json"), R"({"rules":[{"pattern":"x"}]})");
  EXPECT_EQ(RunCli({"load", dir.Join("c"), "--tp-rank", "0", "--tp-size", "2", "--rules",
                    rules.Join("bad.json")})
                .exit_code,
            2);
}

// --- integrity checksums (docs/integrity.md) ---------------------------------------------------

// Flips one bit of the first byte of the largest tensor of the checkpoint at `path`; returns the
// tensor's name.
std::string CorruptLargestTensor(const std::string& path) {
  auto ckpt = Checkpoint::Open(path);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const TensorInfo* largest = nullptr;
  for (const TensorInfo& t : (*ckpt)->tensors()) {
    if (largest == nullptr || t.size > largest->size) largest = &t;
  }
  const std::string file = (*ckpt)->files()[largest->file].path;
  std::string bytes = ReadBytes(file);
  bytes[largest->offset + 5] ^= 0x10;
  WriteBytes(file, bytes);
  return largest->name;
}

TEST(CliChecksums, WritersEmbedThemAndVerifyAndLoadCheckThem) {
  TempDir t;
  const std::string dir = t.Join("m");
  GenTiny(dir, {"--shard-size", "40KB"});
  const size_t shards = Shards(dir).size();
  const RunResult ok = RunCli({"verify", dir});
  ASSERT_EQ(ok.exit_code, 0) << Describe(ok);
  EXPECT_NE(ok.out.find("checksums: " + std::to_string(shards) + " embedded, 0 from the manifest"),
            std::string::npos)
      << ok.out;
  const RunResult loaded = RunCli({"load", dir, "--verify", "on"});
  ASSERT_EQ(loaded.exit_code, 0) << Describe(loaded);
  EXPECT_NE(loaded.out.find("checksums verified: " + std::to_string(kTinyTensors) + " tensors"),
            std::string::npos)
      << loaded.out;

  const std::string name = CorruptLargestTensor(dir);
  const RunResult bad = RunCli({"verify", dir});
  ExpectOneLineError(bad);
  EXPECT_NE(
      bad.err.find("tensor \"" + name + "\": checksum mismatch in chunk 0 of 1 (tensor bytes [0, "),
      std::string::npos)
      << bad.err;
  for (const char* engine : {"pread", "mmap"}) {
    const RunResult load_bad = RunCli({"load", dir, "--engine", engine, "--populate"});
    ExpectOneLineError(load_bad);
    EXPECT_NE(load_bad.err.find("checksum mismatch in chunk 0"), std::string::npos) << engine;
  }
  const RunResult off = RunCli({"load", dir, "--verify", "off"});
  EXPECT_EQ(off.exit_code, 0) << Describe(off);
}

// reshard writes new checksums over what it reads: a corrupt source is refused first (its own
// checksums checked), never turned into a checkpoint that verifies.
TEST(CliChecksums, ReshardRefusesACorruptSource) {
  TempDir t;
  const std::string src = t.Join("m");
  GenTiny(src);
  const std::string bad = CorruptLargestTensor(src);
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"reshard", src, t.Join("split"), "--max-shard-size", "100KB", "--no-sync"},
           {"reshard", src, t.Join("tp"), "--tp", "2", "--no-sync"}}) {
    const RunResult r = RunCli(args);
    ExpectOneLineError(r);
    EXPECT_NE(r.err.find("checksum mismatch"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(bad), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(args[2])) << args[2];
  }
  // Asked to, it copies what it reads.
  EXPECT_EQ(RunCli({"reshard", src, t.Join("as-is"), "--max-shard-size", "100KB", "--no-sync",
                    "--no-verify"})
                .exit_code,
            0);
}

TEST(CliChecksums, ManifestForThirdPartyFiles) {
  TempDir t;
  std::vector<std::byte> a(5000), b(300);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::byte(static_cast<uint8_t>(i * 7));
  WriteOptions plain;
  plain.checksums = false;  // as the reference writes
  std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {5000}, a, nullptr},
                                        {"b", DType::kU8, {300}, b, nullptr}};
  const std::string file = t.Join("model.safetensors");
  ASSERT_TRUE(WriteFile(file, tensors, {}, plain).ok());

  const RunResult none = RunCli({"load", file, "--verify", "on"});
  ExpectOneLineError(none);
  EXPECT_NE(none.err.find("has no checksums"), std::string::npos) << none.err;

  const RunResult wrote = RunCli({"checksum", file, "--chunk-size", "1KiB"});
  ASSERT_EQ(wrote.exit_code, 0) << Describe(wrote);
  const std::string manifest = t.Join(std::string(kChecksumManifestName));
  ASSERT_TRUE(fs::exists(manifest)) << wrote.out;
  auto parsed = ParseChecksumManifest(ReadBytes(manifest));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->files.count("model.safetensors"), 1u);
  EXPECT_EQ(parsed->files.at("model.safetensors").checksums.tensors.at("a").chunks.size(), 5u);

  const RunResult ok = RunCli({"verify", file, "--json"});
  ASSERT_EQ(ok.exit_code, 0) << Describe(ok);
  EXPECT_NE(ok.out.find("\"checksums\":\"manifest\""), std::string::npos) << ok.out;
  EXPECT_EQ(RunCli({"load", file, "--verify", "on"}).exit_code, 0);

  std::string bytes = ReadBytes(file);
  bytes[bytes.size() - 300 - 1000] ^= 1;  // tensor a (stored after b: same dtype, name order)
  WriteBytes(file, bytes);
  const RunResult bad = RunCli({"verify", file});
  ExpectOneLineError(bad);
  EXPECT_NE(bad.err.find("checksum mismatch in chunk"), std::string::npos) << bad.err;
  // `checksum` again does not record the damaged bytes over the entry that protects them...
  const RunResult rehashed = RunCli({"checksum", file});
  ExpectOneLineError(rehashed);
  EXPECT_NE(rehashed.err.find("against the checksums the manifest records for it"),
            std::string::npos)
      << rehashed.err;
  EXPECT_EQ(RunCli({"verify", file}).exit_code, 1);
  // ...unless the file was changed on purpose.
  const RunResult replaced = RunCli({"checksum", file, "--replace"});
  ASSERT_EQ(replaced.exit_code, 0) << Describe(replaced);
  EXPECT_EQ(RunCli({"verify", file}).exit_code, 0);
  // A file of another size than recorded is refused before hashing.
  WriteBytes(file, bytes + std::string(8, ' '));
  const RunResult resized = RunCli({"load", file});
  EXPECT_EQ(resized.exit_code, 1) << Describe(resized);
}

// One folder of single-file checkpoints shares one manifest: each `checksum` keeps the others'
// entries (in their chunk size). An index keeping its shards in subfolders gets its manifest
// beside the index, its names relative to it, two shards of one base name apart.
TEST(CliChecksums, AFolderSharesItsManifestAndSubfolderShardsKeepTheirNames) {
  TempDir t;
  std::vector<std::byte> bytes(3000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte(static_cast<uint8_t>(i * 5));
  WriteOptions plain;
  plain.checksums = false;
  const auto write = [&](const std::string& path, size_t n) {
    const std::vector<TensorToWrite> tensors = {
        {"w", DType::kU8, {n}, std::span<const std::byte>(bytes.data(), n), nullptr}};
    ASSERT_TRUE(WriteFile(path, tensors, {}, plain).ok());
  };
  write(t.Join("a.safetensors"), 3000);
  write(t.Join("b.safetensors"), 2000);
  RunResult r = RunCli({"checksum", t.Join("a.safetensors"), "--chunk-size", "1KiB"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  r = RunCli({"checksum", t.Join("b.safetensors")});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  auto manifest = ParseChecksumManifest(ReadBytes(t.Join(std::string(kChecksumManifestName))));
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  EXPECT_EQ(manifest->chunk_size, 1024u);
  EXPECT_EQ(manifest->files.size(), 2u);
  for (const char* f : {"a.safetensors", "b.safetensors"}) {
    r = RunCli({"load", t.Join(f), "--verify", "on"});
    EXPECT_EQ(r.exit_code, 0) << f << ": " << Describe(r);
  }
  r = RunCli({"checksum", t.Join("b.safetensors"), "--chunk-size", "2KiB"});
  ExpectOneLineError(r);
  EXPECT_NE(r.err.find("1 other file(s) in chunks of 1024 bytes"), std::string::npos) << r.err;
  EXPECT_EQ(RunCli({"load", t.Join("a.safetensors"), "--verify", "on"}).exit_code, 0);

  const std::string c = t.Join("c");
  fs::create_directories(c + "/a");
  fs::create_directories(c + "/b");
  write(c + "/a/x.safetensors", 1000);
  write(c + "/b/x.safetensors", 2500);
  WriteBytes(c + "/model.safetensors.index.json", R"({"weight_map": {"w": "a/x.safetensors"}})");
  // Two tensors named alike cannot share an index: the second file holds another name.
  const std::vector<TensorToWrite> v = {
      {"v", DType::kU8, {2500}, std::span<const std::byte>(bytes.data(), 2500), nullptr}};
  ASSERT_TRUE(WriteFile(c + "/b/x.safetensors", v, {}, plain).ok());
  WriteBytes(c + "/model.safetensors.index.json",
             R"({"weight_map": {"w": "a/x.safetensors", "v": "b/x.safetensors"}})");
  r = RunCli({"checksum", c});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  manifest = ParseChecksumManifest(ReadBytes(c + "/" + std::string(kChecksumManifestName)));
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  std::vector<std::string> names;
  for (const auto& [name, file] : manifest->files) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"a/x.safetensors", "b/x.safetensors"}));
  r = RunCli({"verify", c});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("2 from the manifest"), std::string::npos) << r.out;
  EXPECT_EQ(RunCli({"load", c, "--verify", "on"}).exit_code, 0);
}

// Errors about a checkpoint given by a relative path name it once (the library names its files
// by absolute path); checksum --json answers a checkpoint it cannot open with its error document.
TEST(CliChecksums, RelativePathsAndJsonErrors) {
  TempDir t;
  fs::create_directory(t.Join("sub"));
  WriteBytes(t.Join("sub/model.safetensors.index.json"),
             R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})");
  char before[4096];
  ASSERT_NE(::getcwd(before, sizeof before), nullptr);
  ASSERT_EQ(::chdir(t.path().c_str()), 0);
  const RunResult missing = RunCli({"inspect", "sub"});
  const RunResult json = RunCli({"checksum", "nothing-here", "--json"});
  ASSERT_EQ(::chdir(before), 0);
  ExpectOneLineError(missing);
  EXPECT_EQ(missing.err.find("sub: /"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("model-00001-of-00001.safetensors"), std::string::npos) << missing.err;
  EXPECT_EQ(json.exit_code, 1) << Describe(json);
  EXPECT_NE(json.out.find("\"ok\":false"), std::string::npos) << json.out;
  EXPECT_NE(json.out.find("\"code\":\"not_found\""), std::string::npos) << json.out;
  EXPECT_NE(json.out.find("nothing-here: no such file or directory"), std::string::npos)
      << json.out;
}

TEST(CliChecksums, HubCacheBlobsAreCheckedBySha256) {
  TempDir t;
  const std::string repo = t.Join("models--x--y");
  fs::create_directories(repo + "/blobs");
  fs::create_directories(repo + "/snapshots/abc");
  std::vector<std::byte> a(1000, std::byte{3});
  std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {1000}, a, nullptr}};
  const std::string tmp = t.Join("tmp.safetensors");
  ASSERT_TRUE(WriteFile(tmp, tensors).ok());
  auto sha = Sha256OfFile(tmp);
  ASSERT_TRUE(sha.ok()) << sha.status().ToString();
  fs::rename(tmp, repo + "/blobs/" + *sha);
  fs::create_symlink("../../blobs/" + *sha, repo + "/snapshots/abc/model.safetensors");
  const RunResult ok = RunCli({"verify", repo + "/snapshots/abc", "--json"});
  ASSERT_EQ(ok.exit_code, 0) << Describe(ok);
  EXPECT_NE(ok.out.find("\"hub_sha256\":\"ok\""), std::string::npos) << ok.out;

  // Same bytes under another blob name: the content does not hash to its name.
  const std::string wrong(64, 'a');
  fs::rename(repo + "/blobs/" + *sha, repo + "/blobs/" + wrong);
  fs::remove(repo + "/snapshots/abc/model.safetensors");
  fs::create_symlink("../../blobs/" + wrong, repo + "/snapshots/abc/model.safetensors");
  const RunResult bad = RunCli({"verify", repo + "/snapshots/abc"});
  ExpectOneLineError(bad);
  EXPECT_NE(bad.err.find("is named by SHA-256 " + wrong), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace tensorferry
