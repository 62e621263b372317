// CudaApi over the CUDA runtime: see cuda_api.h. Handles are cast, never wrapped.
#include "cuda/cuda_api.h"

#include <cuda_runtime_api.h>

namespace xirang::cuda {
namespace {

static_assert(device::kCudaSuccess == cudaSuccess);
static_assert(device::kCudaErrorInvalidValue == cudaErrorInvalidValue);
static_assert(device::kCudaErrorMemoryAllocation == cudaErrorMemoryAllocation);
static_assert(device::kCudaErrorNotReady == cudaErrorNotReady);

inline cudaStream_t st(device::Stream s) { return reinterpret_cast<cudaStream_t>(s); }
inline cudaEvent_t ev(device::Event e) { return reinterpret_cast<cudaEvent_t>(e); }

class Runtime : public device::CudaApi {
 public:
  const char* name() const override { return "cuda"; }
  const char* errorString(int code) override { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
  int getDevice(int* device) override { return cudaGetDevice(device); }
  int setDevice(int device) override { return cudaSetDevice(device); }
  int malloc(void** ptr, size_t bytes) override { return cudaMalloc(ptr, bytes); }
  int free(void* ptr) override { return cudaFree(ptr); }
  int mallocAsync(void** ptr, size_t bytes, device::Stream stream) override {
    return cudaMallocAsync(ptr, bytes, st(stream));
  }
  int freeAsync(void* ptr, device::Stream stream) override { return cudaFreeAsync(ptr, st(stream)); }
  int mallocHost(void** ptr, size_t bytes) override { return cudaMallocHost(ptr, bytes); }
  int freeHost(void* ptr) override { return cudaFreeHost(ptr); }
  int memcpyAsync(void* dst, const void* src, size_t bytes, device::Stream stream) override {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st(stream));
  }
  int memsetAsync(void* dst, int value, size_t bytes, device::Stream stream) override {
    return cudaMemsetAsync(dst, value, bytes, st(stream));
  }
  int streamCreate(device::Stream* stream) override {
    cudaStream_t s = nullptr;
    const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    *stream = reinterpret_cast<device::Stream>(s);
    return e;
  }
  int streamDestroy(device::Stream stream) override { return cudaStreamDestroy(st(stream)); }
  int streamSynchronize(device::Stream stream) override { return cudaStreamSynchronize(st(stream)); }
  int eventCreate(device::Event* event) override {
    cudaEvent_t e = nullptr;
    const cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    *event = reinterpret_cast<device::Event>(e);
    return r;
  }
  int eventDestroy(device::Event event) override { return cudaEventDestroy(ev(event)); }
  int eventRecord(device::Event event, device::Stream stream) override { return cudaEventRecord(ev(event), st(stream)); }
  int streamWaitEvent(device::Stream stream, device::Event event) override {
    return cudaStreamWaitEvent(st(stream), ev(event), 0);
  }
  int eventQuery(device::Event event) override {
    const cudaError_t e = cudaEventQuery(ev(event));
    if (e == cudaErrorNotReady) (void)cudaGetLastError();  // not an error: do not leave it for the next check
    return e;
  }
  int eventSynchronize(device::Event event) override { return cudaEventSynchronize(ev(event)); }
};

}  // namespace

device::CudaApi& runtimeApi() {
  static Runtime r;
  return r;
}

}  // namespace xirang::cuda
