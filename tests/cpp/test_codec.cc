// Tests for the BF16 codec with error feedback (csrc/core/codec.h).
// Every value is checked against an independent reference: an fp64 round-to-nearest-even
// (std::nearbyint on a power-of-two grid) for fp32 -> bf16, and the scalar path's bits for the
// vector paths.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/codec.h"

namespace {

namespace cd = xirang::codec;
using cd::Path;

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

float widenRef(uint16_t b) { return floatOf(static_cast<uint32_t>(b) << 16); }

bool isNanBits16(uint16_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x007Fu) != 0; }

// Independent fp64 reference for fp32 -> bf16 RNE. A bf16 value has 8 significant bits; for
// |d| in [2^(e-1), 2^e) the grid step is 2^(e-8), never finer than the denormal step 2^-133.
// nearbyint rounds ties to even under the default rounding mode. Results with |r| >= 2^128
// are past the largest finite bf16 (RNE with unbounded exponent) and become inf.
uint16_t refBf16(float x) {
  const uint32_t u = bitsOf(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40u);  // the stated NaN rule
  if (std::isinf(x) || x == 0.0f) return static_cast<uint16_t>(u >> 16);
  const double d = x;
  int e = 0;
  std::frexp(d, &e);
  const double q = std::ldexp(1.0, std::max(e - 8, -133));
  const double r = std::nearbyint(d / q) * q;
  if (std::fabs(r) >= 0x1p128) return std::signbit(x) ? 0xFF80 : 0x7F80;
  const float f = static_cast<float>(r);  // exact: r has <= 8 significant bits in range
  REQUIRE(static_cast<double>(f) == r);
  const uint32_t v = bitsOf(f);
  REQUIRE((v & 0xFFFFu) == 0u);
  return static_cast<uint16_t>(v >> 16);
}

const Path kAllPaths[] = {Path::Scalar, Path::AVX2, Path::AVX512BF16};

std::vector<Path> availablePaths() {
  std::vector<Path> out;
  for (Path p : kAllPaths) {
    if (cd::pathAvailable(p)) out.push_back(p);
  }
  return out;
}

// Restores the active path when a test case ends.
struct PathGuard {
  Path saved = cd::activePath();
  ~PathGuard() { cd::setPathForTesting(saved); }
};

// Random fp32 values covering normal magnitudes over the whole exponent range, denormals,
// huge values, zeros, infinities and NaNs (quiet and signalling, both signs, random payloads).
float randomSpecialish(std::mt19937& rng, bool allowNonFinite) {
  std::uniform_int_distribution<int> kind(0, 99);
  std::uniform_int_distribution<uint32_t> any32;
  const int k = kind(rng);
  const uint32_t sign = (any32(rng) & 1u) << 31;
  if (k < 40) {  // ordinary gradient-like values
    std::normal_distribution<float> nd(0.0f, 1.0f);
    return nd(rng) * std::ldexp(1.0f, std::uniform_int_distribution<int>(-30, 10)(rng));
  }
  if (k < 55) {  // any finite bit pattern
    uint32_t u;
    do u = any32(rng); while ((u & 0x7F800000u) == 0x7F800000u);
    return floatOf(u);
  }
  if (k < 67) return floatOf(sign | (any32(rng) & 0x007FFFFFu));  // denormal (or zero)
  if (k < 70) return floatOf(sign | (any32(rng) & 0x0000FFFFu));  // tiny denormal
  if (k < 73) return floatOf(sign | (0x00008000u + (any32(rng) & 0x007F0000u)));  // denormal tie
  if (k < 78) {  // exact ties and near-ties at random exponents
    const uint32_t e = (any32(rng) % 254u + 1u) << 23;
    const uint32_t hi = any32(rng) & 0x007F0000u;
    const uint32_t lo[] = {0x8000u, 0x7FFFu, 0x8001u};
    return floatOf(sign | e | hi | lo[any32(rng) % 3u]);
  }
  if (k < 82) {
    const float big[] = {3.0e38f, 40000.0f, 3.3895314e38f, std::numeric_limits<float>::max(),
                         1.0e38f, 65504.0f};
    const float v = big[any32(rng) % 6u];
    return sign ? -v : v;
  }
  if (k < 86) return sign ? -0.0f : 0.0f;
  if (!allowNonFinite || k < 90) {
    std::uniform_real_distribution<float> ud(-4.0f, 4.0f);
    return ud(rng);
  }
  if (k < 94) return floatOf(sign | 0x7F800000u);  // +-inf
  uint32_t payload;
  do payload = any32(rng) & 0x007FFFFFu; while (payload == 0u);
  return floatOf(sign | 0x7F800000u | payload);  // NaN, quiet or signalling
}

uint16_t randomBf16(std::mt19937& rng, bool allowNonFinite) {
  std::uniform_int_distribution<int> kind(0, 9);
  if (kind(rng) < 2) {
    uint16_t b;
    do b = static_cast<uint16_t>(std::uniform_int_distribution<uint32_t>(0, 0xFFFF)(rng));
    while (!allowNonFinite && (b & 0x7F80u) == 0x7F80u);
    return b;
  }
  return refBf16(randomSpecialish(rng, allowNonFinite));
}

// Operands of one element of an EF call.
struct EFData {
  std::vector<float> x, r;
  std::vector<uint16_t> in;
};

// At most one NaN operand per element unless multiNan: x86 picks the first NaN operand's
// payload and compilers may commute an add, so only single-NaN elements have defined bits.
EFData makeEFData(std::mt19937& rng, int64_t n, bool multiNan) {
  EFData d;
  d.x.resize(n);
  d.r.resize(n);
  d.in.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    d.x[i] = randomSpecialish(rng, true);
    d.r[i] = randomSpecialish(rng, true);
    d.in[i] = randomBf16(rng, true);
    if (!multiNan) {
      const bool xn = std::isnan(d.x[i]);
      if (xn || std::isnan(d.r[i])) {
        if (xn) d.r[i] = randomSpecialish(rng, false);
        while (isNanBits16(d.in[i])) d.in[i] = randomBf16(rng, false);
      }
    } else if (i % 3 == 0) {
      d.x[i] = floatOf(0x7FC00001u + static_cast<uint32_t>(i));
      d.r[i] = floatOf(0xFFC12345u);
      d.in[i] = 0x7FA5;
    }
  }
  return d;
}

const float kScales[] = {1.0f, 0.125f, 1.0f / 3.0f, 0.5f, 1.0e-30f, 7.0f};
const int64_t kSizes[] = {0, 1, 7, 15, 16, 17, 31, 33, 1000, 4099};

// Checks one scalar-path EF result against the fp64 reference and the EF identity.
// p, t, s are recomputed here, operation by operation (this file is built with
// -ffp-contract=off, and no -march, so nothing is fused).
void checkEFElement(float s, uint16_t out, float rIn, float rOut) {
  if (std::isnan(s)) {
    REQUIRE(isNanBits16(out));
    REQUIRE(std::isnan(rOut));
    return;
  }
  REQUIRE(out == refBf16(s));
  const float back = widenRef(out);
  if (std::isinf(s)) {
    REQUIRE(out == (std::signbit(s) ? 0xFF80 : 0x7F80));
    REQUIRE(std::isnan(rOut));  // inf - inf
    return;
  }
  if (std::isinf(back)) {  // finite s past the bf16 range rounds to inf
    REQUIRE(std::fabs(s) >= 0x1.FFp127f);
    // codec.h: the residual of an element whose finite s rounded to +-inf is left as it was
    // (not -+inf, which would poison every later step).
    REQUIRE(bitsOf(rOut) == bitsOf(rIn));
    return;
  }
  // Error feedback identity, exact in fp64 for finite s.
  REQUIRE(static_cast<double>(back) + static_cast<double>(rOut) == static_cast<double>(s));
  REQUIRE(static_cast<double>(rOut) == static_cast<double>(s) - static_cast<double>(back));
  // |error| <= half a bf16 ulp: 2^-8 relative, or half the denormal step 2^-133.
  REQUIRE(std::fabs(static_cast<double>(rOut)) <=
          std::max(std::ldexp(std::fabs(static_cast<double>(s)), -8), 0x1p-134));
}

template <typename T>
void requireSameBits(const std::vector<T>& a, const std::vector<T>& b, const char* what) {
  REQUIRE(a.size() == b.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      if (bad++ == 0) first = i;
    }
  }
  INFO(what << ": " << bad << " mismatching elements, first at " << first);
  REQUIRE(bad == 0);
}

}  // namespace

TEST_CASE("codec: f32ToBf16 selected values match fp64 RNE reference", "[codec]") {
  struct Case {
    uint32_t in;
    uint16_t expect;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F80},  // 1.0
      {0x3F808000u, 0x3F80},  // tie, even below
      {0x3F818000u, 0x3F82},  // tie, even above
      {0x3F807FFFu, 0x3F80},  // just below tie
      {0x3F808001u, 0x3F81},  // just above tie
      {0xBF818000u, 0xBF82},  // negative tie up in magnitude
      {0xBF808000u, 0xBF80},  // negative tie down in magnitude
      {0x3FFF8000u, 0x4000},  // tie carries into the exponent
      {0x7F7F0000u, 0x7F7F},  // bf16 max finite
      {0x7F7F7FFFu, 0x7F7F},  // below the overflow tie
      {0x7F7F8000u, 0x7F80},  // overflow tie -> inf (0x7F7F is odd)
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX -> inf
      {0xFF7FFFFFu, 0xFF80},  // -FLT_MAX -> -inf
      {0x00000001u, 0x0000},  // smallest fp32 denormal
      {0x00008000u, 0x0000},  // denormal tie to even (0)
      {0x00018000u, 0x0002},  // denormal tie to even (2)
      {0x00008001u, 0x0001},  // above tie
      {0x00010000u, 0x0001},  // smallest bf16 denormal
      {0x80010000u, 0x8001},
      {0x007FFFFFu, 0x0080},  // largest denormal rounds up to the smallest normal
      {0x807F8000u, 0x8080},  // negative denormal tie: 0x7F odd -> up
      {0x00000000u, 0x0000},
      {0x80000000u, 0x8000},  // -0.0
      {0x7F800000u, 0x7F80},  // inf
      {0xFF800000u, 0xFF80},  // -inf
      {0x7FC00000u, 0x7FC0},  // quiet NaN
      {0x7F800001u, 0x7FC0},  // signalling NaN, payload only in low bits: must stay NaN
      {0xFF800001u, 0xFFC0},
      {0x7FA12345u, 0x7FE1},  // sNaN with payload: top payload bits kept, quiet bit set
      {0xFFFFFFFFu, 0xFFFF},
      {0x7FBF8000u, 0x7FFF},  // NaN must not round into another pattern
  };
  for (const Case& c : cases) {
    const float x = floatOf(c.in);
    INFO("input 0x" << std::hex << c.in);
    REQUIRE(refBf16(x) == c.expect);
    REQUIRE(cd::f32ToBf16(x) == c.expect);
    REQUIRE(bitsOf(cd::bf16ToF32(c.expect)) == static_cast<uint32_t>(c.expect) << 16);
  }
}

TEST_CASE("codec: pathName and path availability", "[codec]") {
  REQUIRE(std::string(cd::pathName(Path::Scalar)) == "scalar");
  REQUIRE(std::string(cd::pathName(Path::AVX2)) == "avx2");
  REQUIRE(std::string(cd::pathName(Path::AVX512BF16)) == "avx512bf16");
  REQUIRE(std::string(cd::pathName(static_cast<Path>(7))) == "unknown");
  REQUIRE(cd::pathAvailable(Path::Scalar));
  REQUIRE_FALSE(cd::pathAvailable(static_cast<Path>(7)));
  // Auto (the default) picks the best available path unless XIRANG_CODEC forced one.
  const Path active = cd::activePath();
  REQUIRE(cd::pathAvailable(active));
}

TEST_CASE("codec: forcing each path via setPathForTesting", "[codec]") {
  PathGuard guard;
  std::vector<float> x = {1.0f, 0x1.018p0f, -3.0e38f, 1e-40f, 0.0f, -0.0f, 40000.0f, 2.5f, 7.0f};
  std::vector<uint16_t> out(x.size());
  for (Path p : kAllPaths) {
    if (!cd::pathAvailable(p)) {
      WARN("skipping codec path '" << cd::pathName(p) << "': this CPU/build lacks it");
      try {
        cd::setPathForTesting(p);
        FAIL("setPathForTesting accepted unavailable path " << cd::pathName(p));
      } catch (const std::runtime_error& e) {
        REQUIRE(std::string(e.what()).find(cd::pathName(p)) != std::string::npos);
      }
      continue;
    }
    cd::setPathForTesting(p);
    REQUIRE(cd::activePath() == p);
    cd::encode(x.data(), out.data(), static_cast<int64_t>(x.size()));
    for (size_t i = 0; i < x.size(); ++i) REQUIRE(out[i] == refBf16(x[i]));
  }
  REQUIRE_THROWS_AS(cd::setPathForTesting(static_cast<Path>(7)), std::runtime_error);
  REQUIRE_THROWS_AS(cd::encode(x.data(), out.data(), -1), std::invalid_argument);
  // n == 0 with null pointers is a no-op on every path.
  for (Path p : availablePaths()) {
    cd::setPathForTesting(p);
    cd::encode(nullptr, nullptr, 0);
    cd::decode(nullptr, nullptr, 0);
    cd::decodeAccumulate(nullptr, nullptr, 0);
    cd::encodeEF(nullptr, 1.0f, nullptr, nullptr, nullptr, 0);
    cd::accumulateEncodeEF(nullptr, nullptr, 1.0f, nullptr, nullptr, nullptr, 0);
  }
}

TEST_CASE("codec: exhaustive encode/decode, every path equals scalar and the reference", "[codec]") {
  PathGuard guard;
  std::mt19937 rng(12345);
  std::vector<uint32_t> lows = {0x0000u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu};
  for (int i = 0; i < 3; ++i) lows.push_back(std::uniform_int_distribution<uint32_t>(0, 0xFFFF)(rng));
  // Layout: for each low pattern, all 65536 upper patterns, plus 5 extra elements so that
  // the tail code runs (n is not a multiple of 8 or 16).
  std::vector<float> x;
  x.reserve(lows.size() * 65536 + 5);
  for (uint32_t lo : lows) {
    for (uint32_t hi = 0; hi < 65536; ++hi) x.push_back(floatOf((hi << 16) | lo));
  }
  for (uint32_t v : {0x7F800001u, 0x00008000u, 0x7F7F8000u, 0x80000001u, 0x3F808000u}) {
    x.push_back(floatOf(v));
  }
  const int64_t n = static_cast<int64_t>(x.size());

  std::vector<uint16_t> expect(n);
  for (int64_t i = 0; i < n; ++i) {
    expect[i] = cd::f32ToBf16(x[i]);
    if (expect[i] != refBf16(x[i])) {
      INFO("f32ToBf16 disagrees with the reference at 0x" << std::hex << bitsOf(x[i]));
      REQUIRE(expect[i] == refBf16(x[i]));
    }
  }
  std::vector<uint16_t> all16(65536 + 3);
  for (uint32_t b = 0; b < all16.size(); ++b) all16[b] = static_cast<uint16_t>(b * 40503u);
  std::vector<float> decExpect(all16.size());
  for (size_t i = 0; i < all16.size(); ++i) decExpect[i] = widenRef(all16[i]);

  for (Path p : availablePaths()) {
    SECTION(std::string("path ") + cd::pathName(p)) {
      cd::setPathForTesting(p);
      std::vector<uint16_t> out(n, 0xDEAD);
      cd::encode(x.data(), out.data(), n);
      requireSameBits(out, expect, "encode");
      // Unaligned start and odd length.
      std::vector<uint16_t> out2(n, 0xDEAD);
      cd::encode(x.data() + 1, out2.data() + 1, n - 1);
      REQUIRE(out2[0] == 0xDEAD);
      for (int64_t i = 1; i < n; ++i) REQUIRE(out2[i] == expect[i]);

      std::vector<float> dec(all16.size());
      cd::decode(all16.data(), dec.data(), static_cast<int64_t>(all16.size()));
      requireSameBits(dec, decExpect, "decode");
    }
  }
}

TEST_CASE("codec: decodeAccumulate, every path equals scalar", "[codec]") {
  PathGuard guard;
  std::mt19937 rng(777);
  for (int64_t n : kSizes) {
    std::vector<uint16_t> in(n);
    std::vector<float> acc0(n);
    for (int64_t i = 0; i < n; ++i) {
      acc0[i] = randomSpecialish(rng, true);
      in[i] = randomBf16(rng, !std::isnan(acc0[i]));
      if (std::isnan(acc0[i])) {
        while (isNanBits16(in[i])) in[i] = randomBf16(rng, false);
      }
    }
    std::vector<float> expect = acc0;
    for (int64_t i = 0; i < n; ++i) expect[i] = acc0[i] + widenRef(in[i]);
    for (Path p : availablePaths()) {
      INFO("path " << cd::pathName(p) << " n=" << n);
      cd::setPathForTesting(p);
      std::vector<float> acc = acc0;
      cd::decodeAccumulate(in.data(), acc.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(expect[i])) {
          REQUIRE(std::isnan(acc[i]));
        } else {
          REQUIRE(bitsOf(acc[i]) == bitsOf(expect[i]));
        }
      }
      if (p == Path::Scalar) expect = acc;  // NaN payloads: scalar's bits are the reference
      requireSameBits(acc, expect, "decodeAccumulate");
    }
  }
}

TEST_CASE("codec: encodeEF matches reference, EF identity, all paths bitwise equal", "[codec]") {
  PathGuard guard;
  std::mt19937 rng(2024);
  for (int64_t n : kSizes) {
    for (float scale : kScales) {
      const EFData d = makeEFData(rng, n, false);
      // Scalar path first, checked against the reference.
      cd::setPathForTesting(Path::Scalar);
      std::vector<uint16_t> outS(n);
      std::vector<float> rS(n);
      cd::encodeEF(d.x.data(), scale, d.r.data(), rS.data(), outS.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        INFO("n=" << n << " scale=" << scale << " i=" << i << " x=" << d.x[i] << " r=" << d.r[i]);
        const float p = d.x[i] * scale;
        const float s = p + d.r[i];
        checkEFElement(s, outS[i], d.r[i], rS[i]);
      }
      for (Path p : availablePaths()) {
        INFO("path " << cd::pathName(p) << " n=" << n << " scale=" << scale);
        cd::setPathForTesting(p);
        std::vector<uint16_t> out(n, 0xDEAD);
        std::vector<float> rOut(n, -1.0f);
        cd::encodeEF(d.x.data(), scale, d.r.data(), rOut.data(), out.data(), n);
        requireSameBits(out, outS, "encodeEF out");
        requireSameBits(rOut, rS, "encodeEF r_out");
        // In place: r_out aliases r_in.
        std::vector<float> r = d.r;
        std::vector<uint16_t> out2(n, 0xDEAD);
        cd::encodeEF(d.x.data(), scale, r.data(), r.data(), out2.data(), n);
        requireSameBits(out2, outS, "encodeEF in-place out");
        requireSameBits(r, rS, "encodeEF in-place r");
      }
    }
  }
}

TEST_CASE("codec: accumulateEncodeEF matches reference, EF identity, all paths bitwise equal",
          "[codec]") {
  PathGuard guard;
  std::mt19937 rng(99);
  for (int64_t n : kSizes) {
    for (float scale : kScales) {
      const EFData d = makeEFData(rng, n, false);
      cd::setPathForTesting(Path::Scalar);
      std::vector<uint16_t> outS(n);
      std::vector<float> rS(n);
      cd::accumulateEncodeEF(d.in.data(), d.x.data(), scale, d.r.data(), rS.data(), outS.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        INFO("n=" << n << " scale=" << scale << " i=" << i << " x=" << d.x[i] << " r=" << d.r[i]
                  << " in=0x" << std::hex << d.in[i]);
        const float p = d.x[i] * scale;
        const float t = p + d.r[i];
        const float s = widenRef(d.in[i]) + t;
        checkEFElement(s, outS[i], d.r[i], rS[i]);
      }
      for (Path p : availablePaths()) {
        INFO("path " << cd::pathName(p) << " n=" << n << " scale=" << scale);
        cd::setPathForTesting(p);
        std::vector<uint16_t> out(n, 0xDEAD);
        std::vector<float> rOut(n, -1.0f);
        cd::accumulateEncodeEF(d.in.data(), d.x.data(), scale, d.r.data(), rOut.data(), out.data(),
                               n);
        requireSameBits(out, outS, "accumulateEncodeEF out");
        requireSameBits(rOut, rS, "accumulateEncodeEF r_out");
        {  // r_out aliases r_in
          std::vector<float> r = d.r;
          std::vector<uint16_t> o(n, 0xDEAD);
          cd::accumulateEncodeEF(d.in.data(), d.x.data(), scale, r.data(), r.data(), o.data(), n);
          requireSameBits(o, outS, "aliased r: out");
          requireSameBits(r, rS, "aliased r: r");
        }
        {  // out aliases in
          std::vector<uint16_t> io = d.in;
          std::vector<float> r(n, -1.0f);
          cd::accumulateEncodeEF(io.data(), d.x.data(), scale, d.r.data(), r.data(), io.data(), n);
          requireSameBits(io, outS, "aliased out: out");
          requireSameBits(r, rS, "aliased out: r");
        }
        {  // both
          std::vector<uint16_t> io = d.in;
          std::vector<float> r = d.r;
          cd::accumulateEncodeEF(io.data(), d.x.data(), scale, r.data(), r.data(), io.data(), n);
          requireSameBits(io, outS, "aliased both: out");
          requireSameBits(r, rS, "aliased both: r");
        }
        if (n > 1) {  // unaligned start
          std::vector<uint16_t> o(n, 0xDEAD);
          std::vector<float> r(n, -1.0f);
          cd::accumulateEncodeEF(d.in.data() + 1, d.x.data() + 1, scale, d.r.data() + 1,
                                 r.data() + 1, o.data() + 1, n - 1);
          REQUIRE(o[0] == 0xDEAD);
          REQUIRE(r[0] == -1.0f);
          for (int64_t i = 1; i < n; ++i) {
            REQUIRE(o[i] == outS[i]);
            REQUIRE(bitsOf(r[i]) == bitsOf(rS[i]));
          }
        }
      }
    }
  }
}

TEST_CASE("codec: several NaN operands in one element still give NaN on every path", "[codec]") {
  // Which payload survives when two NaNs meet is unspecified (see codec.h); NaN-ness is not.
  PathGuard guard;
  std::mt19937 rng(5);
  const int64_t n = 1000;
  const EFData d = makeEFData(rng, n, true);
  cd::setPathForTesting(Path::Scalar);
  std::vector<uint16_t> outS(n);
  std::vector<float> rS(n);
  cd::accumulateEncodeEF(d.in.data(), d.x.data(), 0.5f, d.r.data(), rS.data(), outS.data(), n);
  for (Path p : availablePaths()) {
    cd::setPathForTesting(p);
    std::vector<uint16_t> out(n);
    std::vector<float> r(n);
    cd::accumulateEncodeEF(d.in.data(), d.x.data(), 0.5f, d.r.data(), r.data(), out.data(), n);
    size_t payloadDiffs = 0;
    for (int64_t i = 0; i < n; ++i) {
      INFO("path " << cd::pathName(p) << " i=" << i);
      REQUIRE(isNanBits16(out[i]) == isNanBits16(outS[i]));
      REQUIRE(std::isnan(r[i]) == std::isnan(rS[i]));
      if (!isNanBits16(outS[i])) {
        REQUIRE(out[i] == outS[i]);
        REQUIRE(bitsOf(r[i]) == bitsOf(rS[i]));
      } else if (out[i] != outS[i]) {
        ++payloadDiffs;
      }
    }
    if (payloadDiffs) WARN("path " << cd::pathName(p) << ": " << payloadDiffs << " NaN payload differences");
  }
}

TEST_CASE("codec: residual carries the rounding error across steps (telescoping sum)", "[codec]") {
  // sum_t f32(out_t) + r_T == sum_t (x_t * scale) up to fp32 rounding of the additions; with
  // values that make the adds exact (small integers / 2^k) it holds exactly in fp64.
  PathGuard guard;
  for (Path p : availablePaths()) {
    cd::setPathForTesting(p);
    const int64_t n = 37;
    std::vector<float> r(n, 0.0f), x(n);
    std::vector<uint16_t> out(n);
    std::vector<double> sumOut(n, 0.0), sumX(n, 0.0);
    for (int step = 0; step < 50; ++step) {
      for (int64_t i = 0; i < n; ++i) {
        x[i] = static_cast<float>(1 + ((step * 131 + i * 71) % 1021)) / 64.0f;  // 16 bits max
        sumX[i] += static_cast<double>(x[i]) * 0.25;
      }
      cd::encodeEF(x.data(), 0.25f, r.data(), r.data(), out.data(), n);
      for (int64_t i = 0; i < n; ++i) sumOut[i] += static_cast<double>(widenRef(out[i]));
    }
    for (int64_t i = 0; i < n; ++i) {
      INFO("path " << cd::pathName(p) << " i=" << i);
      REQUIRE(sumOut[i] + static_cast<double>(r[i]) == sumX[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Scaled wire formats (codec.h: Wire, encodeBlockEF / decodeBlock / decodeAccumulateBlock),
// against references computed here in fp64 / with std::nearbyint, independently of elements.h.
// ---------------------------------------------------------------------------------------------

namespace {

// Inputs whose magnitude changes from segment to segment (2^-20 .. 2^20) and inside it.
std::vector<float> scaledInputs(int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int seg_exp = static_cast<int>((i / cd::kWireSegment) * 7 % 41) - 20;
    x[i] = std::ldexp(u(g), seg_exp + static_cast<int>(g() % 5) - 2);
  }
  return x;
}

float scaleOf(cd::Wire w, const std::vector<uint8_t>& block, int64_t n, int64_t seg) {
  const size_t code = w == cd::Wire::INT8 ? 1 : 2;
  float s;
  std::memcpy(&s, block.data() + code * n + 4 * seg, 4);
  return s;
}

}  // namespace

TEST_CASE("codec: block sizes of the wire formats", "[codec][wire]") {
  for (int64_t n : {0, 1, 7, 1023, 1024, 1025, 4097}) {
    const uint64_t segs = static_cast<uint64_t>((n + 1023) / 1024);
    CHECK(cd::blockBytes(cd::Wire::BF16, n) == 2 * static_cast<uint64_t>(n));
    CHECK(cd::blockBytes(cd::Wire::FP16, n) == 2 * static_cast<uint64_t>(n) + 4 * segs);
    CHECK(cd::blockBytes(cd::Wire::INT8, n) == static_cast<uint64_t>(n) + 4 * segs);
  }
  CHECK_THROWS_AS(cd::blockBytes(cd::Wire::INT8, -1), std::invalid_argument);
  for (cd::Wire w : {cd::Wire::BF16, cd::Wire::FP16, cd::Wire::INT8}) CHECK(cd::wireFromName(cd::wireName(w)) == w);
  CHECK_THROWS_WITH(cd::wireFromName("fp8"), Catch::Contains("fp8") && Catch::Contains("bf16, fp16 or int8"));
}

TEST_CASE("codec: fp16 and int8 blocks: codes, scales and the EF identity against a reference", "[codec][wire]") {
  const cd::Wire w = GENERATE(cd::Wire::FP16, cd::Wire::INT8);
  const int64_t n = GENERATE(0, 1, 7, 1023, 1024, 1025, 4097);
  const bool alias = GENERATE(false, true);
  CAPTURE(cd::wireName(w), n, alias);
  const float scale = 1.0f / 3.0f;
  const auto x = scaledInputs(n, 11);
  auto r_in = scaledInputs(n, 12);
  for (auto& v : r_in) v *= 1e-3f;
  std::vector<float> r_out(r_in);
  std::vector<uint8_t> block(cd::blockBytes(w, n) + 1, 0xAB);  // one guard byte
  cd::encodeBlockEF(w, x.data(), scale, r_in.data(), alias ? r_out.data() : r_out.data(), block.data(), n);
  if (!alias) {
    // r_out separate: encode again into a separate residual and compare (aliasing changes nothing).
    std::vector<float> r2(static_cast<size_t>(n));
    std::vector<uint8_t> b2(block.size(), 0xAB);
    std::vector<float> r_copy(r_in);
    cd::encodeBlockEF(w, x.data(), scale, r_copy.data(), r_copy.data(), b2.data(), n);
    CHECK(b2 == block);
    CHECK(std::memcmp(r_copy.data(), r_out.data(), 4 * static_cast<size_t>(n)) == 0);
  }
  CHECK(block.back() == 0xAB);
  std::vector<float> dec(static_cast<size_t>(n)), acc(static_cast<size_t>(n), 0.25f);
  cd::decodeBlock(w, block.data(), dec.data(), n);
  cd::decodeAccumulateBlock(w, block.data(), acc.data(), n);
  int64_t bad = 0, bad_code = 0, bad_bound = 0, bad_value = 0, bad_id = 0, bad_acc = 0;
  for (int64_t s0 = 0, k = 0; s0 < n; s0 += 1024, ++k) {
    const int64_t end = std::min(n, s0 + 1024);
    volatile float vs;  // s exactly as the contract says: fp32 multiply, then fp32 add
    double amax = 0;
    std::vector<float> s(static_cast<size_t>(end - s0));
    for (int64_t i = s0; i < end; ++i) {
      vs = x[i] * scale;
      vs = vs + r_in[i];
      s[i - s0] = vs;
      amax = std::max(amax, std::fabs(static_cast<double>(vs)));
    }
    const float sc = scaleOf(w, block, n, k);
    if (w == cd::Wire::INT8) {
      CHECK(sc == static_cast<float>(amax) / 127.0f);
    } else {
      int e;
      std::frexp(sc, &e);
      CHECK(sc == std::ldexp(1.0f, e - 1));  // a power of two
      CHECK(amax / sc >= 16384.0);
      CHECK(amax / sc < 32768.0);
    }
    for (int64_t i = s0; i < end; ++i) {
      const float si = s[i - s0];
      double want;
      if (w == cd::Wire::INT8) {
        const float q = std::max(-127.0f, std::min(127.0f, std::nearbyint(si / sc)));
        want = static_cast<double>(q) * sc;
        if (static_cast<int8_t>(block[i]) != static_cast<int8_t>(q)) ++bad_code;
        // Half a code step, plus the rounding of the product code x scale (<= 127 x scale x 2^-24).
        if (std::fabs(static_cast<double>(r_out[i])) > 0.5 * sc + 128.0 * sc * std::ldexp(1.0, -24)) ++bad_bound;
      } else {
        want = static_cast<double>(static_cast<float>(static_cast<_Float16>(si / sc))) * sc;
        if (std::fabs(static_cast<double>(r_out[i])) > amax * std::ldexp(1.0, -11)) ++bad_bound;
      }
      if (static_cast<float>(want) != dec[i]) ++bad_value;
      // EF identity: value + residual == s exactly (the residual is the exact rounding error).
      if (static_cast<double>(dec[i]) + static_cast<double>(r_out[i]) != static_cast<double>(si)) ++bad_id;
      if (acc[i] != 0.25f + dec[i]) ++bad_acc;
    }
  }
  CHECK(bad_code == 0);
  CHECK(bad_bound == 0);
  CHECK(bad_value == 0);
  CHECK(bad_id == 0);
  CHECK(bad_acc == 0);
  CHECK(bad == 0);
}

TEST_CASE("codec: fp16 and int8 blocks: non-finite elements and FLT_MAX", "[codec][wire]") {
  const cd::Wire w = GENERATE(cd::Wire::FP16, cd::Wire::INT8);
  CAPTURE(cd::wireName(w));
  const int64_t n = 3000;
  auto x = scaledInputs(n, 5);
  const float inf = std::numeric_limits<float>::infinity();
  x[10] = std::numeric_limits<float>::quiet_NaN();
  x[20] = inf;
  x[30] = -inf;
  x[2000] = std::numeric_limits<float>::max();  // segment 1
  std::vector<float> r_in(static_cast<size_t>(n), 0.0f), r_out(static_cast<size_t>(n)), dec(static_cast<size_t>(n));
  r_in[2000] = 0.5f;
  std::vector<uint8_t> block(cd::blockBytes(w, n));
  cd::encodeBlockEF(w, x.data(), 1.0f, r_in.data(), r_out.data(), block.data(), n);
  cd::decodeBlock(w, block.data(), dec.data(), n);
  CHECK(std::isnan(dec[10]));
  if (w == cd::Wire::INT8) {
    CHECK(std::isnan(dec[20]));
    CHECK(std::isnan(dec[30]));
  } else {
    CHECK(dec[20] == inf);
    CHECK(dec[30] == -inf);
  }
  // The non-finite elements do not enter their segment's scale: the others stay accurate.
  for (int64_t i = 0; i < 1024; ++i) {
    if (i == 10 || i == 20 || i == 30) continue;
    REQUIRE(std::isfinite(dec[i]));
    REQUIRE(static_cast<double>(dec[i]) + r_out[i] == static_cast<double>(x[i]));
  }
  // FLT_MAX: the value is FLT_MAX-sized or +inf; an infinite value keeps the old residual.
  if (std::isinf(dec[2000])) CHECK(r_out[2000] == 0.5f);
  else CHECK(static_cast<double>(dec[2000]) + r_out[2000] == static_cast<double>(x[2000] + 0.5f));
  for (int64_t i = 1024; i < n; ++i)
    if (i != 2000) REQUIRE(std::isfinite(dec[i]));
}

TEST_CASE("codec: fp16 and int8 blocks: every path gives the scalar path's bits", "[codec][wire]") {
  PathGuard guard;
  const cd::Wire w = GENERATE(cd::Wire::FP16, cd::Wire::INT8);
  CAPTURE(cd::wireName(w));
  // Segments of random magnitudes, plus edge values: zeros of both signs, fp32 and fp16
  // subnormals, fp16's limits, FLT_MAX, inf, NaN (two payloads), an all-zero and an all-NaN
  // segment, and a short last segment (n = 5 x 1024 + 13).
  const int64_t n = 5 * 1024 + 13;
  auto x = scaledInputs(n, 99);
  const float edge[] = {0.0f, -0.0f, 1e-40f, -1e-45f, 6e-8f, 65504.0f, 65520.0f, -70000.0f,
                        std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                        std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::signaling_NaN(), 1.5f, -2.5f, 3e38f};
  for (size_t k = 0; k < sizeof edge / sizeof edge[0]; ++k) {
    x[static_cast<int64_t>(7 * k)] = edge[k];                  // segment 0
    x[2048 + static_cast<int64_t>(k)] = edge[k] * 1e-30f;      // segment 2 (tiny, edge values scaled)
  }
  for (int64_t i = 1024; i < 2048; ++i) x[i] = (i % 2) ? 0.0f : -0.0f;  // segment 1: all zero
  for (int64_t i = 3072; i < 4096; ++i) x[i] = std::numeric_limits<float>::quiet_NaN();  // segment 3
  auto r_in = scaledInputs(n, 100);
  for (auto& v : r_in) v *= 1e-4f;
  struct Out {
    std::vector<uint8_t> block;
    std::vector<float> r, dec, acc;
  };
  auto run = [&](Path p) {
    cd::setPathForTesting(p);
    Out o{std::vector<uint8_t>(cd::blockBytes(w, n)), std::vector<float>(n), std::vector<float>(n),
          std::vector<float>(n, 1.0f)};
    cd::encodeBlockEF(w, x.data(), 0.5f, r_in.data(), o.r.data(), o.block.data(), n);
    cd::decodeBlock(w, o.block.data(), o.dec.data(), n);
    cd::decodeAccumulateBlock(w, o.block.data(), o.acc.data(), n);
    return o;
  };
  const Out ref = run(Path::Scalar);
  for (Path p : availablePaths()) {
    CAPTURE(cd::pathName(p));
    const Out o = run(p);
    CHECK(o.block == ref.block);  // codes and scales
    // Values and residuals: the same bits; NaN residuals (of NaN inputs) only as NaN.
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      auto same = [](float a, float b) { return std::isnan(a) ? std::isnan(b) : std::memcmp(&a, &b, 4) == 0; };
      bad += !same(o.r[i], ref.r[i]) + !same(o.dec[i], ref.dec[i]) + !same(o.acc[i], ref.acc[i]);
    }
    CHECK(bad == 0);
  }
}
