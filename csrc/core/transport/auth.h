// Connection authentication: a 128-bit group key and a challenge-response with SipHash-2-4 as the
// MAC (Aumasson & Bernstein, 2012). A connection must prove it belongs to the group before any
// frame is read from it.
//
// The key is either a random secret rank 0 writes to the c10d store (the default: the store is
// the trust root), or, with XIRANG_AUTH_KEY_FILE, a key the job's launcher distributes (then
// nothing secret is written to the store). The handshake (wire version 2):
//
//   client -> server  hello: "XRHS" version:u16 channel:u8 0:u8 rank:i32 cnonce:u64   (20 bytes)
//   server -> client  snonce:u64 smac:u64, smac = MAC('S', group, channel, cnonce, snonce, server, client)
//   client -> server  cmac:u64,             cmac = MAC('C', group, channel, snonce, cnonce, client, server)
//
// MAC(...) is SipHash-2-4 under the key of the 64-bit words listed; `group` is a per-group random
// id from the store (not secret) so a connection cannot be replayed into another group that
// shares the key file. Integers are little-endian.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace xirang::transport {

using Key128 = std::array<uint8_t, 16>;

// SipHash-2-4 of `len` bytes under `key`.
uint64_t siphash24(const Key128& key, const void* data, size_t len);

// 16 random bytes from the OS (getrandom). Throws std::runtime_error on failure.
Key128 randomKey();
uint64_t randomU64();

// The secret of epoch `epoch` of a group whose secret is `k` (elastic mode): two SipHash-2-4
// outputs of the epoch under k. Computable only by members of the original group.
Key128 deriveKey(const Key128& k, uint64_t epoch);

std::string keyToHex(const Key128& k);

// The 128-bit key of XIRANG_AUTH_KEY_FILE: the file holds 32 hex digits (surrounding whitespace
// ignored), e.g. from `python -c "import secrets; print(secrets.token_hex(16))"`. Throws
// std::runtime_error naming the path when it cannot be read or does not hold such a key.
Key128 loadKeyFile(const std::string& path);

constexpr size_t kHelloBytes = 20;
constexpr uint8_t kHelloMagic[4] = {'X', 'R', 'H', 'S'};

// What a connection carries: the collectives' ordered frames, point-to-point messages (their
// own connections, so sends and receives progress independently of collectives), or a liveness
// probe (answered by closing: "this listener still exists").
enum class Channel : uint8_t { Collective = 0, P2P = 1, Probe = 2 };
const char* channelName(Channel c);

struct Hello {
  uint16_t version = 0;
  Channel channel = Channel::Collective;
  int32_t rank = -1;
  uint64_t nonce = 0;
};
void encodeHello(const Hello& h, uint8_t out[kHelloBytes]);
// Parses the 20 hello bytes. Returns "" or why they are not a hello of this wire version
// (bad magic, version, channel or padding). Never reads past kHelloBytes.
std::string parseHello(const uint8_t in[kHelloBytes], uint16_t wire_version, Hello* out);

// The server's and the client's MAC of one handshake (see the protocol above).
uint64_t serverMac(const Key128& key, uint64_t group, Channel ch, uint64_t cnonce, uint64_t snonce, int server,
                   int client);
uint64_t clientMac(const Key128& key, uint64_t group, Channel ch, uint64_t snonce, uint64_t cnonce, int client,
                   int server);
// Throws std::invalid_argument if `hex` is not 32 hex digits.
Key128 keyFromHex(const std::string& hex);

}  // namespace xirang::transport
