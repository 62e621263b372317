// What an algorithm needs of a link between the ranks of a group, and nothing more: one step
// that sends framed segments to some peers and receives framed segments from others, all at
// once, handing each received segment over as soon as it is in memory; abort / interrupt; byte
// counters. The algorithms (core/algorithms/) are written once against this interface; TCP
// (tcp.h) is one implementation, the in-process one (inproc.h, threads as ranks) another, and a
// shared-memory or NCCL link is one more file here.
//
// Memory: the segments of a step are in the memory the link moves (memory()): host memory for TCP
// and in-process links; a device link (NCCL: nccl_link.h) takes device pointers and orders its
// transfers on a stream, and the algorithm's reducer (core/algorithms/reducer.h) is then a device
// reducer on that stream (algorithms/device_reducer.h); the staged link (staged_link.h) is a device
// link over a host link, staging only the bytes sent through pinned host memory. For a device link
// "done" below means "ordered on the stream": exchange() returns once the transfers are enqueued,
// on_segment runs when segment i's receive is enqueued (the work it enqueues runs after the bytes
// landed and before segment i+1 is received), and completion is the stream's (nccl_link.h,
// staged_link.h: synchronize; the staged link's exchange() returns once its host exchange is done).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/transport/errors.h"
#include "core/transport/frame.h"

namespace xirang::transport {

enum class Memory : uint8_t { Host = 0, Device = 1 };

// One frame's payload: a contiguous byte range.
struct SendSeg {
  const void* data;
  uint64_t bytes;
};
struct RecvSeg {
  void* data;
  uint64_t bytes;
};

// All segments to one peer, sent in order; each segment is one frame whose header is `header`
// with payload_bytes = segment bytes. An empty list still sends one empty frame, so a peer that
// disagrees about the sizes learns it at once.
struct SendJob {
  int peer;
  FrameHeader header;
  std::vector<SendSeg> segs;
};
// All segments from one peer, received in order into the given buffers; each received header
// must equal `expect` (payload_bytes = segment bytes). `on_segment(i)` runs on the exchanging
// thread as soon as segment i is in memory (e.g. to reduce it while later ones are in flight),
// and returns before any byte of segment i+1 is read: segments may share one buffer.
struct RecvJob {
  int peer;
  FrameHeader expect;
  std::vector<RecvSeg> segs;
  std::function<void(size_t)> on_segment;
};

// Per peer and direction, what one exchange() did: seconds from its start until that peer's
// last frame was fully sent / received, and the payload bytes moved.
struct PeerTiming {
  int peer;
  bool send;  // true: our sends to peer; false: our receives from peer
  double seconds;
  uint64_t bytes;
};

class Link {
 public:
  virtual ~Link() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Memory memory() const { return Memory::Host; }

  // Runs all jobs concurrently until every one is done (the contract of SendJob / RecvJob
  // above). Throws TransportError (a peer closed or aborted, a header differs from the expected
  // one: MismatchError naming both values) or TimeoutError after `deadline`; after a throw the
  // link is unusable and the caller aborts it. If `timings` is given, one PeerTiming per peer
  // and direction is appended.
  virtual void exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                        std::vector<PeerTiming>* timings = nullptr) = 0;

  // Best effort: tells every peer (abort frames) and closes. Idempotent; never throws.
  virtual void abort(const std::string& why) = 0;
  // Any thread: a running or later exchange fails with TransportError(why) at once.
  virtual void interrupt(const std::string& why) = 0;

  // Payload bytes sent since creation (headers excluded).
  virtual uint64_t payloadBytesSent() const = 0;
};

}  // namespace xirang::transport
