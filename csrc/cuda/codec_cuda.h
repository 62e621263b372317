// BF16 error-feedback codec on CUDA: the same bits as the CPU codec (core/codec.h) for every
// input, under the same proviso (each floating-point add/multiply has at most one NaN operand).
// Implemented in kernels.cu as launches of core/device/kernels.h's kernels (KernelApi), whose
// element arithmetic is core/elements.h's: the functions the CPU codec's scalar path runs.
//
// Torch-free: plain CUDA runtime API. Every launcher enqueues one kernel on `stream` and returns
// the launch status (cudaGetLastError after the launch); nothing is synchronized. n >= 0 elements
// (n < 0: cudaErrorInvalidValue; n == 0 launches nothing); pointers are device pointers (or
// managed), no alignment required: when every pointer of a call is aligned (16 bytes for fp32, 8
// for bf16) the kernel loads 4 fp32 / stores 4 bf16 per access, else it runs element by element.
// Aliasing rules are core/codec.h's: r_out may alias r_in, out may alias in; nothing else may
// overlap.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace xirang::cuda {

// out[i] = bf16(x[i]).
cudaError_t encode(const float* x, uint16_t* out, int64_t n, cudaStream_t stream);
// out[i] = f32(in[i]).
cudaError_t decode(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);
// acc[i] = acc[i] + f32(in[i]).
cudaError_t decodeAccumulate(const uint16_t* in, float* acc, int64_t n, cudaStream_t stream);
// s = x*scale + r_in; out = bf16(s); r_out = s - f32(out).
cudaError_t encodeEF(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out, int64_t n,
                     cudaStream_t stream);
// s = f32(in) + (x*scale + r_in); out = bf16(s); r_out = s - f32(out).
cudaError_t accumulateEncodeEF(const uint16_t* in, const float* x, float scale, const float* r_in, float* r_out,
                               uint16_t* out, int64_t n, cudaStream_t stream);

}  // namespace xirang::cuda
