// The host-staged CUDA engine of ProcessGroupXirang (backend/device_engine.h; built only with
// XIRANG_WITH_CUDA).
//
// One operation on CUDA tensors runs the host engine's algorithm on pinned host mirrors:
//   caller's thread  Stage::bind() makes a pinned host mirror per CUDA tensor (CPU tensors pass
//                    through); Stage::queued() records an event on the caller's current
//                    stream (where DDP fills its buckets) - the op queue calls it;
//   comm thread      copyIn(): the side stream waits on that event, copies D2H, synchronizes;
//                    the CPU algorithm runs on the mirrors; copyOut(): H2D copies (non-blocking)
//                    on the side stream, recordStream of every device tensor, the done event;
//                    completeFuture() marks the Work's Future completed with the side stream
//                    current (the Future records its own events there);
//   caller's wait()  block(): the caller's current stream waits on the done event; the CPU
//                    does not wait for the copies.
// Side streams: one per device and process group (c10::cuda::getStreamFromPool), made on first
// use. Nothing here makes a CUDA call before the first CUDA tensor is seen.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include "backend/device_engine.h"

namespace xirang::cudastage {

// XIRANG_CUDA_TRANSPORT: "auto" (default) or "host" -> the host-staged transport; "nccl" throws
// c10::Error (not implemented yet); anything else throws naming the accepted values.
void checkTransport();

struct StreamsImpl;
// The side streams of one process group.
class Streams {
 public:
  Streams();
  ~Streams();
  StreamsImpl* impl() { return impl_.get(); }

 private:
  std::unique_ptr<StreamsImpl> impl_;
};

class Stage : public OpStage {
 public:
  explicit Stage(Streams& streams);
  ~Stage() override;

  // Returns the tensor the CPU algorithm works on: t itself on the CPU, else a contiguous pinned
  // host mirror (same shape and dtype), filled from t by copyIn() when copy_in and copied to t by
  // copyOut() when copy_out. All CUDA tensors of one op must be on one device (c10::Error).
  using OpStage::bind;
  at::Tensor bind(const at::Tensor& t, bool copy_in, bool copy_out) override;
  at::Tensor userTensor(const at::Tensor& t) const override;
  // The op's device, once a CUDA tensor was bound.
  std::vector<c10::Device> devices() const override;
  bool copies() const override { return !entries_.empty(); }

  // Caller's thread, when the op is queued.
  void queued() override;

  // Communication thread.
  void copyIn() override;
  void copyOut() override;
  void completeFuture(const c10::intrusive_ptr<c10::ivalue::Future>& fut, c10::IValue value) override;

  // Any thread after completion: the current stream of the op's device waits for the copies.
  void block() override;
  // Whether the copies back have finished (true when none were enqueued).
  bool query() override;

 private:
  struct Entry {
    at::Tensor user, host;
    bool copy_in, copy_out;
  };
  struct Events;
  StreamsImpl* streams_;
  std::vector<Entry> entries_;
  c10::Device device_{c10::kCPU};
  std::unique_ptr<Events> ev_;
};

// The engine: one group's side streams; stage() checks XIRANG_CUDA_TRANSPORT (each op).
class Engine : public DeviceEngine {
 public:
  std::shared_ptr<OpStage> stage() override;

 private:
  Streams streams_;
};

}  // namespace xirang::cudastage
