// BF16 codec with error feedback: the arithmetic of the compressed ring (collectives.h:
// allreduceBF16EF): every rounding to bf16 keeps its error as a residual that is fed back into
// the next step, so sum_t y_t + sum_i r_i = sum_t sum_i x_(i,t) / N up to fp32 rounding.
// Torch-free, plain C++20.
//
// Data types: fp32 values are IEEE-754 binary32 (`float`); bf16 values are carried as their raw
// 16 bits (`uint16_t`), i.e. the upper half of a binary32 with the same sign/exponent layout.
//
// Rounding rule (every path): fp32 -> bf16 is IEEE-754 roundTiesToEven ("RNE") on the 16 dropped
// bits, with no exponent clamping:
//   * ties go to the even bf16 significand, in both directions;
//   * finite values past the bf16 maximum (0x7F7F = 3.3895314e38) round to +-inf exactly as RNE
//     with an unbounded exponent says (anything >= 0x7F7F8000 in magnitude becomes inf);
//   * denormals are rounded exactly like normals (no flush-to-zero, no denormals-are-zero);
//   * +-inf stays +-inf; -0.0 stays -0.0;
//   * NaN -> quiet NaN keeping the sign and the top 7 payload bits: (bits >> 16) | 0x0040.
// bf16 -> fp32 is exact: bits << 16 (NaN payloads, signalling or not, are kept as they are).
//
// The per-element arithmetic is core/elements.h's, shared with the CUDA kernels (cuda/kernels.cu).
//
// Paths: scalar (reference: elements.h's functions), AVX2 (integer RNE on 8 lanes) and AVX-512 BF16 (VCVTNEPS2BF16 on
// 16 lanes, with denormal and NaN lanes patched to the integer RNE result). All paths give the
// same bits as scalar for every input, provided each floating-point add/multiply has at most one
// NaN operand. (When two NaNs meet in one add/multiply, x86 returns the first operand's payload
// and compilers may commute operands, so which payload survives is unspecified; the result is
// still NaN on every path.) Arithmetic is done as written - a multiply then separate adds, never
// fused into an FMA, whatever -ffp-contract says. MXCSR is not touched: if the calling thread
// enabled FTZ/DAZ, the fp32 arithmetic in the EF functions follows it (on every path alike).
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace xirang::codec {

enum class Path : int { Scalar = 0, AVX2 = 1, AVX512BF16 = 2 };

// "scalar", "avx2", "avx512bf16" (the values XIRANG_CODEC accepts); "unknown" otherwise.
const char* pathName(Path p);

// Whether this CPU (and OS) can run path p: runtime check via __builtin_cpu_supports.
// Scalar is always available; on non-x86-64 builds only Scalar exists.
bool pathAvailable(Path p);

// The path every function below dispatches to. On first use reads the environment variable
// XIRANG_CODEC in {auto, avx512bf16, avx2, scalar} (unset or empty = auto = best available).
// Forcing an unavailable path, or an unknown name, throws std::runtime_error naming it.
Path activePath();

// Overrides the active path (tests, benchmarks). Throws std::runtime_error if p is unavailable.
void setPathForTesting(Path p);

// One fp32 -> bf16 bit pattern, RNE as described above.
uint16_t f32ToBf16(float x);
// One bf16 bit pattern -> fp32, exact.
float bf16ToF32(uint16_t b);

// All functions below take n elements, int64_t n >= 0 (n < 0 throws std::invalid_argument;
// pointers may be null when n == 0). Arrays are dense, element-contiguous; fp32 arrays are n
// floats (4n bytes), bf16 arrays n uint16_t (2n bytes). No alignment is required. Pointers must
// not overlap except where an exact alias (same pointer) is noted. `scale` is applied as
// x*scale, a plain rounded multiply, never fused with the following add.

// out[i] = bf16(x[i]).
void encode(const float* x, uint16_t* out, int64_t n);
// out[i] = f32(in[i]).
void decode(const uint16_t* in, float* out, int64_t n);
// acc[i] += f32(in[i])   (computed as acc[i] + f32(in[i])).
void decodeAccumulate(const uint16_t* in, float* acc, int64_t n);

// Fused error-feedback encode (first hop of the compressed ring):
//   s = x*scale + r_in;  out = bf16(s);  r_out = s - f32(out)
// For finite s with finite out, s == f32(out) + r_out exactly. A finite s beyond the bf16
// range (|s| >= 0x7F7F8000, e.g. FLT_MAX) gives out = +-inf and r_out = r_in: the rounding error
// is infinite, so the element's residual is left as it was instead of becoming -+inf and
// poisoning every later step (finite operands never give a non-finite residual). Callers treat
// a non-finite output as a skipped step and do not commit the residual. An inf or NaN s gives a
// NaN residual.
// r_out may alias r_in.
void encodeEF(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out,
              int64_t n);

// Later hops and the owner's final rounding:
//   s = f32(in) + (x*scale + r_in);  out = bf16(s);  r_out = s - f32(out)
// (evaluated in that order: p = x*scale; t = p + r_in; s = f32(in) + t), with encodeEF's
// rounding and overflow rule (a finite s that rounds to +-inf leaves r_out = r_in).
// r_out may alias r_in; out may alias in.
void accumulateEncodeEF(const uint16_t* in, const float* x, float scale, const float* r_in,
                        float* r_out, uint16_t* out, int64_t n);

// ---------------------------------------------------------------------------------------------
// Wire formats of the error-feedback allreduce (collectives.h: allreduceEF, allreduceEFDirect)
// ---------------------------------------------------------------------------------------------
//
//   BF16  2 bytes per element, no scale (the functions above).
//   FP16  2-byte IEEE binary16 codes, one fp32 scale per segment of kWireSegment elements: the
//         power of two 2^(e-14) for the segment's largest finite magnitude in [2^e, 2^(e+1)), so
//         large gradients cannot overflow fp16 (horovod#1699) and small ones keep 11 bits; the
//         only rounding is fp16's RNE of s / scale (exact division by a power of two).
//   INT8  1-byte codes, one fp32 scale = amax / 127 per segment (amax: the largest finite
//         magnitude), code = round-half-even(s / scale) clamped to [-127, 127], -128 for an inf or
//         NaN element (decoded as NaN): the element rule of xirang.fsdp's int8 wire, which cuts its
//         flat buffer into 128-element segments instead (fsdp.py: SEGMENT).
//
// A block of n elements is the n codes followed by ceil(n / kWireSegment) fp32 scales (native
// byte order, unaligned); segments start at the block's first element, the last one is short when
// n is not a multiple. A BF16 block is the n bf16 codes alone. Decoded values are code x scale;
// every rounding's error goes to the residual (s - value, with efRound's rule for a finite s
// whose value is infinite: the residual stays r_in). 1024 elements = 4 KiB of fp32 per scale: the
// scales add 0.4% to int8's bytes (0.251x of fp32 in all), and one large element coarsens only
// its 1023 neighbours.
enum class Wire : int { BF16 = 0, FP16 = 1, INT8 = 2 };
constexpr int64_t kWireSegment = 1024;

// "bf16", "fp16", "int8".
const char* wireName(Wire w);
// The element type of w's codes (BFloat16, Float16, Int8): what an error-feedback operation's
// frame headers carry as their dtype, so ranks that pass different wires fail with a "wire
// mismatch" on every transport (frame.cc: compareHeader) instead of exchanging blocks of
// different layouts.
DType wireDType(Wire w);
// The Wire named `name` (wireName's spelling); std::invalid_argument naming the accepted values.
Wire wireFromName(const std::string& name);
// Bytes of a block of n >= 0 elements in format w (std::invalid_argument for n < 0).
uint64_t blockBytes(Wire w, int64_t n);

// One block, with error feedback at the encoder: s = x*scale + r_in; block = the codes (and
// scales) of s; r_out = s - decoded value. r_out may alias r_in. BF16: encodeEF.
void encodeBlockEF(Wire w, const float* x, float scale, const float* r_in, float* r_out, uint8_t* block, int64_t n);
// out[i] = the decoded value of element i of the block. BF16: decode.
void decodeBlock(Wire w, const uint8_t* block, float* out, int64_t n);
// acc[i] = acc[i] + decoded value i (computed in that order). BF16: decodeAccumulate.
void decodeAccumulateBlock(Wire w, const uint8_t* block, float* acc, int64_t n);

}  // namespace xirang::codec
