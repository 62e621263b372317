#include "core/algorithms/loops.h"

#include <algorithm>

#include "core/ring.h"

namespace xirang::algo {

using transport::FrameHeader;

FrameHeader headerFor(const OpCtx& ctx, uint64_t aux) {
  FrameHeader h;
  h.op = ctx.op;
  h.dtype = ctx.dtype;
  h.reduce = ctx.reduce;
  h.seq = ctx.seq;
  h.op_numel = ctx.numel;
  h.aux = aux;
  return h;
}

uint64_t segmentBytes(const Comm& comm, size_t elem) {
  uint64_t s = static_cast<uint64_t>(std::max<int64_t>(comm.segment_bytes, 1));
  return std::max<uint64_t>(elem, s / elem * elem);
}

std::vector<SendSeg> sendSegments(const void* base, uint64_t bytes, uint64_t seg) {
  std::vector<SendSeg> out;
  for (uint64_t off = 0; off < bytes; off += seg)
    out.push_back(SendSeg{static_cast<const uint8_t*>(base) + off, std::min(seg, bytes - off)});
  return out;
}

std::vector<RecvSeg> recvSegments(void* base, uint64_t bytes, uint64_t seg) {
  std::vector<RecvSeg> out;
  for (uint64_t off = 0; off < bytes; off += seg) out.push_back(RecvSeg{static_cast<uint8_t*>(base) + off, std::min(seg, bytes - off)});
  return out;
}

std::vector<RecvSeg> recvIntoOne(void* buf, uint64_t bytes, uint64_t seg) {
  std::vector<RecvSeg> out;
  for (uint64_t off = 0; off < bytes; off += seg) out.push_back(RecvSeg{buf, std::min(seg, bytes - off)});
  return out;
}

void scatterReduce(const Comm& comm, const OpCtx& ctx, size_t elem, const ChunkFn& chunk, const SegmentFn& on_segment) {
  const int n = comm.size();
  const int pos = comm.position();
  const int next = comm.ring[ring::nextPos(pos, n)];
  const int prev = comm.ring[ring::prevPos(pos, n)];
  const uint64_t seg = segmentBytes(comm, elem);
  // Received segments share one segment-sized buffer, consumed while in cache.
  uint8_t* tmp = comm.scratchBytes(0, seg);
  for (int s = 0; s < n - 1; ++s) {
    const auto st = ring::scatterReduceStep(pos, n, s);
    const RecvSeg sc = chunk(st.send_chunk);
    const RecvSeg rc = chunk(st.recv_chunk);
    std::vector<SendJob> sends{{next, headerFor(ctx, static_cast<uint64_t>(s)), sendSegments(sc.data, sc.bytes, seg)}};
    std::vector<RecvJob> recvs{{prev, headerFor(ctx, static_cast<uint64_t>(s)), recvIntoOne(tmp, rc.bytes, seg), nullptr}};
    const auto& rsegs = recvs[0].segs;
    const int rchunk = st.recv_chunk;
    recvs[0].on_segment = [&](size_t i) { on_segment(rchunk, i * seg, tmp, rsegs[i].bytes); };
    runExchange(comm, ctx, sends, recvs);
  }
}

void allgather(const Comm& comm, const OpCtx& ctx, size_t elem, const ChunkFn& chunk) {
  const int n = comm.size();
  const int pos = comm.position();
  const int next = comm.ring[ring::nextPos(pos, n)];
  const int prev = comm.ring[ring::prevPos(pos, n)];
  const uint64_t seg = segmentBytes(comm, elem);
  for (int s = 0; s < n - 1; ++s) {
    const auto st = ring::allgatherStep(pos, n, s);
    const RecvSeg sc = chunk(st.send_chunk);
    const RecvSeg rc = chunk(st.recv_chunk);
    const uint64_t aux = kAllgatherAux + static_cast<uint64_t>(s);
    std::vector<SendJob> sends{{next, headerFor(ctx, aux), sendSegments(sc.data, sc.bytes, seg)}};
    std::vector<RecvJob> recvs{{prev, headerFor(ctx, aux), recvSegments(rc.data, rc.bytes, seg), nullptr}};
    runExchange(comm, ctx, sends, recvs);
  }
}

ChunkFn blockChunks(const Comm& comm, const std::vector<RecvSeg>& blocks) {
  const int n = comm.size();
  return [&comm, &blocks, n](int c) { return blocks[static_cast<size_t>(comm.ring[(c - 1 + n) % n])]; };
}

}  // namespace xirang::algo
