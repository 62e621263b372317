// BF16 error-feedback codec kernels: see codec_cuda.h. The per-element functions mirror the
// scalar reference in core/codec.cc line by line; keep them in step with it.
#include "cuda/codec_cuda.h"

#include <cuda_runtime.h>

namespace xirang::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Scalar bit logic (device copies of codec.cc's scalar path)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t bitsOf(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float floatOf(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ bool isNanBits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// RNE on the dropped 16 bits; NaN -> quiet NaN with sign and top payload bits.
__device__ __forceinline__ uint16_t rneBits(uint32_t u) {
  if (isNanBits(u)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  // Cannot overflow 32 bits: the largest non-NaN pattern is 0xFF800000.
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float widen(uint16_t b) { return floatOf(static_cast<uint32_t>(b) << 16); }

// The NaN an x86 SSE/AVX add or multiply returns: the first NaN operand, quieted (sign and
// payload kept); for an invalid operation on non-NaN operands the default NaN 0xFFC00000.
// CUDA itself returns the canonical 0x7FFFFFFF, which would change the bf16 bits.
__device__ __noinline__ float x86NaN(float a, float b) {
  const uint32_t ua = bitsOf(a), ub = bitsOf(b);
  if (isNanBits(ua)) return floatOf(ua | 0x00400000u);
  if (isNanBits(ub)) return floatOf(ub | 0x00400000u);
  return floatOf(0xFFC00000u);
}

// Round-to-nearest, never contracted into an FMA.
__device__ __forceinline__ float mul(float a, float b) {
  const float r = __fmul_rn(a, b);
  return isnan(r) ? x86NaN(a, b) : r;
}
__device__ __forceinline__ float add(float a, float b) {
  const float r = __fadd_rn(a, b);
  return isnan(r) ? x86NaN(a, b) : r;
}
__device__ __forceinline__ float sub(float a, float b) {
  const float r = __fsub_rn(a, b);
  return isnan(r) ? x86NaN(a, b) : r;
}

// s = p + r_in (encodeEF) -> (out, r_out).
__device__ __forceinline__ uint16_t efRound(float s, float* r_out) {
  const uint16_t o = rneBits(bitsOf(s));
  *r_out = sub(s, widen(o));
  return o;
}

__device__ __forceinline__ uint2 pack4(uint16_t a, uint16_t b, uint16_t c, uint16_t d) {
  return make_uint2(static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16),
                    static_cast<uint32_t>(c) | (static_cast<uint32_t>(d) << 16));
}
__device__ __forceinline__ void unpack4(uint2 v, uint16_t* o) {
  o[0] = static_cast<uint16_t>(v.x & 0xFFFFu);
  o[1] = static_cast<uint16_t>(v.x >> 16);
  o[2] = static_cast<uint16_t>(v.y & 0xFFFFu);
  o[3] = static_cast<uint16_t>(v.y >> 16);
}

// ---------------------------------------------------------------------------------------------
// Element functors: one(i) does element i; vec(v) does elements 4v..4v+3 with 16-byte fp32 and
// 8-byte bf16 accesses (all reads of a group happen before its writes, so the aliases allowed
// by the contract are safe).
// ---------------------------------------------------------------------------------------------

struct Encode {
  const float* x;
  uint16_t* out;
  __device__ void one(int64_t i) const { out[i] = rneBits(bitsOf(x[i])); }
  __device__ void vec(int64_t v) const {
    const float4 a = reinterpret_cast<const float4*>(x)[v];
    reinterpret_cast<uint2*>(out)[v] =
        pack4(rneBits(bitsOf(a.x)), rneBits(bitsOf(a.y)), rneBits(bitsOf(a.z)), rneBits(bitsOf(a.w)));
  }
};

struct Decode {
  const uint16_t* in;
  float* out;
  __device__ void one(int64_t i) const { out[i] = widen(in[i]); }
  __device__ void vec(int64_t v) const {
    uint16_t b[4];
    unpack4(reinterpret_cast<const uint2*>(in)[v], b);
    reinterpret_cast<float4*>(out)[v] = make_float4(widen(b[0]), widen(b[1]), widen(b[2]), widen(b[3]));
  }
};

struct DecodeAccumulate {
  const uint16_t* in;
  float* acc;
  __device__ void one(int64_t i) const { acc[i] = add(acc[i], widen(in[i])); }
  __device__ void vec(int64_t v) const {
    uint16_t b[4];
    unpack4(reinterpret_cast<const uint2*>(in)[v], b);
    float4 a = reinterpret_cast<const float4*>(acc)[v];
    a.x = add(a.x, widen(b[0]));
    a.y = add(a.y, widen(b[1]));
    a.z = add(a.z, widen(b[2]));
    a.w = add(a.w, widen(b[3]));
    reinterpret_cast<float4*>(acc)[v] = a;
  }
};

struct EncodeEF {
  const float* x;
  float scale;
  const float* r_in;
  float* r_out;
  uint16_t* out;
  __device__ __forceinline__ uint16_t elem(float xv, float rv, float* ro) const {
    const float p = mul(xv, scale);
    const float s = add(p, rv);
    return efRound(s, ro);
  }
  __device__ void one(int64_t i) const {
    float ro;
    const uint16_t o = elem(x[i], r_in[i], &ro);
    out[i] = o;
    r_out[i] = ro;
  }
  __device__ void vec(int64_t v) const {
    const float4 a = reinterpret_cast<const float4*>(x)[v];
    const float4 r = reinterpret_cast<const float4*>(r_in)[v];
    float4 ro;
    const uint16_t o0 = elem(a.x, r.x, &ro.x), o1 = elem(a.y, r.y, &ro.y), o2 = elem(a.z, r.z, &ro.z),
                   o3 = elem(a.w, r.w, &ro.w);
    reinterpret_cast<uint2*>(out)[v] = pack4(o0, o1, o2, o3);
    reinterpret_cast<float4*>(r_out)[v] = ro;
  }
};

struct AccumulateEncodeEF {
  const uint16_t* in;
  const float* x;
  float scale;
  const float* r_in;
  float* r_out;
  uint16_t* out;
  __device__ __forceinline__ uint16_t elem(uint16_t iv, float xv, float rv, float* ro) const {
    const float d = widen(iv);
    const float p = mul(xv, scale);
    const float t = add(p, rv);
    const float s = add(d, t);
    return efRound(s, ro);
  }
  __device__ void one(int64_t i) const {
    float ro;
    const uint16_t o = elem(in[i], x[i], r_in[i], &ro);  // in[i] read before out[i] is written
    out[i] = o;
    r_out[i] = ro;
  }
  __device__ void vec(int64_t v) const {
    uint16_t b[4];
    unpack4(reinterpret_cast<const uint2*>(in)[v], b);
    const float4 a = reinterpret_cast<const float4*>(x)[v];
    const float4 r = reinterpret_cast<const float4*>(r_in)[v];
    float4 ro;
    const uint16_t o0 = elem(b[0], a.x, r.x, &ro.x), o1 = elem(b[1], a.y, r.y, &ro.y),
                   o2 = elem(b[2], a.z, r.z, &ro.z), o3 = elem(b[3], a.w, r.w, &ro.w);
    reinterpret_cast<uint2*>(out)[v] = pack4(o0, o1, o2, o3);
    reinterpret_cast<float4*>(r_out)[v] = ro;
  }
};

// ---------------------------------------------------------------------------------------------
// Kernels and launch
// ---------------------------------------------------------------------------------------------

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// Groups of 4 by vector accesses (grid-stride), then the n % 4 tail element by element.
template <class Op>
__global__ void __launch_bounds__(kThreads) vecKernel(Op op, int64_t nvec, int64_t n) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = tid; v < nvec; v += stride) op.vec(v);
  const int64_t i = nvec * 4 + tid;
  if (i < n) op.one(i);
}

template <class Op>
__global__ void __launch_bounds__(kThreads) scalarKernel(Op op, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) op.one(i);
}

inline bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

inline unsigned blocksFor(int64_t work) {
  int64_t b = (work + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  if (b > kMaxBlocks) b = kMaxBlocks;
  return static_cast<unsigned>(b);
}

template <class Op>
cudaError_t launch(const Op& op, int64_t n, bool vectorizable, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (vectorizable && n >= 4) {
    const int64_t nvec = n / 4;
    vecKernel<Op><<<blocksFor(nvec), kThreads, 0, stream>>>(op, nvec, n);
  } else {
    scalarKernel<Op><<<blocksFor(n), kThreads, 0, stream>>>(op, n);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t encode(const float* x, uint16_t* out, int64_t n, cudaStream_t stream) {
  return launch(Encode{x, out}, n, aligned(x, 16) && aligned(out, 8), stream);
}

cudaError_t decode(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  return launch(Decode{in, out}, n, aligned(in, 8) && aligned(out, 16), stream);
}

cudaError_t decodeAccumulate(const uint16_t* in, float* acc, int64_t n, cudaStream_t stream) {
  return launch(DecodeAccumulate{in, acc}, n, aligned(in, 8) && aligned(acc, 16), stream);
}

cudaError_t encodeEF(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out, int64_t n,
                     cudaStream_t stream) {
  return launch(EncodeEF{x, scale, r_in, r_out, out}, n,
                aligned(x, 16) && aligned(r_in, 16) && aligned(r_out, 16) && aligned(out, 8), stream);
}

cudaError_t accumulateEncodeEF(const uint16_t* in, const float* x, float scale, const float* r_in, float* r_out,
                               uint16_t* out, int64_t n, cudaStream_t stream) {
  return launch(AccumulateEncodeEF{in, x, scale, r_in, r_out, out}, n,
                aligned(in, 8) && aligned(x, 16) && aligned(r_in, 16) && aligned(r_out, 16) && aligned(out, 8),
                stream);
}

}  // namespace xirang::cuda
