// When the Python side sends its batch of posts before the batch fills.
//
// Python batches its posts (PythonRunner::post) so that a graph busy with earlier work is woken
// once per batch. But a graph that has caught up (at a read, say) sits idle waiting for one post
// Python still holds; held back, that post kept the graph idle until the batch filled or Python
// read again, and that read then waited for all the work the batch had held back. So in a
// program that reads, a batch goes at once when the graph waits for one of its posts. In one that
// never reads, early batches only make the two threads hand the channel back and forth per post
// (quick-suite `mutation`: 0.595 -> 0.649 ms per step), and one whose Python waits only for the
// bound on iterations in flight has a graph that is the slower side anyway.
//
// The policy, worked through: iteration 7 reads a value the graph has not published, so Python
// waits; iterations 8 to 8 + memory - 1 send early. If sending early is what keeps them from
// waiting, the policy must not take that as a sign that the program stopped reading: with a
// memory of one iteration, every other iteration waited (quick-suite `branches`: 0.91x eager
// against 1.10x with the default memory of 16, `benchmarks.step_ab` with TERRA_EARLY_MEMORY=1).
// After `memory` iterations without a wait it stops, and the next wait turns it on again.
//
// Torch-free, so that test/cpp checks it without a build of the extension.
#pragma once

#include <cstdint>

namespace terra::runtime {

class EarlyBatchPolicy {
 public:
  static constexpr int kDefaultMemory = 16;

  explicit EarlyBatchPolicy(bool enabled = true, int memory = kDefaultMemory)
      : enabled_(enabled), memory_(memory < 1 ? 1 : memory) {}

  // Called at the start of each iteration with the count of reads Python has waited for so far
  // (it only grows); returns whether this iteration sends a batch early.
  bool next_iteration(int64_t read_waits) {
    if (read_waits != read_waits_seen_) {
      left_ = memory_;
    } else if (left_ > 0) {
      --left_;
    }
    read_waits_seen_ = read_waits;
    return send_early();
  }

  bool send_early() const { return enabled_ && left_ > 0; }

 private:
  bool enabled_;
  int memory_;
  int left_ = 0;  // iterations still sent early since the last one that waited for a read
  int64_t read_waits_seen_ = 0;
};

}  // namespace terra::runtime
