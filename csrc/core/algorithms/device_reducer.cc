#include "core/algorithms/device_reducer.h"

#include <stdexcept>
#include <string>

namespace xirang::algo {

using device::Kernel;

void DeviceReducer::run(const Kernel& k) {
  const std::string bad = device::checkKernel(k);
  if (!bad.empty()) throw std::invalid_argument("xirang: device reducer: " + bad);
  const int e = kernels_.launch(k, stream_);
  if (e != device::kCudaSuccess)
    throw std::runtime_error(std::string("xirang: device reducer: launching kernel ") + device::kernelName(k.kind) +
                             " (" + std::to_string(k.n) + " elements) failed: CUDA error " + std::to_string(e) + " (" +
                             cuda_.errorString(e) + ")");
}

Buffer DeviceReducer::allocate(size_t bytes) {
  void* p = nullptr;
  const int e = cuda_.mallocAsync(&p, bytes, stream_);
  if (e != device::kCudaSuccess)
    throw std::runtime_error("xirang: device reducer: cudaMallocAsync of " + std::to_string(bytes) +
                             " bytes failed: CUDA error " + std::to_string(e) + " (" + cuda_.errorString(e) + ")");
  device::CudaApi* cuda = &cuda_;
  device::Stream s = stream_;
  return Buffer(static_cast<uint8_t*>(p), [cuda, s](uint8_t* q) { (void)cuda->freeAsync(q, s); });
}

void DeviceReducer::reduceInto(void* dst, const void* src, int64_t n, DType t, ReduceOp op) {
  run(Kernel::reduce(dst, src, n, t, op));
}

void DeviceReducer::scale(void* x, int64_t n, DType t, double factor) { run(Kernel::scaleBy(x, n, t, factor)); }

void DeviceReducer::copy(void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0 || dst == src) return;
  const int e = cuda_.memcpyAsync(dst, src, bytes, stream_);
  if (e != device::kCudaSuccess)
    throw std::runtime_error("xirang: device reducer: cudaMemcpyAsync of " + std::to_string(bytes) +
                             " bytes failed: CUDA error " + std::to_string(e) + " (" + cuda_.errorString(e) + ")");
}

void DeviceReducer::encodeEF(const float* x, float s, const float* r_in, float* r_out, uint16_t* out, int64_t n) {
  run(Kernel::encodeEF(x, s, r_in, r_out, out, n));
}

void DeviceReducer::accumulateEncodeEF(const uint16_t* in, const float* x, float s, const float* r_in, float* r_out,
                                       uint16_t* out, int64_t n) {
  run(Kernel::accumulateEncodeEF(in, x, s, r_in, r_out, out, n));
}

void DeviceReducer::decode(const uint16_t* in, float* out, int64_t n) { run(Kernel::decode(in, out, n)); }

void DeviceReducer::decodeAccumulate(const uint16_t* in, float* acc, int64_t n) {
  run(Kernel::decodeAccumulate(in, acc, n));
}

void DeviceReducer::scaledEncodeEF(codec::Wire w, const float* x, float s, const float* r_in, float* r_out,
                                   uint8_t* block, int64_t n) {
  run(Kernel::scaledEncodeEF(codec::wireDType(w), x, s, r_in, r_out, block, n));
}

void DeviceReducer::scaledDecode(codec::Wire w, const uint8_t* block, float* out, int64_t n, bool accumulate) {
  run(Kernel::scaledDecode(codec::wireDType(w), block, out, n, accumulate));
}

void DeviceReducer::combine16(const uint16_t* slots, int contributors, int64_t count, DType t, ReduceOp op, float pre,
                              float post, uint16_t* out) {
  run(Kernel::combine16(slots, contributors, count, t, op, pre, post, out));
}

void DeviceReducer::widen(const uint16_t* in, float* out, int64_t n, DType t) { run(Kernel::widen16(in, out, n, t)); }

void DeviceReducer::narrow(const float* in, uint16_t* out, int64_t n, DType t) {
  run(Kernel::narrow16(in, out, n, t));
}

}  // namespace xirang::algo
