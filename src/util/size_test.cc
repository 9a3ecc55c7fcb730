// ParseSize and FormatBytes (tensorferry/size.h).
#include "tensorferry/size.h"

#include <gtest/gtest.h>

namespace tensorferry {
namespace {

TEST(ParseSize, UnitsAndForms) {
  EXPECT_EQ(ParseSize("4096"), 4096u);
  EXPECT_EQ(ParseSize("0"), 0u);
  EXPECT_EQ(ParseSize("1KB"), 1000u);
  EXPECT_EQ(ParseSize("1k"), 1000u);
  EXPECT_EQ(ParseSize("1KiB"), 1024u);
  EXPECT_EQ(ParseSize("8MiB"), 8u << 20);
  EXPECT_EQ(ParseSize("256MB"), 256000000u);
  EXPECT_EQ(ParseSize("2gib"), 2ull << 30);
  EXPECT_EQ(ParseSize("1.5GB"), 1500000000u);
  EXPECT_EQ(ParseSize("1.5 GiB"), 3ull << 29);  // a space before the unit is ignored
  EXPECT_EQ(ParseSize("12B"), 12u);
  EXPECT_EQ(ParseSize("1E"), 1000000000000000000u);
  EXPECT_EQ(ParseSize("18446744073709551615"), UINT64_MAX - 0);
  // Fractions round to the nearest byte, above 2^63 too (no signed overflow).
  EXPECT_EQ(ParseSize("9.5E"), 9500000000000000000u);
  EXPECT_EQ(ParseSize("17.5E"), 17500000000000000000u);
  EXPECT_EQ(ParseSize("0.6"), 1u);
  EXPECT_EQ(ParseSize("0.0"), 0u);
}

TEST(ParseSize, RefusesWhatIsNotASize) {
  for (const char* bad : {"", "lots", "MB", ".", "1.2.3", "1XB", "1KiBB", "-1", "1 K B x",
                          "18446744073709551616", "16EiB", "1e3", "18.5E", "19E", "0.4"}) {
    EXPECT_FALSE(ParseSize(bad).has_value()) << bad;
  }
}

TEST(FormatBytes, DecimalUnitsTwoDecimals) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(999), "999 B");
  EXPECT_EQ(FormatBytes(1000), "1.00 KB");
  EXPECT_EQ(FormatBytes(512000), "512.00 KB");
  EXPECT_EQ(FormatBytes(4294967296ull), "4.29 GB");
  // No "1000.00 MB": the unit switches where the rounded value would reach 1000.
  EXPECT_EQ(FormatBytes(999999999), "1.00 GB");
  EXPECT_EQ(FormatBytes(UINT64_MAX), "18.45 EB");
}

TEST(FormatBytes, ParsesBackToAboutTheSameSize) {
  for (uint64_t v : {1ull, 1234ull, 5000000ull, 7ull << 30, 123456789012345ull}) {
    const auto back = ParseSize(FormatBytes(v));
    ASSERT_TRUE(back.has_value()) << FormatBytes(v);
    EXPECT_NEAR(static_cast<double>(*back), static_cast<double>(v), static_cast<double>(v) * 0.01);
  }
}

}  // namespace
}  // namespace tensorferry
