#include "backend/tensors.h"

#include "core/reduce.h"

namespace xirang {

std::string rankPrefix(int rank) { return "xirang rank " + std::to_string(rank) + ": "; }

DType toDType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kChar: return DType::Int8;
    case at::kShort: return DType::Int16;
    case at::kInt: return DType::Int32;
    case at::kLong: return DType::Int64;
    case at::kByte: return DType::UInt8;
    case at::kBool: return DType::Bool;
    case at::kComplexFloat: return DType::Complex64;
    case at::kComplexDouble: return DType::Complex128;
    case at::kComplexHalf: return DType::Complex32;
    default: return DType::Bytes;
  }
}

ReduceOp toReduceOp(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::Sum;
    case c10d::ReduceOp::AVG: return ReduceOp::Avg;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::Product;
    case c10d::ReduceOp::MIN: return ReduceOp::Min;
    case c10d::ReduceOp::MAX: return ReduceOp::Max;
    case c10d::ReduceOp::BAND: return ReduceOp::BAnd;
    case c10d::ReduceOp::BOR: return ReduceOp::BOr;
    case c10d::ReduceOp::BXOR: return ReduceOp::BXor;
    case c10d::ReduceOp::PREMUL_SUM: return ReduceOp::PremulSum;
    default: TORCH_CHECK(false, "xirang: unsupported reduce op ", static_cast<int>(op.op_));
  }
}

double premulFactor(const c10d::ReduceOp& op) {
  // NCCLPreMulSumSupplement: torch 2.11's name; later ones keep it as an alias of PreMulSumSupplement.
  auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(sup != nullptr, "xirang: PREMUL_SUM without a factor");
  if (sup->tensor_factor.defined()) return sup->tensor_factor.item<double>();
  return sup->double_factor;
}

double scaleOf(const c10d::ReduceOp& op, ReduceOp mapped) {
  return mapped == ReduceOp::PremulSum ? premulFactor(op) : 1.0;
}

void checkTensors(int rank, const char* op, const std::vector<at::Tensor>& ts, bool cuda_ok) {
  for (const auto& t : ts) {
    XR_CHECK(rank, t.defined(), op, ": undefined tensor");
    if (t.is_cuda()) {
#ifndef XIRANG_WITH_CUDA
      (void)cuda_ok;
      XR_CHECK(rank, false, op,
               ": got a CUDA tensor, but the CUDA path is not built in this xirang "
               "(build_info()['cuda'] is None); use CPU tensors or 'cpu:xirang,cuda:nccl'");
#else
      if (cuda_ok) {
        XR_CHECK(rank, t.layout() == at::kStrided, op, ": sparse tensors are not supported");
        continue;
      }
      XR_CHECK(rank, false, op,
               ": CUDA tensors are not supported by this operation yet (the host-staged CUDA path covers "
               "all_reduce, all_reduce_coalesced, broadcast, reduce, all_gather, all_gather_coalesced, "
               "all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, all_to_all, all_to_all_single, "
               "gather, scatter, send, recv and allreduce_ef); "
               "use CPU tensors or 'cpu:xirang,cuda:nccl'");
#endif
    }
    XR_CHECK(rank, t.device().is_cpu(), op, ": tensors must be on the CPU, got ", t.device());
    XR_CHECK(rank, t.layout() == at::kStrided, op, ": tensors must be dense (strided), got layout ", t.layout(),
             "; of the sparse layouts only sparse COO in allreduce (ReduceOp.SUM) is supported");
  }
}

void checkSameType(int rank, const char* op, const at::Tensor& a, const at::Tensor& b) {
  XR_CHECK(rank, a.scalar_type() == b.scalar_type(), op, ": dtype mismatch between tensors: ", a.scalar_type(),
           " vs ", b.scalar_type());
}

void checkReduce(int rank, const char* op, at::ScalarType t, ReduceOp r) {
  DType d = toDType(t);
  if (d == DType::Float16 || d == DType::BFloat16) d = DType::Float32;
  XR_CHECK(rank, checkReduceOp(d, r).empty(), op, ": ", reduceOpName(r), " is not defined on ", c10::toString(t));
}

std::vector<at::Tensor> rootList(int rank, int size, int root, const char* op, const at::Tensor& mine,
                                 const std::vector<std::vector<at::Tensor>>& lists, const char* theirs,
                                 const char* ours, bool cuda_ok) {
  if (rank != root) {
    XR_CHECK(rank, lists.empty() || lists[0].empty(), op, ": only the root passes ", theirs, " tensors");
    return {};
  }
  XR_CHECK(rank, lists.size() == 1 && static_cast<int>(lists[0].size()) == size, op, ": the root needs a list of ",
           size, " ", theirs, " tensors");
  checkTensors(rank, op, lists[0], cuda_ok);
  for (const auto& t : lists[0]) {
    checkSameType(rank, op, mine, t);
    XR_CHECK(rank, t.numel() == mine.numel(), op, ": ", theirs, " has ", t.numel(), " elements, ", ours, " ",
             mine.numel());
  }
  return lists[0];
}

std::vector<int64_t> alltoallRows(int rank, int size, const at::Tensor& t, const std::vector<int64_t>& splits,
                                  const char* which) {
  const int64_t dim0 = t.dim() == 0 ? 1 : t.size(0);
  if (splits.empty()) {
    XR_CHECK(rank, dim0 % size == 0, "alltoall_base: ", which, " dim 0 (", dim0, ") is not divisible by world size ",
             size);
    return std::vector<int64_t>(size, dim0 / size);
  }
  XR_CHECK(rank, static_cast<int>(splits.size()) == size, "alltoall_base: ", which, " splits have ", splits.size(),
           " entries, expected ", size);
  int64_t sum = 0;
  for (size_t i = 0; i < splits.size(); ++i) {  // bounded, so the sum cannot overflow
    XR_CHECK(rank, splits[i] >= 0 && splits[i] <= dim0, "alltoall_base: ", which, " split ", i, " is ", splits[i],
             ": splits must be in 0..", dim0, " (dim 0)");
    sum += splits[i];
  }
  XR_CHECK(rank, sum == dim0, "alltoall_base: ", which, " splits sum to ", sum, ", dim 0 is ", dim0);
  return splits;
}

}  // namespace xirang
