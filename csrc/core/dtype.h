// Element types and reduction operators as the torch-free core sees them.
// The backend maps at::ScalarType / c10d::ReduceOp onto these; the wire header carries
// the numeric values, so never renumber an existing entry.
#pragma once

#include <cstddef>
#include <cstdint>

namespace xirang {

enum class DType : uint8_t {
  Float32 = 1,
  Float64 = 2,
  Float16 = 3,
  BFloat16 = 4,
  Int8 = 5,
  Int16 = 6,
  Int32 = 7,
  Int64 = 8,
  UInt8 = 9,
  Bool = 10,
  Complex64 = 11,
  Complex128 = 12,
  Complex32 = 13,
  Bytes = 14,  // opaque bytes: data movement of any other dtype (e.g. float8, uint16)
};

// Size in bytes of one element. Bytes -> 1.
size_t elementSize(DType t);
const char* dtypeName(DType t);
bool isFloating(DType t);  // Float32/64/16, BFloat16
bool isIntegral(DType t);  // Int8..Int64, UInt8 (not Bool)

enum class ReduceOp : uint8_t {
  Sum = 1,
  Avg = 2,
  Product = 3,
  Min = 4,
  Max = 5,
  PremulSum = 6,
  BAnd = 7,
  BOr = 8,
  BXor = 9,
  None = 0,  // data movement, no reduction
};

const char* reduceOpName(ReduceOp op);

}  // namespace xirang
