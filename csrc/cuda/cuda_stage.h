// The CUDA engines of ProcessGroupXirang (backend/device_engine.h; built only with
// XIRANG_WITH_CUDA). XIRANG_CUDA_TRANSPORT picks them, read once per group: "nccl" the NCCL
// engine, "host" the host-staged engines, "mirror" the mirror engine only, "auto" (default) NCCL
// or host as the group's first CUDA collective decides (Engine::useNccl: NCCL when it loaded on
// every rank and no two ranks use one GPU; never in elastic mode); point-to-point takes the
// mirror engine in every case.
//
// Staged (auto / host, where it fits): the core's algorithms run on the user's tensors themselves
// with the device reducer's kernels (algorithms/device_reducer.h) on the engine's stream, over a
// transport::StagedLink on the group's TCP link: only the bytes an algorithm sends cross to the
// host, through pinned staging buffers (the wire format's: bf16 codes for the hook's op, half of
// fp32 mirrors, and no CPU codec). It fits an op whose tensors are all on one CUDA device (strided;
// the group's first such op fixes the device; no CPU tensor, not even an empty one), in a group
// that is not elastic and whose ranks do not share this rank's host memory (no shared-memory
// domain: there the bytes go through host memory anyway, and the mirror engine's shared-memory
// algorithms move them); other ops take the mirror engine. Same stage discipline as NCCL below.
//
// Mirror (host-staged with whole-tensor mirrors): one operation on CUDA tensors runs the host
// engine's algorithm on pinned host mirrors:
//   caller's thread  Stage::bind() makes a pinned host mirror per CUDA tensor (CPU tensors pass
//                    through); Stage::queued() records an event on the caller's current
//                    stream (where DDP fills its buckets) - the op queue calls it;
//   comm thread      copyIn(): the side stream waits on that event, copies D2H, the host waits
//                    for them under the op's deadline; the CPU algorithm runs on the mirrors;
//                    copyOut(): the side stream waits on the ready event too (a receive has no
//                    copyIn), H2D copies (non-blocking), recordStream of every device tensor, the
//                    done event; completeFuture() marks the Work's Future completed with the
//                    group's completion stream current after it waited on the done event only
//                    (the Future records its own events there; the side stream may already hold
//                    the next ops when the completion thread gets to it);
//   caller's wait()  block(): the caller's current stream waits on the done event; the CPU
//                    does not wait for the copies.
//
// NCCL and staged (DeviceStage over a LinkDevice): the same algorithm on the user's tensors
// themselves, over the engine's device Comm (NCCL: transport/nccl_link.h over the dlopen'ed
// libnccl.so.2; staged: transport/staged_link.h), every kernel, copy and transfer on the side
// stream:
//   caller's thread  bind() returns the tensor itself; queued() records the ready event;
//   comm thread      run(): the side stream waits on the ready event; the body runs with the
//                    side stream current (torch's own copies in host_engine.cc go there too);
//                    recordStream of every tensor, the done event; then the link's synchronize
//                    under the op's deadline, so an error or a hang ends this op with an
//                    error (no watchdog thread: the comm thread waits for the device, the
//                    caller's CPU does not); a wait that fails aborts the NCCL communicator;
//   caller's wait()  as above: its stream waits on the done event.
// The NCCL communicator: one per group, made at the group's first NCCL op (rank 0's unique id under
// the store key <creation namespace>/nccl/<group>/epoch0; non-blocking init, bounded by that
// op's deadline), on the device of that op's tensors; its ranks are the group's. Under auto it is
// made on the caller's thread right after the choice (transport::startNcclAgreed, bounded by the
// group's timeout), and when any rank cannot make its own, every rank falls back to the
// host-staged engines with one WARNING naming that rank and NCCL's error. Its stream is
// the engine's own (not a pool stream shared with the mirror engine's point-to-point ops or other
// groups, whose waits could otherwise queue behind an NCCL receive). A poisoned or aborted group
// interrupts its link (DeviceEngine::abort, any thread), so this rank's NCCL wait fails at once;
// the comm thread then aborts the communicator (only it calls into NCCL; ncclCommAbort and
// ncclCommDestroy, which can block for good, run on a thread of their own and hold it at most
// 10 s: transport::boundedTeardown, past which the communicator is leaked). A rank blocked in NCCL
// on a peer that failed elsewhere learns it from the group's store abort note, polled every
// 200 ms of a wait (NcclLink::setStopCheck).
// Not yet: NCCL in elastic mode (a rebuilt ring needs a new communicator: refused with a clear
// error, and auto takes the host-staged engines there), and several devices per group over NCCL.
//
// Streams, all xirang's own (never torch's pool, whose streams other groups and libraries share):
// per device and process group the mirror engine's side stream and the completion stream, made on
// first use; the device-link engines', one each. Nothing here makes a CUDA call before the first
// CUDA tensor is seen.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>

#include "backend/device_engine.h"

namespace xirang::cudastage {

// XIRANG_CUDA_TRANSPORT, read once per group by the Engine.
enum class Transport { Auto, Host, Mirror, Nccl };

struct StreamsImpl;
// The side streams of one process group.
class Streams {
 public:
  Streams();
  ~Streams();
  // Shared with every Stage: a Work (and its Stage) may be completed after its group is gone.
  const std::shared_ptr<StreamsImpl>& impl() { return impl_; }

 private:
  std::shared_ptr<StreamsImpl> impl_;
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
  const char* engine() const override { return entries_.empty() ? "host" : "mirror"; }

  // Caller's thread, when the op is queued.
  void queued() override;

  // Communication thread. copyIn: the copies to the host, waited for under `deadline`; copyOut:
  // the copies back, after the caller's stream reached the op (a receive writes its tensor).
  void copyIn(transport::Deadline deadline) override;
  void copyOut() override;
  void completeFuture(const c10::intrusive_ptr<c10::ivalue::Future>& fut, c10::IValue value) override;

  // Any thread after completion: the current stream of the op's device waits for the copies.
  void block() override;
  // Whether the copies back have finished (true when none were enqueued).
  bool query() override;

 protected:
  struct Entry {
    at::Tensor user, host;
    bool copy_in, copy_out;
  };
  struct Events;
  // A CUDA tensor of the op: strided, on the op's one device; the first one picks the device
  // and its side stream (sideStream(); c10::Error otherwise).
  void track(const at::Tensor& t);
  // recordStream of every bound CUDA tensor on the side stream: the caching allocator must not
  // hand their memory to another stream before the side stream is past them (host-staged: the
  // pinned mirrors are covered by the host allocator's own events).
  void keepAlive();
  // The stream the op runs on: the group's side stream of that device (its own, not torch's pool:
  // a pool stream may be another group's or library's, whose work would delay this one's).
  virtual c10::cuda::CUDAStream sideStream(c10::Device device);
  std::shared_ptr<StreamsImpl> streams_;
  std::vector<Entry> entries_;
  c10::Device device_{c10::kCPU};
  std::unique_ptr<Events> ev_;
};

struct LinkDevice;
// The stage of the engines that run the algorithms on the tensors themselves over a device link
// (NCCL, staged: see the top of this file).
class DeviceStage : public Stage {
 public:
  DeviceStage(Streams& streams, std::shared_ptr<LinkDevice> dev);
  ~DeviceStage() override;

  // t itself. A CPU tensor is accepted only when empty (the hook's placeholders): the device
  // link moves device memory (c10::Error naming the tensor's size otherwise). The first CUDA
  // tensor fixes the group's device; a tensor on another device is a c10::Error here, on the
  // caller's thread, before the op is queued.
  at::Tensor bind(const at::Tensor& t, bool copy_in, bool copy_out) override;
  bool bindsDevice() const override { return true; }
  const char* engine() const override;
  void run(transport::Deadline deadline, const std::function<void()>& body) override;
  const Comm& comm(const Comm& host, const OpCtx& ctx) override;

 protected:
  c10::cuda::CUDAStream sideStream(c10::Device device) override;

 private:
  std::shared_ptr<LinkDevice> dev_;
  bool linked_ = false;  // comm() handed out the device Comm
};

struct NcclDevice;
struct StagedDevice;
// The engine: one group's side streams, NCCL communicator and staged link. XIRANG_CUDA_TRANSPORT
// is read once, at group creation (ranks that disagreed about NCCL would run different links and
// hang; the staged and mirror engines send the same frames over TCP and mix).
class Engine : public DeviceEngine {
 public:
  // "nccl": the NCCL library must load and the group must not be elastic (c10::Error).
  explicit Engine(const EngineSetup& setup);
  ~Engine() override;
  std::shared_ptr<OpStage> stage(bool device_link, const std::vector<at::Tensor>& tensors) override;
  void abort(const std::string& why) override;

 private:
  // Whether an op on `tensors` takes the staged engine (see the top of this file).
  bool stagedFits(const std::vector<at::Tensor>& tensors) const;
  // Whether an op takes the NCCL engine. Under auto the group's first CUDA collective decides, on
  // every rank, by a store round (transport::agreeOnNccl: NCCL when it loaded everywhere and every
  // rank's GPU is its own; this blocks the caller until every rank has reached it, at most the
  // group's timeout: c10::Error naming the rank that did not come), then makes the communicator
  // (host-staged after all when a rank cannot make its own: transport::startNcclAgreed).
  // Also says once, at INFO, how the group's CUDA tensors run.
  bool useNccl(bool device_link, const std::vector<at::Tensor>& tensors);
  // Under decide_mu_: auto's choice (use_nccl_, auto_why_) by the store round.
  void decideAuto(const std::vector<at::Tensor>& tensors);
  // The store key under which the ranks' auto records lie (transport::agreeOnNccl).
  std::string autoKey() const;
  EngineSetup setup_;
  Transport transport_;
  Streams streams_;
  std::shared_ptr<NcclDevice> nccl_;
  std::shared_ptr<StagedDevice> staged_;  // null unless auto / host and not elastic
  std::mutex decide_mu_;                  // the three below
  std::optional<bool> use_nccl_;          // unset: auto, not decided yet
  std::string auto_why_;                  // auto's reason
  bool said_ = false;                     // the INFO line naming the transport, once per group
  std::string decide_failed_;             // auto's decision threw: every later CUDA collective throws it
};

}  // namespace xirang::cudastage
