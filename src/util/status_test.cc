// Status, Result, codes and categories (tensorferry/status.h, util/status.cc), and the
// propagation macros of util/macros.h.
#include "tensorferry/status.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "util/macros.h"

namespace tensorferry {
namespace {

TEST(Status, OkAndErrors) {
  EXPECT_TRUE(Status::Ok().ok());
  EXPECT_EQ(Status::Ok().code(), Code::kOk);
  EXPECT_EQ(Status::Ok().message(), "");
  EXPECT_EQ(Status::Ok().ToString(), "ok");
  EXPECT_TRUE(Status(Code::kOk, "ignored").ok());
  const Status s(Code::kNotFound, "no such tensor 'x'");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kNotFound);
  EXPECT_EQ(s.ToString(), std::string(CodeName(Code::kNotFound)) + ": no such tensor 'x'");
  EXPECT_EQ(s.WithPrefix("a.safetensors").message(), "a.safetensors: no such tensor 'x'");
  EXPECT_EQ(s.WithPrefix("").message(), s.message());
  EXPECT_TRUE(Status::Ok().WithPrefix("x").ok());
}

TEST(Status, EveryCodeHasANameAndACategory) {
  std::set<std::string_view> names;
  int named = 0;
  for (int v = 0; v < 1024; ++v) {
    const Code code = static_cast<Code>(v);
    const std::string_view name = CodeName(code);
    if (name == "unknown") continue;
    ++named;
    EXPECT_TRUE(names.insert(name).second) << "two codes named " << name;
    EXPECT_NE(CategoryName(CategoryOf(code)), "unknown") << name;
    EXPECT_EQ(CategoryOf(code) == Category::kOk, code == Code::kOk) << name;
  }
  EXPECT_GT(named, 50);
  EXPECT_EQ(CategoryOf(Code::kIoError), Category::kIo);
  EXPECT_EQ(CategoryOf(Code::kPickleRefusedGlobal), Category::kUnsupported);
  EXPECT_EQ(CategoryOf(Code::kBudgetExceeded), Category::kBudget);
  EXPECT_EQ(CategoryOf(Code::kCancelled), Category::kCancelled);
}

Result<int> Half(int v) {
  if (v % 2 != 0) return Status(Code::kInvalidArgument, "odd: " + std::to_string(v));
  return v / 2;
}

Result<int> Quarter(int v) {
  TF_ASSIGN_OR_RETURN(const int half, Half(v));
  TF_ASSIGN_OR_RETURN(const int quarter, Half(half));
  return quarter;
}

Status CheckQuarter(int v) {
  TF_RETURN_IF_ERROR(Quarter(v).status());
  return Status::Ok();
}

TEST(Status, ResultAndMacros) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().message(), "odd: 3");
  EXPECT_TRUE(CheckQuarter(4).ok());
  EXPECT_EQ(CheckQuarter(2).code(), Code::kInvalidArgument);
  Result<std::string> r = std::string("v");
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r->size(), 1u);
  EXPECT_THROW(Result<int>(Status(Code::kInternal, "x")).ValueOrThrow(), Error);
  // A Result built from an OK status is an internal error, not a value.
  EXPECT_EQ(Result<int>(Status::Ok()).status().code(), Code::kInternal);
}

}  // namespace
}  // namespace tensorferry
