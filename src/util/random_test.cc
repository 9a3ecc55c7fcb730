// Random bits for unique names (util/random.h).
#include "util/random.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace tensorferry::util {
namespace {

TEST(Random, HexIsSixteenLowercaseDigits) {
  for (uint64_t salt = 0; salt < 8; ++salt) {
    const std::string hex = RandomHex(salt);
    ASSERT_EQ(hex.size(), 16u);
    EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos) << hex;
  }
}

TEST(Random, CallsDiffer) {
  std::set<uint64_t> seen;
  for (uint64_t salt = 0; salt < 100; ++salt) seen.insert(RandomBits(salt));
  EXPECT_EQ(seen.size(), 100u);
}

}  // namespace
}  // namespace tensorferry::util
