// The host-staged CUDA engine: see cuda_stage.h.
#include "cuda/cuda_stage.h"

#include "backend/tensors.h"
#include "core/algorithms/device_reducer.h"
#include "core/device/backoff.h"
#include "core/env.h"
#include "core/transport/nccl_link.h"
#include "core/transport/staged_link.h"
#include "cuda/cuda_api.h"
#include "cuda/nccl_api.h"

#include <unistd.h>

#include <cstdio>
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
// XIRANG_CUDA_TRANSPORT: "auto" (default) -> Auto, "host" -> Host, "mirror" -> Mirror, "nccl" -> Nccl; anything
// else throws c10::Error naming `rank` and the accepted values.
Transport transportSetting(int rank) {
  const std::string t = env::get("XIRANG_CUDA_TRANSPORT");  // declared in core/env.cc
  if (t == "auto") return Transport::Auto;
  if (t == "host") return Transport::Host;
  if (t == "mirror") return Transport::Mirror;
  if (t == "nccl") return Transport::Nccl;
  TORCH_CHECK(false, rankPrefix(rank), "XIRANG_CUDA_TRANSPORT must be auto, host, mirror or nccl, got '", t, "'");
}
}  // namespace

// A stream of xirang's own on `d`, never destroyed (as torch's pool streams are not: the caching
// allocator records events on it when a tensor used there is freed later). Not a pool stream: that
// may be another process group's or library's, and this group's waits would wait for its work too.
c10::cuda::CUDAStream ownStream(c10::Device d) {
  c10::cuda::CUDAGuard guard(d);
  cudaStream_t raw = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  return c10::cuda::getStreamFromExternal(raw, d.index());
}

struct StreamsImpl {
  std::mutex mu;
  // Per device: the mirror engine's side stream, and the stream Futures are completed on.
  std::map<c10::DeviceIndex, c10::cuda::CUDAStream> side, completion;
  c10::cuda::CUDAStream get(c10::DeviceIndex d) { return find(side, d); }
  c10::cuda::CUDAStream completionStream(c10::DeviceIndex d) { return find(completion, d); }

 private:
  c10::cuda::CUDAStream find(std::map<c10::DeviceIndex, c10::cuda::CUDAStream>& m, c10::DeviceIndex d) {
    std::lock_guard<std::mutex> g(mu);
    auto it = m.find(d);
    if (it == m.end()) it = m.emplace(d, ownStream(c10::Device(c10::kCUDA, d))).first;
    return it->second;
  }
};

Streams::Streams() : impl_(std::make_shared<StreamsImpl>()) {}
Streams::~Streams() = default;

namespace {
// A cudaEvent_t without timing, created on first record (on the stream's device).
class Event {
 public:
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (ev_) (void)cudaEventDestroy(ev_);  // no CUDAGuard: it may throw (at exit), and the call needs none
  }
  void record(const c10::cuda::CUDAStream& s) {
    c10::cuda::CUDAGuard g(s.device_index());
    if (!ev_) C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
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
  // The host waits for the work recorded before, polling until `deadline` (transport::TimeoutError
  // naming `what`): a stalled stream fails the op instead of blocking its thread for ever.
  void wait(transport::Deadline deadline, const char* what) {
    device::Backoff b;
    while (!query()) {
      if (Clock::now() >= deadline) throw transport::TimeoutError(std::string("timed out waiting for ") + what, -1);
      b.pause();
    }
  }

 private:
  cudaEvent_t ev_ = nullptr;
};
}  // namespace

struct Stage::Events {
  explicit Events(c10::cuda::CUDAStream s) : side(s) {}
  c10::cuda::CUDAStream side;
  Event ready;   // caller's stream: inputs written
  Event copied;  // side stream: the copies to the host (mirror engine)
  Event done;    // side stream: copies back enqueued before it
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

void Stage::copyIn(transport::Deadline deadline) {
  if (entries_.empty()) return;
  c10::cuda::CUDAGuard dg(device_);
  ev_->ready.block(ev_->side);
  {
    c10::cuda::CUDAStreamGuard sg(ev_->side);
    for (auto& e : entries_)
      if (e.copy_in) e.host.copy_(e.user, /*non_blocking=*/true);
  }
  ev_->copied.record(ev_->side);
  ev_->copied.wait(deadline, "the copies of the operation's CUDA tensors to host memory");
}

void Stage::keepAlive() {
  for (auto& e : entries_)
    c10::cuda::CUDACachingAllocator::recordStream(e.user.storage().data_ptr(), ev_->side);
}

void Stage::copyOut() {
  if (entries_.empty()) return;
  // After the caller's stream reached the op: a receive (which has no copyIn) must not write its
  // tensor while work queued before it on that stream still reads it, or before its memory is free.
  ev_->ready.block(ev_->side);
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
  // On the group's completion stream, after this op's done event only: the Future's events, which
  // its waiters' streams wait on, cover this op and nothing queued on the side stream since (the
  // completion thread may mark it after the next ops were enqueued there: a waiter would also wait
  // for those, and for peers that reach them only after this rank's wait).
  c10::cuda::CUDAStream cs = streams_->completionStream(device_.index());
  if (ev_->done_recorded) ev_->done.block(cs);
  c10::cuda::CUDAStreamGuard sg(cs);
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

// ---------------------------------------------------------------- the device-link engines

// One group's device, stream, link and reducer for an engine that runs the algorithms on the
// tensors themselves. The device and stream are fixed by the first bind (caller's thread), the
// link made by the first op (comm thread).
struct LinkDevice {
  LinkDevice(const EngineSetup& s, std::string transport, const char* engine)
      : setup(s), transport(std::move(transport)), engine(engine) {}
  virtual ~LinkDevice();
  LinkDevice(const LinkDevice&) = delete;
  LinkDevice& operator=(const LinkDevice&) = delete;

  // The engine's stream on `d`, created on the first call; c10::Error when the group already
  // runs on another device.
  c10::cuda::CUDAStream streamFor(c10::Device d);
  // Whether an op on `d` can run here: no device fixed yet, or `d` itself.
  bool accepts(c10::Device d);
  // Comm thread: the device Comm of an op (the link made on the first call; throws once
  // interrupted).
  const Comm& comm(const Comm& host, const OpCtx& ctx);
  // Comm thread, after the op's body is enqueued: waits for the stream under the op's deadline.
  virtual void synchronize(transport::Deadline deadline) = 0;
  // Comm thread: the op's body failed with work enqueued.
  virtual void failed() {}
  // Any thread: a running or later wait of the link fails at once.
  void interrupt(const std::string& why);

  const EngineSetup setup;
  const std::string transport;  // "XIRANG_CUDA_TRANSPORT=nccl", ...: for messages
  const char* const engine;      // records' name: "nccl", "staged"
  std::mutex mu;  // device, stream, link, why
  c10::Device device{c10::kCPU};
  cudaStream_t raw = nullptr;  // never destroyed: tensors recorded on it may be freed after the group
  std::optional<c10::cuda::CUDAStream> stream;
  std::unique_ptr<transport::Link> link;
  std::unique_ptr<algo::DeviceReducer> reducer;
  std::string why;  // interrupted: every later op fails with it
  // Comm thread only: the device Comm handed to the op's body, and its scratch.
  std::shared_ptr<Scratch> scratch = std::make_shared<Scratch>();
  Comm dev_comm;

 protected:
  // Comm thread, first op: the link and reducer (set under mu).
  virtual void makeLink(const Comm& host, transport::Deadline deadline) = 0;
  // Comm thread, every op: the link before the body runs over it.
  virtual void prepare(const Comm& host) { (void)host; }
  void install(std::unique_ptr<transport::Link> l);
};

LinkDevice::~LinkDevice() {
  // The stream stays (as torch's pool streams do): the caching allocator records events on it
  // when a tensor the engine used is freed later. No CUDAGuard (it may throw at exit): the
  // stream-ordered frees and the link's calls name their stream.
  dev_comm = Comm();
  scratch.reset();  // stream-ordered frees on the stream
  reducer.reset();
  link.reset();
}

c10::cuda::CUDAStream LinkDevice::streamFor(c10::Device d) {
  std::lock_guard<std::mutex> g(mu);
  if (!stream) {
    stream = ownStream(d);
    raw = stream->stream();
    device = d;
  }
  TORCH_CHECK(d == device, rankPrefix(setup.rank), transport, ": group '", setup.group_name, "' runs on ", device,
              ", got tensors on ", d,
              " (one device per process group: make a group per device, or use XIRANG_CUDA_TRANSPORT=mirror)");
  return *stream;
}

bool LinkDevice::accepts(c10::Device d) {
  std::lock_guard<std::mutex> g(mu);
  return !stream || d == device;
}

void LinkDevice::install(std::unique_ptr<transport::Link> l) {
  auto r = std::make_unique<algo::DeviceReducer>(cuda::runtimeApi(), cuda::kernelApi(),
                                                 reinterpret_cast<device::Stream>(raw));
  std::string aborted;
  {
    std::lock_guard<std::mutex> g(mu);
    link = std::move(l);
    reducer = std::move(r);
    aborted = why;
  }
  if (!aborted.empty()) {
    link->abort(aborted);  // the comm thread: no call of the link runs now
    TORCH_CHECK(false, aborted);
  }
}

const Comm& LinkDevice::comm(const Comm& host, const OpCtx& ctx) {
  {
    std::lock_guard<std::mutex> g(mu);
    TORCH_CHECK(why.empty(), why);
  }
  if (!link) {
    c10::cuda::CUDAGuard guard(device);
    makeLink(host, ctx.deadline);
  }
  prepare(host);
  Comm& c = dev_comm;  // comm thread only
  c = host;
  c.link = link.get();
  c.reducer = reducer.get();
  c.shm = nullptr;
  c.scratch = scratch;
  return c;
}

void LinkDevice::interrupt(const std::string& w) {
  transport::Link* l = nullptr;
  {
    std::lock_guard<std::mutex> g(mu);
    if (why.empty()) why = w;
    l = link.get();  // destroyed only with this object
  }
  if (l) l->interrupt(w);
}

// The group's abort note (Tcp::abort writes it when a rank fails), "" while there is none or the
// store cannot be read (the waits' deadlines still bound them then).
static std::string abortNote(const EngineSetup& setup) {
  const std::string key = setup.key_ns + "/abort";
  try {
    if (setup.store->check(key)) return setup.store->get(key, Clock::now() + std::chrono::seconds(1));
  } catch (const std::exception&) {
  }
  return {};
}

// The NCCL engine's: the group's own communicator (see cuda_stage.h).
struct NcclDevice : LinkDevice {
  NcclDevice(const EngineSetup& s, std::string transport) : LinkDevice(s, std::move(transport), "nccl") {}
  transport::NcclLink& nccl() { return static_cast<transport::NcclLink&>(*link); }
  void synchronize(transport::Deadline deadline) override { nccl().synchronize(deadline); }
  void failed() override {
    // Sends and receives of this op may be enqueued with no peer to match them: end them (the
    // group is poisoned by this error anyway). The comm thread, between NCCL calls, is the one
    // place that aborts the communicator.
    if (link) link->abort(rankPrefix(setup.rank) + "an NCCL operation failed");
  }
  // XIRANG_CUDA_TRANSPORT=auto, once the ranks chose NCCL: the communicator on device `d`, made on
  // the caller's thread before any op of this engine (transport::startNcclAgreed). False, with
  // `why`, when some rank could not make its own: every rank falls back together. Throws when the
  // group fails meanwhile (a peer gone, the group aborted, a rank silent past the deadline).
  bool startAgreed(c10::Device d, transport::Deadline deadline, std::string* why) {
    (void)streamFor(d);
    c10::cuda::CUDAGuard guard(d);
    device::NcclApi& api = cuda::ncclApi();  // loadable: every rank said so in the choice
    const int rank = setup.rank, size = setup.size;
    // The link (its events and buffers) is made before this rank says it has a communicator: a
    // rank that cannot make it falls back with the others instead of leaving them to wait.
    std::unique_ptr<transport::NcclLink> l;
    transport::NcclStart st =
        transport::startNcclAgreed(api, *setup.store, key(), rank, size, deadline, setup.group_name,
                                   stopCheck(rank, size), [&](device::NcclComm c) { l = newLink(api, c, rank, size); });
    if (!st.comm) {
      *why = st.why;
      return false;  // `l`, if made, tears its communicator down
    }
    adopt(std::move(l), rank, size);
    return true;
  }

 protected:
  void makeLink(const Comm& host, transport::Deadline deadline) override {
    device::NcclApi& api = cuda::ncclApi();  // loadable: the Engine checked it at group creation
    const int rank = host.rank, size = host.size();
    const transport::StopCheck stop = stopCheck(rank, size);
    device::NcclUniqueId id = transport::shareNcclUniqueId(api, *setup.store, key(), rank, deadline, stop);
    const device::NcclComm c = transport::initNcclComm(api, id, rank, size, deadline, setup.group_name, stop);
    std::unique_ptr<transport::NcclLink> l;
    try {
      l = newLink(api, c, rank, size);
    } catch (...) {
      // the peers' communicator must not wait for this one
      device::NcclApi* p = &api;
      (void)transport::boundedTeardown([p, c] { return p->commAbort(c); }, "ncclCommAbort", rank);
      throw;
    }
    adopt(std::move(l), rank, size);
  }

 private:
  std::string key() const { return setup.key_ns + "/nccl/" + setup.group_name + "/epoch0"; }
  // The communicator's set-up waits end early when this group is interrupted (poisoned, aborted,
  // shut down at exit), its abort note is in the store, or a ring neighbour is gone (which fails
  // its other neighbour, whose abort note then reaches every rank): a peer that failed before or
  // during the communicator's creation does not hold the others until the op's deadline.
  transport::StopCheck stopCheck(int rank, int size) {
    return [this, rank, size, next_store_check = Clock::time_point{}]() mutable -> std::string {
      {
        std::lock_guard<std::mutex> g(mu);
        if (!why.empty()) return why;
      }
      if (Clock::now() < next_store_check) return {};
      next_store_check = Clock::now() + std::chrono::milliseconds(200);
      const std::string note = abortNote(setup);
      if (!note.empty()) return "the group was aborted: " + note;
      if (setup.peer_gone && size > 1)
        for (int p : {(rank + 1) % size, (rank + size - 1) % size}) {
          std::string w = setup.peer_gone(p);
          if (!w.empty()) return w;
        }
      return {};
    };
  }
  // The link over communicator `c` on the engine's stream; it owns `c` once made (if it throws,
  // `c` is still the caller's).
  std::unique_ptr<transport::NcclLink> newLink(device::NcclApi& api, device::NcclComm c, int rank, int size) {
    return std::make_unique<transport::NcclLink>(api, cuda::runtimeApi(), c, rank, size,
                                                 reinterpret_cast<device::Stream>(raw));
  }
  // Installs link `l`.
  void adopt(std::unique_ptr<transport::NcclLink> l, int rank, int size) {
    // A peer that failed elsewhere writes the group's abort note (Tcp::abort); a rank blocked in
    // NCCL reads it here (every 200 ms of a wait), as NCCL tells only the ranks a failed call joins.
    l->setStopCheck([s = setup] { return abortNote(s); }, std::chrono::milliseconds(200));
    install(std::move(l));
    env::log(env::Level::Info, rank, "group '" + setup.group_name + "': NCCL communicator of " + std::to_string(size) +
                                         " ranks on " + device.str() + " (NCCL " + cuda::ncclVersionString() + ", " +
                                         cuda::ncclLibraryPath() + ")");
  }
};

// The staged engine's: the group's TCP link under a StagedLink (see cuda_stage.h).
struct StagedDevice : LinkDevice {
  StagedDevice(const EngineSetup& s, std::string transport) : LinkDevice(s, std::move(transport), "staged") {}
  transport::StagedLink& staged() { return static_cast<transport::StagedLink&>(*link); }
  void synchronize(transport::Deadline deadline) override { staged().synchronize(deadline); }

 protected:
  void makeLink(const Comm& host, transport::Deadline deadline) override {
    (void)deadline;
    install(std::make_unique<transport::StagedLink>(cuda::runtimeApi(), reinterpret_cast<device::Stream>(raw),
                                                    *host.link));
  }
  // The group's TCP link is its one for life (no elastic rebuild here: the Engine keeps elastic
  // groups on the mirrors).
  void prepare(const Comm& host) override {
    TORCH_CHECK(&staged().host() == host.link, "xirang: the staged CUDA engine's host link changed (elastic group?)");
  }
};

DeviceStage::DeviceStage(Streams& streams, std::shared_ptr<LinkDevice> dev) : Stage(streams), dev_(std::move(dev)) {}
DeviceStage::~DeviceStage() = default;

c10::cuda::CUDAStream DeviceStage::sideStream(c10::Device device) { return dev_->streamFor(device); }

const char* DeviceStage::engine() const { return entries_.empty() ? "host" : dev_->engine; }

at::Tensor DeviceStage::bind(const at::Tensor& t, bool copy_in, bool copy_out) {
  if (!t.defined()) return t;
  if (!t.is_cuda()) {
    TORCH_CHECK(t.numel() == 0, "xirang: ", dev_->transport, ": every tensor of an operation on CUDA tensors must be "
                "on that GPU, got a ", t.device(), " tensor of ", t.numel(), " elements (use XIRANG_CUDA_TRANSPORT=mirror "
                "to mix devices)");
    return t;
  }
  track(t);
  entries_.push_back(Entry{t, t, copy_in, copy_out});
  return t;
}

const Comm& DeviceStage::comm(const Comm& host, const OpCtx& ctx) {
  if (entries_.empty()) return host;  // only empty CPU tensors: nothing to move
  const Comm& c = dev_->comm(host, ctx);
  linked_ = true;
  return c;
}

void DeviceStage::run(transport::Deadline deadline, const std::function<void()>& body) {
  // Called only when copies(): at least one CUDA tensor is bound, so device_ and ev_ are set.
  c10::cuda::CUDAGuard dg(device_);
  ev_->ready.block(ev_->side);
  {
    c10::cuda::CUDAStreamGuard sg(ev_->side);
    try {
      body();
    } catch (...) {
      keepAlive();  // also when the body failed with work still enqueued
      if (linked_) dev_->failed();
      throw;
    }
    keepAlive();
    ev_->done.record(ev_->side);
    ev_->done_recorded = true;
  }
  try {
    if (linked_) dev_->synchronize(deadline);  // made by comm(), kept for the group
    else ev_->done.wait(deadline, "the operation's work on the side stream");
  } catch (...) {
    // A timeout, a peer's failure or an interrupt (the group was poisoned) during the wait: the
    // NCCL calls enqueued must end too, or they spin on the GPU until the group is destroyed.
    if (linked_) dev_->failed();
    throw;
  }
}

namespace {
const char* transportName(Transport t) {
  switch (t) {
    case Transport::Auto: return "XIRANG_CUDA_TRANSPORT=auto";
    case Transport::Host: return "XIRANG_CUDA_TRANSPORT=host";
    case Transport::Mirror: return "XIRANG_CUDA_TRANSPORT=mirror";
    case Transport::Nccl: return "XIRANG_CUDA_TRANSPORT=nccl";
  }
  return "XIRANG_CUDA_TRANSPORT";
}

// Device `d` as auto's records name it: its UUID ("GPU-" and 32 hex digits), and "<hostname>/<PCI
// domain:bus:device>", which is how NCCL tells GPUs apart (MIG instances of one GPU share it).
void identifyGpu(c10::Device d, std::string* uuid, std::string* where) {
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, d.index()));
  static const char* hex = "0123456789abcdef";
  *uuid = "GPU-";
  for (unsigned char b : prop.uuid.bytes) {
    *uuid += hex[b >> 4];
    *uuid += hex[b & 15];
  }
  char host[256] = {};
  (void)gethostname(host, sizeof(host) - 1);
  char bus[32];
  std::snprintf(bus, sizeof(bus), "%04x:%02x:%02x", static_cast<unsigned>(prop.pciDomainID),
                static_cast<unsigned>(prop.pciBusID), static_cast<unsigned>(prop.pciDeviceID));
  *where = std::string(host) + "/" + bus;
}
}  // namespace

Engine::Engine(const EngineSetup& setup)
    : setup_(setup),
      transport_(transportSetting(setup.rank)),
      nccl_(std::make_shared<NcclDevice>(setup, transportName(transport_))) {
  // Elastic mode keeps the mirrors: a rebuilt ring replaces the host link under the device one,
  // and its op retries restore their inputs on the host. Auto there never takes NCCL.
  if ((transport_ == Transport::Host || transport_ == Transport::Auto) && !setup_.elastic)
    staged_ = std::make_shared<StagedDevice>(setup, transportName(transport_));
  if (transport_ == Transport::Auto && setup_.elastic) use_nccl_ = false;
  if (transport_ == Transport::Host || transport_ == Transport::Mirror) {
    use_nccl_ = false;
    // Auto peers (the settings agree at creation) wait for this rank's word at their first CUDA
    // collective: say now that it is not auto, so that they choose host at once.
    if (!setup_.elastic && setup_.size > 1) {
      try {
        transport::declareNotAuto(*setup_.store, autoKey(), setup_.rank);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, rankPrefix(setup_.rank), "group '", setup_.group_name, "': ", transportName(transport_),
                    ": writing this rank's setting to the store failed: ", e.what());
      }
    }
  }
  if (transport_ != Transport::Nccl) return;
  use_nccl_ = true;
  TORCH_CHECK(!setup_.elastic, rankPrefix(setup_.rank), "group '", setup_.group_name,
              "': XIRANG_CUDA_TRANSPORT=nccl does not support elastic mode (XIRANG_ELASTIC=1) yet: a rebuilt ring "
              "needs a new communicator; use XIRANG_CUDA_TRANSPORT=host");
  std::string why;
  TORCH_CHECK(cuda::tryNcclApi(&why) != nullptr, rankPrefix(setup_.rank), "group '", setup_.group_name,
              "': XIRANG_CUDA_TRANSPORT=nccl: ", why);
}

Engine::~Engine() = default;

bool Engine::stagedFits(const std::vector<at::Tensor>& tensors) const {
  if (!staged_ || (setup_.host_shm && setup_.host_shm())) return false;
  std::optional<c10::Device> dev;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    // Every tensor on the one GPU: the op bodies mix no devices (an empty CPU placeholder, which
    // the NCCL engine takes, goes to the mirrors here, where it always worked).
    if (!t.is_cuda() || t.layout() != at::kStrided || (dev && t.device() != *dev)) return false;
    dev = t.device();
  }
  return dev && staged_->accepts(*dev);
}

std::string Engine::autoKey() const { return setup_.key_ns + "/cudadev/" + setup_.group_name; }

bool Engine::useNccl(bool device_link, const std::vector<at::Tensor>& tensors) {
  // Point-to-point does not decide and never waits for the decision: it takes the mirrors
  // whatever the choice.
  if (!device_link) return false;
  std::lock_guard<std::mutex> g(decide_mu_);
  // A decision that failed (a peer gone, the group aborted) is not made again: its store keys
  // serve one attempt, and the group is failing anyway.
  TORCH_CHECK(decide_failed_.empty(), decide_failed_);
  if (!use_nccl_) {
    try {
      decideAuto(tensors);
    } catch (const c10::Error& e) {
      decide_failed_ = e.what_without_backtrace();
      throw;
    } catch (const std::exception& e) {
      decide_failed_ = e.what();
      throw;
    }
  }
  if (!said_) {
    said_ = true;
    const std::string why = auto_why_.empty() ? std::string() : ": " + auto_why_;
    std::string how;
    if (*use_nccl_)
      how = std::string("over NCCL (") + transportName(transport_) + why + "; point-to-point host-staged)";
    else if (staged_)
      how = std::string("host-staged (") + transportName(transport_) + why +
            "): the codec and reductions as kernels on the GPU, only the bytes sent through pinned host buffers "
            "and TCP (pinned mirrors of whole tensors and the CPU engine where ranks share a host's memory or for "
            "point-to-point)";
    else
      how = std::string("host-staged (") + transportName(transport_) + why +
            "): pinned host mirrors and the TCP/shared-memory engine";
    env::log(env::Level::Info, setup_.rank, "group '" + setup_.group_name + "': CUDA tensors run " + how);
  }
  return *use_nccl_;
}

void Engine::decideAuto(const std::vector<at::Tensor>& tensors) {
  // XIRANG_CUDA_TRANSPORT=auto, this group's first CUDA collective.
  c10::Device dev(c10::kCPU);
  for (const auto& t : tensors)
    if (t.defined() && t.is_cuda()) {
      dev = t.device();
      break;
    }
  transport::NcclCandidate mine;
  identifyGpu(dev, &mine.gpu, &mine.where);
  if (!cuda::tryNcclApi(&mine.unavailable) && mine.unavailable.empty()) mine.unavailable = "NCCL did not load";
  mine.version = cuda::ncclVersionString();
  transport::NcclChoice c;
  try {
    c = transport::agreeOnNccl(*setup_.store, autoKey(), setup_.rank, setup_.size, mine,
                               Clock::now() + setup_.timeout, setup_.peer_gone);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, rankPrefix(setup_.rank), "group '", setup_.group_name, "': XIRANG_CUDA_TRANSPORT=auto: ",
                e.what());
  }
  if (c.nccl) {
    // What auto cannot see before trying: a rank whose communicator cannot be made (NCCL's
    // bootstrap cannot reach a peer, a wrong interface, no device memory). Every rank falls back.
    std::string fell;
    bool made = false;
    try {
      made = nccl_->startAgreed(dev, Clock::now() + setup_.timeout, &fell);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, rankPrefix(setup_.rank), "group '", setup_.group_name,
                  "': XIRANG_CUDA_TRANSPORT=auto chose NCCL, and making its communicator failed: ", e.what());
    }
    if (!made) {
      env::log(env::Level::Warn, setup_.rank,
               "group '" + setup_.group_name + "': XIRANG_CUDA_TRANSPORT=auto chose NCCL (" + c.why + "), but " + fell +
                   ": every rank of the group falls back to the host-staged engines");
      c = {false, "NCCL was chosen, but " + fell};
    }
  }
  use_nccl_ = c.nccl;
  auto_why_ = c.why;
}

std::shared_ptr<OpStage> Engine::stage(bool device_link, const std::vector<at::Tensor>& tensors) {
  if (useNccl(device_link, tensors)) return std::make_shared<DeviceStage>(streams_, nccl_);
  if (device_link && stagedFits(tensors)) return std::make_shared<DeviceStage>(streams_, staged_);
  return std::make_shared<Stage>(streams_);
}

void Engine::abort(const std::string& why) {
  nccl_->interrupt(why);
  if (staged_) staged_->interrupt(why);
}

}  // namespace xirang::cudastage
