#include "core/reduce.h"

#include <cmath>
#include <complex>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace xirang {

size_t elementSize(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Int8: return 1;
    case DType::Int16: return 2;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
    case DType::UInt8: return 1;
    case DType::Bool: return 1;
    case DType::Complex64: return 8;
    case DType::Complex128: return 16;
    case DType::Complex32: return 4;
    case DType::Bytes: return 1;
  }
  throw std::invalid_argument("xirang: unknown dtype code " + std::to_string(static_cast<int>(t)));
}

const char* dtypeName(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int8: return "int8";
    case DType::Int16: return "int16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::UInt8: return "uint8";
    case DType::Bool: return "bool";
    case DType::Complex64: return "complex64";
    case DType::Complex128: return "complex128";
    case DType::Complex32: return "complex32";
    case DType::Bytes: return "bytes";
  }
  return "unknown";
}

bool isFloating(DType t) {
  return t == DType::Float32 || t == DType::Float64 || t == DType::Float16 || t == DType::BFloat16;
}

bool isIntegral(DType t) {
  return t == DType::Int8 || t == DType::Int16 || t == DType::Int32 || t == DType::Int64 ||
         t == DType::UInt8;
}

static bool isComplex(DType t) {
  return t == DType::Complex64 || t == DType::Complex128 || t == DType::Complex32;
}

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "SUM";
    case ReduceOp::Avg: return "AVG";
    case ReduceOp::Product: return "PRODUCT";
    case ReduceOp::Min: return "MIN";
    case ReduceOp::Max: return "MAX";
    case ReduceOp::PremulSum: return "PREMUL_SUM";
    case ReduceOp::BAnd: return "BAND";
    case ReduceOp::BOr: return "BOR";
    case ReduceOp::BXor: return "BXOR";
    case ReduceOp::None: return "NONE";
  }
  return "UNKNOWN";
}

std::string checkReduceOp(DType t, ReduceOp op) {
  auto no = [&] { return std::string(reduceOpName(op)) + " is not defined on " + dtypeName(t); };
  if (t == DType::Bytes || t == DType::Complex32) return no();
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Product:
      return "";
    case ReduceOp::Min:
    case ReduceOp::Max:
      return isComplex(t) ? no() : "";
    case ReduceOp::Avg:
    case ReduceOp::PremulSum:
      return (isFloating(t) || isComplex(t)) ? "" : no();
    case ReduceOp::BAnd:
    case ReduceOp::BOr:
    case ReduceOp::BXor:
      return (isIntegral(t) || t == DType::Bool) ? "" : no();
    case ReduceOp::None:
      return no();
  }
  return no();
}

namespace {

template <typename T>
void reduceTyped(T* d, const T* s, int64_t n, ReduceOp op) {
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    // Signed overflow is undefined in C++; torch wraps around. Do it in the unsigned type.
    using U = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;
    if (op == ReduceOp::Sum) {
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<U>(d[i]) + static_cast<U>(s[i]));
      return;
    }
    if (op == ReduceOp::Product) {
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<U>(d[i]) * static_cast<U>(s[i]));
      return;
    }
  }
  switch (op) {
    case ReduceOp::Sum:
      for (int64_t i = 0; i < n; ++i) d[i] = d[i] + s[i];
      return;
    case ReduceOp::Product:
      for (int64_t i = 0; i < n; ++i) d[i] = d[i] * s[i];
      return;
    default:
      break;
  }
  if constexpr (std::is_floating_point_v<T>) {
    if (op == ReduceOp::Min) {
      for (int64_t i = 0; i < n; ++i)
        d[i] = (std::isnan(d[i]) || std::isnan(s[i])) ? d[i] + s[i] : (s[i] < d[i] ? s[i] : d[i]);
      return;
    }
    if (op == ReduceOp::Max) {
      for (int64_t i = 0; i < n; ++i)
        d[i] = (std::isnan(d[i]) || std::isnan(s[i])) ? d[i] + s[i] : (s[i] > d[i] ? s[i] : d[i]);
      return;
    }
  } else if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case ReduceOp::Min:
        for (int64_t i = 0; i < n; ++i) d[i] = s[i] < d[i] ? s[i] : d[i];
        return;
      case ReduceOp::Max:
        for (int64_t i = 0; i < n; ++i) d[i] = s[i] > d[i] ? s[i] : d[i];
        return;
      case ReduceOp::BAnd:
        for (int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] & s[i]);
        return;
      case ReduceOp::BOr:
        for (int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] | s[i]);
        return;
      case ReduceOp::BXor:
        for (int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] ^ s[i]);
        return;
      default:
        break;
    }
  }
  throw std::invalid_argument(std::string("xirang: reduce op ") + reduceOpName(op) +
                              " not supported here");
}

void reduceBool(uint8_t* d, const uint8_t* s, int64_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Max:
    case ReduceOp::BOr:
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint8_t>((d[i] | s[i]) != 0);
      return;
    case ReduceOp::Min:
    case ReduceOp::Product:
    case ReduceOp::BAnd:
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint8_t>((d[i] != 0) && (s[i] != 0));
      return;
    case ReduceOp::BXor:
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint8_t>((d[i] != 0) != (s[i] != 0));
      return;
    default:
      throw std::invalid_argument("xirang: reduce op not supported on bool");
  }
}

}  // namespace

void reduceInto(void* dst, const void* src, int64_t n, DType t, ReduceOp op) {
  std::string err = checkReduceOp(t, op);
  if (!err.empty()) throw std::invalid_argument("xirang: " + err);
  if (op == ReduceOp::Avg || op == ReduceOp::PremulSum) op = ReduceOp::Sum;
  switch (t) {
    case DType::Float32: return reduceTyped(static_cast<float*>(dst), static_cast<const float*>(src), n, op);
    case DType::Float64: return reduceTyped(static_cast<double*>(dst), static_cast<const double*>(src), n, op);
    case DType::Int8: return reduceTyped(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), n, op);
    case DType::Int16: return reduceTyped(static_cast<int16_t*>(dst), static_cast<const int16_t*>(src), n, op);
    case DType::Int32: return reduceTyped(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n, op);
    case DType::Int64: return reduceTyped(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n, op);
    case DType::UInt8: return reduceTyped(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, op);
    case DType::Bool: return reduceBool(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, op);
    case DType::Complex64:
      return reduceTyped(static_cast<std::complex<float>*>(dst), static_cast<const std::complex<float>*>(src), n, op);
    case DType::Complex128:
      return reduceTyped(static_cast<std::complex<double>*>(dst), static_cast<const std::complex<double>*>(src), n, op);
    default:
      throw std::invalid_argument(std::string("xirang: reduceInto does not take ") + dtypeName(t) +
                                  " (16-bit floats are widened to float32 first)");
  }
}

namespace {
inline float bitsToFloat(uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline uint32_t floatToBits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
}
}  // namespace

float halfToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bitsToFloat((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bitsToFloat((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result = sign | (two_w < (1u << 27) ? floatToBits(denormalized) : floatToBits(normalized));
  return bitsToFloat(result);
}

uint16_t floatToHalf(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = floatToBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bitsToFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = floatToBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

void scale(void* x, int64_t n, DType t, double factor) {
  switch (t) {
    case DType::Float32: {
      auto* p = static_cast<float*>(x);
      const float f = static_cast<float>(factor);
      for (int64_t i = 0; i < n; ++i) p[i] *= f;
      return;
    }
    case DType::Float64: {
      auto* p = static_cast<double*>(x);
      for (int64_t i = 0; i < n; ++i) p[i] *= factor;
      return;
    }
    case DType::Complex64: {
      auto* p = static_cast<std::complex<float>*>(x);
      const float f = static_cast<float>(factor);
      for (int64_t i = 0; i < n; ++i) p[i] *= f;
      return;
    }
    case DType::Complex128: {
      auto* p = static_cast<std::complex<double>*>(x);
      for (int64_t i = 0; i < n; ++i) p[i] *= factor;
      return;
    }
    default:
      throw std::invalid_argument(std::string("xirang: cannot scale ") + dtypeName(t));
  }
}

}  // namespace xirang
