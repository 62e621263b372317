// The per-element arithmetic of the codec and the reductions, written once for the CPU and the
// GPU: every function is XR_HD inline (`__host__ __device__` under nvcc, plain inline under a
// C++ compiler), so the CPU codec's scalar path (codec.cc), the 16-bit conversions and folds
// (reduce.cc, algorithms/reducer.cc) and the CUDA kernels (device/kernels.h -> cuda/kernels.cu)
// compute the same bits by construction. Torch-free, CUDA-free (CUDA intrinsics only under
// __CUDA_ARCH__).
//
// Floating-point rules (every platform, host and device alike):
//   * add/sub/mul (and fp32 div) are single IEEE-754 binary32/binary64 operations rounded to nearest even, never
//     contracted into an FMA (device: __fadd_rn/__fmul_rn, which nvcc never fuses; host: the
//     product passes an empty asm barrier, and the build passes -ffp-contract=off);
//   * denormals are kept (no flush-to-zero) as long as the calling thread's MXCSR says so and the
//     device code is compiled without -ftz / fast math;
//   * a NaN result carries the bits an x86 SSE/AVX instruction returns: the NaN operand, quieted
//     (sign and payload kept), else, for an invalid operation on non-NaN operands (inf - inf,
//     0 * inf), x86's default NaN 0xFFC00000 (binary64: 0xFFF8000000000000). On an x86-64 host
//     that is the hardware's own result; CUDA's NaN is the canonical 0x7FFFFFFF and aarch64's
//     default NaN is positive, so there the result is patched (XR_PATCH_NAN, x86NaN below; the
//     Catch2 tests check the patch against the x86 hardware). When two NaNs meet, the patch takes
//     the first operand's payload, and the host compiler may commute an add: only NaN-ness is
//     defined then (codec.h).
//
// fp32 -> bf16 is roundTiesToEven on the 16 dropped bits with no exponent clamping; NaN -> quiet
// NaN keeping the sign and the top 7 payload bits ((bits >> 16) | 0x0040); bf16 -> fp32 is exact
// (bits << 16). fp16 <-> fp32 is c10::Half's (the FP16 library's fp16_ieee_{from,to}_fp32_value),
// bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/dtype.h"

#if defined(__CUDACC__)
#define XR_HD __host__ __device__
#define XR_HD_COLD __host__ __device__ __noinline__ inline
#else
#define XR_HD
#define XR_HD_COLD inline
#endif

// Whether add/sub/mul patch NaN results to x86's: everywhere but on an SSE host (x86-64).
#if defined(__CUDA_ARCH__) || !(defined(__x86_64__) || defined(__SSE2_MATH__))
#define XR_PATCH_NAN 1
#else
#define XR_PATCH_NAN 0
#endif

namespace xirang::el {

// ---------------------------------------------------------------------------------------------
// Bits
// ---------------------------------------------------------------------------------------------

// The bits of a float / double and back: the device's reinterpret intrinsics, a memcpy on the host.
template <class To, class From>
XR_HD inline To bitCast(From x) {
  static_assert(sizeof(To) == sizeof(From), "bitCast: same size");
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<From, float>) return __float_as_uint(x);
  else if constexpr (std::is_same_v<To, float>) return __uint_as_float(x);
  else if constexpr (std::is_same_v<From, double>) return static_cast<uint64_t>(__double_as_longlong(x));
  else return __longlong_as_double(static_cast<long long>(x));
#else
  To out;
  std::memcpy(&out, &x, sizeof out);
  return out;
#endif
}
XR_HD inline uint32_t bitsOf(float x) { return bitCast<uint32_t>(x); }
XR_HD inline float floatOf(uint32_t u) { return bitCast<float>(u); }
XR_HD inline uint64_t bitsOf(double x) { return bitCast<uint64_t>(x); }
XR_HD inline double doubleOf(uint64_t u) { return bitCast<double>(u); }

XR_HD inline bool isNanBits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
XR_HD inline bool isNan(float x) { return isNanBits(bitsOf(x)); }
XR_HD inline bool isNan(double x) { return (bitsOf(x) & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull; }
XR_HD inline bool isInf(float x) { return (bitsOf(x) & 0x7FFFFFFFu) == 0x7F800000u; }
XR_HD inline bool isInf(double x) { return (bitsOf(x) & 0x7FFFFFFFFFFFFFFFull) == 0x7FF0000000000000ull; }
XR_HD inline float copySign(float mag, float sgn) {
  return floatOf((bitsOf(mag) & 0x7FFFFFFFu) | (bitsOf(sgn) & 0x80000000u));
}
XR_HD inline double copySign(double mag, double sgn) {
  return doubleOf((bitsOf(mag) & 0x7FFFFFFFFFFFFFFFull) | (bitsOf(sgn) & 0x8000000000000000ull));
}

// Keeps the host compiler from fusing a product into a later add: the rounded value must exist in
// a register here. (Device code uses the _rn intrinsics instead.)
template <class T>
XR_HD inline T opaque(T v) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "opaque: float or double");
#if !defined(__CUDA_ARCH__)
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(v));
#elif defined(__aarch64__)
  __asm__("" : "+w"(v));
#else
  volatile T t = v;
  v = t;
#endif
#endif
  return v;
}

// ---------------------------------------------------------------------------------------------
// add / sub / mul with x86 NaN results
// ---------------------------------------------------------------------------------------------

// The NaN an x86 add/sub/mul of a and b returns (see the header comment).
XR_HD_COLD float x86NaN(float a, float b) {
  const uint32_t ua = bitsOf(a), ub = bitsOf(b);
  if (isNanBits(ua)) return floatOf(ua | 0x00400000u);
  if (isNanBits(ub)) return floatOf(ub | 0x00400000u);
  return floatOf(0xFFC00000u);
}
XR_HD_COLD double x86NaN(double a, double b) {
  if (isNan(a)) return doubleOf(bitsOf(a) | 0x0008000000000000ull);
  if (isNan(b)) return doubleOf(bitsOf(b) | 0x0008000000000000ull);
  return doubleOf(0xFFF8000000000000ull);
}

// r, the rounded result of an add/sub/mul of a and b, with x86's NaN where it is one.
template <class T>
XR_HD inline T x86Result(T r, T a, T b) {
  return XR_PATCH_NAN && isNan(r) ? x86NaN(a, b) : r;
}

// NAME(a, b) for T: the device's _rn intrinsic DEVICE, else the host expression HOST of a and b.
#if defined(__CUDA_ARCH__)
#define XR_IEEE_OP(T, NAME, DEVICE, HOST) \
  XR_HD inline T NAME(T a, T b) { return x86Result(DEVICE(a, b), a, b); }
#else
#define XR_IEEE_OP(T, NAME, DEVICE, HOST) \
  XR_HD inline T NAME(T a, T b) { return x86Result(HOST, a, b); }
#endif
XR_IEEE_OP(float, add, __fadd_rn, a + b)
XR_IEEE_OP(float, sub, __fsub_rn, a - b)
XR_IEEE_OP(float, mul, __fmul_rn, opaque(a * b))
XR_IEEE_OP(float, div, __fdiv_rn, a / b)
XR_IEEE_OP(double, add, __dadd_rn, a + b)
XR_IEEE_OP(double, sub, __dsub_rn, a - b)
XR_IEEE_OP(double, mul, __dmul_rn, opaque(a * b))
#undef XR_IEEE_OP

// ---------------------------------------------------------------------------------------------
// bf16 and fp16
// ---------------------------------------------------------------------------------------------

// RNE on the dropped 16 bits of an fp32 bit pattern; NaN -> quiet NaN with sign and top payload.
XR_HD inline uint16_t rneBits(uint32_t u) {
  if (isNanBits(u)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  // Cannot overflow 32 bits: the largest non-NaN pattern is 0xFF800000.
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
XR_HD inline uint16_t f32ToBf16(float x) { return rneBits(bitsOf(x)); }
XR_HD inline float bf16ToF32(uint16_t b) { return floatOf(static_cast<uint32_t>(b) << 16); }

// IEEE binary16 -> binary32, exact (c10::detail::fp16_ieee_to_fp32_value).
XR_HD inline float halfToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = mul(floatOf((two_w >> 4) + (0xE0u << 23)), 0x1.0p-112f);
  const float denormalized = sub(floatOf((two_w >> 17) | (126u << 23)), 0.5f);
  const uint32_t result = sign | (two_w < (1u << 27) ? bitsOf(denormalized) : bitsOf(normalized));
  return floatOf(result);
}

// binary32 -> binary16, round to nearest even (c10::detail::fp16_ieee_from_fp32_value).
XR_HD inline uint16_t floatToHalf(float f) {
  const uint32_t w = bitsOf(f);
  float base = mul(mul(floatOf(w & 0x7FFFFFFFu), 0x1.0p+112f), 0x1.0p-110f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = add(floatOf((bias >> 1) + 0x07800000u), base);
  const uint32_t bits = bitsOf(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// 16-bit float (kHalf: fp16, else bf16) <-> fp32.
template <bool kHalf>
XR_HD inline float to32(uint16_t v) {
  if constexpr (kHalf) return halfToFloat(v);
  else return bf16ToF32(v);
}
template <bool kHalf>
XR_HD inline uint16_t from32(float v) {
  if constexpr (kHalf) return floatToHalf(v);
  else return f32ToBf16(v);
}

// ---------------------------------------------------------------------------------------------
// BF16 error feedback (codec.h)
// ---------------------------------------------------------------------------------------------

// s -> out = bf16(s), *r_out = s - f32(out). When a finite s rounds to +-inf (|s| >= 0x7F7F8000:
// FLT_MAX does), the rounding error is infinite and no finite residual represents it; the
// element's residual is then left as it was (*r_out = r_in) instead of becoming -+inf and
// poisoning every later step. The output is +-inf, which the caller's finiteness check treats as
// a skipped step. Non-finite s (an inf/NaN operand) gives a NaN residual as IEEE arithmetic says.
XR_HD inline uint16_t efRound(float s, float r_in, float* r_out) {
  const uint32_t u = bitsOf(s);
  const uint16_t o = rneBits(u);
  const bool overflowed = (o & 0x7FFFu) == 0x7F80u && (u & 0x7FFFFFFFu) < 0x7F800000u;
  *r_out = overflowed ? r_in : sub(s, bf16ToF32(o));
  return o;
}

// First hop: s = x*scale + r_in.
XR_HD inline uint16_t encodeEF(float x, float scale, float r_in, float* r_out) {
  const float p = mul(x, scale);
  const float s = add(p, r_in);
  return efRound(s, r_in, r_out);
}

// Later hops / the owner's rounding: s = f32(in) + (x*scale + r_in), in that order.
XR_HD inline uint16_t accumulateEncodeEF(uint16_t in, float x, float scale, float r_in, float* r_out) {
  const float d = bf16ToF32(in);
  const float p = mul(x, scale);
  const float t = add(p, r_in);
  const float s = add(d, t);
  return efRound(s, r_in, r_out);
}

// acc + f32(in).
XR_HD inline float decodeAccumulate(float acc, uint16_t in) { return add(acc, bf16ToF32(in)); }

// ---------------------------------------------------------------------------------------------
// Scaled wire formats with error feedback: fp16 and int8 codes, one fp32 scale per segment
// (codec.h: Wire, encodeBlockEF). A value is code x scale; the scale comes from the segment's
// largest finite magnitude `amax`; inf/NaN elements do not enter it.
// ---------------------------------------------------------------------------------------------

// int8: scale = amax / 127 (codes -127..127, round half to even of s / scale; 0 when amax is 0 or
// underflows). -128 flags an inf/NaN element and decodes to NaN (xirang.fsdp's int8 wire, bit for
// bit).
constexpr int8_t kInt8NonFinite = -128;
XR_HD inline float int8Scale(float amax) { return div(amax, 127.0f); }
XR_HD inline int8_t int8Code(float s, float scale) {
  if (isNan(s) || isInf(s)) return kInt8NonFinite;
  if (!(scale > 0.0f)) return 0;
  // Round half to even through the 2^23 + 2^22 trick: |s / scale| <= 127 (1 + 2^-23).
  float q = sub(add(div(s, scale), 12582912.0f), 12582912.0f);
  q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
  return static_cast<int8_t>(q);
}
XR_HD inline float int8Value(int8_t c, float scale) {
  return c == kInt8NonFinite ? floatOf(0x7FC00000u) : mul(static_cast<float>(c), scale);
}

// fp16: the power of two scale = 2^(e-14) for amax in [2^e, 2^(e+1)) (at least 2^-126), so that
// amax / scale lies in [2^14, 2^15): no overflow to fp16's inf (65504), 11 significant bits for
// every value down to amax x 2^-29. Multiplying by a power of two and its reciprocal is exact:
// the only rounding is fp16's. inf/NaN elements stay inf/NaN (fp16 has them).
XR_HD inline float fp16Scale(float amax) {
  uint32_t e = (bitsOf(amax) >> 23) & 0xFFu;
  e = e < 15u ? 15u : e;
  return floatOf((e - 14u) << 23);
}
XR_HD inline uint16_t fp16Code(float s, float scale) {
  const uint32_t e = (bitsOf(scale) >> 23) & 0xFFu;
  return floatToHalf(mul(s, floatOf((254u - e) << 23)));  // s / scale, exactly
}
XR_HD inline float fp16Value(uint16_t c, float scale) { return mul(halfToFloat(c), scale); }

// The residual of one scaled rounding: s - v; a finite s whose value v came out infinite (|s|
// near FLT_MAX) keeps r_in, as efRound does.
XR_HD inline float scaledResidual(float s, float v, float r_in) {
  return (isInf(v) && !isInf(s) && !isNan(s)) ? r_in : sub(s, v);
}

// One segment (n <= codec::kWireSegment elements) of a scaled block, element by element: the
// CPU codec's scalar path (codec.cc) and the device kernels (device/kernels.h: ScaledEncodeEF,
// ScaledDecode). `int8`: int8 codes, else fp16 codes (native byte order, read and written through
// memcpy: a block's fp16 codes need not be 2-byte aligned on the host).
// The segment's largest finite |x*scale + r_in| (0 if none).
XR_HD inline float segAmax(const float* x, float scale, const float* r_in, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = floatOf(bitsOf(add(mul(x[i], scale), r_in[i])) & 0x7FFFFFFFu);
    if (!isNan(a) && !isInf(a) && a > amax) amax = a;
  }
  return amax;
}
// The segment's scale for that amax.
XR_HD inline float segScale(bool int8, float amax) { return int8 ? int8Scale(amax) : fp16Scale(amax); }
// codes and r_out of s = x*scale + r_in with the segment's scale sc (r_in read before r_out is
// written, element by element: the two may alias).
XR_HD inline void segEncode(bool int8, const float* x, float scale, const float* r_in, float* r_out, uint8_t* codes,
                            float sc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = add(mul(x[i], scale), r_in[i]);
    float v;
    if (int8) {
      const int8_t c = int8Code(s, sc);
      reinterpret_cast<int8_t*>(codes)[i] = c;
      v = int8Value(c, sc);
    } else {
      const uint16_t c = fp16Code(s, sc);
      memcpy(codes + 2 * i, &c, 2);
      v = fp16Value(c, sc);
    }
    r_out[i] = scaledResidual(s, v, r_in[i]);
  }
}
// The value of code i of a segment whose codes start at `codes`.
XR_HD inline float segValue(bool int8, const uint8_t* codes, int64_t i, float sc) {
  if (int8) return int8Value(reinterpret_cast<const int8_t*>(codes)[i], sc);
  uint16_t c;
  memcpy(&c, codes + 2 * i, 2);
  return fp16Value(c, sc);
}

// ---------------------------------------------------------------------------------------------
// Reductions (reduce.h's rules)
// ---------------------------------------------------------------------------------------------

// A complex number as two parts (std::complex's layout: real, imaginary).
template <class T>
struct Complex {
  T re, im;
};

// Floating MIN/MAX propagate NaN like torch.minimum: a NaN on either side gives a + b.
template <class T>
XR_HD inline T minNan(T a, T b) {
  return (isNan(a) || isNan(b)) ? add(a, b) : (b < a ? b : a);
}
template <class T>
XR_HD inline T maxNan(T a, T b) {
  return (isNan(a) || isNan(b)) ? add(a, b) : (b > a ? b : a);
}

// cmul's recovery steps (C11 Annex G): a NaN part becomes a zero of its sign; an infinite
// operand (p + qi) becomes a "box" (+-1 for an infinite part, +-0 for a finite one, signs kept)
// and the other operand's (r + si) NaN parts zeros. boxInf: whether p + qi was infinite.
template <class T>
XR_HD inline void nanToZero(T& v) {
  if (isNan(v)) v = copySign(T(0), v);
}
template <class T>
XR_HD inline bool boxInf(T& p, T& q, T& r, T& s) {
  if (!(isInf(p) || isInf(q))) return false;
  p = copySign(isInf(p) ? T(1) : T(0), p);
  q = copySign(isInf(q) ? T(1) : T(0), q);
  nanToZero(r);
  nanToZero(s);
  return true;
}

// (a + bi)(c + di) as GCC computes std::complex<T> * std::complex<T> (the inline product, then
// libgcc's __mulsc3 / __muldc3 recovery of infinities when both parts come out NaN: C11 Annex G).
template <class T>
XR_HD inline Complex<T> cmul(Complex<T> z, Complex<T> w) {
  T a = z.re, b = z.im, c = w.re, d = w.im;
  const T ac = mul(a, c), bd = mul(b, d), ad = mul(a, d), bc = mul(b, c);
  T x = sub(ac, bd), y = add(ad, bc);
  if (isNan(x) && isNan(y)) {
    bool recalc = boxInf(a, b, c, d);
    recalc = boxInf(c, d, a, b) || recalc;
    if (!recalc && (isInf(ac) || isInf(bd) || isInf(ad) || isInf(bc))) {
      nanToZero(a);
      nanToZero(b);
      nanToZero(c);
      nanToZero(d);
      recalc = true;
    }
    if (recalc) {
      const T inf = sizeof(T) == 4 ? T(floatOf(0x7F800000u)) : T(doubleOf(0x7FF0000000000000ull));
      x = mul(inf, sub(mul(a, c), mul(b, d)));
      y = mul(inf, add(mul(a, d), mul(b, c)));
    }
  }
  return Complex<T>{x, y};
}

// Whether reduction `op` exists on element type T in the kernels (reduce.h: checkReduceOp, with
// AVG / PREMUL_SUM already turned into SUM). kBool: T = uint8_t holding torch bools.
template <class T, bool kBool = false>
constexpr bool reduceDefined(ReduceOp op) {
  if constexpr (kBool)
    return op == ReduceOp::Sum || op == ReduceOp::Max || op == ReduceOp::BOr || op == ReduceOp::Min ||
           op == ReduceOp::Product || op == ReduceOp::BAnd || op == ReduceOp::BXor;
  else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
    return op == ReduceOp::Sum || op == ReduceOp::Product || op == ReduceOp::Min || op == ReduceOp::Max;
  else if constexpr (std::is_same_v<T, Complex<float>> || std::is_same_v<T, Complex<double>>)
    return op == ReduceOp::Sum || op == ReduceOp::Product;
  else
    return op == ReduceOp::Sum || op == ReduceOp::Product || op == ReduceOp::Min || op == ReduceOp::Max ||
           op == ReduceOp::BAnd || op == ReduceOp::BOr || op == ReduceOp::BXor;
}

// dst op src for one element: reduceInto's arithmetic (reduce.cc). Integers wrap around (the sum
// and product are done in the unsigned type, at least 32 bits wide, as torch's results are);
// bool: SUM/MAX/BOR = OR, MIN/PRODUCT/BAND = AND, BXOR = XOR, the result 0 or 1.
template <ReduceOp Op, class T, bool kBool = false>
XR_HD inline T reduceElem(T a, T b) {
  if constexpr (kBool) {
    if constexpr (Op == ReduceOp::Sum || Op == ReduceOp::Max || Op == ReduceOp::BOr)
      return static_cast<T>((a | b) != 0);
    else if constexpr (Op == ReduceOp::BXor)
      return static_cast<T>((a != 0) != (b != 0));
    else
      return static_cast<T>((a != 0) && (b != 0));
  } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if constexpr (Op == ReduceOp::Sum) return add(a, b);
    else if constexpr (Op == ReduceOp::Product) return mul(a, b);
    else if constexpr (Op == ReduceOp::Min) return minNan(a, b);
    else return maxNan(a, b);
  } else if constexpr (std::is_same_v<T, Complex<float>> || std::is_same_v<T, Complex<double>>) {
    if constexpr (Op == ReduceOp::Sum) return T{add(a.re, b.re), add(a.im, b.im)};
    else return cmul(a, b);
  } else {
    using U = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;
    if constexpr (Op == ReduceOp::Sum) return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    else if constexpr (Op == ReduceOp::Product) return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
    else if constexpr (Op == ReduceOp::Min) return b < a ? b : a;
    else if constexpr (Op == ReduceOp::Max) return b > a ? b : a;
    else if constexpr (Op == ReduceOp::BAnd) return static_cast<T>(a & b);
    else if constexpr (Op == ReduceOp::BOr) return static_cast<T>(a | b);
    else return static_cast<T>(a ^ b);
  }
}

// x * factor (scale(): AVG's 1/N, PREMUL_SUM's factor). Complex numbers are multiplied part by
// part by the real factor, as std::complex<T> *= T does.
XR_HD inline float scaleElem(float x, float f) { return mul(x, f); }
XR_HD inline double scaleElem(double x, double f) { return mul(x, f); }
template <class T>
XR_HD inline Complex<T> scaleElem(Complex<T> x, T f) {
  return Complex<T>{mul(x.re, f), mul(x.im, f)};
}

// The fp32 fold of the 16-bit reductions (algorithms/reducer.h: combine16): Sum, Product, Min,
// Max with NaN propagation.
template <ReduceOp Op>
XR_HD inline float fold(float acc, float v) {
  static_assert(Op == ReduceOp::Sum || Op == ReduceOp::Product || Op == ReduceOp::Min || Op == ReduceOp::Max,
                "fold: Sum, Product, Min or Max");
  return reduceElem<Op, float>(acc, v);
}

}  // namespace xirang::el
