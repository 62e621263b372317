// The allreduce algorithms: direct exchange (small messages), the ring (scatter-reduce +
// allgather, Patarasuk & Yuan 2009), two-level (hierarchical), the 16-bit direct reduce-scatter
// that rounds once, and the BF16 error-feedback ring. Ring steps come from loops.h, the data
// work from the reducer.
#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "core/algorithms/loops.h"
#include "core/collectives.h"
#include "core/ring.h"

namespace xirang {

using namespace algo;  // NOLINT: the pieces (loops.h) every algorithm here is made of

namespace {

// Rank order of the members (position k holds the k-th smallest rank): every rank reduces the
// contributions in this order, so every rank gets the same bits.
std::vector<int> rankOrder(const Comm& comm) {
  std::vector<int> order = comm.ring;
  std::sort(order.begin(), order.end());
  return order;
}
size_t indexIn(const std::vector<int>& order, int r) {
  return static_cast<size_t>(std::lower_bound(order.begin(), order.end(), r) - order.begin());
}

// Byte range of ring chunk c of a contiguous buffer of `numel` elements of `elem` bytes.
algo::ChunkFn partitionChunks(uint8_t* base, const std::vector<ring::Range>& chunks, size_t elem) {
  return [base, &chunks, elem](int c) {
    const auto& r = chunks[static_cast<size_t>(c)];
    return RecvSeg{base + r.offset * elem, static_cast<uint64_t>(r.count) * elem};
  };
}
}  // namespace

uint8_t* Scratch::get(size_t slot, size_t bytes, algo::Reducer& reducer) {
  if (slot >= 4) throw std::logic_error("xirang: scratch slot out of range");
  if (bytes > caps_[slot] || !bufs_[slot] || owners_[slot] != &reducer) {
    bufs_[slot].reset();  // returned before the new one is taken: peak memory is one buffer
    bufs_[slot] = reducer.allocate(std::max<size_t>(bytes, 1));
    caps_[slot] = bytes;
    owners_[slot] = &reducer;
  }
  return bufs_[slot].get();
}

int Comm::position() const {
  auto it = std::find(ring.begin(), ring.end(), rank);
  if (it == ring.end()) throw std::logic_error("xirang: rank " + std::to_string(rank) + " is not in the ring");
  return static_cast<int>(it - ring.begin());
}

void runExchange(const Comm& comm, const OpCtx& ctx, std::vector<SendJob>& sends, std::vector<RecvJob>& recvs) {
  if (!ctx.phases) {
    comm.link->exchange(sends, recvs, ctx.deadline);
    return;
  }
  std::vector<transport::PeerTiming> timings;
  comm.link->exchange(sends, recvs, ctx.deadline, &timings);
  for (const auto& t : timings) {
    PeerStat& p = ctx.phases->peers[t.peer];
    if (t.send) {
      p.send_s += t.seconds;
      p.bytes_sent += t.bytes;
      ctx.phases->bytes_sent += t.bytes;
    } else {
      p.recv_s += t.seconds;
      p.bytes_recv += t.bytes;
    }
  }
}

namespace {

// The direct form's layout of a wire buffer: chunk q of ring::partition's chunks is the block
// blocks[q] of codec::blockBytes(w, count) bytes, the blocks one after the other (for BF16 and
// other 16-bit wires: chunk q's elements at their own offsets, 2 bytes each).
std::vector<RecvSeg> ownerBlocks(uint8_t* base, const std::vector<ring::Range>& chunks, codec::Wire w) {
  std::vector<RecvSeg> blocks;
  uint64_t off = 0;
  for (const auto& c : chunks) {
    const uint64_t b = codec::blockBytes(w, c.count);
    blocks.push_back(RecvSeg{base + off, b});
    off += b;
  }
  return blocks;
}

// The direct form's scatter: block q of this rank's wire buffer goes to the member at ring
// position q; every member's block for this rank's position lands in scratch slot 2, slot k
// holding the k-th member in rank order (so the owner folds in rank order on every path). Returns
// the slots: n blocks of blocks[position].bytes. aux: the frames' header aux.
uint8_t* sendToOwners(const Comm& comm, const OpCtx& ctx, const std::vector<RecvSeg>& blocks, uint64_t aux) {
  const int n = comm.size();
  const auto order = rankOrder(comm);
  const uint64_t mine = blocks[static_cast<size_t>(comm.position())].bytes;
  uint8_t* slots = comm.scratchBytes(2, static_cast<size_t>(mine) * n);
  auto slotOf = [&](int r) { return slots + mine * indexIn(order, r); };
  comm.reducer->copy(slotOf(comm.rank), blocks[static_cast<size_t>(comm.position())].data, mine);
  const uint64_t seg = algo::segmentBytes(comm, 2);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  for (int q = 0; q < n; ++q) {
    const int r = comm.ring[q];
    if (r == comm.rank) continue;
    sends.push_back(SendJob{r, headerFor(ctx, aux), algo::sendSegments(blocks[static_cast<size_t>(q)].data,
                                                                       blocks[static_cast<size_t>(q)].bytes, seg)});
    recvs.push_back(RecvJob{r, headerFor(ctx, aux), algo::recvSegments(slotOf(r), mine, seg), nullptr});
  }
  runExchange(comm, ctx, sends, recvs);
  return slots;
}

// The direct form's allgather: position q owns blocks[q], which in the ring allgather's layout
// is ring chunk q+1.
void allgatherFromOwners(const Comm& comm, const OpCtx& ctx, const std::vector<RecvSeg>& blocks) {
  const int n = comm.size();
  algo::allgather(comm, ctx, 1, [&](int c) { return blocks[static_cast<size_t>((c - 1 + n) % n)]; });
}

}  // namespace

void directAllreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op) {
  const uint64_t bytes = static_cast<uint64_t>(numel) * elementSize(wire);
  const auto order = rankOrder(comm);
  uint8_t* all = comm.scratchBytes(0, bytes * order.size());
  auto slot = [&](int r) { return all + bytes * indexIn(order, r); };
  comm.reducer->copy(slot(comm.rank), data, bytes);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  for (int r : comm.ring) {
    if (r == comm.rank) continue;
    sends.push_back(SendJob{r, headerFor(ctx, 0), {SendSeg{data, bytes}}});
    recvs.push_back(RecvJob{r, headerFor(ctx, 0), {RecvSeg{slot(r), bytes}}, nullptr});
  }
  auto t0 = Clock::now();
  runExchange(comm, ctx, sends, recvs);
  // Reduce in rank order on every rank: the same operands in the same order give the same bits.
  comm.reducer->copy(data, all, bytes);
  for (size_t i = 1; i < order.size(); ++i) comm.reducer->reduceInto(data, all + bytes * i, numel, wire, op);
  if (ctx.phases) {
    ctx.phases->scatter_reduce_s += since(t0);
    ctx.phases->algorithm = "direct";
  }
}

void ringAllreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op) {
  const size_t elem = elementSize(wire);
  const auto chunks = ring::partition(numel, comm.size());
  uint8_t* base = static_cast<uint8_t*>(data);
  const auto chunk = partitionChunks(base, chunks, elem);
  auto t0 = Clock::now();
  algo::scatterReduce(comm, ctx, elem, chunk, [&](int c, uint64_t off, const void* seg, uint64_t bytes) {
    comm.reducer->reduceInto(static_cast<uint8_t*>(chunk(c).data) + off, seg, static_cast<int64_t>(bytes / elem), wire, op);
  });
  auto t1 = Clock::now();
  algo::allgather(comm, ctx, elem, chunk);
  if (ctx.phases) {
    ctx.phases->scatter_reduce_s += between(t0, t1);
    ctx.phases->allgather_s += since(t1);
    ctx.phases->algorithm = "ring";
  }
}

TwoLevelSplit twoLevelSplit(const Comm& comm, void* data, int64_t numel, DType wire) {
  const size_t elem = elementSize(wire);
  const int g = static_cast<int>(comm.local_group.size());
  const int j = static_cast<int>(std::find(comm.local_group.begin(), comm.local_group.end(), comm.rank) -
                                 comm.local_group.begin());
  const auto shards = ring::partition(numel, g);
  uint8_t* base = static_cast<uint8_t*>(data);
  int max_rank = 0;
  for (int r : comm.ring) max_rank = std::max(max_rank, r);
  TwoLevelSplit s{comm, comm, std::vector<RecvSeg>(static_cast<size_t>(max_rank) + 1, RecvSeg{nullptr, 0}),
                  base + shards[static_cast<size_t>(j)].offset * elem, shards[static_cast<size_t>(j)].count};
  for (int k = 0; k < g; ++k)
    s.blocks[static_cast<size_t>(comm.local_group[static_cast<size_t>(k)])] =
        RecvSeg{base + shards[static_cast<size_t>(k)].offset * elem,
                static_cast<uint64_t>(shards[static_cast<size_t>(k)].count) * elem};
  s.local.ring = comm.local_group;
  s.local.local_group.clear();
  s.cross.ring = comm.cross_group;
  s.cross.local_group.clear();
  return s;
}

// Two-level (hierarchical) allreduce: reduce-scatter among the ranks of this host, allreduce of
// this rank's shard among the ranks holding the same shard on the other hosts, allgather inside
// the host. Shard j's final value is computed once by the cross-host allreduce and copied, so
// every rank ends with the same bits.
void twoLevelAllreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op) {
  TwoLevelSplit s = twoLevelSplit(comm, data, numel, wire);
  reduceScatter(s.local, ctx, s.blocks, wire, op);
  allreduce(s.cross, ctx, s.shard, s.shard_numel, wire, op);
  allgather(s.local, ctx, s.blocks);
  if (ctx.phases) ctx.phases->algorithm = "two_level";
}

Comm::Algo allreduceAlgo(const Comm& comm, int64_t numel, DType wire) {
  const uint64_t bytes = static_cast<uint64_t>(numel) * elementSize(wire);
  const bool small = bytes <= static_cast<uint64_t>(comm.small_bytes) || numel < comm.size();
  const bool two_level_ok = comm.local_group.size() > 1 && comm.cross_group.size() > 1 &&
                            numel >= static_cast<int64_t>(comm.local_group.size());
  // numel == 0 still exchanges (empty) frames so a rank that disagrees about the size is told.
  if (numel == 0 || comm.algo == Comm::Algo::Direct || (comm.algo == Comm::Algo::Auto && small))
    return Comm::Algo::Direct;
  if (two_level_ok && (comm.algo == Comm::Algo::TwoLevel || comm.algo == Comm::Algo::Auto)) return Comm::Algo::TwoLevel;
  return Comm::Algo::Ring;
}

void allreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op) {
  if (comm.size() <= 1) return;
  switch (allreduceAlgo(comm, numel, wire)) {
    case Comm::Algo::Direct: directAllreduce(comm, ctx, data, numel, wire, op); return;
    case Comm::Algo::TwoLevel: twoLevelAllreduce(comm, ctx, data, numel, wire, op); return;
    default: ringAllreduce(comm, ctx, data, numel, wire, op); return;
  }
}

void allreduce16(const Comm& comm, const OpCtx& ctx, uint16_t* data, int64_t numel, DType t, ReduceOp op,
                 float pre_scale, float post_scale) {
  if (t != DType::Float16 && t != DType::BFloat16)
    throw std::invalid_argument(std::string("xirang: allreduce16 takes float16 or bfloat16, not ") + dtypeName(t));
  const int n = comm.size();
  if (n <= 1) {
    if (pre_scale != 1.0f || post_scale != 1.0f) comm.reducer->combine16(data, 1, numel, t, op, pre_scale, post_scale, data);
    return;
  }
  const int pos = comm.position();
  auto chunks = ring::partition(numel, n);
  const auto& mine = chunks[static_cast<size_t>(pos)];
  const auto blocks = ownerBlocks(reinterpret_cast<uint8_t*>(data), chunks, codec::Wire::BF16);  // 2 bytes each
  auto t0 = Clock::now();
  const auto* slots = reinterpret_cast<const uint16_t*>(sendToOwners(comm, ctx, blocks, 1));
  auto t1 = Clock::now();
  comm.reducer->combine16(slots, n, mine.count, t, op, pre_scale, post_scale, data + mine.offset);
  auto t2 = Clock::now();
  allgatherFromOwners(comm, ctx, blocks);
  if (ctx.phases) {
    ctx.phases->scatter_reduce_s += between(t0, t1);
    ctx.phases->encode_s += between(t1, t2);
    ctx.phases->algorithm = "direct_rs_fp32+ring_ag";
  }
}

namespace {
// What both compressed allreduces start from: the average's scale 1/N, the reducer, the bf16
// wire buffer of numel elements (scratch slot 1; none for numel 0: the direct form lays out its
// own), the phases to add to (ctx's or a dummy).
struct EFRun {
  EFRun(const Comm& comm, const OpCtx& ctx, int64_t numel, const char* algorithm)
      : n(comm.size()),
        scale(1.0f / static_cast<float>(n)),
        red(*comm.reducer),
        wire(numel > 0 ? reinterpret_cast<uint16_t*>(comm.scratchBytes(1, static_cast<size_t>(numel) * 2)) : nullptr),
        ph(ctx.phases ? *ctx.phases : dummy) {
    ph.algorithm = algorithm;
  }
  // wire = bf16(x/N + r_in) for all numel elements, r_out = the rounding error.
  void encodeAll(const float* x, const float* r_in, float* r_out, int64_t numel) {
    auto t0 = Clock::now();
    red.encodeEF(x, scale, r_in, r_out, wire, numel);
    ph.encode_s += since(t0);
  }
  // x = f32(wire), all numel elements.
  void decodeAll(float* x, int64_t numel) {
    auto t0 = Clock::now();
    red.decode(wire, x, numel);
    ph.decode_s += since(t0);
  }
  const int n;
  const float scale;
  algo::Reducer& red;
  uint16_t* const wire;
  Phases dummy;
  Phases& ph;
};
}  // namespace

void allreduceBF16EF(const Comm& comm, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t numel) {
  EFRun run(comm, ctx, numel, "ring_bf16_ef");
  const int n = run.n;
  const float scale = run.scale;
  algo::Reducer& red = run.red;
  uint16_t* wire = run.wire;
  Phases& ph = run.ph;
  if (n <= 1 || numel == 0) {
    run.encodeAll(x, r_in, r_out, numel);
    run.decodeAll(x, numel);
    return;
  }
  const int pos = comm.position();
  const auto chunks = ring::partition(numel, n);
  // First hop: this position starts chunk ring::scatterReduceStep(pos, n, 0).send_chunk.
  auto t0 = Clock::now();
  {
    const auto& c = chunks[static_cast<size_t>(ring::scatterReduceStep(pos, n, 0).send_chunk)];
    red.encodeEF(x + c.offset, scale, r_in + c.offset, r_out + c.offset, wire + c.offset, c.count);
  }
  ph.encode_s += since(t0);
  const auto chunk = partitionChunks(reinterpret_cast<uint8_t*>(wire), chunks, 2);
  auto t1 = Clock::now();
  double hop_codec_s = 0;
  algo::scatterReduce(comm, ctx, 2, chunk, [&](int c, uint64_t off, const void* seg, uint64_t bytes) {
    auto tc = Clock::now();
    const int64_t at = chunks[static_cast<size_t>(c)].offset + static_cast<int64_t>(off / 2);
    // Partial sum so far + this rank's x/N + residual, re-encoded; the rounding error of this
    // hop becomes this rank's residual for these elements (every rounding is fed back).
    red.accumulateEncodeEF(static_cast<const uint16_t*>(seg), x + at, scale, r_in + at, r_out + at, wire + at,
                           static_cast<int64_t>(bytes / 2));
    hop_codec_s += since(tc);
  });
  auto t2 = Clock::now();
  algo::allgather(comm, ctx, 2, chunk);
  auto t3 = Clock::now();
  // Every rank, the owner included, decodes the same bf16 values: replicas are bitwise equal.
  red.decode(wire, x, numel);
  ph.decode_s += since(t3);
  ph.encode_s += hop_codec_s;
  ph.scatter_reduce_s += between(t1, t2) - hop_codec_s;
  ph.allgather_s += between(t2, t3);
}

namespace {
// allreduceEFDirect with s = x*scale + r_in at the sender (1/N: the average; 1: the sum).
void efDirect(const Comm& comm, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t numel,
              codec::Wire w, float scale) {
  static const char* const kNames[] = {"direct_bf16_ef", "direct_fp16_ef", "direct_int8_ef"};
  EFRun run(comm, ctx, 0, kNames[static_cast<int>(w)]);
  const int n = run.n;
  algo::Reducer& red = run.red;
  Phases& ph = run.ph;
  const auto chunks = ring::partition(numel, std::max(n, 1));
  // The wire buffer, scratch slot 1: block q holds chunk q (codes, then scales).
  uint64_t bytes = 0;
  for (const auto& c : chunks) bytes += codec::blockBytes(w, c.count);
  const auto blocks = ownerBlocks(comm.scratchBytes(1, static_cast<size_t>(bytes)), chunks, w);
  auto forEachBlock = [&](auto&& f) {
    for (size_t q = 0; q < chunks.size(); ++q) f(chunks[q], blocks[q].data);
  };
  auto t0 = Clock::now();
  // The sender's rounding, fed back through r_out.
  forEachBlock([&](const ring::Range& c, void* b) {
    red.encodeBlockEF(w, x + c.offset, scale, r_in + c.offset, r_out + c.offset, static_cast<uint8_t*>(b), c.count);
  });
  ph.encode_s += since(t0);
  auto decodeAll = [&] {
    auto t = Clock::now();
    forEachBlock([&](const ring::Range& c, void* b) {
      red.decodeBlock(w, static_cast<const uint8_t*>(b), x + c.offset, c.count);
    });
    ph.decode_s += since(t);
  };
  if (n <= 1) {
    decodeAll();
    return;
  }
  const auto& mine = chunks[static_cast<size_t>(comm.position())];
  const uint64_t mine_bytes = blocks[static_cast<size_t>(comm.position())].bytes;
  auto t1 = Clock::now();
  // aux 2 for bf16 (as before), 12 for fp16, 22 for int8: ranks on different formats are told.
  const uint8_t* slots = sendToOwners(comm, ctx, blocks, 2 + 10 * static_cast<uint64_t>(w));
  auto t2 = Clock::now();
  // fp32 sum in rank order (the same operands in the same order on every path), one rounding.
  float* acc = reinterpret_cast<float*>(comm.scratchBytes(3, static_cast<size_t>(mine.count) * 4));
  red.decodeBlock(w, slots, acc, mine.count);
  for (int k = 1; k < n; ++k) red.decodeAccumulateBlock(w, slots + mine_bytes * static_cast<uint64_t>(k), acc, mine.count);
  red.encodeBlockEF(w, acc, 1.0f, r_out + mine.offset, r_out + mine.offset,
                    static_cast<uint8_t*>(blocks[static_cast<size_t>(comm.position())].data), mine.count);
  auto t3 = Clock::now();
  allgatherFromOwners(comm, ctx, blocks);
  auto t4 = Clock::now();
  // Every rank, the owner included, decodes the same blocks: replicas are bitwise equal.
  decodeAll();
  ph.encode_s += between(t2, t3);
  ph.scatter_reduce_s += between(t1, t2);
  ph.allgather_s += between(t3, t4);
}
}  // namespace

void allreduceEFDirect(const Comm& comm, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t numel,
                       codec::Wire w) {
  efDirect(comm, ctx, x, r_in, r_out, numel, w, 1.0f / static_cast<float>(std::max(comm.size(), 1)));
}

bool efTwoLevel(const Comm& comm, int64_t n, codec::Wire w) {
  return allreduceAlgo(comm, n, DType::Float32) == Comm::Algo::TwoLevel &&
         (w != codec::Wire::BF16 || comm.algo == Comm::Algo::TwoLevel);
}

const HostLevel& linkHostLevel() {
  static const HostLevel link{
      [](const Comm& local, const OpCtx& ctx, const std::vector<RecvSeg>& blocks) {
        reduceScatter(local, ctx, blocks, DType::Float32, ReduceOp::Sum);
      },
      [](const Comm& local, const OpCtx& ctx, const std::vector<RecvSeg>& blocks) { allgather(local, ctx, blocks); }};
  return link;
}

void allreduceEFTwoLevel(const Comm& comm, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t n,
                         codec::Wire w, const HostLevel& host) {
  algo::Reducer& red = *comm.reducer;
  // v = x/N + r_in, in place (x*scale, then + r_in: the encoders' s); r_in is consumed here, so
  // r_out (which may alias it) can be cleared: only this rank's shard gets new roundings. r_out
  // is cleared as 0 x r_in (a committed residual is finite), not from its own stale contents,
  // which a skipped step may have left non-finite.
  red.scale(x, n, DType::Float32, 1.0 / static_cast<double>(comm.size()));
  red.reduceInto(x, r_in, n, DType::Float32, ReduceOp::Sum);
  if (r_out != r_in) red.copy(r_out, r_in, static_cast<uint64_t>(n) * 4);
  red.scale(r_out, n, DType::Float32, 0.0);
  TwoLevelSplit s = twoLevelSplit(comm, x, n, DType::Float32);
  host.reduce_scatter_sum(s.local, ctx, s.blocks);
  float* shard = reinterpret_cast<float*>(s.shard);
  float* r_shard = r_out + (shard - x);
  efDirect(s.cross, ctx, shard, r_shard, r_shard, s.shard_numel, w, 1.0f);
  host.allgather(s.local, ctx, s.blocks);
  if (ctx.phases) {
    static const char* const kNames[] = {"two_level_bf16_ef", "two_level_fp16_ef", "two_level_int8_ef"};
    ctx.phases->algorithm = kNames[static_cast<int>(w)];
  }
}

}  // namespace xirang
