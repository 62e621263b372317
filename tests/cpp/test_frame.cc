// Wire frame header (csrc/core/transport/frame.h) and connection authentication primitives
// (csrc/core/transport/auth.h): SipHash-2-4 against the reference vectors, key hex codec.
#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/codec.h"
#include "core/transport/auth.h"
#include "core/transport/frame.h"

namespace {

namespace tp = xirang::transport;
using xirang::DType;
using xirang::ReduceOp;

tp::FrameHeader sample() {
  tp::FrameHeader h;
  h.kind = static_cast<tp::FrameKind>(3);  // a kind byte that is neither default: the codec carries any
  h.op = tp::OpKind::ReduceScatter;
  h.dtype = DType::Complex128;
  h.reduce = ReduceOp::BXor;
  h.reserved = 0xBEEF;
  h.tag = 0xDEADBEEFu;
  h.seq = (uint64_t{1} << 63) + 1;
  h.op_numel = (uint64_t{1} << 40) + 3;
  h.payload_bytes = 5000000000000ULL;
  h.aux = 0xFEDCBA9876543210ULL;
  return h;
}

template <typename T>
T at(const uint8_t* buf, size_t off) {
  T v;
  std::memcpy(&v, buf + off, sizeof(T));
  return v;
}

bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

}  // namespace

TEST_CASE("frame: header round trip keeps every field, 64-bit sizes included", "[frame]") {
  const tp::FrameHeader h = sample();
  uint8_t buf[tp::kHeaderBytes + 8];
  std::memset(buf, 0xA5, sizeof(buf));
  tp::encodeHeader(h, buf);
  // Exactly kHeaderBytes written: the canary after it is untouched.
  for (size_t i = tp::kHeaderBytes; i < sizeof(buf); ++i) REQUIRE(buf[i] == 0xA5);

  const tp::FrameHeader g = tp::decodeHeader(buf);
  CHECK(g.magic == tp::kMagic);
  CHECK(g.version == tp::kWireVersion);
  CHECK(g.kind == h.kind);
  CHECK(g.op == h.op);
  CHECK(g.dtype == h.dtype);
  CHECK(g.reduce == h.reduce);
  CHECK(g.reserved == h.reserved);
  CHECK(g.tag == h.tag);
  CHECK(g.seq == (uint64_t{1} << 63) + 1);
  CHECK(g.op_numel == (uint64_t{1} << 40) + 3);
  CHECK(g.payload_bytes == 5000000000000ULL);
  CHECK(g.payload_bytes > uint64_t{INT32_MAX});
  CHECK(g.aux == h.aux);
  CHECK(tp::compareHeader(h, g, 0).empty());
}

TEST_CASE("frame: little-endian layout at fixed offsets", "[frame]") {
  const tp::FrameHeader h = sample();
  uint8_t buf[tp::kHeaderBytes];
  tp::encodeHeader(h, buf);
  CHECK(std::string(reinterpret_cast<const char*>(buf), 4) == "XRNG");
  CHECK(at<uint16_t>(buf, 4) == tp::kWireVersion);
  CHECK(buf[6] == 3);
  CHECK(buf[7] == static_cast<uint8_t>(tp::OpKind::ReduceScatter));
  CHECK(buf[8] == static_cast<uint8_t>(DType::Complex128));
  CHECK(buf[9] == static_cast<uint8_t>(ReduceOp::BXor));
  CHECK(at<uint16_t>(buf, 10) == 0xBEEF);
  CHECK(at<uint32_t>(buf, 12) == 0xDEADBEEFu);
  CHECK(at<uint64_t>(buf, 16) == h.seq);
  CHECK(at<uint64_t>(buf, 24) == h.op_numel);
  CHECK(at<uint64_t>(buf, 32) == h.payload_bytes);
  CHECK(at<uint64_t>(buf, 40) == h.aux);
  // The most significant byte of payload_bytes = 5e12 = 0x48C27395000 lands at offset 32 + 5.
  CHECK(buf[32] == 0x00);
  CHECK(buf[37] == 0x04);
  CHECK(buf[38] == 0x00);
}

TEST_CASE("frame: default header and every byte value survive a round trip", "[frame]") {
  tp::FrameHeader d;
  uint8_t buf[tp::kHeaderBytes];
  tp::encodeHeader(d, buf);
  tp::FrameHeader g = tp::decodeHeader(buf);
  CHECK(tp::compareHeader(d, g, 1).empty());
  CHECK(g.magic == tp::kMagic);
  CHECK(g.kind == tp::FrameKind::Data);
  CHECK(g.payload_bytes == 0);

  // All-ones 64-bit fields.
  d.seq = d.op_numel = d.payload_bytes = d.aux = UINT64_MAX;
  d.tag = UINT32_MAX;
  tp::encodeHeader(d, buf);
  g = tp::decodeHeader(buf);
  CHECK(g.seq == UINT64_MAX);
  CHECK(g.op_numel == UINT64_MAX);
  CHECK(g.payload_bytes == UINT64_MAX);
  CHECK(g.aux == UINT64_MAX);
  CHECK(g.tag == UINT32_MAX);
}

TEST_CASE("frame: compareHeader names each mismatch with both values", "[frame]") {
  tp::FrameHeader e;
  e.op = tp::OpKind::Allreduce;
  e.dtype = DType::Float32;
  e.reduce = ReduceOp::Sum;
  e.seq = 7;
  e.op_numel = 1000;
  e.payload_bytes = 4000;
  e.aux = 2;

  CHECK(tp::compareHeader(e, e, 3) == "");

  SECTION("dtype") {
    tp::FrameHeader g = e;
    g.dtype = DType::BFloat16;
    const std::string m = tp::compareHeader(e, g, 3);
    CHECK(m == "dtype mismatch: this rank float32, rank 3 bfloat16");
  }
  SECTION("element count, 64-bit") {
    tp::FrameHeader g = e;
    g.op_numel = (uint64_t{1} << 40) + 3;
    const std::string m = tp::compareHeader(e, g, 1);
    CHECK(contains(m, "element count mismatch"));
    CHECK(contains(m, "this rank 1000"));
    CHECK(contains(m, "rank 1 1099511627779"));
  }
  SECTION("op") {
    tp::FrameHeader g = e;
    g.op = tp::OpKind::Broadcast;
    const std::string m = tp::compareHeader(e, g, 0);
    CHECK(contains(m, "op mismatch"));
    CHECK(contains(m, "allreduce"));
    CHECK(contains(m, "broadcast"));
    CHECK(contains(m, "rank 0"));
  }
  SECTION("order (seq)") {
    tp::FrameHeader g = e;
    g.seq = (uint64_t{1} << 63) + 1;
    const std::string m = tp::compareHeader(e, g, 5);
    CHECK(contains(m, "order mismatch"));
    CHECK(contains(m, "#7"));
    CHECK(contains(m, "#9223372036854775809"));
    CHECK(contains(m, "rank 5"));
  }
  SECTION("reduce op") {
    tp::FrameHeader g = e;
    g.reduce = ReduceOp::Max;
    const std::string m = tp::compareHeader(e, g, 2);
    CHECK(contains(m, "reduce op mismatch"));
    CHECK(contains(m, "SUM"));
    CHECK(contains(m, "MAX"));
  }
  SECTION("several fields at once are all named") {
    tp::FrameHeader g = e;
    g.dtype = DType::Int64;
    g.op_numel = 999;
    g.op = tp::OpKind::Allgather;
    const std::string m = tp::compareHeader(e, g, 4);
    CHECK(contains(m, "dtype mismatch: this rank float32, rank 4 int64"));
    CHECK(contains(m, "element count mismatch: this rank 1000, rank 4 999"));
    CHECK(contains(m, "op mismatch: this rank allreduce, rank 4 allgather"));
  }
  SECTION("p2p tag") {
    tp::FrameHeader ps = e, pg = e;
    ps.op = pg.op = tp::OpKind::Send;
    ps.tag = 5;
    pg.tag = 6;
    const std::string m = tp::compareHeader(ps, pg, 1);
    CHECK(contains(m, "tag mismatch"));
    CHECK(contains(m, "tag 5"));
    CHECK(contains(m, "tag 6"));
    // Collectives carry tag 0 and do not compare it.
    pg.op = ps.op = tp::OpKind::Allreduce;
    CHECK(tp::compareHeader(ps, pg, 1) == "");
  }
  SECTION("aux (root/chunk)") {
    tp::FrameHeader g = e;
    g.aux = 3;
    const std::string m = tp::compareHeader(e, g, 1);
    CHECK(contains(m, "this rank 2"));
    CHECK(contains(m, "rank 1 3"));
  }
  SECTION("root of a one-directional collective's agreement frame") {
    tp::FrameHeader ex = e, g = e;
    ex.aux = (1ULL << 40) | 0;
    g.aux = (1ULL << 40) | 1;
    const std::string m = tp::compareHeader(ex, g, 1);
    CHECK(contains(m, "root mismatch: this rank root 0, rank 1 root 1"));
  }
  SECTION("frame length") {
    tp::FrameHeader g = e;
    g.payload_bytes = 5000000000000ULL;
    const std::string m = tp::compareHeader(e, g, 1);
    CHECK(m == "frame length mismatch: expected 4000 bytes, rank 1 sent 5000000000000");
  }
  SECTION("bad magic") {
    tp::FrameHeader g = e;
    g.magic = 0x50545448;  // "HTTP"
    const std::string m = tp::compareHeader(e, g, 6);
    CHECK(contains(m, "magic"));
    CHECK(contains(m, "rank 6"));
  }
  SECTION("bad magic parsed from garbage bytes") {
    uint8_t buf[tp::kHeaderBytes];
    const char* http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n......................";
    std::memcpy(buf, http, sizeof(buf));
    const std::string m = tp::compareHeader(e, tp::decodeHeader(buf), 6);
    CHECK(contains(m, "magic"));
  }
  SECTION("version mismatch") {
    tp::FrameHeader g = e;
    g.version = tp::kWireVersion + 1;
    const std::string m = tp::compareHeader(e, g, 2);
    CHECK(contains(m, "version mismatch"));
    CHECK(contains(m, "this rank " + std::to_string(tp::kWireVersion)));
    CHECK(contains(m, "rank 2 " + std::to_string(tp::kWireVersion + 1)));
  }
}

TEST_CASE("frame: the hook's op with another wire is a wire mismatch, not a dtype or chunk one", "[frame]") {
  tp::FrameHeader e;
  e.op = tp::OpKind::AllreduceEF;
  e.dtype = xirang::codec::wireDType(xirang::codec::Wire::BF16);
  tp::FrameHeader g = e;
  g.dtype = xirang::codec::wireDType(xirang::codec::Wire::INT8);
  g.aux = e.aux + 22;  // the int8 direct form's chunk layout differs too: named only when the rest agrees
  const std::string m = tp::compareHeader(e, g, 1);
  CHECK(m == "wire mismatch: this rank bfloat16, rank 1 int8 (every rank must pass the same wire)");
  CHECK(xirang::codec::wireDType(xirang::codec::Wire::FP16) == xirang::DType::Float16);
  // Other ops still say dtype.
  e.op = g.op = tp::OpKind::Allreduce;
  CHECK(contains(tp::compareHeader(e, g, 1), "dtype mismatch: this rank bfloat16, rank 1 int8"));
}

TEST_CASE("frame: opKindName covers every op", "[frame]") {
  CHECK(std::string(tp::opKindName(tp::OpKind::Allreduce)) == "allreduce");
  CHECK(std::string(tp::opKindName(tp::OpKind::ReduceScatter)) == "reduce_scatter");
  CHECK(std::string(tp::opKindName(tp::OpKind::Send)) == "send");
  CHECK(std::string(tp::opKindName(tp::OpKind::AllreduceEF)) == "allreduce_ef");
  for (int k = 0; k <= 11; ++k) CHECK(std::string(tp::opKindName(static_cast<tp::OpKind>(k))) != "unknown");
  CHECK(std::string(tp::opKindName(static_cast<tp::OpKind>(200))) == "unknown");
}

// ---------------------------------------------------------------------------------------------
// SipHash-2-4: the 64 reference vectors of the SipHash reference implementation (vectors.h,
// vectors_sip64), key 00 01 .. 0f, message 00 01 .. (len-1), as little-endian u64. Entry 15 is
// the worked example of the paper's Appendix A (Aumasson & Bernstein 2012).
namespace {
constexpr uint64_t kSip64[64] = {
    0x726fdb47dd0e0e31, 0x74f839c593dc67fd, 0x0d6c8009d9a94f5a, 0x85676696d7fb7e2d,
    0xcf2794e0277187b7, 0x18765564cd99a68d, 0xcbc9466e58fee3ce, 0xab0200f58b01d137,
    0x93f5f5799a932462, 0x9e0082df0ba9e4b0, 0x7a5dbbc594ddb9f3, 0xf4b32f46226bada7,
    0x751e8fbc860ee5fb, 0x14ea5627c0843d90, 0xf723ca908e7af2ee, 0xa129ca6149be45e5,
    0x3f2acc7f57c29bdb, 0x699ae9f52cbe4794, 0x4bc1b3f0968dd39c, 0xbb6dc91da77961bd,
    0xbed65cf21aa2ee98, 0xd0f2cbb02e3b67c7, 0x93536795e3a33e88, 0xa80c038ccd5ccec8,
    0xb8ad50c6f649af94, 0xbce192de8a85b8ea, 0x17d835b85bbb15f3, 0x2f2e6163076bcfad,
    0xde4daaaca71dc9a5, 0xa6a2506687956571, 0xad87a3535c49ef28, 0x32d892fad841c342,
    0x7127512f72f27cce, 0xa7f32346f95978e3, 0x12e0b01abb051238, 0x15e034d40fa197ae,
    0x314dffbe0815a3b4, 0x027990f029623981, 0xcadcd4e59ef40c4d, 0x9abfd8766a33735c,
    0x0e3ea96b5304a7d0, 0xad0c42d6fc585992, 0x187306c89bc215a9, 0xd4a60abcf3792b95,
    0xf935451de4f21df2, 0xa9538f0419755787, 0xdb9acddff56ca510, 0xd06c98cd5c0975eb,
    0xe612a3cb9ecba951, 0xc766e62cfcadaf96, 0xee64435a9752fe72, 0xa192d576b245165a,
    0x0a8787bf8ecb74b2, 0x81b3e73d20b49b6f, 0x7fa8220ba3b2ecea, 0x245731c13ca42499,
    0xb78dbfaf3a8d83bd, 0xea1ad565322a1a0b, 0x60e61c23a3795013, 0x6606d7e446282b93,
    0x6ca4ecb15c5f91e1, 0x9f626da15c9625f3, 0xe51b38608ef25f57, 0x958a324ceb064572,
};
}  // namespace

TEST_CASE("auth: siphash24 matches the reference vectors", "[frame][auth]") {
  tp::Key128 key;
  for (int i = 0; i < 16; ++i) key[i] = static_cast<uint8_t>(i);
  uint8_t msg[64];
  for (int i = 0; i < 64; ++i) msg[i] = static_cast<uint8_t>(i);
  for (size_t len = 0; len < 64; ++len) {
    INFO("len " << len);
    CHECK(tp::siphash24(key, msg, len) == kSip64[len]);
  }
  CHECK(tp::siphash24(key, nullptr, 0) == 0x726fdb47dd0e0e31ULL);
  CHECK(tp::siphash24(key, msg, 15) == 0xa129ca6149be45e5ULL);

  // Unaligned input gives the same answer (the MAC is over bytes, not words).
  uint8_t shifted[65];
  std::memcpy(shifted + 1, msg, 64);
  for (size_t len = 0; len < 64; len += 7) CHECK(tp::siphash24(key, shifted + 1, len) == kSip64[len]);

  // Any key bit matters.
  tp::Key128 k2 = key;
  k2[15] ^= 0x80;
  CHECK(tp::siphash24(k2, msg, 15) != kSip64[15]);
}

TEST_CASE("auth: keyToHex / keyFromHex", "[frame][auth]") {
  tp::Key128 key;
  for (int i = 0; i < 16; ++i) key[i] = static_cast<uint8_t>(i * 17 + 3);
  const std::string hex = tp::keyToHex(key);
  CHECK(hex.size() == 32);
  CHECK(hex == "031425364758697a8b9cadbecfe0f102");
  CHECK(tp::keyFromHex(hex) == key);

  tp::Key128 zero{};
  CHECK(tp::keyToHex(zero) == std::string(32, '0'));
  tp::Key128 ff;
  ff.fill(0xff);
  CHECK(tp::keyToHex(ff) == std::string(32, 'f'));
  CHECK(tp::keyFromHex(std::string(32, 'f')) == ff);

  for (int i = 0; i < 20; ++i) {
    const tp::Key128 r = tp::randomKey();
    CHECK(tp::keyFromHex(tp::keyToHex(r)) == r);
  }
  CHECK(tp::randomKey() != tp::randomKey());
  CHECK(tp::randomU64() != tp::randomU64());

  CHECK_THROWS_AS(tp::keyFromHex(""), std::invalid_argument);
  CHECK_THROWS_AS(tp::keyFromHex(hex.substr(0, 31)), std::invalid_argument);
  CHECK_THROWS_AS(tp::keyFromHex(hex + "0"), std::invalid_argument);
  CHECK_THROWS_AS(tp::keyFromHex("031425364758697a8b9xadbecfe0f102"), std::invalid_argument);
  CHECK_THROWS_AS(tp::keyFromHex("031425364758697a8b9 adbecfe0f102"), std::invalid_argument);
  CHECK_THROWS_AS(tp::keyFromHex(std::string("031425364758697a8b9cadbecfe0f10") + '\0'), std::invalid_argument);
}

// auth.h promises std::invalid_argument only "if `hex` is not 32 hex digits"; 'A'-'F' are hex
// digits, but keyFromHex accepts only lower case. Harmless today (the secret always comes from
// keyToHex), so this documents the deviation rather than gating the build.
TEST_CASE("auth: keyFromHex accepts upper-case hex digits", "[frame][auth]") {
  tp::Key128 key;
  for (int i = 0; i < 16; ++i) key[i] = static_cast<uint8_t>(i * 17 + 3);
  CHECK_NOTHROW(tp::keyFromHex("031425364758697A8B9CADBECFE0F102"));
  CHECK(tp::keyFromHex("031425364758697A8B9CADBECFE0F102") == key);
}
