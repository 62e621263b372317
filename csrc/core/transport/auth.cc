#include "core/transport/auth.h"

#include <sys/random.h>

#include <cctype>
#include <cstring>
#include <fstream>
#include <sstream>
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

Key128 loadKeyFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("XIRANG_AUTH_KEY_FILE=" + path + ": cannot read the file: " + std::strerror(errno));
  std::ostringstream buf;
  buf << f.rdbuf();
  std::string text = buf.str();
  if (text.size() > 4096) throw std::runtime_error("XIRANG_AUTH_KEY_FILE=" + path + ": longer than a key file");
  size_t b = 0, e = text.size();
  while (b < e && std::isspace(static_cast<unsigned char>(text[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(text[e - 1]))) --e;
  try {
    return keyFromHex(text.substr(b, e - b));
  } catch (const std::invalid_argument&) {
    throw std::runtime_error("XIRANG_AUTH_KEY_FILE=" + path +
                             ": the file must hold a 128-bit key as 32 hex digits (e.g. python -c "
                             "\"import secrets; print(secrets.token_hex(16))\")");
  }
}

const char* channelName(Channel c) {
  switch (c) {
    case Channel::Collective: return "collective";
    case Channel::P2P: return "point-to-point";
    case Channel::Probe: return "probe";
  }
  return "unknown";
}

void encodeHello(const Hello& h, uint8_t out[kHelloBytes]) {
  std::memset(out, 0, kHelloBytes);
  std::memcpy(out, kHelloMagic, 4);
  out[4] = static_cast<uint8_t>(h.version & 0xff);
  out[5] = static_cast<uint8_t>(h.version >> 8);
  out[6] = static_cast<uint8_t>(h.channel);
  const uint32_t r = static_cast<uint32_t>(h.rank);
  for (int i = 0; i < 4; ++i) out[8 + i] = static_cast<uint8_t>(r >> (8 * i));
  for (int i = 0; i < 8; ++i) out[12 + i] = static_cast<uint8_t>(h.nonce >> (8 * i));
}

std::string parseHello(const uint8_t in[kHelloBytes], uint16_t wire_version, Hello* out) {
  if (std::memcmp(in, kHelloMagic, 4) != 0) return "not a xirang peer (bad hello)";
  Hello h;
  h.version = static_cast<uint16_t>(in[4] | (in[5] << 8));
  if (h.version != wire_version)
    return "peer speaks wire version " + std::to_string(h.version) + ", this rank " + std::to_string(wire_version);
  if (in[6] > static_cast<uint8_t>(Channel::Probe) || in[7] != 0) return "bad hello (unknown channel)";
  h.channel = static_cast<Channel>(in[6]);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>(in[8 + i]) << (8 * i);
  h.rank = static_cast<int32_t>(r);
  for (int i = 0; i < 8; ++i) h.nonce |= static_cast<uint64_t>(in[12 + i]) << (8 * i);
  *out = h;
  return "";
}

namespace {
uint64_t handshakeMac(const Key128& key, uint64_t who, uint64_t group, Channel ch, uint64_t n1, uint64_t n2, int a,
                      int b) {
  const uint64_t msg[5] = {who | (static_cast<uint64_t>(ch) << 8), group, n1, n2,
                           (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b)};
  return siphash24(key, msg, sizeof(msg));
}
}  // namespace

uint64_t serverMac(const Key128& key, uint64_t group, Channel ch, uint64_t cnonce, uint64_t snonce, int server,
                   int client) {
  return handshakeMac(key, 0x53, group, ch, cnonce, snonce, server, client);
}

uint64_t clientMac(const Key128& key, uint64_t group, Channel ch, uint64_t snonce, uint64_t cnonce, int client,
                   int server) {
  return handshakeMac(key, 0x43, group, ch, snonce, cnonce, client, server);
}

}  // namespace xirang::transport
