// One record entry: what profiling a key produced. Seed 001 keeps two answers per convolution,
// the fastest and the least-memory choice; we keep the whole ranked list so that a configuration
// that fails at run time (not supported at another batch size, out of memory) has a next choice.
//
// Format 2 stores cuDNN *engine configurations* (graph API: an engine's global index plus its
// knob choices), the unit PyTorch's own benchmark mode times and replays
// (aten/src/ATen/native/cudnn/Conv_v8.cpp). Format 1 stored legacy algorithm enums, a narrower
// and slower kernel set (issue 17: steady steps 2-3x slower than cudnn.benchmark's).
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "profile/conv_key.h"

namespace terra::profile {

// One knob choice of an engine: (cudnnBackendKnobType_t, value). Kept as plain integers so the
// torch-free core and the file need no cuDNN header.
struct Knob {
  int64_t type = 0;
  int64_t value = 0;
  auto operator<=>(const Knob&) const = default;
};

struct EngineConfig {
  int64_t engine = 0;       // CUDNN_ATTR_ENGINE_GLOBAL_INDEX
  std::vector<Knob> knobs;  // sorted by type; with `engine` this identifies the kernel
  std::string tag;          // human-readable name of the plan ("eng0_k2=1_k3=0"); informational
  std::vector<std::string> numerical_notes;  // cuDNN's numerical notes, e.g. "TENSOR_CORE"
  double time_ms = 0.0;          // at the profiled batch size (0 for untimed heuristic choices)
  uint64_t workspace_bytes = 0;  // at the profiled batch size

  // Same engine and knobs: the same kernel, whatever was measured.
  bool same_config(const EngineConfig& other) const { return engine == other.engine && knobs == other.knobs; }
  bool operator==(const EngineConfig&) const = default;
};

// The tag cudnn-frontend would print for an engine configuration; used when a provider has none.
std::string default_tag(int64_t engine, const std::vector<Knob>& knobs);

struct Entry {
  ConvKey key;
  int64_t profiled_batch = 0;
  std::vector<EngineConfig> configs;  // ranked: fastest first
  EngineConfig least_memory;          // one of `configs`, repeated so it survives hand edits

  bool operator==(const Entry&) const = default;
};

// Fastest first; ties broken by workspace, then by engine and knobs, so equal inputs give equal
// files. Keeps only the first (fastest) timing of a configuration; sorts each one's knobs.
void rank(std::vector<EngineConfig>& configs);

// Least workspace; ties broken by time. nullopt for an empty list.
std::optional<EngineConfig> least_memory(const std::vector<EngineConfig>& configs);

// Ranks `configs` and fills least_memory. nullopt when nothing was measured.
std::optional<Entry> make_entry(ConvKey key, int64_t batch, std::vector<EngineConfig> configs);

}  // namespace terra::profile
