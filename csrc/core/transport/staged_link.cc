// The staged device link: see staged_link.h.
#include "core/transport/staged_link.h"

#include <algorithm>
#include <stdexcept>

#include "core/device/backoff.h"

namespace xirang::transport {

namespace dv = xirang::device;

StagedLink::StagedLink(dv::CudaApi& cuda, dv::Stream stream, Link* host) : cuda_(cuda), stream_(stream), host_(host) {
  callCuda(cuda_.eventCreate(&idle_), "cudaEventCreate");
}

StagedLink::~StagedLink() {
  (void)cuda_.streamSynchronize(stream_);  // pending copies may still read the staging buffers
  if (send_.ptr) (void)cuda_.freeHost(send_.ptr);
  if (recv_.ptr) (void)cuda_.freeHost(recv_.ptr);
  if (idle_) (void)cuda_.eventDestroy(idle_);
}

Link& StagedLink::hostLink() const {
  if (!host_) throw std::logic_error("xirang: StagedLink used before its host link was set");
  return *host_;
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
  if (p.ptr) {
    waitIdle(deadline, "the copies out of the old staging buffer");
    callCuda(cuda_.freeHost(p.ptr), "cudaFreeHost");
    p.ptr = nullptr;
    p.cap = 0;
  }
  const uint64_t cap = std::max(bytes, uint64_t{64} << 10);
  void* ptr = nullptr;
  callCuda(cuda_.mallocHost(&ptr, cap), "cudaMallocHost");
  p.ptr = static_cast<uint8_t*>(ptr);
  p.cap = cap;
  return p.ptr;
}

void StagedLink::exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                          std::vector<PeerTiming>* timings) {
  check();
  Link& host = hostLink();
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
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_why_.empty()) stop_why_ = why;
  }
  if (host_) host_->abort(why);
}

void StagedLink::interrupt(const std::string& why) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_why_.empty()) stop_why_ = why;
  }
  if (host_) host_->interrupt(why);
}

}  // namespace xirang::transport
