#include "core/planner.h"

#include <stdexcept>

#include "core/algorithms/shm.h"
#include "core/reduce.h"

namespace xirang {

namespace {
bool is16BitFloat(DType t) { return t == DType::Float16 || t == DType::BFloat16; }
}  // namespace

Scaling scalingFor(ReduceOp op, double premul, int world_size) {
  if (op == ReduceOp::Avg) return {ReduceOp::Sum, 1.0 / static_cast<double>(world_size)};
  if (op == ReduceOp::PremulSum) return {ReduceOp::Sum, premul};
  return {op, 1.0};
}

const char* pathName(AllreducePlan::Path p) {
  switch (p) {
    case AllreducePlan::Path::Native: return "native";
    case AllreducePlan::Path::Widened: return "widened";
    case AllreducePlan::Path::Direct16: return "direct16";
  }
  return "unknown";
}

AllreducePlan planAllreduce(const Comm& comm, DType dtype, ReduceOp op, double premul) {
  AllreducePlan p;
  const Scaling s = scalingFor(op, premul, comm.size());
  p.wire_op = s.wire_op;
  if (!is16BitFloat(dtype)) {
    p.pre_scale = s.factor;
    return p;
  }
  const bool keep_topology = comm.algo == Comm::Algo::Ring || comm.algo == Comm::Algo::TwoLevel ||
                             !comm.local_group.empty();
  if (keep_topology) {
    p.path = AllreducePlan::Path::Widened;
    p.pre_scale = s.factor;
    return p;
  }
  p.path = AllreducePlan::Path::Direct16;
  p.pre_scale = op == ReduceOp::PremulSum ? premul : 1.0;
  p.post_scale = op == ReduceOp::Avg ? 1.0f / static_cast<float>(comm.size()) : 1.0f;
  return p;
}

void allreduceOp(const Comm& comm, const OpCtx& ctx, void* data, int64_t numel, DType dtype, ReduceOp op,
                 double premul) {
  AllreduceImpl engine;
  engine.native = [&](void* d, int64_t n, DType wire, ReduceOp o) { allreduce(comm, ctx, d, n, wire, o); };
  engine.direct16 = [&](uint16_t* d, int64_t n, DType t, ReduceOp o, float pre, float post) {
    allreduce16(comm, ctx, d, n, t, o, pre, post);
  };
  allreduceOp(comm, engine, data, numel, dtype, op, premul);
}

void allreduceOp(const Comm& comm, const AllreduceImpl& impl, void* data, int64_t numel, DType dtype, ReduceOp op,
                 double premul) {
  const std::string err = checkReduceOp(is16BitFloat(dtype) ? DType::Float32 : dtype, op);
  if (!err.empty()) throw std::invalid_argument("xirang: allreduce: " + err);
  const AllreducePlan p = planAllreduce(comm, dtype, op, premul);
  algo::Reducer& red = *comm.reducer;
  // native on buf times pre_scale: fused where the algorithms offer it, else a scale pass first.
  auto scaledNative = [&](void* buf, DType wire) {
    if (p.pre_scale == 1.0) return impl.native(buf, numel, wire, p.wire_op);
    if (impl.scaled_native) return impl.scaled_native(buf, numel, wire, p.wire_op, p.pre_scale);
    red.scale(buf, numel, wire, p.pre_scale);
    impl.native(buf, numel, wire, p.wire_op);
  };
  switch (p.path) {
    case AllreducePlan::Path::Direct16:
      impl.direct16(static_cast<uint16_t*>(data), numel, dtype, p.wire_op, static_cast<float>(p.pre_scale), p.post_scale);
      return;
    case AllreducePlan::Path::Widened: {
      float* wide = reinterpret_cast<float*>(comm.scratchBytes(3, static_cast<size_t>(numel) * sizeof(float)));
      red.widen(static_cast<const uint16_t*>(data), wide, numel, dtype);
      scaledNative(wide, DType::Float32);
      red.narrow(wide, static_cast<uint16_t*>(data), numel, dtype);
      return;
    }
    case AllreducePlan::Path::Native:
      scaledNative(data, dtype);
      return;
  }
}

namespace {
class LinkCollectives final : public Collectives {
 public:
  void allreduce(const Comm& c, const OpCtx& ctx, void* data, int64_t numel, DType dtype, ReduceOp op,
                 double premul) const override {
    allreduceOp(c, ctx, data, numel, dtype, op, premul);
  }
  void allreduceEF(const Comm& c, const OpCtx& ctx, float* x, const float* r_in, float* r_out, int64_t n,
                   codec::Wire wire) const override {
    if (efTwoLevel(c, n, wire)) return allreduceEFTwoLevel(c, ctx, x, r_in, r_out, n, wire, linkHostLevel());
    if (wire == codec::Wire::BF16) return allreduceBF16EF(c, ctx, x, r_in, r_out, n);
    allreduceEFDirect(c, ctx, x, r_in, r_out, n, wire);
  }
  void reduceScatter(const Comm& c, const OpCtx& ctx, const std::vector<transport::RecvSeg>& blocks, DType wire,
                     ReduceOp op) const override {
    xirang::reduceScatter(c, ctx, blocks, wire, op);
  }
  void allgather(const Comm& c, const OpCtx& ctx, const std::vector<transport::RecvSeg>& blocks) const override {
    xirang::allgather(c, ctx, blocks);
  }
  void broadcast(const Comm& c, const OpCtx& ctx, void* data, uint64_t bytes, int root) const override {
    xirang::broadcast(c, ctx, data, bytes, root);
  }
  void alltoall(const Comm& c, const OpCtx& ctx, const std::vector<transport::SendSeg>& sends,
                const std::vector<transport::RecvSeg>& recvs) const override {
    xirang::alltoall(c, ctx, sends, recvs);
  }
  void gather(const Comm& c, const OpCtx& ctx, transport::SendSeg mine, const std::vector<transport::RecvSeg>& blocks,
              int root) const override {
    xirang::gather(c, ctx, mine, blocks, root);
  }
  void scatter(const Comm& c, const OpCtx& ctx, const std::vector<transport::SendSeg>& blocks,
               transport::RecvSeg mine, int root) const override {
    xirang::scatter(c, ctx, blocks, mine, root);
  }
  // A barrier is the allreduce of one byte.
  void barrier(const Comm& c, const OpCtx& ctx) const override {
    uint8_t one = 1;
    xirang::allreduce(c, ctx, &one, 1, DType::UInt8, ReduceOp::Max);
  }
};
}  // namespace

const Collectives& linkCollectives() {
  static const LinkCollectives link;
  return link;
}

const Collectives& collectivesFor(const Comm& comm) {
  return comm.shm != nullptr && comm.size() > 1 ? shm::collectives() : linkCollectives();
}

}  // namespace xirang
