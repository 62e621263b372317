// An algo::Reducer on device memory: every operation is a kernel (device/kernels.h, through a
// KernelApi) or a copy enqueued on one stream, the stream of the device link the algorithm runs
// over (transport/nccl_link.h), so the core's algorithms run unchanged with their data on the
// GPU. Nothing waits: results are there for later work on the same stream. The kernels' element
// arithmetic is the host reducer's (core/elements.h), so both give the same bits for the same
// inputs (NaN payloads aside where two NaNs meet: codec.h).
//
// allocate() takes stream-ordered device memory (cudaMallocAsync) and returns it stream-ordered
// (cudaFreeAsync), so a scratch buffer replaced while kernels still read it stays valid for them.
// copy() is an asynchronous device-to-device copy; source and destination must not overlap
// unless they are the same pointer (then nothing is done). Errors (a launch refused, an invalid
// dtype / op) throw std::runtime_error / std::invalid_argument naming the kernel and the CUDA error.
#pragma once

#include "core/algorithms/reducer.h"
#include "core/device/api.h"

namespace xirang::algo {

class DeviceReducer : public Reducer {
 public:
  DeviceReducer(device::CudaApi& cuda, device::KernelApi& kernels, device::Stream stream)
      : cuda_(cuda), kernels_(kernels), stream_(stream) {}
  device::Stream stream() const { return stream_; }

  transport::Memory memory() const override { return transport::Memory::Device; }
  Buffer allocate(size_t bytes) override;
  void reduceInto(void* dst, const void* src, int64_t n, DType t, ReduceOp op) override;
  void scale(void* x, int64_t n, DType t, double factor) override;
  void copy(void* dst, const void* src, uint64_t bytes) override;
  void encodeEF(const float* x, float scale, const float* r_in, float* r_out, uint16_t* out, int64_t n) override;
  void accumulateEncodeEF(const uint16_t* in, const float* x, float scale, const float* r_in, float* r_out,
                          uint16_t* out, int64_t n) override;
  void decode(const uint16_t* in, float* out, int64_t n) override;
  void decodeAccumulate(const uint16_t* in, float* acc, int64_t n) override;
  void scaledEncodeEF(codec::Wire w, const float* x, float scale, const float* r_in, float* r_out, uint8_t* block,
                      int64_t n) override;
  void scaledDecode(codec::Wire w, const uint8_t* block, float* out, int64_t n, bool accumulate) override;
  void combine16(const uint16_t* slots, int contributors, int64_t count, DType t, ReduceOp op, float pre, float post,
                 uint16_t* out) override;
  void widen(const uint16_t* in, float* out, int64_t n, DType t) override;
  void narrow(const float* in, uint16_t* out, int64_t n, DType t) override;

 private:
  void run(const device::Kernel& k);
  device::CudaApi& cuda_;
  device::KernelApi& kernels_;
  device::Stream stream_;
};

}  // namespace xirang::algo
