// BF16 error-feedback codec on CUDA: the same bits as the CPU codec (core/codec.h) for every
// input, under the same proviso (each floating-point add/multiply has at most one NaN operand).
//
// Torch-free: plain CUDA runtime API. Every launcher enqueues one kernel on `stream` and returns
// the launch status (cudaGetLastError after the launch); nothing is synchronized. n >= 0 elements
// (n == 0 launches nothing); pointers are device pointers (or managed), no alignment required:
// when every pointer of a call is 16-byte aligned the kernel loads 4 fp32 / stores 4 bf16 per
// access, else it runs element by element. Aliasing rules are core/codec.h's: r_out may alias
// r_in, out may alias in; nothing else may overlap.
//
// How the CPU bits are matched:
//   * RNE is done on the integer bits (rneBits below mirrors codec.cc's scalar rneBits), never by
//     __float2bfloat16 (whose NaN handling differs);
//   * x*scale and the adds use __fmul_rn/__fadd_rn/__fsub_rn, which nvcc never contracts into an
//     FMA (and the build passes --fmad=false); denormals are kept (no -ftz, no fast math);
//   * NaN results follow x86 SSE rules instead of CUDA's canonical NaN: a NaN operand is returned
//     quieted (payload and sign kept), an invalid operation (inf - inf, 0 * inf) gives x86's
//     default NaN 0xFFC00000.
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
