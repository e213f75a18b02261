#include "capture/op_arguments.h"

namespace terra::capture {

bool writes_running_statistics(const c10::FunctionSchema& schema) {
  if (!schema.overload_name().empty()) return false;
  const std::string& name = schema.name();
  return name == "aten::native_batch_norm" || name == "aten::cudnn_batch_norm" || name == "aten::miopen_batch_norm";
}

}  // namespace terra::capture
