// An in-process link: ranks are threads of one process, frames travel through queues in memory.
// For tests of the algorithms at world sizes 1..N without sockets (Gloo's tests run rings of
// threads the same way), and as the smallest example of a transport::Link.
//
// Sends never block (a frame is copied into the receiver's queue), so an exchange cannot
// deadlock whatever the order of its jobs; receives wait for their frames up to the deadline.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/transport/transport.h"

namespace xirang::transport {

class InprocHub {
 public:
  explicit InprocHub(int size);
  int size() const { return size_; }
  // The link of `rank` (owned by the hub).
  Link& link(int rank);

 private:
  friend class InprocLink;
  struct Frame {
    FrameHeader h;
    std::vector<uint8_t> payload;
  };
  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::deque<Frame>> queues_;  // [src * size + dst]
  std::vector<std::unique_ptr<Link>> links_;
};

}  // namespace xirang::transport
