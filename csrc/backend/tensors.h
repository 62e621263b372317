// The torch side of an operation's arguments: dtype and reduce-op mapping to the core's, the
// checks every entry point runs on its tensors, and XR_CHECK, which writes the prefix every
// backend error carries ("xirang rank R: ") once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "core/dtype.h"

// TORCH_CHECK (c10::Error, Python RuntimeError) with the message "xirang rank <rank>: <args...>".
// The arguments are evaluated only when the check fails.
#define XR_CHECK(rank, cond, ...) TORCH_CHECK(cond, "xirang rank ", rank, ": ", __VA_ARGS__)

namespace xirang {

// The same prefix for a message built as a string: "xirang rank <rank>: ".
std::string rankPrefix(int rank);

DType toDType(at::ScalarType t);  // DType::Bytes for a dtype the core does not reduce
// Throws c10::Error for an op c10d adds later.
ReduceOp toReduceOp(const c10d::ReduceOp& op);
// PREMUL_SUM's factor (a double or a one-element tensor). Throws c10::Error without one.
double premulFactor(const c10d::ReduceOp& op);
// premulFactor() for PREMUL_SUM, else 1.
double scaleOf(const c10d::ReduceOp& op, ReduceOp mapped);

inline bool is16BitFloat(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }
inline uint64_t nbytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// Every tensor of `ts` is defined, dense and on the CPU; else c10::Error naming rank and op.
// cuda_ok: CUDA tensors are the caller's to handle (point-to-point stages them itself; the NCCL
// engine's stage binds them as they are: OpStage::bindsDevice(); only in a build with the CUDA path).
void checkTensors(int rank, const char* op, const std::vector<at::Tensor>& ts, bool cuda_ok = false);
void checkSameType(int rank, const char* op, const at::Tensor& a, const at::Tensor& b);
// `r` is defined on tensors of dtype `t` (16-bit floats reduce as float32).
void checkReduce(int rank, const char* op, at::ScalarType t, ReduceOp r);
// gather's outputs / scatter's inputs: on the root, the one list of `size` tensors (`theirs`:
// "output" / "input") like `mine` in dtype and numel; elsewhere none (returns an empty list).
std::vector<at::Tensor> rootList(int rank, int size, int root, const char* op, const at::Tensor& mine,
                                 const std::vector<std::vector<at::Tensor>>& lists, const char* theirs,
                                 const char* ours, bool cuda_ok = false);
// alltoall_base's row counts per rank: `splits` checked against t's dim 0, or dim 0 split evenly.
std::vector<int64_t> alltoallRows(int rank, int size, const at::Tensor& t, const std::vector<int64_t>& splits,
                                  const char* which);

}  // namespace xirang
