// The loopback fake of CUDA, NCCL and the kernels: see fake.h. One mutex and one condition
// variable guard all of its state (a test-sized fake: simple beats fast).
#include "core/device/fake.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace xirang::device {

namespace {

struct StreamObj {
  std::deque<std::function<void()>> q;
  std::thread worker;
  bool destroyed = false;
};

struct EventObj {
  uint64_t recorded = 0, completed = 0;
};

struct World;
struct FakeComm {
  World* world = nullptr;
  int rank = 0;
  bool aborted = false, destroyed = false;
  int async_error = kNcclSuccess;
  std::string last_error;
};

struct P2POp {
  bool send = false;
  const void* src = nullptr;  // send
  void* dst = nullptr;        // recv
  size_t bytes = 0;
  int peer = 0;
  FakeComm* comm = nullptr;
  Stream stream = nullptr;
  uint64_t k = 0;  // index among the calls of this direction and (src, dst) pair, in issue order
  bool done = false, failed = false;
};

struct World {
  int nranks = 0;
  int joined = 0;
  std::vector<FakeComm*> members;
  std::set<int> dead;  // ranks whose communicator was aborted
  std::map<std::pair<int, int>, uint64_t> issued_sends, issued_recvs;           // (src, dst) -> count
  std::map<std::tuple<int, int, uint64_t>, std::shared_ptr<P2POp>> sends, recvs;  // waiting for a match
};

// The calls between groupStart and groupEnd of one thread (NCCL's groups are per thread).
struct GroupState {
  int depth = 0;
  std::vector<std::shared_ptr<P2POp>> ops;
  int error = kNcclSuccess;
};
thread_local GroupState tGroup;

const char* ncclName(int r) {
  switch (r) {
    case kNcclSuccess: return "no error";
    case kNcclUnhandledCudaError: return "unhandled cuda error";
    case kNcclSystemError: return "unhandled system error";
    case kNcclInternalError: return "internal error";
    case kNcclInvalidArgument: return "invalid argument";
    case kNcclInvalidUsage: return "invalid usage";
    case kNcclRemoteError: return "remote process exited or there was a network error";
    case kNcclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

}  // namespace

struct FakeDevice::Impl {
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::vector<std::unique_ptr<StreamObj>> streams;
  StreamObj* default_stream = nullptr;
  std::vector<std::unique_ptr<EventObj>> events;
  std::set<void*> allocations;
  std::map<std::string, std::unique_ptr<World>> worlds;
  std::vector<std::unique_ptr<FakeComm>> comms;
  uint64_t next_id = 0;
  std::atomic<uint64_t> kernels{0};

  StreamObj* newStream() {  // under mu
    streams.push_back(std::make_unique<StreamObj>());
    StreamObj* s = streams.back().get();
    s->worker = std::thread([this, s] { work(s); });
    return s;
  }
  StreamObj* stream(Stream s) { return s ? reinterpret_cast<StreamObj*>(s) : default_stream; }

  void work(StreamObj* s) {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return stopping || !s->q.empty() || s->destroyed; });
      if (stopping || (s->q.empty() && s->destroyed)) return;
      auto fn = std::move(s->q.front());
      s->q.pop_front();
      lk.unlock();
      fn();
      lk.lock();
    }
  }

  int enqueue(Stream s, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> g(mu);
      StreamObj* so = stream(s);
      if (so->destroyed) return kCudaErrorInvalidValue;
      so->q.push_back(std::move(fn));
    }
    cv.notify_all();
    return kCudaSuccess;
  }

  // --- NCCL matching (under mu) ---

  void setAsync(FakeComm* c, int err, const std::string& why) {
    if (c->async_error == kNcclSuccess) {
      c->async_error = err;
      c->last_error = why;
    }
  }

  void fail(const std::shared_ptr<P2POp>& op, int err, const std::string& why) {
    op->failed = true;
    setAsync(op->comm, err, why);
  }

  // The op's stream reached it: look for its match among the peer's executing calls.
  void activate(const std::shared_ptr<P2POp>& op) {
    World& w = *op->comm->world;
    const int me = op->comm->rank;
    if (op->comm->aborted) return fail(op, kNcclInvalidUsage, "communicator aborted");
    if (w.dead.count(op->peer))
      return fail(op, kNcclRemoteError, "rank " + std::to_string(op->peer) + " aborted its communicator");
    const auto key = op->send ? std::make_tuple(me, op->peer, op->k) : std::make_tuple(op->peer, me, op->k);
    auto& mine = op->send ? w.sends : w.recvs;
    auto& theirs = op->send ? w.recvs : w.sends;
    auto it = theirs.find(key);
    if (it == theirs.end()) {
      mine[key] = op;
      return;
    }
    std::shared_ptr<P2POp> other = it->second;
    theirs.erase(it);
    P2POp& s = op->send ? *op : *other;
    P2POp& r = op->send ? *other : *op;
    if (s.bytes != r.bytes) {
      const std::string why = "size mismatch: rank " + std::to_string(s.comm->rank) + " sends " +
                              std::to_string(s.bytes) + " bytes, rank " + std::to_string(r.comm->rank) +
                              " receives " + std::to_string(r.bytes);
      fail(op, kNcclInvalidUsage, why);
      fail(other, kNcclInvalidUsage, why);
      return;
    }
    if (s.bytes) std::memcpy(r.dst, s.src, s.bytes);
    s.done = r.done = true;
  }

  // A group's calls on one stream, run by that stream's worker.
  void runGroup(const std::vector<std::shared_ptr<P2POp>>& ops) {
    std::unique_lock<std::mutex> lk(mu);
    for (const auto& op : ops) activate(op);
    cv.notify_all();
    cv.wait(lk, [&] {
      if (stopping) return true;
      for (const auto& op : ops)
        if (!op->done && !op->failed) return false;
      return true;
    });
  }

  void abortComm(FakeComm* c) {  // under mu
    if (c->aborted) return;
    c->aborted = true;
    World& w = *c->world;
    w.dead.insert(c->rank);
    for (auto* table : {&w.sends, &w.recvs}) {
      for (auto it = table->begin(); it != table->end();) {
        const auto& op = it->second;
        if (op->comm == c) {
          op->failed = true;
          it = table->erase(it);
        } else if (op->peer == c->rank) {
          fail(op, kNcclRemoteError, "rank " + std::to_string(c->rank) + " aborted its communicator");
          it = table->erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  class Cuda : public CudaApi {
   public:
    explicit Cuda(Impl& d) : d_(d) {}
    const char* name() const override { return "fake"; }
    const char* errorString(int code) override {
      switch (code) {
        case kCudaSuccess: return "no error";
        case kCudaErrorInvalidValue: return "invalid argument";
        case kCudaErrorMemoryAllocation: return "out of memory";
        case kCudaErrorNotReady: return "device not ready";
        default: return "unknown error";
      }
    }
    int getDevice(int* device) override {
      *device = device_;
      return kCudaSuccess;
    }
    int setDevice(int device) override {
      if (device != 0) return kCudaErrorInvalidValue;  // one fake GPU per process
      device_ = device;
      return kCudaSuccess;
    }
    int malloc(void** ptr, size_t bytes) override {
      void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
      if (!p) return kCudaErrorMemoryAllocation;
      std::lock_guard<std::mutex> g(d_.mu);
      d_.allocations.insert(p);
      *ptr = p;
      return kCudaSuccess;
    }
    int free(void* ptr) override {
      if (!ptr) return kCudaSuccess;
      {
        std::lock_guard<std::mutex> g(d_.mu);
        if (!d_.allocations.erase(ptr)) return kCudaErrorInvalidValue;
      }
      std::free(ptr);
      return kCudaSuccess;
    }
    int mallocAsync(void** ptr, size_t bytes, Stream) override { return malloc(ptr, bytes); }
    int freeAsync(void* ptr, Stream stream) override {
      {
        std::lock_guard<std::mutex> g(d_.mu);
        if (ptr && !d_.allocations.count(ptr)) return kCudaErrorInvalidValue;
      }
      return d_.enqueue(stream, [this, ptr] { (void)free(ptr); });
    }
    int mallocHost(void** ptr, size_t bytes) override { return malloc(ptr, bytes); }
    int freeHost(void* ptr) override { return free(ptr); }
    int memcpyAsync(void* dst, const void* src, size_t bytes, Stream stream) override {
      if (bytes == 0) return kCudaSuccess;
      if (!dst || !src) return kCudaErrorInvalidValue;
      return d_.enqueue(stream, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
    }
    int memsetAsync(void* dst, int value, size_t bytes, Stream stream) override {
      if (bytes == 0) return kCudaSuccess;
      if (!dst) return kCudaErrorInvalidValue;
      return d_.enqueue(stream, [dst, value, bytes] { std::memset(dst, value, bytes); });
    }
    int streamCreate(Stream* stream) override {
      std::lock_guard<std::mutex> g(d_.mu);
      *stream = reinterpret_cast<Stream>(d_.newStream());
      return kCudaSuccess;
    }
    int streamDestroy(Stream stream) override {
      if (!stream) return kCudaErrorInvalidValue;
      {
        std::lock_guard<std::mutex> g(d_.mu);
        d_.stream(stream)->destroyed = true;  // the worker finishes what is queued, then exits
      }
      d_.cv.notify_all();
      return kCudaSuccess;
    }
    int streamSynchronize(Stream stream) override {
      auto done = std::make_shared<bool>(false);
      const int e = d_.enqueue(stream, [this, done] {
        std::lock_guard<std::mutex> g(d_.mu);
        *done = true;
        d_.cv.notify_all();
      });
      if (e != kCudaSuccess) return e;
      std::unique_lock<std::mutex> lk(d_.mu);
      d_.cv.wait(lk, [&] { return *done || d_.stopping; });
      return *done ? kCudaSuccess : kCudaErrorNotReady;
    }
    int eventCreate(Event* event) override {
      std::lock_guard<std::mutex> g(d_.mu);
      d_.events.push_back(std::make_unique<EventObj>());
      *event = reinterpret_cast<Event>(d_.events.back().get());
      return kCudaSuccess;
    }
    int eventDestroy(Event event) override { return event ? kCudaSuccess : kCudaErrorInvalidValue; }
    int eventRecord(Event event, Stream stream) override {
      if (!event) return kCudaErrorInvalidValue;
      auto* e = reinterpret_cast<EventObj*>(event);
      uint64_t gen;
      {
        std::lock_guard<std::mutex> g(d_.mu);
        gen = ++e->recorded;
      }
      return d_.enqueue(stream, [this, e, gen] {
        std::lock_guard<std::mutex> g(d_.mu);
        if (e->completed < gen) e->completed = gen;
        d_.cv.notify_all();
      });
    }
    int streamWaitEvent(Stream stream, Event event) override {
      if (!event) return kCudaErrorInvalidValue;
      auto* e = reinterpret_cast<EventObj*>(event);
      uint64_t gen;
      {
        std::lock_guard<std::mutex> g(d_.mu);
        gen = e->recorded;
      }
      if (gen == 0) return kCudaSuccess;
      return d_.enqueue(stream, [this, e, gen] {
        std::unique_lock<std::mutex> lk(d_.mu);
        d_.cv.wait(lk, [&] { return e->completed >= gen || d_.stopping; });
      });
    }
    int eventQuery(Event event) override {
      if (!event) return kCudaErrorInvalidValue;
      auto* e = reinterpret_cast<EventObj*>(event);
      std::lock_guard<std::mutex> g(d_.mu);
      return e->completed >= e->recorded ? kCudaSuccess : kCudaErrorNotReady;
    }
    int eventSynchronize(Event event) override {
      if (!event) return kCudaErrorInvalidValue;
      auto* e = reinterpret_cast<EventObj*>(event);
      std::unique_lock<std::mutex> lk(d_.mu);
      const uint64_t gen = e->recorded;
      d_.cv.wait(lk, [&] { return e->completed >= gen || d_.stopping; });
      return e->completed >= gen ? kCudaSuccess : kCudaErrorNotReady;
    }

   private:
    Impl& d_;
    static thread_local int device_;
  };

  class Nccl : public NcclApi {
   public:
    explicit Nccl(Impl& d) : d_(d) {}
    const char* name() const override { return "fake"; }
    const char* errorString(int r) override { return ncclName(r); }
    std::string lastError(NcclComm comm) override {
      if (!comm) return "";
      std::lock_guard<std::mutex> g(d_.mu);
      return reinterpret_cast<FakeComm*>(comm)->last_error;
    }
    int getVersion(int* version) override {
      *version = 23007;
      return kNcclSuccess;
    }
    int getUniqueId(NcclUniqueId* id) override {
      std::memset(id->internal, 0, sizeof id->internal);
      std::lock_guard<std::mutex> g(d_.mu);
      const std::string s = "xirang-fake-nccl:" + std::to_string(reinterpret_cast<uintptr_t>(&d_)) + ":" +
                            std::to_string(++d_.next_id);
      std::memcpy(id->internal, s.data(), s.size());
      return kNcclSuccess;
    }
    int commInitRankConfig(NcclComm* comm, int nranks, const NcclUniqueId& id, int rank,
                           const NcclConfig& config) override {
      if (!comm || nranks < 1 || rank < 0 || rank >= nranks) return kNcclInvalidArgument;
      std::unique_lock<std::mutex> lk(d_.mu);
      auto& w = d_.worlds[std::string(id.internal, sizeof id.internal)];
      if (!w) {
        w = std::make_unique<World>();
        w->nranks = nranks;
        w->members.assign(static_cast<size_t>(nranks), nullptr);
      }
      if (w->nranks != nranks || w->members[static_cast<size_t>(rank)]) return kNcclInvalidUsage;
      d_.comms.push_back(std::make_unique<FakeComm>());
      FakeComm* c = d_.comms.back().get();
      c->world = w.get();
      c->rank = rank;
      w->members[static_cast<size_t>(rank)] = c;
      ++w->joined;
      *comm = reinterpret_cast<NcclComm>(c);
      d_.cv.notify_all();
      if (config.blocking) {
        World* wp = w.get();
        d_.cv.wait(lk, [&] { return wp->joined == wp->nranks || d_.stopping; });
      }
      return w->joined == w->nranks ? kNcclSuccess : kNcclInProgress;
    }
    int commAbort(NcclComm comm) override {
      if (!comm) return kNcclInvalidArgument;
      {
        std::lock_guard<std::mutex> g(d_.mu);
        d_.abortComm(reinterpret_cast<FakeComm*>(comm));
      }
      d_.cv.notify_all();
      return kNcclSuccess;
    }
    int commDestroy(NcclComm comm) override {
      if (!comm) return kNcclInvalidArgument;
      {
        std::lock_guard<std::mutex> g(d_.mu);
        auto* c = reinterpret_cast<FakeComm*>(comm);
        if (c->destroyed) return kNcclInvalidUsage;
        d_.abortComm(c);  // nothing may be pending on a destroyed communicator
        c->destroyed = true;
      }
      d_.cv.notify_all();
      return kNcclSuccess;
    }
    int commGetAsyncError(NcclComm comm, int* async_error) override {
      if (!comm || !async_error) return kNcclInvalidArgument;
      std::lock_guard<std::mutex> g(d_.mu);
      auto* c = reinterpret_cast<FakeComm*>(comm);
      if (c->destroyed) return kNcclInvalidUsage;
      if (c->async_error != kNcclSuccess) *async_error = c->async_error;
      else *async_error = c->world->joined == c->world->nranks ? kNcclSuccess : kNcclInProgress;
      return kNcclSuccess;
    }
    int groupStart() override {
      ++tGroup.depth;
      return kNcclSuccess;
    }
    int groupEnd() override {
      if (tGroup.depth == 0) return kNcclInvalidUsage;
      if (--tGroup.depth > 0) return kNcclSuccess;
      std::vector<std::shared_ptr<P2POp>> ops;
      ops.swap(tGroup.ops);
      const int err = tGroup.error;
      tGroup.error = kNcclSuccess;
      if (err != kNcclSuccess) return err;
      launch(ops);
      return kNcclSuccess;
    }
    int send(const void* buf, size_t bytes, int peer, NcclComm comm, Stream stream) override {
      return post(true, const_cast<void*>(buf), bytes, peer, comm, stream);
    }
    int recv(void* buf, size_t bytes, int peer, NcclComm comm, Stream stream) override {
      return post(false, buf, bytes, peer, comm, stream);
    }

   private:
    int post(bool is_send, void* buf, size_t bytes, int peer, NcclComm comm, Stream stream) {
      auto op = std::make_shared<P2POp>();
      int err = kNcclSuccess;
      {
        std::lock_guard<std::mutex> g(d_.mu);
        auto* c = reinterpret_cast<FakeComm*>(comm);
        if (!c || c->destroyed || c->aborted) {
          err = kNcclInvalidUsage;
        } else if (c->world->joined != c->world->nranks) {
          err = kNcclInvalidUsage;  // not initialised yet
        } else if (peer < 0 || peer >= c->world->nranks || (bytes && !buf)) {
          err = kNcclInvalidArgument;
        } else {
          op->send = is_send;
          op->src = buf;
          op->dst = buf;
          op->bytes = bytes;
          op->peer = peer;
          op->comm = c;
          op->stream = stream;
          auto& ctr = is_send ? c->world->issued_sends[{c->rank, peer}] : c->world->issued_recvs[{peer, c->rank}];
          op->k = ctr++;
        }
      }
      if (err != kNcclSuccess) {
        if (tGroup.depth > 0) tGroup.error = err;
        return err;
      }
      if (tGroup.depth > 0) {
        tGroup.ops.push_back(std::move(op));
        return kNcclSuccess;
      }
      launch({op});
      return kNcclSuccess;
    }

    // One group: the calls on each stream run as one unit of that stream.
    void launch(const std::vector<std::shared_ptr<P2POp>>& ops) {
      std::vector<Stream> order;
      std::map<Stream, std::vector<std::shared_ptr<P2POp>>> by;
      for (const auto& op : ops) {
        if (!by.count(op->stream)) order.push_back(op->stream);
        by[op->stream].push_back(op);
      }
      for (Stream s : order) {
        auto group = by[s];
        d_.enqueue(s, [this, group] { d_.runGroup(group); });
      }
    }

    Impl& d_;
  };

  class Kernels : public KernelApi {
   public:
    explicit Kernels(Impl& d) : d_(d) {}
    const char* name() const override { return "emulator"; }
    int launch(const Kernel& k, Stream stream) override {
      if (!checkKernel(k).empty()) return kCudaErrorInvalidValue;
      if (k.n == 0) return kCudaSuccess;
      d_.kernels.fetch_add(1);
      return d_.enqueue(stream, [k] { emulate(k); });
    }

   private:
    Impl& d_;
  };

  Cuda cuda_api{*this};
  Nccl nccl_api{*this};
  Kernels kernel_api{*this};
};

thread_local int FakeDevice::Impl::Cuda::device_ = 0;

FakeDevice::FakeDevice() : impl_(std::make_unique<Impl>()) {
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->default_stream = impl_->newStream();
}

FakeDevice::~FakeDevice() {
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  for (auto& s : impl_->streams)
    if (s->worker.joinable()) s->worker.join();
  for (void* p : impl_->allocations) std::free(p);
}

CudaApi& FakeDevice::cuda() { return impl_->cuda_api; }
NcclApi& FakeDevice::nccl() { return impl_->nccl_api; }
KernelApi& FakeDevice::kernels() { return impl_->kernel_api; }

void FakeDevice::enqueueHostWork(Stream stream, std::function<void()> fn) { (void)impl_->enqueue(stream, std::move(fn)); }

size_t FakeDevice::liveAllocations() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->allocations.size();
}

uint64_t FakeDevice::kernelsLaunched() const { return impl_->kernels.load(); }

}  // namespace xirang::device
