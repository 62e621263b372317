#include "core/algorithms/reducer.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "core/codec.h"
#include "core/elements.h"
#include "core/reduce.h"

namespace xirang::algo {

namespace {

class HostReducer : public Reducer {
 public:
  transport::Memory memory() const override { return transport::Memory::Host; }
  Buffer allocate(size_t bytes) override {
    // new uint8_t[] (default-initialised): no zeroing pass over what the algorithm overwrites.
    return Buffer(new uint8_t[bytes], [](uint8_t* p) { delete[] p; });
  }
  void reduceInto(void* dst, const void* src, int64_t n, DType t, ReduceOp op) override {
    xirang::reduceInto(dst, src, n, t, op);
  }
  void scale(void* x, int64_t n, DType t, double factor) override { xirang::scale(x, n, t, factor); }
  void copy(void* dst, const void* src, uint64_t bytes) override {
    if (bytes && dst != src) std::memmove(dst, src, bytes);
  }
  void encodeEF(const float* x, float s, const float* r_in, float* r_out, uint16_t* out, int64_t n) override {
    codec::encodeEF(x, s, r_in, r_out, out, n);
  }
  void accumulateEncodeEF(const uint16_t* in, const float* x, float s, const float* r_in, float* r_out, uint16_t* out,
                          int64_t n) override {
    codec::accumulateEncodeEF(in, x, s, r_in, r_out, out, n);
  }
  void decode(const uint16_t* in, float* out, int64_t n) override { codec::decode(in, out, n); }
  void decodeAccumulate(const uint16_t* in, float* acc, int64_t n) override { codec::decodeAccumulate(in, acc, n); }

  void combine16(const uint16_t* slots, int contributors, int64_t count, DType t, ReduceOp op, float pre, float post,
                 uint16_t* out) override {
    const bool half = check16(t);
    switch (op) {
      case ReduceOp::Sum: return half ? fold16<true, ReduceOp::Sum>(slots, contributors, count, pre, post, out)
                                      : fold16<false, ReduceOp::Sum>(slots, contributors, count, pre, post, out);
      case ReduceOp::Product:
        return half ? fold16<true, ReduceOp::Product>(slots, contributors, count, pre, post, out)
                    : fold16<false, ReduceOp::Product>(slots, contributors, count, pre, post, out);
      case ReduceOp::Min: return half ? fold16<true, ReduceOp::Min>(slots, contributors, count, pre, post, out)
                                      : fold16<false, ReduceOp::Min>(slots, contributors, count, pre, post, out);
      case ReduceOp::Max: return half ? fold16<true, ReduceOp::Max>(slots, contributors, count, pre, post, out)
                                      : fold16<false, ReduceOp::Max>(slots, contributors, count, pre, post, out);
      default: throw std::invalid_argument(std::string("xirang: 16-bit reduction: ") + reduceOpName(op));
    }
  }
  void widen(const uint16_t* in, float* out, int64_t n, DType t) override {
    if (check16(t)) {
      for (int64_t i = 0; i < n; ++i) out[i] = el::halfToFloat(in[i]);
    } else {
      codec::decode(in, out, n);
    }
  }
  void narrow(const float* in, uint16_t* out, int64_t n, DType t) override {
    if (check16(t)) {
      for (int64_t i = 0; i < n; ++i) out[i] = el::floatToHalf(in[i]);
    } else {
      codec::encode(in, out, n);
    }
  }

 private:
  // elements.h's per-element fold, the same the device kernel (device/kernels.h: Combine16) runs.
  template <bool kHalf, ReduceOp Op>
  static void fold16(const uint16_t* slots, int contributors, int64_t count, float pre, float post, uint16_t* out) {
    for (int64_t i = 0; i < count; ++i) {
      float acc = el::mul(el::to32<kHalf>(slots[i]), pre);
      for (int k = 1; k < contributors; ++k) acc = el::fold<Op>(acc, el::mul(el::to32<kHalf>(slots[count * k + i]), pre));
      out[i] = el::from32<kHalf>(el::mul(acc, post));
    }
  }
  static bool check16(DType t) {  // true: float16, false: bfloat16
    if (t != DType::Float16 && t != DType::BFloat16)
      throw std::invalid_argument(std::string("xirang: expected float16 or bfloat16, not ") + dtypeName(t));
    return t == DType::Float16;
  }
};

}  // namespace

Reducer& hostReducer() {
  static HostReducer r;
  return r;
}

namespace {
void hostOnly(const Reducer& r, codec::Wire w) {
  if (r.memory() != transport::Memory::Host)
    throw std::runtime_error(std::string("xirang: the ") + codec::wireName(w) +
                             " wire format has no kernels on this reducer's memory; use bf16");
}
}  // namespace

void Reducer::encodeBlockEF(codec::Wire w, const float* x, float scale, const float* r_in, float* r_out,
                            uint8_t* block, int64_t n) {
  if (w == codec::Wire::BF16) return encodeEF(x, scale, r_in, r_out, reinterpret_cast<uint16_t*>(block), n);
  scaledEncodeEF(w, x, scale, r_in, r_out, block, n);
}

void Reducer::decodeBlock(codec::Wire w, const uint8_t* block, float* out, int64_t n) {
  if (w == codec::Wire::BF16) return decode(reinterpret_cast<const uint16_t*>(block), out, n);
  scaledDecode(w, block, out, n, false);
}

void Reducer::decodeAccumulateBlock(codec::Wire w, const uint8_t* block, float* acc, int64_t n) {
  if (w == codec::Wire::BF16) return decodeAccumulate(reinterpret_cast<const uint16_t*>(block), acc, n);
  scaledDecode(w, block, acc, n, true);
}

void Reducer::scaledEncodeEF(codec::Wire w, const float* x, float scale, const float* r_in, float* r_out,
                             uint8_t* block, int64_t n) {
  hostOnly(*this, w);
  codec::encodeBlockEF(w, x, scale, r_in, r_out, block, n);
}

void Reducer::scaledDecode(codec::Wire w, const uint8_t* block, float* out, int64_t n, bool accumulate) {
  hostOnly(*this, w);
  if (accumulate) codec::decodeAccumulateBlock(w, block, out, n);
  else codec::decodeBlock(w, block, out, n);
}

}  // namespace xirang::algo
