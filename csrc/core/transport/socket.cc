#include "core/transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "core/transport/frame.h"

namespace xirang::transport {

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

ssize_t writeFrame(int fd, const uint8_t* hdr, size_t* hdr_off, const uint8_t* data, uint64_t bytes, uint64_t* pay_off) {
  ssize_t w;
  if (*hdr_off < kHeaderBytes) {
    iovec iov[2] = {{const_cast<uint8_t*>(hdr) + *hdr_off, kHeaderBytes - *hdr_off},
                    {const_cast<uint8_t*>(data), static_cast<size_t>(bytes)}};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = bytes ? 2 : 1;
    w = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      const size_t hw = std::min<size_t>(static_cast<size_t>(w), kHeaderBytes - *hdr_off);
      *hdr_off += hw;
      *pay_off += static_cast<uint64_t>(w) - hw;
    }
  } else {
    w = ::send(fd, data + *pay_off, static_cast<size_t>(bytes - *pay_off), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) *pay_off += static_cast<uint64_t>(w);
  }
  return w;
}

std::string readAbortMessage(int fd, uint64_t payload_bytes) {
  std::string msg(static_cast<size_t>(std::min<uint64_t>(payload_bytes, kMaxAbortMessage)), '\0');
  std::string why;
  if (!ioExact(fd, msg.data(), msg.size(), false, Clock::now() + std::chrono::milliseconds(200), &why)) msg.clear();
  return msg;
}

namespace {

// "ip:port" / "[ip]:port" of a socket address. Written into one buffer: GCC 12's -Wrestrict
// misfires on a chain of std::string concatenations here.
std::string sockaddrToString(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = {0};
  char out[INET6_ADDRSTRLEN + 16] = {0};
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    std::snprintf(out, sizeof(out), "%s:%u", host, static_cast<unsigned>(ntohs(in->sin_port)));
  } else {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    std::snprintf(out, sizeof(out), "[%s]:%u", host, static_cast<unsigned>(ntohs(in6->sin6_port)));
  }
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
  // A backlog of 1024 (capped by net.core.somaxconn): a burst of connections from strangers
  // must not push the members' connections out of the queue.
  if (::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0 || ::listen(fd, 1024) != 0) {
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

namespace {

// One non-blocking connect to each getaddrinfo result of host:port, each bounded by `wait`.
// Returns the connected fd (non-blocking) or -1; *refused tells whether some result refused.
int connectOnce(const std::string& host, const std::string& port, std::chrono::milliseconds wait, bool* refused,
                std::string* last) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int gai = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0) {
    *last = gai_strerror(gai);
    return -1;
  }
  int out = -1;
  for (addrinfo* r = res; r != nullptr && out < 0; r = r->ai_next) {
    int fd = ::socket(r->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      *last = errnoStr(errno);
      continue;
    }
    setNonBlocking(fd, true);
    int rc = ::connect(fd, r->ai_addr, r->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      if (::poll(&pfd, 1, static_cast<int>(wait.count())) == 1) {
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
      out = fd;
      break;
    }
    *refused = *refused || errno == ECONNREFUSED;
    *last = errnoStr(errno);
    ::close(fd);
  }
  freeaddrinfo(res);
  return out;
}

}  // namespace

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
    const auto wait = std::chrono::milliseconds(std::min(msUntil(deadline), 5000));
    int fd = connectOnce(host, port, wait, &refused, &last);
    if (fd >= 0) {
      tuneSocket(fd);
      setNonBlocking(fd, false);
      return fd;
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

int probeConnect(const std::string& address, std::chrono::milliseconds wait, int* fd_out) {
  std::string host, port, last;
  try {
    splitAddress(address, &host, &port);
  } catch (const std::exception&) {
    return -1;
  }
  bool refused = false;
  int fd = connectOnce(host, port, wait, &refused, &last);
  if (fd >= 0) {
    setNonBlocking(fd, false);
    *fd_out = fd;
    return 1;
  }
  return refused ? 0 : -1;
}

}  // namespace xirang::transport
