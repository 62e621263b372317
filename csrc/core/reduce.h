// Elementwise reductions on raw buffers, the arithmetic inside every reducing collective.
// 16-bit floats are not reduced here: a reduction over N ranks must round them once, so the
// planner (planner.h) either widens them to float32 for the whole reduction or has each chunk's
// owner accumulate the N contributions in float32 (algorithms/reducer.h: combine16).
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace xirang {

// Returns "" if `op` is defined on `t`, else a message such as "AVG is not defined on int64".
// Rules (NCCL/Gloo semantics): SUM/PRODUCT/MIN/MAX on every numeric dtype (MIN/MAX not on
// complex); AVG and PREMUL_SUM only on floating and complex; BAND/BOR/BXOR only on integers and
// bool; bool: SUM/MAX = OR, MIN/PRODUCT = AND.
std::string checkReduceOp(DType t, ReduceOp op);

// dst[i] = op(dst[i], src[i]) for i in [0, n). `op` is one of Sum, Product, Min, Max, BAnd, BOr,
// BXor (Avg and PremulSum are Sum plus scale()). Min/Max propagate NaN like torch.minimum.
// Throws std::invalid_argument for combinations checkReduceOp rejects or for Float16/BFloat16.
void reduceInto(void* dst, const void* src, int64_t n, DType t, ReduceOp op);

// x[i] *= factor for a floating or complex buffer (AVG's 1/N, PREMUL_SUM's factor).
void scale(void* x, int64_t n, DType t, double factor);

// IEEE binary16 <-> binary32, round to nearest even, bit-exact with torch's c10::Half (the
// FP16 library's fp16_ieee_from_fp32_value / fp16_ieee_to_fp32_value).
float halfToFloat(uint16_t h);
uint16_t floatToHalf(float f);

}  // namespace xirang
