// BF16 codec with error feedback: scalar reference, AVX2 and AVX-512 BF16 paths.
// See codec.h for the contract; every path must produce the scalar path's bits.
//
// No path may fuse x*scale with the following add. The build passes -ffp-contract=off, but
// the products are also passed through an empty asm barrier (el::opaque, opaque8/16), so the guarantee holds
// even where this file is compiled with GCC's default -ffp-contract=fast (e.g. the
// avx512f target implies FMA, and intrinsic mul/add are ordinary vector ops that GCC contracts).
#include "core/codec.h"
#include "core/env.h"

#include "core/elements.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*() (`__m512i __Y = __Y;`) and
// trip a false -Wmaybe-uninitialized once inlined (GCC PR 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace xirang::codec {
namespace {

// ---------------------------------------------------------------------------------------------
// Scalar reference: the per-element functions of core/elements.h, which the CUDA kernels run too.
// ---------------------------------------------------------------------------------------------

void encodeScalar(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = el::f32ToBf16(x[i]);
}

void decodeScalar(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = el::bf16ToF32(in[i]);
}

void decodeAccumulateScalar(const uint16_t* in, float* acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = el::decodeAccumulate(acc[i], in[i]);
}

void encodeEFScalar(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out,
                    int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float r;
    out[i] = el::encodeEF(x[i], scale, r_in[i], &r);
    r_out[i] = r;
  }
}

void accumulateEncodeEFScalar(const uint16_t* in, const float* x, float scale, const float* r_in,
                              float* r_out, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float r;
    const uint16_t o = el::accumulateEncodeEF(in[i], x[i], scale, r_in[i], &r);  // in[i] read first
    out[i] = o;
    r_out[i] = r;
  }
}

#if defined(__x86_64__)

// ---------------------------------------------------------------------------------------------
// AVX2: integer RNE on 8 lanes. (Only "avx2" is enabled, not "fma": the compiler then cannot
// emit an FMA at all, on top of the opaque barriers.)
// ---------------------------------------------------------------------------------------------

#define XR_AVX2 __attribute__((target("avx2")))

XR_AVX2 inline __m256 opaque8(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

// 8 fp32 bit patterns -> 8 bf16 patterns, each in the low half of a 32-bit lane.
XR_AVX2 inline __m256i rne8(__m256i u) {
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i isNan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7F800000));  // both >= 0
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, isNan);
}

// 8 lanes of values <= 0xFFFF -> 8 uint16 (packus saturation never triggers).
XR_AVX2 inline __m128i pack8(__m256i r) {
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

XR_AVX2 inline __m256 widen8(__m128i b) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

// r_out of 8 lanes (elements.h: efRound): s - f32(out), or r_in where a finite s rounded to +-inf.
XR_AVX2 inline __m256 residual8(__m256 s, __m256i r, __m256 rin) {
  const __m256 back = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
  const __m256i u = _mm256_castps_si256(s);
  const __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), absu);  // both >= 0
  const __m256i toInf =
      _mm256_cmpeq_epi32(_mm256_and_si256(r, _mm256_set1_epi32(0x7FFF)), _mm256_set1_epi32(0x7F80));
  return _mm256_blendv_ps(_mm256_sub_ps(s, back), rin, _mm256_castsi256_ps(_mm256_and_si256(finite, toInf)));
}

XR_AVX2 void encodeAVX2(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), pack8(rne8(u)));
  }
  encodeScalar(x + i, out + i, n - i);
}

XR_AVX2 void decodeAVX2(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  decodeScalar(in + i, out + i, n - i);
}

XR_AVX2 void decodeAccumulateAVX2(const uint16_t* in, float* acc, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 d = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), d));
  }
  decodeAccumulateScalar(in + i, acc + i, n - i);
}

XR_AVX2 void encodeEFAVX2(const float* x, float scale, const float* r_in, float* r_out,
                          uint16_t* out, int64_t n) {
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 p = opaque8(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    const __m256 rin = _mm256_loadu_ps(r_in + i);
    const __m256 s = _mm256_add_ps(p, rin);
    const __m256i r = rne8(_mm256_castps_si256(s));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), pack8(r));
    _mm256_storeu_ps(r_out + i, residual8(s, r, rin));
  }
  encodeEFScalar(x + i, scale, r_in + i, r_out + i, out + i, n - i);
}

XR_AVX2 void accumulateEncodeEFAVX2(const uint16_t* in, const float* x, float scale,
                                    const float* r_in, float* r_out, uint16_t* out, int64_t n) {
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 d = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    const __m256 p = opaque8(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    const __m256 rin = _mm256_loadu_ps(r_in + i);
    const __m256 t = _mm256_add_ps(p, rin);
    const __m256 s = _mm256_add_ps(d, t);
    const __m256i r = rne8(_mm256_castps_si256(s));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), pack8(r));
    _mm256_storeu_ps(r_out + i, residual8(s, r, rin));
  }
  accumulateEncodeEFScalar(in + i, x + i, scale, r_in + i, r_out + i, out + i, n - i);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 BF16: VCVTNEPS2BF16 on 16 lanes. The instruction treats denormal inputs as zero
// (and its NaN handling is not ours to rely on), so lanes whose input is a nonzero denormal or
// a NaN are replaced by the integer-RNE result. Tails use masked loads/stores.
// ---------------------------------------------------------------------------------------------

#define XR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

XR_AVX512 inline __m512 opaque16(__m512 v) {
  __asm__("" : "+v"(v));
  return v;
}

// 16 fp32 -> 16 bf16 patterns (packed uint16), bit-identical to rneBits.
XR_AVX512 inline __m256i cvt16(__m512 s) {
  __m256i o = (__m256i)_mm512_cvtneps_pbh(s);
  const __m512i u = _mm512_castps_si512(s);
  const __m512i absu = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  // nonzero denormal: absu - 1 < 0x7FFFFF (unsigned); NaN: absu > 0x7F800000.
  const __mmask16 special =
      _mm512_cmplt_epu32_mask(_mm512_sub_epi32(absu, _mm512_set1_epi32(1)),
                              _mm512_set1_epi32(0x007FFFFF)) |
      _mm512_cmpgt_epu32_mask(absu, _mm512_set1_epi32(0x7F800000));
  if (__builtin_expect(special != 0, 0)) {
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    const __mmask16 isNan = _mm512_cmpgt_epu32_mask(absu, _mm512_set1_epi32(0x7F800000));
    const __m512i fixed = _mm512_mask_blend_epi32(isNan, rounded, quiet);
    o = _mm256_mask_blend_epi16(special, o, _mm512_cvtepi32_epi16(fixed));
  }
  return o;
}

XR_AVX512 inline __m512 widen16(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// r_out of 16 lanes (elements.h: efRound): s - f32(o), or r_in where a finite s rounded to +-inf.
XR_AVX512 inline __m512 residual16(__m512 s, __m256i o, __m512 rin) {
  const __m512i absu = _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 finite = _mm512_cmplt_epu32_mask(absu, _mm512_set1_epi32(0x7F800000));
  const __mmask16 toInf = _mm256_cmpeq_epi16_mask(_mm256_and_si256(o, _mm256_set1_epi16(0x7FFF)),
                                                  _mm256_set1_epi16(0x7F80));
  return _mm512_mask_blend_ps(finite & toInf, _mm512_sub_ps(s, widen16(o)), rin);
}

XR_AVX512 inline __mmask16 tailMask(int64_t rem) {
  return static_cast<__mmask16>((1u << rem) - 1u);
}

// The 16-lane loop: full(i) for every whole block of 16 elements from i, then tail(i, k) for the
// rest, k its lanes.
template <class Full, class Tail>
XR_AVX512 inline void lanes16(int64_t n, Full&& full, Tail&& tail) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) full(i);
  if (i < n) tail(i, tailMask(n - i));
}

XR_AVX512 void encodeAVX512(const float* x, uint16_t* out, int64_t n) {
  lanes16(
      n,
      [&](int64_t i) XR_AVX512 {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), cvt16(_mm512_loadu_ps(x + i)));
      },
      [&](int64_t i, __mmask16 k) XR_AVX512 {
        _mm256_mask_storeu_epi16(out + i, k, cvt16(_mm512_maskz_loadu_ps(k, x + i)));
      });
}

XR_AVX512 void decodeAVX512(const uint16_t* in, float* out, int64_t n) {
  lanes16(
      n,
      [&](int64_t i) XR_AVX512 {
        _mm512_storeu_ps(out + i, widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
      },
      [&](int64_t i, __mmask16 k) XR_AVX512 {
        _mm512_mask_storeu_ps(out + i, k, widen16(_mm256_maskz_loadu_epi16(k, in + i)));
      });
}

XR_AVX512 void decodeAccumulateAVX512(const uint16_t* in, float* acc, int64_t n) {
  lanes16(
      n,
      [&](int64_t i) XR_AVX512 {
        const __m512 d = widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
        _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), d));
      },
      [&](int64_t i, __mmask16 k) XR_AVX512 {
        const __m512 d = widen16(_mm256_maskz_loadu_epi16(k, in + i));
        _mm512_mask_storeu_ps(acc + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, acc + i), d));
      });
}

XR_AVX512 inline void encodeEF16(const float* x, __m512 vs, const float* r_in, float* r_out,
                                 uint16_t* out, __mmask16 k) {
  const __m512 p = opaque16(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x), vs));
  const __m512 rin = _mm512_maskz_loadu_ps(k, r_in);
  const __m512 s = _mm512_add_ps(p, rin);
  const __m256i o = cvt16(s);
  _mm256_mask_storeu_epi16(out, k, o);
  _mm512_mask_storeu_ps(r_out, k, residual16(s, o, rin));
}

XR_AVX512 void encodeEFAVX512(const float* x, float scale, const float* r_in, float* r_out,
                              uint16_t* out, int64_t n) {
  const __m512 vs = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    encodeEF16(x + i, vs, r_in + i, r_out + i, out + i, static_cast<__mmask16>(0xFFFF));
  }
  if (i < n) encodeEF16(x + i, vs, r_in + i, r_out + i, out + i, tailMask(n - i));
}

XR_AVX512 inline void accumulateEncodeEF16(const uint16_t* in, const float* x, __m512 vs,
                                           const float* r_in, float* r_out, uint16_t* out,
                                           __mmask16 k) {
  const __m512 d = widen16(_mm256_maskz_loadu_epi16(k, in));
  const __m512 p = opaque16(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x), vs));
  const __m512 rin = _mm512_maskz_loadu_ps(k, r_in);
  const __m512 t = _mm512_add_ps(p, rin);
  const __m512 s = _mm512_add_ps(d, t);
  const __m256i o = cvt16(s);
  _mm256_mask_storeu_epi16(out, k, o);
  _mm512_mask_storeu_ps(r_out, k, residual16(s, o, rin));
}

XR_AVX512 void accumulateEncodeEFAVX512(const uint16_t* in, const float* x, float scale,
                                        const float* r_in, float* r_out, uint16_t* out,
                                        int64_t n) {
  const __m512 vs = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    accumulateEncodeEF16(in + i, x + i, vs, r_in + i, r_out + i, out + i,
                         static_cast<__mmask16>(0xFFFF));
  }
  if (i < n) {
    accumulateEncodeEF16(in + i, x + i, vs, r_in + i, r_out + i, out + i, tailMask(n - i));
  }
}

#endif  // __x86_64__

// ---------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------

std::atomic<int> gPath{-1};

Path resolveFromEnv() {
  const std::string raw = env::get("XIRANG_CODEC");  // declared in core/env.cc (default "auto")
  std::string v = raw;
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v.empty() || v == "auto") {
    if (pathAvailable(Path::AVX512BF16)) return Path::AVX512BF16;
    if (pathAvailable(Path::AVX2)) return Path::AVX2;
    return Path::Scalar;
  }
  for (Path p : {Path::Scalar, Path::AVX2, Path::AVX512BF16}) {
    if (v == pathName(p)) {
      if (!pathAvailable(p)) {
        throw std::runtime_error(std::string("XIRANG_CODEC=") + raw + ": codec path '" +
                                 pathName(p) + "' is not available on this CPU/build");
      }
      return p;
    }
  }
  throw std::runtime_error(std::string("XIRANG_CODEC=") + raw +
                           ": unknown codec path (expected auto, avx512bf16, avx2 or scalar)");
}

void checkN(int64_t n, const char* fn) {
  if (n < 0) {
    throw std::invalid_argument(std::string("xirang::codec::") + fn +
                                ": negative element count " + std::to_string(n));
  }
}

}  // namespace

const char* pathName(Path p) {
  switch (p) {
    case Path::Scalar:
      return "scalar";
    case Path::AVX2:
      return "avx2";
    case Path::AVX512BF16:
      return "avx512bf16";
  }
  return "unknown";
}

bool pathAvailable(Path p) {
  switch (p) {
    case Path::Scalar:
      return true;
#if defined(__x86_64__)
    case Path::AVX2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2");
    case Path::AVX512BF16:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
    case Path::AVX2:
    case Path::AVX512BF16:
      return false;
#endif
  }
  return false;
}

Path activePath() {
  int p = gPath.load(std::memory_order_acquire);
  if (p >= 0) return static_cast<Path>(p);
  int resolved = static_cast<int>(resolveFromEnv());  // throws if forced path is unavailable
  int expected = -1;
  gPath.compare_exchange_strong(expected, resolved, std::memory_order_acq_rel);
  return static_cast<Path>(gPath.load(std::memory_order_acquire));
}

void setPathForTesting(Path p) {
  if (!pathAvailable(p)) {
    throw std::runtime_error(std::string("xirang::codec::setPathForTesting: codec path '") +
                             pathName(p) + "' is not available on this CPU/build");
  }
  gPath.store(static_cast<int>(p), std::memory_order_release);
}

uint16_t f32ToBf16(float x) { return el::f32ToBf16(x); }

float bf16ToF32(uint16_t b) { return el::bf16ToF32(b); }

namespace {
// The active path's form of a codec function (only the scalar form is built off x86-64, where
// activePath() is always Scalar).
template <class Fn>
Fn pick(Fn avx512, Fn avx2, Fn scalar) {
  switch (activePath()) {
    case Path::AVX512BF16: return avx512;
    case Path::AVX2: return avx2;
    default: return scalar;
  }
}
}  // namespace
#if defined(__x86_64__)
#define XR_PATHS(fn) fn##AVX512, fn##AVX2, fn##Scalar
#else
#define XR_PATHS(fn) fn##Scalar, fn##Scalar, fn##Scalar
#endif

void encode(const float* x, uint16_t* out, int64_t n) {
  checkN(n, "encode");
  pick(XR_PATHS(encode))(x, out, n);
}

void decode(const uint16_t* in, float* out, int64_t n) {
  checkN(n, "decode");
  pick(XR_PATHS(decode))(in, out, n);
}

void decodeAccumulate(const uint16_t* in, float* acc, int64_t n) {
  checkN(n, "decodeAccumulate");
  pick(XR_PATHS(decodeAccumulate))(in, acc, n);
}

void encodeEF(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out,
              int64_t n) {
  checkN(n, "encodeEF");
  pick(XR_PATHS(encodeEF))(x, scale, r_in, r_out, out, n);
}

void accumulateEncodeEF(const uint16_t* in, const float* x, float scale, const float* r_in,
                        float* r_out, uint16_t* out, int64_t n) {
  checkN(n, "accumulateEncodeEF");
  pick(XR_PATHS(accumulateEncodeEF))(in, x, scale, r_in, r_out, out, n);
}

#undef XR_PATHS

// ---------------------------------------------------------------------------------------------
// Scaled wire formats (fp16, int8): the element functions of core/elements.h, segment by segment.
// ---------------------------------------------------------------------------------------------

const char* wireName(Wire w) {
  switch (w) {
    case Wire::BF16: return "bf16";
    case Wire::FP16: return "fp16";
    case Wire::INT8: return "int8";
  }
  return "unknown";
}

DType wireDType(Wire w) {
  switch (w) {
    case Wire::BF16: return DType::BFloat16;
    case Wire::FP16: return DType::Float16;
    case Wire::INT8: return DType::Int8;
  }
  return DType::Bytes;
}

Wire wireFromName(const std::string& name) {
  for (Wire w : {Wire::BF16, Wire::FP16, Wire::INT8})
    if (name == wireName(w)) return w;
  throw std::invalid_argument("xirang: unknown wire format '" + name + "' (expected bf16, fp16 or int8)");
}

namespace {
uint64_t codeBytes(Wire w) { return w == Wire::INT8 ? 1 : 2; }
uint64_t segments(int64_t n) { return static_cast<uint64_t>((n + kWireSegment - 1) / kWireSegment); }

// One segment of a scaled block, n <= kWireSegment elements; `codes` points at the segment's
// first code, `sc` is its scale. The scalar forms are elements.h's functions element by element;
// the AVX2 forms compute the same bits 8 lanes at a time (the same IEEE operations in the same
// order: a multiply, then an add; the division of int8's s / scale; c10's fp16 conversions as
// integer and fp32 lane operations), their tails the scalar forms.

// The scalar forms: elements.h's segment functions (the device kernels' bodies too).
float segAmaxScalar(const float* x, float scale, const float* r_in, int64_t n) { return el::segAmax(x, scale, r_in, n); }

void segEncodeScalar(Wire w, const float* x, float scale, const float* r_in, float* r_out, uint8_t* codes, float sc,
                     int64_t n) {
  el::segEncode(w == Wire::INT8, x, scale, r_in, r_out, codes, sc, n);
}

// out[i] = value i (accumulate: out[i] = out[i] + value i).
void segDecodeScalar(Wire w, const uint8_t* codes, float sc, float* out, bool accumulate, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = el::segValue(w == Wire::INT8, codes, i, sc);
    out[i] = accumulate ? el::add(out[i], v) : v;
  }
}

#if defined(__x86_64__)
// s = x*scale + r_in on 8 lanes (the product through the barrier: never an FMA).
XR_AVX2 inline __m256 sumOf8(const float* x, __m256 scale, const float* r_in) {
  return _mm256_add_ps(opaque8(_mm256_mul_ps(_mm256_loadu_ps(x), scale)), _mm256_loadu_ps(r_in));
}
XR_AVX2 inline __m256i absBits8(__m256 v) {
  return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
}
// Lanes whose |bits| are below inf's (finite values).
XR_AVX2 inline __m256i finite8(__m256 v) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), absBits8(v)); }

// elements.h: floatToHalf (c10's fp16_ieee_from_fp32_value) on 8 lanes -> 8 uint16 in 32-bit lanes.
XR_AVX2 inline __m256i toHalf8(__m256 f) {
  const __m256i w = _mm256_castps_si256(f);
  __m256 base = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(0x7FFFFFFF))),
                                            _mm256_set1_ps(0x1.0p+112f)),
                              _mm256_set1_ps(0x1.0p-110f));
  const __m256i shl1 = _mm256_add_epi32(w, w);
  const __m256i sign = _mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i bias = _mm256_max_epu32(_mm256_and_si256(shl1, _mm256_set1_epi32(static_cast<int>(0xFF000000u))),
                                        _mm256_set1_epi32(0x71000000));
  base = _mm256_add_ps(
      _mm256_castsi256_ps(_mm256_add_epi32(_mm256_srli_epi32(bias, 1), _mm256_set1_epi32(0x07800000))), base);
  const __m256i bits = _mm256_castps_si256(base);
  const __m256i nonsign = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 13), _mm256_set1_epi32(0x7C00)),
                                           _mm256_and_si256(bits, _mm256_set1_epi32(0x0FFF)));
  // shl1 > 0xFF000000 (unsigned): a NaN.
  const __m256i nan = _mm256_xor_si256(
      _mm256_cmpeq_epi32(_mm256_max_epu32(shl1, _mm256_set1_epi32(static_cast<int>(0xFF000000u))),
                         _mm256_set1_epi32(static_cast<int>(0xFF000000u))),
      _mm256_set1_epi32(-1));
  return _mm256_or_si256(_mm256_srli_epi32(sign, 16), _mm256_blendv_epi8(nonsign, _mm256_set1_epi32(0x7E00), nan));
}

// elements.h: halfToFloat (c10's fp16_ieee_to_fp32_value) of 8 uint16 in 32-bit lanes.
XR_AVX2 inline __m256 fromHalf8(__m256i h) {
  const __m256i w = _mm256_slli_epi32(h, 16);
  const __m256i sign = _mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i two_w = _mm256_add_epi32(w, w);
  const __m256 normalized =
      _mm256_mul_ps(_mm256_castsi256_ps(_mm256_add_epi32(_mm256_srli_epi32(two_w, 4), _mm256_set1_epi32(0xE0 << 23))),
                    _mm256_set1_ps(0x1.0p-112f));
  const __m256 denormalized = _mm256_sub_ps(
      _mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(two_w, 17), _mm256_set1_epi32(126 << 23))),
      _mm256_set1_ps(0.5f));
  // two_w < 2^27 (unsigned): a zero or subnormal half.
  const __m256i small = _mm256_cmpeq_epi32(_mm256_min_epu32(two_w, _mm256_set1_epi32((1 << 27) - 1)), two_w);
  return _mm256_castsi256_ps(_mm256_or_si256(
      sign, _mm256_blendv_epi8(_mm256_castps_si256(normalized), _mm256_castps_si256(denormalized), small)));
}

// int8 value of 8 codes in 32-bit lanes: code x sc, NaN for -128.
XR_AVX2 inline __m256 int8Value8(__m256i c, __m256 sc) {
  const __m256 v = opaque8(_mm256_mul_ps(_mm256_cvtepi32_ps(c), sc));
  const __m256i flag = _mm256_cmpeq_epi32(c, _mm256_set1_epi32(el::kInt8NonFinite));
  return _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_castsi256_ps(flag));
}

XR_AVX2 float segAmaxAVX2(const float* x, float scale, const float* r_in, int64_t n) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 s = sumOf8(x + i, vs, r_in + i);
    m = _mm256_max_epi32(m, _mm256_and_si256(absBits8(s), finite8(s)));  // finite |s| bits order as the values
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  float amax = segAmaxScalar(x + i, scale, r_in + i, n - i);
  for (int32_t b : lanes) amax = std::max(amax, el::floatOf(static_cast<uint32_t>(b)));
  return amax;
}

XR_AVX2 void segEncodeAVX2(Wire w, const float* x, float scale, const float* r_in, float* r_out, uint8_t* codes,
                           float sc, int64_t n) {
  const __m256 vs = _mm256_set1_ps(scale), vsc = _mm256_set1_ps(sc);
  const bool zero = !(sc > 0.0f);  // int8: every finite code 0
  const uint32_t e = (el::bitsOf(sc) >> 23) & 0xFFu;
  const __m256 inv = _mm256_set1_ps(el::floatOf((254u - e) << 23));  // fp16: 1 / scale
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 rin = _mm256_loadu_ps(r_in + i);
    const __m256 s = sumOf8(x + i, vs, r_in + i);
    const __m256i fin = finite8(s);
    __m256 v;
    if (w == Wire::INT8) {
      __m256 q = zero ? _mm256_setzero_ps()
                      : _mm256_sub_ps(_mm256_add_ps(_mm256_div_ps(s, vsc), _mm256_set1_ps(12582912.0f)),
                                      _mm256_set1_ps(12582912.0f));
      q = _mm256_max_ps(_mm256_min_ps(q, _mm256_set1_ps(127.0f)), _mm256_set1_ps(-127.0f));
      const __m256i c = _mm256_blendv_epi8(_mm256_set1_epi32(el::kInt8NonFinite), _mm256_cvttps_epi32(q), fin);
      const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packs_epi16(p16, p16));
      v = int8Value8(c, vsc);
    } else {
      const __m256i c = toHalf8(opaque8(_mm256_mul_ps(s, inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 2 * i), pack8(c));
      v = opaque8(_mm256_mul_ps(fromHalf8(c), vsc));
    }
    // elements.h: scaledResidual: an infinite value of a finite s keeps r_in.
    const __m256i vinf = _mm256_cmpeq_epi32(absBits8(v), _mm256_set1_epi32(0x7F800000));
    _mm256_storeu_ps(r_out + i, _mm256_blendv_ps(_mm256_sub_ps(s, v), rin,
                                                 _mm256_castsi256_ps(_mm256_and_si256(vinf, fin))));
  }
  segEncodeScalar(w, x + i, scale, r_in + i, r_out + i, codes + codeBytes(w) * static_cast<uint64_t>(i), sc, n - i);
}

XR_AVX2 void segDecodeAVX2(Wire w, const uint8_t* codes, float sc, float* out, bool accumulate, int64_t n) {
  const __m256 vsc = _mm256_set1_ps(sc);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v;
    if (w == Wire::INT8) {
      v = int8Value8(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i))), vsc);
    } else {
      v = opaque8(_mm256_mul_ps(
          fromHalf8(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 2 * i)))), vsc));
    }
    _mm256_storeu_ps(out + i, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out + i), v) : v);
  }
  segDecodeScalar(w, codes + codeBytes(w) * static_cast<uint64_t>(i), sc, out + i, accumulate, n - i);
}
#endif

// The active path's segment functions (AVX-512 BF16 CPUs run the AVX2 forms: the scaled formats
// have no AVX-512 code).
#if defined(__x86_64__)
#define XR_SEG(fn) fn##AVX2, fn##AVX2, fn##Scalar
#else
#define XR_SEG(fn) fn##Scalar, fn##Scalar, fn##Scalar
#endif

float scaleAt(const uint8_t* scales, uint64_t k) {
  float v;
  std::memcpy(&v, scales + 4 * k, 4);
  return v;
}

// f(first element, count, scale, codes) for every segment of a scaled block of n elements.
template <class F>
void forEachSegment(Wire w, const uint8_t* block, int64_t n, F&& f) {
  const uint8_t* scales = block + codeBytes(w) * static_cast<uint64_t>(n);
  for (int64_t s0 = 0, k = 0; s0 < n; s0 += kWireSegment, ++k)
    f(s0, std::min(kWireSegment, n - s0), scaleAt(scales, static_cast<uint64_t>(k)),
      block + codeBytes(w) * static_cast<uint64_t>(s0));
}
}  // namespace

uint64_t blockBytes(Wire w, int64_t n) {
  checkN(n, "blockBytes");
  const uint64_t codes = codeBytes(w) * static_cast<uint64_t>(n);
  return w == Wire::BF16 ? codes : codes + 4 * segments(n);
}

void encodeBlockEF(Wire w, const float* x, float scale, const float* r_in, float* r_out, uint8_t* block, int64_t n) {
  checkN(n, "encodeBlockEF");
  if (w == Wire::BF16) {
    encodeEF(x, scale, r_in, r_out, reinterpret_cast<uint16_t*>(block), n);
    return;
  }
  const auto amaxOf = pick(XR_SEG(segAmax));
  const auto encode = pick(XR_SEG(segEncode));
  uint8_t* scales = block + codeBytes(w) * static_cast<uint64_t>(n);
  for (int64_t s0 = 0, k = 0; s0 < n; s0 += kWireSegment, ++k) {
    const int64_t m = std::min(kWireSegment, n - s0);
    // Pass 1: the segment's scale; pass 2 recomputes s (r_in is read before r_out is written,
    // element by element, so the two may alias).
    const float amax = amaxOf(x + s0, scale, r_in + s0, m);
    const float sc = el::segScale(w == Wire::INT8, amax);
    std::memcpy(scales + 4 * k, &sc, 4);
    encode(w, x + s0, scale, r_in + s0, r_out + s0, block + codeBytes(w) * static_cast<uint64_t>(s0), sc, m);
  }
}

void decodeBlock(Wire w, const uint8_t* block, float* out, int64_t n) {
  checkN(n, "decodeBlock");
  if (w == Wire::BF16) return decode(reinterpret_cast<const uint16_t*>(block), out, n);
  const auto dec = pick(XR_SEG(segDecode));
  forEachSegment(w, block, n, [&](int64_t s0, int64_t m, float sc, const uint8_t* c) { dec(w, c, sc, out + s0, false, m); });
}

void decodeAccumulateBlock(Wire w, const uint8_t* block, float* acc, int64_t n) {
  checkN(n, "decodeAccumulateBlock");
  if (w == Wire::BF16) return decodeAccumulate(reinterpret_cast<const uint16_t*>(block), acc, n);
  const auto dec = pick(XR_SEG(segDecode));
  forEachSegment(w, block, n, [&](int64_t s0, int64_t m, float sc, const uint8_t* c) { dec(w, c, sc, acc + s0, true, m); });
}

#undef XR_SEG

}  // namespace xirang::codec
