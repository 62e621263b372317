// The pieces every algorithm is made of: frame headers from the op's context, segments of a
// buffer, one exchange step (collectives.h: runExchange), and the ring's two loops, written once:
//
//   scatterReduce  n-1 steps; at step s each position sends ring chunk ring::scatterReduceStep.
//                  send_chunk to the next position and receives recv_chunk from the previous one,
//                  segment by segment into one segment-sized scratch buffer; every received
//                  segment is handed to `on_segment` (reduce it in the wire dtype, or accumulate
//                  and re-encode with error feedback, ...) before the next one is read.
//   allgather      n-1 steps of ring::allgatherStep; received chunks land in place.
//
// A chunk is ring chunk c of the op's layout, given by the caller as a byte range per chunk: the
// fp32 ring's partition of its buffer, the compressed ring's bf16 wire array, or the blocks of a
// reduce-scatter / allgather (chunk c = the block of rank ring[c-1], so that position p ends
// owning its own block). Ring indices come only from ring.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/collectives.h"
#include "core/transport/transport.h"

namespace xirang::algo {

using transport::RecvJob;
using transport::RecvSeg;
using transport::SendJob;
using transport::SendSeg;

// aux of the frames of step s: s in the scatter-reduce, kAllgatherAux + s in the allgather (a
// rank that runs the other phase, or another step, is told, not fed the wrong chunk).
constexpr uint64_t kAllgatherAux = 1000;
// aux bit marking the agreement check (an empty frame) of one-directional collectives.
constexpr uint64_t kCheckBit = 1ULL << 40;

transport::FrameHeader headerFor(const OpCtx& ctx, uint64_t aux);

// Seconds between two steady-clock times, and since one: the phase times of the records.
inline double between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
inline double since(Clock::time_point t0) { return between(t0, Clock::now()); }

// comm.segment_bytes rounded down to whole elements of `elem` bytes (at least one element).
uint64_t segmentBytes(const Comm& comm, size_t elem);

// Segments of at most `seg` bytes of [base, base + bytes).
std::vector<transport::SendSeg> sendSegments(const void* base, uint64_t bytes, uint64_t seg);
std::vector<transport::RecvSeg> recvSegments(void* base, uint64_t bytes, uint64_t seg);
// Receive segments of a `bytes`-byte message that all land in the one `seg`-byte buffer `buf`
// (segment i is bytes [i*seg, i*seg + segs[i].bytes) of the message; see RecvJob::on_segment).
std::vector<transport::RecvSeg> recvIntoOne(void* buf, uint64_t bytes, uint64_t seg);

// The byte range of ring chunk c.
using ChunkFn = std::function<transport::RecvSeg(int chunk)>;
// A received segment of ring chunk `chunk`: `bytes` at `data` (scratch, valid until it returns)
// that belong at byte `offset` of the chunk.
using SegmentFn = std::function<void(int chunk, uint64_t offset, const void* data, uint64_t bytes)>;

// The ring scatter-reduce over comm.ring (see above). Segments are segmentBytes(comm, elem)
// long. After it, this position holds the fully reduced chunk ring::ownedChunk(pos, n).
void scatterReduce(const Comm& comm, const OpCtx& ctx, size_t elem, const ChunkFn& chunk, const SegmentFn& on_segment);

// The ring allgather over comm.ring: at its end every chunk holds the bytes its owner had.
void allgather(const Comm& comm, const OpCtx& ctx, size_t elem, const ChunkFn& chunk);

// Chunk c of a layout of per-rank blocks (reduce-scatter, allgather): the block of ring[c-1].
ChunkFn blockChunks(const Comm& comm, const std::vector<transport::RecvSeg>& blocks);

}  // namespace xirang::algo
