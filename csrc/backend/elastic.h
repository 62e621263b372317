// The group's membership: the ranks that take part, the ring over them and the transport that
// connects them, one epoch at a time. A group that is not elastic has one epoch for its life.
//
// Elastic mode (XIRANG_ELASTIC, Options(elastic=True)): a heartbeat thread advances this rank's
// counter in the store and watches its ring neighbours'; when a rank is lost (its heartbeat goes
// silent, or an operation's transport fails) the survivors agree through the store on the next
// epoch's live ranks and on which operations in flight completed (core/membership.h), and every
// survivor rebuilds the transport and the ring without it. Spares (XIRANG_JOIN) take dead ranks'
// places at a step boundary (admit()). Operations whose result is void raise MembershipChanged.
//
// Membership owns its state and knows nothing of the op queue: the communication thread calls
// run() for every operation, and the callbacks it is handed record the group's first error and
// wake that thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/config.h"
#include "core/collectives.h"
#include "core/membership.h"
#include "core/transport/shm.h"
#include "core/transport/tcp.h"

namespace xirang {

// Raised (Python: xirang.MembershipChanged, a RuntimeError) by every operation that was in
// flight when an elastic group lost a rank: its result is void on every survivor.
class MembershipChanged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What an elastic group's membership is now (ProcessGroupXirang::membership()).
struct MembershipInfo {
  uint64_t epoch = 0;
  std::vector<int> live;         // group ranks, ascending
  std::vector<int> ring;         // live ranks in ring order
  uint64_t recoveries = 0;
  double last_recovery_s = 0;    // failure noticed -> new ring ready, seconds
  double last_agreement_s = 0;   // of which the agreement through the store
  std::string last_failure;      // the reason recorded for the last change
  int source = -1;               // after spares joined: the rank to copy training state from
};

// An operation's body, on the communication thread.
using OpFn = std::function<void(OpCtx&)>;
// Elastic mode: snapshots an operation's inputs and returns their restore; an operation that has
// one is retried on the new ring instead of raising MembershipChanged (the hook's op).
using SaveFn = std::function<std::function<void()>()>;

class Membership {
 public:
  struct Callbacks {
    std::function<void(const std::string&)> poison;  // records the group's first error
    std::function<void()> wake;                      // wakes the communication thread
  };

  // Reads the transport's knobs (XIRANG_SOCKET_IFNAME, XIRANG_HANDSHAKE_TIMEOUT_MS,
  // XIRANG_AUTH_KEY_FILE, XIRANG_TRANSPORT_LOCAL) and, unless this process is a spare
  // (cfg.join), opens the first epoch's transport: TCP, and the shared-memory domain of this
  // rank's same-host ranks (see makeShm). `comm`: the algorithms' configuration (ring order, sizes, two-level
  // plan). Throws c10::Error naming the rank and the group.
  Membership(int rank, int size, const XirangConfig& cfg, std::shared_ptr<transport::Store> store,
             std::string key_ns, Comm comm, Callbacks cb);
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Elastic mode: registers this rank's heartbeat, waits to be admitted (a spare), starts the
  // heartbeat thread. Returns the sequence number of the group's last operation before this
  // rank's first (a spare starts after the admission op; otherwise 0). Throws c10::Error.
  uint64_t start();
  // Stops the heartbeat thread; close() then leaves the group and closes the transport.
  void stop();
  void close();
  // A poisoned rank stops its heartbeat, so that an elastic group's survivors drop it.
  void stopHeartbeat();

  // The algorithms' view (communication thread only).
  Comm& comm() { return comm_; }
  std::string address() const;
  // Any thread: "" while group rank `peer` may still take part, else why not (the TCP transport's
  // peerGone: its connection closed, its exit note, a refused probe, or the group's abort note).
  std::string peerGone(int peer) const;
  // Fails every connection: abort frames to the peers, the store's abort note, the abort word
  // of the shared-memory domain (its waiters in every local process wake up and throw).
  void abort(const std::string& why);
  // The group ranks the current shared-memory domain holds (ascending; empty: none, every
  // byte goes over TCP).
  std::vector<int> shmRanks() const;

  // Whether a failure was reported and this rank has not joined the agreement yet; clearSignal()
  // drops it (a poisoned rank takes no part).
  bool signalled() const { return signal_.load(); }
  void clearSignal() { signal_ = false; }
  // The caller issued collective number `seq`.
  void issued(uint64_t seq) { issued_seq_.store(seq); }

  // Whether elastic mode applies (elastic and more than one rank): operations go through run().
  bool active() const { return cfg_.elastic && size_ > 1; }
  // Runs one operation in elastic mode (communication thread): `fn` under a deadline of
  // `timeout` from now, then the completion round; on a lost rank the recovery and either the
  // retry (with `save`) or MembershipChanged. name: the op's name; what: its description
  // ("all_reduce (op #3, ...)").
  void run(OpCtx& ctx, const OpFn& fn, std::chrono::milliseconds timeout, const SaveFn& save,
           const std::string& name, const std::string& what);
  // A failure reported while nothing is queued: joins the agreement now, so the survivors do not
  // wait for this rank's next operation (poisons the group if that fails).
  void recoverIdle();
  // Elastic mode: a failure every rank must hear about (a mismatch: the program's bug) instead
  // of one the survivors recover from.
  void failGroup(const std::string& msg);
  // The admission op's body (communication thread): see ProcessGroupXirang::admitJoiners.
  void admit(OpCtx& ctx, int64_t expect, double wait_s);

  // The transport's point-to-point engine. Throws MembershipChanged on a shrunken ring, or what
  // the transport throws.
  transport::P2P& p2p(const std::string& desc);
  // Whether an operation started in `epoch` was overtaken by a membership change.
  bool changedSince(uint64_t epoch) const;
  uint64_t epoch() const { return epoch_.load(); }
  // Whether `rank` is on the current ring (communication thread).
  bool live(int rank) const;
  // "epoch E, live ranks [...] of N".
  std::string text() const { return text(nullptr); }

  MembershipInfo info() const;
  // fn runs on the communication thread after every rebuild (before the next op runs).
  void setCallback(std::function<void()> fn);

 private:
  std::string text(const elastic::Decision* d) const;
  MembershipChanged unavailable(const std::string& desc) const;
  transport::TcpOptions transportOptions(const std::string& key_prefix) const;
  // The shared-memory domain of epoch `epoch` for the ranks of `members` on this rank's host
  // (cfg.hosts labels), or null: XIRANG_TRANSPORT_LOCAL=tcp, fewer than two such ranks, or (auto)
  // ShmDomain::create found shared memory unavailable (one INFO line says why). Collective over
  // those ranks; store keys under key_ns + "/shm/<epoch>/<lowest local rank>"; a peer's death is also learnt from
  // `tcp`'s peerGone, for the ranks of `beating` (whose heartbeat threads run: the survivors of
  // an elastic epoch) from their heartbeats, and for those of `joining` (spares being admitted)
  // from their join beats. A local rank found gone that way during the set-up
  // of a rebuilt epoch (epoch > 0) leaves the epoch without shared memory (one WARN line): its
  // first operation then fails over TCP and the next rebuild drops the rank. Throws c10::Error
  // naming the rank (shm: unavailable; a local rank missing the group timeout; a bad
  // XIRANG_SHM_BYTES; a local rank gone at epoch 0).
  std::shared_ptr<transport::ShmDomain> makeShm(const std::vector<int>& members, uint64_t epoch,
                                                const std::shared_ptr<transport::Tcp>& tcp,
                                                const std::vector<int>& beating = {},
                                                const std::vector<int>& joining = {}) const;
  // Agrees with the survivors on the next epoch and rebuilds the transport and ring. Throws
  // TransportError if this rank was declared dead or the store is unreachable.
  elastic::Decision recover(const std::string& why);
  // `beating`, `joining`: the ranks of d.live whose heartbeats / join beats run (makeShm).
  void installEpoch(const elastic::Decision& d, const transport::Key128& key, int source, const std::string& reason,
                    double agreement_s, Clock::time_point t0, const std::vector<int>& beating,
                    const std::vector<int>& joining = {});
  uint64_t join();
  // Polls `key` until it exists (returns its value); throws TransportError if a failure is
  // reported for the current epoch meanwhile, TimeoutError after `deadline`.
  std::string waitKey(const std::string& key, transport::Deadline deadline);
  void heartbeatLoop();
  // XIRANG_HEARTBEAT_S as a duration (a rank silent that long is stale), and the interval at which
  // a counter is advanced (a fifth of it, at least 20 ms).
  std::chrono::milliseconds heartbeatPeriod() const;
  std::chrono::milliseconds heartbeatTick() const;
  transport::Key128 epochKey(uint64_t epoch, const transport::Key128& otherwise) const;

  const int rank_, size_;
  const XirangConfig& cfg_;
  std::shared_ptr<transport::Store> store_;
  const std::string key_ns_;  // generation::keyNamespace(cfg.generation): the transport's keys
  const std::string prefix_;  // key_ns_ + "/elastic": heartbeats, agreements (core/membership.h)
  std::string ifname_;
  std::chrono::milliseconds handshake_timeout_;
  std::optional<transport::Key128> auth_key_;  // XIRANG_AUTH_KEY_FILE's key, if set
  Callbacks cb_;

  // tcp_/comm_'s ring/live_ change on the communication thread only, under mu_ (the heartbeat
  // thread interrupts tcp_ and reads the ring under it).
  mutable std::mutex mu_;
  std::shared_ptr<transport::Tcp> tcp_;  // replaced per epoch
  std::shared_ptr<transport::ShmDomain> shm_;  // likewise; null: none (comm_.shm mirrors it)
  std::string local_mode_;               // XIRANG_TRANSPORT_LOCAL: auto, shm or tcp
  Comm comm_;
  std::vector<int> live_;
  std::vector<std::pair<uint64_t, uint64_t>> void_ranges_;  // (done_seq, fence] per decision
  MembershipInfo info_;
  std::function<void()> callback_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<bool> signal_{false};
  std::atomic<uint64_t> issued_seq_{0};
  uint64_t done_seq_ = 0;  // communication thread

  std::thread hb_thread_;
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  bool hb_stop_ = false;  // under hb_mu_
  std::mutex watch_mu_;   // guards hb_watch_ (the heartbeat thread's view of its neighbours)
  elastic::HeartbeatWatch* hb_watch_ = nullptr;
};

}  // namespace xirang
