// The shared-memory collectives (shm.h): one piece loop (runPieces) that every collective is
// made of, one routine that reduces a lane from all its copies (reduceLane), shared by
// allreduce and reduce-scatter. Data work goes through the comm's reducer.
#include "core/algorithms/shm.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>

#include "core/algorithms/loops.h"
#include "core/planner.h"
#include "core/ring.h"

namespace xirang::shm {

namespace {

using algo::between;
using algo::since;

// The algorithm in an op's record, so that ranks that would combine in different orders (other
// XIRANG_SMALL_BYTES or XIRANG_ALGO) are told instead of computing different bits.
enum Variant : uint64_t { kMove = 1, kRankOrder = 2, kRingOrder = 3, kCombine16 = 4 };
const char* variantName(uint64_t v) {
  switch (v) {
    case kMove: return "data movement";
    case kRankOrder: return "rank-order reduction (direct exchange)";
    case kRingOrder: return "ring-order reduction (ring)";
    case kCombine16: return "16-bit reduction in fp32 (allreduce16)";
    default: return "unknown";
  }
}

// A reduction's bytes are worked on in blocks this long, so that the n-1 passes of a lane's
// fold read and write cache instead of memory.
constexpr uint64_t kFoldBlockBytes = 16 << 10;

// dst = src * scale (elements of t; scale 1: a copy): the reducer's copy and then its scale() a
// block at a time, so the scaling costs no pass over memory of its own.
void copyScaled(algo::Reducer& red, uint8_t* dst, const uint8_t* src, uint64_t bytes, DType t, double scale) {
  if (scale == 1.0) return red.copy(dst, src, bytes);
  const size_t elem = elementSize(t);
  const uint64_t block = std::max<uint64_t>(elem, kFoldBlockBytes / elem * elem);
  for (uint64_t b = 0; b < bytes; b += block) {
    const uint64_t len = std::min(block, bytes - b);
    red.copy(dst + b, src + b, len);
    red.scale(dst + b, static_cast<int64_t>(len / elem), t, scale);
  }
}

// The comm seen from the domain: local indices (= rank order, d.ranks() is sorted) and ring
// positions of the same ranks.
struct Local {
  const Comm& comm;
  ShmDomain& d;
  int n;
  int me;                          // local index
  std::vector<int> index_at_pos;   // local index of the rank at ring position p
  std::vector<int> pos_of_index;   // ring position of local index j
  algo::Reducer& red;
};

bool covers(const std::vector<int>& ranks, const ShmDomain& d) {
  std::vector<int> s = ranks;
  std::sort(s.begin(), s.end());
  return s == d.ranks();
}

Local localView(const Comm& comm, ShmDomain& d, const char* op) {
  const std::string where = std::string("xirang: ") + op + " over shared memory: ";
  if (comm.rank != d.rank())
    throw std::invalid_argument(where + "the comm is rank " + std::to_string(comm.rank) + "'s, the domain rank " +
                                std::to_string(d.rank()) + "'s");
  if (!covers(comm.ring, d)) throw std::invalid_argument(where + "the comm's ring is not the domain's local ranks");
  if (comm.reducer->memory() != transport::Memory::Host)
    throw std::invalid_argument(where + "the reducer does not work on host memory");
  Local L{comm, d, d.size(), d.index(), {}, {}, *comm.reducer};
  L.index_at_pos.resize(static_cast<size_t>(L.n));
  L.pos_of_index.resize(static_cast<size_t>(L.n));
  for (int p = 0; p < L.n; ++p) {
    const int j = d.indexOf(comm.ring[static_cast<size_t>(p)]);
    L.index_at_pos[static_cast<size_t>(p)] = j;
    L.pos_of_index[static_cast<size_t>(j)] = p;
  }
  return L;
}

int rootIndex(const Local& L, int root, const char* op) {
  const int j = L.d.indexOf(root);
  if (j < 0)
    throw std::invalid_argument(std::string("xirang: ") + op + " over shared memory: root " + std::to_string(root) +
                                " is not a member");
  return j;
}

// Bytes [k * cap, (k + 1) * cap) of a `total`-byte range: the part that piece k moves.
struct Window {
  uint64_t off = 0, bytes = 0;
};
Window window(uint64_t total, int64_t k, uint64_t cap) {
  Window w;
  w.off = static_cast<uint64_t>(k) * cap;
  w.bytes = w.off < total ? std::min(cap, total - w.off) : 0;
  return w;
}

// One collective as the piece loop runs it. For piece k = 0, 1, ...:
//   in(k)    this rank's writes into the segment (returns the bytes written);   barrier
//   mid(k)   reads of what the others wrote (and, for reductions, the results); barrier
//   out(k)   reads of the results (may be empty).
// No piece needs double buffers. A barrier separates every write of a byte from every read of
// it, and mid(k)'s reads from in(k+1)'s writes. out(k) has no barrier after it: it reads piece
// k's results, which in(k+1) cannot reach (a lane's piece writes its copies below the place of
// its result, and pieces never grow), and which mid(k+1) overwrites only after the barrier that
// follows every rank's in(k+1). Across operations, a plan with out() arrives when done and every
// operation settles before its first write (ShmDomain::arrive / settle), so a fast rank's next
// operation never overwrites the results a slow rank is still copying out. Without mid, a
// piece is in(k) and one barrier (barrier()).
// The pieces: enough that the largest send (sizes: each rank's bytes to every rank, and from
// every rank) fits in `cap` bytes per piece; at least one, so even an empty op is checked.
struct Plan {
  const char* name;
  uint64_t variant = kMove;
  uint64_t cap = 1;
  uint64_t aux = 0;  // the record's aux: a rooted op's root, as the engine's agreement frame has it
  std::function<void(uint64_t* send, uint64_t* recv)> sizes;  // 2 x n words, zeroed; may be empty
  std::function<uint64_t(int64_t)> in;
  std::function<void(int64_t)> mid;
  std::function<void(int64_t)> out;
  double* out_seconds = nullptr;  // time spent in out(), for the phases
};

std::string bytesOf(uint64_t v) { return std::to_string(v) + " bytes"; }

// After the first barrier: every rank's record against this rank's. Throws MismatchError on
// every local rank (they all see the same records) before any rank reads data.
void checkRecords(const Local& L, int parity, const char* name) {
  const ShmDomain& d = L.d;
  const auto& mine = d.record(L.me, parity);
  std::string problems;
  int first = -1;
  int listed = 0;
  auto add = [&](const std::string& s, int rank) {
    if (first < 0) first = rank;
    if (listed++ < 6) problems += (problems.empty() ? "" : "; ") + s;
  };
  for (int j = 0; j < L.n; ++j) {
    if (j == L.me) continue;
    const int r = d.ranks()[static_cast<size_t>(j)];
    const auto& other = d.record(j, parity);
    std::string diff = transport::compareHeader(mine.header, other.header, r);
    if (diff.empty() && other.variant != mine.variant)
      diff = std::string("algorithm mismatch: this rank ") + variantName(mine.variant) + ", rank " + std::to_string(r) +
             " " + variantName(other.variant) + " (XIRANG_SMALL_BYTES or XIRANG_ALGO differ?)";
    if (!diff.empty()) add(diff, r);
  }
  if (first < 0) {
    const uint64_t n = static_cast<uint64_t>(L.n);
    for (int i = 0; i < L.n; ++i) {
      const uint64_t* si = d.sizes(i, parity);
      for (int j = 0; j < L.n; ++j) {
        const uint64_t send = si[j], recv = d.sizes(j, parity)[n + static_cast<uint64_t>(i)];
        if (send != recv)
          add("size mismatch: rank " + std::to_string(d.ranks()[static_cast<size_t>(i)]) + " sends " + bytesOf(send) +
                  " to rank " + std::to_string(d.ranks()[static_cast<size_t>(j)]) + ", which expects " + bytesOf(recv),
              d.ranks()[static_cast<size_t>(i)]);
      }
    }
  }
  if (first >= 0)
    throw transport::MismatchError(std::string("xirang: ") + name + " over shared memory: " + problems +
                                       (listed > 6 ? " (and " + std::to_string(listed - 6) + " more)" : ""),
                                   first);
}

void runPieces(const Local& L, const OpCtx& ctx, const Plan& p) {
  ShmDomain& d = L.d;
  const int parity = static_cast<int>(d.nextOp() & 1);
  auto& rec = d.record(L.me, parity);
  if (p.name == nullptr || !p.in) throw std::logic_error("xirang: shared memory: incomplete plan");
  rec.header = algo::headerFor(ctx, p.aux);
  rec.variant = p.variant;
  const uint64_t n = static_cast<uint64_t>(L.n);
  uint64_t* sizes = d.sizes(L.me, parity);
  std::fill(sizes, sizes + 2 * n, uint64_t{0});
  if (p.sizes) p.sizes(sizes, sizes + n);
  const auto t0 = Clock::now();
  // The previous operation's last reads (an allreduce's copy-out) are done on every rank.
  d.settle(ctx.deadline, p.name);
  uint64_t wrote = 0;
  int64_t pieces = 1;
  for (int64_t k = 0; k < pieces; ++k) {
    const uint64_t w = p.in(k);
    wrote += w;
    transport::dieAfterSegmentsHook(L.comm.rank, w);
    d.barrier(ctx.deadline, p.name);
    if (k == 0) {
      checkRecords(L, parity, p.name);
      uint64_t most = 0;
      for (int i = 0; i < L.n; ++i) {
        const uint64_t* si = d.sizes(i, parity);
        most = std::max(most, *std::max_element(si, si + n));
      }
      pieces = std::max<int64_t>(1, static_cast<int64_t>((most + p.cap - 1) / p.cap));
    }
    if (!p.mid) continue;
    p.mid(k);
    d.barrier(ctx.deadline, p.name);
    if (p.out) {
      const auto t1 = Clock::now();
      p.out(k);
      if (p.out_seconds) *p.out_seconds += since(t1);
    }
  }
  // out() of the last piece read the segment after the last barrier: the next operation's
  // first write waits for every rank's arrival here (ShmDomain::settle).
  if (p.out) d.arrive();
  if (ctx.phases) {
    ctx.phases->bytes_shm += wrote;
    ctx.phases->scatter_reduce_s += since(t0) - (p.out_seconds ? *p.out_seconds : 0.0);
    ctx.phases->allgather_s += p.out_seconds ? *p.out_seconds : 0.0;
  }
}

// How local rank j combines the n copies of its lane.
struct Fold {
  uint64_t variant = kRankOrder;
  int start = 0;  // kRingOrder: the ring position whose input comes first
  DType t = DType::Float32;
  ReduceOp op = ReduceOp::Sum;
  float pre = 1.0f, post = 1.0f;  // kCombine16
};

// The lane's `count` elements of `elem` bytes: copy k (k = local index, i.e. rank order) at
// area + k * count * elem, except this rank's own copy when `own` is given: then it is read (and
// may be clobbered) at `own`, each block first scaled by `own_scale` (the reducer's scale(), as
// the others' copies were on their way in), and every block of the result is also written back
// over it once that block is folded (an allreduce's own lane: the result is what the rank's buffer ends with,
// written while it is in cache instead of copied out of the segment later). Writes the result to
// `out` (which must not overlap the copies). The ring order clobbers the copies (nobody else
// reads this lane's slot before the next barrier).
//   kRankOrder: out = x_0; out = op(out, x_k) for k = 1..n-1     (directAllreduce's roles)
//   kRingOrder: a = x_p(s); a = op(x_p(s+i), a) for i = 1..n-1   (the ring scatter-reduce's
//               roles: the receiving position's own input is the destination)
//   kCombine16: combine16 in rank order with pre / post scaling    (allreduce16; no `own`)
void reduceLane(const Local& L, const Fold& f, uint8_t* area, int64_t count, uint8_t* out, uint8_t* own = nullptr,
                double own_scale = 1.0) {
  if (count <= 0) return;
  const size_t elem = elementSize(f.t);
  const int n = L.n;
  const uint64_t stride = static_cast<uint64_t>(count) * elem;
  auto copyOf = [&](int k) { return own != nullptr && k == L.me ? own : area + stride * static_cast<uint64_t>(k); };
  if (f.variant == kCombine16) {
    if (own != nullptr) throw std::logic_error("xirang: shared memory: combine16 reads its copies from the slot");
    L.red.combine16(reinterpret_cast<const uint16_t*>(area), n, count, f.t, f.op, f.pre, f.post,
                    reinterpret_cast<uint16_t*>(out));
    return;
  }
  const uint64_t block = std::max<uint64_t>(elem, kFoldBlockBytes / elem * elem);
  for (uint64_t b = 0; b < stride; b += block) {
    const uint64_t bytes = std::min(block, stride - b);
    const int64_t cnt = static_cast<int64_t>(bytes / elem);
    if (own != nullptr && own_scale != 1.0) L.red.scale(own + b, cnt, f.t, own_scale);  // read first here
    if (f.variant == kRankOrder || n == 1) {
      L.red.copy(out + b, copyOf(0) + b, bytes);
      for (int k = 1; k < n; ++k) L.red.reduceInto(out + b, copyOf(k) + b, cnt, f.t, f.op);
    } else {
      auto at = [&](int i) { return copyOf(L.index_at_pos[static_cast<size_t>((f.start + i) % n)]) + b; };
      uint8_t* acc = at(0);
      for (int i = 1; i < n - 1; ++i) {
        L.red.reduceInto(at(i), acc, cnt, f.t, f.op);
        acc = at(i);
      }
      L.red.copy(out + b, at(n - 1), bytes);
      L.red.reduceInto(out + b, acc, cnt, f.t, f.op);
    }
    if (own != nullptr) L.red.copy(own + b, out + b, bytes);  // block b of `own` is read no more
  }
}

// The reduction of allreduce and reduce-scatter. Lane j: lanes[j] (in this rank's buffer,
// elements of fold.t), reduced by local index j with folds[j]. Its slot holds, per piece, the n
// copies of the piece's part of the lane and then the result. allreduce (gather_all): every
// lane's result is copied back into lanes[j]; reduce-scatter: lane `me`'s result goes straight
// into lanes[me] and the other lanes are left alone.
// An allreduce that folds copies one at a time (not combine16) leaves this rank's own part of
// its own lane in its buffer: the fold reads it there and writes the result back over it block
// by block (reduceLane's `own`), so that part is neither copied into the segment nor copied back
// out of it: at n = 2 a rank's memory traffic per byte of message goes from 5.5 bytes (copy in 2,
// fold 1.5, copy out 2) to 4 (1, 2, 1).
void reduceLanes(const Local& L, const OpCtx& ctx, const char* name, const std::vector<RecvSeg>& lanes,
                 const std::vector<Fold>& folds, bool gather_all, double scale = 1.0) {
  ShmDomain& d = L.d;
  const int n = L.n;
  const size_t elem = elementSize(folds[0].t);
  const bool own_in_place = gather_all && folds[static_cast<size_t>(L.me)].variant != kCombine16;
  if (scale != 1.0 && folds[static_cast<size_t>(L.me)].variant == kCombine16)
    throw std::logic_error("xirang: shared memory: combine16 scales in its fold");
  // Per piece and lane: n copies and the result, 64-byte aligned, in one slot.
  const uint64_t cap = (d.slotBytes() / static_cast<uint64_t>(n + 1)) / 64 * 64;
  auto counts = [&](int j, int64_t k, Window* w) {
    *w = window(lanes[static_cast<size_t>(j)].bytes, k, cap);
    return static_cast<int64_t>(w->bytes / elem);
  };
  double out_s = 0;
  Plan p;
  p.name = name;
  p.variant = folds[static_cast<size_t>(L.me)].variant;
  p.cap = cap;
  p.out_seconds = &out_s;
  // Rank i sends its part of lane j to j; j expects the size of its own lane from everyone.
  p.sizes = [&](uint64_t* send, uint64_t* recv) {
    for (int j = 0; j < n; ++j) {
      send[j] = lanes[static_cast<size_t>(j)].bytes;
      recv[j] = lanes[static_cast<size_t>(L.me)].bytes;
    }
  };
  p.in = [&](int64_t k) {
    uint64_t wrote = 0;
    for (int j = 0; j < n; ++j) {
      if (own_in_place && j == L.me) continue;
      Window w;
      const int64_t c = counts(j, k, &w);
      const uint64_t stride = static_cast<uint64_t>(c) * elem;
      copyScaled(L.red, d.slot(j) + stride * static_cast<uint64_t>(L.me),
                 static_cast<uint8_t*>(lanes[static_cast<size_t>(j)].data) + w.off, w.bytes, folds[0].t, scale);
      wrote += w.bytes;
    }
    return wrote;
  };
  p.mid = [&](int64_t k) {
    Window w;
    const int64_t c = counts(L.me, k, &w);
    uint8_t* mine = static_cast<uint8_t*>(lanes[static_cast<size_t>(L.me)].data) + w.off;
    uint8_t* result = gather_all ? d.slot(L.me) + static_cast<uint64_t>(c) * elem * static_cast<uint64_t>(n) : mine;
    reduceLane(L, folds[static_cast<size_t>(L.me)], d.slot(L.me), c, result, own_in_place ? mine : nullptr, scale);
  };
  if (gather_all) {
    p.out = [&](int64_t k) {
      for (int j = 0; j < n; ++j) {
        if (own_in_place && j == L.me) continue;  // written back by the fold
        Window w;
        const int64_t c = counts(j, k, &w);
        L.red.copy(static_cast<uint8_t*>(lanes[static_cast<size_t>(j)].data) + w.off,
                   d.slot(j) + static_cast<uint64_t>(c) * elem * static_cast<uint64_t>(n), w.bytes);
      }
    };
  }
  runPieces(L, ctx, p);
}

// Lanes = the ring's chunks of a contiguous buffer (lane j = chunk j).
std::vector<RecvSeg> chunkLanes(void* data, int64_t numel, int n, size_t elem) {
  std::vector<RecvSeg> lanes;
  for (const auto& r : ring::partition(numel, n))
    lanes.push_back(RecvSeg{static_cast<uint8_t*>(data) + static_cast<uint64_t>(r.offset) * elem,
                            static_cast<uint64_t>(r.count) * elem});
  return lanes;
}

void setAlgorithm(const OpCtx& ctx, const char* name) {
  if (ctx.phases) ctx.phases->algorithm = name;
}

// `scale`: every input times it first (scaled_native's contract), fused into the copies.
void localAllreduce(const Local& L, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op,
                    double scale = 1.0) {
  const bool ring = allreduceAlgo(L.comm, numel, wire) != Comm::Algo::Direct;
  std::vector<Fold> folds(static_cast<size_t>(L.n));
  for (int j = 0; j < L.n; ++j) {
    Fold& f = folds[static_cast<size_t>(j)];
    f.variant = ring ? kRingOrder : kRankOrder;
    f.start = j;  // ring chunk j starts at ring position j (ring::scatterReduceStep)
    f.t = wire;
    f.op = op;
  }
  reduceLanes(L, ctx, "allreduce", chunkLanes(data, numel, L.n, elementSize(wire)), folds, true, scale);
  setAlgorithm(ctx, ring ? "shm_ring_order" : "shm_rank_order");
}

// Blocks by group rank -> by local index.
template <typename Seg>
std::vector<Seg> byIndex(const Local& L, const std::vector<Seg>& by_rank, const char* op) {
  std::vector<Seg> out;
  for (int r : L.d.ranks()) {
    if (r < 0 || static_cast<size_t>(r) >= by_rank.size())
      throw std::invalid_argument(std::string("xirang: ") + op + " over shared memory: no block for rank " +
                                  std::to_string(r));
    out.push_back(by_rank[static_cast<size_t>(r)]);
  }
  return out;
}

}  // namespace

void allreduce(const Comm& comm, ShmDomain& d, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op) {
  if (comm.size() <= 1) return;
  if (covers(comm.ring, d)) {
    localAllreduce(localView(comm, d, "allreduce"), ctx, data, numel, wire, op);
    return;
  }
  if (allreduceAlgo(comm, numel, wire) != Comm::Algo::TwoLevel || !covers(comm.local_group, d)) {
    xirang::allreduce(comm, ctx, data, numel, wire, op);
    return;
  }
  // Two-level, as twoLevelAllreduce (collectives.h) with the host's steps over shared memory.
  TwoLevelSplit s = twoLevelSplit(comm, data, numel, wire);
  reduceScatter(s.local, d, ctx, s.blocks, wire, op);
  xirang::allreduce(s.cross, ctx, s.shard, s.shard_numel, wire, op);
  allgather(s.local, d, ctx, s.blocks);
  setAlgorithm(ctx, "shm_two_level");
}

void allreduce16(const Comm& comm, ShmDomain& d, const OpCtx& ctx, uint16_t* data, int64_t numel, DType t, ReduceOp op,
                 float pre_scale, float post_scale) {
  if (t != DType::Float16 && t != DType::BFloat16)
    throw std::invalid_argument(std::string("xirang: allreduce16 takes float16 or bfloat16, not ") + dtypeName(t));
  if (comm.size() <= 1 || !covers(comm.ring, d)) {
    xirang::allreduce16(comm, ctx, data, numel, t, op, pre_scale, post_scale);  // one rank: only the scaling
    return;
  }
  const Local L = localView(comm, d, "allreduce");
  std::vector<Fold> folds(static_cast<size_t>(L.n));
  for (auto& f : folds) {
    f.variant = kCombine16;
    f.t = t;
    f.op = op;
    f.pre = pre_scale;
    f.post = post_scale;
  }
  reduceLanes(L, ctx, "allreduce", chunkLanes(data, numel, L.n, 2), folds, true);
  setAlgorithm(ctx, "shm_direct16");
}

void allreduceOp(const Comm& comm, ShmDomain& d, const OpCtx& ctx, void* data, int64_t numel, DType dtype, ReduceOp op,
                 double premul) {
  AllreduceImpl impl;
  impl.native = [&](void* x, int64_t n, DType wire, ReduceOp o) { allreduce(comm, d, ctx, x, n, wire, o); };
  if (comm.size() > 1 && covers(comm.ring, d)) {  // one host: the scaling rides on the copies in
    impl.scaled_native = [&](void* x, int64_t n, DType wire, ReduceOp o, double scale) {
      localAllreduce(localView(comm, d, "allreduce"), ctx, x, n, wire, o, scale);
    };
  }
  impl.direct16 = [&](uint16_t* x, int64_t n, DType t, ReduceOp o, float pre, float post) {
    allreduce16(comm, d, ctx, x, n, t, o, pre, post);
  };
  xirang::allreduceOp(comm, impl, data, numel, dtype, op, premul);
}

void reduceScatter(const Comm& comm, ShmDomain& d, const OpCtx& ctx, const std::vector<RecvSeg>& blocks, DType wire,
                   ReduceOp op) {
  if (comm.size() <= 1) return;
  const Local L = localView(comm, d, "reduce_scatter");
  std::vector<Fold> folds(static_cast<size_t>(L.n));
  for (int j = 0; j < L.n; ++j) {
    Fold& f = folds[static_cast<size_t>(j)];
    f.variant = kRingOrder;
    // The ring's chunk c is the block of ring[c-1] (loops.h: blockChunks), and starts at
    // position c: the block of the rank at position p starts at p + 1.
    f.start = (L.pos_of_index[static_cast<size_t>(j)] + 1) % L.n;
    f.t = wire;
    f.op = op;
  }
  reduceLanes(L, ctx, "reduce_scatter", byIndex(L, blocks, "reduce_scatter"), folds, false);
  setAlgorithm(ctx, "shm_ring_order");
}

void allgather(const Comm& comm, ShmDomain& d, const OpCtx& ctx, const std::vector<RecvSeg>& blocks) {
  if (comm.size() <= 1) return;
  const Local L = localView(comm, d, "allgather");
  const auto lanes = byIndex(L, blocks, "allgather");
  const int n = L.n;
  Plan p;
  p.name = "allgather";
  p.cap = d.slotBytes();
  p.sizes = [&](uint64_t* send, uint64_t* recv) {
    for (int j = 0; j < n; ++j) {
      send[j] = j == L.me ? 0 : lanes[static_cast<size_t>(L.me)].bytes;
      recv[j] = j == L.me ? 0 : lanes[static_cast<size_t>(j)].bytes;
    }
  };
  p.in = [&](int64_t k) {
    const Window w = window(lanes[static_cast<size_t>(L.me)].bytes, k, p.cap);
    L.red.copy(d.slot(L.me), static_cast<uint8_t*>(lanes[static_cast<size_t>(L.me)].data) + w.off, w.bytes);
    return w.bytes;
  };
  p.mid = [&](int64_t k) {
    for (int j = 0; j < n; ++j) {
      if (j == L.me) continue;
      const Window w = window(lanes[static_cast<size_t>(j)].bytes, k, p.cap);
      L.red.copy(static_cast<uint8_t*>(lanes[static_cast<size_t>(j)].data) + w.off, d.slot(j), w.bytes);
    }
  };
  runPieces(L, ctx, p);
  setAlgorithm(ctx, "shm");
}

void broadcast(const Comm& comm, ShmDomain& d, const OpCtx& ctx, void* data, uint64_t bytes, int root) {
  if (comm.size() <= 1) return;
  const Local L = localView(comm, d, "broadcast");
  const int ri = rootIndex(L, root, "broadcast");
  Plan p;
  p.name = "broadcast";
  p.aux = algo::kCheckBit | static_cast<uint64_t>(root);
  p.cap = d.dataBytes();  // only the root writes: every slot holds one piece
  p.sizes = [&](uint64_t* send, uint64_t* recv) {
    for (int j = 0; j < L.n; ++j) {
      if (L.me == ri && j != ri) send[j] = bytes;
      if (L.me != ri && j == ri) recv[j] = bytes;
    }
  };
  p.in = [&](int64_t k) {
    if (L.me != ri) return uint64_t{0};
    const Window w = window(bytes, k, p.cap);
    L.red.copy(d.slot(0), static_cast<uint8_t*>(data) + w.off, w.bytes);
    return w.bytes;
  };
  p.mid = [&](int64_t k) {
    if (L.me == ri) return;
    const Window w = window(bytes, k, p.cap);
    L.red.copy(static_cast<uint8_t*>(data) + w.off, d.slot(0), w.bytes);
  };
  runPieces(L, ctx, p);
  setAlgorithm(ctx, "shm");
}

void alltoall(const Comm& comm, ShmDomain& d, const OpCtx& ctx, const std::vector<SendSeg>& sends,
              const std::vector<RecvSeg>& recvs) {
  const Local L = localView(comm, d, "alltoall");
  const auto out = byIndex(L, sends, "alltoall");
  const auto in = byIndex(L, recvs, "alltoall");
  const int n = L.n;
  const size_t me = static_cast<size_t>(L.me);
  if (in[me].bytes != out[me].bytes)
    throw std::invalid_argument("xirang: alltoall: rank " + std::to_string(comm.rank) + " sends itself " +
                                std::to_string(out[me].bytes) + " bytes but expects " + std::to_string(in[me].bytes));
  L.red.copy(in[me].data, out[me].data, in[me].bytes);
  if (n <= 1) return;
  Plan p;
  p.name = "alltoall";
  p.cap = std::max<uint64_t>(64, d.slotBytes() / static_cast<uint64_t>(n) / 64 * 64);  // slot j: one part per sender
  p.sizes = [&](uint64_t* send, uint64_t* recv) {
    for (int j = 0; j < n; ++j) {
      if (j == L.me) continue;
      send[j] = out[static_cast<size_t>(j)].bytes;
      recv[j] = in[static_cast<size_t>(j)].bytes;
    }
  };
  p.in = [&](int64_t k) {
    uint64_t wrote = 0;
    for (int j = 0; j < n; ++j) {
      if (j == L.me) continue;
      const Window w = window(out[static_cast<size_t>(j)].bytes, k, p.cap);
      L.red.copy(d.slot(j) + p.cap * me, static_cast<const uint8_t*>(out[static_cast<size_t>(j)].data) + w.off, w.bytes);
      wrote += w.bytes;
    }
    return wrote;
  };
  p.mid = [&](int64_t k) {
    for (int i = 0; i < n; ++i) {
      if (i == L.me) continue;
      const Window w = window(in[static_cast<size_t>(i)].bytes, k, p.cap);
      L.red.copy(static_cast<uint8_t*>(in[static_cast<size_t>(i)].data) + w.off,
                 d.slot(L.me) + p.cap * static_cast<uint64_t>(i), w.bytes);
    }
  };
  // The ranks' element counts differ with uneven splits (the engine's frames carry each pair's
  // block size instead): the record's sizes table checks every pair, its header the rest.
  OpCtx pairwise = ctx;
  pairwise.numel = 0;
  runPieces(L, pairwise, p);
  setAlgorithm(ctx, "shm");
}

namespace {

// Gather (to_root) and scatter: rank j's block travels through slot j.
void rooted(const Comm& comm, ShmDomain& d, const OpCtx& ctx, int root, bool to_root, RecvSeg mine,
            const std::vector<RecvSeg>& blocks_by_rank, const char* name) {
  const Local L = localView(comm, d, name);
  const int ri = rootIndex(L, root, name);
  const bool at_root = L.me == ri;
  std::vector<RecvSeg> blocks;
  if (at_root) {
    blocks = byIndex(L, blocks_by_rank, name);
    const RecvSeg own = blocks[static_cast<size_t>(ri)];
    if (own.bytes != mine.bytes)
      throw std::invalid_argument(std::string("xirang: ") + name + ": root " + std::to_string(root) + "'s own block is " +
                                  std::to_string(own.bytes) + " bytes, its tensor " + std::to_string(mine.bytes));
    L.red.copy(to_root ? own.data : mine.data, to_root ? mine.data : own.data, own.bytes);
  }
  if (L.n <= 1) return;
  Plan p;
  p.name = name;
  p.aux = algo::kCheckBit | static_cast<uint64_t>(root);
  p.cap = d.slotBytes();
  p.sizes = [&](uint64_t* send, uint64_t* recv) {
    for (int j = 0; j < L.n; ++j) {
      if (j == L.me) continue;
      // to_root: rank j sends mine to the root; scatter: the root sends blocks[j] to j.
      if (to_root && j == ri) send[j] = mine.bytes;
      if (to_root && at_root) recv[j] = blocks[static_cast<size_t>(j)].bytes;
      if (!to_root && at_root) send[j] = blocks[static_cast<size_t>(j)].bytes;
      if (!to_root && j == ri) recv[j] = mine.bytes;
    }
  };
  p.in = [&](int64_t k) {
    uint64_t wrote = 0;
    if (to_root && !at_root) {
      const Window w = window(mine.bytes, k, p.cap);
      L.red.copy(d.slot(L.me), static_cast<uint8_t*>(mine.data) + w.off, w.bytes);
      wrote = w.bytes;
    } else if (!to_root && at_root) {
      for (int j = 0; j < L.n; ++j) {
        if (j == ri) continue;
        const Window w = window(blocks[static_cast<size_t>(j)].bytes, k, p.cap);
        L.red.copy(d.slot(j), static_cast<uint8_t*>(blocks[static_cast<size_t>(j)].data) + w.off, w.bytes);
        wrote += w.bytes;
      }
    }
    return wrote;
  };
  p.mid = [&](int64_t k) {
    if (to_root && at_root) {
      for (int j = 0; j < L.n; ++j) {
        if (j == ri) continue;
        const Window w = window(blocks[static_cast<size_t>(j)].bytes, k, p.cap);
        L.red.copy(static_cast<uint8_t*>(blocks[static_cast<size_t>(j)].data) + w.off, d.slot(j), w.bytes);
      }
    } else if (!to_root && !at_root) {
      const Window w = window(mine.bytes, k, p.cap);
      L.red.copy(static_cast<uint8_t*>(mine.data) + w.off, d.slot(L.me), w.bytes);
    }
  };
  runPieces(L, ctx, p);
  setAlgorithm(ctx, "shm");
}

}  // namespace

void gather(const Comm& comm, ShmDomain& d, const OpCtx& ctx, SendSeg mine, const std::vector<RecvSeg>& blocks,
            int root) {
  rooted(comm, d, ctx, root, true, RecvSeg{const_cast<void*>(mine.data), mine.bytes}, blocks, "gather");
}

void scatter(const Comm& comm, ShmDomain& d, const OpCtx& ctx, const std::vector<SendSeg>& blocks, RecvSeg mine,
             int root) {
  std::vector<RecvSeg> b;
  for (const auto& s : blocks) b.push_back(RecvSeg{const_cast<void*>(s.data), s.bytes});
  rooted(comm, d, ctx, root, false, mine, b, "scatter");
}

void barrier(const Comm& comm, ShmDomain& d, const OpCtx& ctx) {
  if (comm.size() <= 1) return;
  const Local L = localView(comm, d, "barrier");
  Plan p;
  p.name = "barrier";
  p.in = [](int64_t) { return uint64_t{0}; };
  runPieces(L, ctx, p);
  setAlgorithm(ctx, "shm");
}

void allreduceEF(const Comm& comm, ShmDomain& d, const OpCtx& ctx, float* x, const float* r_in, float* r_out,
                 int64_t n) {
  algo::Reducer& red = *comm.reducer;
  red.scale(x, n, DType::Float32, 1.0 / static_cast<double>(comm.size()));
  red.reduceInto(x, r_in, n, DType::Float32, ReduceOp::Sum);
  allreduce(comm, d, ctx, x, n, DType::Float32, ReduceOp::Sum);
  std::fill(r_out, r_out + n, 0.0f);
}

namespace {
// The host level of a two-level operation over shared memory (local: a comm of one host's ranks,
// its shm set).
const HostLevel& hostLevel() {
  static const HostLevel h{
      [](const Comm& local, const OpCtx& ctx, const std::vector<RecvSeg>& blocks) {
        reduceScatter(local, *local.shm, ctx, blocks, DType::Float32, ReduceOp::Sum);
      },
      [](const Comm& local, const OpCtx& ctx, const std::vector<RecvSeg>& blocks) {
        allgather(local, *local.shm, ctx, blocks);
      }};
  return h;
}

// Over shared memory when comm.shm holds the whole ring, else the engine's over comm.link.
class ShmCollectives final : public Collectives {
 public:
  void allreduce(const Comm& c, const OpCtx& ctx, void* data, int64_t numel, DType dtype, ReduceOp op,
                 double premul) const override {
    allreduceOp(c, *c.shm, ctx, data, numel, dtype, op, premul);
  }
  void allreduceEF(const Comm& c, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t n,
                   codec::Wire wire) const override {
    if (!whole(c)) {
      // Several hosts: the two-level plan with shared memory inside this host, where it covers it.
      if (efTwoLevel(c, n, wire) && covers(c.local_group, *c.shm))
        return allreduceEFTwoLevel(c, ctx, x, r_in, r_out, n, wire, hostLevel());
      return linkCollectives().allreduceEF(c, ctx, x, r_in, r_out, n, wire);
    }
    shm::allreduceEF(c, *c.shm, ctx, x, r_in, r_out, n);
  }
  void reduceScatter(const Comm& c, const OpCtx& ctx, const std::vector<RecvSeg>& blocks, DType wire,
                     ReduceOp op) const override {
    if (!whole(c)) return linkCollectives().reduceScatter(c, ctx, blocks, wire, op);
    shm::reduceScatter(c, *c.shm, ctx, blocks, wire, op);
  }
  void allgather(const Comm& c, const OpCtx& ctx, const std::vector<RecvSeg>& blocks) const override {
    if (!whole(c)) return linkCollectives().allgather(c, ctx, blocks);
    shm::allgather(c, *c.shm, ctx, blocks);
  }
  void broadcast(const Comm& c, const OpCtx& ctx, void* data, uint64_t bytes, int root) const override {
    if (!whole(c)) return linkCollectives().broadcast(c, ctx, data, bytes, root);
    shm::broadcast(c, *c.shm, ctx, data, bytes, root);
  }
  void alltoall(const Comm& c, const OpCtx& ctx, const std::vector<SendSeg>& sends,
                const std::vector<RecvSeg>& recvs) const override {
    if (!whole(c)) return linkCollectives().alltoall(c, ctx, sends, recvs);
    shm::alltoall(c, *c.shm, ctx, sends, recvs);
  }
  void gather(const Comm& c, const OpCtx& ctx, SendSeg mine, const std::vector<RecvSeg>& blocks,
              int root) const override {
    if (!whole(c)) return linkCollectives().gather(c, ctx, mine, blocks, root);
    shm::gather(c, *c.shm, ctx, mine, blocks, root);
  }
  void scatter(const Comm& c, const OpCtx& ctx, const std::vector<SendSeg>& blocks, RecvSeg mine,
               int root) const override {
    if (!whole(c)) return linkCollectives().scatter(c, ctx, blocks, mine, root);
    shm::scatter(c, *c.shm, ctx, blocks, mine, root);
  }
  void barrier(const Comm& c, const OpCtx& ctx) const override {
    if (!whole(c)) return linkCollectives().barrier(c, ctx);
    shm::barrier(c, *c.shm, ctx);
  }

 private:
  static bool whole(const Comm& c) { return c.shm != nullptr && covers(c.ring, *c.shm); }
};
}  // namespace

const Collectives& collectives() {
  static const ShmCollectives shm;
  return shm;
}

}  // namespace xirang::shm
