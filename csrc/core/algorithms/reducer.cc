#include "core/algorithms/reducer.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/codec.h"
#include "core/reduce.h"

namespace xirang::algo {

namespace {

class HostReducer : public Reducer {
 public:
  transport::Memory memory() const override { return transport::Memory::Host; }
  std::unique_ptr<uint8_t[], void (*)(uint8_t*)> allocate(size_t bytes) override {
    // new uint8_t[] (default-initialised): no zeroing pass over what the algorithm overwrites.
    return {new uint8_t[bytes], [](uint8_t* p) { delete[] p; }};
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

  void combine16(const uint16_t* slots, int contributors, int64_t count, DType t, ReduceOp op, float pre, float post,
                 uint16_t* out) override {
    const bool half = check16(t);
    auto toF = [half](uint16_t v) { return half ? halfToFloat(v) : codec::bf16ToF32(v); };
    auto fromF = [half](float v) { return half ? floatToHalf(v) : codec::f32ToBf16(v); };
    auto fold = [op](float a, float b) {
      switch (op) {
        case ReduceOp::Sum: return a + b;
        case ReduceOp::Product: return a * b;
        case ReduceOp::Min: return (std::isnan(a) || std::isnan(b)) ? a + b : (b < a ? b : a);
        case ReduceOp::Max: return (std::isnan(a) || std::isnan(b)) ? a + b : (b > a ? b : a);
        default: throw std::invalid_argument(std::string("xirang: 16-bit reduction: ") + reduceOpName(op));
      }
    };
    for (int64_t i = 0; i < count; ++i) {
      float acc = toF(slots[i]) * pre;
      for (int k = 1; k < contributors; ++k) acc = fold(acc, toF(slots[count * k + i]) * pre);
      out[i] = fromF(acc * post);
    }
  }
  void widen(const uint16_t* in, float* out, int64_t n, DType t) override {
    if (check16(t)) {
      for (int64_t i = 0; i < n; ++i) out[i] = halfToFloat(in[i]);
    } else {
      codec::decode(in, out, n);
    }
  }
  void narrow(const float* in, uint16_t* out, int64_t n, DType t) override {
    if (check16(t)) {
      for (int64_t i = 0; i < n; ++i) out[i] = floatToHalf(in[i]);
    } else {
      codec::encode(in, out, n);
    }
  }

 private:
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

}  // namespace xirang::algo
