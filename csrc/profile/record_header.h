// The header of a record file: which format it is written in and which device, cuDNN and CUDA
// produced its timings. Timings and even the set of valid algorithms differ between GPUs and
// cuDNN releases, so entries from another device must never be used (they are ignored with a
// warning). MIOpen's find-db puts the same facts into its versioned file name.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace terra::profile {

// 2: engine configurations of cuDNN's graph API (entry.h). 1: legacy algorithm enums, which this
// build does not replay; such files are reported and their convolutions profiled again.
inline constexpr int kFormatVersion = 2;
inline constexpr int kLegacyFormatVersion = 1;
inline constexpr const char* kFormatName = "terra_torch.conv_profile_record";

struct RecordHeader {
  int format_version = kFormatVersion;
  std::string device_name;         // cudaDeviceProp::name, e.g. "NVIDIA H200"
  std::string compute_capability;  // "9.0"
  int64_t cudnn_version = 0;       // cudnnGetVersion(), e.g. 92400 for 9.24.0
  int64_t cuda_version = 0;        // cudaRuntimeGetVersion(), e.g. 13000; informational
  std::string torch_version;       // informational

  bool operator==(const RecordHeader&) const = default;

  // "NVIDIA H200 (sm 9.0, cuDNN 92400)": the part that decides compatibility.
  std::string device_label() const;
};

// Why a record written under `file` cannot serve `current` (device name, compute capability or
// cuDNN version differ), or nullopt when it can. CUDA and torch versions do not matter: the
// algorithms are cuDNN's.
std::optional<std::string> device_mismatch(const RecordHeader& file, const RecordHeader& current);

}  // namespace terra::profile
