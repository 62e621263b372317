// The kernels of core/device/kernels.h, launched: one __global__ template that runs the shared
// grid-stride body, instantiated for every functor visit() can pick (cuda_api.h: kernelApi), and
// the launchers of codec_cuda.h on top of them. The element arithmetic is core/elements.h's, so
// the bits are the CPU codec's (the build passes --fmad=false as well; no -ftz, no fast math).
#include <cuda_runtime.h>

#include <type_traits>

#include "core/device/kernels.h"
#include "cuda/codec_cuda.h"
#include "cuda/cuda_api.h"

namespace xirang::cuda {
namespace {

using device::GridIdx;
using device::Kernel;
using device::kThreads;
using device::LaunchDims;

template <class Op>
__global__ void __launch_bounds__(kThreads) gridKernel(Op op, int64_t nvec, int64_t n) {
  device::gridStride(op, nvec, n, GridIdx{blockIdx.x, threadIdx.x, blockDim.x, gridDim.x});
}

class Kernels : public device::KernelApi {
 public:
  const char* name() const override { return "cuda"; }
  int launch(const Kernel& k, device::Stream stream) override {
    if (!device::checkKernel(k).empty()) return cudaErrorInvalidValue;
    if (k.n == 0) return cudaSuccess;
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    device::visit(k, [s](const auto& op, int64_t nvec, int64_t n, LaunchDims dims) {
      using Op = std::decay_t<decltype(op)>;
      gridKernel<Op><<<dims.blocks, dims.threads, 0, s>>>(op, nvec, n);
    });
    return cudaGetLastError();
  }
};

cudaError_t run(const Kernel& k, cudaStream_t stream) {
  return static_cast<cudaError_t>(kernelApi().launch(k, reinterpret_cast<device::Stream>(stream)));
}

}  // namespace

device::KernelApi& kernelApi() {
  static Kernels k;
  return k;
}

cudaError_t encode(const float* x, uint16_t* out, int64_t n, cudaStream_t stream) {
  return run(Kernel::encode(x, out, n), stream);
}

cudaError_t decode(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  return run(Kernel::decode(in, out, n), stream);
}

cudaError_t decodeAccumulate(const uint16_t* in, float* acc, int64_t n, cudaStream_t stream) {
  return run(Kernel::decodeAccumulate(in, acc, n), stream);
}

cudaError_t encodeEF(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out, int64_t n,
                     cudaStream_t stream) {
  return run(Kernel::encodeEF(x, scale, r_in, r_out, out, n), stream);
}

cudaError_t accumulateEncodeEF(const uint16_t* in, const float* x, float scale, const float* r_in, float* r_out,
                               uint16_t* out, int64_t n, cudaStream_t stream) {
  return run(Kernel::accumulateEncodeEF(in, x, scale, r_in, r_out, out, n), stream);
}

}  // namespace xirang::cuda
