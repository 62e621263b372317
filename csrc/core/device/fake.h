// A loopback fake of the CUDA runtime, NCCL and the kernels (device/api.h's three tables) for the
// Catch2 tests, so that the device data path's real code (transport/nccl_link.h,
// algorithms/device_reducer.h, the core's algorithms) runs without a GPU:
//
//   * ranks are threads of one process; "device" memory is host memory (malloc'd, 256-byte
//     aligned, tracked: freeing a pointer the fake did not hand out is an error);
//   * a stream is a FIFO executed in order by a worker thread of its own, so work on one stream
//     runs after the work enqueued before it and concurrently with other streams; an event
//     completes when its stream reaches the record; streamWaitEvent blocks the stream's worker;
//     enqueueHostWork() puts any function on a stream (a producer "kernel" that finishes late);
//   * kernels are the grid emulator (device/kernels.h: emulate) running the real kernel bodies on
//     the stream's worker;
//   * NCCL: communicators are found by unique id; commInitRankConfig is non-blocking (InProgress
//     until all ranks joined; a rank that never joins leaves the others InProgress for ever).
//     Sends and receives match per (src, dst) in the order they were issued; a group is executed
//     by its stream as one unit and completes only when every one of its calls has met its match
//     executing on the peer's stream too, which is NCCL's rule for point-to-point calls ("calls
//     that must progress together must be in one group"): an order that deadlocks real NCCL
//     deadlocks here (and shows as a timeout). Matched calls of different sizes set an
//     InvalidUsage async error on both communicators. commAbort ends the communicator's pending
//     calls and gives every peer with a pending or later call to it an async RemoteError (a
//     peer's failure, as NCCL's proxy reports a closed connection).
// One FakeDevice is one process's CUDA + NCCL; tests make one per test case. Its destructor stops
// every stream (abandoning work still blocked) and joins the workers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "core/device/api.h"

namespace xirang::device {

class FakeDevice {
 public:
  FakeDevice();
  ~FakeDevice();
  FakeDevice(const FakeDevice&) = delete;
  FakeDevice& operator=(const FakeDevice&) = delete;

  CudaApi& cuda();
  NcclApi& nccl();
  KernelApi& kernels();

  // Runs `fn` on `stream`'s worker in stream order, as a kernel would run.
  void enqueueHostWork(Stream stream, std::function<void()> fn);
  // Device allocations not freed yet (a leak check for the tests).
  size_t liveAllocations() const;
  // Kernels launched so far (all streams).
  uint64_t kernelsLaunched() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace xirang::device
