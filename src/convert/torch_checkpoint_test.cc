#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tensorferry/convert.h"
#include "tensorferry/format.h"
#include "testing/test_util.h"
#include "testing/torch_builder.h"

namespace tensorferry {
namespace {

using testing::F32Bytes;
using testing::MakeLegacy;
using testing::MakeTorchZip;
using testing::MakeZip;
using testing::MemoryEnv;
using testing::PickleBuilder;

::testing::AssertionResult Fails(const Status& s, Code code, std::string_view needle) {
  if (s.ok()) return ::testing::AssertionFailure() << "accepted";
  if (s.code() != code) {
    return ::testing::AssertionFailure() << "code " << CodeName(s.code()) << ": " << s.message();
  }
  if (s.message().find(needle) == std::string::npos) {
    return ::testing::AssertionFailure() << "\"" << s.message() << "\" lacks \"" << needle << "\"";
  }
  return ::testing::AssertionSuccess();
}

Result<std::unique_ptr<TorchCheckpoint>> OpenIn(MemoryEnv& env, const std::string& path,
                                                TorchLimits limits = {}) {
  TorchOpenOptions options;
  options.env = &env;
  options.limits = limits;
  return TorchCheckpoint::Open(path, options);
}

std::string ReadAllOf(const TorchCheckpoint& c, const std::string& name, size_t chunk = 3) {
  const TorchTensor* t = c.Find(name);
  EXPECT_NE(t, nullptr) << name;
  if (t == nullptr) return "";
  const size_t index = static_cast<size_t>(t - c.tensors().data());
  std::string out(static_cast<size_t>(t->byte_size), '\0');
  for (size_t off = 0; off < out.size(); off += chunk) {
    const size_t n = std::min(chunk, out.size() - off);
    Status s =
        c.ReadTensor(index, off, std::as_writable_bytes(std::span<char>(out.data() + off, n)));
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return out;
}

// {"model": {"w": 2x3 float32 [0..5], "w_t": its transpose, "b": f16[3], "tied": w again},
//  "step": 7, "lr": 0.5, "tags": ["a", 1]}
PickleBuilder ModelPickle(bool legacy) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().Str("model").OrderedDict().Mark();
  p.Str("w").Tensor("FloatStorage", "0", 6, 0, {2, 3}, {3, 1}, legacy).Put(1);
  p.Str("w_t").Tensor("FloatStorage", "0", 6, 0, {3, 2}, {1, 3}, legacy);
  p.Str("b").Tensor("HalfStorage", "1", 3, 0, {3}, {1}, legacy);
  p.Str("tied").Get(1);
  p.SetItems();
  p.Str("step")
      .Int(7)
      .Str("lr")
      .Float(0.5)
      .Str("tags")
      .EmptyList()
      .Mark()
      .Str("a")
      .Int(1)
      .Appends();
  p.SetItems().Stop();
  return p;
}

const std::string kW = F32Bytes({0, 1, 2, 3, 4, 5});
const std::string kB("\x01\x3c\x02\x3c\x03\x3c", 6);

void ExpectModel(const TorchCheckpoint& c) {
  ASSERT_EQ(c.tensors().size(), 4u);
  EXPECT_EQ(c.tensors()[0].name, "model.w");
  EXPECT_EQ(c.tensors()[1].name, "model.w_t");
  EXPECT_EQ(c.tensors()[3].name, "model.tied");
  const TorchTensor& w = *c.Find("model.w");
  EXPECT_EQ(w.dtype, DType::kF32);
  EXPECT_EQ(w.torch_dtype, "float32");
  EXPECT_EQ(w.shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_TRUE(w.contiguous);
  EXPECT_FALSE(c.Find("model.w_t")->contiguous);
  EXPECT_EQ(c.Find("model.b")->dtype, DType::kF16);
  EXPECT_EQ(c.storages().size(), 2u);
  EXPECT_EQ(c.Find("model.tied")->storage, w.storage);
  EXPECT_EQ(ReadAllOf(c, "model.w"), kW);
  EXPECT_EQ(ReadAllOf(c, "model.tied"), kW);
  EXPECT_EQ(ReadAllOf(c, "model.w_t"), F32Bytes({0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(ReadAllOf(c, "model.w_t", 1000), F32Bytes({0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(ReadAllOf(c, "model.b"), kB);
  ASSERT_EQ(c.values().size(), 3u);
  EXPECT_EQ(c.values()[0].name, "step");
  EXPECT_EQ(c.values()[0].text, "7");
  EXPECT_EQ(c.values()[1].text, "0.5");
  EXPECT_EQ(c.values()[2].name, "tags");
  EXPECT_EQ(c.values()[2].text, "['a', 1]");
  EXPECT_EQ(c.values()[2].type, "list");
}

TEST(TorchCheckpoint, ZipArchive) {
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(ModelPickle(false).bytes(), {{"0", kW}, {"1", kB}}));
  auto c = OpenIn(env, "m.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ExpectModel(**c);
  const TorchFileInfo& f = (*c)->files()[0];
  EXPECT_EQ(f.format, TorchFormat::kZip);
  EXPECT_EQ(f.archive, "archive");
  EXPECT_EQ(f.version, "3");
  EXPECT_FALSE(f.big_endian);
  EXPECT_EQ(f.pickle_size, ModelPickle(false).size());
}

// Views using a small part of a large storage are gathered through a small window, not a copy
// of the span (a 2-element view of a huge storage must not allocate the storage); a compressed
// entry is read so only when the view's walk moves forwards.
TEST(TorchCheckpoint, SparseViewsReadThroughAWindow) {
  constexpr int64_t kNumel = 20 << 20;  // 80 MiB of floats: more than the 64 MiB dense slack
  // Zeros (quick to deflate) but for the elements the views read, which hold their position.
  std::vector<float> values(kNumel);
  for (int64_t i : std::vector<int64_t>{1, 5, 8, 11, 18000005, 18000008, 18000011, kNumel - 1}) {
    values[i] = static_cast<float>(i);
  }
  const std::string storage = F32Bytes(values);
  auto expect = [&](std::initializer_list<int64_t> positions) {
    std::vector<float> v;
    for (int64_t p : positions) v.push_back(static_cast<float>(p));
    return F32Bytes(v);
  };
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark();
  p.Str("ends").Tensor("FloatStorage", "0", kNumel, 1, {2}, {kNumel - 2});
  p.Str("grid").Tensor("FloatStorage", "0", kNumel, 5, {2, 3}, {18000000, 3});
  p.Str("grid_t").Tensor("FloatStorage", "0", kNumel, 5, {3, 2}, {3, 18000000});
  p.SetItems().Stop();
  const std::string want_ends = expect({1, kNumel - 1});
  const std::string want_grid = expect({5, 8, 11, 18000005, 18000008, 18000011});
  const std::string want_grid_t = expect({5, 18000005, 8, 18000008, 11, 18000011});

  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(p.bytes(), {{"0", storage}}));
  auto c = OpenIn(env, "m.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(ReadAllOf(**c, "ends"), want_ends);
  EXPECT_EQ(ReadAllOf(**c, "grid"), want_grid);
  EXPECT_EQ(ReadAllOf(**c, "grid_t"), want_grid_t);
  EXPECT_EQ(ReadAllOf(**c, "grid_t", 1000), want_grid_t);

  testing::TempDir tmp;
  testing::WriteDeflatedZip(tmp.Join("d.pt"), {{"archive/data.pkl", p.bytes()},
                                               {"archive/byteorder", "little"},
                                               {"archive/data/0", storage},
                                               {"archive/version", "3\n"}});
  TorchOpenOptions options;
  auto d = TorchCheckpoint::Open(tmp.Join("d.pt"), options);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(ReadAllOf(**d, "ends", 1000), want_ends);
  EXPECT_EQ(ReadAllOf(**d, "grid", 1000), want_grid);
  const TorchTensor* t = (*d)->Find("grid_t");
  ASSERT_NE(t, nullptr);
  std::string out(static_cast<size_t>(t->byte_size), '\0');
  const Status s =
      (*d)->ReadTensor(static_cast<size_t>(t - (*d)->tensors().data()), 0,
                       std::as_writable_bytes(std::span<char>(out.data(), out.size())));
  EXPECT_TRUE(Fails(s, Code::kTorchBadTensor, "d.pt: tensor \"grid_t\": a sparse view (24 bytes"));
  EXPECT_TRUE(Fails(s, Code::kTorchBadTensor, "not in storage order, of a compressed zip entry"));
}

TEST(TorchCheckpoint, LegacyFile) {
  MemoryEnv env;
  env.AddFile("m.pt", MakeLegacy(ModelPickle(true).bytes(), {{"1", 3, kB}, {"0", 6, kW}}));
  auto c = OpenIn(env, "m.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ExpectModel(**c);
  EXPECT_EQ((*c)->files()[0].format, TorchFormat::kLegacy);
}

TEST(TorchCheckpoint, BigEndianStoragesAreSwapped) {
  std::string w_be = kW, b_be = kB;
  for (size_t i = 0; i < w_be.size(); i += 4) std::reverse(w_be.begin() + i, w_be.begin() + i + 4);
  for (size_t i = 0; i < b_be.size(); i += 2) std::reverse(b_be.begin() + i, b_be.begin() + i + 2);
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(ModelPickle(false).bytes(), {{"0", w_be}, {"1", b_be}},
                                   "archive", "big"));
  auto c = OpenIn(env, "m.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE((*c)->files()[0].big_endian);
  ExpectModel(**c);
}

TEST(TorchCheckpoint, ArchiveLayoutErrors) {
  const std::string pkl = ModelPickle(false).bytes();
  const std::map<std::string, std::string> data = {{"0", kW}, {"1", kB}};
  struct Case {
    std::string bytes;
    Code code;
    std::string needle;
  };
  std::string wrong_size = MakeTorchZip(pkl, {{"0", kW + "x"}, {"1", kB}});
  const std::vector<Case> cases = {
      {MakeTorchZip(pkl, {{"0", kW}}), Code::kTorchMissingStorage,
       "m.pt: storage \"1\" (pickle offset"},
      {wrong_size, Code::kTorchMissingStorage,
       "entry \"archive/data/0\" holds 25 bytes but its storage (6 x FloatStorage) needs 24"},
      {MakeZip({{"archive/other", "x"}}), Code::kTorchBadArchive, "no \"<archive>/data.pkl\""},
      {MakeZip({{"a/data.pkl", pkl}, {"b/data.pkl", pkl}}), Code::kTorchBadArchive,
       "several \"<archive>/data.pkl\" entries"},
      {MakeTorchZip(pkl, data, "archive", "middle"), Code::kTorchBadArchive,
       "holds \"middle\", not \"little\" or \"big\""},
      {MakeZip({{"archive/data.pkl", pkl}, {"archive/version", "three"}}), Code::kTorchBadArchive,
       "not a version number"},
      {MakeTorchZip(pkl + "junk", data), Code::kPickleMalformed, "4 bytes after STOP"},
      {"hello world", Code::kTorchBadArchive, "neither a zip archive nor a pickle"},
      {std::string("\x80\x02K\x01.", 5), Code::kTorchLegacyInvalid, "torch's magic number"},
  };
  for (const Case& c : cases) {
    MemoryEnv env;
    env.AddFile("m.pt", c.bytes);
    auto r = OpenIn(env, "m.pt");
    EXPECT_TRUE(Fails(r.status(), c.code, c.needle)) << c.needle;
  }
}

TEST(TorchCheckpoint, MaliciousPickleInsideAnArchive) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().Str("x").Global("os", "system").Str("touch /tmp/pwned");
  p.Tuple(1).Reduce().SetItems().Stop();
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(p.bytes(), {}));
  auto r = OpenIn(env, "m.pt");
  EXPECT_TRUE(Fails(r.status(), Code::kPickleRefusedGlobal,
                    "m.pt: archive/data.pkl: refused global os.system at pickle offset 10"));
}

TEST(TorchCheckpoint, ObjectTreeRules) {
  struct Case {
    PickleBuilder p;
    Code code;
    std::string needle;
  };
  std::vector<Case> cases(4);
  cases[0].p.Proto(2).Tensor("FloatStorage", "0", 4, 0, {4}, {1}).Stop();
  cases[0].code = Code::kTorchNotStateDict;
  cases[0].needle = "holds a Tensor, not a dict of tensors";
  cases[1].p.Proto(2).EmptyDict().Mark().Str("a.b").Tensor("FloatStorage", "0", 4, 0, {4}, {1});
  cases[1].p.Str("a").EmptyDict().Str("b").Int(1).SetItem().SetItems().Stop();
  cases[1].code = Code::kTorchNameConflict;
  cases[1].needle = "two entries are both named \"a.b\"";
  cases[2].p.Proto(2).EmptyDict().Mark().Str("c");
  cases[2].p.Tensor("ComplexDoubleStorage", "0", 1, 0, {1}, {1}).SetItems().Stop();
  cases[2].code = Code::kTorchUnsupportedDtype;
  cases[2].needle = "tensor \"c\" (pickle offset";
  cases[3].p.Proto(2).EmptyDict().Str("a").EmptyDict().Str("b").EmptyDict().Str("c").Int(1);
  cases[3].p.SetItem().SetItem().SetItem().Stop();
  cases[3].code = Code::kPickleLimitExceeded;
  cases[3].needle = "\"a.b.c\" is nested deeper than TorchLimits::max_depth (2)";
  TorchLimits limits;
  limits.max_depth = 2;
  for (const Case& c : cases) {
    MemoryEnv env;
    env.AddFile("m.pt", MakeTorchZip(c.p.bytes(), {{"0", std::string(16, '\0')}}));
    auto r = OpenIn(env, "m.pt", limits);
    EXPECT_TRUE(Fails(r.status(), c.code, c.needle)) << c.needle;
  }
}

TEST(TorchCheckpoint, ValuesKeysAndCycles) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark();
  p.Str("state").EmptyDict().Mark().Int(0).EmptyDict().Str("m").Tensor("FloatStorage", "0", 1, 0,
                                                                       {}, {});
  p.SetItem().Int(1).None().SetItems();              // int keys -> "state.0.m"
  p.Str("loop").EmptyList().Put(5).Get(5).Append();  // a list holding itself
  p.Str("blob").Bytes("\x01'").Str("dt").Global("torch", "float16");
  p.Str("size").Global("torch", "Size").Int(2).Tuple(1).Tuple(1).Reduce();
  p.Str("nested").EmptyList().Mark().EmptyDict().Str("lr").Float(1e-5).SetItem().Appends();
  p.Str("empty").EmptyDict().Str("od").OrderedDict().Str("t").Int(3).Tuple(1);
  p.Int(5).Str("int key").None().Str("none");
  p.SetItems().Stop();
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(p.bytes(), {{"0", F32Bytes({1.5f})}}));
  auto c = OpenIn(env, "m.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ((*c)->tensors().size(), 1u);
  EXPECT_EQ((*c)->tensors()[0].name, "state.0.m");
  EXPECT_TRUE((*c)->tensors()[0].shape.empty());
  std::map<std::string, const TorchValue*> v;
  for (const TorchValue& x : (*c)->values()) v[x.name] = &x;
  EXPECT_EQ(v.at("state.1")->text, "None");
  EXPECT_FALSE(v.at("loop")->representable);
  EXPECT_NE(v.at("loop")->note.find("contains itself"), std::string::npos) << v.at("loop")->note;
  EXPECT_EQ(v.at("blob")->text, "b\"\\x01'\"");
  EXPECT_EQ(v.at("dt")->text, "torch.float16");
  EXPECT_EQ(v.at("size")->text, "torch.Size([2])");
  EXPECT_EQ(v.at("nested.0.lr")->text, "1e-05");
  EXPECT_EQ(v.at("empty")->text, "{}");
  EXPECT_EQ(v.at("od")->text, "OrderedDict()");
  EXPECT_EQ(v.at("t")->text, "(3,)");
  EXPECT_EQ(v.at("5")->text, "int key");
  EXPECT_EQ(v.at("None")->text, "none");
}

// Keys Python compares equal are one key holding the last value, as torch.load's dict has it:
// 1, True, 1.0 and a big integer of value 1; 0.0 and -0.0; two equal strings. A big integer key
// fetched from the memo many times is printed once (it once cost 12 ms a use).
TEST(TorchCheckpoint, EqualKeysAreOneKeyTheLastValueWins) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark();
  p.Int(1).Tensor("FloatStorage", "0", 1, 0, {}, {});
  p.Bool(true).Tensor("FloatStorage", "1", 1, 0, {}, {});
  p.Float(1.0).Tensor("FloatStorage", "2", 1, 0, {}, {});
  p.Str("w").Tensor("FloatStorage", "0", 1, 0, {}, {});
  p.Str("w").Tensor("FloatStorage", "3", 1, 0, {}, {});
  p.Float(-0.0).Int(1).Float(0.0).Int(2).Int(0).Int(3);      // values: 0 -> 3
  p.Long1(std::string(200, '\x11') + '\x01').Put(9).Int(4);  // a big integer key, memoized
  for (int i = 0; i < 20000; ++i) p.Get(9).Int(5 + i % 2);   // ... then used again and again
  p.SetItems().Stop();
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(p.bytes(), {{"0", F32Bytes({1})},
                                               {"1", F32Bytes({2})},
                                               {"2", F32Bytes({3})},
                                               {"3", F32Bytes({4})}}));
  const auto start = std::chrono::steady_clock::now();
  auto c = OpenIn(env, "m.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 20.0);
  ASSERT_EQ((*c)->tensors().size(), 2u);
  EXPECT_EQ(ReadAllOf(**c, "1"), F32Bytes({3}));  // named by the first of 1, True, 1.0
  EXPECT_EQ(ReadAllOf(**c, "w"), F32Bytes({4}));
  std::map<std::string, std::string> v;
  for (const TorchValue& x : (*c)->values()) v[x.name] = x.text;
  ASSERT_EQ(v.size(), 2u) << v.size();
  EXPECT_EQ(v.at("-0.0"), "3");
  EXPECT_EQ(v.size() == 2 ? (++v.begin())->second : "", "6");  // the big integer's last value
  EXPECT_EQ(v.size() == 2 ? (++v.begin())->first.size() : 0, 482u);
}

TEST(TorchCheckpoint, SharedGraphsCannotBlowUp) {
  // d0 = {"t": tensor}; d[k] = {"a": d[k-1], "b": d[k-1]}: 2^40 names if walked naively.
  PickleBuilder dicts;
  dicts.Proto(2).EmptyDict().Str("t").Tensor("FloatStorage", "0", 1, 0, {1}, {1}).SetItem();
  dicts.Put(0).Op('0');  // POP: the dict lives on in the memo
  for (uint32_t k = 1; k <= 40; ++k) {
    dicts.EmptyDict().Mark().Str("a").Get(k - 1).Str("b").Get(k - 1).SetItems().Put(k).Op('0');
  }
  dicts.EmptyDict().Str("root").Get(40).SetItem().Stop();
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(dicts.bytes(), {{"0", F32Bytes({1})}}));
  TorchLimits limits;
  limits.max_entries = 10000;
  auto r = OpenIn(env, "m.pt", limits);
  EXPECT_TRUE(Fails(r.status(), Code::kPickleLimitExceeded, "TorchLimits::max_entries (10000)"));

  // l[k] = [l[k-1], l[k-1]] under 5000 names: every text is too long, and the work is bounded
  // by the total text budget, not 5000 x 2^60.
  PickleBuilder lists;
  lists.Proto(2).EmptyList().Put(0).Op('0');
  for (uint32_t k = 1; k <= 60; ++k) {
    lists.EmptyList().Mark().Get(k - 1).Get(k - 1).Appends().Put(k).Op('0');
  }
  lists.EmptyDict().Mark();
  for (int i = 0; i < 5000; ++i) {
    std::string key = "v";
    key += std::to_string(i);  // (not "v" + ...: GCC 12 warns falsely, -Wrestrict)
    lists.Str(key).Get(60);
  }
  lists.SetItems().Stop();
  MemoryEnv env2;
  env2.AddFile("m.pt", MakeTorchZip(lists.bytes(), {}));
  auto c = OpenIn(env2, "m.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ((*c)->values().size(), 5000u);
  EXPECT_FALSE((*c)->values()[0].representable);
  EXPECT_NE((*c)->values()[4999].note.find("in all"), std::string::npos)
      << (*c)->values()[4999].note;
}

// Items whose keys have no name (a tuple) are recorded as entries, one per visit of their dict:
// a dict of many such items shared under many names is charged as walked values are, not free
// (1000 items x 10000 names would be 10^7 entries from a 90 KB pickle).
TEST(TorchCheckpoint, UnnamedKeysOfASharedDictAreCharged) {
  PickleBuilder p;
  p.Proto(2).EmptyTuple().Put(0).Op('0');
  p.EmptyDict().Mark();
  for (int i = 0; i < 1000; ++i) p.Get(0).None();
  p.SetItems().Put(1).Op('0');
  p.EmptyDict().Mark();
  for (int i = 0; i < 10000; ++i) {
    std::string key = "k";
    key += std::to_string(i);
    p.Str(key).Get(1);
  }
  p.SetItems().Stop();
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(p.bytes(), {}));
  const auto start = std::chrono::steady_clock::now();
  auto r = OpenIn(env, "m.pt");
  EXPECT_TRUE(Fails(r.status(), Code::kPickleLimitExceeded,
                    "flatten_base + flatten_per_pickle_byte x the pickle's size"))
      << r.status().ToString();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 20.0);
  // One visit of such a dict is fine: its items are listed as values that have no name.
  PickleBuilder once;
  once.Proto(2).EmptyDict().Mark().Str("d").EmptyDict().Mark();
  once.EmptyTuple().Int(1).Str("w").Int(2);
  once.SetItems().SetItems().Stop();
  MemoryEnv env2;
  env2.AddFile("m.pt", MakeTorchZip(once.bytes(), {}));
  auto c = OpenIn(env2, "m.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->values().size(), 2u);
}

TEST(TorchCheckpoint, FlatteningASharedDagIsBoundedByThePicklesSize) {
  // A 59-level shared dict of ~1 KB (2^59 names): refused after a bounded amount of names, by
  // the limit proportional to the pickle (the default max_entries would allow 4M names, ~700 MB).
  PickleBuilder dicts;
  dicts.Proto(2).EmptyDict().Str("t").Tensor("FloatStorage", "0", 1, 0, {1}, {1}).SetItem();
  dicts.Put(0).Op('0');
  for (uint32_t k = 1; k <= 59; ++k) {
    dicts.EmptyDict().Mark().Str("a").Get(k - 1).Str("b").Get(k - 1).SetItems().Put(k).Op('0');
  }
  dicts.EmptyDict().Str("root").Get(59).SetItem().Stop();
  ASSERT_LT(dicts.size(), 2048u);
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(dicts.bytes(), {{"0", F32Bytes({1})}}));
  auto r = OpenIn(env, "m.pt");
  EXPECT_TRUE(Fails(r.status(), Code::kPickleLimitExceeded,
                    "flatten_base + flatten_per_pickle_byte x the pickle's size"));
  EXPECT_TRUE(
      Fails(r.status(), Code::kPickleLimitExceeded, std::to_string(dicts.size()) + "-byte pickle"));
  // With a budget of 0 per byte and a tiny base, even a small tree is refused: the bound is real.
  TorchLimits tight;
  tight.flatten_base = 100;
  tight.flatten_per_pickle_byte = 0;
  MemoryEnv env2;
  env2.AddFile("m.pt", MakeTorchZip(ModelPickle(false).bytes(), {{"0", kW}, {"1", kB}}));
  EXPECT_TRUE(Fails(OpenIn(env2, "m.pt", tight).status(), Code::kPickleLimitExceeded,
                    "more than 100 bytes of names"));
  EXPECT_TRUE(OpenIn(env2, "m.pt").ok());
}

// A long string memoized once and referenced over and over costs its length at each reference
// where it is looked up or held: as a storage key (bounded to 1 KiB) and as a dict key (charged
// to the flatten budget), so that a small pickle cannot make the work grow with its square.
TEST(TorchCheckpoint, ALongStringReferencedOverAndOverIsBounded) {
  const std::string long_key(2000, 'k');
  PickleBuilder storage;
  storage.Proto(2).EmptyDict().Mark();
  storage.Str("w").Tensor("FloatStorage", long_key, 1, 0, {1}, {1});
  storage.SetItems().Stop();
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(storage.bytes(), {{long_key, F32Bytes({1})}}));
  EXPECT_TRUE(Fails(OpenIn(env, "m.pt").status(), Code::kPickleBadPersistentId,
                    "storage key of 2000 bytes, more than 1024"));

  // One 64 KiB key, then 10,000 more references to it as keys of one dict (the last value
  // wins, as in Python): 640 MB of key text to hold and hash from a pickle of ~110 KB.
  PickleBuilder keys;
  keys.Proto(2).EmptyDict().Mark().Str(std::string(64u << 10, 'n')).Put(1).Int(0);
  for (int i = 0; i < 10000; ++i) keys.Get(1).Int(i);
  keys.SetItems().Stop();
  MemoryEnv env2;
  env2.AddFile("k.pt", MakeTorchZip(keys.bytes(), {}));
  EXPECT_TRUE(
      Fails(OpenIn(env2, "k.pt").status(), Code::kPickleLimitExceeded, "bytes of names and keys"));
}

TEST(TorchCheckpoint, ShardedIndex) {
  PickleBuilder a, b;
  a.Proto(2)
      .EmptyDict()
      .Mark()
      .Str("x")
      .Tensor("FloatStorage", "0", 1, 0, {1}, {1})
      .SetItems()
      .Stop();
  b.Proto(2)
      .EmptyDict()
      .Mark()
      .Str("y")
      .Tensor("FloatStorage", "0", 2, 0, {2}, {1})
      .SetItems()
      .Stop();
  auto env_with = [&](const std::string& index) {
    auto env = std::make_unique<MemoryEnv>();
    env->AddFile("d/p-1.bin", MakeTorchZip(a.bytes(), {{"0", F32Bytes({1})}}));
    env->AddFile("d/p-2.bin", MakeLegacy(PickleBuilder()
                                             .Proto(2)
                                             .EmptyDict()
                                             .Mark()
                                             .Str("y")
                                             .Tensor("FloatStorage", "k", 2, 0, {2}, {1}, true)
                                             .SetItems()
                                             .Stop()
                                             .bytes(),
                                         {{"k", 2, F32Bytes({2, 3})}}));
    env->AddFile("d/pytorch_model.bin.index.json", index);
    return env;
  };
  auto ok =
      env_with(R"({"metadata":{"total_size":12},"weight_map":{"x":"p-1.bin","y":"p-2.bin"}})");
  auto c = OpenIn(*ok, "d/pytorch_model.bin.index.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->files().size(), 2u);
  EXPECT_EQ((*c)->files()[1].format, TorchFormat::kLegacy);
  EXPECT_EQ(ReadAllOf(**c, "y"), F32Bytes({2, 3}));
  EXPECT_EQ((*c)->index_metadata().size(), 1u);

  auto missing = env_with(R"({"weight_map":{"x":"p-1.bin","y":"p-2.bin","z":"p-2.bin"}})");
  EXPECT_TRUE(Fails(OpenIn(*missing, "d/pytorch_model.bin.index.json").status(),
                    Code::kIndexMissingTensor, "tensor \"z\" is listed in \"p-2.bin\""));
  auto unlisted = env_with(R"({"weight_map":{"x":"p-1.bin","y":"p-2.bin"}})");
  PickleBuilder two;
  two.Proto(2).EmptyDict().Mark().Str("x").Tensor("FloatStorage", "0", 1, 0, {1}, {1});
  two.Str("extra").Tensor("FloatStorage", "0", 1, 0, {1}, {1}).SetItems().Stop();
  unlisted->AddFile("d/p-1.bin", MakeTorchZip(two.bytes(), {{"0", F32Bytes({1})}}));
  EXPECT_TRUE(Fails(OpenIn(*unlisted, "d/pytorch_model.bin.index.json").status(),
                    Code::kIndexUnlistedTensor, "d/p-1.bin: tensor \"extra\" is not listed"));
  auto wrong_file = env_with(R"({"weight_map":{"x":"p-2.bin","y":"p-2.bin"}})");
  EXPECT_TRUE(Fails(OpenIn(*wrong_file, "d/pytorch_model.bin.index.json").status(),
                    Code::kIndexMissingTensor, "tensor \"x\" is listed in \"p-2.bin\""));
  auto absent = env_with(R"({"weight_map":{"x":"p-1.bin","y":"p-3.bin"}})");
  EXPECT_TRUE(Fails(OpenIn(*absent, "d/pytorch_model.bin.index.json").status(),
                    Code::kIndexMissingFile, "file \"p-3.bin\""));
  auto escape = env_with(R"({"weight_map":{"x":"../p-1.bin"}})");
  EXPECT_EQ(OpenIn(*escape, "d/pytorch_model.bin.index.json").status().code(),
            Code::kIndexPathEscape);
}

// A sharded pytorch_model.bin in a Hugging Face hub cache: snapshots/<rev>/ holds symlinks into
// the repository's blobs/ (the index too). The path rule accepts them, as it does for a
// safetensors index, and still refuses a symlink that leaves the repository.
TEST(TorchCheckpoint, ShardedIndexInAHubCacheSnapshot) {
  namespace fs = std::filesystem;
  testing::TempDir tmp;
  const fs::path repo = fs::path(tmp.path()) / "models--org--name";
  const fs::path snapshot = repo / "snapshots" / "0123abcd";
  fs::create_directories(repo / "blobs");
  fs::create_directories(snapshot);
  auto one = [](const std::string& name, float v) {
    PickleBuilder p;
    p.Proto(2).EmptyDict().Mark().Str(name).Tensor("FloatStorage", "0", 1, 0, {1}, {1});
    p.SetItems().Stop();
    return MakeTorchZip(p.bytes(), {{"0", F32Bytes({v})}});
  };
  const std::vector<std::pair<std::string, std::string>> files = {
      {"pytorch_model-00001-of-00002.bin", one("x", 1)},
      {"pytorch_model-00002-of-00002.bin", one("y", 2)},
      {"pytorch_model.bin.index.json", R"({"weight_map":{"x":"pytorch_model-00001-of-00002.bin",)"
                                       R"("y":"pytorch_model-00002-of-00002.bin"}})"}};
  int blob = 0;
  for (const auto& [name, bytes] : files) {
    const std::string sha = "b10b" + std::to_string(blob++);
    testing::WriteBytes((repo / "blobs" / sha).string(), bytes);
    fs::create_symlink(fs::path("../../blobs") / sha, snapshot / name);
  }
  auto c = TorchCheckpoint::Open(snapshot.string());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->files().size(), 2u);
  EXPECT_EQ(ReadAllOf(**c, "y"), F32Bytes({2}));

  // A shard resolving outside the repository is still an escape.
  testing::WriteBytes(tmp.Join("elsewhere.bin"), one("y", 3));
  fs::remove(snapshot / "pytorch_model-00002-of-00002.bin");
  fs::create_symlink(fs::path(tmp.path()) / "elsewhere.bin",
                     snapshot / "pytorch_model-00002-of-00002.bin");
  EXPECT_TRUE(Fails(TorchCheckpoint::Open(snapshot.string()).status(), Code::kIndexPathEscape,
                    "outside the checkpoint directory"));
}

TEST(TorchCheckpoint, EveryTruncationOfAZipOrLegacyFileEndsCleanly) {
  const std::string zip = MakeTorchZip(ModelPickle(false).bytes(), {{"0", kW}, {"1", kB}});
  const std::string legacy = MakeLegacy(ModelPickle(true).bytes(), {{"1", 3, kB}, {"0", 6, kW}});
  for (const std::string* full : {&zip, &legacy}) {
    for (size_t n = 0; n < full->size(); ++n) {
      MemoryEnv env;
      env.AddFile("m.pt", full->substr(0, n));
      auto c = OpenIn(env, "m.pt");
      ASSERT_FALSE(c.ok()) << n;
      EXPECT_FALSE(c.status().message().empty());
    }
  }
}

// A flipped byte anywhere either makes Open fail with an error of the format (never an internal
// error or a bad-argument one, always with a message), or gives a checkpoint whose every tensor
// lies inside its storage, whose size matches its shape, and which reads or fails cleanly.
bool IsFormatError(Code code) {
  const Category c = CategoryOf(code);
  return c == Category::kCorrupt || c == Category::kUnsupported || code == Code::kUnexpectedEof;
}

void ExpectTensorsInsideStorages(const TorchCheckpoint& c, size_t flipped) {
  for (size_t t = 0; t < c.tensors().size(); ++t) {
    const TorchTensor& tensor = c.tensors()[t];
    ASSERT_LT(tensor.storage, c.storages().size()) << flipped;
    const TorchStorage& storage = c.storages()[tensor.storage];
    EXPECT_LT(storage.file, c.files().size()) << flipped;
    auto bytes = TensorByteSize(tensor.dtype, tensor.shape);
    ASSERT_TRUE(bytes.ok()) << flipped;
    EXPECT_EQ(*bytes, tensor.byte_size) << flipped << " " << tensor.name;
    ASSERT_EQ(tensor.stride.size(), tensor.shape.size()) << flipped;
    if (tensor.byte_size == 0) continue;
    // The last element the view touches lies inside the storage.
    uint64_t last = tensor.storage_offset;
    for (size_t d = 0; d < tensor.shape.size(); ++d)
      last += (tensor.shape[d] - 1) * tensor.stride[d];
    const uint64_t element = DTypeBits(tensor.dtype) / 8;
    EXPECT_LE((last + 1) * element, storage.nbytes) << flipped << " " << tensor.name;
    std::vector<std::byte> out(static_cast<size_t>(tensor.byte_size));
    const Status read = c.ReadTensor(t, 0, out);
    if (!read.ok()) {
      EXPECT_TRUE(IsFormatError(read.code()) || read.code() == Code::kIoError) << read.ToString();
      EXPECT_FALSE(read.message().empty());
    }
  }
}

TEST(TorchCheckpoint, EveryByteFlipEndsCleanly) {
  const std::string legacy = MakeLegacy(ModelPickle(true).bytes(), {{"1", 3, kB}, {"0", 6, kW}});
  const std::string zip = MakeTorchZip(ModelPickle(false).bytes(), {{"0", kW}, {"1", kB}});
  size_t opened = 0, refused = 0;
  for (const std::string* full : {&zip, &legacy}) {
    for (size_t i = 0; i < full->size(); ++i) {
      std::string bytes = *full;
      bytes[i] = static_cast<char>(bytes[i] ^ 0x24);
      MemoryEnv env;
      env.AddFile("m.pt", bytes);
      auto c = OpenIn(env, "m.pt");
      if (!c.ok()) {
        ++refused;
        EXPECT_TRUE(IsFormatError(c.status().code())) << i << ": " << c.status().ToString();
        EXPECT_FALSE(c.status().message().empty()) << i;
        continue;
      }
      ++opened;
      ExpectTensorsInsideStorages(**c, i);
    }
  }
  // Both outcomes happen: flips in tensor data open fine, flips in structure are refused.
  EXPECT_GT(opened, 0u);
  EXPECT_GT(refused, 0u);
}

TEST(TorchCheckpoint, ReadTensorChecksItsArguments) {
  MemoryEnv env;
  env.AddFile("m.pt", MakeTorchZip(ModelPickle(false).bytes(), {{"0", kW}, {"1", kB}}));
  auto c = OpenIn(env, "m.pt");
  ASSERT_TRUE(c.ok());
  std::vector<std::byte> out(8);
  EXPECT_EQ((*c)->ReadTensor(99, 0, out).code(), Code::kInvalidArgument);
  EXPECT_EQ((*c)->ReadTensor(0, 20, out).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace tensorferry
