#include "core/transport/inproc.h"

#include <atomic>
#include <cstring>

namespace xirang::transport {

class InprocLink : public Link {
 public:
  InprocLink(InprocHub& hub, int rank) : hub_(hub), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_.size_; }
  uint64_t payloadBytesSent() const override { return sent_.load(); }

  void exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                std::vector<PeerTiming>* timings) override {
    const auto t0 = Clock::now();
    auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
    {
      std::lock_guard<std::mutex> g(hub_.mu_);
      check();
      for (auto& job : sends) {
        auto& q = hub_.queues_[static_cast<size_t>(rank_ * hub_.size_ + job.peer)];
        uint64_t bytes = 0;
        auto push = [&](const SendSeg& s) {
          InprocHub::Frame f{job.header, {}};
          f.h.payload_bytes = s.bytes;
          if (s.bytes) f.payload.assign(static_cast<const uint8_t*>(s.data), static_cast<const uint8_t*>(s.data) + s.bytes);
          q.push_back(std::move(f));
          bytes += s.bytes;
        };
        if (job.segs.empty()) push(SendSeg{nullptr, 0});
        for (const auto& s : job.segs) push(s);
        sent_ += bytes;
        if (timings) timings->push_back({job.peer, true, elapsed(), bytes});
      }
    }
    hub_.cv_.notify_all();
    for (auto& job : recvs) {
      auto& q = hub_.queues_[static_cast<size_t>(job.peer * hub_.size_ + rank_)];
      const size_t nseg = job.segs.empty() ? 1 : job.segs.size();
      uint64_t bytes = 0;
      for (size_t i = 0; i < nseg; ++i) {
        InprocHub::Frame f;
        {
          std::unique_lock<std::mutex> g(hub_.mu_);
          if (!hub_.cv_.wait_until(g, deadline, [&] { return !q.empty() || !interrupted_.empty(); }))
            throw TimeoutError("timed out; still waiting to receive from rank " + std::to_string(job.peer), -1);
          check();
          f = std::move(q.front());
          q.pop_front();
        }
        if (f.h.kind == FrameKind::Abort)
          throw TransportError("rank " + std::to_string(job.peer) + " aborted: " +
                                   std::string(f.payload.begin(), f.payload.end()),
                               job.peer);
        FrameHeader want = job.expect;
        want.payload_bytes = job.segs.empty() ? 0 : job.segs[i].bytes;
        std::string diff = compareHeader(want, f.h, job.peer);
        if (!diff.empty()) throw MismatchError(diff, job.peer);
        if (want.payload_bytes) std::memcpy(job.segs[i].data, f.payload.data(), want.payload_bytes);
        bytes += want.payload_bytes;
        if (!job.segs.empty() && job.on_segment) job.on_segment(i);
      }
      if (timings) timings->push_back({job.peer, false, elapsed(), bytes});
    }
  }

  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> g(hub_.mu_);
      if (aborted_) return;
      aborted_ = true;
      for (int p = 0; p < hub_.size_; ++p) {
        if (p == rank_) continue;
        InprocHub::Frame f;
        f.h.kind = FrameKind::Abort;
        f.payload.assign(why.begin(), why.end());
        f.h.payload_bytes = f.payload.size();
        // In front: the peer's next receive from us sees it whatever it was waiting for.
        hub_.queues_[static_cast<size_t>(rank_ * hub_.size_ + p)].push_front(std::move(f));
      }
      if (interrupted_.empty()) interrupted_ = "aborted: " + why;
    }
    hub_.cv_.notify_all();
  }

  void interrupt(const std::string& why) override {
    {
      std::lock_guard<std::mutex> g(hub_.mu_);
      if (interrupted_.empty()) interrupted_ = why.empty() ? "interrupted" : why;
    }
    hub_.cv_.notify_all();
  }

 private:
  void check() const {  // under hub_.mu_
    if (!interrupted_.empty()) throw TransportError("transport closed: " + interrupted_, -1);
  }
  InprocHub& hub_;
  const int rank_;
  std::atomic<uint64_t> sent_{0};
  bool aborted_ = false;
  std::string interrupted_;  // under hub_.mu_
};

InprocHub::InprocHub(int size) : size_(size), queues_(static_cast<size_t>(size) * static_cast<size_t>(size)) {
  if (size < 1) throw std::invalid_argument("xirang: InprocHub needs at least one rank");
  for (int r = 0; r < size; ++r) links_.push_back(std::make_unique<InprocLink>(*this, r));
}

Link& InprocHub::link(int rank) { return *links_.at(static_cast<size_t>(rank)); }

}  // namespace xirang::transport
