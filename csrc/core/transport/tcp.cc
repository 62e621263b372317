#include "core/transport/tcp.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
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

// What a failed store call (the process hosting the store has exited, most often) says.
std::string storeUnreachable(const std::exception& e) {
  return std::string("the store is unreachable (") + e.what() +
         "): the process hosting it (MASTER_ADDR:MASTER_PORT; under torchrun's env:// rendezvous, rank 0) may have exited";
}

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

bool Tcp::everyPeerGone(const std::function<bool(int)>& known_gone) {
  std::vector<uint8_t> gone(static_cast<size_t>(size_), 0);
  {
    std::lock_guard<std::mutex> g(mu_);  // close() cannot recycle an fd meanwhile
    for (auto* m : {&out_fds_, &in_fds_, &p2p_out_fds_, &p2p_in_fds_})
      for (const auto& [peer, fd] : *m) {
        uint8_t b;
        if (peer >= 0 && peer < size_ && ::recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0)
          gone[static_cast<size_t>(peer)] = 1;
      }
  }
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && !gone[static_cast<size_t>(r)] && !(known_gone && known_gone(r))) return false;
  return true;
}

void Tcp::leave(const std::function<bool(int)>& known_gone) {
  {
    // Once: a group shut down twice (destroy_process_group, then the exit handler for a subgroup
    // Python still holds) has closed its connections by the second call, which could then no
    // longer tell that every peer is gone, and would write into a store whose host has exited.
    std::lock_guard<std::mutex> g(mu_);
    if (left_) return;
    left_ = true;
  }
  if (!store_ || size_ <= 1 || store_->unreachable() || everyPeerGone(known_gone)) return;
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
    throw TransportError(storeUnreachable(e), peer);
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
    return storeUnreachable(e);
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
  if (store_ && size_ > 1 && !store_->unreachable()) {
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
  auto fromStore = [&](auto&& f) {
    try {
      return f();
    } catch (const std::exception& e) {
      throw TransportError(storeUnreachable(e), peer);
    }
  };
  while (!fromStore([&] { return store_->check(addr_key); })) {
    checkStoreAbort(peer);
    if (Clock::now() >= deadline)
      throw TimeoutError("rank " + std::to_string(peer) + " never published its address", peer);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string addr = fromStore([&] { return store_->get(addr_key, deadline); });
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
  // A handshake cut short is most often the peer aborting or leaving: its abort record is in the
  // store before it closes its sockets, so the root cause is named rather than "connection reset".
  auto handshakeFailed = [&](const std::string& io_error) {
    ::close(fd);
    checkStoreAbort(peer);
    const std::string gone = peerGone(peer);
    return TransportError("handshake with rank " + std::to_string(peer) + " at " + addr + " failed: " + io_error +
                             (gone.empty() ? "" : " (" + gone + ")"),
                         peer);
  };
  uint64_t reply[2];
  if (!ioExact(fd, hbuf, sizeof(hbuf), true, hs, &why) || !ioExact(fd, reply, sizeof(reply), false, hs, &why))
    throw handshakeFailed(why);
  if (reply[1] != serverMac(key_, group_id_, channel, hello.nonce, reply[0], peer, rank_)) {
    ::close(fd);
    throw TransportError("rank " + std::to_string(peer) + " at " + addr +
                             " failed authentication (a process outside this group?)",
                         peer);
  }
  uint64_t cmac = clientMac(key_, group_id_, channel, reply[0], hello.nonce, rank_, peer);
  if (!ioExact(fd, &cmac, sizeof(cmac), true, hs, &why)) throw handshakeFailed(why);
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

}  // namespace xirang::transport
