// The record key: batch excluded, transposed convolutions mapped onto cuDNN's three problems,
// and the fields that must change the key do.
#include <gtest/gtest.h>

#include "profile/conv_call.h"
#include "profile_test_util.h"

namespace terra::profile {
namespace {

using testing::resnet_call;

TEST(ProfileKey, ExcludesBatchButKeepsIt) {
  KeyedCall small = make_key(resnet_call(8), Pass::forward);
  KeyedCall large = make_key(resnet_call(256), Pass::forward);
  EXPECT_EQ(small.key, large.key);
  EXPECT_EQ(small.key.id(), large.key.id());
  EXPECT_EQ(small.batch, 8);
  EXPECT_EQ(large.batch, 256);
  EXPECT_EQ(small.key.input, (Dims{64, 56, 56}));
  EXPECT_EQ(small.key.filter, (Dims{64, 64, 3, 3}));
  EXPECT_TRUE(small.key.invalid_reason().empty()) << small.key.invalid_reason();
}

TEST(ProfileKey, RolesDiffer) {
  auto call = resnet_call(8);
  ConvKey fwd = make_key(call, Pass::forward).key;
  ConvKey bwd_data = make_key(call, Pass::grad_input).key;
  ConvKey bwd_filter = make_key(call, Pass::grad_weight).key;
  EXPECT_EQ(fwd.role, Role::forward);
  EXPECT_EQ(bwd_data.role, Role::backward_data);
  EXPECT_EQ(bwd_filter.role, Role::backward_filter);
  EXPECT_NE(fwd.id(), bwd_data.id());
  EXPECT_NE(bwd_data.id(), bwd_filter.id());
}

TEST(ProfileKey, EveryAttributeChangesTheKey) {
  const ConvKey base = make_key(resnet_call(8), Pass::forward).key;
  auto differs = [&](auto mutate) {
    ConvCall call = resnet_call(8);
    mutate(call);
    return make_key(call, Pass::forward).key.id() != base.id();
  };
  EXPECT_TRUE(differs([](ConvCall& c) { c.padding = {0, 0}; c.output = {8, 64, 54, 54}; }));
  EXPECT_TRUE(differs([](ConvCall& c) { c.stride = {2, 2}; c.output = {8, 64, 28, 28}; }));
  EXPECT_TRUE(differs([](ConvCall& c) { c.dilation = {2, 2}; c.padding = {2, 2}; }));
  EXPECT_TRUE(differs([](ConvCall& c) { c.groups = 2; c.weight = {64, 32, 3, 3}; }));
  EXPECT_TRUE(differs([](ConvCall& c) { c.dtype = "float16"; }));
  EXPECT_TRUE(differs([](ConvCall& c) { c.layout = "nhwc"; }));
  EXPECT_TRUE(differs([](ConvCall& c) { c.allow_tf32 = false; }));
  EXPECT_TRUE(differs([](ConvCall& c) { c.deterministic = true; }));
  EXPECT_FALSE(differs([](ConvCall& c) { c.input[0] = c.output[0] = 99; }));
}

TEST(ProfileKey, MathAndComputeTypeFollowPyTorchDescriptors) {
  EXPECT_EQ(default_compute_type("float16"), "float32");
  EXPECT_EQ(default_compute_type("bfloat16"), "float32");
  EXPECT_EQ(default_compute_type("float64"), "float64");
  EXPECT_EQ(default_math_mode("float16", false), "tensor_op");
  EXPECT_EQ(default_math_mode("float32", false), "fma");
  EXPECT_EQ(default_math_mode("float32", true), "default");
  EXPECT_EQ(default_math_mode("bfloat16", true), "default");
}

// ConvTranspose2d(32 -> 16, k=4, s=2, p=1): 8x8 -> 16x16. cuDNN runs its forward as the
// data-gradient of the convolution 16x16x16 -> 32x8x8 with the same filter.
TEST(ProfileKey, TransposedMapsOntoTheMirrorConvolution) {
  ConvCall t;
  t.input = {4, 32, 8, 8};
  t.weight = {32, 16, 4, 4};
  t.output = {4, 16, 16, 16};
  t.padding = {1, 1};
  t.stride = {2, 2};
  t.dilation = {1, 1};
  t.transposed = true;

  ConvCall mirror;
  mirror.input = {4, 16, 16, 16};
  mirror.weight = {32, 16, 4, 4};
  mirror.output = {4, 32, 8, 8};
  mirror.padding = {1, 1};
  mirror.stride = {2, 2};
  mirror.dilation = {1, 1};

  EXPECT_EQ(make_key(t, Pass::forward).key, make_key(mirror, Pass::grad_input).key);
  EXPECT_EQ(make_key(t, Pass::grad_input).key, make_key(mirror, Pass::forward).key);
  EXPECT_EQ(make_key(t, Pass::grad_weight).key, make_key(mirror, Pass::grad_weight).key);
  EXPECT_EQ(make_key(t, Pass::forward).key.role, Role::backward_data);
  EXPECT_EQ(make_key(t, Pass::forward).batch, 4);
  EXPECT_TRUE(make_key(t, Pass::forward).key.invalid_reason().empty());
}

TEST(ProfileKey, InvalidKeysAreNamed) {
  ConvKey key = make_key(resnet_call(8), Pass::forward).key;
  EXPECT_EQ(key.invalid_reason(), "");
  ConvKey bad_groups = key;
  bad_groups.groups = 3;
  EXPECT_NE(bad_groups.invalid_reason(), "");
  ConvKey bad_rank = key;
  bad_rank.padding = {1};
  EXPECT_NE(bad_rank.invalid_reason(), "");
  ConvKey bad_channels = key;
  bad_channels.output[0] = 65;
  EXPECT_NE(bad_channels.invalid_reason(), "");
  EXPECT_EQ(parse_role("backward_filter"), Role::backward_filter);
  EXPECT_FALSE(parse_role("sideways").has_value());
}

}  // namespace
}  // namespace terra::profile
