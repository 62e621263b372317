#include "core/planner.h"

#include <stdexcept>

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
  const std::string err = checkReduceOp(is16BitFloat(dtype) ? DType::Float32 : dtype, op);
  if (!err.empty()) throw std::invalid_argument("xirang: allreduce: " + err);
  const AllreducePlan p = planAllreduce(comm, dtype, op, premul);
  algo::Reducer& red = *comm.reducer;
  switch (p.path) {
    case AllreducePlan::Path::Direct16:
      allreduce16(comm, ctx, static_cast<uint16_t*>(data), numel, dtype, p.wire_op, static_cast<float>(p.pre_scale),
                  p.post_scale);
      return;
    case AllreducePlan::Path::Widened: {
      float* wide = reinterpret_cast<float*>(comm.scratchBytes(3, static_cast<size_t>(numel) * sizeof(float)));
      red.widen(static_cast<const uint16_t*>(data), wide, numel, dtype);
      if (p.pre_scale != 1.0) red.scale(wide, numel, DType::Float32, p.pre_scale);
      allreduce(comm, ctx, wide, numel, DType::Float32, p.wire_op);
      red.narrow(wide, static_cast<uint16_t*>(data), numel, dtype);
      return;
    }
    case AllreducePlan::Path::Native:
      if (p.pre_scale != 1.0) red.scale(data, numel, dtype, p.pre_scale);
      allreduce(comm, ctx, data, numel, dtype, p.wire_op);
      return;
  }
}

}  // namespace xirang
