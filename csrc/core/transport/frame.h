// The wire frame: a fixed 48-byte little-endian header followed by `payload_bytes` of payload.
// Every field an operation's ranks must agree on travels in every frame, so a disagreement
// (dtype, element count, op order) is detected by the receiver as a clear error, never a hang
// or garbage. Sizes are 64-bit end to end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "core/dtype.h"

namespace xirang::transport {

constexpr uint32_t kMagic = 0x474e5258;  // "XRNG" little-endian
constexpr uint16_t kWireVersion = 3;  // 2: handshake MACs bind the channel and the group id; 3: allreduce_ef frames carry the wire's code dtype
constexpr size_t kHeaderBytes = 48;
constexpr uint64_t kMaxAbortMessage = 4096;

enum class FrameKind : uint8_t { Data = 1, Abort = 2 };

// Operation kinds, matching c10d's collectives; carried so that ranks issuing different
// collectives at the same sequence number fail instead of exchanging bytes.
enum class OpKind : uint8_t {
  None = 0,
  Allreduce = 1,
  Broadcast = 2,
  Allgather = 3,
  ReduceScatter = 4,
  Alltoall = 5,
  Reduce = 6,
  Gather = 7,
  Scatter = 8,
  Barrier = 9,
  Send = 10,
  AllreduceEF = 11,
  Ack = 12,    // elastic mode: "I hold this op's result" (empty frame to every live rank)
  Admit = 13,  // elastic mode: spares admitted at a step boundary (one barrier's frames; the store carries the decision)
};
const char* opKindName(OpKind k);

struct FrameHeader {
  uint32_t magic = kMagic;
  uint16_t version = kWireVersion;
  FrameKind kind = FrameKind::Data;
  OpKind op = OpKind::None;
  DType dtype = DType::Bytes;
  ReduceOp reduce = ReduceOp::None;
  uint16_t reserved = 0;
  uint32_t tag = 0;         // p2p tag; 0 for collectives
  uint64_t seq = 0;         // per-group collective sequence number (c10d's "tag" counter)
  uint64_t op_numel = 0;    // elements of the whole operation on the sender (shape check)
  uint64_t payload_bytes = 0;
  uint64_t aux = 0;         // op-specific: root rank, chunk index, ...
};

// Serialise / parse exactly kHeaderBytes bytes.
void encodeHeader(const FrameHeader& h, uint8_t* out);
FrameHeader decodeHeader(const uint8_t* in);

// Compare a received data header against what this rank expects for the same operation.
// Returns "" when they agree, else a message naming every field that differs with both values,
// e.g. "dtype mismatch: this rank float32, rank 0 bfloat16". Magic and version are checked
// first (a stranger or another xirang version). `peer` is the sender's rank for the message.
std::string compareHeader(const FrameHeader& expected, const FrameHeader& got, int peer);

// XIRANG_TEST_DIE_AFTER_SEGMENTS=k[@r] (test only): the process (only group rank r's, with @r)
// kills itself, as a crashed machine would vanish, right after sending its k-th data frame with
// a payload (elastic mode's failure injection). Every transport calls it once per data frame
// (shared memory: once per piece it wrote), with the frame's payload bytes.
void dieAfterSegmentsHook(int rank, uint64_t payload);
// Its value: {k, r} (r = -1 without @r; k = 0 when unset: never). std::invalid_argument naming the
// knob when it is not "k" or "k@r" with k and r >= 0 (checked at group creation).
std::pair<int64_t, int> dieAfterSegmentsKnob();

}  // namespace xirang::transport
