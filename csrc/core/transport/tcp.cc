#include "core/transport/tcp.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <thread>

#include "core/env.h"

namespace xirang::transport {

namespace {

// XIRANG_TEST_DIE_AFTER_SEGMENTS=k[@r] (test only): the process (only group rank r's, with @r)
// kills itself, as a crashed machine would vanish, right after sending its k-th data frame with
// a payload (elastic mode's failure injection).
void dieAfterSegmentsHook(int rank, uint64_t payload) {
  static const std::pair<int64_t, int> knob = [] {
    std::string v = env::get("XIRANG_TEST_DIE_AFTER_SEGMENTS");
    size_t at = v.find('@');
    try {
      return std::make_pair(static_cast<int64_t>(std::stoll(v.substr(0, at))),
                            at == std::string::npos ? -1 : std::stoi(v.substr(at + 1)));
    } catch (const std::exception&) {
      return std::make_pair(int64_t{0}, -1);
    }
  }();
  static std::atomic<int64_t> sent{0};
  if (knob.first <= 0 || payload == 0 || (knob.second >= 0 && knob.second != rank)) return;
  if (++sent >= knob.first) ::kill(::getpid(), SIGKILL);
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t fromHex64(const std::string& s) {
  if (s.empty() || s.size() > 16) throw std::invalid_argument("xirang: bad group id '" + s + "' in the store");
  uint64_t v = 0;
  for (char c : s) {
    int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    if (d < 0) throw std::invalid_argument("xirang: bad group id '" + s + "' in the store");
    v = v * 16 + static_cast<uint64_t>(d);
  }
  return v;
}

constexpr auto kProbeEvery = std::chrono::milliseconds(500);

}  // namespace

Tcp::Tcp(int rank, int size, std::shared_ptr<Store> store, TcpOptions opts, Deadline deadline)
    : rank_(rank), size_(size), store_(std::move(store)), opts_(std::move(opts)) {
  if (size_ <= 1) return;
  const std::string& pre = opts_.key_prefix;
  if (rank_ == 0) {
    group_id_ = opts_.group_id ? *opts_.group_id : randomU64();
    key_ = opts_.key ? *opts_.key : randomKey();
    if (!opts_.group_id) store_->set(pre + "/group_id", hex64(group_id_));
    if (!opts_.key) store_->set(pre + "/secret", keyToHex(key_));
  } else {
    try {
      group_id_ = opts_.group_id ? *opts_.group_id : fromHex64(store_->get(pre + "/group_id", deadline));
      key_ = opts_.key ? *opts_.key : keyFromHex(store_->get(pre + "/secret", deadline));
    } catch (const std::exception& e) {
      throw TransportError(std::string("timed out waiting for rank 0's group id and secret in the store: ") + e.what(), 0);
    }
  }
  int listen_fd = listenOnInterface(opts_.ifname, &address_);
  Acceptor::Config ac;
  ac.rank = rank_;
  ac.size = size_;
  ac.key = key_;
  ac.group_id = group_id_;
  ac.handshake_timeout = opts_.handshake_timeout;
  ac.members = opts_.members;
  acceptor_ = std::make_unique<Acceptor>(listen_fd, ac,
                                         [this](Channel ch, int peer, int fd) { return onPeer(ch, peer, fd); });
  store_->set(pre + "/addr/" + std::to_string(rank_), address_);
  env::log(env::Level::Info, rank_, "listening on " + address_);
}

Tcp::~Tcp() { close(); }

std::string Tcp::onPeer(Channel channel, int peer, int fd) {
  P2P* engine = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return "transport closed";
    auto& fds = channel == Channel::P2P ? p2p_in_fds_ : in_fds_;
    if (fds.count(peer))
      return "rank " + std::to_string(peer) + " already has a " + channelName(channel) +
             " connection here: a second one claiming that rank is refused";
    fds[peer] = fd;
    if (channel == Channel::P2P) {
      if (!p2p_) p2p_ = std::make_unique<P2P>(rank_, size_, *this, opts_.p2p_limits);
      engine = p2p_.get();
    }
  }
  if (engine) engine->addIncoming(peer, fd);
  cv_.notify_all();
  return "";
}

P2P& Tcp::p2p() {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw TransportError("transport closed: " + abort_reason_, -1);
  if (!p2p_) p2p_ = std::make_unique<P2P>(rank_, size_, *this, opts_.p2p_limits);
  return *p2p_;
}

void Tcp::close() {
  std::vector<int> fds;
  {
    std::lock_guard<std::mutex> g(mu_);
    closed_ = true;
    if (abort_reason_.empty()) abort_reason_ = "the process group was shut down";
  }
  cv_.notify_all();
  if (acceptor_) acceptor_->stop();  // no connection is handed over after this
  if (p2p_) p2p_->stop("transport closed: " + abort_reason_);
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto* m : {&out_fds_, &in_fds_, &p2p_out_fds_, &p2p_in_fds_}) {
      for (auto& kv : *m) fds.push_back(kv.second);
      m->clear();
    }
    fds.insert(fds.end(), dead_fds_.begin(), dead_fds_.end());
    dead_fds_.clear();
  }
  for (int fd : fds) {
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
  }
}

void Tcp::interrupt(const std::string& why) {
  P2P* engine = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (abort_reason_.empty()) abort_reason_ = why.empty() ? "interrupted" : why;
    closed_ = true;
    for (auto* m : {&out_fds_, &in_fds_, &p2p_out_fds_, &p2p_in_fds_})
      for (auto& kv : *m) ::shutdown(kv.second, SHUT_RDWR);
    engine = p2p_.get();
  }
  if (engine) engine->shutdown("transport closed: " + (why.empty() ? std::string("interrupted") : why));
  cv_.notify_all();
}

void Tcp::leave() {
  if (!store_ || size_ <= 1) return;
  try {
    store_->set(opts_.key_prefix + "/exit/" + std::to_string(rank_), "left");
  } catch (...) {  // best effort: the store may be gone with the rank that hosted it
  }
}

void Tcp::checkStoreAbort(int peer) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) throw TransportError("transport closed: " + abort_reason_, peer);
  }
  if (!store_) return;
  const std::string key = opts_.key_prefix + "/abort";
  bool aborted = false;
  try {
    aborted = store_->check(key);
  } catch (const std::exception& e) {
    throw TransportError(std::string("the store is unreachable (") + e.what() + ")", peer);
  }
  if (aborted) {
    std::string why = store_->get(key, Clock::now() + std::chrono::seconds(5));
    throw TransportError("the group was aborted: " + why, peer);
  }
}

std::string Tcp::peerGone(int peer) {
  int out_fd = -1;
  bool probe = false;
  const auto now = Clock::now();
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return "transport closed: " + abort_reason_;
    auto gi = gone_.find(peer);
    if (gi != gone_.end()) return gi->second;
    // Our connections to it, closed by the peer? (a peek never blocks; under mu_ so that close()
    // cannot recycle the fd meanwhile)
    for (auto* m : {&out_fds_, &p2p_out_fds_}) {
      auto it = m->find(peer);
      if (it == m->end()) continue;
      uint8_t b;
      if (::recv(it->second, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0) out_fd = it->second;
    }
    auto& last = last_probe_[peer];
    if (now - last >= kProbeEvery) {
      last = now;
      probe = true;
    }
  }
  const std::string who = "rank " + std::to_string(peer);
  std::string why;
  std::string addr;
  try {
    const std::string& pre = opts_.key_prefix;
    if (store_->check(pre + "/abort")) return "the group was aborted: " + store_->get(pre + "/abort", now + std::chrono::seconds(5));
    if (store_->check(pre + "/exit/" + std::to_string(peer)))
      why = who + " left the group (destroy_process_group or exit)";
    else if (probe && store_->check(pre + "/addr/" + std::to_string(peer)))
      addr = store_->get(pre + "/addr/" + std::to_string(peer), now + std::chrono::seconds(5));
  } catch (const std::exception& e) {
    return std::string("the store is unreachable (") + e.what() + ")";
  }
  if (why.empty() && out_fd >= 0) why = who + " closed its connection to this rank (its process exited or left the group)";
  if (why.empty() && !addr.empty()) {
    int fd = -1;
    const int alive = probeConnect(addr, std::chrono::milliseconds(100), &fd);
    if (alive == 0) why = who + " at " + addr + " refuses connections: its process exited or left the group";
    if (alive == 1) {  // say what this is, so its listener closes it without a warning
      Hello h;
      h.version = kWireVersion;
      h.channel = Channel::Probe;
      h.rank = rank_;
      uint8_t buf[kHelloBytes];
      encodeHello(h, buf);
      (void)!::send(fd, buf, sizeof(buf), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::close(fd);
    }
  }
  if (!why.empty()) {
    std::lock_guard<std::mutex> g(mu_);
    gone_[peer] = why;
  }
  return why;
}

void Tcp::checkPeer(int peer) {
  checkStoreAbort(peer);
  std::string why = peerGone(peer);
  if (!why.empty()) throw TransportError(why + ", before it connected to this rank", peer);
}

void Tcp::abort(const std::string& why) {
  if (store_ && size_ > 1) {
    try {  // best effort: the store may be gone with the rank that hosted it
      store_->set(opts_.key_prefix + "/abort", why.substr(0, kMaxAbortMessage));
    } catch (...) {
    }
  }
  std::vector<int> fds;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (abort_reason_.empty()) abort_reason_ = why.empty() ? "aborted" : why;
    for (auto* m : {&out_fds_, &in_fds_, &p2p_out_fds_, &p2p_in_fds_})
      for (auto& kv : *m) fds.push_back(kv.second);
  }
  std::string msg = why.substr(0, kMaxAbortMessage);
  FrameHeader h;
  h.kind = FrameKind::Abort;
  h.payload_bytes = msg.size();
  uint8_t buf[kHeaderBytes];
  encodeHeader(h, buf);
  for (int fd : fds) {
    // Best effort, never blocking: a peer that does not read loses the reason but still sees
    // the connection close.
    (void)!::send(fd, buf, sizeof(buf), MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)!::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  close();
}

int Tcp::clientConnect(int peer, Deadline deadline, Channel channel) {
  const std::string addr_key = opts_.key_prefix + "/addr/" + std::to_string(peer);
  // Poll rather than block in the store until the deadline: an abort or interrupt must end the
  // wait for a peer that will never publish its address.
  while (!store_->check(addr_key)) {
    checkStoreAbort(peer);
    if (Clock::now() >= deadline)
      throw TimeoutError("rank " + std::to_string(peer) + " never published its address", peer);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string addr = store_->get(addr_key, deadline);
  int fd = connectTo(addr, deadline, peer, [this, peer] { checkStoreAbort(peer); });
  setNonBlocking(fd, true);
  Deadline hs = std::min(deadline, Clock::now() + opts_.handshake_timeout);
  Hello hello;
  hello.version = kWireVersion;
  hello.channel = channel;
  hello.rank = rank_;
  hello.nonce = randomU64();
  uint8_t hbuf[kHelloBytes];
  encodeHello(hello, hbuf);
  std::string why;
  uint64_t reply[2];
  if (!ioExact(fd, hbuf, sizeof(hbuf), true, hs, &why) || !ioExact(fd, reply, sizeof(reply), false, hs, &why)) {
    ::close(fd);
    throw TransportError("handshake with rank " + std::to_string(peer) + " at " + addr + " failed: " + why, peer);
  }
  if (reply[1] != serverMac(key_, group_id_, channel, hello.nonce, reply[0], peer, rank_)) {
    ::close(fd);
    throw TransportError("rank " + std::to_string(peer) + " at " + addr +
                             " failed authentication (a process outside this group?)",
                         peer);
  }
  uint64_t cmac = clientMac(key_, group_id_, channel, reply[0], hello.nonce, rank_, peer);
  if (!ioExact(fd, &cmac, sizeof(cmac), true, hs, &why)) {
    ::close(fd);
    throw TransportError("handshake with rank " + std::to_string(peer) + " failed: " + why, peer);
  }
  if (channel == Channel::P2P) {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) {
      ::close(fd);
      throw TransportError("transport closed: " + abort_reason_, peer);
    }
    auto it = p2p_out_fds_.find(peer);
    if (it != p2p_out_fds_.end()) dead_fds_.push_back(it->second);  // a failed earlier stream
    p2p_out_fds_[peer] = fd;
  }
  env::log(env::Level::Info, rank_,
           "connected to rank " + std::to_string(peer) + " at " + addr + " (" + channelName(channel) + ")");
  return fd;
}

int Tcp::outgoing(int peer, Deadline deadline) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) throw TransportError("transport closed: " + abort_reason_, peer);
    auto it = out_fds_.find(peer);
    if (it != out_fds_.end()) return it->second;
  }
  int fd = clientConnect(peer, deadline, Channel::Collective);
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) {
    ::close(fd);
    throw TransportError("transport closed: " + abort_reason_, peer);
  }
  out_fds_[peer] = fd;
  return fd;
}

int Tcp::tryIncoming(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw TransportError("transport closed: " + abort_reason_, peer);
  auto it = in_fds_.find(peer);
  return it == in_fds_.end() ? -1 : it->second;
}

int Tcp::incoming(int peer, Deadline deadline) {
  while (true) {
    {
      std::unique_lock<std::mutex> g(mu_);
      auto until = std::min(deadline, Clock::now() + std::chrono::milliseconds(200));
      cv_.wait_until(g, until, [&] { return closed_ || in_fds_.count(peer) != 0; });
      if (closed_) throw TransportError("transport closed: " + abort_reason_, peer);
      auto it = in_fds_.find(peer);
      if (it != in_fds_.end()) return it->second;
      if (Clock::now() >= deadline)
        throw TimeoutError("timed out waiting for rank " + std::to_string(peer) + " to connect", peer);
    }
    checkPeer(peer);
  }
}

void Tcp::connectPeer(int peer, Deadline deadline) {
  outgoing(peer, deadline);
  incoming(peer, deadline);
}

namespace {

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
  size_t seg;
};
struct OutStream {
  int fd;
  int peer;
  std::vector<OutFrame> frames;
  size_t cur = 0;
  uint8_t hdr[kHeaderBytes] = {};
  size_t hdr_off = 0;
  uint64_t pay_off = 0;
  bool hdr_ready = false;
  uint64_t bytes_done = 0;
  bool back_closed = false;
};
struct InStream {
  int fd;
  int peer;
  std::vector<InFrame> frames;
  size_t cur = 0;
  uint8_t hdr[kHeaderBytes] = {};
  size_t hdr_off = 0;
  uint64_t pay_off = 0;
  bool hdr_ok = false;
  uint64_t bytes_done = 0;
};

[[noreturn]] void throwAbortFrom(int fd, int peer, const uint8_t* hdr) {
  FrameHeader h = decodeHeader(hdr);
  std::string msg(std::min<uint64_t>(h.payload_bytes, kMaxAbortMessage), '\0');
  std::string why;
  ioExact(fd, msg.data(), msg.size(), false, Clock::now() + std::chrono::milliseconds(200), &why);
  throw TransportError("rank " + std::to_string(peer) + " aborted: " + msg, peer);
}

// XIRANG_SEND_THREAD_BYTES: sends of at least this many bytes to one peer during a receive get
// their own thread (0: never).
int64_t sendThreadBytes() {
  static const int64_t v = env::getInt("XIRANG_SEND_THREAD_BYTES");
  return v;
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

void Tcp::exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                   std::vector<PeerTiming>* timings) {
  const auto started = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - started).count(); };
  std::vector<OutStream> outs;
  std::vector<InStream> ins;
  for (auto& job : sends) {
    int fd = outgoing(job.peer, deadline);
    auto it = std::find_if(outs.begin(), outs.end(), [&](const OutStream& s) { return s.fd == fd; });
    if (it == outs.end()) {
      outs.push_back(OutStream{fd, job.peer, {}});
      it = outs.end() - 1;
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
  for (size_t j = 0; j < recvs.size(); ++j) {
    auto& job = recvs[j];
    // The peer's connection to us may not exist yet (it connects when it first sends): do not
    // wait for it here, or a peer that is itself waiting for our frames never gets them.
    auto it = std::find_if(ins.begin(), ins.end(), [&](const InStream& s) { return s.peer == job.peer; });
    if (it == ins.end()) {
      ins.push_back(InStream{tryIncoming(job.peer), job.peer, {}});
      it = ins.end() - 1;
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

  // Sends on one stream what its socket takes now (until EAGAIN or the stream is done).
  auto pumpOut = [&](OutStream& s, short revents, uint64_t& sent, std::vector<PeerTiming>* tm) {
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
      ssize_t w;
      if (s.hdr_off < kHeaderBytes) {
        iovec iov[2] = {{s.hdr + s.hdr_off, kHeaderBytes - s.hdr_off},
                        {const_cast<uint8_t*>(f.data), static_cast<size_t>(f.bytes)}};
        msghdr m{};
        m.msg_iov = iov;
        m.msg_iovlen = f.bytes ? 2 : 1;
        w = ::sendmsg(s.fd, &m, MSG_NOSIGNAL);
        if (w > 0) {
          size_t hw = std::min<size_t>(static_cast<size_t>(w), kHeaderBytes - s.hdr_off);
          s.hdr_off += hw;
          s.pay_off += static_cast<uint64_t>(w) - hw;
        }
      } else {
        w = ::send(s.fd, f.data + s.pay_off, static_cast<size_t>(f.bytes - s.pay_off), MSG_NOSIGNAL);
        if (w > 0) s.pay_off += static_cast<uint64_t>(w);
      }
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        throw TransportError("send to rank " + std::to_string(s.peer) + " failed: " + errnoStr(errno), s.peer);
      }
      if (s.hdr_off == kHeaderBytes && s.pay_off == f.bytes) {
        dieAfterSegmentsHook(rank_, f.bytes);
        sent += f.bytes;
        s.bytes_done += f.bytes;
        s.cur++;
        s.hdr_ready = false;
        if (tm && s.cur == s.frames.size()) tm->push_back({s.peer, true, elapsed(), s.bytes_done});
      }
    }
  };

  // A large send to one peer while receiving (a ring step) is pumped by a helper thread blocked
  // in its own poll(), as a sender thread beside a receiver thread would be: neither direction
  // waits for the other's syscalls or for the reductions run in on_segment. (On loopback, WS=2,
  // 64 MiB allreduce: see the README's benchmark notes.) The main loop leaves outs[0] alone until
  // the helper is done; after that it handles it as usual (back channel, or what the helper left
  // when the deadline passed).
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
    ~Helper() { join(); }
  } helper;
  uint64_t sent_payload = 0;
  auto finishHelper = [&] {
    helper.join();
    helper.active = false;
    sent_payload += helper.sent;
    if (timings) timings->insert(timings->end(), helper.timings.begin(), helper.timings.end());
    if (helper.err) std::rethrow_exception(helper.err);
  };
  if (outs.size() == 1 && !ins.empty() && sendThreadBytes() > 0) {
    uint64_t total = 0;
    for (auto& f : outs[0].frames) total += f.bytes;
    if (total >= static_cast<uint64_t>(sendThreadBytes()) &&
        (helper.evfd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) >= 0) {
      helper.active = true;
      helper.th = std::thread([&] {
        OutStream& s = outs[0];
        try {
          while (s.cur < s.frames.size() && !helper.stop.load(std::memory_order_relaxed)) {
            pollfd p{s.fd, POLLIN | POLLOUT, 0};
            int r = ::poll(&p, 1, std::min(msUntil(deadline), 20));
            if (r < 0 && errno != EINTR) throw TransportError("poll failed: " + errnoStr(errno), -1);
            if (r > 0) pumpOut(s, p.revents, helper.sent, timings ? &helper.timings : nullptr);
            if (r == 0 && Clock::now() >= deadline) break;
          }
        } catch (...) {
          helper.err = std::current_exception();
        }
        uint64_t one = 1;  // wakes the main loop's poll(); join() orders what the helper wrote
        (void)!::write(helper.evfd, &one, sizeof(one));
      });
    }
  }

  std::vector<pollfd> pfds;
  std::vector<std::pair<bool, size_t>> who;  // (is_out, index); (false, SIZE_MAX): the helper
  auto last_store_check = Clock::now();
  while (true) {
    pfds.clear();
    who.clear();
    bool pending = false, connecting = false;
    for (auto& in : ins) {
      if (in.cur >= in.frames.size()) continue;
      pending = true;
      if (in.fd < 0 && (in.fd = tryIncoming(in.peer)) < 0) connecting = true;
    }
    if (helper.active) {
      pending = true;
      pfds.push_back({helper.evfd, POLLIN, 0});
      who.push_back({false, SIZE_MAX});
    }
    for (size_t i = helper.active ? 1 : 0; i < outs.size(); ++i) pending = pending || outs[i].cur < outs[i].frames.size();
    if (!pending) break;
    for (size_t i = helper.active ? 1 : 0; i < outs.size(); ++i) {
      // Abort frames arrive on the back channel, also after our sends to that peer are done.
      const bool sending = outs[i].cur < outs[i].frames.size();
      if (!sending && outs[i].back_closed) continue;
      pfds.push_back({outs[i].fd, static_cast<short>(sending ? (POLLIN | POLLOUT) : POLLIN), 0});
      who.push_back({true, i});
    }
    for (size_t i = 0; i < ins.size(); ++i) {
      if (ins[i].cur >= ins[i].frames.size() || ins[i].fd < 0) continue;
      pfds.push_back({ins[i].fd, POLLIN, 0});
      who.push_back({false, i});
    }
    int t = msUntil(deadline);
    if (connecting) {  // look again for the connections not yet accepted
      t = std::min(t, 10);
      if (Clock::now() - last_store_check > std::chrono::milliseconds(200)) {
        last_store_check = Clock::now();
        for (auto& in : ins)
          if (in.fd < 0) checkPeer(in.peer);
      }
    }
    int r = t == 0 ? 0 : ::poll(pfds.data(), pfds.size(), t);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw TransportError("poll failed: " + errnoStr(errno), -1);
    }
    if (r == 0 && Clock::now() >= deadline) {
      if (helper.active) finishHelper();
      std::string waiting;
      auto add = [&](const std::string& w) { waiting += (waiting.empty() ? " " : ", ") + w; };
      for (auto& s : ins)
        if (s.cur < s.frames.size())
          add("receive from rank " + std::to_string(s.peer) + (s.fd < 0 ? " (it has not connected)" : ""));
      for (auto& s : outs)
        if (s.cur < s.frames.size()) add("send to rank " + std::to_string(s.peer));
      throw TimeoutError("timed out; still waiting to" + waiting, -1);
    }
    for (size_t k = 0; k < pfds.size(); ++k) {
      if (pfds[k].revents == 0) continue;
      if (who[k].second == SIZE_MAX) {
        finishHelper();
        continue;
      }
      if (who[k].first) {
        OutStream& s = outs[who[k].second];
        if (s.cur >= s.frames.size()) {
          // Our sends are complete: only an abort matters; a peer that finished and closed
          // (or died: the streams we still wait on will say so) is not an error here.
          if (!readAbortIfAny(s.fd, s.peer)) s.back_closed = true;
          continue;
        }
        pumpOut(s, pfds[k].revents, sent_payload, timings);
      } else {
        InStream& s = ins[who[k].second];
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
          if (got == 0)
            throw TransportError("rank " + std::to_string(s.peer) + " closed the connection", s.peer);
          if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            throw TransportError("receive from rank " + std::to_string(s.peer) + " failed: " + errnoStr(errno), s.peer);
          }
          if (s.hdr_ok && s.pay_off == f.bytes) {
            s.bytes_done += f.bytes;
            s.cur++;
            if (timings && s.cur == s.frames.size()) timings->push_back({s.peer, false, elapsed(), s.bytes_done});
            s.hdr_ok = false;
            s.hdr_off = 0;
            if (f.seg != SIZE_MAX && recvs[f.job].on_segment) recvs[f.job].on_segment(f.seg);
          }
        }
      }
    }
  }
  payload_sent_ += sent_payload;
}

}  // namespace xirang::transport
