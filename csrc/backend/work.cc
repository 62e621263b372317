#include "backend/work.h"

#include <atomic>
#include <mutex>
#include <thread>

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

c10::intrusive_ptr<WorkXirang> Coalescing::end(int rank, const std::string& group_name) {
  XR_CHECK(rank, open_, "endCoalescing without startCoalescing");
  open_ = false;
  auto works = std::move(works_);
  works_.clear();
  auto batch = c10::make_intrusive<WorkXirang>(rank, c10d::OpType::COALESCED, "xirang:coalesced",
                                               std::vector<at::Tensor>{}, std::nullopt, hostStage());
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
    w->getFuture()->addCallback([left, batch](c10::ivalue::Future& f) {
      if (f.hasError()) {
        std::lock_guard<std::mutex> g(left->mu);
        if (!left->first) left->first = f.exception_ptr();
      }
      if (--left->n == 0) batch->complete(left->first);
    });
  }
  return batch;
}

}  // namespace xirang
