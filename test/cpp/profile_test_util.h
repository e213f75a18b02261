// Helpers shared by the Profile* GoogleTests: a scratch directory and keys/headers to play with.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "profile/conv_call.h"
#include "profile/entry.h"
#include "profile/record_header.h"

namespace terra::profile::testing {

// A fresh directory under $TMPDIR, removed with its contents at the end of the test.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "terra_profile_XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline RecordHeader h200() {
  RecordHeader h;
  h.device_name = "NVIDIA H200";
  h.compute_capability = "9.0";
  h.cudnn_version = 92400;
  h.cuda_version = 13000;
  h.torch_version = "2.14.1";
  return h;
}

// A 3x3 convolution of a 64-channel 56x56 image: ResNet's most common layer.
inline ConvCall resnet_call(int64_t batch, int64_t channels = 64) {
  ConvCall call;
  call.input = {batch, channels, 56, 56};
  call.weight = {channels, channels, 3, 3};
  call.output = {batch, channels, 56, 56};
  call.padding = {1, 1};
  call.stride = {1, 1};
  call.dilation = {1, 1};
  return call;
}

// An engine configuration as a provider would report it.
inline EngineConfig config(int64_t engine, double time_ms, uint64_t workspace, std::vector<Knob> knobs = {},
                           std::vector<std::string> notes = {}) {
  EngineConfig c;
  c.engine = engine;
  c.knobs = std::move(knobs);
  c.tag = default_tag(engine, c.knobs);
  c.numerical_notes = std::move(notes);
  c.time_ms = time_ms;
  c.workspace_bytes = workspace;
  return c;
}

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

inline void spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace terra::profile::testing
