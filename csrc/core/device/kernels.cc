// Kernel descriptors, their check, and the host grid emulator: see kernels.h.
#include "core/device/kernels.h"

#include "core/reduce.h"

namespace xirang::device {

const char* kernelName(KernelKind k) {
  switch (k) {
    case KernelKind::Encode: return "encode";
    case KernelKind::Decode: return "decode";
    case KernelKind::DecodeAccumulate: return "decodeAccumulate";
    case KernelKind::EncodeEF: return "encodeEF";
    case KernelKind::AccumulateEncodeEF: return "accumulateEncodeEF";
    case KernelKind::Reduce: return "reduce";
    case KernelKind::Scale: return "scale";
    case KernelKind::Combine16: return "combine16";
    case KernelKind::Widen16: return "widen16";
    case KernelKind::Narrow16: return "narrow16";
    case KernelKind::ScaledEncodeEF: return "scaledEncodeEF";
    case KernelKind::ScaledDecode: return "scaledDecode";
    case KernelKind::ScaledDecodeAccumulate: return "scaledDecodeAccumulate";
  }
  return "unknown";
}

// Designated initializers in the member order of Kernel (kernels.h); every member not named keeps
// its default.
Kernel Kernel::encode(const float* x, uint16_t* out, int64_t n) {
  return Kernel{.kind = KernelKind::Encode, .n = n, .x = x, .out = out};
}

Kernel Kernel::decode(const uint16_t* in, float* out, int64_t n) {
  return Kernel{.kind = KernelKind::Decode, .n = n, .in = in, .out = out};
}

Kernel Kernel::decodeAccumulate(const uint16_t* in, float* acc, int64_t n) {
  return Kernel{.kind = KernelKind::DecodeAccumulate, .n = n, .in = in, .out = acc};
}

Kernel Kernel::encodeEF(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out, int64_t n) {
  return Kernel{.kind = KernelKind::EncodeEF, .n = n, .scale = scale, .x = x, .r_in = r_in, .r_out = r_out, .out = out};
}

Kernel Kernel::accumulateEncodeEF(const uint16_t* in, const float* x, float scale, const float* r_in, float* r_out,
                                  uint16_t* out, int64_t n) {
  Kernel k = encodeEF(x, scale, r_in, r_out, out, n);
  k.kind = KernelKind::AccumulateEncodeEF;
  k.in = in;
  return k;
}

Kernel Kernel::reduce(void* dst, const void* src, int64_t n, DType t, ReduceOp op) {
  // Avg and PremulSum reduce as Sum (reduceInto's rule; their scaling is separate).
  return Kernel{.kind = KernelKind::Reduce, .dtype = t, .op = op, .n = n, .in = src, .out = dst};
}

Kernel Kernel::scaleBy(void* x, int64_t n, DType t, double factor) {
  return Kernel{.kind = KernelKind::Scale, .dtype = t, .n = n, .factor = factor, .out = x};
}

Kernel Kernel::combine16(const uint16_t* slots, int contributors, int64_t count, DType t, ReduceOp op, float pre,
                         float post, uint16_t* out) {
  return Kernel{.kind = KernelKind::Combine16, .dtype = t, .op = op, .n = count, .contributors = contributors,
                .scale = pre, .post = post, .in = slots, .out = out};
}

Kernel Kernel::widen16(const uint16_t* in, float* out, int64_t n, DType t) {
  return Kernel{.kind = KernelKind::Widen16, .dtype = t, .n = n, .in = in, .out = out};
}

Kernel Kernel::narrow16(const float* in, uint16_t* out, int64_t n, DType t) {
  return Kernel{.kind = KernelKind::Narrow16, .dtype = t, .n = n, .x = in, .out = out};
}

Kernel Kernel::scaledEncodeEF(DType codes, const float* x, float scale, const float* r_in, float* r_out,
                              uint8_t* block, int64_t n) {
  return Kernel{.kind = KernelKind::ScaledEncodeEF, .dtype = codes, .n = n, .scale = scale, .x = x, .r_in = r_in,
                .r_out = r_out, .out = block};
}

Kernel Kernel::scaledDecode(DType codes, const uint8_t* block, float* out, int64_t n, bool accumulate) {
  return Kernel{.kind = accumulate ? KernelKind::ScaledDecodeAccumulate : KernelKind::ScaledDecode, .dtype = codes,
                .n = n, .in = block, .out = out};
}

std::string checkKernel(const Kernel& k) {
  const std::string what = std::string("kernel ") + kernelName(k.kind) + ": ";
  if (k.n < 0) return what + "negative element count " + std::to_string(k.n);
  const bool is16 = k.dtype == DType::Float16 || k.dtype == DType::BFloat16;
  switch (k.kind) {
    case KernelKind::Reduce: {
      if (is16 || k.dtype == DType::Bytes || k.dtype == DType::Complex32)
        return what + "does not take " + dtypeName(k.dtype) + " (16-bit floats: combine16 or widen16)";
      const std::string e = checkReduceOp(k.dtype, k.op);
      if (!e.empty()) return what + e;
      break;
    }
    case KernelKind::Scale:
      if (k.dtype != DType::Float32 && k.dtype != DType::Float64 && k.dtype != DType::Complex64 &&
          k.dtype != DType::Complex128)
        return what + "cannot scale " + dtypeName(k.dtype);
      break;
    case KernelKind::Combine16:
      if (k.op != ReduceOp::Sum && k.op != ReduceOp::Product && k.op != ReduceOp::Min && k.op != ReduceOp::Max)
        return what + "op " + reduceOpName(k.op) + " (Sum, Product, Min or Max)";
      if (k.contributors < 1) return what + "needs at least one contributor, got " + std::to_string(k.contributors);
      [[fallthrough]];
    case KernelKind::Widen16:
    case KernelKind::Narrow16:
      if (!is16) return what + "expects float16 or bfloat16, not " + dtypeName(k.dtype);
      break;
    case KernelKind::ScaledEncodeEF:
    case KernelKind::ScaledDecode:
    case KernelKind::ScaledDecodeAccumulate:
      if (k.dtype != DType::Float16 && k.dtype != DType::Int8)
        return what + "codes are float16 or int8 (the fp16 / int8 wire), not " + dtypeName(k.dtype);
      break;
    default:
      break;
  }
  if (k.n == 0) return "";
  auto need = [&](const void* p, const char* name) { return p ? std::string() : what + "null " + name + " pointer"; };
  std::string e;
  switch (k.kind) {
    case KernelKind::Encode:
    case KernelKind::Narrow16: e = need(k.x, "input") + need(k.out, "output"); break;
    case KernelKind::Decode:
    case KernelKind::DecodeAccumulate:
    case KernelKind::Widen16:
    case KernelKind::Reduce:
    case KernelKind::Combine16: e = need(k.in, "input") + need(k.out, "output"); break;
    case KernelKind::EncodeEF:
      e = need(k.x, "x") + need(k.r_in, "r_in") + need(k.r_out, "r_out") + need(k.out, "output");
      break;
    case KernelKind::AccumulateEncodeEF:
      e = need(k.in, "input") + need(k.x, "x") + need(k.r_in, "r_in") + need(k.r_out, "r_out") + need(k.out, "output");
      break;
    case KernelKind::Scale: e = need(k.out, "data"); break;
    case KernelKind::ScaledEncodeEF:
      e = need(k.x, "x") + need(k.r_in, "r_in") + need(k.r_out, "r_out") + need(k.out, "block");
      break;
    case KernelKind::ScaledDecode:
    case KernelKind::ScaledDecodeAccumulate: e = need(k.in, "block") + need(k.out, "output"); break;
  }
  return e;
}

void emulate(const Kernel& k, uint32_t max_blocks, uint32_t threads) {
  visit(k, [&](const auto& op, int64_t nvec, int64_t n, LaunchDims dims) {
    if (max_blocks > 0) {
      dims.threads = threads;
      if (dims.blocks > max_blocks) dims.blocks = max_blocks;
    }
    emulate(op, nvec, n, dims);
  });
}

}  // namespace xirang::device
