// Elastic membership (#8): after a failure, the surviving ranks of a group agree through the
// c10d store on the next epoch's live ranks and on which of the operations in flight completed.
//
// Store keys, under `prefix`:
//   hb/<rank>            heartbeat counter, advanced by every live rank's heartbeat thread
//   e<k>/fail            first failure report of epoch k (its existence ends epoch k)
//   e<k>/alive/<rank>    a survivor's report: "<done_seq> <issued_seq>"
//   e<k>/decision        the decision for epoch k+1, written once (compareSet: first writer wins)
//
// Why the decision carries sequence numbers: a ring allreduce can finish on one rank and not on
// another when a rank dies during its last steps. In elastic mode a rank completes an operation
// only after every live rank has said it holds the result (an empty "ack" frame to each), so
// if any survivor completed op s, every survivor holds s's result. The decision takes
// done_seq = min over survivors of the last op whose result they hold: ops up to done_seq
// complete everywhere, ops in (done_seq, fence] (fence = max issued) raise MembershipChanged
// everywhere (or are retried by the hook's op) and ops after fence run on the new ring. Every
// survivor applies the same rule to the same sequence numbers, so none keeps a result that
// holds the dead rank's data while another does not.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/store.h"
#include "core/transport/errors.h"

namespace xirang::elastic {

struct Report {
  uint64_t done_seq = 0;    // last op seq whose result this rank holds
  uint64_t issued_seq = 0;  // last op seq the caller has issued
};

struct Decision {
  uint64_t epoch = 0;      // the epoch this decision starts
  std::vector<int> live;   // its live group ranks, ascending
  uint64_t done_seq = 0;   // ops <= done_seq completed on every survivor
  uint64_t fence = 0;      // ops in (done_seq, fence] are void: MembershipChanged (or retried)

  std::string encode() const;
  // Throws std::invalid_argument on malformed text.
  static Decision decode(const std::string& text);
};

std::string heartbeatKey(const std::string& prefix, int rank);
// A waiting spare's counter (it advances while the spare waits and joins; its heartbeat key is
// the lost rank's, which the spare must not advance before it is in).
std::string joinBeatKey(const std::string& prefix, int rank);
std::string joinKey(const std::string& prefix, int rank);
std::string joinedKey(const std::string& prefix, int rank);
std::string admitKey(const std::string& prefix, uint64_t seq);
std::string secretKey(const std::string& prefix, uint64_t epoch);
std::string failKey(const std::string& prefix, uint64_t epoch);

// Best effort: records `why` as the failure that ends `epoch` unless one is recorded already.
// Returns the reason recorded (ours or the first one). Throws TransportError if the store is
// unreachable.
std::string reportFailure(transport::Store& store, const std::string& prefix, uint64_t epoch,
                          const std::string& why);

// Watches heartbeat counters as seen by this process: a rank is stale when its counter has not
// changed for `stale_after` since this watch first read it (so a just-started watch never calls
// a rank stale before stale_after has passed).
class HeartbeatWatch {
 public:
  // `spares`: watch the spares' join beats (joinBeatKey) instead of the heartbeats.
  HeartbeatWatch(transport::Store& store, std::string prefix, std::chrono::milliseconds stale_after,
                 bool spares = false);
  // Reads rank r's counter now. Throws TransportError if the store is unreachable.
  bool stale(int r);
  // Seconds since rank r's counter last changed (0 if never read).
  double silentFor(int r) const;
  // Takes over another watch's observations (same store and prefix): what the heartbeat thread
  // already saw counts, so a rank silent for a while is stale at once in the agreement.
  void adopt(const HeartbeatWatch& other);

 private:
  struct Seen {
    int64_t value;
    std::chrono::steady_clock::time_point changed;
  };
  transport::Store& store_;
  std::string prefix_;
  std::chrono::milliseconds stale_after_;
  bool spares_;
  std::map<int, Seen> seen_;
};

// One survivor's part of the agreement that ends `epoch` (every survivor calls it; all return
// the same Decision). Registers `mine`, then waits until every rank of `live` has registered
// or gone stale (its heartbeat silent for the watch's stale_after), or until `deadline`, and
// proposes the registered set; the first proposal written wins. A rank that dies during the
// agreement is either in the decision (it registered first; the next epoch drops it) or not:
// either way the survivors converge.
// Throws TransportError if the store is unreachable or no decision is reached by `deadline`
// plus the watch's stale_after.
Decision agree(transport::Store& store, const std::string& prefix, uint64_t epoch, const std::vector<int>& live,
               int rank, const Report& mine, HeartbeatWatch& watch, transport::Deadline deadline);

}  // namespace xirang::elastic
