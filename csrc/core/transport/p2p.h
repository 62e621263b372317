// Point-to-point messages (send / recv / recv from any source) of one TCP transport, on
// connections of their own (Channel::P2P), progressed by one thread independently of the
// collectives and of the order in which the caller issued them: a send and a receive with the
// same peer, or sends and receives with different peers, all move at once (gloo's semantics), so
// `irecv(peer); send(peer)`, rings of isend/irecv and batch_isend_irecv of any size and order
// complete.
//
// Matching (MPI's rules): a message matches the earliest posted receive whose source is its
// sender (or any source) and whose tag is its tag; messages from one sender with the same tag
// arrive in the order they were sent. A message that arrives before its receive is posted is
// queued, its memory growing with the bytes that arrive (never allocated from a length a peer
// claims). The queue is bounded (Limits): when it is full, a connection whose next message
// matches no posted receive is not read further until a receive is posted or the queue drains
// (the sender's send waits in the kernel); a receive that cannot be satisfied meanwhile fails at
// its deadline saying so.
//
// Failures: a peer that closes its connection fails the receives waiting for it (a receive from
// any source fails only once no live peer could still send); messages it delivered before
// closing are still received. An abort frame, a malformed frame or a header that disagrees with
// its receive (dtype, element count) fails that receive naming both values. Everything pending
// fails when the transport closes.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/transport/errors.h"
#include "core/transport/frame.h"

namespace xirang::transport {

// What the engine needs of its transport.
class P2PLinks {
 public:
  virtual ~P2PLinks() = default;
  // Opens and authenticates this rank's point-to-point connection to `peer` (blocking; called on
  // a connector thread). Returns a blocking fd or throws TransportError.
  virtual int connectP2P(int peer, Deadline deadline) = 0;
  // "" while `peer` may still send to us, else why it cannot (it left the group or exited, the
  // group was aborted). Cheap enough to call every few hundred milliseconds.
  virtual std::string peerGone(int peer) = 0;
  // Payload bytes written to the network, for the transport's counters.
  virtual void countSent(uint64_t bytes) = 0;
};

class P2P {
 public:
  // error: null on success. source: the sender of a received message (the peer for a send).
  using Done = std::function<void(std::exception_ptr error, int source)>;
  struct Limits {
    uint64_t max_queued_bytes = 1ULL << 30;     // payload of messages waiting for their receives
    uint64_t max_queued_messages = 1ULL << 17;  // their number (empty messages count too)
  };
  struct Counters {
    uint64_t queued_messages = 0, queued_bytes = 0, bytes_sent = 0, bytes_received = 0;
  };

  P2P(int rank, int size, P2PLinks& links, Limits limits);
  ~P2P();  // stop("transport closed")
  P2P(const P2P&) = delete;
  P2P& operator=(const P2P&) = delete;

  // Queues a message to `peer`: header `h` (op Send, tag, dtype, op_numel; payload_bytes is set
  // here) and `bytes` at `data`, which must stay valid until `done` runs (on the engine's thread,
  // once). Sends to one peer go out in order.
  void send(int peer, FrameHeader h, const void* data, uint64_t bytes, Deadline deadline, Done done);
  // Posts a receive of a message from `peer` (-1: any source) whose header must equal `expect`
  // (tag, dtype, op_numel) and whose payload is `bytes` long, into `data` (valid until done).
  void recv(int peer, FrameHeader expect, void* data, uint64_t bytes, Deadline deadline, Done done);

  // An authenticated point-to-point connection `peer` opened to us (the acceptor's thread).
  void addIncoming(int peer, int fd);
  // Fails everything pending and everything posted later with TransportError(why), without
  // waiting: the thread fails what is pending and ends. Callable from any thread. Idempotent.
  void shutdown(const std::string& why);
  // shutdown(why), then joins the thread and the connectors. Does not close the fds (the
  // transport owns them).
  void stop(const std::string& why);
  Counters counters();

 private:
  struct SendOp {
    FrameHeader h;
    const uint8_t* data;
    uint64_t bytes;
    Deadline deadline;
    Done done;
  };
  struct RecvOp {
    int peer;
    FrameHeader expect;
    uint8_t* data;
    uint64_t bytes;
    Deadline deadline;
    Done done;
  };
  struct Msg {  // a message that arrived before its receive
    int peer;
    FrameHeader h;
    std::vector<uint8_t> payload;
  };
  struct In {
    int fd = -1;
    std::string closed;  // why this peer can send no more ("" while it can)
    uint8_t hdr[kHeaderBytes];
    size_t hdr_off = 0;
    bool have_hdr = false;
    FrameHeader h;
    enum Mode { Header, IntoRecv, IntoQueue, Parked } mode = Header;
    std::shared_ptr<RecvOp> target;  // IntoRecv
    Msg msg;                         // IntoQueue
    uint64_t off = 0;
  };
  struct Out {
    int fd = -1;
    bool connecting = false;
    std::thread connector;
    bool connector_done = false;
    int connected_fd = -1;
    std::exception_ptr connect_error;
    std::string closed;  // why nothing more can be sent ("" while we can)
    std::deque<SendOp> q;
    uint8_t hdr[kHeaderBytes];
    size_t hdr_off = 0;
    uint64_t pay_off = 0;
    bool started = false;  // the head's header is being written
    uint8_t back[kHeaderBytes];  // what the peer sent on this send-only connection (an abort)
    size_t back_off = 0;
  };
  struct Completion {
    Done done;
    std::exception_ptr error;
    int source;
  };

  void loop();
  void wake();
  // Under mu_. Each appends to done_ what completed; none blocks.
  void pumpIn(int peer);
  // Whether recv() on in_[peer] got r > 0 bytes; else in_[peer] failed (r == 0: who(peer) +
  // `closed`; an error other than "nothing yet") or there is nothing to read now.
  bool received(int peer, ssize_t r, const char* closed);
  void pumpOut(int peer);
  void onHeader(int peer);           // a whole header has arrived on in_[peer]
  void decide(int peer);             // where in_[peer]'s message goes: a receive, the queue, or wait
  void finishMessage(int peer);      // in_[peer]'s payload is complete
  bool deliverQueued(const std::shared_ptr<RecvOp>& op);  // from the queue, if a message matches
  void matchNew();                   // the queue's newest message against the posted receives
  void dropQueued(std::deque<Msg>::iterator it);
  void reconsiderParked();
  void failRecv(const std::shared_ptr<RecvOp>& op, const std::exception_ptr& e);
  void failPeerIn(int peer, const std::string& why);
  void failPeerOut(int peer, const std::exception_ptr& e, const std::string& closed_why);
  void failAll(const std::string& why);
  void failAnySourceIfNobodyLeft();
  void checkDeadlines();
  std::vector<int> livenessToCheck();
  bool pumpBack(int peer);           // the back channel of out_[peer]; false when it failed
  bool anyLivePeer();
  std::string mismatch(const FrameHeader& expect, uint64_t bytes, const FrameHeader& got, int peer) const;

  const int rank_;
  const int size_;
  P2PLinks& links_;
  const Limits limits_;

  std::mutex mu_;
  int wake_fd_ = -1;
  std::thread thread_;
  bool stopping_ = false;
  std::string failed_;  // set once everything fails (stop, abort frame)
  std::map<int, In> in_;
  std::map<int, Out> out_;
  std::list<std::shared_ptr<RecvOp>> posted_;  // not yet matched, in post order
  std::deque<Msg> queue_;                      // arrived before their receives, in arrival order
  uint64_t queued_bytes_ = 0;                  // includes messages being read into the queue
  uint64_t queued_msgs_ = 0;
  std::vector<Completion> done_;
  std::vector<int> kick_;  // in-connections to pump next round whatever poll says (unparked)
  bool reconsider_parked_ = false;
  Clock::time_point last_liveness_{};
  std::map<int, std::string> gone_;  // peerGone() results seen
  Counters counters_;
};

}  // namespace xirang::transport
