// The collectives that move data more than they reduce it: pipelined chain broadcast, ring
// allgather and reduce-scatter of per-rank blocks (the ring loops of loops.h), direct alltoall,
// gather and scatter, and elastic mode's completion round.
#include <algorithm>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>

#include "core/algorithms/loops.h"
#include "core/collectives.h"
#include "core/ring.h"

namespace xirang {

using namespace algo;  // NOLINT: the pieces (loops.h) every algorithm here is made of

namespace {

// One-directional collectives (broadcast, gather, scatter) first exchange one empty frame around
// the ring (send to next, receive from prev), carrying op, dtype, element count, order and root.
// Without it, ranks that disagree about the root could all wait to receive (nobody sends) until
// the timeout, or a root could return success while its peers raise. Any disagreement is seen
// by some rank, whose abort reaches everybody. Cost: one latency round.
void precheck(const Comm& comm, const OpCtx& ctx, int root) {
  const int n = comm.size();
  if (n <= 1) return;
  const int pos = comm.position();
  const auto h = headerFor(ctx, algo::kCheckBit | static_cast<uint64_t>(root));
  std::vector<SendJob> sends{{comm.ring[ring::nextPos(pos, n)], h, {}}};
  std::vector<RecvJob> recvs{{comm.ring[ring::prevPos(pos, n)], h, {}, nullptr}};
  runExchange(comm, ctx, sends, recvs);
}
// The root's side of a gather (to_root) or scatter: block(r) is rank r's block at the root;
// `mine` is this rank's own (sent to the root, or received from it; the root copies its own).
void rooted(const Comm& comm, const OpCtx& ctx, int root, bool to_root, RecvSeg mine,
            const std::function<RecvSeg(int)>& block) {
  precheck(comm, ctx, root);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  const uint64_t seg = algo::segmentBytes(comm, 1);
  const auto h = headerFor(ctx, static_cast<uint64_t>(root));
  if (comm.rank == root) {
    const RecvSeg own = block(root);
    comm.reducer->copy(to_root ? own.data : mine.data, to_root ? mine.data : own.data, own.bytes);
    for (int r : comm.ring) {
      if (r == root) continue;
      const RecvSeg b = block(r);
      if (to_root) recvs.push_back(RecvJob{r, h, algo::recvSegments(b.data, b.bytes, seg), nullptr});
      else sends.push_back(SendJob{r, h, algo::sendSegments(b.data, b.bytes, seg)});
    }
  } else if (to_root) {
    sends.push_back(SendJob{root, h, algo::sendSegments(mine.data, mine.bytes, seg)});
  } else {
    recvs.push_back(RecvJob{root, h, algo::recvSegments(mine.data, mine.bytes, seg), nullptr});
  }
  runExchange(comm, ctx, sends, recvs);
  if (ctx.phases) ctx.phases->algorithm = "direct";
}
}  // namespace

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
  auto segs = algo::recvSegments(data, bytes, algo::segmentBytes(comm, 1));
  const int64_t nseg = static_cast<int64_t>(segs.size());
  auto t0 = Clock::now();
  // Iteration i: the rank at distance d receives segment i-d+1 and forwards segment i-d.
  for (int64_t i = 0; i < nseg + n - 2; ++i) {
    std::vector<SendJob> sends;
    std::vector<RecvJob> recvs;
    const int64_t sk = i - d;
    if (d < n - 1 && sk >= 0 && sk < nseg)
      sends.push_back(SendJob{next, headerFor(ctx, static_cast<uint64_t>(root)), {SendSeg{segs[sk].data, segs[sk].bytes}}});
    const int64_t rk = i - d + 1;
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
  if (comm.size() <= 1) return;
  auto t0 = Clock::now();
  algo::allgather(comm, ctx, 1, algo::blockChunks(comm, blocks));
  if (ctx.phases) {
    ctx.phases->allgather_s += since(t0);
    ctx.phases->algorithm = "ring";
  }
}

void reduceScatter(const Comm& comm, const OpCtx& ctx, const std::vector<RecvSeg>& blocks, DType wire, ReduceOp op) {
  if (comm.size() <= 1) return;
  const size_t elem = elementSize(wire);
  const auto chunk = algo::blockChunks(comm, blocks);
  auto t0 = Clock::now();
  algo::scatterReduce(comm, ctx, elem, chunk, [&](int c, uint64_t off, const void* seg, uint64_t bytes) {
    comm.reducer->reduceInto(static_cast<uint8_t*>(chunk(c).data) + off, seg, static_cast<int64_t>(bytes / elem), wire, op);
  });
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
  comm.reducer->copy(recvs_in[me].data, sends_in[me].data, recvs_in[me].bytes);
  std::vector<SendJob> sends;
  std::vector<RecvJob> recvs;
  const uint64_t seg = algo::segmentBytes(comm, 1);
  for (int r : comm.ring) {
    if (r == me) continue;
    // op_numel carries the pair's block size so uneven splits are checked pairwise.
    auto hs = headerFor(ctx, 0);
    hs.op_numel = sends_in[r].bytes;
    auto hr = headerFor(ctx, 0);
    hr.op_numel = recvs_in[r].bytes;
    sends.push_back(SendJob{r, hs, algo::sendSegments(sends_in[r].data, sends_in[r].bytes, seg)});
    recvs.push_back(RecvJob{r, hr, algo::recvSegments(recvs_in[r].data, recvs_in[r].bytes, seg), nullptr});
  }
  auto t0 = Clock::now();
  runExchange(comm, ctx, sends, recvs);
  if (ctx.phases) {
    ctx.phases->allgather_s += since(t0);
    ctx.phases->algorithm = "direct";
  }
}

// Gather and scatter: the root exchanges one block with every other member (receiving for a
// gather, sending for a scatter) and copies its own.
void gather(const Comm& comm, const OpCtx& ctx, SendSeg mine, const std::vector<RecvSeg>& blocks, int root) {
  rooted(comm, ctx, root, /*to_root=*/true, RecvSeg{const_cast<void*>(mine.data), mine.bytes},
         [&](int r) { return RecvSeg{blocks[r].data, blocks[r].bytes}; });
}

void scatter(const Comm& comm, const OpCtx& ctx, const std::vector<SendSeg>& blocks, RecvSeg mine, int root) {
  rooted(comm, ctx, root, /*to_root=*/false, mine,
         [&](int r) { return RecvSeg{const_cast<void*>(blocks[r].data), blocks[r].bytes}; });
}

void ack(const Comm& comm, const OpCtx& ctx) {
  if (comm.size() <= 1) return;
  OpCtx c = ctx;
  c.op = transport::OpKind::Ack;
  c.phases = nullptr;  // not part of the operation's traffic in the stats
  const auto h = headerFor(c, 0);
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
