// The host engine (device_engine.h): the body of every operation on host tensors, run on the
// communication thread (a small synchronous one: on the caller's, op_queue.h) by the collectives of
// the op's transport (core/planner.h: collectivesFor: shared memory, core/algorithms/shm.h, when
// comm.shm is set, else comm.link's engine, core/collectives.h); the results are bitwise the same,
// except the hook's op, which is fp32 over shared memory (no BF16 rounding; the new residual is 0).
// The c10d entry points have checked the arguments; these functions stage non-contiguous tensors
// into contiguous buffers, call the algorithm and write the results back. The CUDA engines run the
// same functions: the mirror engine on its pinned host mirrors, the staged and NCCL engines on the
// device tensors.
//
// `size` is the group's world size (buffers hold one block per group rank); comm.ring the ranks
// taking part (fewer after an elastic membership change).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/collectives.h"

namespace xirang::host {

// The reduce `op` of the user's dtype on an fp32-or-native buffer, with AVG / PREMUL_SUM
// scaling: core/planner.h's allreduceOp, which chooses how a reduction runs (widening 16-bit
// floats vs allreduce16, scaling before the sum).
void reduceAll(const Comm& comm, const OpCtx& ctx, at::Tensor& buf, ReduceOp op, double premul);

void allreduce(const Comm& comm, const OpCtx& ctx, const at::Tensor& t, ReduceOp op, double premul);
// The tensors reduced as one flat buffer (they share a dtype).
void allreduceCoalesced(const Comm& comm, const OpCtx& ctx, const std::vector<at::Tensor>& ts, ReduceOp op,
                        double premul);

// Sparse allreduce's metadata: one fixed-size int64 record per rank, allgathered first:
// [0] sparse_dim, [1] dense_dim, [2] nnz, [3] dim, [4, 4 + dim) sizes.
constexpr int64_t kSparseMaxDims = 64;
// The sum of one sparse COO CPU tensor `t` over the ranks, written into t (see the .cc).
void allreduceSparse(const Comm& comm, const OpCtx& ctx, const at::Tensor& t, int size);

// The hook's op: pack_into[i].copy_(pack_from[i]) (the layer group's gradients into views of
// buffer / plain; timed as ctx.phases->pack_s), the error-feedback average of `buffer` in wire
// format `wire` (planner.h: Collectives::allreduceEF), then the plain average of each `plain`
// tensor in its own dtype.
void allreduceEF(const Comm& comm, const OpCtx& ctx, const at::Tensor& buffer, const at::Tensor& residual,
                 const at::Tensor& staged, const std::vector<at::Tensor>& plain, codec::Wire wire,
                 const std::vector<at::Tensor>& pack_into = {}, const std::vector<at::Tensor>& pack_from = {});

void broadcast(const Comm& comm, const OpCtx& ctx, const at::Tensor& t, int root);
// Allreduce into a private buffer; only the root writes t.
void reduce(const Comm& comm, const OpCtx& ctx, const at::Tensor& t, ReduceOp op, double premul, int root);

// output: `size` blocks of input's numel, block r rank r's input.
void allgatherBase(const Comm& comm, const OpCtx& ctx, const at::Tensor& output, const at::Tensor& input, int size);
void allgather(const Comm& comm, const OpCtx& ctx, const std::vector<at::Tensor>& outs, const at::Tensor& in,
               int size);
// outs[r][i] receives rank r's ins[i]; `bytes`: the inputs' total bytes (every rank's).
void allgatherCoalesced(const Comm& comm, const OpCtx& ctx, const std::vector<at::Tensor>& ins,
                        const std::vector<std::vector<at::Tensor>>& outs, uint64_t bytes, int size);

// output = the reduction of block `rank` of every rank's input: `size` blocks, counts[r] elements
// for rank r, in rank order (output has counts[rank]; input the sum).
void reduceScatterBase(const Comm& comm, const OpCtx& ctx, const at::Tensor& output, const at::Tensor& input,
                       const std::vector<int64_t>& counts, ReduceOp op, double premul, int size);

// Rows in_rows[r] of input go to rank r; out_rows[r] rows of output come from rank r.
void alltoallBase(const Comm& comm, const OpCtx& ctx, const at::Tensor& output, const at::Tensor& input,
                  const std::vector<int64_t>& in_rows, const std::vector<int64_t>& out_rows, int size);
void alltoall(const Comm& comm, const OpCtx& ctx, const std::vector<at::Tensor>& outs,
              const std::vector<at::Tensor>& ins, int size);

// outs: the root's output tensors (empty elsewhere) / ins: the root's inputs (empty elsewhere).
void gather(const Comm& comm, const OpCtx& ctx, const at::Tensor& in, const std::vector<at::Tensor>& outs, int root);
void scatter(const Comm& comm, const OpCtx& ctx, const at::Tensor& out, const std::vector<at::Tensor>& ins, int root);

void barrier(const Comm& comm, const OpCtx& ctx);

}  // namespace xirang::host
