#include "backend/completions.h"

#include <string>
#include <thread>

#include "backend/tensors.h"
#include "core/env.h"

namespace xirang {

Completions& Completions::instance() {
  static Completions* pool = new Completions();  // leaked on purpose (see the header)
  return *pool;
}

void Completions::post(int rank, std::function<void()> fn) {
  std::unique_lock<std::mutex> lock(mu_);
  queue_.push_back(std::move(fn));
  if (idle_ < queue_.size()) {
    if (threads_ < kMaxThreads) {
      ++threads_;
      std::thread([this] { loop(); }).detach();
    } else if (!warned_) {
      warned_ = true;
      lock.unlock();
      cv_.notify_one();
      env::log(env::Level::Warn, rank,
               rankPrefix(rank) + std::to_string(kMaxThreads) +
                   " Future callbacks are blocked at once (callbacks waiting on later operations); further "
                   "completions wait until one of them returns");
      return;
    }
  }
  lock.unlock();
  cv_.notify_one();
}

bool Completions::drain(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_cv_.wait_until(lock, deadline, [&] { return queue_.empty() && idle_ == threads_; });
}

void Completions::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    ++idle_;
    idle_cv_.notify_all();
    cv_.wait(lock, [&] { return !queue_.empty(); });
    --idle_;
    auto fn = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    fn();  // WorkXirang::completeNow: catches what a callback throws
    lock.lock();
  }
}

}  // namespace xirang
