// Polling a stream's event (or an NCCL communicator) from a host thread: spin briefly (a GPU
// round trip is microseconds), then sleep up to 200 us per poll, so that a waiting host thread
// leaves the CPU to the work it waits for. Used by the device links (transport/nccl_link.h,
// transport/staged_link.h).
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace xirang::device {

class Backoff {
 public:
  void pause() {
    if (n_ < 64) {
      ++n_;
      std::this_thread::yield();
      return;
    }
    us_ = std::min(us_ * 2, 200);
    std::this_thread::sleep_for(std::chrono::microseconds(us_));
  }

 private:
  int n_ = 0;
  int us_ = 1;
};

}  // namespace xirang::device
