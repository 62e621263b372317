// The listener of one TCP transport: accepts connections and runs the server side of the
// handshake (auth.h) for all of them on one thread, as a non-blocking state machine per
// connection. A connection costs a few hundred bytes while its handshake is pending, never a
// thread, so a stranger flooding the port (connect + reset, or connect and stay silent) cannot
// exhaust threads, mappings or memory; the members' handshakes go on beside it.
//
// Bounds: a handshake that has not finished within `handshake_timeout` is dropped; at most
// kMaxPending handshakes are pending at once (the oldest is dropped to admit a new one: a member
// finishes its handshake in a round trip, a stranger holding connections open is what gets
// dropped). Rejections are logged once, then summarised at most every 10 s, so a flood does not
// flood the log.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/transport/auth.h"
#include "core/transport/errors.h"

namespace xirang::transport {

class Acceptor {
 public:
  static constexpr size_t kMaxPending = 512;

  struct Config {
    int rank = 0;
    int size = 1;
    Key128 key{};
    uint64_t group_id = 0;
    std::chrono::milliseconds handshake_timeout{10000};
    std::vector<int> members;  // ranks allowed to connect; empty: every rank of the group
  };
  // Called on the acceptor's thread for each authenticated connection (non-blocking fd).
  // Returns "" when it took the fd, else why the connection is refused (the acceptor closes it).
  using OnPeer = std::function<std::string(Channel channel, int peer, int fd)>;

  // Takes ownership of `listen_fd` (closed by stop()). Starts the thread.
  Acceptor(int listen_fd, Config cfg, OnPeer on_peer);
  ~Acceptor();
  Acceptor(const Acceptor&) = delete;
  Acceptor& operator=(const Acceptor&) = delete;

  // Stops the thread, closes the pending connections and the listener. Idempotent.
  void stop();

  // For tests and stats: handshakes pending now, connections rejected so far, probes answered.
  size_t pending() const { return pending_count_.load(); }
  uint64_t rejected() const { return rejected_.load(); }
  uint64_t probes() const { return probes_.load(); }

 private:
  struct Pending;
  void loop();
  // Advances one handshake on readiness; returns true when it is over (accepted or rejected).
  bool advance(Pending& p);
  void reject(Pending& p, const std::string& why);
  void noteRejection(const std::string& why);

  int listen_fd_;
  int wake_[2] = {-1, -1};
  Config cfg_;
  OnPeer on_peer_;
  std::thread thread_;
  std::atomic<size_t> pending_count_{0};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> probes_{0};
  // Log rate limit (the acceptor's thread only).
  Clock::time_point last_log_{};
  uint64_t unlogged_ = 0;
  std::string last_why_;
};

}  // namespace xirang::transport
