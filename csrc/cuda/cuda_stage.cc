// The host-staged CUDA engine: see cuda_stage.h.
#include "cuda/cuda_stage.h"

#include "core/env.h"

#include <map>
#include <string>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

// Only c10/cuda headers and the CUDA runtime: ATen/cuda/CUDAContext.h needs the cuBLAS/cuSPARSE
// headers, which a CUDA toolkit with just nvcc and cudart lacks.

namespace xirang::cudastage {

void checkTransport() {
  const std::string t = env::get("XIRANG_CUDA_TRANSPORT");  // declared in core/env.cc
  if (t == "auto" || t == "host") return;
  TORCH_CHECK(t != "nccl",
              "xirang: XIRANG_CUDA_TRANSPORT=nccl: the NCCL transport for CUDA tensors is not implemented yet; "
              "unset it or use 'auto'/'host' (host-staged: pinned host buffers and the TCP ring), or use "
              "'cpu:xirang,cuda:nccl'");
  TORCH_CHECK(false, "xirang: XIRANG_CUDA_TRANSPORT must be auto, host or nccl, got '", t, "'");
}

struct StreamsImpl {
  std::mutex mu;
  std::map<c10::DeviceIndex, c10::cuda::CUDAStream> side;
  c10::cuda::CUDAStream get(c10::DeviceIndex d) {
    std::lock_guard<std::mutex> g(mu);
    auto it = side.find(d);
    if (it == side.end()) it = side.emplace(d, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, d)).first;
    return it->second;
  }
};

Streams::Streams() : impl_(std::make_unique<StreamsImpl>()) {}
Streams::~Streams() = default;

namespace {
// A cudaEvent_t without timing, created on first record (on the stream's device).
class Event {
 public:
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (ev_) {
      c10::cuda::CUDAGuard g(device_);
      (void)cudaEventDestroy(ev_);
    }
  }
  void record(const c10::cuda::CUDAStream& s) {
    c10::cuda::CUDAGuard g(s.device_index());
    if (!ev_) {
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
      device_ = s.device_index();
    }
    C10_CUDA_CHECK(cudaEventRecord(ev_, s.stream()));
  }
  // The stream waits (on the GPU) for the work recorded before; a no-op if never recorded.
  void block(const c10::cuda::CUDAStream& s) {
    if (!ev_) return;
    c10::cuda::CUDAGuard g(s.device_index());
    C10_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), ev_, 0));
  }
  bool query() {
    if (!ev_) return true;
    cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    C10_CUDA_CHECK(e);
    return false;
  }

 private:
  cudaEvent_t ev_ = nullptr;
  c10::DeviceIndex device_ = 0;
};
}  // namespace

struct Stage::Events {
  explicit Events(c10::cuda::CUDAStream s) : side(s) {}
  c10::cuda::CUDAStream side;
  Event ready;  // caller's stream: inputs written
  Event done;   // side stream: copies back enqueued before it
  bool done_recorded = false;
};

Stage::Stage(Streams& streams) : streams_(streams.impl()) {}
Stage::~Stage() = default;

at::Tensor Stage::bind(const at::Tensor& t, bool copy_in, bool copy_out) {
  if (!t.defined() || !t.is_cuda()) return t;
  TORCH_CHECK(t.layout() == at::kStrided, "xirang: sparse CUDA tensors are not supported");
  if (entries_.empty()) {
    device_ = t.device();
    ev_ = std::make_unique<Events>(streams_->get(device_.index()));
  }
  TORCH_CHECK(t.device() == device_, "xirang: all CUDA tensors of one operation must be on one device, got ",
              device_, " and ", t.device());
  at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  entries_.push_back(Entry{t, host, copy_in, copy_out});
  return host;
}

void Stage::queued() {
  if (entries_.empty()) return;
  ev_->ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
}

std::vector<c10::Device> Stage::devices() const {
  if (entries_.empty()) return {};
  return {device_};
}

at::Tensor Stage::userTensor(const at::Tensor& t) const {
  for (const auto& e : entries_)
    if (e.host.is_same(t)) return e.user;
  return t;
}

void Stage::copyIn() {
  if (entries_.empty()) return;
  c10::cuda::CUDAGuard dg(device_);
  ev_->ready.block(ev_->side);
  {
    c10::cuda::CUDAStreamGuard sg(ev_->side);
    for (auto& e : entries_)
      if (e.copy_in) e.host.copy_(e.user, /*non_blocking=*/true);
  }
  ev_->side.synchronize();
}

void Stage::copyOut() {
  if (entries_.empty()) return;
  c10::cuda::CUDAStreamGuard sg(ev_->side);
  for (auto& e : entries_)
    if (e.copy_out) e.user.copy_(e.host, /*non_blocking=*/true);
  // The caching allocator must not hand the user's memory to another stream before the side
  // stream is done with it (the pinned mirrors are covered by the host allocator's own events).
  for (auto& e : entries_)
    c10::cuda::CUDACachingAllocator::recordStream(e.user.storage().data_ptr(), ev_->side);
  ev_->done.record(ev_->side);
  ev_->done_recorded = true;
}

void Stage::completeFuture(const c10::intrusive_ptr<c10::ivalue::Future>& fut, c10::IValue value) {
  if (entries_.empty()) {
    fut->markCompleted(std::move(value));
    return;
  }
  c10::cuda::CUDAStreamGuard sg(ev_->side);
  fut->markCompleted(std::move(value));
}

void Stage::block() {
  if (entries_.empty() || !ev_->done_recorded) return;
  ev_->done.block(c10::cuda::getCurrentCUDAStream(device_.index()));
}

bool Stage::query() {
  if (entries_.empty() || !ev_->done_recorded) return true;
  return ev_->done.query();
}

std::shared_ptr<OpStage> Engine::stage() {
  checkTransport();
  return std::make_shared<Stage>(streams_);
}

}  // namespace xirang::cudastage
