#include "core/collectives.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "core/codec.h"
#include "core/reduce.h"
#include "core/ring.h"

namespace xirang {

using transport::FrameHeader;
using transport::RecvJob;
using transport::RecvSeg;
using transport::SendJob;
using transport::SendSeg;

uint8_t* Scratch::get(size_t slot, size_t bytes) {
  if (slot >= 4) throw std::logic_error("xirang: scratch slot out of range");
  if (bytes > caps_[slot]) {
    bufs_[slot].reset(new uint8_t[bytes]);  // default-initialised: no zeroing pass
    caps_[slot] = bytes;
  }
  return bufs_[slot].get();
}

int Comm::position() const {
  auto it = std::find(ring.begin(), ring.end(), rank);
  if (it == ring.end()) throw std::logic_error("xirang: rank " + std::to_string(rank) + " is not in the ring");
  return static_cast<int>(it - ring.begin());
}

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

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

// Byte segments of [base, base+bytes) of at most seg bytes, aligned to whole elements.
template <typename Seg, typename Ptr>
std::vector<Seg> segmentsOf(Ptr base, uint64_t bytes, uint64_t seg_bytes) {
  std::vector<Seg> out;
  for (uint64_t off = 0; off < bytes; off += seg_bytes) {
    out.push_back(Seg{static_cast<Ptr>(static_cast<uint8_t*>(const_cast<void*>(static_cast<const void*>(base))) + off),
                      std::min(seg_bytes, bytes - off)});
  }
  return out;
}

// Receive segments for a message of `bytes` bytes, all landing in the one seg-byte buffer `buf`:
// exchange() hands segment i to on_segment before it reads segment i+1, so the consumer (a
// reduction) reads it from cache, and segment i is bytes [i*seg, i*seg + segs[i].bytes) of the message.
std::vector<RecvSeg> segmentsInto(void* buf, uint64_t bytes, uint64_t seg) {
  std::vector<RecvSeg> out;
  for (uint64_t off = 0; off < bytes; off += seg) out.push_back(RecvSeg{buf, std::min(seg, bytes - off)});
  return out;
}

// aux bit marking the agreement check (an empty frame) of one-directional collectives.
constexpr uint64_t kCheckBit = 1ULL << 40;

uint64_t segBytesFor(const Comm& comm, size_t elem) {
  uint64_t s = static_cast<uint64_t>(std::max<int64_t>(comm.segment_bytes, 1));
  s = std::max<uint64_t>(elem, s / elem * elem);
  return s;
}

}  // namespace

void runExchange(const Comm& comm, const OpCtx& ctx, std::vector<SendJob>& sends, std::vector<RecvJob>& recvs) {
  if (!ctx.phases) {
    comm.tcp->exchange(sends, recvs, ctx.deadline);
    return;
  }
  std::vector<transport::PeerTiming> timings;
  comm.tcp->exchange(sends, recvs, ctx.deadline, &timings);
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

void directAllreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op) {
  const int n = comm.size();
  const uint64_t bytes = static_cast<uint64_t>(numel) * elementSize(wire);
  uint8_t* all = comm.scratch->get(0, bytes * n);
  const int me = comm.rank;
  // Slot i holds the input of the i-th member in rank order.
  std::vector<int> order = comm.ring;
  std::sort(order.begin(), order.end());
  auto slot = [&](int r) { return all + bytes * (std::lower_bound(order.begin(), order.end(), r) - order.begin()); };
  if (bytes) std::memcpy(slot(me), data, bytes);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  for (int r : comm.ring) {
    if (r == me) continue;
    sends.push_back(SendJob{r, headerFor(ctx, 0), {SendSeg{data, bytes}}});
    recvs.push_back(RecvJob{r, headerFor(ctx, 0), {RecvSeg{slot(r), bytes}}, nullptr});
  }
  auto t0 = Clock::now();
  runExchange(comm, ctx, sends, recvs);
  // Reduce in rank order on every rank: the same operands in the same order give the same bits.
  if (bytes) std::memcpy(data, all, bytes);
  for (size_t i = 1; i < order.size(); ++i) reduceInto(data, all + bytes * i, numel, wire, op);
  if (ctx.phases) {
    ctx.phases->scatter_reduce_s += since(t0);
    ctx.phases->algorithm = "direct";
  }
}

void ringAllreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op) {
  const int n = comm.size();
  const int pos = comm.position();
  const size_t elem = elementSize(wire);
  const int next = comm.ring[ring::nextPos(pos, n)];
  const int prev = comm.ring[ring::prevPos(pos, n)];
  auto chunks = ring::partition(numel, n);
  uint8_t* base = static_cast<uint8_t*>(data);
  const uint64_t seg = segBytesFor(comm, elem);
  // Received segments share one segment-sized buffer (segmentsInto), reduced while in cache.
  uint8_t* tmp = comm.scratch->get(0, seg);

  auto t0 = Clock::now();
  for (int s = 0; s < n - 1; ++s) {
    auto st = ring::scatterReduceStep(pos, n, s);
    const auto& sc = chunks[st.send_chunk];
    const auto& rc = chunks[st.recv_chunk];
    std::vector<SendJob> sends{{next, headerFor(ctx, static_cast<uint64_t>(s)),
                                segmentsOf<SendSeg, const void*>(base + sc.offset * elem, sc.count * elem, seg)}};
    std::vector<RecvJob> recvs{{prev, headerFor(ctx, static_cast<uint64_t>(s)),
                                segmentsInto(tmp, rc.count * elem, seg), nullptr}};
    auto& rsegs = recvs[0].segs;
    recvs[0].on_segment = [&](size_t i) {
      reduceInto(base + rc.offset * elem + i * seg, tmp, static_cast<int64_t>(rsegs[i].bytes / elem), wire, op);
    };
    runExchange(comm, ctx, sends, recvs);
  }
  auto t1 = Clock::now();
  for (int s = 0; s < n - 1; ++s) {
    auto st = ring::allgatherStep(pos, n, s);
    const auto& sc = chunks[st.send_chunk];
    const auto& rc = chunks[st.recv_chunk];
    std::vector<SendJob> sends{{next, headerFor(ctx, 1000 + static_cast<uint64_t>(s)),
                                segmentsOf<SendSeg, const void*>(base + sc.offset * elem, sc.count * elem, seg)}};
    std::vector<RecvJob> recvs{{prev, headerFor(ctx, 1000 + static_cast<uint64_t>(s)),
                                segmentsOf<RecvSeg, void*>(base + rc.offset * elem, rc.count * elem, seg), nullptr}};
    runExchange(comm, ctx, sends, recvs);
  }
  if (ctx.phases) {
    ctx.phases->scatter_reduce_s += std::chrono::duration<double>(t1 - t0).count();
    ctx.phases->allgather_s += since(t1);
    ctx.phases->algorithm = "ring";
  }
}

}  // namespace

// Two-level (hierarchical) allreduce: reduce-scatter among the ranks of this host, allreduce of
// this rank's shard among the ranks holding the same shard on the other hosts, allgather inside
// the host. Shard j's final value is computed once by the cross-host allreduce and copied, so
// every rank ends with the same bits.
void twoLevelAllreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op) {
  const size_t elem = elementSize(wire);
  const int g = static_cast<int>(comm.local_group.size());
  const int j = static_cast<int>(std::find(comm.local_group.begin(), comm.local_group.end(), comm.rank) -
                                 comm.local_group.begin());
  auto shards = ring::partition(numel, g);
  uint8_t* base = static_cast<uint8_t*>(data);
  int max_rank = 0;
  for (int r : comm.ring) max_rank = std::max(max_rank, r);
  std::vector<RecvSeg> blocks(static_cast<size_t>(max_rank) + 1, RecvSeg{nullptr, 0});
  for (int k = 0; k < g; ++k)
    blocks[comm.local_group[k]] = RecvSeg{base + shards[k].offset * elem, static_cast<uint64_t>(shards[k].count) * elem};
  Comm local = comm;
  local.ring = comm.local_group;
  local.local_group.clear();
  Comm cross = comm;
  cross.ring = comm.cross_group;
  cross.local_group.clear();
  reduceScatter(local, ctx, blocks, wire, op);
  allreduce(cross, ctx, base + shards[j].offset * elem, shards[j].count, wire, op);
  allgather(local, ctx, blocks);
  if (ctx.phases) ctx.phases->algorithm = "two_level";
}

// One-directional collectives (broadcast, gather, scatter) first exchange one empty frame around
// the ring (send to next, receive from prev), carrying op, dtype, element count, order and root.
// Without it, ranks that disagree about the root could all wait to receive (nobody sends) until
// the timeout, or a root could return success while its peers raise. Any disagreement is seen
// by some rank, whose abort reaches everybody. Cost: one latency round.
static void precheck(const Comm& comm, const OpCtx& ctx, int root) {
  const int n = comm.size();
  if (n <= 1) return;
  const int pos = comm.position();
  const auto h = headerFor(ctx, kCheckBit | static_cast<uint64_t>(root));
  std::vector<SendJob> sends{{comm.ring[ring::nextPos(pos, n)], h, {}}};
  std::vector<RecvJob> recvs{{comm.ring[ring::prevPos(pos, n)], h, {}, nullptr}};
  runExchange(comm, ctx, sends, recvs);
}

void allreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op) {
  if (comm.size() <= 1) return;
  const uint64_t bytes = static_cast<uint64_t>(numel) * elementSize(wire);
  const bool small = bytes <= static_cast<uint64_t>(comm.small_bytes) || numel < comm.size();
  const bool two_level_ok = comm.local_group.size() > 1 && comm.cross_group.size() > 1 &&
                            numel >= static_cast<int64_t>(comm.local_group.size());
  // numel == 0 still exchanges (empty) frames so a rank that disagrees about the size is told.
  if (numel == 0 || comm.algo == Comm::Algo::Direct || (comm.algo == Comm::Algo::Auto && small)) {
    directAllreduce(comm, ctx, data, numel, wire, op);
  } else if (two_level_ok && (comm.algo == Comm::Algo::TwoLevel || comm.algo == Comm::Algo::Auto)) {
    twoLevelAllreduce(comm, ctx, data, numel, wire, op);
  } else {
    ringAllreduce(comm, ctx, data, numel, wire, op);
  }
}

void allreduce16(const Comm& comm, const OpCtx& ctx, uint16_t* data, int64_t numel, DType t, ReduceOp op,
                 float pre_scale, float post_scale) {
  if (t != DType::Float16 && t != DType::BFloat16)
    throw std::invalid_argument(std::string("xirang: allreduce16 takes float16 or bfloat16, not ") + dtypeName(t));
  const bool half = t == DType::Float16;
  auto toF = [half](uint16_t v) { return half ? halfToFloat(v) : codec::bf16ToF32(v); };
  auto fromF = [half](float v) { return half ? floatToHalf(v) : codec::f32ToBf16(v); };
  auto combine = [op](float a, float b) {
    switch (op) {
      case ReduceOp::Sum: return a + b;
      case ReduceOp::Product: return a * b;
      case ReduceOp::Min: return (std::isnan(a) || std::isnan(b)) ? a + b : (b < a ? b : a);
      case ReduceOp::Max: return (std::isnan(a) || std::isnan(b)) ? a + b : (b > a ? b : a);
      default: throw std::invalid_argument(std::string("xirang: allreduce16: ") + reduceOpName(op));
    }
  };
  const int n = comm.size();
  if (n <= 1) {
    if (pre_scale != 1.0f || post_scale != 1.0f)
      for (int64_t i = 0; i < numel; ++i) data[i] = fromF((toF(data[i]) * pre_scale) * post_scale);
    return;
  }
  const int pos = comm.position();
  auto chunks = ring::partition(numel, n);
  const auto& mine = chunks[pos];
  std::vector<int> order = comm.ring;
  std::sort(order.begin(), order.end());
  // Slot k: the contribution of the k-th member in rank order to this rank's chunk.
  uint16_t* slots = reinterpret_cast<uint16_t*>(comm.scratch->get(2, static_cast<size_t>(mine.count) * 2 * n));
  auto slotOf = [&](int r) {
    return slots + mine.count * (std::lower_bound(order.begin(), order.end(), r) - order.begin());
  };
  if (mine.count) std::memcpy(slotOf(comm.rank), data + mine.offset, static_cast<size_t>(mine.count) * 2);
  const uint64_t seg = segBytesFor(comm, 2);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  for (int q = 0; q < n; ++q) {
    int r = comm.ring[q];
    if (r == comm.rank) continue;
    sends.push_back(SendJob{r, headerFor(ctx, 1), segmentsOf<SendSeg, const void*>(data + chunks[q].offset, chunks[q].count * 2, seg)});
    recvs.push_back(RecvJob{r, headerFor(ctx, 1), segmentsOf<RecvSeg, void*>(slotOf(r), mine.count * 2, seg), nullptr});
  }
  auto t0 = Clock::now();
  runExchange(comm, ctx, sends, recvs);
  auto t1 = Clock::now();
  for (int64_t i = 0; i < mine.count; ++i) {
    float acc = toF(slots[i]) * pre_scale;
    for (int k = 1; k < n; ++k) acc = combine(acc, toF(slots[mine.count * k + i]) * pre_scale);
    data[mine.offset + i] = fromF(acc * post_scale);
  }
  std::vector<RecvSeg> blocks(static_cast<size_t>(*std::max_element(order.begin(), order.end())) + 1, RecvSeg{nullptr, 0});
  for (int c = 0; c < n; ++c)
    blocks[comm.ring[c]] = RecvSeg{data + chunks[c].offset, static_cast<uint64_t>(chunks[c].count) * 2};
  auto t2 = Clock::now();
  allgather(comm, ctx, blocks);
  if (ctx.phases) {
    ctx.phases->scatter_reduce_s += std::chrono::duration<double>(t1 - t0).count();
    ctx.phases->encode_s += std::chrono::duration<double>(t2 - t1).count();
    ctx.phases->algorithm = "direct_rs_fp32+ring_ag";
  }
}

void allreduceBF16EF(const Comm& comm, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t numel) {
  const int n = comm.size();
  const float scale = 1.0f / static_cast<float>(n);
  uint16_t* wire = reinterpret_cast<uint16_t*>(comm.scratch->get(1, static_cast<size_t>(numel) * 2));
  Phases dummy;
  Phases& ph = ctx.phases ? *ctx.phases : dummy;
  ph.algorithm = "ring_bf16_ef";
  if (n <= 1 || numel == 0) {
    auto t0 = Clock::now();
    codec::encodeEF(x, scale, r_in, r_out, wire, numel);
    ph.encode_s += since(t0);
    auto t1 = Clock::now();
    codec::decode(wire, x, numel);
    ph.decode_s += since(t1);
    return;
  }
  const int pos = comm.position();
  const int next = comm.ring[ring::nextPos(pos, n)];
  const int prev = comm.ring[ring::prevPos(pos, n)];
  auto chunks = ring::partition(numel, n);
  const uint64_t seg = segBytesFor(comm, 2);
  uint16_t* tmp = reinterpret_cast<uint16_t*>(comm.scratch->get(0, seg));

  // First hop: this position starts chunk ring::scatterReduceStep(pos, n, 0).send_chunk.
  auto t0 = Clock::now();
  {
    const auto& c = chunks[ring::scatterReduceStep(pos, n, 0).send_chunk];
    codec::encodeEF(x + c.offset, scale, r_in + c.offset, r_out + c.offset, wire + c.offset, c.count);
  }
  ph.encode_s += since(t0);
  auto t1 = Clock::now();
  double hop_codec_s = 0;
  for (int s = 0; s < n - 1; ++s) {
    auto st = ring::scatterReduceStep(pos, n, s);
    const auto& sc = chunks[st.send_chunk];
    const auto& rc = chunks[st.recv_chunk];
    std::vector<SendJob> sends{{next, headerFor(ctx, static_cast<uint64_t>(s)),
                                segmentsOf<SendSeg, const void*>(wire + sc.offset, sc.count * 2, seg)}};
    std::vector<RecvJob> recvs{{prev, headerFor(ctx, static_cast<uint64_t>(s)),
                                segmentsInto(tmp, rc.count * 2, seg), nullptr}};
    auto& rsegs = recvs[0].segs;
    recvs[0].on_segment = [&](size_t i) {
      auto tc = Clock::now();
      int64_t off = static_cast<int64_t>(i * seg / 2) + rc.offset;
      int64_t cnt = static_cast<int64_t>(rsegs[i].bytes / 2);
      // Partial sum so far + this rank's x/N + residual, re-encoded; the rounding error of this
      // hop becomes this rank's residual for these elements (every rounding is fed back).
      codec::accumulateEncodeEF(tmp, x + off, scale, r_in + off,
                                r_out + off, wire + off, cnt);
      hop_codec_s += since(tc);
    };
    runExchange(comm, ctx, sends, recvs);
  }
  auto t2 = Clock::now();
  for (int s = 0; s < n - 1; ++s) {
    auto st = ring::allgatherStep(pos, n, s);
    const auto& sc = chunks[st.send_chunk];
    const auto& rc = chunks[st.recv_chunk];
    std::vector<SendJob> sends{{next, headerFor(ctx, 1000 + static_cast<uint64_t>(s)),
                                segmentsOf<SendSeg, const void*>(wire + sc.offset, sc.count * 2, seg)}};
    std::vector<RecvJob> recvs{{prev, headerFor(ctx, 1000 + static_cast<uint64_t>(s)),
                                segmentsOf<RecvSeg, void*>(wire + rc.offset, rc.count * 2, seg), nullptr}};
    runExchange(comm, ctx, sends, recvs);
  }
  auto t3 = Clock::now();
  // Every rank, the owner included, decodes the same bf16 values: replicas are bitwise equal.
  codec::decode(wire, x, numel);
  ph.decode_s += since(t3);
  ph.encode_s += hop_codec_s;
  ph.scatter_reduce_s += std::chrono::duration<double>(t2 - t1).count() - hop_codec_s;
  ph.allgather_s += std::chrono::duration<double>(t3 - t2).count();
}

void broadcast(const Comm& comm, const OpCtx& ctx, void* data, uint64_t bytes, int root) {
  const int n = comm.size();
  if (n <= 1) return;
  const int pos = comm.position();
  auto rit = std::find(comm.ring.begin(), comm.ring.end(), root);
  if (rit == comm.ring.end()) throw std::invalid_argument("xirang: broadcast root " + std::to_string(root) + " is not a member");
  const int root_pos = static_cast<int>(rit - comm.ring.begin());
  precheck(comm, ctx, root);
  if (bytes == 0) return;
  const int d = (pos - root_pos + n) % n;  // distance from the root along the ring
  const int next = comm.ring[ring::nextPos(pos, n)];
  const int prev = comm.ring[ring::prevPos(pos, n)];
  auto segs = segmentsOf<RecvSeg, void*>(data, bytes, segBytesFor(comm, 1));
  const int64_t nseg = static_cast<int64_t>(segs.size());
  auto t0 = Clock::now();
  // Iteration i: the rank at distance d receives segment i-d+1 and forwards segment i-d.
  for (int64_t i = 0; i < nseg + n - 2; ++i) {
    std::vector<SendJob> sends;
    std::vector<RecvJob> recvs;
    int64_t sk = i - d;
    if (d < n - 1 && sk >= 0 && sk < nseg)
      sends.push_back(SendJob{next, headerFor(ctx, static_cast<uint64_t>(root)), {SendSeg{segs[sk].data, segs[sk].bytes}}});
    int64_t rk = i - d + 1;
    if (d > 0 && rk >= 0 && rk < nseg)
      recvs.push_back(RecvJob{prev, headerFor(ctx, static_cast<uint64_t>(root)), {segs[rk]}, nullptr});
    if (!sends.empty() || !recvs.empty()) runExchange(comm, ctx, sends, recvs);
  }
  if (ctx.phases) {
    ctx.phases->allgather_s += since(t0);
    ctx.phases->algorithm = "chain";
  }
}

void allgather(const Comm& comm, const OpCtx& ctx, const std::vector<RecvSeg>& blocks) {
  const int n = comm.size();
  if (n <= 1) return;
  const int pos = comm.position();
  const int next = comm.ring[ring::nextPos(pos, n)];
  const int prev = comm.ring[ring::prevPos(pos, n)];
  const uint64_t seg = segBytesFor(comm, 1);
  auto t0 = Clock::now();
  for (int s = 0; s < n - 1; ++s) {
    const RecvSeg& sb = blocks[comm.ring[(pos - s + n) % n]];
    const RecvSeg& rb = blocks[comm.ring[(pos - s - 1 + 2 * n) % n]];
    std::vector<SendJob> sends{{next, headerFor(ctx, static_cast<uint64_t>(s)),
                                segmentsOf<SendSeg, const void*>(sb.data, sb.bytes, seg)}};
    std::vector<RecvJob> recvs{{prev, headerFor(ctx, static_cast<uint64_t>(s)),
                                segmentsOf<RecvSeg, void*>(rb.data, rb.bytes, seg), nullptr}};
    runExchange(comm, ctx, sends, recvs);
  }
  if (ctx.phases) {
    ctx.phases->allgather_s += since(t0);
    ctx.phases->algorithm = "ring";
  }
}

void reduceScatter(const Comm& comm, const OpCtx& ctx, const std::vector<RecvSeg>& blocks, DType wire, ReduceOp op) {
  const int n = comm.size();
  if (n <= 1) return;
  const int pos = comm.position();
  const size_t elem = elementSize(wire);
  const int next = comm.ring[ring::nextPos(pos, n)];
  const int prev = comm.ring[ring::prevPos(pos, n)];
  // Chunk c of the ring schedule is the block of rank ring[c-1]: position p then ends owning
  // chunk p+1, i.e. its own block.
  auto blockOf = [&](int chunk) -> const RecvSeg& { return blocks[comm.ring[(chunk - 1 + n) % n]]; };
  const uint64_t seg = segBytesFor(comm, elem);
  uint8_t* tmp = comm.scratch->get(0, seg);
  auto t0 = Clock::now();
  for (int s = 0; s < n - 1; ++s) {
    auto st = ring::scatterReduceStep(pos, n, s);
    const RecvSeg& sb = blockOf(st.send_chunk);
    const RecvSeg& rb = blockOf(st.recv_chunk);
    std::vector<SendJob> sends{{next, headerFor(ctx, static_cast<uint64_t>(s)),
                                segmentsOf<SendSeg, const void*>(sb.data, sb.bytes, seg)}};
    std::vector<RecvJob> recvs{{prev, headerFor(ctx, static_cast<uint64_t>(s)),
                                segmentsInto(tmp, rb.bytes, seg), nullptr}};
    auto& rsegs = recvs[0].segs;
    recvs[0].on_segment = [&](size_t i) {
      reduceInto(static_cast<uint8_t*>(rb.data) + i * seg, tmp, static_cast<int64_t>(rsegs[i].bytes / elem), wire, op);
    };
    runExchange(comm, ctx, sends, recvs);
  }
  if (ctx.phases) {
    ctx.phases->scatter_reduce_s += since(t0);
    ctx.phases->algorithm = "ring";
  }
}

void alltoall(const Comm& comm, const OpCtx& ctx, const std::vector<SendSeg>& sends_in, const std::vector<RecvSeg>& recvs_in) {
  const int me = comm.rank;
  if (recvs_in[me].bytes != sends_in[me].bytes)
    throw std::invalid_argument("xirang: alltoall: rank " + std::to_string(me) + " sends itself " +
                                std::to_string(sends_in[me].bytes) + " bytes but expects " +
                                std::to_string(recvs_in[me].bytes));
  if (recvs_in[me].bytes) std::memmove(recvs_in[me].data, sends_in[me].data, recvs_in[me].bytes);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  const uint64_t seg = segBytesFor(comm, 1);
  for (int r : comm.ring) {
    if (r == me) continue;
    // op_numel carries the pair's block size so uneven splits are checked pairwise.
    FrameHeader hs = headerFor(ctx, 0);
    hs.op_numel = sends_in[r].bytes;
    FrameHeader hr = headerFor(ctx, 0);
    hr.op_numel = recvs_in[r].bytes;
    sends.push_back(SendJob{r, hs, segmentsOf<SendSeg, const void*>(sends_in[r].data, sends_in[r].bytes, seg)});
    recvs.push_back(RecvJob{r, hr, segmentsOf<RecvSeg, void*>(recvs_in[r].data, recvs_in[r].bytes, seg), nullptr});
  }
  auto t0 = Clock::now();
  runExchange(comm, ctx, sends, recvs);
  if (ctx.phases) {
    ctx.phases->allgather_s += since(t0);
    ctx.phases->algorithm = "direct";
  }
}

void gather(const Comm& comm, const OpCtx& ctx, SendSeg mine, const std::vector<RecvSeg>& blocks, int root) {
  precheck(comm, ctx, root);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  const uint64_t seg = segBytesFor(comm, 1);
  if (comm.rank == root) {
    if (blocks[root].bytes) std::memmove(blocks[root].data, mine.data, blocks[root].bytes);
    for (int r : comm.ring) {
      if (r == root) continue;
      recvs.push_back(RecvJob{r, headerFor(ctx, static_cast<uint64_t>(root)),
                              segmentsOf<RecvSeg, void*>(blocks[r].data, blocks[r].bytes, seg), nullptr});
    }
  } else {
    sends.push_back(SendJob{root, headerFor(ctx, static_cast<uint64_t>(root)),
                            segmentsOf<SendSeg, const void*>(mine.data, mine.bytes, seg)});
  }
  runExchange(comm, ctx, sends, recvs);
  if (ctx.phases) ctx.phases->algorithm = "direct";
}

void scatter(const Comm& comm, const OpCtx& ctx, const std::vector<SendSeg>& blocks, RecvSeg mine, int root) {
  precheck(comm, ctx, root);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  const uint64_t seg = segBytesFor(comm, 1);
  if (comm.rank == root) {
    if (mine.bytes) std::memmove(mine.data, blocks[root].data, mine.bytes);
    for (int r : comm.ring) {
      if (r == root) continue;
      sends.push_back(SendJob{r, headerFor(ctx, static_cast<uint64_t>(root)),
                              segmentsOf<SendSeg, const void*>(blocks[r].data, blocks[r].bytes, seg)});
    }
  } else {
    recvs.push_back(RecvJob{root, headerFor(ctx, static_cast<uint64_t>(root)),
                            segmentsOf<RecvSeg, void*>(mine.data, mine.bytes, seg), nullptr});
  }
  runExchange(comm, ctx, sends, recvs);
  if (ctx.phases) ctx.phases->algorithm = "direct";
}

void ack(const Comm& comm, const OpCtx& ctx) {
  if (comm.size() <= 1) return;
  OpCtx c = ctx;
  c.op = transport::OpKind::Ack;
  c.phases = nullptr;  // not part of the operation's traffic in the stats
  const FrameHeader h = headerFor(c, 0);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  for (int r : comm.ring) {
    if (r == comm.rank) continue;
    sends.push_back(SendJob{r, h, {}});
    recvs.push_back(RecvJob{r, h, {}, nullptr});
  }
  runExchange(comm, c, sends, recvs);
}

}  // namespace xirang
