// The seam between the c10d entry points and the devices: how an op on tensors of one kind of
// device runs.
//
// An entry point takes the op's stage from DeviceEngines::stageFor() (the one place that picks
// an engine from the tensors' devices), binds every tensor through it, checks and describes the
// op on the bound tensors and queues it; the algorithm runs on the bound tensors. Engines:
//   host             (host_engine.h) CPU tensors: the bound tensor is the tensor itself and the
//                    algorithm runs on it (core/collectives over TCP).
//   host-staged CUDA (cuda/cuda_stage.h, XIRANG_WITH_CUDA builds) CUDA tensors: the bound tensor
//                    is a pinned host mirror, the host engine's algorithm runs on the mirrors
//                    between copyIn() and copyOut() on a side stream, and the Work's outputs and
//                    Future are the user's device tensors.
// An engine that runs ops on the device itself (NCCL) plugs in here as a third one.
#pragma once

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

namespace xirang {

// How one op's tensors are held while it runs. This base class is the host engine's: the tensors
// themselves, nothing to copy.
class OpStage {
 public:
  virtual ~OpStage() = default;

  // Caller's thread, before the op's checks. The tensor the algorithm works on in place of the
  // user's `t`: copy_in: the op reads t's values; copy_out: the op writes t.
  virtual at::Tensor bind(const at::Tensor& t, bool copy_in, bool copy_out) {
    (void)copy_in, (void)copy_out;
    return t;
  }
  std::vector<at::Tensor> bind(const std::vector<at::Tensor>& ts, bool copy_in, bool copy_out);
  // The user's tensor a bound tensor stands for (t itself when it is not a stand-in).
  virtual at::Tensor userTensor(const at::Tensor& t) const { return t; }
  // The devices of the op's Future (none: CPU).
  virtual std::vector<c10::Device> devices() const { return {}; }
  // Whether copyIn()/copyOut() do anything.
  virtual bool copies() const { return false; }

  // Caller's thread, when the op is queued: the inputs are ready (CUDA: an event on the caller's
  // current stream).
  virtual void queued() {}
  // Communication thread, before and after the algorithm.
  virtual void copyIn() {}
  virtual void copyOut() {}
  // Communication thread: completes the Work's Future with `value`.
  virtual void completeFuture(const c10::intrusive_ptr<c10::ivalue::Future>& fut, c10::IValue value) {
    fut->markCompleted(std::move(value));
  }
  // Any thread, after completion: the caller's current stream waits for the copies back; and
  // whether they have finished.
  virtual void block() {}
  virtual bool query() { return true; }
};

// The host engine's stage (shared: it holds nothing).
std::shared_ptr<OpStage> hostStage();

class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;
  // A new op's stage (caller's thread). Throws c10::Error when the engine cannot run ops as
  // configured (e.g. XIRANG_CUDA_TRANSPORT=nccl).
  virtual std::shared_ptr<OpStage> stage() = 0;
};

// The engines of one process group.
class DeviceEngines {
 public:
  DeviceEngines();
  DeviceEngines(const DeviceEngines&) = delete;
  DeviceEngines& operator=(const DeviceEngines&) = delete;

  // The stage of an op on `tensors` (undefined ones ignored): the CUDA engine's when any is a
  // CUDA tensor (its bind() passes CPU tensors through), else the host's. Ops without a device
  // path take hostStage() and their checks reject device tensors.
  std::shared_ptr<OpStage> stageFor(const std::vector<at::Tensor>& tensors);

 private:
  std::unique_ptr<DeviceEngine> cuda_;  // null in a build without the CUDA path
};

}  // namespace xirang
