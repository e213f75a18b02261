#include "runtime/early_batches.h"

#include <gtest/gtest.h>

namespace {

using terra::runtime::EarlyBatchPolicy;

TEST(EarlyBatchPolicy, NoReadWaitNoEarlyBatches) {
  EarlyBatchPolicy policy(true, 4);
  for (int i = 0; i < 10; ++i) EXPECT_FALSE(policy.next_iteration(0)) << i;
}

TEST(EarlyBatchPolicy, AWaitKeepsEarlyBatchesForTheMemoryThenStops) {
  EarlyBatchPolicy policy(true, 4);
  EXPECT_FALSE(policy.next_iteration(0));
  // The iteration before waited once: four iterations send early, even though sending early
  // keeps them from waiting (the count stays at 1), and the fifth does not.
  EXPECT_TRUE(policy.next_iteration(1));
  EXPECT_TRUE(policy.next_iteration(1));
  EXPECT_TRUE(policy.next_iteration(1));
  EXPECT_TRUE(policy.next_iteration(1));
  EXPECT_FALSE(policy.next_iteration(1));
  EXPECT_FALSE(policy.next_iteration(1));
  // A new wait starts the memory again, from its full length.
  EXPECT_TRUE(policy.next_iteration(3));
  EXPECT_TRUE(policy.next_iteration(3));
  EXPECT_TRUE(policy.next_iteration(4));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(policy.next_iteration(4)) << i;
  EXPECT_FALSE(policy.next_iteration(4));
}

TEST(EarlyBatchPolicy, MemoryOfOneIsThePreviousIterationOnly) {
  EarlyBatchPolicy policy(true, 1);
  EXPECT_TRUE(policy.next_iteration(1));
  EXPECT_FALSE(policy.next_iteration(1));
  EXPECT_TRUE(policy.next_iteration(2));
  EXPECT_FALSE(policy.next_iteration(2));
  EXPECT_EQ(EarlyBatchPolicy(true, 0).next_iteration(1), true);  // a memory below one is one
}

TEST(EarlyBatchPolicy, SwitchedOffNeverSendsEarly) {
  EarlyBatchPolicy policy(false, 16);
  for (int i = 1; i < 10; ++i) EXPECT_FALSE(policy.next_iteration(i)) << i;
}

}  // namespace
