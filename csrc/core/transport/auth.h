// Connection authentication: a per-group 128-bit secret (exchanged through the c10d store) and a
// challenge-response with SipHash-2-4 as the MAC (Aumasson & Bernstein, 2012). A connection must
// prove it belongs to the group before any frame is read from it.
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
// Throws std::invalid_argument if `hex` is not 32 hex digits.
Key128 keyFromHex(const std::string& hex);

}  // namespace xirang::transport
