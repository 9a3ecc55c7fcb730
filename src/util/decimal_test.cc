#include "util/decimal.h"

#include <gtest/gtest.h>

namespace tensorferry {
namespace {

TEST(ParseDecimal, DigitsOnly) {
  EXPECT_EQ(ParseDecimal("0"), 0u);
  EXPECT_EQ(ParseDecimal("00042"), 42u);
  EXPECT_EQ(ParseDecimal("18446744073709551615"), UINT64_MAX);
  for (const char* bad : {"", " 1", "1 ", "+1", "-1", "0x10", "1.5", "1e3", "١",
                          "18446744073709551616", "99999999999999999999999"}) {
    EXPECT_FALSE(ParseDecimal(bad).has_value()) << bad;
  }
}

TEST(ParseDecimal, Bound) {
  EXPECT_EQ(ParseDecimal("4294967295", UINT32_MAX), UINT32_MAX);
  EXPECT_FALSE(ParseDecimal("4294967296", UINT32_MAX).has_value());
  EXPECT_EQ(ParseDecimal("65535", 65535), 65535u);
  EXPECT_FALSE(ParseDecimal("65536", 65535).has_value());
}

}  // namespace
}  // namespace tensorferry
