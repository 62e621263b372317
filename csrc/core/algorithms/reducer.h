// What an algorithm does to the data between transfers: the elementwise reductions (reduce.h),
// the BF16 codec with error feedback (codec.h), 16-bit float accumulation in fp32, scaling and
// copies, on the memory the link moves. The ring loops (loops.h) and the algorithms call only
// this; the host reducer runs the CPU functions, and a device reducer (kernels on the link's
// stream, from the same element functions) plugs in without touching the loops.
//
// Units: counts are elements of the dtype named, `bytes` are bytes. Pointers address memory()
// and must not overlap except where noted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "core/codec.h"
#include "core/dtype.h"
#include "core/transport/transport.h"

namespace xirang::algo {

// Working memory of a reducer; its deleter returns it (a device reducer: stream-ordered, after the
// work already enqueued on its stream).
using Buffer = std::unique_ptr<uint8_t[], std::function<void(uint8_t*)>>;

class Reducer {
 public:
  virtual ~Reducer() = default;
  virtual transport::Memory memory() const = 0;
  // `bytes` of uninitialised working memory (never zero-filled: no pass over it).
  virtual Buffer allocate(size_t bytes) = 0;

  // dst[i] = op(dst[i], src[i]): Sum, Product, Min, Max, BAnd, BOr, BXor (reduce.h's rules;
  // no 16-bit floats: see combine16).
  virtual void reduceInto(void* dst, const void* src, int64_t n, DType t, ReduceOp op) = 0;
  // x[i] *= factor (floating and complex dtypes).
  virtual void scale(void* x, int64_t n, DType t, double factor) = 0;
  virtual void copy(void* dst, const void* src, uint64_t bytes) = 0;

  // The compressed ring (codec.h): out = bf16(x*scale + r_in), r_out = the rounding error;
  // the next hops' accumulate-and-re-encode; the final decode.
  virtual void encodeEF(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out, int64_t n) = 0;
  virtual void accumulateEncodeEF(const uint16_t* in, const float* x, float scale, const float* r_in, float* r_out,
                                  uint16_t* out, int64_t n) = 0;
  virtual void decode(const uint16_t* in, float* out, int64_t n) = 0;
  // acc[i] = acc[i] + f32(in[i]) (the direct compressed allreduce's fp32 sum at the owner).
  virtual void decodeAccumulate(const uint16_t* in, float* acc, int64_t n) = 0;

  // The same three steps on a block of wire format w (codec.h: encodeBlockEF, decodeBlock,
  // decodeAccumulateBlock): BF16 is encodeEF / decode / decodeAccumulate above; FP16 and INT8
  // are scaledEncodeEF / scaledDecode below.
  void encodeBlockEF(codec::Wire w, const float* x, float scale, const float* r_in, float* r_out, uint8_t* block,
                     int64_t n);
  void decodeBlock(codec::Wire w, const uint8_t* block, float* out, int64_t n);
  void decodeAccumulateBlock(codec::Wire w, const uint8_t* block, float* acc, int64_t n);
  // FP16 / INT8 blocks (w is not BF16). This base runs the host codec (std::runtime_error naming
  // the format when memory() is not Host and the reducer does not override them).
  virtual void scaledEncodeEF(codec::Wire w, const float* x, float scale, const float* r_in, float* r_out,
                              uint8_t* block, int64_t n);
  virtual void scaledDecode(codec::Wire w, const uint8_t* block, float* out, int64_t n, bool accumulate);

  // 16-bit floats (t = Float16 or BFloat16) reduced once: out[i] = round16(post * fold_k(op,
  // pre * f32(slots[k*count + i]))) over k = 0..contributors-1 in that order, in fp32. Sum,
  // Product, Min, Max (NaN propagates).
  virtual void combine16(const uint16_t* slots, int contributors, int64_t count, DType t, ReduceOp op, float pre,
                         float post, uint16_t* out) = 0;
  // 16-bit floats <-> fp32 (round to nearest even), whole buffers.
  virtual void widen(const uint16_t* in, float* out, int64_t n, DType t) = 0;
  virtual void narrow(const float* in, uint16_t* out, int64_t n, DType t) = 0;
};

// The CPU implementation (SIMD codec paths, codec.h).
Reducer& hostReducer();

}  // namespace xirang::algo
