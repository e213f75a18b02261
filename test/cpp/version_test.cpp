#include "common/version.h"

#include <gtest/gtest.h>

namespace terra {
namespace {

TEST(Version, ParsesTorchStyleStrings) {
  auto v = parse_version("2.13.0+cpu");
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->major, 2);
  EXPECT_EQ(v->minor, 13);
  EXPECT_EQ(v->patch, 0);

  auto nightly = parse_version("2.14.0a0+git1234abc");
  ASSERT_TRUE(nightly.has_value());
  EXPECT_EQ(nightly->minor, 14);

  auto two_parts = parse_version("2.11");
  ASSERT_TRUE(two_parts.has_value());
  EXPECT_EQ(two_parts->patch, 0);
}

TEST(Version, RejectsGarbage) {
  EXPECT_FALSE(parse_version("").has_value());
  EXPECT_FALSE(parse_version("torch").has_value());
  EXPECT_FALSE(parse_version("2").has_value());
  EXPECT_FALSE(parse_version("2.").has_value());
  EXPECT_FALSE(parse_version(".13").has_value());
}

TEST(Version, OrdersNumericallyNotLexically) {
  EXPECT_LT(*parse_version("2.9.1"), *parse_version("2.11.0"));
  EXPECT_LT(*parse_version("2.13.0"), *parse_version("2.13.1"));
  EXPECT_GT(*parse_version("3.0"), *parse_version("2.99.99"));
}

TEST(Version, SameMinorReleaseIgnoresPatchAndSuffix) {
  EXPECT_TRUE(same_minor_release(*parse_version("2.13.0+cpu"), *parse_version("2.13.1")));
  EXPECT_FALSE(same_minor_release(*parse_version("2.13.0"), *parse_version("2.14.0")));
  EXPECT_EQ(parse_version("2.13.7+cu130")->str(), "2.13.7");
}

}  // namespace
}  // namespace terra
