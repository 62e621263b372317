// Elementwise reductions (csrc/core/reduce.h) against straightforward per-element references.
#include <catch2/catch.hpp>

#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/reduce.h"
#include "support.h"

namespace {

using xirang::DType;
using xirang::ReduceOp;
using xirang_test::mix;
using xirang_test::unit;

const ReduceOp kAllOps[] = {ReduceOp::Sum, ReduceOp::Avg,  ReduceOp::Product, ReduceOp::Min, ReduceOp::Max,
                            ReduceOp::PremulSum, ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor};

template <typename T>
T gen(uint64_t h, int salt) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    // Mix of magnitudes and signs, a few exact specials.
    switch (h % 16) {
      case 0: return T(0);
      case 1: return T(-0.0);
      case 2: return std::numeric_limits<T>::max();
      case 3: return std::numeric_limits<T>::lowest();
      case 4: return std::numeric_limits<T>::denorm_min();
      default: return static_cast<T>((unit(mix(h, salt)) - 0.5) * std::ldexp(1.0, static_cast<int>(h % 40) - 20));
    }
  } else if constexpr (std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>>) {
    using R = typename T::value_type;
    return T(static_cast<R>(unit(mix(h, salt, 1)) * 8 - 4), static_cast<R>(unit(mix(h, salt, 2)) * 8 - 4));
  } else {
    // Integers: the full range, including the extremes.
    switch (h % 8) {
      case 0: return std::numeric_limits<T>::min();
      case 1: return std::numeric_limits<T>::max();
      case 2: return T(0);
      case 3: return T(-1);
      default: return static_cast<T>(mix(h, salt));
    }
  }
}

// Reference for one element. Integer sums/products wrap (two's complement), computed in uint64
// so the reference itself is well defined.
template <typename T>
T ref(T a, T b, ReduceOp op) {
  if (op == ReduceOp::Avg || op == ReduceOp::PremulSum) op = ReduceOp::Sum;
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    const U ua = static_cast<U>(a), ub = static_cast<U>(b);
    switch (op) {
      case ReduceOp::Sum: return static_cast<T>(static_cast<U>(static_cast<uint64_t>(ua) + ub));
      case ReduceOp::Product: return static_cast<T>(static_cast<U>(static_cast<uint64_t>(ua) * ub));
      case ReduceOp::Min: return a < b ? a : b;
      case ReduceOp::Max: return a > b ? a : b;
      case ReduceOp::BAnd: return static_cast<T>(ua & ub);
      case ReduceOp::BOr: return static_cast<T>(ua | ub);
      case ReduceOp::BXor: return static_cast<T>(ua ^ ub);
      default: break;
    }
  } else {
    switch (op) {
      case ReduceOp::Sum: return a + b;
      case ReduceOp::Product: return a * b;
      default: break;
    }
    if constexpr (std::is_floating_point_v<T>) {
      if (op == ReduceOp::Min) return (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<T>::quiet_NaN() : std::fmin(a, b);
      if (op == ReduceOp::Max) return (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<T>::quiet_NaN() : std::fmax(a, b);
    }
  }
  throw std::logic_error("no reference");
}

template <typename T>
bool same(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
    if (a == 0 && b == 0) return true;  // fmin/fmax's choice of zero sign is not specified
    return a == b;
  } else if constexpr (std::is_integral_v<T>) {
    return a == b;
  } else {
    return same(a.real(), b.real()) && same(a.imag(), b.imag());
  }
}

template <typename T>
void checkDtype(DType t) {
  const int64_t n = 1000;
  for (ReduceOp op : kAllOps) {
    INFO(xirang::dtypeName(t) << " " << xirang::reduceOpName(op));
    std::vector<T> d(n), s(n), want(n);
    for (int64_t i = 0; i < n; ++i) {
      d[i] = gen<T>(mix(static_cast<uint64_t>(i), 1, static_cast<uint64_t>(t)), 1);
      s[i] = gen<T>(mix(static_cast<uint64_t>(i), 2, static_cast<uint64_t>(t)), 2);
    }
    if (!xirang::checkReduceOp(t, op).empty()) {
      CHECK_THROWS_AS(xirang::reduceInto(d.data(), s.data(), n, t, op), std::invalid_argument);
      continue;
    }
    for (int64_t i = 0; i < n; ++i) want[i] = ref(d[i], s[i], op);
    const std::vector<T> src_before = s;
    xirang::reduceInto(d.data(), s.data(), n, t, op);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (!same(d[i], want[i])) {
        if (first < 0) first = i;
        ++bad;
      }
    }
    CAPTURE(first);
    CHECK(bad == 0);
    CHECK(std::memcmp(s.data(), src_before.data(), sizeof(T) * n) == 0);  // src untouched
    // n == 0 is a no-op, also with null pointers.
    CHECK_NOTHROW(xirang::reduceInto(nullptr, nullptr, 0, t, op));
  }
}

}  // namespace

TEST_CASE("reduce: reduceInto for every dtype x op matches the reference", "[reduce]") {
  checkDtype<float>(DType::Float32);
  checkDtype<double>(DType::Float64);
  checkDtype<int8_t>(DType::Int8);
  checkDtype<int16_t>(DType::Int16);
  checkDtype<int32_t>(DType::Int32);
  checkDtype<int64_t>(DType::Int64);
  checkDtype<uint8_t>(DType::UInt8);
  checkDtype<std::complex<float>>(DType::Complex64);
  checkDtype<std::complex<double>>(DType::Complex128);
}

TEST_CASE("reduce: which dtype x op combinations are accepted", "[reduce]") {
  const DType ints[] = {DType::Int8, DType::Int16, DType::Int32, DType::Int64, DType::UInt8};
  const DType floats[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
  for (DType t : ints) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::BAnd,
                        ReduceOp::BOr, ReduceOp::BXor})
      CHECK(xirang::checkReduceOp(t, op) == "");
    CHECK(xirang::checkReduceOp(t, ReduceOp::Avg) != "");
    CHECK(xirang::checkReduceOp(t, ReduceOp::PremulSum) != "");
  }
  for (DType t : floats) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg,
                        ReduceOp::PremulSum})
      CHECK(xirang::checkReduceOp(t, op) == "");
    for (ReduceOp op : {ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor}) CHECK(xirang::checkReduceOp(t, op) != "");
  }
  for (DType t : {DType::Complex64, DType::Complex128}) {
    CHECK(xirang::checkReduceOp(t, ReduceOp::Sum) == "");
    CHECK(xirang::checkReduceOp(t, ReduceOp::Avg) == "");
    CHECK(xirang::checkReduceOp(t, ReduceOp::Min) != "");
    CHECK(xirang::checkReduceOp(t, ReduceOp::Max) != "");
    CHECK(xirang::checkReduceOp(t, ReduceOp::BXor) != "");
  }
  CHECK(xirang::checkReduceOp(DType::Bool, ReduceOp::Avg) != "");
  CHECK(xirang::checkReduceOp(DType::Bool, ReduceOp::BXor) == "");
  CHECK(xirang::checkReduceOp(DType::Bytes, ReduceOp::Sum) != "");
  CHECK(xirang::checkReduceOp(DType::Complex32, ReduceOp::Sum) != "");
  CHECK(xirang::checkReduceOp(DType::Float32, ReduceOp::None) != "");

  // The messages the backend shows users.
  CHECK(xirang::checkReduceOp(DType::Int64, ReduceOp::Avg) == "AVG is not defined on int64");
  CHECK(xirang::checkReduceOp(DType::Float32, ReduceOp::BAnd) == "BAND is not defined on float32");
  CHECK(xirang::checkReduceOp(DType::Complex64, ReduceOp::Max) == "MAX is not defined on complex64");

  // reduceInto enforces the same rules, with the message.
  int64_t a[2] = {1, 2}, b[2] = {3, 4};
  try {
    xirang::reduceInto(a, b, 2, DType::Int64, ReduceOp::Avg);
    FAIL("AVG on int64 accepted");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("AVG is not defined on int64") != std::string::npos);
  }
  float fa[1] = {1}, fb[1] = {2};
  CHECK_THROWS_WITH(xirang::reduceInto(fa, fb, 1, DType::Float32, ReduceOp::BAnd),
                    Catch::Contains("BAND is not defined on float32"));
  // 16-bit floats are widened by the backend, never reduced here.
  uint16_t h1[1] = {0x3c00}, h2[1] = {0x3c00};
  CHECK_THROWS_AS(xirang::reduceInto(h1, h2, 1, DType::Float16, ReduceOp::Sum), std::invalid_argument);
  CHECK_THROWS_AS(xirang::reduceInto(h1, h2, 1, DType::BFloat16, ReduceOp::Sum), std::invalid_argument);
  CHECK_THROWS_AS(xirang::reduceInto(h1, h2, 1, DType::Bytes, ReduceOp::Sum), std::invalid_argument);
}

TEST_CASE("reduce: bool semantics (SUM/MAX = OR, MIN/PRODUCT = AND)", "[reduce]") {
  // Every pair, including non-canonical true bytes (2, 0xff).
  const uint8_t vals[] = {0, 1, 2, 0xff};
  std::vector<uint8_t> d, s;
  for (uint8_t a : vals)
    for (uint8_t b : vals) {
      d.push_back(a);
      s.push_back(b);
    }
  const int64_t n = static_cast<int64_t>(d.size());
  for (ReduceOp op : kAllOps) {
    INFO(xirang::reduceOpName(op));
    std::vector<uint8_t> out = d;
    if (op == ReduceOp::Avg || op == ReduceOp::PremulSum) {
      CHECK_THROWS_AS(xirang::reduceInto(out.data(), s.data(), n, DType::Bool, op), std::invalid_argument);
      continue;
    }
    xirang::reduceInto(out.data(), s.data(), n, DType::Bool, op);
    for (int64_t i = 0; i < n; ++i) {
      const bool a = d[i] != 0, b = s[i] != 0;
      bool want = false;
      switch (op) {
        case ReduceOp::Sum:
        case ReduceOp::Max:
        case ReduceOp::BOr: want = a || b; break;
        case ReduceOp::Min:
        case ReduceOp::Product:
        case ReduceOp::BAnd: want = a && b; break;
        case ReduceOp::BXor: want = a != b; break;
        default: break;
      }
      CAPTURE(i, int(d[i]), int(s[i]));
      CHECK(out[i] == (want ? 1 : 0));  // canonical 0/1 bytes
    }
  }
}

TEST_CASE("reduce: MIN/MAX propagate NaN from either side", "[reduce]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> d = {nan, 1.0f, nan, -inf, 2.0f, inf, -0.0f};
  std::vector<float> s = {1.0f, nan, nan, nan, 3.0f, -inf, 5.0f};
  for (ReduceOp op : {ReduceOp::Min, ReduceOp::Max}) {
    std::vector<float> out = d;
    xirang::reduceInto(out.data(), s.data(), static_cast<int64_t>(out.size()), DType::Float32, op);
    CHECK(std::isnan(out[0]));
    CHECK(std::isnan(out[1]));
    CHECK(std::isnan(out[2]));
    CHECK(std::isnan(out[3]));
    CHECK(out[4] == (op == ReduceOp::Min ? 2.0f : 3.0f));
    CHECK(out[5] == (op == ReduceOp::Min ? -inf : inf));
    CHECK(out[6] == (op == ReduceOp::Min ? -0.0f : 5.0f));
  }
  std::vector<double> dd = {std::nan(""), 1.0, -1.0};
  std::vector<double> ds = {0.0, std::nan(""), -2.0};
  for (ReduceOp op : {ReduceOp::Min, ReduceOp::Max}) {
    std::vector<double> out = dd;
    xirang::reduceInto(out.data(), ds.data(), 3, DType::Float64, op);
    CHECK(std::isnan(out[0]));
    CHECK(std::isnan(out[1]));
    CHECK(out[2] == (op == ReduceOp::Min ? -2.0 : -1.0));
  }
  // Sum/Product: IEEE semantics.
  std::vector<float> a = {inf, 1.0f}, b = {-inf, nan};
  xirang::reduceInto(a.data(), b.data(), 2, DType::Float32, ReduceOp::Sum);
  CHECK(std::isnan(a[0]));
  CHECK(std::isnan(a[1]));
}

TEST_CASE("reduce: scale() and dtype metadata", "[reduce]") {
  std::vector<float> f = {1.0f, -3.0f, 0.5f};
  xirang::scale(f.data(), 3, DType::Float32, 0.25);
  CHECK(f == std::vector<float>{0.25f, -0.75f, 0.125f});
  std::vector<double> d = {1.0, 3.0};
  xirang::scale(d.data(), 2, DType::Float64, 1.0 / 3.0);
  CHECK(d[0] == 1.0 / 3.0);
  CHECK(d[1] == 3.0 * (1.0 / 3.0));
  std::vector<std::complex<double>> c = {{1, -2}};
  xirang::scale(c.data(), 1, DType::Complex128, 2.0);
  CHECK(c[0] == std::complex<double>(2, -4));
  std::vector<std::complex<float>> cf = {{1, -2}};
  xirang::scale(cf.data(), 1, DType::Complex64, 0.5);
  CHECK(cf[0] == std::complex<float>(0.5f, -1.0f));
  int32_t i[1] = {4};
  CHECK_THROWS_AS(xirang::scale(i, 1, DType::Int32, 0.5), std::invalid_argument);

  CHECK(xirang::elementSize(DType::Float32) == 4);
  CHECK(xirang::elementSize(DType::Float64) == 8);
  CHECK(xirang::elementSize(DType::BFloat16) == 2);
  CHECK(xirang::elementSize(DType::Int64) == 8);
  CHECK(xirang::elementSize(DType::Bool) == 1);
  CHECK(xirang::elementSize(DType::Complex128) == 16);
  CHECK(xirang::elementSize(DType::Complex32) == 4);
  CHECK(xirang::elementSize(DType::Bytes) == 1);
  CHECK(std::string(xirang::dtypeName(DType::UInt8)) == "uint8");
  CHECK(std::string(xirang::reduceOpName(ReduceOp::PremulSum)) == "PREMUL_SUM");
  CHECK(xirang::isFloating(DType::BFloat16));
  CHECK_FALSE(xirang::isFloating(DType::Complex64));
  CHECK(xirang::isIntegral(DType::UInt8));
  CHECK_FALSE(xirang::isIntegral(DType::Bool));
}

// binary16 conversions against the compiler's _Float16 (IEEE round to nearest even).
TEST_CASE("reduce: halfToFloat / floatToHalf are bit-exact IEEE binary16", "[reduce][half]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    _Float16 ref;
    uint16_t hb = static_cast<uint16_t>(h);
    std::memcpy(&ref, &hb, 2);
    float got = xirang::halfToFloat(hb);
    float want = static_cast<float>(ref);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
      continue;
    }
    uint32_t a, b;
    std::memcpy(&a, &got, 4);
    std::memcpy(&b, &want, 4);
    REQUIRE(a == b);
    REQUIRE(xirang::floatToHalf(got) == hb);  // exact round trip
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t w = bits(rng);
    float f;
    std::memcpy(&f, &w, 4);
    if (std::isnan(f)) continue;
    _Float16 ref = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &ref, 2);
    REQUIRE(xirang::floatToHalf(f) == want);
  }
  CHECK(xirang::floatToHalf(1.0f) == 0x3C00);
  CHECK(xirang::floatToHalf(65504.0f) == 0x7BFF);
  CHECK(xirang::floatToHalf(65520.0f) == 0x7C00);  // the tie above max rounds to inf
  CHECK(xirang::floatToHalf(-0.0f) == 0x8000);
}
