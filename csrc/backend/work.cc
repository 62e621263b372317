#include "backend/work.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "backend/completions.h"
#include "backend/tensors.h"
#include "core/env.h"

namespace xirang {

WorkXirang::WorkXirang(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                       const std::optional<std::vector<at::Tensor>>& inputs, std::shared_ptr<OpStage> stage)
    : Work(rank, type, title, inputs), outputs_(std::move(outputs)), stage_(std::move(stage)) {
  for (auto& o : outputs_) o = stage_->userTensor(o);
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                     stage_->devices());
}

c10::intrusive_ptr<c10::ivalue::Future> WorkXirang::getFuture() {
  std::lock_guard<std::mutex> g(future_mu_);
  future_handed_ = true;
  return future_;
}

std::vector<at::Tensor> WorkXirang::result() { return outputs_; }

bool WorkXirang::wait(std::chrono::milliseconds timeout) {
  WaitClock::Timer timer(wait_clock_.get());
  if (spin_.count() > 0) {  // a small operation ends within the spin: no sleep, no wake-up
    const auto end = Clock::now() + spin_;
    while (!done_.load(std::memory_order_acquire) && Clock::now() < end) std::this_thread::yield();
  }
  if (timeout != kNoTimeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
      TORCH_CHECK(false, desc_, ": Work.wait(timeout=", timeout.count(),
                  " ms) expired while the operation is still in progress (its own op timeout still applies)");
    }
  }
  return Work::wait(kNoTimeout);
}

void WorkXirang::synchronize() { stage_->block(); }

bool WorkXirang::isCompleted() { return c10d::Work::isCompleted() && stage_->query(); }

// The Future first, then the Work (as gloo's finishWorkGloo): a caller woken by Work.wait() reads
// get_future().value() at once (DDP's sparse buckets do), so the Future must be done by then.
// A callback that throws (torch's own wrappers catch) must not leave the Work unfinished.
void WorkXirang::complete(std::exception_ptr error) {
  {
    // Under the lock: a getFuture() racing with this waits until the Future is done, so its
    // caller's callbacks run on its own thread (c10's Future runs them at once when done).
    std::lock_guard<std::mutex> g(future_mu_);
    if (!future_handed_) {
      completeNow(error);
      return;
    }
  }
  auto self = c10::intrusive_ptr<WorkXirang>::unsafe_reclaim_from_nonowning(this);
  Completions::instance().post(rank_, [self, error] { self->completeNow(error); });
}

void WorkXirang::completeNow(std::exception_ptr error) {
  done_.store(true, std::memory_order_release);
  try {
    if (error) future_->setError(error);
    else stage_->completeFuture(future_, c10::IValue(outputs_));  // a CUDA stage: its side stream current
  } catch (const std::exception& e) {
    env::log(env::Level::Warn, rank_, desc_ + ": a Future callback raised: " + e.what());
  }
  finish(error);
}

void Coalescing::start(int rank) {
  XR_CHECK(rank, !open_, "startCoalescing called twice");
  open_ = true;
  works_.clear();
}

namespace {
// The stage of a coalesced batch's Work: the members' devices, and an event per member and
// device recorded where that member's values are ready (in its Future's callback, whose current
// streams c10 has made wait for the member). Host-only batches hold no events and behave as
// hostStage().
class BatchStage : public OpStage {
 public:
  explicit BatchStage(std::vector<c10::Device> devices) : devices_(std::move(devices)) {}
  std::vector<c10::Device> devices() const override { return devices_; }

  // A member's Future callback (its current streams wait for the member): an event per device.
  void memberDone(const c10::ivalue::Future& f) {
    for (const c10::Device& d : f.devices()) {
      c10::impl::VirtualGuardImpl impl(d.type());
      c10::Event e(d.type());
      e.record(impl.getStream(d));
      std::lock_guard<std::mutex> g(mu_);
      events_.push_back(std::move(e));
    }
  }
  // The batch's Future, on fresh pool streams that wait for every member's event (c10 records
  // the Future's own events on them).
  void completeFuture(const c10::intrusive_ptr<c10::ivalue::Future>& fut, c10::IValue value) override {
    if (devices_.empty()) {
      fut->markCompleted(std::move(value));
      return;
    }
    std::vector<c10::Stream> streams;
    for (const c10::Device& d : devices_)
      streams.push_back(c10::impl::VirtualGuardImpl(d.type()).getStreamFromGlobalPool(d));
    c10::MultiStreamGuard guard(streams);
    waitOnCurrentStreams();
    fut->markCompleted(std::move(value));
  }
  // Work.wait() / synchronize(): the caller's current streams wait for every member.
  void block() override { waitOnCurrentStreams(); }
  bool query() override {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& e : events_)
      if (!e.query()) return false;
    return true;
  }

 private:
  void waitOnCurrentStreams() {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& e : events_) {
      const c10::Device d(e.device_type(), e.device_index());
      e.block(c10::impl::VirtualGuardImpl(d.type()).getStream(d));
    }
  }

  std::vector<c10::Device> devices_;
  std::mutex mu_;
  std::vector<c10::Event> events_;
};
}  // namespace

c10::intrusive_ptr<WorkXirang> Coalescing::end(int rank, const std::string& group_name) {
  XR_CHECK(rank, open_, "endCoalescing without startCoalescing");
  open_ = false;
  auto works = std::move(works_);
  works_.clear();
  std::vector<c10::Device> devices;
  for (auto& w : works)
    for (const c10::Device& d : w->getFuture()->devices())
      if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
  auto stage = std::make_shared<BatchStage>(devices);
  auto batch = c10::make_intrusive<WorkXirang>(rank, c10d::OpType::COALESCED, "xirang:coalesced",
                                               std::vector<at::Tensor>{}, std::nullopt, stage);
  batch->desc_ = rankPrefix(rank) + "coalesced batch of " + std::to_string(works.size()) +
                 " operations (group '" + group_name + "')";
  if (works.empty()) {
    batch->complete(nullptr);
    return batch;
  }
  struct Left {
    std::atomic<size_t> n;
    std::mutex mu;
    std::exception_ptr first;
  };
  auto left = std::make_shared<Left>();
  left->n = works.size();
  for (auto& w : works) {
    w->getFuture()->addCallback([left, batch, stage](c10::ivalue::Future& f) {
      if (f.hasError()) {
        std::lock_guard<std::mutex> g(left->mu);
        if (!left->first) left->first = f.exception_ptr();
      } else {
        stage->memberDone(f);
      }
      if (--left->n == 0) batch->complete(left->first);
    });
  }
  return batch;
}

}  // namespace xirang
