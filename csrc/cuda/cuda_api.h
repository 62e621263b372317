// The real tables of core/device/api.h in a CUDA build: the CUDA runtime (cuda_api.cc) and the
// kernels (kernels.cu). NCCL's table is nccl_api.h's (loaded at run time).
#pragma once

#include "core/device/api.h"

namespace xirang::cuda {

// The CUDA runtime of this process (cudaMalloc, cudaStreamCreateWithFlags(cudaStreamNonBlocking),
// cudaEventCreateWithFlags(cudaEventDisableTiming), ...). Handles are the runtime's own.
device::CudaApi& runtimeApi();

// device/kernels.h's kernels compiled by nvcc, launched with <<<launchDims, 0, stream>>>; a launch
// returns cudaGetLastError() after it (nothing is synchronized).
device::KernelApi& kernelApi();

}  // namespace xirang::cuda
