#include "runtime/early_batches.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <string>

namespace {

using terra::runtime::EarlyBatchPolicy;

// The policy's answers for iterations that start with these running counts of read waits, one
// letter per iteration: 'E' sends early, '.' does not.
std::string answers(EarlyBatchPolicy& policy, std::initializer_list<int64_t> read_waits) {
  std::string out;
  for (const int64_t w : read_waits) out += policy.next_iteration(w) ? 'E' : '.';
  return out;
}

TEST(EarlyBatchPolicy, NoReadWaitNoEarlyBatches) {
  EarlyBatchPolicy policy(true, 4);
  EXPECT_EQ(answers(policy, {0, 0, 0, 0, 0, 0}), "......");
}

TEST(EarlyBatchPolicy, AWaitKeepsEarlyBatchesForTheMemoryThenStops) {
  EarlyBatchPolicy policy(true, 4);
  // The iteration before the second waited once: four iterations send early, even though sending
  // early keeps them from waiting (the count stays at 1), and the fifth does not.
  EXPECT_EQ(answers(policy, {0, 1, 1, 1, 1, 1, 1}), ".EEEE..");
  // A new wait starts the memory again, from its full length.
  EXPECT_EQ(answers(policy, {3, 3, 4, 4, 4, 4, 4}), "EEEEEE.");
}

TEST(EarlyBatchPolicy, MemoryOfOneIsThePreviousIterationOnly) {
  EarlyBatchPolicy policy(true, 1);
  EXPECT_EQ(answers(policy, {1, 1, 2, 2}), "E.E.");
  EarlyBatchPolicy below_one(true, 0);  // (a memory below one is one)
  EXPECT_EQ(answers(below_one, {1, 1}), "E.");
}

TEST(EarlyBatchPolicy, SwitchedOffNeverSendsEarly) {
  EarlyBatchPolicy policy(false, 16);
  EXPECT_EQ(answers(policy, {1, 2, 3, 4, 5}), ".....");
}

}  // namespace
