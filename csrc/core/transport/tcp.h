// TCP transport: one listener per process group, connections made lazily and authenticated
// (auth.h, acceptor.h), a poll()-driven exchange that moves the collectives' framed segments to
// and from several peers at once, and point-to-point messages on connections of their own
// (p2p.h).
//
// Connections are directional: rank A sends to B on the connection A opened to B's listener
// and receives from B on the connection B opened to A. That makes lazy connection set-up free of
// deadlock (nobody waits for a peer to accept before it can itself accept) and lets one poll
// loop send to the ring's next rank while receiving from the previous one. Each pair of ranks
// has such connections per channel: the collectives' (ordered by the op sequence number) and the
// point-to-point messages' (matched by tag, independent of the collectives' order).
//
// The transport knows frames and peers, nothing of reductions: the ring schedule and the codec
// run in the callbacks collectives.cc passes to exchange().
//
// Store keys (under TcpOptions::key_prefix): addr/<rank> (where a rank listens), group_id (a
// random id binding the handshake MACs to this group), secret (the group key, unless
// XIRANG_AUTH_KEY_FILE provides it), abort (the first failure, for ranks not connected yet),
// exit/<rank> (a rank that left the group cleanly).
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

#include "core/store.h"
#include "core/transport/acceptor.h"
#include "core/transport/auth.h"
#include "core/transport/errors.h"
#include "core/transport/frame.h"
#include "core/transport/p2p.h"
#include "core/transport/socket.h"
#include "core/transport/transport.h"

namespace xirang::transport {

struct TcpOptions {
  std::string ifname;                                  // XIRANG_SOCKET_IFNAME
  std::chrono::milliseconds handshake_timeout{10000};  // per connection
  std::string key_prefix = "xirang";                   // store key namespace
  // The group key. Unset: rank 0 draws a random one and writes it to the store (the store is
  // the trust root); XIRANG_AUTH_KEY_FILE's key, or elastic mode's derived epoch key, is passed
  // here and nothing secret is written to the store.
  std::optional<Key128> key;
  // The group id the handshake MACs bind (not secret). Unset: rank 0 draws one and writes it to
  // the store under key_prefix; elastic epochs pass the one derived from the first epoch's.
  std::optional<uint64_t> group_id;
  // Only these ranks may connect (empty = every rank of the group): elastic mode's live ranks.
  std::vector<int> members;
  P2P::Limits p2p_limits;
};

class Tcp : public Link, public P2PLinks {
 public:
  // Creates the listener on the chosen interface, publishes "<prefix>/addr/<rank>" and (rank 0)
  // the group id and, without opts.key, the group secret to the store. With size == 1 no socket
  // is opened. Throws TransportError when no address can be bound or the store times out.
  Tcp(int rank, int size, std::shared_ptr<Store> store, TcpOptions opts, Deadline deadline);
  ~Tcp() override;
  Tcp(const Tcp&) = delete;
  Tcp& operator=(const Tcp&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const Key128& key() const { return key_; }
  uint64_t groupId() const { return group_id_; }
  // "ip:port" this rank listens on ("" for size 1).
  const std::string& address() const { return address_; }

  // Runs all jobs concurrently until every one is done. Throws TransportError (peer closed,
  // reset, bad header, abort frame from a peer, a header mismatch naming both values, a peer
  // that left before it ever connected: see peerGone) or TimeoutError after `deadline`. After a
  // throw the connections involved are unusable: the caller is expected to abort().
  // If `timings` is given, one PeerTiming per peer and direction is appended to it.
  void exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                std::vector<PeerTiming>* timings = nullptr) override;

  // Makes sure the collective connection to `peer` exists (connecting if needed) and that
  // `peer`'s connection to us has been accepted; bounded by `deadline`.
  void connectPeer(int peer, Deadline deadline);

  // Point-to-point messages (send, recv, recv from any source): made on first use, or when a
  // peer first connects its point-to-point channel to us. Throws TransportError once closed.
  P2P& p2p();

  // "" while `peer` may still take part, else why it cannot: the group was aborted, the peer
  // left cleanly (its exit record), closed our connection to it, or its listener is gone (a
  // refused probe: the process exited or was killed). Probes a peer at most every 500 ms.
  std::string peerGone(int peer) override;

  // Best effort: sends an Abort frame carrying `why` on every open connection (both
  // directions, every channel) and records it in the store, then closes every socket.
  // Idempotent; never throws.
  void abort(const std::string& why) override;
  // Records in the store that this rank leaves the group cleanly (destroy_process_group), so a
  // peer waiting for our connection fails now instead of at its timeout. Skipped when every other
  // rank is gone already: it closed a connection with this one, or `known_gone(rank)` says so
  // (the shared-memory domain's process watch). Then nobody waits, and the store may have gone
  // with the rank that hosted it (torch's TCPStore prints such a failure with a backtrace).
  // Once per transport: later calls return at once. Never throws.
  void leave(const std::function<bool(int)>& known_gone = {});
  // Closes everything and joins the transport's threads. Idempotent.
  void close();
  // Callable from any thread: marks the transport closed with `why` and shuts every socket
  // down (without closing the fds another thread may be polling), so a running exchange,
  // connect or point-to-point operation fails with TransportError at once and peers see the
  // connections end. The owner still calls close(). Elastic mode uses it when the membership
  // changes.
  void interrupt(const std::string& why) override;

  // Payload bytes sent since creation (headers excluded), collectives and point-to-point.
  uint64_t payloadBytesSent() const override { return payload_sent_.load(); }
  // Connections rejected by the listener so far (strangers, failed handshakes, duplicates).
  uint64_t rejectedConnections() const { return acceptor_ ? acceptor_->rejected() : 0; }
  size_t pendingHandshakes() const { return acceptor_ ? acceptor_->pending() : 0; }

  // P2PLinks
  int connectP2P(int peer, Deadline deadline) override { return clientConnect(peer, deadline, Channel::P2P); }
  void countSent(uint64_t bytes) override { payload_sent_ += bytes; }

 private:
  class Exchange;  // one exchange()'s pump (tcp_exchange.cc)
  friend class Exchange;
  int outgoing(int peer, Deadline deadline);  // collective fd we send on
  int incoming(int peer, Deadline deadline);  // collective fd we receive on
  int tryIncoming(int peer);                  // the same, or -1 if not connected yet
  // Throws the abort another rank left in the store (abort() writes "<prefix>/abort"), if any:
  // how a rank waiting for a peer that will never connect learns the group is gone.
  void checkStoreAbort(int peer);
  // Throws TransportError when peerGone(peer) says so.
  void checkPeer(int peer);
  // Whether every other rank closed a connection with this one (a peek sees EOF) or is
  // `known_gone`.
  bool everyPeerGone(const std::function<bool(int)>& known_gone);
  // Called by the acceptor for each authenticated connection.
  std::string onPeer(Channel channel, int peer, int fd);
  int clientConnect(int peer, Deadline deadline, Channel channel);

  const int rank_;
  const int size_;
  std::shared_ptr<Store> store_;
  TcpOptions opts_;
  Key128 key_{};
  uint64_t group_id_ = 0;
  std::string address_;
  std::unique_ptr<Acceptor> acceptor_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, int> out_fds_;      // peer -> fd, collective channel
  std::map<int, int> in_fds_;
  std::map<int, int> p2p_out_fds_;  // peer -> fd, point-to-point channel (the engine's)
  std::map<int, int> p2p_in_fds_;
  std::vector<int> dead_fds_;       // replaced, closed at close()
  std::unique_ptr<P2P> p2p_;
  bool closed_ = false;
  bool left_ = false;  // leave() ran
  std::string abort_reason_;
  std::atomic<uint64_t> payload_sent_{0};
  std::map<int, Clock::time_point> last_probe_;  // peerGone's rate limit
  std::map<int, std::string> gone_;              // what peerGone found (it does not change)
};

}  // namespace xirang::transport
