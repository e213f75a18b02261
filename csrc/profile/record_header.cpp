// Device compatibility of record headers; see record_header.h.
#include "profile/record_header.h"

namespace terra::profile {

std::string RecordHeader::device_label() const {
  return device_name + " (sm " + compute_capability + ", cuDNN " + std::to_string(cudnn_version) +
         ")";
}

std::optional<std::string> device_mismatch(const RecordHeader& file, const RecordHeader& current) {
  if (file.device_name != current.device_name || file.compute_capability != current.compute_capability ||
      file.cudnn_version != current.cudnn_version)
    return "the record was profiled on " + file.device_label() + ", this process runs on " +
           current.device_label();
  return std::nullopt;
}

}  // namespace terra::profile
