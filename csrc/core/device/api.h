// The CUDA runtime, NCCL and kernel calls the core's device data path makes, as three tables
// (abstract classes) over xirang's own opaque types, so that the core compiles without CUDA or
// NCCL headers and a fake (device/fake.h: threads as ranks, host memory as device memory) can
// stand in for the real libraries in the Catch2 tests:
//
//   CudaApi    memory, copies, streams and events of one process (cuda/cuda_api.cc: the CUDA
//              runtime; the torch-facing engine may supply one over torch's allocator/streams);
//   NcclApi    the NCCL calls of transport/nccl_link.h (cuda/nccl_api.cc: libnccl.so.2 loaded at
//              run time with dlopen; no NCCL symbol is linked at build time);
//   KernelApi  the kernels of device/kernels.h launched on a stream (cuda/kernels.cu: nvcc; the
//              fake: the grid emulator running the same kernel bodies on the stream's thread).
//
// Handles are the libraries' own (a Stream is a cudaStream_t, an NcclComm an ncclComm_t, ...)
// cast to these opaque pointer types; the result codes are the libraries' own numbers
// (cudaError_t, ncclResult_t), named below for the values the core tests. Every call may be made
// from any thread, but NCCL calls on one communicator must not run concurrently (NCCL's rule),
// except abort.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/device/kernels.h"

namespace xirang::device {

struct StreamOpaque;
struct EventOpaque;
struct NcclCommOpaque;
using Stream = StreamOpaque*;    // cudaStream_t
using Event = EventOpaque*;      // cudaEvent_t (created without timing)
using NcclComm = NcclCommOpaque*;  // ncclComm_t

// cudaError_t values.
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorInvalidValue = 1;
constexpr int kCudaErrorMemoryAllocation = 2;
constexpr int kCudaErrorNotReady = 600;

class CudaApi {
 public:
  virtual ~CudaApi() = default;
  virtual const char* name() const = 0;  // "cuda", "fake"
  virtual const char* errorString(int code) = 0;

  virtual int getDevice(int* device) = 0;
  virtual int setDevice(int device) = 0;

  // Device memory: plain (cudaMalloc/cudaFree) and stream-ordered (cudaMallocAsync /
  // cudaFreeAsync: usable by work enqueued on `stream` after the call, returned after the work
  // enqueued before the free). Pinned host memory (cudaMallocHost) for host <-> device staging.
  virtual int malloc(void** ptr, size_t bytes) = 0;
  virtual int free(void* ptr) = 0;
  virtual int mallocAsync(void** ptr, size_t bytes, Stream stream) = 0;
  virtual int freeAsync(void* ptr, Stream stream) = 0;
  virtual int mallocHost(void** ptr, size_t bytes) = 0;
  virtual int freeHost(void* ptr) = 0;

  // cudaMemcpyAsync(cudaMemcpyDefault) / cudaMemsetAsync on `stream`. Regions must not overlap.
  virtual int memcpyAsync(void* dst, const void* src, size_t bytes, Stream stream) = 0;
  virtual int memsetAsync(void* dst, int value, size_t bytes, Stream stream) = 0;

  // Non-blocking streams (cudaStreamNonBlocking) and events without timing.
  virtual int streamCreate(Stream* stream) = 0;
  virtual int streamDestroy(Stream stream) = 0;
  virtual int streamSynchronize(Stream stream) = 0;
  virtual int eventCreate(Event* event) = 0;
  virtual int eventDestroy(Event event) = 0;
  // Captures the work enqueued on `stream` so far; query/synchronize/wait refer to the latest
  // record (an event never recorded counts as complete).
  virtual int eventRecord(Event event, Stream stream) = 0;
  // `stream`'s later work waits (on the device) for `event`'s latest record.
  virtual int streamWaitEvent(Stream stream, Event event) = 0;
  // kCudaSuccess when complete, kCudaErrorNotReady when not yet, else an error.
  virtual int eventQuery(Event event) = 0;
  virtual int eventSynchronize(Event event) = 0;
};

// ncclResult_t values.
constexpr int kNcclSuccess = 0;
constexpr int kNcclUnhandledCudaError = 1;
constexpr int kNcclSystemError = 2;
constexpr int kNcclInternalError = 3;
constexpr int kNcclInvalidArgument = 4;
constexpr int kNcclInvalidUsage = 5;
constexpr int kNcclRemoteError = 6;
constexpr int kNcclInProgress = 7;

constexpr size_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct NcclUniqueId {
  char internal[kNcclUniqueIdBytes];
};

// The part of ncclConfig_t the core sets; the real table fills the rest with
// NCCL_CONFIG_INITIALIZER's defaults.
struct NcclConfig {
  bool blocking = false;          // the core always creates non-blocking communicators
  std::string comm_name;          // ncclConfig_t::commName (diagnostics); "" = none
};

class NcclApi {
 public:
  virtual ~NcclApi() = default;
  virtual const char* name() const = 0;  // "nccl", "fake"
  virtual const char* errorString(int result) = 0;
  // The library's last error message for `comm` (ncclGetLastError), "" if none.
  virtual std::string lastError(NcclComm comm) = 0;

  virtual int getVersion(int* version) = 0;  // NCCL_VERSION_CODE, e.g. 23007 for 2.30.7
  virtual int getUniqueId(NcclUniqueId* id) = 0;
  // ncclCommInitRankConfig. Non-blocking: may return kNcclInProgress, then commGetAsyncError
  // turns from kNcclInProgress to kNcclSuccess once every rank has joined.
  virtual int commInitRankConfig(NcclComm* comm, int nranks, const NcclUniqueId& id, int rank,
                                 const NcclConfig& config) = 0;
  virtual int commAbort(NcclComm comm) = 0;    // any thread; ends pending work
  virtual int commDestroy(NcclComm comm) = 0;  // after all work on it completed
  virtual int commGetAsyncError(NcclComm comm, int* async_error) = 0;
  virtual int groupStart() = 0;
  // On a non-blocking communicator may return kNcclInProgress: the calls are still being
  // enqueued; commGetAsyncError says when they are (kNcclSuccess) or failed.
  virtual int groupEnd() = 0;
  // Point to point on `stream`, `bytes` bytes as ncclUint8. A send and a receive match when they
  // are the k-th send from src to dst and the k-th receive at dst from src; each blocks its
  // stream until its match runs too (calls that must progress together belong in one group).
  virtual int send(const void* buf, size_t bytes, int peer, NcclComm comm, Stream stream) = 0;
  virtual int recv(void* buf, size_t bytes, int peer, NcclComm comm, Stream stream) = 0;
};

// The kernels of device/kernels.h on a stream. launch() checks the descriptor (an invalid one:
// kCudaErrorInvalidValue, nothing enqueued) and enqueues the kernel (n == 0: nothing).
class KernelApi {
 public:
  virtual ~KernelApi() = default;
  virtual const char* name() const = 0;  // "cuda", "emulator"
  virtual int launch(const Kernel& kernel, Stream stream) = 0;
};

}  // namespace xirang::device
