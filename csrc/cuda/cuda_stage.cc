// The host-staged CUDA engine: see cuda_stage.h.
#include "cuda/cuda_stage.h"

#include "backend/tensors.h"
#include "core/algorithms/device_reducer.h"
#include "core/env.h"
#include "core/transport/nccl_link.h"
#include "cuda/cuda_api.h"
#include "cuda/nccl_api.h"

#include <map>
#include <optional>
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

namespace {
// XIRANG_CUDA_TRANSPORT: "auto" (default) and "host" -> Host, "nccl" -> Nccl; anything else
// throws c10::Error naming `rank` and the accepted values.
Transport transportSetting(int rank) {
  const std::string t = env::get("XIRANG_CUDA_TRANSPORT");  // declared in core/env.cc
  if (t == "auto" || t == "host") return Transport::Host;
  if (t == "nccl") return Transport::Nccl;
  TORCH_CHECK(false, rankPrefix(rank), "XIRANG_CUDA_TRANSPORT must be auto, host or nccl, got '", t, "'");
}
}  // namespace

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

c10::cuda::CUDAStream Stage::sideStream(c10::Device device) { return streams_->get(device.index()); }

void Stage::track(const at::Tensor& t) {
  TORCH_CHECK(t.layout() == at::kStrided, "xirang: sparse CUDA tensors are not supported");
  if (entries_.empty()) {
    ev_ = std::make_unique<Events>(sideStream(t.device()));
    device_ = t.device();
  }
  TORCH_CHECK(t.device() == device_, "xirang: all CUDA tensors of one operation must be on one device, got ",
              device_, " and ", t.device());
}

at::Tensor Stage::bind(const at::Tensor& t, bool copy_in, bool copy_out) {
  if (!t.defined() || !t.is_cuda()) return t;
  track(t);
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

void Stage::keepAlive() {
  for (auto& e : entries_)
    c10::cuda::CUDACachingAllocator::recordStream(e.user.storage().data_ptr(), ev_->side);
}

void Stage::copyOut() {
  if (entries_.empty()) return;
  c10::cuda::CUDAStreamGuard sg(ev_->side);
  for (auto& e : entries_)
    if (e.copy_out) e.user.copy_(e.host, /*non_blocking=*/true);
  keepAlive();
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

// ---------------------------------------------------------------- the NCCL engine

// One group's NCCL device, stream, communicator and what runs over it. The device and stream
// are fixed by the first bind (caller's thread), the link made by the first op (comm thread).
struct NcclDevice {
  explicit NcclDevice(const EngineSetup& s) : setup(s) {}
  ~NcclDevice();
  NcclDevice(const NcclDevice&) = delete;
  NcclDevice& operator=(const NcclDevice&) = delete;

  // The engine's stream on `d`, created on the first call; c10::Error when the group already
  // runs on another device.
  c10::cuda::CUDAStream streamFor(c10::Device d);
  // The link, made on the first call (collective: every rank's first NCCL op); throws once
  // interrupted.
  transport::NcclLink& linkFor(const Comm& host, transport::Deadline deadline);
  // Any thread: a running or later wait of the link fails at once (NcclLink::interrupt; only
  // the comm thread calls into NCCL, so ncclCommAbort never frees a communicator under it).
  void interrupt(const std::string& why);

  const EngineSetup setup;
  std::mutex mu;  // device, stream, link, why
  c10::Device device{c10::kCPU};
  cudaStream_t raw = nullptr;  // never destroyed: tensors recorded on it may be freed after the group
  std::optional<c10::cuda::CUDAStream> stream;
  std::unique_ptr<transport::NcclLink> link;
  std::unique_ptr<algo::DeviceReducer> reducer;
  std::string why;  // aborted: every later op fails with it
  // Comm thread only: the device Comm handed to the op's body, and its scratch.
  std::shared_ptr<Scratch> scratch = std::make_shared<Scratch>();
  Comm comm;
};

NcclDevice::~NcclDevice() {
  // The stream stays (as torch's pool streams do): the caching allocator records events on it
  // when a tensor the engine used is freed later. No CUDAGuard (it may throw at exit): the
  // stream-ordered frees and the link's calls name their stream.
  comm = Comm();
  scratch.reset();  // stream-ordered frees on the stream
  reducer.reset();
  link.reset();  // destroys the communicator when the stream is idle, else aborts it
}

c10::cuda::CUDAStream NcclDevice::streamFor(c10::Device d) {
  std::lock_guard<std::mutex> g(mu);
  if (!stream) {
    c10::cuda::CUDAGuard guard(d);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
    device = d;
    stream = c10::cuda::getStreamFromExternal(raw, d.index());
  }
  TORCH_CHECK(d == device, rankPrefix(setup.rank), "XIRANG_CUDA_TRANSPORT=nccl: group '", setup.group_name,
              "' runs over NCCL on ", device, ", got tensors on ", d,
              " (one device per process group: make a group per device, or use XIRANG_CUDA_TRANSPORT=host)");
  return *stream;
}

transport::NcclLink& NcclDevice::linkFor(const Comm& host, transport::Deadline deadline) {
  {
    std::lock_guard<std::mutex> g(mu);
    TORCH_CHECK(why.empty(), why);
    if (link) return *link;
  }
  c10::cuda::CUDAGuard guard(device);
  device::NcclApi& nccl = cuda::ncclApi();  // loadable: the Engine checked it at group creation
  const std::string key = setup.key_ns + "/nccl/" + setup.group_name + "/epoch0";
  const int rank = host.rank, size = host.size();
  device::NcclUniqueId id = transport::shareNcclUniqueId(nccl, *setup.store, key, rank, deadline);
  device::NcclComm c = transport::initNcclComm(nccl, id, rank, size, deadline, setup.group_name);
  auto s = reinterpret_cast<device::Stream>(raw);
  std::unique_ptr<transport::NcclLink> l;
  try {
    l = std::make_unique<transport::NcclLink>(nccl, cuda::runtimeApi(), c, rank, size, s);
  } catch (...) {
    (void)nccl.commAbort(c);  // the peers' communicator must not wait for this one
    throw;
  }
  // A peer that failed elsewhere writes the group's abort note (Tcp::abort); a rank blocked in
  // NCCL reads it here (every 200 ms of a wait), as NCCL tells only the ranks a failed call joins.
  l->setStopCheck(
      [store = setup.store, key = setup.key_ns + "/abort"]() -> std::string {
        try {
          if (store->check(key)) return store->get(key, Clock::now() + std::chrono::seconds(1));
        } catch (const std::exception&) {  // an unreachable store: the deadline still bounds the wait
        }
        return {};
      },
      std::chrono::milliseconds(200));
  auto r = std::make_unique<algo::DeviceReducer>(cuda::runtimeApi(), cuda::kernelApi(), s);
  std::string aborted;
  {
    std::lock_guard<std::mutex> g(mu);
    link = std::move(l);
    reducer = std::move(r);
    aborted = why;
  }
  if (!aborted.empty()) {
    link->abort(aborted);  // the comm thread: no NCCL call of it runs now
    TORCH_CHECK(false, aborted);
  }
  env::log(env::Level::Info, rank, "group '" + setup.group_name + "': NCCL communicator of " + std::to_string(size) +
                                       " ranks on " + device.str() + " (NCCL " + cuda::ncclVersionString() + ", " +
                                       cuda::ncclLibraryPath() + ")");
  return *link;
}

void NcclDevice::interrupt(const std::string& w) {
  transport::NcclLink* l = nullptr;
  {
    std::lock_guard<std::mutex> g(mu);
    if (why.empty()) why = w;
    l = link.get();  // destroyed only with this object
  }
  if (l) l->interrupt(w);
}

NcclStage::NcclStage(Streams& streams, std::shared_ptr<NcclDevice> dev) : Stage(streams), dev_(std::move(dev)) {}
NcclStage::~NcclStage() = default;

c10::cuda::CUDAStream NcclStage::sideStream(c10::Device device) { return dev_->streamFor(device); }

at::Tensor NcclStage::bind(const at::Tensor& t, bool copy_in, bool copy_out) {
  if (!t.defined()) return t;
  if (!t.is_cuda()) {
    TORCH_CHECK(t.numel() == 0, "xirang: XIRANG_CUDA_TRANSPORT=nccl: every tensor of an operation on CUDA tensors must be "
                "on that GPU, got a ", t.device(), " tensor of ", t.numel(), " elements (use XIRANG_CUDA_TRANSPORT=host "
                "to mix devices)");
    return t;
  }
  track(t);
  entries_.push_back(Entry{t, t, copy_in, copy_out});
  return t;
}

const Comm& NcclStage::comm(const Comm& host, const OpCtx& ctx) {
  if (entries_.empty()) return host;  // only empty CPU tensors: nothing to move
  deadline_ = ctx.deadline;
  transport::NcclLink& link = dev_->linkFor(host, ctx.deadline);
  Comm& c = dev_->comm;  // comm thread only
  c = host;
  c.link = &link;
  c.reducer = dev_->reducer.get();
  c.shm = nullptr;
  c.scratch = dev_->scratch;
  linked_ = true;
  return c;
}

void NcclStage::run(const std::function<void()>& body) {
  // Called only when copies(): at least one CUDA tensor is bound, so device_ and ev_ are set.
  c10::cuda::CUDAGuard dg(device_);
  ev_->ready.block(ev_->side);
  {
    c10::cuda::CUDAStreamGuard sg(ev_->side);
    try {
      body();
    } catch (...) {
      keepAlive();  // also when the body failed with work still enqueued
      // Sends and receives of this op may be enqueued with no peer to match them: end them (the
      // group is poisoned by this error anyway). The comm thread, between NCCL calls, is the one
      // place that aborts the communicator.
      if (linked_) dev_->link->abort(rankPrefix(dev_->setup.rank) + "an NCCL operation failed");
      throw;
    }
    keepAlive();
    ev_->done.record(ev_->side);
    ev_->done_recorded = true;
  }
  if (linked_) dev_->link->synchronize(deadline_);  // made by comm(), kept for the group
  else ev_->side.synchronize();
}

Engine::Engine(const EngineSetup& setup)
    : setup_(setup), transport_(transportSetting(setup.rank)), nccl_(std::make_shared<NcclDevice>(setup)) {
  if (transport_ != Transport::Nccl) return;
  TORCH_CHECK(!setup_.elastic, rankPrefix(setup_.rank), "group '", setup_.group_name,
              "': XIRANG_CUDA_TRANSPORT=nccl does not support elastic mode (XIRANG_ELASTIC=1) yet: a rebuilt ring "
              "needs a new communicator; use XIRANG_CUDA_TRANSPORT=host");
  std::string why;
  TORCH_CHECK(cuda::tryNcclApi(&why) != nullptr, rankPrefix(setup_.rank), "group '", setup_.group_name,
              "': XIRANG_CUDA_TRANSPORT=nccl: ", why);
}

Engine::~Engine() = default;

std::shared_ptr<OpStage> Engine::stage(bool device_link) {
  std::call_once(said_, [&] {
    env::log(env::Level::Info, setup_.rank,
             "group '" + setup_.group_name + "': CUDA tensors run " +
                 (transport_ == Transport::Nccl
                      ? std::string("over NCCL (XIRANG_CUDA_TRANSPORT=nccl; point-to-point host-staged)")
                      : std::string("host-staged: pinned host buffers and the TCP/shared-memory engine "
                                    "(XIRANG_CUDA_TRANSPORT=nccl runs them over NCCL)")));
  });
  if (transport_ == Transport::Nccl && device_link) return std::make_shared<NcclStage>(streams_, nccl_);
  return std::make_shared<Stage>(streams_);
}

void Engine::abort(const std::string& why) { nccl_->interrupt(why); }

}  // namespace xirang::cudastage
