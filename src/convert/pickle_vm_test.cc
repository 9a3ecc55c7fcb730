#include "convert/pickle_vm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "testing/torch_builder.h"

namespace tensorferry::convert {
namespace {

using testing::PickleBuilder;

std::span<const std::byte> Span(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

Result<PickleResult> RunP(const PickleBuilder& p, const PickleLimits& limits = {},
                          PersistentIds pids = PersistentIds::kZip) {
  return RunPickle(Span(p.bytes()), limits, pids, "test.pkl");
}

::testing::AssertionResult Fails(const Result<PickleResult>& r, Code code,
                                 std::string_view needle) {
  if (r.ok()) return ::testing::AssertionFailure() << "accepted";
  if (r.status().code() != code) {
    return ::testing::AssertionFailure()
           << "code " << CodeName(r.status().code()) << ": " << r.status().message();
  }
  if (r.status().message().find(needle) == std::string::npos) {
    return ::testing::AssertionFailure()
           << "\"" << r.status().message() << "\" lacks \"" << needle << "\"";
  }
  return ::testing::AssertionSuccess();
}

// The value under string key `key` of the root dict.
Value Lookup(const PickleResult& r, std::string_view key) {
  const Object* d = r.As(r.root, Kind::kDict);
  EXPECT_NE(d, nullptr);
  if (d == nullptr) return Value::None();
  for (size_t i = 0; i + 1 < d->items.size(); i += 2) {
    const Object* k = r.As(d->items[i], Kind::kStr);
    if (k != nullptr && k->str == key) return d->items[i + 1];
  }
  ADD_FAILURE() << "no key " << key;
  return Value::None();
}

TEST(PickleVm, ScalarsStringsAndContainers) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Put(0).Mark();
  p.Str("i").Int(-5).Str("big").Int(70000).Str("neg").Int(-100000);
  p.Str("f").Float(0.25).Str("s").ShortStr("hé").Str("n").None().Str("t").Bool(true);
  p.Str("b").Bytes(std::string("\x00\xff", 2));
  p.Str("tup").Int(1).Int(2).Tuple(2).Str("lst").EmptyList().Mark().Int(3).Int(4).Appends();
  p.SetItems().Stop();
  auto r = RunP(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->protocol, 2);
  EXPECT_EQ(r->end, p.size());
  EXPECT_EQ(Lookup(*r, "i").i, -5);
  EXPECT_EQ(Lookup(*r, "big").i, 70000);
  EXPECT_EQ(Lookup(*r, "neg").i, -100000);
  EXPECT_EQ(Lookup(*r, "f").f, 0.25);
  EXPECT_EQ(r->object(Lookup(*r, "s")).str, "hé");
  EXPECT_EQ(Lookup(*r, "n").tag, Tag::kNone);
  EXPECT_TRUE(Lookup(*r, "t").b);
  EXPECT_EQ(r->object(Lookup(*r, "b")).str, std::string("\x00\xff", 2));
  EXPECT_EQ(r->object(Lookup(*r, "tup")).items.size(), 2u);
  const Object& lst = r->object(Lookup(*r, "lst"));
  ASSERT_EQ(lst.items.size(), 2u);
  EXPECT_EQ(lst.items[1].i, 4);
}

TEST(PickleVm, LongIntegers) {
  PickleBuilder p;
  p.Proto(2).EmptyList().Mark();
  p.Long1("");                                                      // 0
  p.Long1(std::string("\xff", 1));                                  // -1
  p.Long1(std::string("\x00\x80\x00", 3));                          // 32768
  p.Long1(std::string("\xff\xff\xff\xff\xff\xff\xff\x7f\x00", 9));  // INT64_MAX, 9 bytes
  p.Long1(std::string("\x00\x00\x00\x00\x00\x00\x00\x00\x01", 9));  // 2**64
  p.Long1(std::string("\x00\x00\x00\x00\x00\x00\x00\x00\xc0", 9));  // -2**70
  p.Appends().Stop();
  auto r = RunP(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Object& l = r->object(r->root);
  ASSERT_EQ(l.items.size(), 6u);
  EXPECT_EQ(l.items[0].i, 0);
  EXPECT_EQ(l.items[1].i, -1);
  EXPECT_EQ(l.items[2].i, 32768);
  EXPECT_EQ(l.items[3].i, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(BigIntToDecimal(r->object(l.items[4]).str), "18446744073709551616");
  EXPECT_EQ(BigIntToDecimal(r->object(l.items[5]).str), "-1180591620717411303424");
}

TEST(PickleVm, PythonFloatRepr) {
  const std::vector<std::pair<double, std::string>> cases = {
      {0.1, "0.1"},
      {1e-05, "1e-05"},
      {0.0001, "0.0001"},
      {1e16, "1e+16"},
      {1e15, "1000000000000000.0"},
      {100.0, "100.0"},
      {-0.0, "-0.0"},
      {0.0, "0.0"},
      {1.5, "1.5"},
      {-2.5e-7, "-2.5e-07"},
      {123456789.125, "123456789.125"},
      {5e-324, "5e-324"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {std::numeric_limits<double>::infinity(), "inf"},
      {-std::numeric_limits<double>::infinity(), "-inf"},
      {std::nan(""), "nan"},
  };
  for (const auto& [v, want] : cases) EXPECT_EQ(PythonFloatRepr(v), want) << v;
}

TEST(PickleVm, MemoForms) {
  PickleBuilder p;
  p.Proto(4).EmptyList().Memoize().ShortStr("x").Memoize().Put(300).Append();
  p.Get(300).Append().Get(1).Append().Get(0).Append().Stop();
  auto r = RunP(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Object& l = r->object(r->root);
  ASSERT_EQ(l.items.size(), 4u);
  EXPECT_EQ(r->object(l.items[2]).str, "x");  // MEMOIZE numbered it len(memo) == 1
  EXPECT_EQ(l.items[0].ref, l.items[2].ref);
  EXPECT_EQ(l.items[3].ref, r->root.ref);  // the list holds itself: no problem in an arena
  PickleBuilder bad;
  bad.Proto(2).Get(7).Stop();
  EXPECT_TRUE(
      Fails(RunP(bad), Code::kPickleMalformed, "memo key 7 was never set at pickle offset 2"));

  // Keys put out of order, then filled in, overwritten, and MEMOIZE numbering them as Python
  // does (len(memo)): a, b, c under keys 2, 0, 1; then d memoized as 3; then key 0 overwritten
  // by e, and f memoized as 4 (len(memo) is still 4 before it).
  PickleBuilder order;
  order.Proto(4).EmptyList();
  order.ShortStr("a").Put(2).Append().ShortStr("b").Put(0).Append().ShortStr("c").Put(1).Append();
  order.ShortStr("d").Memoize().Append().ShortStr("e").Put(0).Append().ShortStr("f").Memoize();
  order.Append();
  for (uint32_t key : {0u, 1u, 2u, 3u, 4u}) order.Get(key).Append();
  order.Stop();
  auto o = RunP(order);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  const Object& items = o->object(o->root);
  ASSERT_EQ(items.items.size(), 11u);
  std::string got;
  for (size_t i = 6; i < 11; ++i) got += o->object(items.items[i]).str;
  EXPECT_EQ(got, "ecadf");
  // A limit of 4 keys: 4 distinct keys fit, overwriting one of them too, the fifth does not.
  PickleLimits four;
  four.max_memo = 4;
  PickleBuilder fits;
  fits.Proto(4).None().Put(3).Put(1).Put(0).Put(2).Put(3).Memoize().Stop();
  EXPECT_TRUE(Fails(RunP(fits, four), Code::kPickleLimitExceeded, "max_memo (4)"));
  PickleBuilder overwrites;
  overwrites.Proto(4).None().Put(3).Put(1).Put(0).Put(2).Put(3).Put(0).Stop();
  EXPECT_TRUE(RunP(overwrites, four).ok());
}

TEST(PickleVm, TorchTensorAndStorage) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().Str("w");
  p.Tensor("FloatStorage", "0", 6, 1, {2, 2}, {1, 2});
  p.Str("s").Global("torch", "Size").Int(2).Int(3).Tuple(2).Tuple(1).Reduce();
  p.Str("d").Global("torch", "bfloat16");
  p.SetItems().Stop();
  auto r = RunP(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->storages.size(), 1u);
  EXPECT_EQ(r->storages[0].key, "0");
  EXPECT_EQ(r->storages[0].location, "cpu");
  EXPECT_EQ(r->storages[0].nbytes, 24u);
  ASSERT_EQ(r->tensors.size(), 1u);
  const TensorRecord& t = r->tensors[0];
  EXPECT_EQ(TorchDtypes()[t.dtype].name, "float32");
  EXPECT_EQ(t.offset, 1u);
  EXPECT_EQ(t.shape, (std::vector<uint64_t>{2, 2}));
  EXPECT_EQ(t.stride, (std::vector<uint64_t>{1, 2}));
  EXPECT_TRUE(r->object(Lookup(*r, "s")).torch_size);
  EXPECT_EQ(r->object(Lookup(*r, "d")).global, GlobalId::kTorchDtype);
}

TEST(PickleVm, RebuildTensorV3ParameterAndSharedKeys) {
  PickleBuilder p;
  p.Proto(2).EmptyList().Mark();
  // _rebuild_tensor_v3(UntypedStorage, 0, (3,), (1,), False, OrderedDict(), torch.uint16)
  p.Global("torch._utils", "_rebuild_tensor_v3").Mark();
  p.Storage("UntypedStorage", "k", 6).Int(0).Int(3).Tuple(1).Int(1).Tuple(1).Bool(false);
  p.OrderedDict().Global("torch", "uint16").Tuple().Reduce();
  // _rebuild_parameter(<tensor of the same key>, True, OrderedDict())
  p.Global("torch._utils", "_rebuild_parameter");
  p.Global("torch._utils", "_rebuild_tensor").Mark().Storage("UntypedStorage", "k", 6).Int(1);
  p.Int(5).Tuple(1).Int(1).Tuple(1).Tuple().Reduce();
  p.Bool(true).OrderedDict().Tuple(3).Reduce();
  p.Appends().Stop();
  auto r = RunP(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->storages.size(), 1u) << "one key is one storage";
  ASSERT_EQ(r->tensors.size(), 2u);
  EXPECT_EQ(TorchDtypes()[r->tensors[0].dtype].name, "uint16");
  EXPECT_EQ(TorchDtypes()[r->tensors[1].dtype].name, "uint8");
  EXPECT_TRUE(r->tensors[1].parameter);
  EXPECT_FALSE(r->tensors[0].parameter);
}

TEST(PickleVm, OrderedDictBuildAndCodecs) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark();
  p.Str("od").OrderedDict().Mark().Str("a").Int(1).SetItems();
  p.EmptyDict().Str("_metadata").OrderedDict().SetItem().Build();
  p.Str("od2").Global("collections", "OrderedDict").EmptyTuple().NewObj();
  p.Str("bytes").Global("_codecs", "encode").Str("ab\xc3\xbf").Str("latin1").Tuple(2).Reduce();
  p.SetItems().Stop();
  auto r = RunP(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Object& od = r->object(Lookup(*r, "od"));
  EXPECT_TRUE(od.ordered);
  EXPECT_EQ(od.items.size(), 2u) << "BUILD attributes are dropped, items kept";
  EXPECT_TRUE(r->object(Lookup(*r, "od2")).ordered);
  EXPECT_EQ(r->object(Lookup(*r, "bytes")).str, "ab\xff");
}

// --- refusals ------------------------------------------------------------------------------------

TEST(PickleVm, RefusesEveryGlobalOutsideTheAllowlist) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"os", "system"},
      {"posix", "system"},
      {"builtins", "eval"},
      {"builtins", "exec"},
      {"builtins", "__import__"},
      {"builtins", "getattr"},
      {"builtins", "open"},
      {"__builtin__", "eval"},
      {"subprocess", "Popen"},
      {"subprocess", "check_output"},
      {"copyreg", "_reconstructor"},
      {"functools", "partial"},
      {"torch", "load"},
      {"torch", "Tensor"},
      {"torch._utils", "_rebuild_device_tensor_from_numpy"},
      {"torch._utils", "_rebuild_from_type_v2"},
      {"torch.serialization", "_get_layout"},
      {"numpy.core.multiarray", "_reconstruct"},
      {"collections", "defaultdict"},
      {"torch.storage", "_load_from_bytes"},
      {"__main__", "Net"},
      {"torch.nn.modules.linear", "Linear"},
      {"_codecs", "decode"},
  };
  for (const auto& [module, name] : refused) {
    PickleBuilder p;
    p.Proto(2).Global(module, name).Stop();
    EXPECT_TRUE(Fails(RunP(p), Code::kPickleRefusedGlobal,
                      "test.pkl: refused global " + module + "." + name + " at pickle offset 2"))
        << module << "." << name;
    PickleBuilder q;
    q.Proto(4).StackGlobal(module, name).Stop();
    EXPECT_TRUE(Fails(RunP(q), Code::kPickleRefusedGlobal, "refused global " + module + "." + name))
        << module << "." << name;
  }
  // A name of megabytes is shown by its start and its length (cut between UTF-8 characters).
  std::string module = "m";
  for (int i = 0; i < 150; ++i) module += "\xc3\xa9";  // 301 bytes
  PickleBuilder big;
  big.Proto(2).Global(module, "Cls").Stop();
  Result<PickleResult> r = RunP(big);
  ASSERT_FALSE(r.ok());
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("refused global " + module.substr(0, 199) + "... (301 bytes).Cls"),
            std::string::npos)
      << m;
  EXPECT_LT(m.size(), 400u) << m;
}

TEST(PickleVm, RefusesNestedAndObfuscatedReductions) {
  // getattr(builtins, "eval")("...") as pickled by a __reduce__ chain: refused at getattr.
  PickleBuilder getattr_chain;
  getattr_chain.Proto(2).Global("builtins", "getattr").Global("builtins", "__builtins__");
  getattr_chain.Str("eval").Tuple(2).Reduce().Str("print(1)").Tuple(1).Reduce().Stop();
  EXPECT_TRUE(
      Fails(RunP(getattr_chain), Code::kPickleRefusedGlobal, "refused global builtins.getattr"));
  // A malicious reduction hidden inside an allowlisted tensor's arguments.
  PickleBuilder nested;
  nested.Proto(2).EmptyDict().Mark().Str("w").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  nested.Global("os", "system").Str("id").Tuple(1).Reduce();
  EXPECT_TRUE(Fails(RunP(nested), Code::kPickleRefusedGlobal, "refused global os.system"));
  // INST and OBJ import and call in one opcode.
  PickleBuilder inst;
  inst.Proto(2).Mark().Str("id").Op('i').Raw("os\nsystem\n").Stop();
  EXPECT_TRUE(
      Fails(RunP(inst), Code::kPickleRefusedGlobal, "refused INST os.system at pickle offset 10"));
  PickleBuilder inst_allowed;
  inst_allowed.Proto(2).Mark().Op('i').Raw("collections\nOrderedDict\n").Stop();
  EXPECT_TRUE(
      Fails(RunP(inst_allowed), Code::kPickleRefusedCall, "refused INST collections.OrderedDict"));
  PickleBuilder obj;
  obj.Proto(2).Mark().Global("collections", "OrderedDict").Op('o').Stop();
  EXPECT_TRUE(Fails(RunP(obj), Code::kPickleRefusedCall, "refused OBJ"));
  PickleBuilder ext;
  ext.Proto(2).Op(0x82).U8(7).Stop();
  EXPECT_TRUE(Fails(RunP(ext), Code::kPickleRefusedGlobal, "copyreg extension registry"));
}

TEST(PickleVm, RefusesCallsOutsideTheAllowlist) {
  struct Case {
    PickleBuilder p;
    std::string needle;
  };
  std::vector<Case> cases(11);
  cases[0].p.Proto(2).Global("torch", "FloatStorage").EmptyTuple().Reduce().Stop();
  cases[0].needle = "refused REDUCE of torch.FloatStorage";
  cases[1].p.Proto(2).EmptyTuple().EmptyTuple().Reduce().Stop();
  cases[1].needle = "refused REDUCE of tuple";
  cases[2].p.Proto(2).Global("torch", "Size").EmptyTuple().NewObj().Stop();
  cases[2].needle = "refused NEWOBJ of torch.Size";
  cases[3].p.Proto(2).EmptyDict().EmptyDict().Build().Stop();
  cases[3].needle = "refused BUILD on dict";
  cases[4].p.Proto(2).Global("collections", "OrderedDict").Str("x").Tuple(1).Reduce().Stop();
  cases[4].needle = "expects a list of (key, value) pairs";
  cases[5].p.Proto(2).OrderedDict().Int(3).Build().Stop();
  cases[5].needle = "refused BUILD on OrderedDict with a int state";
  cases[6].p.Proto(2).Global("_codecs", "encode").Str("x").Str("rot13").Tuple(2).Reduce().Stop();
  cases[6].needle = "only encode(str, 'latin1')";
  // The builtins protocol 2 pickles sets and bytes with take only what it pickles them from.
  cases[7].p.Proto(2).Global("__builtin__", "set").Str("abc").Tuple(1).Reduce().Stop();
  cases[7].needle = "expects a list, tuple, set or frozenset, not str";
  cases[8].p.Proto(2).Global("builtins", "bytearray").Int(10).Tuple(1).Reduce().Stop();
  cases[8].needle = "refused REDUCE of builtins.bytearray: expects bytes, not int";
  cases[9].p.Proto(2).Global("builtins", "bytes").Str("\xc4\x80").Str("latin1").Tuple(2);
  cases[9].p.Reduce().Stop();
  cases[9].needle = "a character above U+00FF is not latin1";
  // U+07FF: two bytes of UTF-8 too (lead DF), but not latin1 (was taken as its low byte).
  cases[10].p.Proto(2).Global("_codecs", "encode").Str("a\xdf\xbf").Str("latin1").Tuple(2);
  cases[10].p.Reduce().Stop();
  cases[10].needle = "a character above U+00FF is not latin1";
  for (const Case& c : cases) EXPECT_TRUE(Fails(RunP(c.p), Code::kPickleRefusedCall, c.needle));
}

TEST(PickleVm, RefusesTensorArgumentsItCannotRepresent) {
  auto tensor_with = [](const std::function<void(PickleBuilder&)>& tail) {
    PickleBuilder p;
    p.Proto(2).Global("torch._utils", "_rebuild_tensor_v2").Mark();
    p.Storage("FloatStorage", "0", 4).Int(0).Int(4).Tuple(1).Int(1).Tuple(1);
    tail(p);
    p.Tuple().Reduce().Stop();
    return p;
  };
  auto hooks =
      tensor_with([](PickleBuilder& p) { p.Bool(false).EmptyDict().Int(1).Int(2).SetItem(); });
  EXPECT_TRUE(Fails(RunP(hooks), Code::kPickleRefusedCall, "backward hooks must be empty"));
  auto meta = tensor_with([](PickleBuilder& p) {
    p.Bool(false).OrderedDict().EmptyDict().Str("neg").Bool(true).SetItem();
  });
  EXPECT_TRUE(Fails(RunP(meta), Code::kPickleRefusedCall, "tensor metadata"));
  auto few = tensor_with([](PickleBuilder& p) { p.Bool(false); });
  EXPECT_TRUE(Fails(RunP(few), Code::kPickleRefusedCall, "expects 6 or 7 arguments, got 5"));
}

TEST(PickleVm, RejectsViewsOutsideTheirStorage) {
  auto tensor = [](int64_t numel, int64_t offset, std::vector<int64_t> shape,
                   std::vector<int64_t> stride) {
    PickleBuilder p;
    p.Proto(2).Tensor("FloatStorage", "0", numel, offset, shape, stride).Stop();
    return RunP(p);
  };
  EXPECT_TRUE(tensor(6, 0, {2, 3}, {3, 1}).ok());
  EXPECT_TRUE(tensor(6, 5, {1}, {1}).ok());
  EXPECT_TRUE(tensor(6, 9, {0, 3}, {3, 1}).ok()) << "an empty view touches nothing";
  EXPECT_TRUE(Fails(tensor(6, 1, {2, 3}, {3, 1}), Code::kTorchBadTensor,
                    "(24 bytes) reaches byte 28 (offset 1 elements of 4 bytes)"));
  EXPECT_TRUE(Fails(tensor(6, 0, {3, 3}, {1, 3}), Code::kTorchBadTensor, "reaches byte 36"));
  EXPECT_TRUE(Fails(tensor(6, -1, {1}, {1}), Code::kTorchBadTensor, "negative storage offset"));
  EXPECT_TRUE(Fails(tensor(6, 0, {2}, {-1}), Code::kTorchBadTensor, "stride holds the negative"));
  EXPECT_TRUE(Fails(tensor(6, 0, {2, 2}, {1}), Code::kTorchBadTensor, "2 dimensions but stride 1"));
  EXPECT_TRUE(Fails(tensor(6, 0, {INT64_MAX, 2}, {INT64_MAX, 1}), Code::kTorchBadTensor,
                    "overflows 64 bits"));
}

TEST(PickleVm, RejectsBadPersistentIds) {
  struct Case {
    PickleBuilder p;
    std::string needle;
  };
  std::vector<Case> cases(7);
  cases[0].p.Proto(2).Str("0").PersId().Stop();
  cases[0].needle = "persistent id is a str, not a tuple";
  cases[1].p.Proto(2).Mark().Str("module").Str("x").Tuple().PersId().Stop();
  cases[1].needle = "must start with 'storage'";
  cases[2]
      .p.Proto(2)
      .Mark()
      .Str("storage")
      .Global("torch", "FloatStorage")
      .Str("0")
      .Tuple()
      .PersId()
      .Stop();
  cases[2].needle = "has 3 fields, expected 5";
  cases[3].p.Proto(2).Mark().Str("storage").Str("FloatStorage").Str("0").Str("cpu").Int(1).Tuple();
  cases[3].p.PersId().Stop();
  cases[3].needle = "storage type must be a torch storage class, not str";
  cases[4].p.Proto(2).Mark().Str("storage").Global("torch", "float32").Str("0").Str("cpu").Int(1);
  cases[4].p.Tuple().PersId().Stop();
  cases[4].needle = "storage type must be a torch storage class";
  cases[5].p.Proto(2).Storage("FloatStorage", "0", -1).Stop();
  cases[5].needle = "numel must be a non-negative int";
  cases[6].p.Proto(2).EmptyList().Mark().Storage("FloatStorage", "0", 4);
  cases[6].p.Storage("HalfStorage", "0", 4).Appends().Stop();
  cases[6].needle = "reuses storage key \"0\" with another type or size";
  for (const Case& c : cases) EXPECT_TRUE(Fails(RunP(c.p), Code::kPickleBadPersistentId, c.needle));

  PickleBuilder legacy_in_zip;
  legacy_in_zip.Proto(2).Storage("FloatStorage", "0", 4, /*legacy=*/true).Stop();
  EXPECT_TRUE(Fails(RunP(legacy_in_zip), Code::kPickleBadPersistentId, "6 fields, expected 5"));
  EXPECT_TRUE(RunP(legacy_in_zip, {}, PersistentIds::kLegacy).ok());
  PickleBuilder view;
  view.Proto(2).Mark().Str("storage").Global("torch", "FloatStorage").Str("0").Str("cpu").Int(4);
  view.Str("view").Tuple().PersId().Stop();
  EXPECT_TRUE(
      Fails(RunP(view, {}, PersistentIds::kLegacy), Code::kPickleBadPersistentId, "view metadata"));
  PickleBuilder none;
  none.Proto(2).Storage("FloatStorage", "0", 4).Stop();
  EXPECT_TRUE(Fails(RunP(none, {}, PersistentIds::kNone), Code::kPickleBadPersistentId,
                    "where none may appear"));
}

TEST(PickleVm, UnsupportedOpcodesAreNamed) {
  struct Case {
    std::string bytes;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {std::string("\x80\x06N.", 4), "unsupported pickle protocol 6"},
      {"I1\n.", "unsupported opcode INT (0x49) at pickle offset 0"},
      {"F1.0\n.", "unsupported opcode FLOAT"},
      {"S'x'\n.", "unsupported opcode STRING"},
      {"Vx\n.", "unsupported opcode UNICODE"},
      {"Np0\n.", "unsupported opcode PUT (0x70) at pickle offset 1"},
      {"g0\n.", "unsupported opcode GET"},
      {"P0\n.", "unsupported opcode PERSID"},
      {std::string("\x80\x05\x97.", 4), "unsupported opcode NEXT_BUFFER"},
      {std::string("\x80\x05N\x98.", 5), "unsupported opcode READONLY_BUFFER"},
      {"\xff.", "unknown opcode 0xff at pickle offset 0"},
  };
  for (const Case& c : cases) {
    PickleBuilder p;
    p.Raw(c.bytes);
    EXPECT_TRUE(Fails(RunP(p), Code::kPickleUnsupportedOpcode, c.needle)) << c.needle;
  }
}

TEST(PickleVm, MalformedPickles) {
  struct Case {
    std::string bytes;
    Code code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {".", Code::kPickleMalformed, "stack underflow at pickle offset 0"},
      {"\x85.", Code::kPickleMalformed, "stack underflow"},
      {"(N\x86.", Code::kPickleMalformed, "stack underflow"},  // TUPLE2 cannot cross a MARK
      {"1.", Code::kPickleMalformed, "no MARK to pop to"},
      {"t.", Code::kPickleMalformed, "no MARK"},
      {"]NNs.", Code::kPickleMalformed, "SETITEM: expects a dict below its operands, found list"},
      {"}Na.", Code::kPickleMalformed, "APPEND: expects a list"},
      {"(N\x90.", Code::kPickleMalformed, "stack underflow"},
      {"(NNNd.", Code::kPickleMalformed, "odd number of items"},
      {"}(Nu.", Code::kPickleMalformed, "odd number of items"},
      {std::string("X\x01\x00\x00\x00\xff.", 7), Code::kPickleMalformed, "not valid UTF-8"},
      {std::string("T\xff\xff\xff\xff.", 6), Code::kPickleMalformed, "negative length"},
      {std::string("\x8b\x00\x00\x00\x80.", 6), Code::kPickleMalformed, "negative length"},
      {"N\x93.", Code::kPickleMalformed, "stack underflow"},
      {"NN\x93.", Code::kPickleMalformed, "module and name must be str"},
      {"", Code::kPickleTruncated, "ends without STOP at pickle offset 0"},
      {"N", Code::kPickleTruncated, "ends without STOP at pickle offset 1"},
      {"X\x05\x00\x00\x00ab", Code::kPickleTruncated, "ends inside BINUNICODE"},
      {"cos\nsys", Code::kPickleTruncated, "ends inside GLOBAL"},
  };
  for (const Case& c : cases) {
    PickleBuilder p;
    p.Raw(c.bytes);
    EXPECT_TRUE(Fails(RunP(p), c.code, c.needle)) << c.needle;
  }
}

TEST(PickleVm, PopSemanticsAndFrames) {
  PickleBuilder p;  // MARK, POP (pops the mark), FRAME is skipped, DUP, POP_MARK
  p.Proto(4).Op(0x95).U64(6).Mark().Op('0').Int(1).Op('2').Mark().Int(9).Op('1').Tuple(2).Stop();
  auto r = RunP(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Object& t = r->object(r->root);
  ASSERT_EQ(t.items.size(), 2u);
  EXPECT_EQ(t.items[0].i, 1);
  EXPECT_EQ(t.items[1].i, 1);
  PickleBuilder bad_frame;
  bad_frame.Proto(4).Op(0x95).U64(1000).None().Stop();
  EXPECT_TRUE(Fails(RunP(bad_frame), Code::kPickleTruncated, "ends inside FRAME"));
}

TEST(PickleVm, EveryLimitIsEnforced) {
  auto limited = [](auto set) {
    PickleLimits l;
    set(l);
    return l;
  };
  PickleBuilder many;
  many.Proto(2);
  for (int i = 0; i < 10; ++i) many.None();
  many.Stop();
  EXPECT_TRUE(Fails(RunP(many, limited([](PickleLimits& l) { l.max_stack = 9; })),
                    Code::kPickleLimitExceeded,
                    "PickleLimits::max_stack (9) exceeded at pickle offset 11"));
  EXPECT_TRUE(RunP(many, limited([](PickleLimits& l) { l.max_stack = 10; })).ok());

  PickleBuilder marks;
  marks.Proto(2).Mark().Mark().Mark().None().Stop();
  EXPECT_TRUE(Fails(RunP(marks, limited([](PickleLimits& l) { l.max_marks = 2; })),
                    Code::kPickleLimitExceeded, "max_marks"));

  PickleBuilder memo;
  memo.Proto(2).None().Put(0).Put(1).Put(2).Stop();
  EXPECT_TRUE(Fails(RunP(memo, limited([](PickleLimits& l) { l.max_memo = 2; })),
                    Code::kPickleLimitExceeded, "max_memo (2)"));
  PickleBuilder memo_index;
  memo_index.Proto(2).None().Put(5000).Stop();
  EXPECT_TRUE(Fails(RunP(memo_index, limited([](PickleLimits& l) { l.max_memo_index = 4096; })),
                    Code::kPickleLimitExceeded, "max_memo_index"));

  PickleBuilder str;
  str.Proto(2).Str("abcdef").Stop();
  EXPECT_TRUE(Fails(RunP(str, limited([](PickleLimits& l) { l.max_string = 5; })),
                    Code::kPickleLimitExceeded, "max_string (5)"));
  PickleBuilder huge_claim;  // a length far beyond the input: limit or truncation, no allocation
  huge_claim.Proto(4).Op(0x8d).U64(UINT64_MAX).Stop();
  EXPECT_TRUE(Fails(RunP(huge_claim), Code::kPickleLimitExceeded, "max_string"));
  PickleBuilder long_line;
  long_line.Proto(2).Op('c').Raw(std::string(100, 'a'));
  EXPECT_TRUE(Fails(RunP(long_line, limited([](PickleLimits& l) { l.max_string = 50; })),
                    Code::kPickleLimitExceeded, "max_string"));

  PickleBuilder container;
  container.Proto(2).EmptyList().Mark().None().None().None().Appends().Stop();
  EXPECT_TRUE(Fails(RunP(container, limited([](PickleLimits& l) { l.max_container = 2; })),
                    Code::kPickleLimitExceeded, "max_container (2)"));
  PickleBuilder appends;
  appends.Proto(2).EmptyList().None().Append().None().Append().None().Append().Stop();
  EXPECT_TRUE(Fails(RunP(appends, limited([](PickleLimits& l) { l.max_container = 2; })),
                    Code::kPickleLimitExceeded, "max_container"));
  EXPECT_TRUE(Fails(RunP(container, limited([](PickleLimits& l) { l.max_total_items = 2; })),
                    Code::kPickleLimitExceeded, "max_total_items (2)"));

  PickleBuilder objects;
  objects.Proto(2).EmptyList().EmptyList().EmptyList().Stop();
  EXPECT_TRUE(Fails(RunP(objects, limited([](PickleLimits& l) { l.max_objects = 2; })),
                    Code::kPickleLimitExceeded, "max_objects (2)"));

  PickleBuilder rank;
  rank.Proto(2).Tensor("FloatStorage", "0", 1, 0, {1, 1, 1}, {1, 1, 1}).Stop();
  EXPECT_TRUE(Fails(RunP(rank, limited([](PickleLimits& l) { l.max_rank = 2; })),
                    Code::kPickleLimitExceeded, "max_rank (2)"));

  PickleBuilder big;
  big.Proto(2).EmptyList().Mark();
  for (int i = 0; i < 100; ++i) big.Int(i);
  big.Appends().Stop();
  EXPECT_TRUE(Fails(RunP(big, limited([](PickleLimits& l) { l.max_pickle_size = 50; })),
                    Code::kPickleLimitExceeded, "max_pickle_size (50)"));
  PickleLimits exact;
  exact.max_pickle_size = big.size();
  EXPECT_TRUE(RunP(big, exact).ok());
}

// The decimal text of two's complement little-endian bytes, digit by digit (the reference).
std::string SlowDecimal(std::string_view le) {
  std::vector<uint8_t> mag(le.begin(), le.end());
  const bool negative = !mag.empty() && (mag.back() & 0x80) != 0;
  if (negative) {
    unsigned carry = 1;
    for (auto& b : mag) {
      const unsigned x = static_cast<uint8_t>(~b) + carry;
      b = static_cast<uint8_t>(x);
      carry = x >> 8;
    }
  }
  std::vector<uint8_t> be(mag.rbegin(), mag.rend());
  std::string digits;
  while (!be.empty()) {
    unsigned rem = 0;
    std::vector<uint8_t> q;
    for (uint8_t b : be) {
      const unsigned cur = rem * 256 + b;
      rem = cur % 10;
      if (!q.empty() || cur / 10 != 0) q.push_back(static_cast<uint8_t>(cur / 10));
    }
    digits.push_back(static_cast<char>('0' + rem));
    be = std::move(q);
  }
  if (digits.empty()) digits = "0";
  if (negative) digits.push_back('-');
  return std::string(digits.rbegin(), digits.rend());
}

TEST(PickleVm, BigIntegersPrintAsTheReferenceDoes) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 400; ++i) {
    std::string le(1 + rng() % (i < 200 ? 24 : 1786), '\0');
    for (char& c : le) c = static_cast<char>(rng());
    if (i % 5 == 0) le.back() = 0;                              // leading zero bytes
    if (i % 7 == 0) std::fill(le.begin(), le.end() - 1, '\0');  // a power of 256
    EXPECT_EQ(BigIntToDecimal(le), SlowDecimal(le)) << i;
  }
  EXPECT_EQ(BigIntToDecimal(std::string("\0\0\0\0\0\0\0\0\0", 9)), "0");
  EXPECT_EQ(BigIntToDecimal(std::string("\x00\xca\x9a\x3b", 4)), "1000000000");
}

TEST(PickleVm, HugeIntegersAreRefusedBeforeAnyWork) {
  // The largest accepted integer: 1786 bytes, ~4300 decimal digits.
  PickleBuilder ok;
  ok.Proto(2).Op(0x8b).U32(1786).Raw(std::string(1785, '\x11') + '\x01').Stop();
  auto r = RunP(ok);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const std::string digits = BigIntToDecimal(r->object(r->root).str);
  EXPECT_GE(digits.size(), 4290u);
  EXPECT_LE(digits.size(), 4301u);
  // One byte more, and 256 KiB (which took minutes to print): refused at the opcode, naming it,
  // the size and the offset, inside a container too.
  for (const uint32_t n : {1787u, 256u << 10}) {
    PickleBuilder big;
    big.Proto(2).EmptyDict().Str("k").Op(0x8b).U32(n).Raw(std::string(n, '\x7f')).SetItem().Stop();
    EXPECT_TRUE(Fails(RunP(big), Code::kPickleLimitExceeded,
                      "LONG4: an integer of " + std::to_string(n) +
                          " bytes exceeds PickleLimits::max_int_bytes (1786; integers of more "
                          "than 4300 decimal digits"));
    EXPECT_TRUE(Fails(RunP(big), Code::kPickleLimitExceeded, "at pickle offset 9"));
  }
  PickleBuilder as_key;  // LONG1 as a dict key, with a lowered limit
  as_key.Proto(2).EmptyDict().Long1(std::string(20, '\x01')).None().SetItem().Stop();
  PickleLimits l;
  l.max_int_bytes = 16;
  EXPECT_TRUE(Fails(RunP(as_key, l), Code::kPickleLimitExceeded, "LONG1: an integer of 20 bytes"));
}

TEST(PickleVm, EmulatedCallsCopyAtMostThePicklesSize) {
  // A list of 1000 pairs, memoized, then OrderedDict(pairs) called again and again: each call
  // costs 5 bytes of pickle and copies 2000 items.
  const auto calls = [](int n) {
    PickleBuilder p;
    p.Proto(2).EmptyList().Put(0).Mark();
    for (int i = 0; i < 1000; ++i) p.Int(i % 200).Int(i % 100).Tuple(2);
    p.Appends().Op('0');
    p.Global("collections", "OrderedDict").Put(1).Op('0');
    p.EmptyList().Mark();
    for (int i = 0; i < n; ++i) p.Get(1).Get(0).Tuple(1).Reduce();
    p.Appends().Stop();
    return p;
  };
  EXPECT_TRUE(RunP(calls(1)).ok());
  EXPECT_TRUE(Fails(RunP(calls(1000)), Code::kPickleLimitExceeded,
                    "copy more than the pickle's size plus PickleLimits::copy_allowance"));
  // _codecs.encode of one memoized 64 KiB string, 100 times.
  PickleBuilder enc;
  enc.Proto(2).Str(std::string(64 << 10, 'a')).Put(0).Op('0');
  enc.Global("_codecs", "encode").Put(1).Op('0').Str("latin1").Put(2).Op('0');
  enc.EmptyList().Mark();
  for (int i = 0; i < 100; ++i) enc.Get(1).Get(0).Get(2).Tuple(2).Reduce();
  enc.Appends().Stop();
  EXPECT_TRUE(Fails(RunP(enc), Code::kPickleLimitExceeded, "PickleLimits::copy_allowance"));
}

TEST(PickleVm, MessagesUsePythonTypeNames) {
  PickleBuilder p;  // STACK_GLOBAL of None and a tensor
  p.Proto(2).None().Tensor("FloatStorage", "0", 1, 0, {1}, {1}).Op(0x93).Stop();
  EXPECT_TRUE(Fails(RunP(p), Code::kPickleMalformed, "must be str, not NoneType and Tensor"));
  PickleBuilder g;  // a global is named by its own name
  g.Proto(2).Global("torch", "FloatStorage").EmptyTuple().Reduce().Stop();
  EXPECT_TRUE(Fails(RunP(g), Code::kPickleRefusedCall, "REDUCE of torch.FloatStorage"));
}

// A pickle shaped like torch.save's, used for truncation and corruption sweeps.
PickleBuilder StateDictPickle() {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Put(0).Mark();
  p.Str("model.w").Put(1).Tensor("FloatStorage", "0", 6, 0, {2, 3}, {3, 1}).Put(2);
  p.Str("model.b").Tensor("HalfStorage", "1", 3, 0, {3}, {1});
  p.Str("step").Int(10).Str("lr").Float(1e-3).Str("alias").Get(2);
  p.SetItems().Stop();
  return p;
}

TEST(PickleVm, EveryTruncationIsAnErrorNeverACrash) {
  const PickleBuilder full = StateDictPickle();
  ASSERT_TRUE(RunP(full).ok());
  for (size_t n = 0; n < full.size(); ++n) {
    PickleBuilder cut;
    cut.Raw(std::string_view(full.bytes()).substr(0, n));
    auto r = RunP(cut);
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), Code::kPickleTruncated) << n << ": " << r.status().message();
  }
}

TEST(PickleVm, EveryByteFlipEndsCleanly) {
  const PickleBuilder full = StateDictPickle();
  for (size_t i = 0; i < full.size(); ++i) {
    for (uint8_t x : {0x01, 0x80, 0xff}) {
      std::string bytes = full.bytes();
      bytes[i] = static_cast<char>(bytes[i] ^ x);
      auto r = RunPickle(Span(bytes), {}, PersistentIds::kZip, "flip");
      if (!r.ok()) {
        // An error of the pickle's own (truncated, malformed, refused, over a limit), with a
        // message: never an internal or bad-argument error.
        const Category c = CategoryOf(r.status().code());
        EXPECT_TRUE(c == Category::kCorrupt || c == Category::kUnsupported)
            << i << ": " << r.status().ToString();
        EXPECT_FALSE(r.status().message().empty());
      }
    }
  }
}

}  // namespace
}  // namespace tensorferry::convert
