#include "core/transport/acceptor.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <memory>

#include "core/env.h"
#include "core/transport/frame.h"
#include "core/transport/socket.h"

namespace xirang::transport {

namespace {
constexpr auto kLogEvery = std::chrono::seconds(10);
}

// One connection's server handshake: read the hello, write nonce + MAC, read the client's MAC.
struct Acceptor::Pending {
  int fd = -1;
  Deadline deadline;
  enum Stage { ReadHello, WriteReply, ReadMac } stage = ReadHello;
  uint8_t buf[kHelloBytes] = {0};
  size_t off = 0;
  Hello hello;
  uint64_t snonce = 0;
  uint8_t reply[16] = {0};
};

Acceptor::Acceptor(int listen_fd, Config cfg, OnPeer on_peer)
    : listen_fd_(listen_fd), cfg_(std::move(cfg)), on_peer_(std::move(on_peer)) {
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(listen_fd_);
    throw TransportError("xirang: pipe failed: " + errnoStr(errno), -1);
  }
  setNonBlocking(listen_fd_, true);
  thread_ = std::thread([this] { loop(); });
}

Acceptor::~Acceptor() { stop(); }

void Acceptor::stop() {
  if (thread_.joinable()) {
    char c = 0;
    (void)!::write(wake_[1], &c, 1);
    thread_.join();
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  for (int& p : wake_) {
    if (p >= 0) ::close(p);
    p = -1;
  }
}

void Acceptor::noteRejection(const std::string& why) {
  rejected_++;
  const auto now = Clock::now();
  if (last_log_ == Clock::time_point{} || now - last_log_ >= kLogEvery) {
    std::string msg = "rejected a connection: " + why;
    if (unlogged_ > 0)
      msg += " (and " + std::to_string(unlogged_) + " more since the last such line, the last one: " + last_why_ + ")";
    env::log(env::Level::Warn, cfg_.rank, msg);
    last_log_ = now;
    unlogged_ = 0;
  } else {
    unlogged_++;
    last_why_ = why;
  }
}

void Acceptor::reject(Pending& p, const std::string& why) {
  if (p.fd >= 0) ::close(p.fd);
  p.fd = -1;
  if (!why.empty()) noteRejection(why);
}

bool Acceptor::advance(Pending& p) {
  while (true) {
    if (p.stage == Pending::ReadHello || p.stage == Pending::ReadMac) {
      uint8_t* dst = p.stage == Pending::ReadHello ? p.buf : p.buf;  // the MAC reuses buf[0..8)
      const size_t want = p.stage == Pending::ReadHello ? kHelloBytes : 8;
      ssize_t r = ::recv(p.fd, dst + p.off, want - p.off, 0);
      if (r == 0) {
        reject(p, "connection closed during the handshake");
        return true;
      }
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
        reject(p, "handshake: " + errnoStr(errno));
        return true;
      }
      p.off += static_cast<size_t>(r);
      if (p.off < want) continue;
      p.off = 0;
      if (p.stage == Pending::ReadHello) {
        std::string why = parseHello(p.buf, kWireVersion, &p.hello);
        if (!why.empty()) {
          reject(p, why);
          return true;
        }
        if (p.hello.channel == Channel::Probe) {  // "is this listener alive?": yes, and goodbye
          probes_++;
          reject(p, "");
          return true;
        }
        const int peer = p.hello.rank;
        if (peer < 0 || peer >= cfg_.size || peer == cfg_.rank) {
          reject(p, "peer claims invalid rank " + std::to_string(peer));
          return true;
        }
        if (!cfg_.members.empty() && std::find(cfg_.members.begin(), cfg_.members.end(), peer) == cfg_.members.end()) {
          reject(p, "rank " + std::to_string(peer) + " is not a live member of this epoch (it was declared dead)");
          return true;
        }
        p.snonce = randomU64();
        const uint64_t mac = serverMac(cfg_.key, cfg_.group_id, p.hello.channel, p.hello.nonce, p.snonce, cfg_.rank, peer);
        std::memcpy(p.reply, &p.snonce, 8);
        std::memcpy(p.reply + 8, &mac, 8);
        p.stage = Pending::WriteReply;
        continue;
      }
      // The client's MAC.
      uint64_t cmac;
      std::memcpy(&cmac, p.buf, 8);
      const int peer = p.hello.rank;
      if (cmac != clientMac(cfg_.key, cfg_.group_id, p.hello.channel, p.snonce, p.hello.nonce, peer, cfg_.rank)) {
        reject(p, "peer claiming rank " + std::to_string(peer) + " failed authentication (not in this group)");
        return true;
      }
      std::string why = on_peer_(p.hello.channel, peer, p.fd);
      if (!why.empty()) {
        reject(p, why);
      } else {
        p.fd = -1;  // handed over
      }
      return true;
    }
    // WriteReply
    ssize_t w = ::send(p.fd, p.reply + p.off, sizeof(p.reply) - p.off, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      reject(p, "handshake: " + errnoStr(errno));
      return true;
    }
    p.off += static_cast<size_t>(w);
    if (p.off < sizeof(p.reply)) return false;
    p.off = 0;
    p.stage = Pending::ReadMac;
  }
}

void Acceptor::loop() {
  std::deque<std::unique_ptr<Pending>> pending;  // oldest first
  std::vector<pollfd> pfds;
  Clock::time_point listen_paused_until{};
  auto dropOldest = [&](const std::string& why) {
    if (pending.empty()) return false;
    reject(*pending.front(), why);
    pending.pop_front();
    return true;
  };
  while (true) {
    pending_count_.store(pending.size());
    const auto now = Clock::now();
    pfds.clear();
    pfds.push_back({wake_[0], POLLIN, 0});
    const bool listening = now >= listen_paused_until;
    pfds.push_back({listening ? listen_fd_ : -1, POLLIN, 0});
    int timeout = -1;
    for (auto& p : pending) {
      pfds.push_back({p->fd, static_cast<short>(p->stage == Pending::WriteReply ? POLLOUT : POLLIN), 0});
      const int t = msUntil(p->deadline);
      timeout = timeout < 0 ? t : std::min(timeout, t);
    }
    if (!listening) {
      const int t = msUntil(listen_paused_until);
      timeout = timeout < 0 ? t : std::min(timeout, t);
    }
    int r = ::poll(pfds.data(), pfds.size(), timeout);
    if (r < 0 && errno != EINTR) {
      env::log(env::Level::Warn, cfg_.rank, "listener poll failed: " + errnoStr(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (r > 0 && pfds[0].revents) break;  // stop()
    // Handshakes first (they were pending before the new ones), then expiries, then accepts.
    if (r > 0) {
      std::vector<bool> done(pending.size(), false);
      for (size_t i = 0; i < pending.size(); ++i) {
        if (pfds[i + 2].revents == 0) continue;
        done[i] = advance(*pending[i]);
      }
      std::deque<std::unique_ptr<Pending>> keep;
      for (size_t i = 0; i < pending.size(); ++i)
        if (!done[i]) keep.push_back(std::move(pending[i]));
      pending.swap(keep);
    }
    const auto t = Clock::now();
    while (!pending.empty()) {
      auto it = std::find_if(pending.begin(), pending.end(), [&](const auto& p) { return t >= p->deadline; });
      if (it == pending.end()) break;
      reject(**it, "handshake timed out (XIRANG_HANDSHAKE_TIMEOUT_MS=" + std::to_string(cfg_.handshake_timeout.count()) +
                       ")");
      pending.erase(it);
    }
    if (r > 0 && listening && (pfds[1].revents & POLLIN)) {
      // Accept what is queued now (bounded per round so handshakes keep moving).
      for (int k = 0; k < 64; ++k) {
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            // Out of descriptors: drop the oldest pending handshake, or pause accepting a moment
            // (the listen fd stays readable, so polling it now would spin).
            if (!dropOldest("out of file descriptors (" + errnoStr(errno) + ")")) {
              noteRejection("accept: " + errnoStr(errno));
              listen_paused_until = Clock::now() + std::chrono::milliseconds(100);
            }
          }
          break;
        }
        tuneSocket(fd);
        if (pending.size() >= kMaxPending) dropOldest("more than " + std::to_string(kMaxPending) + " handshakes pending");
        auto p = std::make_unique<Pending>();
        p->fd = fd;
        p->deadline = Clock::now() + cfg_.handshake_timeout;
        pending.push_back(std::move(p));
      }
    }
  }
  for (auto& p : pending) reject(*p, "");
  pending_count_.store(0);
  if (unlogged_ > 0)
    env::log(env::Level::Warn, cfg_.rank,
             "rejected " + std::to_string(unlogged_) + " more connections since the last such line (the last one: " +
                 last_why_ + ")");
}

}  // namespace xirang::transport
