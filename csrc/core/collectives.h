// The collective algorithms on raw buffers: ring allreduce (scatter-reduce + allgather,
// Patarasuk & Yuan 2009), the latency-optimal direct exchange for small messages, the BF16
// error-feedback ring (codec.h: every hop's rounding error fed back), pipelined chain broadcast,
// ring allgather / reduce-scatter, and direct alltoall / gather / scatter. Implemented in
// core/algorithms/ over one ring scatter-reduce loop and one ring allgather loop (loops.h), a
// transport::Link and an algo::Reducer; which algorithm an allreduce takes, and its AVG /
// PREMUL_SUM scaling, is core/planner.h's.
//
// Torch-free: the backend hands pointers, element counts (int64, so > 2^31 works) and dtypes.
// Every function is collective over `comm.ring` and is called by every member with the same
// OpCtx fields (op, dtype, reduce, numel, seq); a member that disagrees gets a TransportError
// naming the field, and so (through the backend's abort) does everybody else.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "core/algorithms/reducer.h"
#include "core/codec.h"
#include "core/dtype.h"
#include "core/transport/transport.h"

namespace xirang {

namespace transport {
class ShmDomain;
}

// Reusable, uninitialised working memory for the algorithms, in the reducer's memory. Large
// per-op allocations went to mmap/munmap on every call (glibc's threshold) and cost page faults
// comparable to the transfer.
class Scratch {
 public:
  // At least `bytes` bytes for `slot` (0..3) from `reducer`, kept until a larger request for the
  // same slot or a request from another reducer (another memory).
  uint8_t* get(size_t slot, size_t bytes, algo::Reducer& reducer = algo::hostReducer());

 private:
  algo::Buffer bufs_[4];
  size_t caps_[4] = {0, 0, 0, 0};
  const algo::Reducer* owners_[4] = {nullptr, nullptr, nullptr, nullptr};  // whose memory bufs_ are
};

// Who takes part and how: membership is data (#8 rebuilds it without a failed rank).
struct Comm {
  transport::Link* link = nullptr;
  algo::Reducer* reducer = &algo::hostReducer();  // works on the memory link moves
  int rank = 0;                // this process's rank in the group
  std::vector<int> ring;       // ring order: ranks by position; every member appears once
  int64_t segment_bytes = 1 << 20;
  int64_t small_bytes = 64 << 10;
  // Auto: the direct exchange up to small_bytes; above it the two-level allreduce when a plan
  // exists (local_group/cross_group set: several hosts with the same number of ranks each),
  // else the ring. Alpha-beta reasoning (Thakur, Rabenseifner & Gropp 2005): a flat ring over
  // N ranks pays 2(N-1) step latencies on its slowest link; two-level pays 2(g-1) cheap
  // intra-host steps plus 2(H-1) cross-host ones, while each host uplink still carries about
  // 2(H-1)/H x S bytes, so it wins where hosts are many and cross-host latency dominates.
  enum class Algo { Auto, Ring, Direct, TwoLevel } algo = Algo::Auto;
  std::vector<int> local_group;  // two-level plan: ranks on this rank's host, in ring order
  std::vector<int> cross_group;  // ranks with this rank's local index on every host
  // The shared-memory domain of this rank's same-host ranks (transport/shm.h), or null: the
  // caller's choice of transport for them (the backend: XIRANG_TRANSPORT_LOCAL). The algorithms
  // of this header never touch it; algorithms/shm.h's take it as an argument.
  transport::ShmDomain* shm = nullptr;

  std::shared_ptr<Scratch> scratch = std::make_shared<Scratch>();  // one op at a time uses it
  uint8_t* scratchBytes(size_t slot, size_t bytes) const { return scratch->get(slot, bytes, *reducer); }

  int size() const { return static_cast<int>(ring.size()); }
  int position() const;        // index of `rank` in `ring`; throws if absent
};

// Per ring neighbour / peer: seconds spent until our sends to it (receives from it) completed,
// summed over the operation's exchanges, and payload bytes. A slow link or rank shows up here.
struct PeerStat {
  double send_s = 0, recv_s = 0;
  uint64_t bytes_sent = 0, bytes_recv = 0;
};

// Seconds spent in each phase of one operation, and payload bytes this rank sent.
struct Phases {
  double pack_s = 0;  // the hook's op: copying the layer group's gradients into its buffers
  double encode_s = 0, scatter_reduce_s = 0, allgather_s = 0, decode_s = 0;
  uint64_t bytes_sent = 0;  // payload only, headers excluded
  uint64_t bytes_shm = 0;   // payload this rank wrote into shared memory (algorithms/shm.h)
  const char* algorithm = "";
  std::map<int, PeerStat> peers;
};

struct OpCtx {
  transport::OpKind op = transport::OpKind::None;
  DType dtype = DType::Bytes;      // the caller's dtype (checked across ranks)
  ReduceOp reduce = ReduceOp::None;
  uint64_t numel = 0;              // caller's element count (checked across ranks)
  uint64_t seq = 0;
  transport::Deadline deadline;
  Phases* phases = nullptr;        // optional
};

// Runs one exchange of comm.link under ctx's deadline, adding per-peer times and bytes to
// ctx.phases when given. Every algorithm goes through it.
void runExchange(const Comm& comm, const OpCtx& ctx, std::vector<transport::SendJob>& sends,
                 std::vector<transport::RecvJob>& recvs);

// In-place allreduce of `numel` elements of `wire` dtype at `data` (not 16-bit floats: see
// planner.h's allreduceOp, which also does AVG / PREMUL_SUM). `op` is Sum, Product, Min, Max,
// BAnd, BOr or BXor. Small messages (<= comm.small_bytes) take the direct exchange (one round,
// every rank reduces all inputs in rank order); larger ones the two-level plan where one exists,
// else the segmented ring. Results are bitwise identical on all ranks.
void allreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op);

// The algorithm allreduce() runs for these arguments on a comm of more than one rank: Direct,
// TwoLevel or Ring (never Auto).
Comm::Algo allreduceAlgo(const Comm& comm, int64_t numel, DType wire);

// The two algorithms allreduce() picks from above the small-message size, callable directly.
void ringAllreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op);
void twoLevelAllreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op);
// The two-level plan of `numel` elements of `wire` at `data` (comm.local_group and cross_group
// set, this rank in both): `local` is the comm of this host's ranks, `cross` that of the ranks
// holding this rank's shard on the other hosts; blocks (by group rank) are the host ranks' shards
// of data, the reduce-scatter's and allgather's blocks; `shard` / `shard_numel` this rank's.
struct TwoLevelSplit {
  Comm local, cross;
  std::vector<transport::RecvSeg> blocks;
  uint8_t* shard;
  int64_t shard_numel;
};
TwoLevelSplit twoLevelSplit(const Comm& comm, void* data, int64_t numel, DType wire);
void directAllreduce(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op);

// Allreduce of a 16-bit float buffer (t = Float16 or BFloat16) that rounds once: each rank sends
// chunk c straight to its owner ring[c], the owner combines all N contributions in fp32 in rank
// order (each first multiplied by pre_scale, the result by post_scale: PREMUL_SUM's factor and
// AVG's 1/N), rounds to 16 bits once, and a ring allgather of the 16-bit chunks follows. Bytes
// per rank: 2(N-1)/N x 2 x numel, like a 16-bit ring; results bitwise equal on all ranks.
// `op`: Sum, Product, Min or Max.
void allreduce16(const Comm& comm, const OpCtx& ctx, uint16_t* data, int64_t numel, DType t, ReduceOp op,
                 float pre_scale, float post_scale);

// BF16 error-feedback ring allreduce of fp32 `x` (n elements), averaged (scale = 1/N applied
// before the first encode). Reads residual `r_in`, writes the new residual to `r_out` (r_out may
// alias r_in; the backend passes a separate buffer so that a step whose outputs are not finite
// leaves the residual untouched). On return x holds the decoded bf16 average, bitwise identical
// on all ranks. Wire bytes per rank: 2 * 2(N-1)/N * n.
void allreduceBF16EF(const Comm& comm, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t n);

// The direct form of the same compressed allreduce (the default over NCCL; usable over any link),
// in wire format w (codec.h: Wire): every rank encodes its buffer once, chunk by chunk (ring::
// partition's chunks, chunk q as one codec block), s = x/N + r_in with r_out = the rounding error
// (error feedback at the sender), sends block q straight to the chunk's owner ring[q], the owner
// decodes the N contributions and sums them in fp32 in rank order, encodes the sum once (adding
// its own residual of that chunk first and keeping the new rounding error as its residual, so
// nothing is lost: sum_t y_t + sum_i r_i = sum_t sum_i x_(i,t)/N up to fp32 rounding), and a ring
// allgather of the blocks follows; every rank decodes the same blocks. One rounding of each
// contribution and one of each sum, against one per hop on the ring. Bytes per rank: 2(N-1)/N x
// blockBytes (BF16 / FP16 2n, plus 4 bytes per 1024-element segment for FP16 / INT8's scales;
// INT8 n), with N-1 peers at once in the first phase. Aliasing and the result's bits across ranks
// as allreduceBF16EF. Non-finite input: BF16 and FP16 carry inf/NaN through; INT8 codes an inf or
// NaN element as -128, decoded as NaN; the other elements stay finite.
void allreduceEFDirect(const Comm& comm, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t n,
                       codec::Wire w);

// The host level of a two-level operation: a fp32 SUM reduce-scatter and an allgather over the
// ranks of one host (`local`: twoLevelSplit's local comm), by the link (the engine's) or by shared
// memory (algorithms/shm.h).
struct HostLevel {
  std::function<void(const Comm& local, const OpCtx& ctx, const std::vector<transport::RecvSeg>& blocks)>
      reduce_scatter_sum, allgather;
};
// The link's host level.
const HostLevel& linkHostLevel();

// The error-feedback allreduce in two levels, for comm's two-level plan (comm.local_group and
// comm.cross_group, as twoLevelAllreduce): every rank folds its residual in, v = x/N + r_in (the
// encoders' s, fp32); the ranks of a host sum v exactly in fp32 by the host's reduce-scatter (no
// rounding to feed back: bytes inside a host are cheap); the ranks holding the same shard on the
// other hosts sum their shards with the direct form in wire format w (allreduceEFDirect without the
// 1/N: the sender's and the owner's roundings of this rank's shard are its new residual); the
// host's allgather copies the shards. r_out holds those roundings on this rank's shard and 0
// elsewhere (r_in was folded into v), so y + sum_i r_out_i = sum_i v_i: the invariant of
// allreduceBF16EF, with only the cross-host bytes coded. Bytes across hosts per rank: 2(H-1)/H x
// blockBytes(w, shard). Results bitwise equal on all ranks. r_out may alias r_in.
void allreduceEFTwoLevel(const Comm& comm, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t n,
                         codec::Wire w, const HostLevel& host);
// Whether the error-feedback op of n elements runs allreduceEFTwoLevel: comm has a two-level plan
// (allreduceAlgo: TwoLevel) and either the wire is FP16 / INT8 or two-level is forced
// (Comm::Algo::TwoLevel). BF16 under Auto keeps the compressed topology ring: on the emulated
// cluster (benchmarks/topology.py, 2 racks x 2 hosts x 2 ranks, 16 MiB DDP step) the ring took 749
// ms against two-level's 1062, while int8 took 709 ms two-level (half the ring's cross-rack bytes)
// and fp16 871, against 811-1478 ms for their direct form.
bool efTwoLevel(const Comm& comm, int64_t n, codec::Wire w);

// Broadcast `bytes` at `data` from group rank `root` along the ring (pipelined chain of segments).
void broadcast(const Comm& comm, const OpCtx& ctx, void* data, uint64_t bytes, int root);

// Ring allgather: blocks[r] is rank r's block (this rank's must already hold its input); after the
// call every block holds its owner's bytes. Block sizes must agree across ranks.
void allgather(const Comm& comm, const OpCtx& ctx, const std::vector<transport::RecvSeg>& blocks);

// Ring reduce-scatter: `data` holds this rank's full input as blocks (blocks[r] = the part rank r
// ends with, in elements of `wire`); on return blocks[rank] holds the reduction. Other blocks are
// clobbered.
void reduceScatter(const Comm& comm, const OpCtx& ctx, const std::vector<transport::RecvSeg>& blocks,
                   DType wire, ReduceOp op);

// Every rank sends sends[r] to rank r and receives recvs[r] from rank r, all at once (own block
// copied locally). Sizes must match pairwise.
void alltoall(const Comm& comm, const OpCtx& ctx, const std::vector<transport::SendSeg>& sends,
              const std::vector<transport::RecvSeg>& recvs);

// Gather to root: non-roots send `mine`; root receives blocks[r] from each r (its own copied).
void gather(const Comm& comm, const OpCtx& ctx, transport::SendSeg mine,
            const std::vector<transport::RecvSeg>& blocks, int root);
// Scatter from root: root sends blocks[r] to r (own copied into `mine`); others receive `mine`.
void scatter(const Comm& comm, const OpCtx& ctx, const std::vector<transport::SendSeg>& blocks,
             transport::RecvSeg mine, int root);

// Elastic mode's completion round: every member sends an empty Ack frame (op Ack, ctx.seq) to
// every other member and receives one from each. A rank sends its ack only once it holds the
// operation's result, so a rank that receives all of them knows every member holds it.
void ack(const Comm& comm, const OpCtx& ctx);

}  // namespace xirang
