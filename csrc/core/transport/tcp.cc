#include "core/transport/tcp.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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
// a payload (#8's failure injection).
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

constexpr uint8_t kHelloMagic[4] = {'X', 'R', 'H', 'S'};
constexpr size_t kHelloBytes = 20;  // magic4 version2 channel1 pad1 rank4 nonce8

std::string errnoStr(int e) { return std::strerror(e); }

int msUntil(Deadline d) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d - Clock::now()).count();
  if (ms < 0) return 0;
  if (ms > 1000000) return 1000000;
  return static_cast<int>(ms) + 1;
}

void setNonBlocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void tuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Reads or writes exactly n bytes on a non-blocking fd before the deadline.
bool ioExact(int fd, void* buf, size_t n, bool write, Deadline deadline, std::string* why) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  size_t done = 0;
  while (done < n) {
    ssize_t r = write ? ::send(fd, p + done, n - done, MSG_NOSIGNAL) : ::recv(fd, p + done, n - done, 0);
    if (r > 0) {
      done += static_cast<size_t>(r);
      continue;
    }
    if (r == 0 && !write) {
      *why = "connection closed";
      return false;
    }
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      *why = errnoStr(errno);
      return false;
    }
    pollfd pfd{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    int t = msUntil(deadline);
    if (t == 0 || ::poll(&pfd, 1, t) == 0) {
      if (Clock::now() >= deadline) {
        *why = "timed out";
        return false;
      }
    }
  }
  return true;
}

std::string sockaddrToString(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return std::string(host) + ":" + std::to_string(ntohs(in->sin_port));
  }
  auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
  inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
  // Appended piecewise: `"[" + std::string(host)` trips a false -Wrestrict of GCC 12 (C++20).
  std::string out = "[";
  out += host;
  out += "]:";
  out += std::to_string(ntohs(in6->sin6_port));
  return out;
}

int bindListen(const sockaddr* sa, socklen_t len, std::string* address) {
  int fd = ::socket(sa->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_storage ss{};
  std::memcpy(&ss, sa, len);
  if (ss.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&ss)->sin_port = 0;
  if (ss.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0 || ::listen(fd, 128) != 0) {
    ::close(fd);
    return -1;
  }
  sockaddr_storage bound{};
  socklen_t blen = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &blen);
  *address = sockaddrToString(reinterpret_cast<sockaddr*>(&bound));
  return fd;
}

void splitAddress(const std::string& a, std::string* host, std::string* port) {
  auto colon = a.rfind(':');
  if (colon == std::string::npos) throw std::invalid_argument("xirang: bad address " + a);
  *host = a.substr(0, colon);
  *port = a.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[') *host = host->substr(1, host->size() - 2);
}

}  // namespace

int listenOnInterface(const std::string& ifname, std::string* address) {
  if (!ifname.empty()) {
    ifaddrs* ifs = nullptr;
    if (getifaddrs(&ifs) != 0) throw TransportError("xirang: getifaddrs failed: " + errnoStr(errno), -1);
    int fd = -1;
    for (int family : {AF_INET, AF_INET6}) {
      for (ifaddrs* i = ifs; i != nullptr && fd < 0; i = i->ifa_next) {
        if (!i->ifa_addr || ifname != i->ifa_name || i->ifa_addr->sa_family != family) continue;
        socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
        fd = bindListen(i->ifa_addr, len, address);
      }
    }
    freeifaddrs(ifs);
    if (fd < 0)
      throw TransportError("xirang: XIRANG_SOCKET_IFNAME=" + ifname +
                               ": no IPv4/IPv6 address on that interface could be bound",
                           -1);
    return fd;
  }
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host, nullptr, &hints, &res) == 0) {
    for (addrinfo* r = res; r != nullptr; r = r->ai_next) {
      int fd = bindListen(r->ai_addr, r->ai_addrlen, address);
      if (fd >= 0) {
        freeaddrinfo(res);
        return fd;
      }
    }
    freeaddrinfo(res);
  }
  sockaddr_in lo{};
  lo.sin_family = AF_INET;
  lo.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int fd = bindListen(reinterpret_cast<sockaddr*>(&lo), sizeof(lo), address);
  if (fd < 0) throw TransportError("xirang: cannot listen on any address: " + errnoStr(errno), -1);
  return fd;
}

int connectTo(const std::string& address, Deadline deadline, int peer, const std::function<void()>& between_tries) {
  std::string host, port;
  splitAddress(address, &host, &port);
  std::string last = "no address";
  // A peer publishes its address only once it listens, so connections refused for a while mean
  // its listener is gone: the process exited or destroyed its group. Fail now, not at the
  // deadline (a refusal can also be a full accept backlog for an instant: a short grace).
  Clock::time_point refused_since{};
  while (true) {
    bool refused = false;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int gai = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
    if (gai != 0) {
      last = gai_strerror(gai);
    } else {
      for (addrinfo* r = res; r != nullptr; r = r->ai_next) {
        int fd = ::socket(r->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
          last = errnoStr(errno);
          continue;
        }
        setNonBlocking(fd, true);
        int rc = ::connect(fd, r->ai_addr, r->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
          pollfd pfd{fd, POLLOUT, 0};
          if (::poll(&pfd, 1, std::min(msUntil(deadline), 5000)) == 1) {
            int err = 0;
            socklen_t el = sizeof(err);
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
            rc = err == 0 ? 0 : -1;
            errno = err;
          } else {
            errno = ETIMEDOUT;
          }
        }
        if (rc == 0) {
          freeaddrinfo(res);
          tuneSocket(fd);
          setNonBlocking(fd, false);
          return fd;
        }
        refused = refused || errno == ECONNREFUSED;
        last = errnoStr(errno);
        ::close(fd);
      }
      freeaddrinfo(res);
    }
    if (!refused) {
      refused_since = {};
    } else if (refused_since == Clock::time_point{}) {
      refused_since = Clock::now();
    } else if (Clock::now() - refused_since >= std::chrono::milliseconds(500)) {
      throw TransportError("rank " + std::to_string(peer) + " at " + address +
                               " refuses connections: its process exited or left the group",
                           peer);
    }
    if (Clock::now() >= deadline) break;
    if (between_tries) between_tries();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // listener may still be starting
  }
  throw TimeoutError("cannot connect to rank " + std::to_string(peer) + " at " + address + ": " + last, peer);
}

Tcp::Tcp(int rank, int size, std::shared_ptr<Store> store, TcpOptions opts, Deadline deadline)
    : rank_(rank), size_(size), store_(std::move(store)), opts_(std::move(opts)) {
  if (size_ <= 1) return;
  if (opts_.key) {
    key_ = *opts_.key;
  } else if (rank_ == 0) {
    key_ = randomKey();
    store_->set(opts_.key_prefix + "/secret", keyToHex(key_));
  }
  listen_fd_ = listenOnInterface(opts_.ifname, &address_);
  if (::pipe2(wake_pipe_, O_CLOEXEC) != 0) {
    ::close(listen_fd_);
    throw TransportError("xirang: pipe failed: " + errnoStr(errno), -1);
  }
  if (rank_ != 0 && !opts_.key) {
    try {
      key_ = keyFromHex(store_->get(opts_.key_prefix + "/secret", deadline));
    } catch (const std::exception& e) {
      close();
      throw TransportError(std::string("timed out waiting for rank 0's group secret in the store: ") + e.what(), 0);
    }
  }
  accept_thread_ = std::thread([this] { acceptLoop(); });
  store_->set(opts_.key_prefix + "/addr/" + std::to_string(rank_), address_);
  env::log(env::Level::Info, rank_, "listening on " + address_);
}

Tcp::~Tcp() { close(); }

void Tcp::close() {
  std::vector<int> fds;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_ && !accept_thread_.joinable() && handshake_threads_.empty()) return;
    closed_ = true;
    for (auto& kv : out_fds_) fds.push_back(kv.second);
    for (auto& kv : in_fds_) fds.push_back(kv.second);
    out_fds_.clear();
    in_fds_.clear();
    fds.insert(fds.end(), dead_fds_.begin(), dead_fds_.end());
    dead_fds_.clear();
  }
  cv_.notify_all();
  if (wake_pipe_[1] >= 0) {
    char c = 0;
    (void)!::write(wake_pipe_[1], &c, 1);
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  std::vector<std::thread> hs;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (int fd : pending_fds_) ::shutdown(fd, SHUT_RDWR);  // fail pending handshakes now
    hs.swap(handshake_threads_);
  }
  for (auto& t : hs) t.join();
  for (int fd : fds) {
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  for (int& p : wake_pipe_) {
    if (p >= 0) ::close(p);
    p = -1;
  }
}

void Tcp::interrupt(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  if (abort_reason_.empty()) abort_reason_ = why.empty() ? "interrupted" : why;
  closed_ = true;
  for (auto& kv : out_fds_) ::shutdown(kv.second, SHUT_RDWR);
  for (auto& kv : in_fds_) ::shutdown(kv.second, SHUT_RDWR);
  for (int fd : pending_fds_) ::shutdown(fd, SHUT_RDWR);
  cv_.notify_all();
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
    for (auto& kv : out_fds_) fds.push_back(kv.second);
    for (auto& kv : in_fds_) fds.push_back(kv.second);
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

void Tcp::acceptLoop() {
  while (true) {
    pollfd pfds[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
    int r = ::poll(pfds, 2, -1);
    if (r < 0 && errno == EINTR) continue;
    if (pfds[1].revents != 0) return;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_) return;
    }
    if (!(pfds[0].revents & POLLIN)) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    tuneSocket(fd);
    setNonBlocking(fd, true);
    // Each handshake runs on its own thread, so a silent stranger cannot hold up the members'
    // connections; close() shuts pending sockets down and joins these threads.
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) {
      ::close(fd);
      return;
    }
    pending_fds_.insert(fd);
    handshake_threads_.emplace_back([this, fd] { finishAccept(fd); });
  }
}

void Tcp::finishAccept(int fd) {
  int peer = -1;
  std::string why;
  bool ok = serverHandshake(fd, &peer, &why);
  {
    std::lock_guard<std::mutex> g(mu_);
    pending_fds_.erase(fd);
    if (!ok || closed_) {
      if (!ok && !closed_) env::log(env::Level::Warn, rank_, "rejected a connection: " + why);
      ::close(fd);
      return;
    }
    auto it = in_fds_.find(peer);
    if (it != in_fds_.end()) dead_fds_.push_back(it->second);
    in_fds_[peer] = fd;
  }
  cv_.notify_all();
}

bool Tcp::serverHandshake(int fd, int* peer_out, std::string* why) {
  Deadline deadline = Clock::now() + opts_.handshake_timeout;
  uint8_t hello[kHelloBytes];
  if (!ioExact(fd, hello, sizeof(hello), false, deadline, why)) return false;
  if (std::memcmp(hello, kHelloMagic, 4) != 0) {
    *why = "not a xirang peer (bad hello)";
    return false;
  }
  uint16_t version;
  int32_t peer;
  uint64_t cnonce;
  std::memcpy(&version, hello + 4, 2);
  std::memcpy(&peer, hello + 8, 4);
  std::memcpy(&cnonce, hello + 12, 8);
  if (version != kWireVersion) {
    *why = "peer speaks wire version " + std::to_string(version) + ", this rank " + std::to_string(kWireVersion);
    return false;
  }
  if (peer < 0 || peer >= size_ || peer == rank_) {
    *why = "peer claims invalid rank " + std::to_string(peer);
    return false;
  }
  if (!opts_.members.empty() && std::find(opts_.members.begin(), opts_.members.end(), peer) == opts_.members.end()) {
    *why = "rank " + std::to_string(peer) + " is not a live member of this epoch (it was declared dead)";
    return false;
  }
  uint64_t snonce = randomU64();
  uint64_t msg[4] = {0x53ULL, cnonce, snonce, (static_cast<uint64_t>(rank_) << 32) | static_cast<uint32_t>(peer)};
  uint64_t reply[2] = {snonce, siphash24(key_, msg, sizeof(msg))};
  if (!ioExact(fd, reply, sizeof(reply), true, deadline, why)) return false;
  uint64_t cmac;
  if (!ioExact(fd, &cmac, sizeof(cmac), false, deadline, why)) return false;
  uint64_t expect[4] = {0x43ULL, snonce, cnonce, (static_cast<uint64_t>(peer) << 32) | static_cast<uint32_t>(rank_)};
  if (cmac != siphash24(key_, expect, sizeof(expect))) {
    *why = "peer claiming rank " + std::to_string(peer) + " failed authentication (not in this group)";
    return false;
  }
  *peer_out = peer;
  return true;
}

int Tcp::clientConnect(int peer, Deadline deadline) {
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
  uint8_t hello[kHelloBytes] = {0};
  std::memcpy(hello, kHelloMagic, 4);
  uint16_t version = kWireVersion;
  int32_t me = rank_;
  uint64_t cnonce = randomU64();
  std::memcpy(hello + 4, &version, 2);
  std::memcpy(hello + 8, &me, 4);
  std::memcpy(hello + 12, &cnonce, 8);
  std::string why;
  uint64_t reply[2];
  if (!ioExact(fd, hello, sizeof(hello), true, hs, &why) || !ioExact(fd, reply, sizeof(reply), false, hs, &why)) {
    ::close(fd);
    throw TransportError("handshake with rank " + std::to_string(peer) + " at " + addr + " failed: " + why, peer);
  }
  uint64_t smsg[4] = {0x53ULL, cnonce, reply[0], (static_cast<uint64_t>(peer) << 32) | static_cast<uint32_t>(rank_)};
  if (reply[1] != siphash24(key_, smsg, sizeof(smsg))) {
    ::close(fd);
    throw TransportError("rank " + std::to_string(peer) + " at " + addr +
                             " failed authentication (a process outside this group?)",
                         peer);
  }
  uint64_t cmsg[4] = {0x43ULL, reply[0], cnonce, (static_cast<uint64_t>(rank_) << 32) | static_cast<uint32_t>(peer)};
  uint64_t cmac = siphash24(key_, cmsg, sizeof(cmsg));
  if (!ioExact(fd, &cmac, sizeof(cmac), true, hs, &why)) {
    ::close(fd);
    throw TransportError("handshake with rank " + std::to_string(peer) + " failed: " + why, peer);
  }
  env::log(env::Level::Info, rank_, "connected to rank " + std::to_string(peer) + " at " + addr);
  return fd;
}

int Tcp::outgoing(int peer, Deadline deadline) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) throw TransportError("transport closed: " + abort_reason_, peer);
    auto it = out_fds_.find(peer);
    if (it != out_fds_.end()) return it->second;
  }
  int fd = clientConnect(peer, deadline);
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
  std::unique_lock<std::mutex> g(mu_);
  while (true) {
    if (closed_) throw TransportError("transport closed: " + abort_reason_, peer);
    auto it = in_fds_.find(peer);
    if (it != in_fds_.end()) return it->second;
    if (cv_.wait_until(g, deadline) == std::cv_status::timeout && Clock::now() >= deadline) {
      throw TimeoutError("timed out waiting for rank " + std::to_string(peer) + " to connect", peer);
    }
  }
}

void Tcp::connectPeer(int peer, Deadline deadline) {
  outgoing(peer, deadline);
  incoming(peer, deadline);
}

int Tcp::waitAnySource(Deadline deadline, uint32_t tag) {
  for (auto& [peer, msgs] : stash_)
    for (auto& m : msgs)
      if (m.header.tag == tag) return peer;
  while (true) {
    std::vector<std::pair<int, int>> fds;  // (peer, fd)
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_) throw TransportError("transport closed: " + abort_reason_, -1);
      for (auto& kv : in_fds_) fds.push_back(kv);
    }
    std::vector<pollfd> pfds;
    for (auto& pf : fds) pfds.push_back({pf.second, POLLIN, 0});
    int t = std::min(msUntil(deadline), 100);
    int r = pfds.empty() ? 0 : ::poll(pfds.data(), pfds.size(), t);
    if (pfds.empty()) {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait_for(g, std::chrono::milliseconds(t));
    }
    for (size_t i = 0; r > 0 && i < pfds.size(); ++i) {
      if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      uint8_t hdr[kHeaderBytes];
      ssize_t got = ::recv(pfds[i].fd, hdr, sizeof(hdr), MSG_PEEK);
      if (got == 0) throw TransportError("rank " + std::to_string(fds[i].first) + " closed the connection", fds[i].first);
      if (got == static_cast<ssize_t>(sizeof(hdr))) {
        FrameHeader h = decodeHeader(hdr);
        if (h.kind == FrameKind::Abort || (h.kind == FrameKind::Data && h.op == OpKind::Send && h.tag == tag))
          return fds[i].first;
        if (h.magic == kMagic && h.kind == FrameKind::Data && h.op == OpKind::Send) {
          // A message with another tag is in front: keep it for its own receive and look again.
          if (stash_bytes_ + h.payload_bytes > kMaxStashBytes)
            throw TransportError("more than 1 GiB of point-to-point messages from rank " +
                                     std::to_string(fds[i].first) + " arrived ahead of their receives",
                                 fds[i].first);
          Stashed m;
          m.header = h;
          m.payload.resize(h.payload_bytes);
          std::string why;
          if (!ioExact(pfds[i].fd, hdr, sizeof(hdr), false, deadline, &why) ||
              !ioExact(pfds[i].fd, m.payload.data(), m.payload.size(), false, deadline, &why))
            throw TransportError("receive from rank " + std::to_string(fds[i].first) + " failed: " + why,
                                 fds[i].first);
          stash_bytes_ += m.payload.size();
          stash_[fds[i].first].push_back(std::move(m));
          return waitAnySource(deadline, tag);
        }
      }
    }
    if (Clock::now() >= deadline) throw TimeoutError("timed out waiting for a message from any rank", -1);
  }
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
  bool stashing = false;  // reading a p2p message with another tag into the stash
  Tcp::Stashed stash{};
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
  uint8_t hdr[kHeaderBytes];
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
  uint8_t hdr[kHeaderBytes];
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
      if (h.op == OpKind::Send) {
        // A message with this tag may have arrived while an earlier receive waited for another.
        auto& msgs = stash_[job.peer];
        auto m = std::find_if(msgs.begin(), msgs.end(), [&](const Stashed& x) { return x.header.tag == h.tag; });
        if (m != msgs.end()) {
          std::string diff = compareHeader(h, m->header, job.peer);
          if (!diff.empty()) throw MismatchError(diff, job.peer);
          if (h.payload_bytes) std::memcpy(job.segs[s].data, m->payload.data(), h.payload_bytes);
          stash_bytes_ -= m->payload.size();
          msgs.erase(m);
          if (job.on_segment) job.on_segment(s);
          continue;
        }
      }
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
          if (in.fd < 0) checkStoreAbort(in.peer);
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
                if (h.magic == kMagic && h.kind == FrameKind::Data && h.op == OpKind::Send &&
                    f.expect.op == OpKind::Send && h.tag != f.expect.tag) {
                  // A message for a later receive: keep it and read on.
                  if (stash_bytes_ + h.payload_bytes > kMaxStashBytes)
                    throw TransportError("more than 1 GiB of point-to-point messages from rank " +
                                             std::to_string(s.peer) + " arrived ahead of their receives",
                                         s.peer);
                  s.stashing = true;
                  s.stash.header = h;
                  s.stash.payload.resize(h.payload_bytes);
                }
                if (!s.stashing) {
                  std::string diff = compareHeader(f.expect, h, s.peer);
                  if (!diff.empty()) throw MismatchError(diff, s.peer);
                }
                s.hdr_ok = true;
                s.pay_off = 0;
              }
            }
          } else if (s.stashing) {
            uint64_t want = s.stash.payload.size() - s.pay_off;
            got = want ? ::recv(s.fd, s.stash.payload.data() + s.pay_off, static_cast<size_t>(want), 0) : 1;
            if (want && got > 0) s.pay_off += static_cast<uint64_t>(got);
            if (got > 0 && s.pay_off == s.stash.payload.size()) {
              stash_bytes_ += s.stash.payload.size();
              stash_[s.peer].push_back(std::move(s.stash));
              s.stash = Stashed{};
              s.stashing = false;
              s.hdr_ok = false;
              s.hdr_off = 0;
              continue;
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
          if (s.hdr_ok && !s.stashing && s.pay_off == f.bytes) {
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
