#include "core/transport/p2p.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "core/env.h"
#include "core/transport/socket.h"

namespace xirang::transport {

namespace {

constexpr uint64_t kMinQueueChunk = 64 << 10;  // a queued message's buffer grows by at least this
constexpr auto kLivenessEvery = std::chrono::milliseconds(250);

std::string who(int peer) { return "rank " + std::to_string(peer); }

std::string tagText(const FrameHeader& h) { return "tag " + std::to_string(h.tag); }

bool matches(int want_peer, const FrameHeader& expect, int peer, const FrameHeader& h) {
  return (want_peer < 0 || want_peer == peer) && expect.tag == h.tag;
}

}  // namespace

P2P::P2P(int rank, int size, P2PLinks& links, Limits limits)
    : rank_(rank), size_(size), links_(links), limits_(limits) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw TransportError("xirang: eventfd failed: " + errnoStr(errno), -1);
  thread_ = std::thread([this] { loop(); });
}

P2P::~P2P() { stop("transport closed"); }

void P2P::wake() {
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void P2P::shutdown(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  if (failed_.empty()) failed_ = why.empty() ? "transport closed" : why;
  stopping_ = true;
  if (wake_fd_ >= 0) wake();
}

void P2P::stop(const std::string& why) {
  shutdown(why);
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  // Connectors end once the transport refuses them (it is closed before we are stopped).
  std::vector<std::thread> connectors;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& kv : out_)
      if (kv.second.connector.joinable()) connectors.push_back(std::move(kv.second.connector));
  }
  for (auto& t : connectors) t.join();
  std::lock_guard<std::mutex> g(mu_);
  for (auto& kv : out_) {
    if (kv.second.connected_fd >= 0) ::close(kv.second.connected_fd);  // made, never adopted
    kv.second.connected_fd = -1;
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
}

P2P::Counters P2P::counters() {
  std::lock_guard<std::mutex> g(mu_);
  Counters c = counters_;
  c.queued_messages = queued_msgs_;
  c.queued_bytes = queued_bytes_;
  return c;
}

void P2P::send(int peer, FrameHeader h, const void* data, uint64_t bytes, Deadline deadline, Done done) {
  h.kind = FrameKind::Data;
  h.payload_bytes = bytes;
  std::string failed;
  {
    std::lock_guard<std::mutex> g(mu_);
    Out& o = out_[peer];
    if (!failed_.empty()) {
      failed = failed_;
    } else if (!o.closed.empty()) {
      failed = o.closed;
    } else {
      o.q.push_back(SendOp{h, static_cast<const uint8_t*>(data), bytes, deadline, std::move(done)});
      if (o.fd < 0 && !o.connecting) {
        o.connecting = true;
        o.connector_done = false;
        o.connector = std::thread([this, peer, deadline] {
          int fd = -1;
          std::exception_ptr err;
          try {
            fd = links_.connectP2P(peer, deadline);
          } catch (...) {
            err = std::current_exception();
          }
          {
            std::lock_guard<std::mutex> g2(mu_);
            Out& oo = out_[peer];
            oo.connector_done = true;
            oo.connected_fd = fd;
            oo.connect_error = err;
          }
          wake();
        });
      }
    }
  }
  if (!failed.empty()) {
    done(std::make_exception_ptr(TransportError(failed, peer)), peer);
    return;
  }
  wake();
}

void P2P::recv(int peer, FrameHeader expect, void* data, uint64_t bytes, Deadline deadline, Done done) {
  expect.kind = FrameKind::Data;
  expect.payload_bytes = bytes;
  std::string failed;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!failed_.empty()) {
      failed = failed_;
    } else {
      auto op = std::make_shared<RecvOp>(RecvOp{peer, expect, static_cast<uint8_t*>(data), bytes, deadline,
                                                std::move(done)});
      if (!deliverQueued(op)) {
        if (peer >= 0 && !in_[peer].closed.empty()) {
          failRecv(op, std::make_exception_ptr(TransportError(in_[peer].closed + "; nothing from it with " +
                                                                  tagText(expect) + " is waiting",
                                                              peer)));
        } else {
          posted_.push_back(op);
          // A connection waiting with a message nobody had posted a receive for may now proceed.
          for (auto& kv : in_)
            if (kv.second.mode == In::Parked && matches(peer, expect, kv.first, kv.second.h)) {
              decide(kv.first);
              if (kv.second.mode != In::Parked) {
                kick_.push_back(kv.first);
                break;
              }
            }
          if (peer < 0) failAnySourceIfNobodyLeft();
        }
      }
    }
  }
  if (!failed.empty()) {
    done(std::make_exception_ptr(TransportError(failed, peer)), peer);
    return;
  }
  wake();
}

void P2P::addIncoming(int peer, int fd) {
  {
    std::lock_guard<std::mutex> g(mu_);
    In& in = in_[peer];
    in = In{};
    in.fd = fd;
  }
  wake();
}

// ---------------------------------------------------------------- matching (all under mu_)

std::string P2P::mismatch(const FrameHeader& expect, uint64_t bytes, const FrameHeader& got, int peer) const {
  FrameHeader e = expect;
  e.payload_bytes = bytes;
  FrameHeader g = got;
  g.seq = e.seq;  // point-to-point messages carry no collective sequence number
  g.aux = e.aux;
  return compareHeader(e, g, peer);
}

bool P2P::deliverQueued(const std::shared_ptr<RecvOp>& op) {
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (!matches(op->peer, op->expect, it->peer, it->h)) continue;
    const int src = it->peer;
    std::string diff = mismatch(op->expect, op->bytes, it->h, src);
    if (!diff.empty()) {
      failRecv(op, std::make_exception_ptr(MismatchError(diff, src)));
    } else {
      if (op->bytes) std::memcpy(op->data, it->payload.data(), op->bytes);
      counters_.bytes_received += op->bytes;
      done_.push_back({op->done, nullptr, src});
    }
    dropQueued(it);
    return true;
  }
  return false;
}

void P2P::dropQueued(std::deque<Msg>::iterator it) {
  queued_bytes_ -= it->h.payload_bytes;
  queued_msgs_--;
  queue_.erase(it);
  reconsider_parked_ = true;
}

void P2P::matchNew() {
  const Msg& m = queue_.back();
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (!matches((*it)->peer, (*it)->expect, m.peer, m.h)) continue;
    auto op = *it;
    posted_.erase(it);
    deliverQueued(op);  // finds m (or an earlier match, which cannot exist: it would have matched)
    return;
  }
}

void P2P::reconsiderParked() {
  reconsider_parked_ = false;
  for (auto& kv : in_) {
    if (kv.second.mode != In::Parked || !kv.second.closed.empty()) continue;
    decide(kv.first);
    if (kv.second.mode != In::Parked) kick_.push_back(kv.first);
  }
}

void P2P::decide(int peer) {
  In& in = in_[peer];
  const FrameHeader& h = in.h;
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (!matches((*it)->peer, (*it)->expect, peer, h)) continue;
    auto op = *it;
    posted_.erase(it);
    std::string diff = mismatch(op->expect, op->bytes, h, peer);
    if (!diff.empty()) {
      failRecv(op, std::make_exception_ptr(MismatchError(diff, peer)));
      // Its payload would have to be read into nowhere: the stream from peer ends here.
      failPeerIn(peer, "the point-to-point stream from " + who(peer) + " stopped at a mismatched message (" + diff + ")");
      return;
    }
    in.mode = In::IntoRecv;
    in.target = op;
    in.off = 0;
    return;
  }
  // Room in the queue? (checked arithmetic: the length is the peer's claim)
  if (queued_msgs_ < limits_.max_queued_messages && h.payload_bytes <= limits_.max_queued_bytes - queued_bytes_) {
    queued_msgs_++;
    queued_bytes_ += h.payload_bytes;
    in.mode = In::IntoQueue;
    in.msg = Msg{peer, h, {}};
    in.off = 0;
    return;
  }
  in.mode = In::Parked;
}

void P2P::finishMessage(int peer) {
  In& in = in_[peer];
  if (in.mode == In::IntoRecv) {
    counters_.bytes_received += in.target->bytes;
    done_.push_back({in.target->done, nullptr, peer});
    in.target.reset();
  } else {
    queue_.push_back(std::move(in.msg));
    in.msg = Msg{};
  }
  const bool queued = in.mode == In::IntoQueue;
  in.mode = In::Header;
  in.have_hdr = false;
  in.off = 0;
  if (queued) matchNew();
}

void P2P::onHeader(int peer) {
  In& in = in_[peer];
  FrameHeader h = decodeHeader(in.hdr);
  if (h.magic != kMagic || h.version != kWireVersion) {
    failPeerIn(peer, "bad frame from " + who(peer) + " on its point-to-point connection (a corrupted stream)");
    return;
  }
  if (h.kind == FrameKind::Abort) {
    failAll(who(peer) + " aborted: " + readAbortMessage(in.fd, h.payload_bytes));
    return;
  }
  if (h.kind != FrameKind::Data || h.op != OpKind::Send) {
    failPeerIn(peer, "unexpected frame (" + std::string(opKindName(h.op)) + ") from " + who(peer) +
                         " on its point-to-point connection");
    return;
  }
  in.h = h;
  in.have_hdr = true;
  decide(peer);
}

// ---------------------------------------------------------------- failures (under mu_)

void P2P::failRecv(const std::shared_ptr<RecvOp>& op, const std::exception_ptr& e) {
  done_.push_back({op->done, e, op->peer});
}

void P2P::failPeerIn(int peer, const std::string& why) {
  In& in = in_[peer];
  if (!in.closed.empty()) return;
  in.closed = why;
  if (in.mode == In::IntoRecv && in.target) {
    failRecv(in.target, std::make_exception_ptr(TransportError(why + " (in the middle of a message with " +
                                                                   tagText(in.h) + ")",
                                                               peer)));
    in.target.reset();
  } else if (in.mode == In::IntoQueue || in.mode == In::Parked) {
    if (in.mode == In::IntoQueue) {
      queued_bytes_ -= in.h.payload_bytes;
      queued_msgs_--;
    }
    in.msg = Msg{};
  }
  in.mode = In::Header;
  in.have_hdr = false;
  // Receives that only this peer could satisfy (the queue was searched when they were posted).
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->peer == peer) {
      failRecv(*it, std::make_exception_ptr(TransportError(why + "; no message with " + tagText((*it)->expect) +
                                                               " from it is waiting",
                                                           peer)));
      it = posted_.erase(it);
    } else {
      ++it;
    }
  }
  failAnySourceIfNobodyLeft();
}

bool P2P::anyLivePeer() {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    auto it = in_.find(r);
    const bool closed = it != in_.end() && !it->second.closed.empty();
    const bool gone = gone_.count(r) != 0 && (it == in_.end() || it->second.fd < 0);
    if (!closed && !gone) return true;
  }
  return false;
}

void P2P::failAnySourceIfNobodyLeft() {
  bool any = false;
  for (auto& op : posted_) any = any || op->peer < 0;
  if (!any || anyLivePeer()) return;
  std::string why = "no rank can send any more:";
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    auto it = in_.find(r);
    why += " " + ((it != in_.end() && !it->second.closed.empty()) ? it->second.closed : gone_[r]) + ";";
  }
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->peer < 0) {
      failRecv(*it, std::make_exception_ptr(TransportError(why + " no message with " + tagText((*it)->expect) +
                                                               " is waiting",
                                                           -1)));
      it = posted_.erase(it);
    } else {
      ++it;
    }
  }
}

void P2P::failPeerOut(int peer, const std::exception_ptr& e, const std::string& closed_why) {
  Out& o = out_[peer];
  if (!closed_why.empty() && o.closed.empty()) o.closed = closed_why;
  for (auto& s : o.q) done_.push_back({s.done, e, peer});
  o.q.clear();
  o.started = false;
}

void P2P::failAll(const std::string& why) {
  if (failed_.empty()) failed_ = why;
  auto e = [&](int peer) { return std::make_exception_ptr(TransportError(why, peer)); };
  for (auto& op : posted_) failRecv(op, e(op->peer));
  posted_.clear();
  for (auto& kv : in_) {
    if (kv.second.mode == In::IntoRecv && kv.second.target) failRecv(kv.second.target, e(kv.first));
    kv.second.target.reset();
    if (kv.second.closed.empty()) kv.second.closed = why;
  }
  for (auto& kv : out_) failPeerOut(kv.first, e(kv.first), why);
  queue_.clear();
  queued_bytes_ = 0;
  queued_msgs_ = 0;
}

void P2P::checkDeadlines() {
  const auto now = Clock::now();
  auto timeoutText = [&](const std::string& what) {
    std::string s = "timed out " + what;
    if (queued_msgs_ >= limits_.max_queued_messages || queued_bytes_ >= limits_.max_queued_bytes / 2)
      s += " (" + std::to_string(queued_msgs_) + " point-to-point messages, " + std::to_string(queued_bytes_) +
           " bytes, are waiting for their receives; at most " + std::to_string(limits_.max_queued_messages) +
           " messages / " + std::to_string(limits_.max_queued_bytes) + " bytes are held)";
    return s;
  };
  for (auto it = posted_.begin(); it != posted_.end();) {
    if (now < (*it)->deadline) {
      ++it;
      continue;
    }
    const int p = (*it)->peer;
    std::string what = "waiting to receive a message with " + tagText((*it)->expect) + " from " +
                       (p < 0 ? std::string("any rank") : who(p));
    if (p >= 0 && in_[p].fd < 0) what += " (it has not connected)";
    failRecv(*it, std::make_exception_ptr(TimeoutError(timeoutText(what), p)));
    it = posted_.erase(it);
  }
  for (auto& kv : in_) {
    In& in = kv.second;
    if (in.mode == In::IntoRecv && in.target && now >= in.target->deadline) {
      auto op = in.target;
      in.target.reset();
      failRecv(op, std::make_exception_ptr(TimeoutError(
                       "timed out receiving a message with " + tagText(in.h) + " from " + who(kv.first) + " (" +
                           std::to_string(in.off) + " of " + std::to_string(op->bytes) + " bytes arrived)",
                       kv.first)));
      in.mode = In::Header;
      failPeerIn(kv.first, "the point-to-point stream from " + who(kv.first) + " broke off at a timeout");
    }
  }
  for (auto& kv : out_) {
    Out& o = kv.second;
    for (size_t i = 0; i < o.q.size();) {
      if (now < o.q[i].deadline) {
        ++i;
        continue;
      }
      std::string what = "sending a message with " + tagText(o.q[i].h) + " to " + who(kv.first);
      if (o.fd < 0) what += " (not connected yet)";
      auto err = std::make_exception_ptr(TimeoutError(timeoutText(what), kv.first));
      if (i == 0 && o.started) {  // half written: nothing after it can follow on this stream
        failPeerOut(kv.first, err, "the point-to-point stream to " + who(kv.first) + " broke off at a timeout");
        break;
      }
      done_.push_back({o.q[i].done, err, kv.first});
      o.q.erase(o.q.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
}

// Peers whose liveness matters now: those a posted receive waits for that have not connected
// (every unconnected peer, for a receive from any source).
std::vector<int> P2P::livenessToCheck() {
  std::vector<int> out;
  bool any_source = false;
  for (auto& op : posted_) {
    if (op->peer < 0) {
      any_source = true;
    } else if (in_[op->peer].fd < 0 && !gone_.count(op->peer)) {
      out.push_back(op->peer);
    }
  }
  if (any_source)
    for (int r = 0; r < size_; ++r)
      if (r != rank_ && in_[r].fd < 0 && !gone_.count(r)) out.push_back(r);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// ---------------------------------------------------------------- I/O (under mu_)

void P2P::pumpIn(int peer) {
  In& in = in_[peer];
  while (in.fd >= 0 && in.closed.empty() && in.mode != In::Parked) {
    if (!in.have_hdr) {
      ssize_t r = ::recv(in.fd, in.hdr + in.hdr_off, kHeaderBytes - in.hdr_off, MSG_DONTWAIT);
      if (!received(peer, r,
                    in.hdr_off ? " closed its connection in the middle of a message header"
                               : " closed its point-to-point connection (it left the group or exited)"))
        return;
      in.hdr_off += static_cast<size_t>(r);
      if (in.hdr_off < kHeaderBytes) continue;
      in.hdr_off = 0;
      onHeader(peer);
      continue;
    }
    const uint64_t total = in.h.payload_bytes;
    if (in.off == total) {
      finishMessage(peer);
      continue;
    }
    ssize_t r;
    if (in.mode == In::IntoRecv) {
      r = ::recv(in.fd, in.target->data + in.off, static_cast<size_t>(total - in.off), MSG_DONTWAIT);
    } else {
      // Grow with what arrives (at most doubling), never to the claimed length at once.
      const uint64_t chunk = std::min<uint64_t>(total - in.off, std::max<uint64_t>(kMinQueueChunk, in.off));
      in.msg.payload.resize(static_cast<size_t>(in.off + chunk));
      r = ::recv(in.fd, in.msg.payload.data() + in.off, static_cast<size_t>(chunk), MSG_DONTWAIT);
      in.msg.payload.resize(static_cast<size_t>(in.off + (r > 0 ? static_cast<uint64_t>(r) : 0)));
    }
    if (!received(peer, r, " closed its connection")) return;
    in.off += static_cast<uint64_t>(r);
  }
}

bool P2P::received(int peer, ssize_t r, const char* closed) {
  if (r > 0) return true;
  if (r == 0) failPeerIn(peer, who(peer) + closed);
  else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
    failPeerIn(peer, "receive from " + who(peer) + " failed: " + errnoStr(errno));
  return false;
}

bool P2P::pumpBack(int peer) {
  Out& o = out_[peer];
  while (true) {
    ssize_t r = ::recv(o.fd, o.back + o.back_off, kHeaderBytes - o.back_off, MSG_DONTWAIT);
    if (r > 0) {
      o.back_off += static_cast<size_t>(r);
      if (o.back_off < kHeaderBytes) continue;
      FrameHeader h = decodeHeader(o.back);
      if (h.magic == kMagic && h.kind == FrameKind::Abort) {
        failAll(who(peer) + " aborted: " + readAbortMessage(o.fd, h.payload_bytes));
        return false;
      }
      const std::string why = "unexpected data from " + who(peer) + " on a send-only connection";
      failPeerOut(peer, std::make_exception_ptr(TransportError(why, peer)), why);
      return false;
    }
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    const std::string why = r == 0 ? who(peer) + " closed the connection (it left the group or exited)"
                                   : "connection to " + who(peer) + " lost: " + errnoStr(errno);
    failPeerOut(peer, std::make_exception_ptr(TransportError(why, peer)), why);
    return false;
  }
}

void P2P::pumpOut(int peer) {
  Out& o = out_[peer];
  while (o.fd >= 0 && !o.q.empty()) {
    SendOp& s = o.q.front();
    if (!o.started) {
      encodeHeader(s.h, o.hdr);
      o.hdr_off = 0;
      o.pay_off = 0;
      o.started = true;
    }
    const ssize_t w = writeFrame(o.fd, o.hdr, &o.hdr_off, s.data, s.bytes, &o.pay_off);
    if (w < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      const std::string why = "send to " + who(peer) + " failed: " + errnoStr(errno);
      failPeerOut(peer, std::make_exception_ptr(TransportError(why, peer)), why);
      return;
    }
    if (o.hdr_off == kHeaderBytes && o.pay_off == s.bytes) {
      links_.countSent(s.bytes);
      counters_.bytes_sent += s.bytes;
      done_.push_back({std::move(s.done), nullptr, peer});
      o.q.pop_front();
      o.started = false;
    }
  }
}

// ---------------------------------------------------------------- the thread

void P2P::loop() {
  std::vector<pollfd> pfds;
  std::vector<std::pair<int, bool>> who_fd;  // (peer, is_out) per pfds entry after the first
  std::unique_lock<std::mutex> g(mu_);
  while (true) {
    // Adopt finished connection attempts.
    std::vector<std::thread> finished;
    for (auto& kv : out_) {
      Out& o = kv.second;
      if (!o.connector_done) continue;
      o.connector_done = false;
      o.connecting = false;
      if (o.connector.joinable()) finished.push_back(std::move(o.connector));
      if (o.connect_error) {
        auto e = o.connect_error;
        o.connect_error = nullptr;
        failPeerOut(kv.first, e, "");  // a later send tries again
      } else if (o.connected_fd >= 0) {
        o.fd = o.connected_fd;
        o.connected_fd = -1;
        setNonBlocking(o.fd, true);
      }
    }
    if (reconsider_parked_) reconsiderParked();
    for (int p : std::exchange(kick_, {})) pumpIn(p);
    checkDeadlines();
    if (stopping_) failAll(failed_);

    // Callbacks run without the lock: they complete torch Works, whose Future callbacks may post
    // more operations here.
    if (!done_.empty() || !finished.empty()) {
      auto todo = std::exchange(done_, {});
      g.unlock();
      for (auto& t : finished) t.join();
      for (auto& c : todo) {
        try {
          c.done(c.error, c.source);
        } catch (const std::exception& e) {
          env::log(env::Level::Warn, rank_, std::string("point-to-point completion callback threw: ") + e.what());
        } catch (...) {
          env::log(env::Level::Warn, rank_, "point-to-point completion callback threw");
        }
      }
      g.lock();
      continue;  // look again: the callbacks may have posted more
    }
    if (stopping_) break;

    // Peers a receive waits for that never connected: have they left?
    const auto now = Clock::now();
    if (now - last_liveness_ >= kLivenessEvery) {
      std::vector<int> check = livenessToCheck();
      if (!check.empty()) {
        last_liveness_ = now;
        g.unlock();
        std::vector<std::pair<int, std::string>> gone;
        for (int p : check) {
          std::string why = links_.peerGone(p);
          if (!why.empty()) gone.push_back({p, why});
        }
        g.lock();
        for (auto& [p, why] : gone) {
          gone_[p] = why;
          if (in_[p].fd < 0) failPeerIn(p, why);
        }
        if (!gone.empty()) continue;
      }
    }

    pfds.clear();
    who_fd.clear();
    pfds.push_back({wake_fd_, POLLIN, 0});
    Deadline next = Clock::time_point::max();
    bool waiting_on_unconnected = false;
    for (auto& kv : in_) {
      const In& in = kv.second;
      if (in.fd < 0 || !in.closed.empty() || in.mode == In::Parked) continue;
      pfds.push_back({in.fd, POLLIN, 0});
      who_fd.push_back({kv.first, false});
      if (in.target) next = std::min(next, in.target->deadline);
    }
    for (auto& kv : out_) {
      const Out& o = kv.second;
      for (const auto& s : o.q) next = std::min(next, s.deadline);
      if (o.fd < 0 || !o.closed.empty()) continue;
      pfds.push_back({o.fd, static_cast<short>(POLLIN | (o.q.empty() ? 0 : POLLOUT)), 0});
      who_fd.push_back({kv.first, true});
    }
    for (const auto& op : posted_) {
      next = std::min(next, op->deadline);
      if (op->peer < 0 || in_[op->peer].fd < 0) waiting_on_unconnected = true;
    }
    int timeout = next == Clock::time_point::max() ? -1 : msUntil(next);
    if (waiting_on_unconnected) timeout = timeout < 0 ? 250 : std::min(timeout, 250);
    g.unlock();
    int r = ::poll(pfds.data(), pfds.size(), timeout);
    g.lock();
    if (r < 0) {
      if (errno != EINTR) {
        env::log(env::Level::Warn, rank_, "point-to-point poll failed: " + errnoStr(errno));
        g.unlock();
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        g.lock();
      }
      continue;
    }
    if (pfds[0].revents) {
      uint64_t v;
      (void)!::read(wake_fd_, &v, sizeof(v));
    }
    for (size_t k = 1; k < pfds.size(); ++k) {
      if (pfds[k].revents == 0) continue;
      const auto [peer, is_out] = who_fd[k - 1];
      if (!is_out) {
        pumpIn(peer);
        continue;
      }
      Out& o = out_[peer];
      if (o.fd < 0 || !o.closed.empty()) continue;  // failed meanwhile
      if ((pfds[k].revents & (POLLIN | POLLHUP | POLLERR)) && !pumpBack(peer)) continue;
      if (pfds[k].revents & POLLOUT) pumpOut(peer);
    }
  }
}

}  // namespace xirang::transport
