// The seam between the c10d entry points and the devices: how an op on tensors of one kind of
// device runs.
//
// An entry point takes the op's stage from DeviceEngines::stageFor() (the one place that picks
// an engine from the tensors' devices), binds every tensor through it, checks and describes the
// op on the bound tensors and queues it; the algorithm (host_engine.h) runs on the bound tensors
// over the stage's comm(). Engines:
//   host             (host_engine.h) CPU tensors: the bound tensor is the tensor itself and the
//                    algorithm runs on it over the group's Comm (core/collectives over TCP or
//                    shared memory).
//   host-staged CUDA (cuda/cuda_stage.h, XIRANG_WITH_CUDA builds) CUDA tensors. Staged: the bound
//                    tensor is the user's own and the algorithm runs over a device Comm whose link
//                    (transport/staged_link.h) stages only the bytes sent through pinned host
//                    memory, with the device reducer's kernels. Mirror (where ranks share host
//                    memory, elastic groups, point-to-point, XIRANG_CUDA_TRANSPORT=mirror): the
//                    bound tensor is a pinned host mirror, the host engine's algorithm runs on the
//                    mirrors between copyIn() and copyOut() on a side stream, and the Work's
//                    outputs and Future are the user's device tensors.
//   NCCL             (cuda/cuda_stage.h, XIRANG_CUDA_TRANSPORT=nccl, or auto where every rank
//                    has a GPU of its own) CUDA tensors: the bound
//                    tensor is the user's own; the same algorithm runs over the engine's device
//                    Comm (transport/nccl_link.h + algorithms/device_reducer.h) with the side
//                    stream current, so every kernel, copy and NCCL call is on that stream.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include "core/collectives.h"
#include "core/store.h"

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
  // Whether copyIn()/copyOut() (or run()) do anything.
  virtual bool copies() const { return false; }
  // The engine that runs the op, as records name it: "host" (CPU tensors), "mirror", "staged" or
  // "nccl" (cuda/cuda_stage.h).
  virtual const char* engine() const { return "host"; }
  // Whether bind() hands back device tensors (the NCCL and staged engines), which the checks then accept.
  virtual bool bindsDevice() const { return false; }

  // Caller's thread, when the op is queued: the inputs are ready (CUDA: an event on the caller's
  // current stream).
  virtual void queued() {}
  // Communication thread: the op's body (the algorithm) between the stage's copies, when copies();
  // `deadline`: the op's (ctx.deadline), which bounds every wait for the device.
  virtual void run(transport::Deadline deadline, const std::function<void()>& body) {
    copyIn(deadline);
    body();
    copyOut();
  }
  // Communication thread (a send's: the caller's), before and after the algorithm. copyIn's
  // wait for the copies to the host ends by `deadline` (transport::TimeoutError).
  virtual void copyIn(transport::Deadline deadline) { (void)deadline; }
  virtual void copyOut() {}
  // Communication thread, inside run()'s body: the Comm the algorithm runs over. `host` is the
  // group's (the host engines run over it); the device-link engines (NCCL, staged) return their
  // device Comm (same ranks and ring), making its communicator on the first op (collective: every
  // rank's first CUDA op; c10::Error / TransportError / TimeoutError by ctx.deadline).
  virtual const Comm& comm(const Comm& host, const OpCtx& ctx) {
    (void)ctx;
    return host;
  }
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
  // configured (e.g. XIRANG_CUDA_TRANSPORT=nccl without a usable NCCL library).
  // `tensors`: the op's (stageFor's argument), from which an engine may pick how to run it.
  virtual std::shared_ptr<OpStage> stage(bool device_link, const std::vector<at::Tensor>& tensors) = 0;
  // Any thread: ends the engine's own communication at once (the group was poisoned or aborted:
  // a wait on the NCCL or staged link fails now instead of at its deadline); later ops on it fail.
  virtual void abort(const std::string& why) { (void)why; }
};

// What the device engines need of their process group (the NCCL engine's communicator, the
// staged engine's shared-memory test).
struct EngineSetup {
  std::shared_ptr<Store> store;
  std::string key_ns;      // the group creation's store namespace (generation::keyNamespace)
  std::string group_name;
  int rank = 0, size = 1;
  bool elastic = false;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // the group's (XIRANG_CUDA_TRANSPORT=auto's choice)
  // Whether this rank's host Comm moves bytes through shared memory now (same-host peers in its
  // domain); unset: never. Called on the caller's thread when an op is staged.
  std::function<bool()> host_shm;
  // "" while group rank `peer` may still take part, else why not (Membership::peerGone); unset:
  // never gone. Any thread (auto's choice polls it while it waits for a peer's record).
  std::function<std::string(int)> peer_gone;
};

// The engines of one process group.
class DeviceEngines {
 public:
  DeviceEngines();
  ~DeviceEngines();
  DeviceEngines(const DeviceEngines&) = delete;
  DeviceEngines& operator=(const DeviceEngines&) = delete;
  // Once, in the group's constructor, before the first op.
  void configure(const EngineSetup& setup);

  // The stage of an op on `tensors` (undefined ones ignored): the CUDA engine's when any is a
  // CUDA tensor, else the host's. Ops without a device path take hostStage() and their checks
  // reject device tensors. `device_link`: whether the op may run over a device link (NCCL, staged);
  // point-to-point passes false and gets the mirror stage whatever XIRANG_CUDA_TRANSPORT is.
  // Throws c10::Error when the configured CUDA transport cannot run (engine's stage()).
  std::shared_ptr<OpStage> stageFor(const std::vector<at::Tensor>& tensors, bool device_link = true);
  // DeviceEngine::abort of every engine (any thread).
  void abort(const std::string& why);

 private:
  std::unique_ptr<DeviceEngine> cuda_;  // null in a build without the CUDA path
};

}  // namespace xirang
