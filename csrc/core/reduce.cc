#include "core/reduce.h"

#include "core/elements.h"

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

template <ReduceOp Op, typename T, bool kBool = false>
void loop(T* d, const T* s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = el::reduceElem<Op, T, kBool>(d[i], s[i]);
}

// The per-element arithmetic is elements.h's (the device kernels run the same functions), except
// that floating SUM and PRODUCT are the plain operators here, which the compiler vectorises: on
// x86 they give exactly el::add / el::mul's bits, NaNs included (test_elements.cc checks).
template <typename T, bool kBool = false>
void reduceTyped(T* d, const T* s, int64_t n, ReduceOp op) {
  constexpr bool kFloating = std::is_floating_point_v<T> || std::is_same_v<T, std::complex<float>> ||
                             std::is_same_v<T, std::complex<double>>;
  if constexpr (kFloating) {
    if (op == ReduceOp::Sum) {
      for (int64_t i = 0; i < n; ++i) d[i] = d[i] + s[i];
      return;
    }
    if (op == ReduceOp::Product) {
      for (int64_t i = 0; i < n; ++i) d[i] = d[i] * s[i];
      return;
    }
  }
  if constexpr (std::is_floating_point_v<T>) {
    if (op == ReduceOp::Min) return loop<ReduceOp::Min>(d, s, n);
    if (op == ReduceOp::Max) return loop<ReduceOp::Max>(d, s, n);
  } else if constexpr (!kFloating) {
    switch (op) {
      case ReduceOp::Sum: return loop<ReduceOp::Sum, T, kBool>(d, s, n);
      case ReduceOp::Product: return loop<ReduceOp::Product, T, kBool>(d, s, n);
      case ReduceOp::Min: return loop<ReduceOp::Min, T, kBool>(d, s, n);
      case ReduceOp::Max: return loop<ReduceOp::Max, T, kBool>(d, s, n);
      case ReduceOp::BAnd: return loop<ReduceOp::BAnd, T, kBool>(d, s, n);
      case ReduceOp::BOr: return loop<ReduceOp::BOr, T, kBool>(d, s, n);
      case ReduceOp::BXor: return loop<ReduceOp::BXor, T, kBool>(d, s, n);
      default: break;
    }
  }
  throw std::invalid_argument(std::string("xirang: reduce op ") + reduceOpName(op) + " not supported here" +
                              (kBool ? " on bool" : ""));
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
    case DType::Bool: return reduceTyped<uint8_t, true>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, op);
    case DType::Complex64:
      return reduceTyped(static_cast<std::complex<float>*>(dst), static_cast<const std::complex<float>*>(src), n, op);
    case DType::Complex128:
      return reduceTyped(static_cast<std::complex<double>*>(dst), static_cast<const std::complex<double>*>(src), n, op);
    default:
      throw std::invalid_argument(std::string("xirang: reduceInto does not take ") + dtypeName(t) +
                                  " (16-bit floats are widened to float32 first)");
  }
}

float halfToFloat(uint16_t h) { return el::halfToFloat(h); }

uint16_t floatToHalf(float f) { return el::floatToHalf(f); }

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
