// The collectives over shared memory (transport/shm.h) for the ranks of one host, and the
// two-level allreduce that uses them inside a host.
//
// The reduction is the one that suits shared memory (DeepSpeed's CPU shm allreduce, NCCL's SHM
// transport) rather than a ring of copies. The message is cut into n lanes (n = local ranks;
// allreduce: the ring's chunks, reduce-scatter: the output blocks), local rank j reduces lane j,
// and the lanes go through the segment in pieces: every rank copies its piece of every other
// rank's lane into that lane's slot (a reduce-scatter and a 16-bit allreduce its own lane's too);
// barrier; each rank reduces its lane's n copies straight from its slot (its own copy from its
// buffer) and writes the result once (an allreduce: into the slot and over its own copy);
// barrier; everyone copies every other lane's result out (allreduce; a reduce-scatter writes its
// result into its own block instead). Two barriers and one read of each input per piece; 16-bit
// floats are accumulated in fp32 and rounded once.
//
// Bits: every result is bitwise identical on all ranks and bitwise equal to what the TCP engine
// (collectives.h) computes for the same inputs and the same Comm, because the order in which an
// element's contributions are combined is free here and is chosen to be the engine's: rank order
// where the engine runs the direct exchange or allreduce16, the ring's order (from the first
// position of the element's ring chunk, with the ring's operand roles) where it runs the ring,
// and the same AVG / PREMUL_SUM scaling (planner.h: the same plan runs on these algorithms).
//
// Agreement: every operation starts with a record (what a TCP frame header carries: op, dtype,
// reduce op, element count, sequence number, root; the algorithm; the bytes each rank sends to
// and expects from every other) that every rank compares with every other's after the first
// barrier: a disagreement throws MismatchError on every local rank, naming the field and both
// values, before any rank reads data. Sizes are bytes unless the name says elements.
//
// Every function is collective over the local ranks of `d` and is called by each of them with
// the same OpCtx fields. `comm` is what the engine would be given (comm.rank == d.rank(); its ring
// holds exactly d.ranks() unless stated otherwise; small_bytes and algo choose the fold order as
// they choose the engine's algorithm; its reducer must work on host memory). Errors: those of
// ShmDomain's waits (TransportError naming a dead, aborted or unreachable rank, TimeoutError at
// ctx.deadline), MismatchError, std::invalid_argument for arguments no rank could run. After a
// throw the domain is unusable: the caller aborts it (ShmDomain::abort) and its peers fail too.
#pragma once

#include <cstdint>
#include <vector>

#include "core/collectives.h"
#include "core/planner.h"
#include "core/transport/shm.h"

namespace xirang::shm {

using transport::RecvSeg;
using transport::SendSeg;
using transport::ShmDomain;

// planner.h's allreduceOp (every ReduceOp the dtype has, AVG / PREMUL_SUM with `premul`, 16-bit
// floats widened or reduced in fp32 as the plan says) on the algorithms below: `numel` elements
// of `dtype` at `data`, in place. Where `d` holds only part of comm.ring, see allreduce().
void allreduceOp(const Comm& comm, ShmDomain& d, const OpCtx& ctx, void* data, int64_t numel, DType dtype, ReduceOp op,
                 double premul = 1.0);

// collectives.h's allreduce (no 16-bit floats; Sum, Product, Min, Max, BAnd, BOr, BXor) in place.
// If `d` holds all of comm.ring: over shared memory. If it holds comm.local_group and the engine
// would run the two-level allreduce: reduce-scatter over shared memory, the shards' allreduce
// across hosts over comm.link (comm.cross_group), allgather over shared memory (bitwise the
// engine's two-level result). Otherwise the engine's algorithm over comm.link.
void allreduce(const Comm& comm, ShmDomain& d, const OpCtx& ctx, void* data, int64_t numel, DType wire, ReduceOp op);

// collectives.h's allreduce16 (t = Float16 or BFloat16): every element's n contributions times
// pre_scale combined in fp32 in rank order, times post_scale, rounded once. If `d` does not hold
// all of comm.ring, the engine's allreduce16 over comm.link.
void allreduce16(const Comm& comm, ShmDomain& d, const OpCtx& ctx, uint16_t* data, int64_t numel, DType t, ReduceOp op,
                 float pre_scale, float post_scale);

// collectives.h's reduceScatter: blocks[r] (indexed by group rank) is the part of this rank's
// input that rank r ends with, in elements of `wire` (not 16-bit floats); on return
// blocks[rank] holds the reduction (the ring's fold order), the other blocks are unchanged.
// Block sizes may differ between ranks' blocks but must agree across ranks.
void reduceScatter(const Comm& comm, ShmDomain& d, const OpCtx& ctx, const std::vector<RecvSeg>& blocks, DType wire,
                   ReduceOp op);

// collectives.h's allgather: blocks[r] (by group rank) receives rank r's block; this rank's must
// hold its input.
void allgather(const Comm& comm, ShmDomain& d, const OpCtx& ctx, const std::vector<RecvSeg>& blocks);

// `bytes` at `data` from group rank `root` to every local rank.
void broadcast(const Comm& comm, ShmDomain& d, const OpCtx& ctx, void* data, uint64_t bytes, int root);

// Every rank sends sends[r] to rank r and receives recvs[r] from it (by group rank; sizes may
// differ per pair and must match pairwise; the own block is copied locally).
void alltoall(const Comm& comm, ShmDomain& d, const OpCtx& ctx, const std::vector<SendSeg>& sends,
              const std::vector<RecvSeg>& recvs);

// Gather to `root`: every rank sends `mine`; the root receives blocks[r] from each rank r (its
// own copied from `mine`).
void gather(const Comm& comm, ShmDomain& d, const OpCtx& ctx, SendSeg mine, const std::vector<RecvSeg>& blocks,
            int root);

// Scatter from `root`: rank r receives blocks[r] into `mine` (the root copies its own).
void scatter(const Comm& comm, ShmDomain& d, const OpCtx& ctx, const std::vector<SendSeg>& blocks, RecvSeg mine,
             int root);

// Every local rank has reached it (one barrier, with the agreement check).
void barrier(const Comm& comm, ShmDomain& d, const OpCtx& ctx);

// The hook's error-feedback op (collectives.h: allreduceBF16EF) for a group whose ranks are all
// on this host, where bytes cost nothing to speak of: no bf16, no rounding to feed back. On
// return x (n fp32 elements) holds sum_i (x_i / N + r_in_i), every rank's addition done in fp32
// by the fp32 allreduce (bitwise identical on all ranks), and r_out holds 0 (r_out may alias
// r_in). So with y_t the output of step t, sum_t y_t + sum_i r_i = sum_t sum_i x_i,t / N up to
// fp32 rounding, as on the compressed ring.
void allreduceEF(const Comm& comm, ShmDomain& d, const OpCtx& ctx, float* x, const float* r_in, float* r_out,
                 int64_t n);

// planner.h's Collectives over comm.shm (collectivesFor returns it when comm.shm is set): every
// operation over shared memory when the domain holds all of comm.ring; where it holds only part
// (several hosts), allreduce as allreduceOp above (the host level of two-level over shared
// memory) and every other operation linkCollectives()'s over comm.link.
const Collectives& collectives();

}  // namespace xirang::shm
