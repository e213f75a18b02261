// The record header of a CUDA device: what makes a record valid for it (name, compute capability,
// cuDNN version) plus the CUDA runtime version for people reading the file.
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "profile/cuda_hooks.h"

namespace terra::profile::cuda {

RecordHeader device_header(int device_index) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device_index));
  RecordHeader header;
  header.device_name = props->name;
  header.compute_capability = std::to_string(props->major) + "." + std::to_string(props->minor);
  header.cudnn_version = static_cast<int64_t>(cudnnGetVersion());
  int runtime = 0;
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess) header.cuda_version = runtime;
  return header;
}

}  // namespace terra::profile::cuda
