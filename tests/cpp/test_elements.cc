// The one element source (core/elements.h) and the kernel bodies (core/device/kernels.h) run by
// the host grid emulator. References: the CPU codec (codec.h, itself checked against an fp64
// reference in test_codec.cc), reduceInto / scale (reduce.h), the host reducer, the x86
// hardware's own NaN results and std::complex's product.
#include <catch2/catch.hpp>

#include <cfloat>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/algorithms/reducer.h"
#include "core/codec.h"
#include "core/device/kernels.h"
#include "core/elements.h"
#include "core/reduce.h"

namespace {

namespace cd = xirang::codec;
namespace dv = xirang::device;
namespace el = xirang::el;
using xirang::DType;
using xirang::ReduceOp;

uint32_t bitsOf(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float floatOf(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
uint64_t bitsOf(double x) {
  uint64_t u;
  std::memcpy(&u, &x, 8);
  return u;
}

// Random fp32 values: ordinary, any finite pattern, denormals, ties, huge, zeros, inf, NaN
// (quiet and signalling with random payloads), both signs.
float anyFloat(std::mt19937& rng, bool nonFinite = true) {
  std::uniform_int_distribution<uint32_t> any32;
  const uint32_t k = any32(rng) % 100, sign = (any32(rng) & 1u) << 31;
  if (k < 35) return std::normal_distribution<float>(0.0f, 1.0f)(rng) * std::ldexp(1.0f, static_cast<int>(k % 20) - 10);
  if (k < 50) {
    uint32_t u;
    do u = any32(rng); while ((u & 0x7F800000u) == 0x7F800000u);
    return floatOf(u);
  }
  if (k < 60) return floatOf(sign | (any32(rng) & 0x007FFFFFu));
  if (k < 68) return floatOf(sign | ((any32(rng) % 254u + 1u) << 23) | (any32(rng) & 0x007F0000u) | 0x8000u);
  if (k < 74) return floatOf(sign | 0x7F7F0000u | (any32(rng) & 0xFFFFu));  // near FLT_MAX: rounds to inf or not
  if (k < 80) return sign ? -0.0f : 0.0f;
  if (!nonFinite || k < 86) return std::uniform_real_distribution<float>(-8.0f, 8.0f)(rng);
  if (k < 92) return floatOf(sign | 0x7F800000u);
  uint32_t p;
  do p = any32(rng) & 0x007FFFFFu; while (!p);
  return floatOf(sign | 0x7F800000u | p);
}

double anyDouble(std::mt19937& rng) {
  std::uniform_int_distribution<uint64_t> any64;
  const uint64_t k = any64(rng) % 10, sign = (any64(rng) & 1u) << 63;
  double d;
  if (k < 4) return std::normal_distribution<double>(0.0, 100.0)(rng);
  if (k < 6) {
    const uint64_t u = any64(rng) & ~(0x7FFull << 52);
    std::memcpy(&d, &u, 8);
    return d;
  }
  if (k < 7) return sign ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
  if (k < 8) {
    uint64_t u = sign | (0x7FFull << 52) | ((any64(rng) & 0x000FFFFFFFFFFFFFull) | 1u);
    std::memcpy(&d, &u, 8);
    return d;
  }
  if (k < 9) return sign ? -0.0 : 0.0;
  return std::numeric_limits<double>::max() * (sign ? -1.0 : 1.0);
}

// Opaque operands so that the compiler computes the hardware's result at run time.
template <class T>
T hw(T a, T b, char op) {
  volatile T va = a, vb = b;
  const T x = va, y = vb;
  return op == '+' ? x + y : op == '-' ? x - y : x * y;
}

// A host buffer with `pad` sentinel elements after n, and an offset of `off` elements (so that
// the vector form is refused when off is odd).
template <class T>
struct Padded {
  std::vector<T> v;
  size_t off;
  int64_t n;
  Padded(int64_t n_, size_t off_, T fill) : v(static_cast<size_t>(n_) + off_ + 8, fill), off(off_), n(n_) {}
  T* data() { return v.data() + off; }
  const T* data() const { return v.data() + off; }
  std::vector<T> body() const { return std::vector<T>(v.begin() + off, v.begin() + off + n); }
  bool padIntact(T fill) const {
    for (size_t i = 0; i < off; ++i)
      if (std::memcmp(&v[i], &fill, sizeof(T))) return false;
    for (size_t i = off + n; i < v.size(); ++i)
      if (std::memcmp(&v[i], &fill, sizeof(T))) return false;
    return true;
  }
};

template <class T>
size_t firstDiff(const std::vector<T>& a, const std::vector<T>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return i;
  return a.size();
}

// EF inputs where at most one NaN meets in any add (two NaNs: only NaN-ness is defined, codec.h).
struct EFIn {
  std::vector<float> x, r;
  std::vector<uint16_t> in;
};
EFIn efInputs(std::mt19937& rng, int64_t n) {
  EFIn d;
  d.x.resize(n);
  d.r.resize(n);
  d.in.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    d.x[i] = anyFloat(rng);
    d.r[i] = anyFloat(rng, !std::isnan(d.x[i]));
    d.in[i] = cd::f32ToBf16(anyFloat(rng, !std::isnan(d.x[i]) && !std::isnan(d.r[i])));
    if (std::isnan(cd::bf16ToF32(d.in[i]))) {  // inf - inf would make a second NaN meet it
      d.x[i] = anyFloat(rng, false);
      d.r[i] = anyFloat(rng, false);
    }
  }
  return d;
}

const int64_t kTailSizes[] = {0, 1, 7, 4095, 4097, (int64_t{1} << 20) + 3};

}  // namespace

TEST_CASE("elements: x86NaN (the device's NaN patch) gives the x86 hardware's NaN bits", "[elements]") {
#if !defined(__x86_64__)
  WARN("not an x86-64 build: the hardware reference for the NaN patch is not available here");
#else
  std::mt19937 rng(17);
  int64_t nans = 0;
  for (int i = 0; i < 300000; ++i) {
    float a = anyFloat(rng), b = anyFloat(rng, !std::isnan(a));
    if (i % 50 == 0) {  // invalid operations: inf - inf, inf * 0 (x86's default NaN)
      a = floatOf(0x7F800000u);
      b = i % 100 == 0 ? a : 0.0f;
    }
    if (i % 2) std::swap(a, b);
    for (char op : {'+', '-', '*'}) {
      const float want = hw(a, b, op);
      // On this host el::add / sub / mul are the hardware's operations themselves.
      const float got = op == '+' ? el::add(a, b) : op == '-' ? el::sub(a, b) : el::mul(a, b);
      REQUIRE(bitsOf(got) == bitsOf(want));
      if (!std::isnan(want)) continue;
      ++nans;
      if (bitsOf(el::x86NaN(a, b)) != bitsOf(want)) {
        INFO("float " << op << " a=0x" << std::hex << bitsOf(a) << " b=0x" << bitsOf(b) << " hardware 0x"
                      << bitsOf(want) << " patch 0x" << bitsOf(el::x86NaN(a, b)));
        REQUIRE(bitsOf(el::x86NaN(a, b)) == bitsOf(want));
      }
    }
    const double c = anyDouble(rng), d = anyDouble(rng);
    if (std::isnan(c) && std::isnan(d)) continue;
    for (char op : {'+', '-', '*'}) {
      const double want = hw(c, d, op);
      if (!std::isnan(want)) continue;
      ++nans;
      if (bitsOf(el::x86NaN(c, d)) != bitsOf(want)) {
        INFO("double " << op << " hardware 0x" << std::hex << bitsOf(want) << " patch 0x" << bitsOf(el::x86NaN(c, d)));
        REQUIRE(bitsOf(el::x86NaN(c, d)) == bitsOf(want));
      }
    }
  }
  CHECK(nans > 10000);  // the NaN rule was exercised
#endif
}

TEST_CASE("elements: the complex product is std::complex's, bit for bit", "[elements]") {
  std::mt19937 rng(23);
  auto check = [&](auto zero) {
    using T = decltype(zero);
    int64_t payload = 0;
    for (int i = 0; i < 200000; ++i) {
      T p[4];
      for (T& v : p) {
        if constexpr (sizeof(T) == 4) v = anyFloat(rng);
        else v = anyDouble(rng);
      }
      if (i % 7 == 0) p[1] = p[3] = T(0);  // real factors
      volatile T a = p[0], b = p[1], c = p[2], d = p[3];
      const std::complex<T> want = std::complex<T>(a, b) * std::complex<T>(c, d);
      const el::Complex<T> got = el::cmul(el::Complex<T>{p[0], p[1]}, el::Complex<T>{p[2], p[3]});
      int nan_in = 0;
      for (T v : p) nan_in += std::isnan(v);
      for (int part = 0; part < 2; ++part) {
        const T w = part ? want.imag() : want.real();
        const T g = part ? got.im : got.re;
        INFO((sizeof(T) == 4 ? "complex64" : "complex128") << " i=" << i << " (" << p[0] << "," << p[1] << ")*(" << p[2]
                                                          << "," << p[3] << ") part " << part);
        REQUIRE(std::isnan(g) == std::isnan(w));
        if (!std::isnan(w)) REQUIRE(bitsOf(g) == bitsOf(w));
        else if (nan_in <= 1) REQUIRE(bitsOf(g) == bitsOf(w));  // one NaN operand: its payload
        else payload += bitsOf(g) != bitsOf(w);
      }
    }
    if (payload) WARN(payload << " NaN payload differences where several NaN operands met");
  };
  check(0.0f);
  check(0.0);
}

TEST_CASE("elements: FLT_MAX rounds to inf in bf16 and leaves the residual as it was", "[elements][codec]") {
  const float big[] = {FLT_MAX, -FLT_MAX, 0x1.FFp127f, -0x1.FFp127f, 3.3962e38f};
  for (cd::Path p : {cd::Path::Scalar, cd::Path::AVX2, cd::Path::AVX512BF16}) {
    if (!cd::pathAvailable(p)) continue;
    const cd::Path saved = cd::activePath();
    cd::setPathForTesting(p);
    const int64_t n = 37;  // vector lanes and a scalar tail
    std::vector<float> x(n), r(n), r2(n);
    std::vector<uint16_t> out(n), in(n, 0x3F80);
    for (int64_t i = 0; i < n; ++i) {
      x[i] = i % 3 == 0 ? big[i % 5] : 0.5f + static_cast<float>(i);
      r[i] = 0.25f * static_cast<float>(i % 4);
    }
    cd::encodeEF(x.data(), 1.0f, r.data(), r2.data(), out.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      INFO("path " << cd::pathName(p) << " i=" << i);
      if (i % 3 == 0) {
        REQUIRE((out[i] & 0x7FFF) == 0x7F80);     // +-inf
        REQUIRE(bitsOf(r2[i]) == bitsOf(r[i]));  // residual untouched, not -+inf
      } else {
        REQUIRE(std::isfinite(r2[i]));
        REQUIRE(static_cast<double>(cd::bf16ToF32(out[i])) + r2[i] == static_cast<double>(x[i]) + r[i]);
      }
    }
    // The next step with finite inputs is finite everywhere: nothing was poisoned.
    std::vector<float> x2(n, 1.0f), r3(n);
    cd::encodeEF(x2.data(), 1.0f, r2.data(), r3.data(), out.data(), n);
    for (int64_t i = 0; i < n; ++i) REQUIRE(std::isfinite(r3[i]));
    // Later hops: a partial sum that overflows only after adding `in`.
    // 2^127 + 1.7e38 = 3.40141e38: finite (< FLT_MAX), past 0x7F7F8000, so it rounds to +inf.
    std::vector<float> xa(n, 1.7e38f), ra(n, 0.125f), ro(n);
    std::vector<uint16_t> ia(n, cd::f32ToBf16(0x1p127f)), oa(n);
    cd::accumulateEncodeEF(ia.data(), xa.data(), 1.0f, ra.data(), ro.data(), oa.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      REQUIRE(oa[i] == 0x7F80);
      REQUIRE(ro[i] == 0.125f);
    }
    cd::setPathForTesting(saved);
  }
}

TEST_CASE("kernels: the grid emulator runs the codec kernels with the CPU codec's bits at tail sizes",
          "[elements][kernels]") {
  std::mt19937 rng(4242);
  const EFIn d = efInputs(rng, (int64_t{1} << 20) + 3 + 1);
  const float scale = 1.0f / 3.0f;
  for (int64_t n : kTailSizes) {
    for (size_t off : {size_t{0}, size_t{1}}) {  // aligned (vector form) and not (element by element)
      for (uint32_t max_blocks : {0u, 3u}) {     // the launch's own grid, and a small one that strides
        CAPTURE(n, off, max_blocks);
        const float* x = d.x.data() + off;
        const float* r = d.r.data() + off;
        const uint16_t* in = d.in.data() + off;
        const std::vector<float> xv(x, x + n), rv(r, r + n);
        const std::vector<uint16_t> inv(in, in + n);
        // encode
        {
          std::vector<uint16_t> want(n);
          cd::encode(x, want.data(), n);
          Padded<uint16_t> got(n, off, 0xDEAD);
          dv::emulate(dv::Kernel::encode(x, got.data(), n), max_blocks, 64);
          REQUIRE(firstDiff(got.body(), want) == want.size());
          REQUIRE(got.padIntact(0xDEAD));
        }
        // decode
        {
          std::vector<float> want(n);
          cd::decode(in, want.data(), n);
          Padded<float> got(n, off, -7.0f);
          dv::emulate(dv::Kernel::decode(in, got.data(), n), max_blocks, 64);
          REQUIRE(firstDiff(got.body(), want) == want.size());
          REQUIRE(got.padIntact(-7.0f));
        }
        // decodeAccumulate
        {
          std::vector<float> want = rv;
          cd::decodeAccumulate(in, want.data(), n);
          Padded<float> got(n, off, -7.0f);
          std::copy(rv.begin(), rv.end(), got.data());
          dv::emulate(dv::Kernel::decodeAccumulate(in, got.data(), n), max_blocks, 64);
          REQUIRE(firstDiff(got.body(), want) == want.size());
          REQUIRE(got.padIntact(-7.0f));
        }
        // encodeEF, separate and aliased residual
        {
          std::vector<uint16_t> wo(n);
          std::vector<float> wr(n);
          cd::encodeEF(x, scale, r, wr.data(), wo.data(), n);
          Padded<uint16_t> go(n, off, 0xDEAD);
          Padded<float> gr(n, off, -7.0f);
          dv::emulate(dv::Kernel::encodeEF(x, scale, r, gr.data(), go.data(), n), max_blocks, 64);
          REQUIRE(firstDiff(go.body(), wo) == wo.size());
          REQUIRE(firstDiff(gr.body(), wr) == wr.size());
          REQUIRE((go.padIntact(0xDEAD) && gr.padIntact(-7.0f)));
          Padded<float> ra(n, off, -7.0f);
          std::copy(rv.begin(), rv.end(), ra.data());
          dv::emulate(dv::Kernel::encodeEF(x, scale, ra.data(), ra.data(), go.data(), n), max_blocks, 64);
          REQUIRE(firstDiff(ra.body(), wr) == wr.size());
        }
        // accumulateEncodeEF, separate and aliased (out == in, r_out == r_in)
        {
          std::vector<uint16_t> wo(n);
          std::vector<float> wr(n);
          cd::accumulateEncodeEF(in, x, scale, r, wr.data(), wo.data(), n);
          Padded<uint16_t> go(n, off, 0xDEAD);
          Padded<float> gr(n, off, -7.0f);
          dv::emulate(dv::Kernel::accumulateEncodeEF(in, x, scale, r, gr.data(), go.data(), n), max_blocks, 64);
          REQUIRE(firstDiff(go.body(), wo) == wo.size());
          REQUIRE(firstDiff(gr.body(), wr) == wr.size());
          REQUIRE((go.padIntact(0xDEAD) && gr.padIntact(-7.0f)));
          Padded<uint16_t> io(n, off, 0xDEAD);
          Padded<float> ra(n, off, -7.0f);
          std::copy(inv.begin(), inv.end(), io.data());
          std::copy(rv.begin(), rv.end(), ra.data());
          dv::emulate(dv::Kernel::accumulateEncodeEF(io.data(), x, scale, ra.data(), ra.data(), io.data(), n),
                      max_blocks, 64);
          REQUIRE(firstDiff(io.body(), wo) == wo.size());
          REQUIRE(firstDiff(ra.body(), wr) == wr.size());
        }
      }
    }
  }
}

TEST_CASE("kernels: the scaled wire kernels (fp16, int8) give the CPU codec's blocks and residuals at tail sizes",
          "[elements][kernels]") {
  REQUIRE(dv::kSegment == cd::kWireSegment);
  std::mt19937 rng(777);
  const int64_t most = (int64_t{1} << 20) + 3 + 1;
  // Segments of different characters in turn: any floats (inf, NaN, huge, subnormal), gradient-like
  // N(0, 1e-3), all zeros, gradient-like with one inf, one NaN and one value near FLT_MAX.
  EFIn d = efInputs(rng, most);
  std::normal_distribution<float> g(0.0f, 1e-3f);
  for (int64_t i = 0; i < most; ++i) {
    const int64_t kind = (i / cd::kWireSegment) % 4;
    if (kind == 0) continue;
    d.x[i] = kind == 2 ? 0.0f : g(rng);
    d.r[i] = kind == 2 ? 0.0f : g(rng) * 1e-3f;
    if (kind == 3 && i % cd::kWireSegment == 5) d.x[i] = floatOf(0x7F800000u);
    if (kind == 3 && i % cd::kWireSegment == 6) d.x[i] = floatOf(0x7FC00000u);
    if (kind == 3 && i % cd::kWireSegment == 7) d.x[i] = FLT_MAX;
  }
  const float scale = 1.0f / 3.0f;
  std::vector<int64_t> sizes(std::begin(kTailSizes), std::end(kTailSizes));
  for (int64_t n : {1023, 1024, 1025, 3 * 1024 + 17}) sizes.push_back(n);
  for (cd::Wire w : {cd::Wire::FP16, cd::Wire::INT8}) {
    const DType codes = cd::wireDType(w);
    for (int64_t n : sizes) {
      const size_t bytes = static_cast<size_t>(cd::blockBytes(w, n));
      for (size_t off : {size_t{0}, size_t{1}}) {  // an odd offset: codes and scales unaligned
        for (uint32_t max_blocks : {0u, 3u}) {
          CAPTURE(cd::wireName(w), n, off, max_blocks);
          const float* x = d.x.data() + off;
          const float* r = d.r.data() + off;
          const std::vector<float> rv(r, r + n);
          std::vector<uint8_t> wb(bytes);
          std::vector<float> wr(n);
          cd::encodeBlockEF(w, x, scale, r, wr.data(), wb.data(), n);
          // encode: separate and aliased residual
          Padded<uint8_t> gb(static_cast<int64_t>(bytes), off, 0xA5);
          Padded<float> gr(n, off, -7.0f);
          dv::emulate(dv::Kernel::scaledEncodeEF(codes, x, scale, r, gr.data(), gb.data(), n), max_blocks, 64);
          REQUIRE(firstDiff(gb.body(), wb) == wb.size());
          REQUIRE(firstDiff(gr.body(), wr) == wr.size());
          REQUIRE((gb.padIntact(0xA5) && gr.padIntact(-7.0f)));
          Padded<float> ra(n, off, -7.0f);
          std::copy(rv.begin(), rv.end(), ra.data());
          dv::emulate(dv::Kernel::scaledEncodeEF(codes, x, scale, ra.data(), ra.data(), gb.data(), n), max_blocks, 64);
          REQUIRE(firstDiff(ra.body(), wr) == wr.size());
          // decode and decode-accumulate of the codec's block
          Padded<uint8_t> blk(static_cast<int64_t>(bytes), off, 0xA5);
          std::copy(wb.begin(), wb.end(), blk.data());
          std::vector<float> want(n);
          cd::decodeBlock(w, wb.data(), want.data(), n);
          Padded<float> got(n, off, -7.0f);
          dv::emulate(dv::Kernel::scaledDecode(codes, blk.data(), got.data(), n, false), max_blocks, 64);
          REQUIRE(firstDiff(got.body(), want) == want.size());
          REQUIRE(got.padIntact(-7.0f));
          std::vector<float> acc0(n);  // finite: a NaN value then meets no NaN (two NaNs: only NaN-ness is defined)
          for (int64_t i = 0; i < n; ++i) acc0[i] = 0.25f * static_cast<float>(i % 1000) - 100.0f;
          std::vector<float> acc = acc0;
          cd::decodeAccumulateBlock(w, wb.data(), acc.data(), n);
          std::copy(acc0.begin(), acc0.end(), got.data());
          dv::emulate(dv::Kernel::scaledDecode(codes, blk.data(), got.data(), n, true), max_blocks, 64);
          REQUIRE(firstDiff(got.body(), acc) == acc.size());
          REQUIRE(got.padIntact(-7.0f));
        }
      }
    }
  }
  // The descriptor's checks.
  float f = 0.0f;
  uint8_t b[8] = {};
  REQUIRE(dv::checkKernel(dv::Kernel::scaledEncodeEF(DType::BFloat16, &f, 1.0f, &f, &f, b, 1)).find("float16 or int8") !=
          std::string::npos);
  REQUIRE(dv::checkKernel(dv::Kernel::scaledDecode(DType::Int8, nullptr, &f, 1, false)).find("null block") !=
          std::string::npos);
  REQUIRE(dv::checkKernel(dv::Kernel::scaledDecode(DType::Float16, b, &f, 0, true)).empty());
}

namespace {

// Random elements of dtype t for op (at most one NaN per pair of floats).
void fillFor(std::mt19937& rng, DType t, void* a, void* b, int64_t n) {
  auto* pa = static_cast<uint8_t*>(a);
  auto* pb = static_cast<uint8_t*>(b);
  const size_t es = xirang::elementSize(t);
  std::uniform_int_distribution<uint32_t> any32;
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* x = pa + i * es;
    uint8_t* y = pb + i * es;
    switch (t) {
      case DType::Float32:
      case DType::Complex64: {  // at most one NaN among all the parts of the two operands
        bool nan = false;
        for (size_t k = 0; k < es / 4; ++k) {
          const float u = anyFloat(rng, !nan);
          nan |= std::isnan(u);
          const float v = anyFloat(rng, !nan);
          nan |= std::isnan(v);
          std::memcpy(x + 4 * k, &u, 4);
          std::memcpy(y + 4 * k, &v, 4);
        }
        break;
      }
      case DType::Float64:
      case DType::Complex128: {
        bool nan = false;
        for (size_t k = 0; k < es / 8; ++k) {
          double u = anyDouble(rng);
          if (nan && std::isnan(u)) u = -2.5;
          nan |= std::isnan(u);
          double v = anyDouble(rng);
          if (nan && std::isnan(v)) v = 1.5;
          nan |= std::isnan(v);
          std::memcpy(x + 8 * k, &u, 8);
          std::memcpy(y + 8 * k, &v, 8);
        }
        break;
      }
      case DType::Bool:
        x[0] = static_cast<uint8_t>(any32(rng) & 1u);
        y[0] = static_cast<uint8_t>(any32(rng) & 1u);
        break;
      default:
        for (size_t k = 0; k < es; ++k) {
          x[k] = static_cast<uint8_t>(any32(rng));
          y[k] = static_cast<uint8_t>(any32(rng));
        }
    }
  }
}

}  // namespace

TEST_CASE("kernels: reduce and scale kernels equal reduceInto / scale for every dtype and op", "[elements][kernels]") {
  std::mt19937 rng(99);
  const DType dtypes[] = {DType::Float32, DType::Float64, DType::Int8,      DType::Int16,     DType::Int32,
                          DType::Int64,   DType::UInt8,   DType::Bool,      DType::Complex64, DType::Complex128};
  const ReduceOp ops[] = {ReduceOp::Sum, ReduceOp::Avg,  ReduceOp::Product, ReduceOp::Min,      ReduceOp::Max,
                          ReduceOp::PremulSum, ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor};
  int cases = 0;
  for (DType t : dtypes) {
    const size_t es = xirang::elementSize(t);
    for (ReduceOp op : ops) {
      if (!xirang::checkReduceOp(t, op).empty()) {
        REQUIRE(!dv::checkKernel(dv::Kernel::reduce(nullptr, nullptr, 0, t, op)).empty());
        continue;
      }
      for (int64_t n : {int64_t{1}, int64_t{33}, int64_t{4097}}) {
        for (size_t off : {size_t{0}, size_t{1}}) {
          CAPTURE(xirang::dtypeName(t), xirang::reduceOpName(op), n, off);
          std::vector<uint8_t> a((n + 1) * es), b((n + 1) * es);
          fillFor(rng, t, a.data() + off * es, b.data() + off * es, n);
          std::vector<uint8_t> want = a, got = a;
          xirang::reduceInto(want.data() + off * es, b.data() + off * es, n, t, op);
          const auto k = dv::Kernel::reduce(got.data() + off * es, b.data() + off * es, n, t, op);
          REQUIRE(dv::checkKernel(k).empty());
          dv::emulate(k, 2, 32);
          REQUIRE(firstDiff(got, want) == want.size());
          ++cases;
        }
      }
    }
  }
  CHECK(cases == 2 * 3 * (2 * 6 + 5 * 7 + 7 + 2 * 4));
  for (DType t : {DType::Float32, DType::Float64, DType::Complex64, DType::Complex128}) {
    for (double f : {0.5, 1.0 / 3.0, 0.1, 1e-40, 3.0}) {
      const size_t es = xirang::elementSize(t);
      const int64_t n = 1001;
      std::vector<uint8_t> a(n * es), b(n * es);
      fillFor(rng, t, a.data(), b.data(), n);
      std::vector<uint8_t> want = a, got = a;
      xirang::scale(want.data(), n, t, f);
      dv::emulate(dv::Kernel::scaleBy(got.data(), n, t, f));
      CAPTURE(xirang::dtypeName(t), f);
      REQUIRE(firstDiff(got, want) == want.size());
    }
  }
  REQUIRE(!dv::checkKernel(dv::Kernel::scaleBy(nullptr, 1, DType::Int32, 2.0)).empty());
}

TEST_CASE("kernels: combine16 / widen16 / narrow16 equal the host reducer (float16, bfloat16)", "[elements][kernels]") {
  std::mt19937 rng(7);
  auto& host = xirang::algo::hostReducer();
  for (DType t : {DType::Float16, DType::BFloat16}) {
    for (int contributors : {1, 3, 8}) {
      for (int64_t count : {int64_t{1}, int64_t{8}, int64_t{1003}, int64_t{4096}}) {
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max}) {
          CAPTURE(xirang::dtypeName(t), contributors, count, xirang::reduceOpName(op));
          std::vector<uint16_t> slots(static_cast<size_t>(count) * contributors);
          for (size_t j = 0; j < slots.size(); ++j) {  // NaNs only in slot 0: one NaN per fold at most
            const float f = anyFloat(rng, j < static_cast<size_t>(count) && rng() % 16 == 0);
            slots[j] = t == DType::Float16 ? xirang::floatToHalf(f) : cd::f32ToBf16(f);
          }
          std::vector<uint16_t> want(count), got(count, 0xDEAD);
          host.combine16(slots.data(), contributors, count, t, op, 0.37f, 0.5f, want.data());
          dv::emulate(dv::Kernel::combine16(slots.data(), contributors, count, t, op, 0.37f, 0.5f, got.data()), 3, 32);
          REQUIRE(firstDiff(got, want) == want.size());
        }
      }
    }
    for (int64_t n : kTailSizes) {
      if (n > 5000) continue;
      std::vector<uint16_t> h(n + 1);
      std::vector<float> f(n + 1);
      for (int64_t i = 0; i <= n; ++i) {
        h[i] = static_cast<uint16_t>(rng());
        f[i] = anyFloat(rng);
      }
      for (size_t off : {size_t{0}, size_t{1}}) {
        CAPTURE(xirang::dtypeName(t), n, off);
        std::vector<float> wf(n), gf(n);
        host.widen(h.data() + off, wf.data(), n, t);
        dv::emulate(dv::Kernel::widen16(h.data() + off, gf.data(), n, t));
        REQUIRE(firstDiff(gf, wf) == wf.size());
        std::vector<uint16_t> wh(n), gh(n);
        host.narrow(f.data() + off, wh.data(), n, t);
        dv::emulate(dv::Kernel::narrow16(f.data() + off, gh.data(), n, t));
        REQUIRE(firstDiff(gh, wh) == wh.size());
      }
    }
  }
}

TEST_CASE("kernels: checkKernel refuses what the kernels cannot do", "[elements][kernels]") {
  float f[4] = {};
  uint16_t h[4] = {};
  CHECK(dv::checkKernel(dv::Kernel::encode(f, h, 4)).empty());
  CHECK(dv::checkKernel(dv::Kernel::encode(f, h, 0)).empty());
  CHECK(dv::checkKernel(dv::Kernel::encode(nullptr, nullptr, 0)).empty());
  CHECK(dv::checkKernel(dv::Kernel::encode(f, h, -1)).find("negative") != std::string::npos);
  CHECK(dv::checkKernel(dv::Kernel::encode(nullptr, h, 4)).find("null") != std::string::npos);
  CHECK(dv::checkKernel(dv::Kernel::reduce(h, h, 4, DType::BFloat16, ReduceOp::Sum)).find("bfloat16") !=
        std::string::npos);
  CHECK(dv::checkKernel(dv::Kernel::reduce(f, f, 4, DType::Float32, ReduceOp::BXor)).find("BXOR") != std::string::npos);
  CHECK(dv::checkKernel(dv::Kernel::reduce(f, f, 4, DType::Complex64, ReduceOp::Max)).find("MAX") != std::string::npos);
  CHECK(!dv::checkKernel(dv::Kernel::combine16(h, 0, 4, DType::Float16, ReduceOp::Sum, 1, 1, h)).empty());
  CHECK(!dv::checkKernel(dv::Kernel::combine16(h, 2, 2, DType::Float32, ReduceOp::Sum, 1, 1, h)).empty());
  CHECK(!dv::checkKernel(dv::Kernel::combine16(h, 2, 2, DType::Float16, ReduceOp::BAnd, 1, 1, h)).empty());
  CHECK(!dv::checkKernel(dv::Kernel::widen16(h, f, 4, DType::Int16)).empty());
}
