// The entry points of the CUDA provider (csrc/profile/cuda/), declared without any torch or CUDA
// type so that the pybind11-only bindings can call them. They exist only in builds with
// TERRA_WITH_CUDA; callers guard with that macro.
#pragma once

#include <string>

#include "profile/record_header.h"

namespace terra::profile::cuda {

// Device name, compute capability, cuDNN and CUDA runtime versions of one device. The torch
// version is left empty for the caller (Python knows torch.__version__).
RecordHeader device_header(int device_index);

// Registers terra's kernels for aten::cudnn_convolution, aten::cudnn_convolution_transpose and
// aten::convolution_backward on the CUDA key, so PyTorch's own convolutions consult the active
// selector; uninstall restores PyTorch's kernels. Idempotent.
void install_kernels();
void uninstall_kernels();
bool kernels_installed();

}  // namespace terra::profile::cuda
