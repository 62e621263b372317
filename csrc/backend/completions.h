// Completions: the threads that complete the Works whose Future was handed out, so that no
// Future callback (DDP's, a comm hook's .then(), torch's PowerSGD) runs on the communication
// thread. A callback may itself wait on a later operation of the same group (PowerSGD does):
// a callback run on the communication thread would wait for that very thread; one run here
// waits while the communication thread goes on, and the next completion starts on another
// thread of this pool (one is started whenever none is idle, up to kMaxThreads). Threads stay
// for the process (idle ones wait on a condition variable).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>

namespace xirang {

class Completions {
 public:
  // Callbacks waiting on each other deeper than this many levels queue (a WARNING says so once).
  static constexpr size_t kMaxThreads = 64;

  // The process's pool (every group's Works; never destroyed: a Work, and a callback waiting
  // in it, may outlive its group, and its idle threads end with the process).
  static Completions& instance();

  // Queues fn (completions start in the order posted); rank names this rank in the one WARNING.
  void post(int rank, std::function<void()> fn);
  // Waits until every completion posted so far has run (each thread idle), at most until
  // `deadline`; whether they have.
  bool drain(std::chrono::steady_clock::time_point deadline);

 private:
  Completions() = default;
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;  // a thread became idle (drain)
  std::deque<std::function<void()>> queue_;
  size_t threads_ = 0;  // started (detached), never more than kMaxThreads
  size_t idle_ = 0;
  bool warned_ = false;
};

}  // namespace xirang
