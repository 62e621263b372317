#include "core/transport/auth.h"

#include <sys/random.h>

#include <cstring>
#include <stdexcept>

namespace xirang::transport {

namespace {
inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }
inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
}  // namespace

uint64_t siphash24(const Key128& key, const void* data, size_t len) {
  const uint8_t* in = static_cast<const uint8_t*>(data);
  const uint64_t k0 = load64(key.data()), k1 = load64(key.data() + 8);
  uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
  uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
  auto round = [&] {
    v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);
    v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;
    v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;
    v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);
  };
  const size_t full = len & ~size_t(7);
  for (size_t i = 0; i < full; i += 8) {
    uint64_t m = load64(in + i);
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  }
  uint64_t b = static_cast<uint64_t>(len) << 56;
  for (size_t i = 0; i < (len & 7); ++i) b |= static_cast<uint64_t>(in[full + i]) << (8 * i);
  v3 ^= b;
  round();
  round();
  v0 ^= b;
  v2 ^= 0xff;
  round();
  round();
  round();
  round();
  return v0 ^ v1 ^ v2 ^ v3;
}

static void fillRandom(void* p, size_t n) {
  uint8_t* out = static_cast<uint8_t*>(p);
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("xirang: getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(r);
  }
}

Key128 randomKey() {
  Key128 k;
  fillRandom(k.data(), k.size());
  return k;
}

uint64_t randomU64() {
  uint64_t v;
  fillRandom(&v, sizeof(v));
  return v;
}

std::string keyToHex(const Key128& k) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t b : k) {
    s += d[b >> 4];
    s += d[b & 15];
  }
  return s;
}

Key128 keyFromHex(const std::string& hex) {
  if (hex.size() != 32) throw std::invalid_argument("xirang: group secret must be 32 hex digits");
  Key128 k;
  auto nib = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    throw std::invalid_argument("xirang: group secret is not hex");
  };
  for (size_t i = 0; i < 16; ++i) k[i] = static_cast<uint8_t>(nib(hex[2 * i]) * 16 + nib(hex[2 * i + 1]));
  return k;
}

Key128 deriveKey(const Key128& k, uint64_t epoch) {
  Key128 out{};
  for (uint64_t half = 0; half < 2; ++half) {
    const uint64_t msg[3] = {0x7869726e67ULL /* "xirng" */, epoch, half};
    uint64_t h = siphash24(k, msg, sizeof(msg));
    std::memcpy(out.data() + 8 * half, &h, 8);
  }
  return out;
}

}  // namespace xirang::transport
