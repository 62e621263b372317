// The staged device link: see staged_link.h.
#include "core/transport/staged_link.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "core/device/backoff.h"

namespace xirang::transport {

namespace dv = xirang::device;

StagedLink::StagedLink(dv::CudaApi& cuda, dv::Stream stream, Link& host) : cuda_(cuda), stream_(stream), host_(&host) {
  callCuda(cuda_.eventCreate(&idle_), "cudaEventCreate");
}

StagedLink::~StagedLink() {
  // Pending copies may still read the staging buffers: free them once the stream is idle. A
  // stream that does not get there (a hung kernel ahead of an op that timed out) is not waited
  // for without bound: the buffers are left allocated then.
  bool idle = false;
  if (idle_ && cuda_.eventRecord(idle_, stream_) == dv::kCudaSuccess) {
    const auto until = Clock::now() + std::chrono::seconds(10);
    dv::Backoff b;
    for (;;) {
      const int q = cuda_.eventQuery(idle_);
      if (q != dv::kCudaErrorNotReady) {
        idle = q == dv::kCudaSuccess;
        break;
      }
      if (Clock::now() >= until) break;
      b.pause();
    }
  }
  if (idle) {
    if (send_.ptr) (void)cuda_.freeHost(send_.ptr);
    if (recv_.ptr) (void)cuda_.freeHost(recv_.ptr);
  }
  if (idle_) (void)cuda_.eventDestroy(idle_);
}

void StagedLink::check() {
  std::lock_guard<std::mutex> g(mu_);
  if (!stop_why_.empty()) throw TransportError(stop_why_, -1);
}

void StagedLink::callCuda(int result, const char* call) {
  if (result == dv::kCudaSuccess) return;
  throw TransportError(std::string("staged link: ") + call + " failed: CUDA error " + std::to_string(result) + " (" +
                           cuda_.errorString(result) + ")",
                       -1);
}

void StagedLink::waitIdle(Deadline deadline, const char* what) {
  callCuda(cuda_.eventRecord(idle_, stream_), "cudaEventRecord");
  dv::Backoff b;
  for (;;) {
    check();
    const int q = cuda_.eventQuery(idle_);
    if (q == dv::kCudaSuccess) return;
    if (q != dv::kCudaErrorNotReady) callCuda(q, "cudaEventQuery");
    if (Clock::now() >= deadline)
      throw TimeoutError(std::string("staged link: timed out waiting for ") + what + " on the device", -1);
    b.pause();
  }
}

void StagedLink::synchronize(Deadline deadline) { waitIdle(deadline, "the link's stream"); }

uint8_t* StagedLink::reserve(Pinned& p, uint64_t bytes, Deadline deadline) {
  if (bytes <= p.cap) return p.ptr;
  const uint64_t old_cap = p.cap;
  if (p.ptr) {
    waitIdle(deadline, "the copies out of the old staging buffer");
    callCuda(cuda_.freeHost(p.ptr), "cudaFreeHost");
    p.ptr = nullptr;
    p.cap = 0;
  }
  // Geometric growth: a pinned allocation synchronizes the device, so sizes that creep up
  // (alltoall with changing splits) must not pay it every time.
  const uint64_t cap = std::max({bytes, old_cap + old_cap / 2, uint64_t{64} << 10});
  void* ptr = nullptr;
  callCuda(cuda_.mallocHost(&ptr, cap), "cudaMallocHost");
  p.ptr = static_cast<uint8_t*>(ptr);
  p.cap = cap;
  return p.ptr;
}

void StagedLink::exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                          std::vector<PeerTiming>* timings) {
  check();
  Link& host = *host_;
  uint64_t send_bytes = 0, recv_bytes = 0;
  for (const auto& j : sends)
    for (const auto& s : j.segs) send_bytes += s.bytes;
  for (const auto& j : recvs)
    for (const auto& s : j.segs) recv_bytes += s.bytes;
  uint8_t* out = reserve(send_, send_bytes, deadline);
  uint8_t* in = reserve(recv_, recv_bytes, deadline);

  // 1. Device to host, then the stream idle (see the header).
  std::vector<SendJob> hsends;
  hsends.reserve(sends.size());
  for (const auto& j : sends) {
    SendJob h{j.peer, j.header, {}};
    h.segs.reserve(j.segs.size());
    for (const auto& s : j.segs) {
      if (s.bytes) callCuda(cuda_.memcpyAsync(out, s.data, s.bytes, stream_), "cudaMemcpyAsync (device to host)");
      h.segs.push_back(SendSeg{out, s.bytes});
      out += s.bytes;
    }
    hsends.push_back(std::move(h));
  }
  waitIdle(deadline, "the bytes to send");

  // 2 and 3. The host exchange; each received segment back to the device, then on_segment.
  std::vector<RecvJob> hrecvs;
  hrecvs.reserve(recvs.size());
  for (size_t k = 0; k < recvs.size(); ++k) {
    RecvJob h{recvs[k].peer, recvs[k].expect, {}, {}};
    h.segs.reserve(recvs[k].segs.size());
    for (const auto& s : recvs[k].segs) {
      h.segs.push_back(RecvSeg{in, s.bytes});
      in += s.bytes;
    }
    h.on_segment = [this, &recvs, &hrecvs, k](size_t i) {
      const RecvSeg& dst = recvs[k].segs[i];
      if (dst.bytes)
        callCuda(cuda_.memcpyAsync(dst.data, hrecvs[k].segs[i].data, dst.bytes, stream_),
                 "cudaMemcpyAsync (host to device)");
      if (recvs[k].on_segment) recvs[k].on_segment(i);
    };
    hrecvs.push_back(std::move(h));
  }
  host.exchange(hsends, hrecvs, deadline, timings);
  sent_ += send_bytes;
}

void StagedLink::abort(const std::string& why) {
  interrupt(why);
  host_->abort(why);
}

void StagedLink::interrupt(const std::string& why) {
  // Not the host link's: its owner (the group) aborts it, sending its abort frames first; an
  // interrupt here would shut its sockets and lose them.
  std::lock_guard<std::mutex> g(mu_);
  if (stop_why_.empty()) stop_why_ = why;
}

}  // namespace xirang::transport
