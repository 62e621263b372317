// Which algorithm an operation takes and how AVG / PREMUL_SUM are applied: the policy, in one
// place, above the algorithms (collectives.h) and below the backend.
//
// Allreduce (planAllreduce):
//   * 16-bit floats (float16, bfloat16) are rounded once, never at every hop. Where the topology
//     matters (a forced ring or two-level algorithm, or a two-level plan exists) they are widened
//     to fp32 and reduced by that algorithm on fp32 partial sums (twice the bytes), then rounded;
//     otherwise the direct reduce-scatter in 16 bits with fp32 accumulation at each chunk's owner
//     (allreduce16: 16 bits on the wire, PREMUL's factor on every input and AVG's 1/N on the sum).
//   * other dtypes: AVG divides every input by N before the sum (N values near the dtype's
//     maximum average to a finite number instead of overflowing), PREMUL_SUM multiplies every
//     input by its factor, then SUM; the algorithm by size and topology (collectives.h: allreduce).
// Reduce-scatter takes the same scaling (scalingFor).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/collectives.h"
#include "core/dtype.h"

namespace xirang {

// How an op's AVG / PREMUL_SUM becomes a plain reduction: the op the algorithm runs and the
// factor every input is multiplied by first (1 for the other ops).
struct Scaling {
  ReduceOp wire_op = ReduceOp::Sum;
  double factor = 1.0;
};
// AVG -> (Sum, 1/world_size); PREMUL_SUM -> (Sum, premul); any other op -> (op, 1).
Scaling scalingFor(ReduceOp op, double premul, int world_size);

struct AllreducePlan {
  enum class Path {
    Native,    // the dtype itself through allreduce() (direct / ring / two-level by size)
    Widened,   // 16-bit floats widened to fp32, allreduce() on fp32, rounded once
    Direct16,  // 16-bit floats: allreduce16 (fp32 accumulation at the owner, one rounding)
  } path = Path::Native;
  ReduceOp wire_op = ReduceOp::Sum;
  double pre_scale = 1.0;   // every input, before the reduction (Native, Widened: in the dtype / fp32)
  float post_scale = 1.0f;  // Direct16 only: AVG's 1/N on the fp32 result
};
AllreducePlan planAllreduce(const Comm& comm, DType dtype, ReduceOp op, double premul);
const char* pathName(AllreducePlan::Path p);

// The one allreduce entry: plans and runs it in place on `numel` elements of `dtype` at `data`
// (any ReduceOp the dtype allows, AVG and PREMUL_SUM with `premul` included). Results are
// bitwise identical on all ranks. Throws std::invalid_argument for an op the dtype does not have.
void allreduceOp(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType dtype, ReduceOp op,
                 double premul = 1.0);

// What a plan runs on: `native` reduces numel elements of a non-16-bit dtype in place with a
// plain op (allreduce()'s contract), `direct16` is allreduce16's contract. allreduceOp above
// runs the engine's (over comm.link); the shared-memory algorithms (algorithms/shm.h) pass theirs.
struct AllreduceImpl {
  std::function<void(void* data, int64_t numel, DType wire, ReduceOp op)> native;
  // Optional: native on data times `scale` (AVG's 1/N, PREMUL_SUM's factor), bitwise the
  // reducer's scale() over the whole buffer and then native, with the scaling fused into the
  // algorithm's own passes over the data where it can (shared memory: one read and write of the
  // message less). Without it, allreduceOp scales first.
  std::function<void(void* data, int64_t numel, DType wire, ReduceOp op, double scale)> scaled_native;
  std::function<void(uint16_t* data, int64_t numel, DType t, ReduceOp op, float pre_scale, float post_scale)> direct16;
};
// allreduceOp with the algorithms of `impl`: the same checks, plan, widening and scaling.
void allreduceOp(const Comm& comm, const AllreduceImpl& impl, void* data, int64_t numel, DType dtype, ReduceOp op,
                 double premul = 1.0);

// The collectives of one operation, by the transport that carries its bytes: the engine's over
// comm.link (collectives.h: linkCollectives) or those over shared memory (algorithms/shm.h:
// shm::collectives) when comm.shm is set. collectivesFor is the one place that chooses; the
// backend calls what it returns. Arguments, results and errors as the collectives.h functions
// of the same names (allreduce: allreduceOp above; allreduceEF: allreduceBF16EF's contract, which
// over shared memory is the exact fp32 average with a zero residual: shm.h's allreduceEF).
class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual void allreduce(const Comm& c, const OpCtx& ctx, void* data, int64_t numel, DType dtype, ReduceOp op,
                         double premul) const = 0;
  // wire: where collectives.h's efTwoLevel says so (a two-level plan, and FP16 / INT8 or a forced
  // two-level), allreduceEFTwoLevel (fp32 inside hosts, `wire` across them; over shared memory
  // inside hosts when comm.shm covers the host); else BF16 runs the compressed ring
  // (allreduceBF16EF), FP16 and INT8 the direct form (allreduceEFDirect); a group inside one host
  // over shared memory is the exact fp32 average.
  virtual void allreduceEF(const Comm& c, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t n,
                           codec::Wire wire) const = 0;
  virtual void reduceScatter(const Comm& c, const OpCtx& ctx, const std::vector<transport::RecvSeg>& blocks,
                             DType wire, ReduceOp op) const = 0;
  virtual void allgather(const Comm& c, const OpCtx& ctx, const std::vector<transport::RecvSeg>& blocks) const = 0;
  virtual void broadcast(const Comm& c, const OpCtx& ctx, void* data, uint64_t bytes, int root) const = 0;
  virtual void alltoall(const Comm& c, const OpCtx& ctx, const std::vector<transport::SendSeg>& sends,
                        const std::vector<transport::RecvSeg>& recvs) const = 0;
  virtual void gather(const Comm& c, const OpCtx& ctx, transport::SendSeg mine,
                      const std::vector<transport::RecvSeg>& blocks, int root) const = 0;
  virtual void scatter(const Comm& c, const OpCtx& ctx, const std::vector<transport::SendSeg>& blocks,
                       transport::RecvSeg mine, int root) const = 0;
  virtual void barrier(const Comm& c, const OpCtx& ctx) const = 0;
};
// The engine's collectives over comm.link (a stateless singleton).
const Collectives& linkCollectives();
// shm::collectives() when comm.shm is set and comm has more than one rank, else linkCollectives().
const Collectives& collectivesFor(const Comm& comm);

}  // namespace xirang
