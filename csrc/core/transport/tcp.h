// TCP transport: one listener per process group, connections made lazily, authenticated, and
// a poll()-driven exchange that moves framed segments to and from several peers at once.
//
// Connections are directional: rank A sends to B on the connection A opened to B's listener
// and receives from B on the connection B opened to A. That makes lazy connection set-up free of
// deadlock (nobody waits for a peer to accept before it can itself accept) and lets one poll
// loop send to the ring's next rank while receiving from the previous one.
//
// The transport knows frames and peers, nothing of reductions: the ring schedule and the codec
// run in the callbacks collectives.cc passes to exchange().
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/transport/auth.h"
#include "core/transport/frame.h"

namespace xirang::transport {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// The slice of c10d::Store the transport uses (the backend adapts torch's store to it).
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` exists, at most until `deadline`; throws std::runtime_error after it.
  virtual std::string get(const std::string& key, Deadline deadline) = 0;
  // Whether `key` exists now (no waiting). Throws if the store cannot be reached.
  virtual bool check(const std::string& key) { (void)key; return false; }
  // Atomically adds `delta` to the integer at `key` (missing: 0) and returns the new value.
  // Elastic mode only (heartbeats); the default throws.
  virtual int64_t add(const std::string& key, int64_t delta) {
    (void)key, (void)delta;
    throw std::runtime_error("this store does not support add");
  }
  // c10d's compareSet: sets `key` to `desired` if its value is `expected` ("" = missing) and
  // returns the value the key holds afterwards. Elastic mode only (the epoch decision).
  virtual std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) {
    (void)key, (void)expected, (void)desired;
    throw std::runtime_error("this store does not support compareSet");
  }
};

// Base of every transport failure. `peer` is the rank involved (-1 if none).
class TransportError : public std::runtime_error {
 public:
  TransportError(const std::string& msg, int peer) : std::runtime_error(msg), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};
class TimeoutError : public TransportError {
 public:
  using TransportError::TransportError;
};
// Ranks disagree about the operation (a frame's header differs from the expected one): a bug in
// the calling program, not a failure of the peer.
class MismatchError : public TransportError {
 public:
  using TransportError::TransportError;
};

// One frame's payload: a contiguous byte range.
struct SendSeg {
  const void* data;
  uint64_t bytes;
};
struct RecvSeg {
  void* data;
  uint64_t bytes;
};

// All segments to one peer, sent in order; each segment is one frame whose header is `header`
// with payload_bytes = segment bytes. An empty list still sends one empty frame, so a peer that
// disagrees about the sizes learns it at once.
struct SendJob {
  int peer;
  FrameHeader header;
  std::vector<SendSeg> segs;
};
// All segments from one peer, received in order into the given buffers; each received header
// must equal `expect` (payload_bytes = segment bytes). `on_segment(i)` runs on the exchanging
// thread as soon as segment i is in memory (e.g. to reduce it while later ones are in flight),
// and returns before any byte of segment i+1 is read: segments may share one buffer.
struct RecvJob {
  int peer;
  FrameHeader expect;
  std::vector<RecvSeg> segs;
  std::function<void(size_t)> on_segment;
};

// Per peer and direction, what one exchange() did: seconds from its start until that peer's
// last frame was fully sent / received, and the payload bytes moved.
struct PeerTiming {
  int peer;
  bool send;  // true: our sends to peer; false: our receives from peer
  double seconds;
  uint64_t bytes;
};

struct TcpOptions {
  std::string ifname;                                  // XIRANG_SOCKET_IFNAME
  std::chrono::milliseconds handshake_timeout{10000};  // per connection
  std::string key_prefix = "xirang";                   // store key namespace
  // Elastic mode's later epochs: the group secret is derived, not exchanged (deriveKey), and
  // only the epoch's live ranks may connect (empty = every rank of the group).
  std::optional<Key128> key;
  std::vector<int> members;
};

class Tcp {
 public:
  // Creates the listener on the chosen interface, publishes "<prefix>/addr/<rank>" and (rank 0)
  // the group secret to the store. With size == 1 no socket is opened.
  // Throws TransportError when no address can be bound or the store times out.
  Tcp(int rank, int size, std::shared_ptr<Store> store, TcpOptions opts, Deadline deadline);
  ~Tcp();
  Tcp(const Tcp&) = delete;
  Tcp& operator=(const Tcp&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Key128& key() const { return key_; }
  // "ip:port" this rank listens on ("" for size 1).
  const std::string& address() const { return address_; }

  // Runs all jobs concurrently until every one is done. Throws TransportError (peer closed,
  // reset, bad header, abort frame from a peer, a header mismatch naming both values) or
  // TimeoutError after `deadline`. After a throw the connections involved are unusable: the
  // caller is expected to abort().
  // If `timings` is given, one PeerTiming per peer and direction is appended to it.
  void exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                std::vector<PeerTiming>* timings = nullptr);

  // Makes sure the connection to `peer` exists (connecting if needed) and that `peer`'s
  // connection to us has been accepted; bounded by `deadline`.
  void connectPeer(int peer, Deadline deadline);

  // recv from any source: blocks until some peer has a point-to-point frame (op Send) waiting
  // on its connection to us and returns that peer's rank. Throws TimeoutError after `deadline`.
  // Messages already stashed (see Stashed) with the tag count as waiting.
  int waitAnySource(Deadline deadline, uint32_t tag);

  // Best effort: sends an Abort frame carrying `why` on every open connection (both
  // directions), then closes every socket. Idempotent; never throws.
  void abort(const std::string& why);
  // Closes everything and joins the accept thread. Idempotent.
  void close();
  // Callable from any thread: marks the transport closed with `why` and shuts every socket
  // down (without closing the fds another thread may be polling), so a running exchange,
  // connect or waitAnySource throws TransportError at once and peers see the connections end.
  // The owner still calls close(). Elastic mode uses it when the membership changes.
  void interrupt(const std::string& why);

  // Payload bytes sent since creation (headers excluded) and header bytes, for the stats.
  uint64_t payloadBytesSent() const { return payload_sent_.load(); }

 private:
  int outgoing(int peer, Deadline deadline);  // fd we send on
  int incoming(int peer, Deadline deadline);  // fd we receive on
  int tryIncoming(int peer);                  // the same, or -1 if not connected yet
  // Throws the abort another rank left in the store (abort() writes "<prefix>/abort"), if any:
  // how a rank waiting for a peer that will never connect learns the group is gone.
  void checkStoreAbort(int peer);
  void acceptLoop();
  void finishAccept(int fd);
  bool serverHandshake(int fd, int* peer_out, std::string* why);
  int clientConnect(int peer, Deadline deadline);

  const int rank_;
  const int size_;
  std::shared_ptr<Store> store_;
  TcpOptions opts_;
  Key128 key_{};
  std::string address_;
  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  std::thread accept_thread_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, int> out_fds_;  // peer -> fd
  std::map<int, int> in_fds_;   // peer -> fd
  std::vector<int> dead_fds_;   // closed at close()
  std::set<int> pending_fds_;   // accepted, handshake in progress
  std::vector<std::thread> handshake_threads_;
  bool closed_ = false;
  std::string abort_reason_;
  std::atomic<uint64_t> payload_sent_{0};

 public:
  // Point-to-point messages that arrived ahead of the receive they belong to (a different tag
  // was expected). Only the exchanging thread touches it. Bounded by kMaxStashBytes.
  struct Stashed {
    FrameHeader header;
    std::vector<uint8_t> payload;
  };
  static constexpr uint64_t kMaxStashBytes = 1ULL << 30;

 private:
  std::map<int, std::vector<Stashed>> stash_;
  uint64_t stash_bytes_ = 0;
};

// Resolves the address to listen on: XIRANG_SOCKET_IFNAME's first IPv4 (else IPv6) address,
// else every getaddrinfo result of the hostname in turn (the first that binds), else loopback.
// Returns the bound, listening fd and sets `address` to "ip:port" ("[ip]:port" for IPv6).
int listenOnInterface(const std::string& ifname, std::string* address);

// Opens a TCP connection to "ip:port" / "[ip]:port", trying every getaddrinfo result, before
// `deadline`. Returns a connected blocking fd or throws TransportError.
// `between_tries` (optional) runs before each retry and may throw to give up early.
int connectTo(const std::string& address, Deadline deadline, int peer,
              const std::function<void()>& between_tries = nullptr);

}  // namespace xirang::transport
