// The exchange pump of the TCP transport (Tcp::exchange): the frames of one step, to and from
// each peer, moved by one poll() loop until all are done; a large send to one peer while
// receiving (a ring step) on a helper thread beside it.
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <thread>

#include "core/env.h"
#include "core/transport/tcp.h"

namespace xirang::transport {

namespace {

// XIRANG_SEND_THREAD_BYTES: sends of at least this many bytes to one peer during a receive get
// their own thread (0: never).
int64_t sendThreadBytes() {
  static const int64_t v = env::getInt("XIRANG_SEND_THREAD_BYTES");
  return v;
}

[[noreturn]] void throwAbortFrom(int fd, int peer, const uint8_t* hdr) {
  const std::string msg = readAbortMessage(fd, decodeHeader(hdr).payload_bytes);
  throw TransportError("rank " + std::to_string(peer) + " aborted: " + msg, peer);
}

// Data on a connection we only send on: the peer is telling us it aborted, or it closed.
[[noreturn]] void readBackChannel(int fd, int peer) {
  uint8_t hdr[kHeaderBytes] = {};
  std::string why;
  if (ioExact(fd, hdr, sizeof(hdr), false, Clock::now() + std::chrono::milliseconds(200), &why)) {
    FrameHeader h = decodeHeader(hdr);
    if (h.magic == kMagic && h.kind == FrameKind::Abort) throwAbortFrom(fd, peer, hdr);
    throw TransportError("unexpected data from rank " + std::to_string(peer) + " on a send-only connection", peer);
  }
  throw TransportError("connection to rank " + std::to_string(peer) + " lost (" + why + ")", peer);
}

// Reads the back channel of a connection we only send on. Throws if it carries an abort frame;
// returns false when the peer closed it (or anything else arrived), true if nothing is there.
bool readAbortIfAny(int fd, int peer) {
  uint8_t hdr[kHeaderBytes] = {};
  ssize_t got = ::recv(fd, hdr, sizeof(hdr), MSG_PEEK | MSG_DONTWAIT);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
  if (got > 0) {
    std::string why;
    if (ioExact(fd, hdr, sizeof(hdr), false, Clock::now() + std::chrono::milliseconds(200), &why)) {
      FrameHeader h = decodeHeader(hdr);
      if (h.magic == kMagic && h.kind == FrameKind::Abort) throwAbortFrom(fd, peer, hdr);
    }
  }
  return false;
}

}  // namespace

class Tcp::Exchange {
 public:
  Exchange(Tcp& tcp, std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
           std::vector<PeerTiming>* timings)
      : tcp_(tcp), recvs_(recvs), deadline_(deadline), timings_(timings), started_(Clock::now()) {
    planSends(sends);
    planRecvs();
  }
  ~Exchange() { helper_.join(); }

  void run();

 private:
  struct OutFrame {
    FrameHeader h;
    const uint8_t* data;
    uint64_t bytes;
  };
  struct InFrame {
    FrameHeader expect;
    uint8_t* data;
    uint64_t bytes;
    size_t job;
    size_t seg;  // SIZE_MAX: the empty frame of a job without segments
  };
  // One peer's frames in one direction, in order: frames[cur] is under way, hdr_off bytes of its
  // header and pay_off of its payload done.
  template <class Frame>
  struct Stream {
    int fd;
    int peer;
    std::vector<Frame> frames;
    size_t cur = 0;
    uint8_t hdr[kHeaderBytes] = {};
    size_t hdr_off = 0;
    uint64_t pay_off = 0;
    uint64_t bytes_done = 0;
  };
  struct OutStream : Stream<OutFrame> {
    bool hdr_ready = false;
    bool back_closed = false;
  };
  struct InStream : Stream<InFrame> {
    bool hdr_ok = false;
  };
  // A large send to one peer while receiving (a ring step) is pumped by a helper thread blocked
  // in its own poll(), as a sender thread beside a receiver thread would be: neither direction
  // waits for the other's syscalls or for the reductions run in on_segment. The main loop leaves
  // outs_[0] alone until the helper is done; after that it handles it as usual (back channel, or
  // what the helper left when the deadline passed).
  struct Helper {
    std::thread th;
    std::atomic<bool> stop{false};
    std::exception_ptr err;
    uint64_t sent = 0;
    std::vector<PeerTiming> timings;
    int evfd = -1;
    bool active = false;
    void join() {
      if (th.joinable()) {
        stop = true;
        th.join();
      }
      if (evfd >= 0) ::close(evfd);
      evfd = -1;
    }
  };

  double elapsed() const { return std::chrono::duration<double>(Clock::now() - started_).count(); }
  void planSends(std::vector<SendJob>& sends);
  void planRecvs();
  // Sends on one stream what its socket takes now (until EAGAIN or the stream is done).
  void pumpOut(OutStream& s, short revents, uint64_t& sent, std::vector<PeerTiming>* tm);
  void pumpIn(InStream& s);
  void startHelper();
  void finishHelper();
  [[noreturn]] void timedOut();

  Tcp& tcp_;
  std::vector<RecvJob>& recvs_;
  const Deadline deadline_;
  std::vector<PeerTiming>* timings_;
  const Clock::time_point started_;
  std::vector<OutStream> outs_;
  std::vector<InStream> ins_;
  Helper helper_;
  uint64_t sent_payload_ = 0;
};

void Tcp::Exchange::planSends(std::vector<SendJob>& sends) {
  for (auto& job : sends) {
    const int fd = tcp_.outgoing(job.peer, deadline_);
    auto it = std::find_if(outs_.begin(), outs_.end(), [&](const OutStream& s) { return s.fd == fd; });
    if (it == outs_.end()) {
      outs_.push_back(OutStream{{fd, job.peer, {}}});
      it = outs_.end() - 1;
    }
    if (job.segs.empty()) {
      FrameHeader h = job.header;
      h.payload_bytes = 0;
      it->frames.push_back({h, nullptr, 0});
    }
    for (auto& s : job.segs) {
      FrameHeader h = job.header;
      h.payload_bytes = s.bytes;
      it->frames.push_back({h, static_cast<const uint8_t*>(s.data), s.bytes});
    }
  }
}

void Tcp::Exchange::planRecvs() {
  for (size_t j = 0; j < recvs_.size(); ++j) {
    auto& job = recvs_[j];
    // The peer's connection to us may not exist yet (it connects when it first sends): do not
    // wait for it here, or a peer that is itself waiting for our frames never gets them.
    auto it = std::find_if(ins_.begin(), ins_.end(), [&](const InStream& s) { return s.peer == job.peer; });
    if (it == ins_.end()) {
      ins_.push_back(InStream{{tcp_.tryIncoming(job.peer), job.peer, {}}});
      it = ins_.end() - 1;
    }
    if (job.segs.empty()) {
      FrameHeader h = job.expect;
      h.payload_bytes = 0;
      it->frames.push_back({h, nullptr, 0, j, SIZE_MAX});
    }
    for (size_t s = 0; s < job.segs.size(); ++s) {
      FrameHeader h = job.expect;
      h.payload_bytes = job.segs[s].bytes;
      it->frames.push_back({h, static_cast<uint8_t*>(job.segs[s].data), job.segs[s].bytes, j, s});
    }
  }
}

void Tcp::Exchange::pumpOut(OutStream& s, short revents, uint64_t& sent, std::vector<PeerTiming>* tm) {
  if (revents & POLLIN) readBackChannel(s.fd, s.peer);
  if (revents & (POLLERR | POLLHUP | POLLNVAL))
    throw TransportError("connection to rank " + std::to_string(s.peer) + " lost", s.peer);
  while (s.cur < s.frames.size()) {
    OutFrame& f = s.frames[s.cur];
    if (!s.hdr_ready) {
      encodeHeader(f.h, s.hdr);
      s.hdr_ready = true;
      s.hdr_off = 0;
      s.pay_off = 0;
    }
    const ssize_t w = writeFrame(s.fd, s.hdr, &s.hdr_off, f.data, f.bytes, &s.pay_off);
    if (w < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
      throw TransportError("send to rank " + std::to_string(s.peer) + " failed: " + errnoStr(errno), s.peer);
    }
    if (s.hdr_off == kHeaderBytes && s.pay_off == f.bytes) {
      dieAfterSegmentsHook(tcp_.rank_, f.bytes);
      sent += f.bytes;
      s.bytes_done += f.bytes;
      s.cur++;
      s.hdr_ready = false;
      if (tm && s.cur == s.frames.size()) tm->push_back({s.peer, true, elapsed(), s.bytes_done});
    }
  }
}

void Tcp::Exchange::pumpIn(InStream& s) {
  while (s.cur < s.frames.size()) {
    InFrame& f = s.frames[s.cur];
    ssize_t got;
    if (!s.hdr_ok) {
      got = ::recv(s.fd, s.hdr + s.hdr_off, kHeaderBytes - s.hdr_off, 0);
      if (got > 0) {
        s.hdr_off += static_cast<size_t>(got);
        if (s.hdr_off == kHeaderBytes) {
          FrameHeader h = decodeHeader(s.hdr);
          if (h.magic == kMagic && h.kind == FrameKind::Abort) throwAbortFrom(s.fd, s.peer, s.hdr);
          std::string diff = compareHeader(f.expect, h, s.peer);
          if (!diff.empty()) throw MismatchError(diff, s.peer);
          s.hdr_ok = true;
          s.pay_off = 0;
        }
      }
    } else if (s.pay_off < f.bytes) {
      got = ::recv(s.fd, f.data + s.pay_off, static_cast<size_t>(f.bytes - s.pay_off), 0);
      if (got > 0) s.pay_off += static_cast<uint64_t>(got);
    } else {
      got = 1;
    }
    if (got == 0) throw TransportError("rank " + std::to_string(s.peer) + " closed the connection", s.peer);
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
      throw TransportError("receive from rank " + std::to_string(s.peer) + " failed: " + errnoStr(errno), s.peer);
    }
    if (s.hdr_ok && s.pay_off == f.bytes) {
      s.bytes_done += f.bytes;
      s.cur++;
      if (timings_ && s.cur == s.frames.size()) timings_->push_back({s.peer, false, elapsed(), s.bytes_done});
      s.hdr_ok = false;
      s.hdr_off = 0;
      if (f.seg != SIZE_MAX && recvs_[f.job].on_segment) recvs_[f.job].on_segment(f.seg);
    }
  }
}

void Tcp::Exchange::startHelper() {
  if (outs_.size() != 1 || ins_.empty() || sendThreadBytes() <= 0) return;
  uint64_t total = 0;
  for (auto& f : outs_[0].frames) total += f.bytes;
  if (total < static_cast<uint64_t>(sendThreadBytes())) return;
  if ((helper_.evfd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) return;
  helper_.active = true;
  helper_.th = std::thread([this] {
    OutStream& s = outs_[0];
    try {
      while (s.cur < s.frames.size() && !helper_.stop.load(std::memory_order_relaxed)) {
        pollfd p{s.fd, POLLIN | POLLOUT, 0};
        int r = ::poll(&p, 1, std::min(msUntil(deadline_), 20));
        if (r < 0 && errno != EINTR) throw TransportError("poll failed: " + errnoStr(errno), -1);
        if (r > 0) pumpOut(s, p.revents, helper_.sent, timings_ ? &helper_.timings : nullptr);
        if (r == 0 && Clock::now() >= deadline_) break;
      }
    } catch (...) {
      helper_.err = std::current_exception();
    }
    uint64_t one = 1;  // wakes the main loop's poll(); join() orders what the helper wrote
    (void)!::write(helper_.evfd, &one, sizeof(one));
  });
}

void Tcp::Exchange::finishHelper() {
  helper_.join();
  helper_.active = false;
  sent_payload_ += helper_.sent;
  if (timings_) timings_->insert(timings_->end(), helper_.timings.begin(), helper_.timings.end());
  if (helper_.err) std::rethrow_exception(helper_.err);
}

void Tcp::Exchange::timedOut() {
  if (helper_.active) finishHelper();
  std::string waiting;
  auto add = [&](const std::string& w) { waiting += (waiting.empty() ? " " : ", ") + w; };
  for (auto& s : ins_)
    if (s.cur < s.frames.size())
      add("receive from rank " + std::to_string(s.peer) + (s.fd < 0 ? " (it has not connected)" : ""));
  for (auto& s : outs_)
    if (s.cur < s.frames.size()) add("send to rank " + std::to_string(s.peer));
  throw TimeoutError("timed out; still waiting to" + waiting, -1);
}

void Tcp::Exchange::run() {
  startHelper();
  std::vector<pollfd> pfds;
  std::vector<std::pair<bool, size_t>> who;  // (is_out, index); (false, SIZE_MAX): the helper
  auto last_peer_check = Clock::now();
  while (true) {
    pfds.clear();
    who.clear();
    bool pending = false, connecting = false;
    for (auto& in : ins_) {
      if (in.cur >= in.frames.size()) continue;
      pending = true;
      if (in.fd < 0 && (in.fd = tcp_.tryIncoming(in.peer)) < 0) connecting = true;
    }
    if (helper_.active) {
      pending = true;
      pfds.push_back({helper_.evfd, POLLIN, 0});
      who.push_back({false, SIZE_MAX});
    }
    const size_t first_out = helper_.active ? 1 : 0;
    for (size_t i = first_out; i < outs_.size(); ++i) pending = pending || outs_[i].cur < outs_[i].frames.size();
    if (!pending) break;
    for (size_t i = first_out; i < outs_.size(); ++i) {
      // Abort frames arrive on the back channel, also after our sends to that peer are done.
      const bool sending = outs_[i].cur < outs_[i].frames.size();
      if (!sending && outs_[i].back_closed) continue;
      pfds.push_back({outs_[i].fd, static_cast<short>(sending ? (POLLIN | POLLOUT) : POLLIN), 0});
      who.push_back({true, i});
    }
    for (size_t i = 0; i < ins_.size(); ++i) {
      if (ins_[i].cur >= ins_[i].frames.size() || ins_[i].fd < 0) continue;
      pfds.push_back({ins_[i].fd, POLLIN, 0});
      who.push_back({false, i});
    }
    int t = msUntil(deadline_);
    if (connecting) {  // look again for the connections not yet accepted; has the peer gone?
      t = std::min(t, 10);
      if (Clock::now() - last_peer_check > std::chrono::milliseconds(200)) {
        last_peer_check = Clock::now();
        for (auto& in : ins_)
          if (in.fd < 0) tcp_.checkPeer(in.peer);
      }
    }
    int r = t == 0 ? 0 : ::poll(pfds.data(), pfds.size(), t);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw TransportError("poll failed: " + errnoStr(errno), -1);
    }
    if (r == 0 && Clock::now() >= deadline_) timedOut();
    for (size_t k = 0; k < pfds.size(); ++k) {
      if (pfds[k].revents == 0) continue;
      if (who[k].second == SIZE_MAX) {
        finishHelper();
        continue;
      }
      if (!who[k].first) {
        pumpIn(ins_[who[k].second]);
        continue;
      }
      OutStream& s = outs_[who[k].second];
      if (s.cur >= s.frames.size()) {
        // Our sends are complete: only an abort matters; a peer that finished and closed
        // (or died: the streams we still wait on will say so) is not an error here.
        if (!readAbortIfAny(s.fd, s.peer)) s.back_closed = true;
        continue;
      }
      pumpOut(s, pfds[k].revents, sent_payload_, timings_);
    }
  }
  tcp_.payload_sent_ += sent_payload_;
}

void Tcp::exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                   std::vector<PeerTiming>* timings) {
  Exchange x(*this, sends, recvs, deadline, timings);
  x.run();
}

}  // namespace xirang::transport
