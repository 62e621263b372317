// The device kernels' bodies, written once: XR_HD functions of the grid index, which
// cuda/kernels.cu launches with nvcc and the grid emulator (emulate() below) calls on the host for
// every (block, thread) index, so the code the Catch2 tests run is the code the GPU runs.
//
// Every kernel is a thin grid-stride loop over an element functor from core/elements.h:
//   gridStride(op, nvec, n, g)  thread t of the grid does vector groups v = t, t + T, ... < nvec
//                               (op.vec(v): elements kVec*v .. kVec*v + kVec-1, 16-byte fp32 / 8-byte
//                               bf16 loads and stores), then the tail elements kVec*nvec + t, + T,
//                               ... < n one by one (op.one(i)). T = gridDim * blockDim. No atomics,
//                               no shared memory: elements are independent, and all reads of an
//                               element (or a vector group) happen before its writes, so the aliases
//                               codec.h allows (r_out == r_in, out == in) are safe.
// A launch takes the vector form only when every pointer it touches is aligned for it (else
// nvec = 0: all elements one by one), and launchDims(work) blocks of kThreads threads.
//
// A kernel is described by a Kernel (the KernelApi's argument, device/api.h); visit() maps it to
// its functor. Pointers are device pointers; counts are elements (int64, n >= 0).
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/elements.h"

namespace xirang::device {

// ---------------------------------------------------------------------------------------------
// Grid
// ---------------------------------------------------------------------------------------------

struct GridIdx {
  uint32_t block, thread, block_dim, grid_dim;  // blockIdx.x, threadIdx.x, blockDim.x, gridDim.x
};
struct LaunchDims {
  uint32_t blocks, threads;
};

constexpr uint32_t kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // beyond it the loop strides (4M+ work items)

inline LaunchDims launchDims(int64_t work) {
  int64_t b = (work + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  if (b > kMaxBlocks) b = kMaxBlocks;
  return LaunchDims{static_cast<uint32_t>(b), kThreads};
}

template <class Op>
XR_HD inline void gridStride(const Op& op, int64_t nvec, int64_t n, GridIdx g) {
  const int64_t tid = static_cast<int64_t>(g.block) * g.block_dim + g.thread;
  const int64_t stride = static_cast<int64_t>(g.grid_dim) * g.block_dim;
  for (int64_t v = tid; v < nvec; v += stride) op.vec(v);
  for (int64_t i = nvec * Op::kVec + tid; i < n; i += stride) op.one(i);
}

// ---------------------------------------------------------------------------------------------
// Vector loads and stores (16 bytes of fp32 / any type, 8 bytes of 16-bit values)
// ---------------------------------------------------------------------------------------------

template <class T, int K>
XR_HD inline void loadVec(const T* p, T (&out)[K]) {
  static_assert(sizeof(T) * K == 16 || sizeof(T) * K == 8, "16- or 8-byte vectors");
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) * K == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    memcpy(out, &v, 16);
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    memcpy(out, &v, 8);
  }
#else
  std::memcpy(out, p, sizeof(T) * K);
#endif
}
template <class T, int K>
XR_HD inline void storeVec(T* p, const T (&in)[K]) {
  static_assert(sizeof(T) * K == 16 || sizeof(T) * K == 8, "16- or 8-byte vectors");
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) * K == 16) {
    uint4 v;
    memcpy(&v, in, 16);
    *reinterpret_cast<uint4*>(p) = v;
  } else {
    uint2 v;
    memcpy(&v, in, 8);
    *reinterpret_cast<uint2*>(p) = v;
  }
#else
  std::memcpy(p, in, sizeof(T) * K);
#endif
}

// ---------------------------------------------------------------------------------------------
// Element functors (one kernel each). kVec elements per vector group.
// ---------------------------------------------------------------------------------------------

// The 16-bit conversions (kHalf: fp16, else bf16). kNarrow: out = 16-bit(in) (bf16: the codec's
// encode; fp16: narrow()); else out = f32(in) (bf16: the codec's decode; fp16: widen()).
template <bool kHalf, bool kNarrow>
struct Convert16 {
  using In = std::conditional_t<kNarrow, float, uint16_t>;
  using Out = std::conditional_t<kNarrow, uint16_t, float>;
  static constexpr int kVec = 4;
  const In* in;
  Out* out;
  XR_HD static Out convert(In v) {
    if constexpr (kNarrow) return el::from32<kHalf>(v);
    else return el::to32<kHalf>(v);
  }
  XR_HD void one(int64_t i) const { out[i] = convert(in[i]); }
  XR_HD void vec(int64_t v) const {
    In a[4];
    Out o[4];
    loadVec(in + 4 * v, a);
    for (int k = 0; k < 4; ++k) o[k] = convert(a[k]);
    storeVec(out + 4 * v, o);
  }
};
template <bool kHalf>
using Narrow16 = Convert16<kHalf, true>;
template <bool kHalf>
using Widen16 = Convert16<kHalf, false>;

// acc = acc + f32(in).
struct DecodeAccumulate {
  static constexpr int kVec = 4;
  const uint16_t* in;
  float* acc;
  XR_HD void one(int64_t i) const { acc[i] = el::decodeAccumulate(acc[i], in[i]); }
  XR_HD void vec(int64_t v) const {
    uint16_t b[4];
    float a[4];
    loadVec(in + 4 * v, b);
    loadVec(acc + 4 * v, a);
    for (int k = 0; k < 4; ++k) a[k] = el::decodeAccumulate(a[k], b[k]);
    storeVec(acc + 4 * v, a);
  }
};

// out = bf16(s), r_out = the rounding error (codec.h: encodeEF, accumulateEncodeEF), where
// s = x*scale + r_in, or with kAccumulate s = f32(in) + (x*scale + r_in). Without kAccumulate
// `in` is not read (null).
template <bool kAccumulate>
struct EncodeEFOp {
  static constexpr int kVec = 4;
  const uint16_t* in;
  const float* x;
  float scale;
  const float* r_in;
  float* r_out;
  uint16_t* out;
  XR_HD uint16_t encode(uint16_t b, float a, float ri, float* ro) const {
    if constexpr (kAccumulate) return el::accumulateEncodeEF(b, a, scale, ri, ro);
    else return el::encodeEF(a, scale, ri, ro);
  }
  XR_HD void one(int64_t i) const {
    float r;
    const uint16_t o = encode(kAccumulate ? in[i] : uint16_t{0}, x[i], r_in[i], &r);  // in[i] read before out[i]
    out[i] = o;
    r_out[i] = r;
  }
  XR_HD void vec(int64_t v) const {
    uint16_t b[4] = {}, o[4];
    float a[4], ri[4], ro[4];
    if constexpr (kAccumulate) loadVec(in + 4 * v, b);
    loadVec(x + 4 * v, a);
    loadVec(r_in + 4 * v, ri);
    for (int k = 0; k < 4; ++k) o[k] = encode(b[k], a[k], ri[k], &ro[k]);
    storeVec(out + 4 * v, o);
    storeVec(r_out + 4 * v, ro);
  }
};
using EncodeEF = EncodeEFOp<false>;
using AccumulateEncodeEF = EncodeEFOp<true>;

// dst = op(dst, src) (reduce.h: reduceInto). kBool: T = uint8_t holding bools.
template <class T, ReduceOp Op, bool kBool = false>
struct Reduce {
  static constexpr int kVec = sizeof(T) >= 16 ? 1 : static_cast<int>(16 / sizeof(T));
  T* dst;
  const T* src;
  XR_HD void one(int64_t i) const { dst[i] = el::reduceElem<Op, T, kBool>(dst[i], src[i]); }
  XR_HD void vec(int64_t v) const {
    if constexpr (kVec == 1) {
      one(v);
    } else {
      T a[kVec], b[kVec];
      loadVec(dst + kVec * v, a);
      loadVec(src + kVec * v, b);
      for (int k = 0; k < kVec; ++k) a[k] = el::reduceElem<Op, T, kBool>(a[k], b[k]);
      storeVec(dst + kVec * v, a);
    }
  }
};

// x = x * factor (reduce.h: scale). F is float for float32 / complex64, double otherwise.
template <class T, class F>
struct Scale {
  static constexpr int kVec = sizeof(T) >= 16 ? 1 : static_cast<int>(16 / sizeof(T));
  T* x;
  F factor;
  XR_HD void one(int64_t i) const { x[i] = el::scaleElem(x[i], factor); }
  XR_HD void vec(int64_t v) const {
    if constexpr (kVec == 1) {
      one(v);
    } else {
      T a[kVec];
      loadVec(x + kVec * v, a);
      for (int k = 0; k < kVec; ++k) a[k] = el::scaleElem(a[k], factor);
      storeVec(x + kVec * v, a);
    }
  }
};

// 16-bit floats reduced once (algorithms/reducer.h: combine16): out[i] = round16(post *
// fold_k(op, pre * f32(slots[k*count + i]))), k = 0..contributors-1 in that order.
template <bool kHalf, ReduceOp Op>
struct Combine16 {
  static constexpr int kVec = 4;
  const uint16_t* slots;
  int contributors;
  int64_t count;
  float pre, post;
  uint16_t* out;
  XR_HD void one(int64_t i) const {
    float acc = el::mul(el::to32<kHalf>(slots[i]), pre);
    for (int k = 1; k < contributors; ++k) acc = el::fold<Op>(acc, el::mul(el::to32<kHalf>(slots[count * k + i]), pre));
    out[i] = el::from32<kHalf>(el::mul(acc, post));
  }
  XR_HD void vec(int64_t v) const {
    uint16_t b[4];
    float acc[4];
    loadVec(slots + 4 * v, b);
    for (int j = 0; j < 4; ++j) acc[j] = el::mul(el::to32<kHalf>(b[j]), pre);
    for (int k = 1; k < contributors; ++k) {
      loadVec(slots + count * k + 4 * v, b);
      for (int j = 0; j < 4; ++j) acc[j] = el::fold<Op>(acc[j], el::mul(el::to32<kHalf>(b[j]), pre));
    }
    uint16_t o[4];
    for (int j = 0; j < 4; ++j) o[j] = el::from32<kHalf>(el::mul(acc[j], post));
    storeVec(out + 4 * v, o);
  }
};

// The scaled wire formats (codec.h: FP16, INT8; a block is the n codes, then one fp32 scale per
// segment of kSegment elements). Encode: one work item per segment (its amax, its scale, its codes
// and residuals: elements.h's segment functions, as the CPU codec's scalar path runs them), so a
// segment's scale never needs a reduction across threads. Decode: one work item per element.
constexpr int64_t kSegment = 1024;  // codec::kWireSegment (the Catch2 tests check they agree)

struct ScaledEncodeEF {
  static constexpr int kVec = 1;  // never vectorised (nvec = 0)
  bool int8;
  const float* x;
  float scale;
  const float* r_in;
  float* r_out;
  uint8_t* block;
  int64_t n;  // elements
  XR_HD void one(int64_t k) const {
    const int64_t s0 = k * kSegment;
    const int64_t m = n - s0 < kSegment ? n - s0 : kSegment;
    const float sc = el::segScale(int8, el::segAmax(x + s0, scale, r_in + s0, m));
    memcpy(block + (int8 ? 1 : 2) * n + 4 * k, &sc, 4);
    el::segEncode(int8, x + s0, scale, r_in + s0, r_out + s0, block + (int8 ? 1 : 2) * s0, sc, m);
  }
  XR_HD void vec(int64_t v) const { one(v); }
};

// out = value i of the block (kAccumulate: out = out + value i).
template <bool kAccumulate>
struct ScaledDecode {
  static constexpr int kVec = 1;
  bool int8;
  const uint8_t* block;
  float* out;
  int64_t n;  // elements
  XR_HD void one(int64_t i) const {
    float sc;
    memcpy(&sc, block + (int8 ? 1 : 2) * n + 4 * (i / kSegment), 4);
    const float v = el::segValue(int8, block, i, sc);
    out[i] = kAccumulate ? el::add(out[i], v) : v;
  }
  XR_HD void vec(int64_t v) const { one(v); }
};

// ---------------------------------------------------------------------------------------------
// Descriptor and dispatch
// ---------------------------------------------------------------------------------------------

enum class KernelKind : uint8_t {
  Encode,              // out(bf16) = bf16(x)
  Decode,              // out(fp32) = f32(in)
  DecodeAccumulate,    // out(fp32) += f32(in)
  EncodeEF,            // out(bf16), r_out = EF encode of x*scale + r_in
  AccumulateEncodeEF,  // out(bf16), r_out = EF encode of f32(in) + (x*scale + r_in)
  Reduce,              // out(dtype) = op(out, in), n elements
  Scale,               // out(dtype) *= factor
  Combine16,           // out(16-bit) = combine of `contributors` slots of n elements at in
  Widen16,             // out(fp32) = f32(in(16-bit dtype))
  Narrow16,            // out(16-bit dtype) = round16(x)
  ScaledEncodeEF,      // out(block of dtype's codes + scales), r_out = EF encode of x*scale + r_in
  ScaledDecode,        // out(fp32) = the values of block in
  ScaledDecodeAccumulate,  // out(fp32) += the values of block in
};
const char* kernelName(KernelKind k);

struct Kernel {
  KernelKind kind = KernelKind::Encode;
  DType dtype = DType::Float32;    // Reduce, Scale; Combine16 / Widen16 / Narrow16: Float16 or BFloat16;
                                   // Scaled*: the codes' dtype, Float16 or Int8 (codec::wireDType)
  ReduceOp op = ReduceOp::Sum;     // Reduce (reduceInto's ops: Avg / PremulSum reduce as Sum), Combine16
                                   // (Sum, Product, Min, Max)
  int64_t n = 0;                   // elements (Combine16: elements per slot)
  int contributors = 0;            // Combine16
  float scale = 1.0f;              // EncodeEF, AccumulateEncodeEF; Combine16: pre
  float post = 1.0f;               // Combine16
  double factor = 1.0;             // Scale
  const void* in = nullptr;        // 16-bit input / Reduce's src / Combine16's slots
  const float* x = nullptr;        // fp32 input
  const float* r_in = nullptr;
  float* r_out = nullptr;
  void* out = nullptr;

  static Kernel encode(const float* x, uint16_t* out, int64_t n);
  static Kernel decode(const uint16_t* in, float* out, int64_t n);
  static Kernel decodeAccumulate(const uint16_t* in, float* acc, int64_t n);
  static Kernel encodeEF(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out, int64_t n);
  static Kernel accumulateEncodeEF(const uint16_t* in, const float* x, float scale, const float* r_in, float* r_out,
                                   uint16_t* out, int64_t n);
  static Kernel reduce(void* dst, const void* src, int64_t n, DType t, ReduceOp op);
  static Kernel scaleBy(void* x, int64_t n, DType t, double factor);
  static Kernel combine16(const uint16_t* slots, int contributors, int64_t count, DType t, ReduceOp op, float pre,
                          float post, uint16_t* out);
  static Kernel widen16(const uint16_t* in, float* out, int64_t n, DType t);
  static Kernel narrow16(const float* in, uint16_t* out, int64_t n, DType t);
  // codes: Float16 (the fp16 wire) or Int8 (the int8 wire); n elements, the block as codec.h lays it out.
  static Kernel scaledEncodeEF(DType codes, const float* x, float scale, const float* r_in, float* r_out,
                               uint8_t* block, int64_t n);
  static Kernel scaledDecode(DType codes, const uint8_t* block, float* out, int64_t n, bool accumulate);
};

// "" when k can run, else why not (the dtype / op it does not take, n < 0, a null pointer with
// n > 0, fewer than one contributor, ...).
std::string checkKernel(const Kernel& k);

namespace detail {
inline bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

template <class Op, class F>
void go(const Op& op, int64_t n, bool vectorizable, F&& launch) {
  const int64_t nvec = vectorizable ? n / Op::kVec : 0;
  const int64_t tail = n - nvec * Op::kVec;
  launch(op, nvec, n, launchDims(nvec > tail ? nvec : tail));
}

template <class T, bool kBool = false, class F>
void reduceOps(const Kernel& k, F&& launch) {
  T* d = static_cast<T*>(k.out);
  const T* s = static_cast<const T*>(k.in);
  const bool v = aligned(d, 16) && aligned(s, 16);
  switch (k.op == ReduceOp::Avg || k.op == ReduceOp::PremulSum ? ReduceOp::Sum : k.op) {
#define XR_CASE(OP)                                                      \
  case ReduceOp::OP:                                                     \
    if constexpr (el::reduceDefined<T, kBool>(ReduceOp::OP))             \
      return go(Reduce<T, ReduceOp::OP, kBool>{d, s}, k.n, v, launch);   \
    break;
    XR_CASE(Sum)
    XR_CASE(Product)
    XR_CASE(Min)
    XR_CASE(Max)
    XR_CASE(BAnd)
    XR_CASE(BOr)
    XR_CASE(BXor)
#undef XR_CASE
    default:
      break;
  }
}

template <bool kHalf, class F>
void combineOps(const Kernel& k, F&& launch) {
  const auto* s = static_cast<const uint16_t*>(k.in);
  auto* o = static_cast<uint16_t*>(k.out);
  const bool v = aligned(s, 8) && aligned(o, 8) && k.n % 4 == 0;
  switch (k.op) {
    case ReduceOp::Sum:
      return go(Combine16<kHalf, ReduceOp::Sum>{s, k.contributors, k.n, k.scale, k.post, o}, k.n, v, launch);
    case ReduceOp::Product:
      return go(Combine16<kHalf, ReduceOp::Product>{s, k.contributors, k.n, k.scale, k.post, o}, k.n, v, launch);
    case ReduceOp::Min:
      return go(Combine16<kHalf, ReduceOp::Min>{s, k.contributors, k.n, k.scale, k.post, o}, k.n, v, launch);
    case ReduceOp::Max:
      return go(Combine16<kHalf, ReduceOp::Max>{s, k.contributors, k.n, k.scale, k.post, o}, k.n, v, launch);
    default:
      return;
  }
}
}  // namespace detail

// Calls launch(op, nvec, n, dims) once with k's functor (nothing when n == 0). k must pass
// checkKernel(). The callers: cuda/kernels.cu (a <<<dims>>> launch of gridStride(op, ...)) and
// the emulator.
template <class F>
void visit(const Kernel& k, F&& launch) {
  using detail::aligned;
  using detail::go;
  if (k.n == 0) return;
  const bool half = k.dtype == DType::Float16;
  switch (k.kind) {
    case KernelKind::Encode: {
      auto* o = static_cast<uint16_t*>(k.out);
      return go(Narrow16<false>{k.x, o}, k.n, aligned(k.x, 16) && aligned(o, 8), launch);
    }
    case KernelKind::Decode: {
      const auto* i = static_cast<const uint16_t*>(k.in);
      auto* o = static_cast<float*>(k.out);
      return go(Widen16<false>{i, o}, k.n, aligned(i, 8) && aligned(o, 16), launch);
    }
    case KernelKind::DecodeAccumulate: {
      const auto* i = static_cast<const uint16_t*>(k.in);
      auto* o = static_cast<float*>(k.out);
      return go(DecodeAccumulate{i, o}, k.n, aligned(i, 8) && aligned(o, 16), launch);
    }
    case KernelKind::EncodeEF: {
      auto* o = static_cast<uint16_t*>(k.out);
      return go(EncodeEF{nullptr, k.x, k.scale, k.r_in, k.r_out, o}, k.n,
                aligned(k.x, 16) && aligned(k.r_in, 16) && aligned(k.r_out, 16) && aligned(o, 8), launch);
    }
    case KernelKind::AccumulateEncodeEF: {
      const auto* i = static_cast<const uint16_t*>(k.in);
      auto* o = static_cast<uint16_t*>(k.out);
      return go(AccumulateEncodeEF{i, k.x, k.scale, k.r_in, k.r_out, o}, k.n,
                aligned(i, 8) && aligned(k.x, 16) && aligned(k.r_in, 16) && aligned(k.r_out, 16) && aligned(o, 8),
                launch);
    }
    case KernelKind::Reduce:
      switch (k.dtype) {
        case DType::Float32: return detail::reduceOps<float>(k, launch);
        case DType::Float64: return detail::reduceOps<double>(k, launch);
        case DType::Int8: return detail::reduceOps<int8_t>(k, launch);
        case DType::Int16: return detail::reduceOps<int16_t>(k, launch);
        case DType::Int32: return detail::reduceOps<int32_t>(k, launch);
        case DType::Int64: return detail::reduceOps<int64_t>(k, launch);
        case DType::UInt8: return detail::reduceOps<uint8_t>(k, launch);
        case DType::Bool: return detail::reduceOps<uint8_t, true>(k, launch);
        case DType::Complex64: return detail::reduceOps<el::Complex<float>>(k, launch);
        case DType::Complex128: return detail::reduceOps<el::Complex<double>>(k, launch);
        default: return;
      }
    case KernelKind::Scale: {
      const bool v = aligned(k.out, 16);
      switch (k.dtype) {
        case DType::Float32:
          return go(Scale<float, float>{static_cast<float*>(k.out), static_cast<float>(k.factor)}, k.n, v, launch);
        case DType::Float64:
          return go(Scale<double, double>{static_cast<double*>(k.out), k.factor}, k.n, v, launch);
        case DType::Complex64:
          return go(Scale<el::Complex<float>, float>{static_cast<el::Complex<float>*>(k.out),
                                                     static_cast<float>(k.factor)},
                    k.n, v, launch);
        case DType::Complex128:
          return go(Scale<el::Complex<double>, double>{static_cast<el::Complex<double>*>(k.out), k.factor}, k.n, v,
                    launch);
        default: return;
      }
    }
    case KernelKind::Combine16:
      return half ? detail::combineOps<true>(k, launch) : detail::combineOps<false>(k, launch);
    case KernelKind::Widen16: {
      const auto* i = static_cast<const uint16_t*>(k.in);
      auto* o = static_cast<float*>(k.out);
      const bool v = aligned(i, 8) && aligned(o, 16);
      return half ? go(Widen16<true>{i, o}, k.n, v, launch) : go(Widen16<false>{i, o}, k.n, v, launch);
    }
    case KernelKind::Narrow16: {
      auto* o = static_cast<uint16_t*>(k.out);
      const bool v = aligned(k.x, 16) && aligned(o, 8);
      return half ? go(Narrow16<true>{k.x, o}, k.n, v, launch) : go(Narrow16<false>{k.x, o}, k.n, v, launch);
    }
    case KernelKind::ScaledEncodeEF:
      return go(ScaledEncodeEF{k.dtype == DType::Int8, k.x, k.scale, k.r_in, k.r_out, static_cast<uint8_t*>(k.out),
                               k.n},
                (k.n + kSegment - 1) / kSegment, false, launch);
    case KernelKind::ScaledDecode:
      return go(ScaledDecode<false>{k.dtype == DType::Int8, static_cast<const uint8_t*>(k.in),
                                    static_cast<float*>(k.out), k.n},
                k.n, false, launch);
    case KernelKind::ScaledDecodeAccumulate:
      return go(ScaledDecode<true>{k.dtype == DType::Int8, static_cast<const uint8_t*>(k.in),
                                   static_cast<float*>(k.out), k.n},
                k.n, false, launch);
  }
}

// ---------------------------------------------------------------------------------------------
// Grid emulator
// ---------------------------------------------------------------------------------------------

// Runs op's body for every (block, thread) index of a `dims` launch, one after the other, on
// the calling thread.
template <class Op>
void emulate(const Op& op, int64_t nvec, int64_t n, LaunchDims dims) {
  for (uint32_t b = 0; b < dims.blocks; ++b)
    for (uint32_t t = 0; t < dims.threads; ++t) gridStride(op, nvec, n, GridIdx{b, t, dims.threads, dims.blocks});
}

// Runs k on the host exactly as a launch would (k must pass checkKernel). With max_blocks > 0
// the grid is capped at that many blocks of `threads` threads (every thread then strides over
// several vector groups, as on a large input).
void emulate(const Kernel& k, uint32_t max_blocks = 0, uint32_t threads = kThreads);

}  // namespace xirang::device
