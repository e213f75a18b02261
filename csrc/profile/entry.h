// One record entry: what profiling a key produced. Seed 001 keeps two answers per convolution,
// the fastest and the least-memory algorithm; we keep the whole ranked list so that an algorithm
// that fails at run time (not supported at another batch size, out of memory) has a next choice.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "profile/conv_key.h"

namespace terra::profile {

struct AlgoPerf {
  int algo = 0;                  // the cuDNN enum value (cudnnConvolutionFwdAlgo_t, ...)
  int math_type = 0;             // cudnnMathType_t it was timed with; cuDNN needs both to replay
  std::string name;              // informational, for people reading the file
  double time_ms = 0.0;          // at the profiled batch size
  uint64_t workspace_bytes = 0;  // at the profiled batch size

  bool same_algorithm(const AlgoPerf& other) const {
    return algo == other.algo && math_type == other.math_type;
  }
  bool operator==(const AlgoPerf&) const = default;
};

struct Entry {
  ConvKey key;
  int64_t profiled_batch = 0;
  std::vector<AlgoPerf> algorithms;  // ranked: fastest first
  AlgoPerf least_memory;             // one of `algorithms`, repeated so it survives truncation

  bool operator==(const Entry&) const = default;
};

// Fastest first; ties broken by workspace, then by algorithm, so equal inputs give equal files.
// Keeps only the first (fastest) timing of an (algo, math_type) pair.
void rank(std::vector<AlgoPerf>& algorithms);

// Least workspace; ties broken by time. nullopt for an empty list.
std::optional<AlgoPerf> least_memory(const std::vector<AlgoPerf>& algorithms);

// Ranks `algorithms` and fills least_memory. nullopt when nothing was measured.
std::optional<Entry> make_entry(ConvKey key, int64_t batch, std::vector<AlgoPerf> algorithms);

}  // namespace terra::profile
