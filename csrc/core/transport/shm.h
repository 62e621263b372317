// Shared memory between the ranks of one group on one host: one POSIX shared-memory segment per
// domain, futex-based synchronisation inside it, and the liveness checks that keep a dead
// same-host peer from being waited on forever. The algorithms over it are core/algorithms/shm.h.
//
// Creation (collective over the local ranks, through the store, all bounded by one deadline):
//   1. the lowest local rank draws a random token, creates "/xirang-<token>" (O_CREAT|O_EXCL,
//      mode 0600), reserves its pages with posix_fallocate (a full /dev/shm fails here, with a
//      message, instead of a SIGBUS at the first touch), maps it, writes the header and publishes
//      the token under <prefix>/token ("!" + why when it could not);
//   2. every other local rank opens and maps it, checks the header, writes its pid into its
//      control block, increments the segment's mapped counter, and reports "ok" or why not under
//      <prefix>/mapped/<i>;
//   3. once every local rank has reported (or the deadline passed) the creator shm_unlink()s the
//      segment: from then on nothing is left in /dev/shm whatever happens to any rank. The window
//      in which a crash leaves a segment behind is the creation itself (steps 1-3);
//   4. every rank checks that the mapped counter reached the local size (the mappings really
//      share memory) and that each peer's process is visible (pidfd_open / kill(pid, 0) and its
//      start time in /proc: a separate pid namespace counts as another host), and reports under
//      <prefix>/checked/<i>.
// A rank that cannot take part (another /dev/shm, a full /dev/shm, an invisible peer) makes every
// local rank throw ShmUnavailable from create(): the caller uses TCP for these ranks instead.
//
// Layout: a header (magic, version, local size, slot bytes, mapped counter, abort word and a
// bounded message), one control block per local rank (pid, the 32-bit futex word counting the
// phases it has published, the current op's agreement record), a table of 2 x size() 64-bit
// sizes per local rank, all page-rounded; then size() slots of slot_bytes each (page aligned).
//
// Synchronisation: each local rank owns one counter ("phases published"). publish() increments
// it with release order after the rank's writes to shared memory, so a rank that has waited for
// the new value (acquire) sees them: no rank ever reads data a peer had not finished writing, and
// a peer that dies mid-write never publishes. A wait spins briefly (a few microseconds), then
// sleeps in FUTEX_WAIT slices of 100 ms (shared futexes: no FUTEX_PRIVATE_FLAG, they work across
// processes); between slices it checks the abort word, this process's interrupt, the peers'
// processes (a pidfd that became readable, or kill() == ESRCH) and the caller's liveness
// callback, so a dead peer is reported within a slice or two as a TransportError naming it, and
// every wait ends at its deadline with a TimeoutError naming the rank it waited for.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/store.h"
#include "core/transport/errors.h"
#include "core/transport/frame.h"

namespace xirang::transport {

// Shared memory cannot serve these ranks (a rank could not create, open or map the segment, the
// mappings are not shared, or a peer's process is not visible from here). Every local rank of
// the domain throws it from ShmDomain::create, with every rank's reason: the caller falls back
// to TCP. `peer` is the first local rank that reported a problem.
class ShmUnavailable : public TransportError {
 public:
  using TransportError::TransportError;
};

struct ShmOptions {
  // Store namespace of this domain's creation keys (token, mapped/<i>, checked/<i>); must be
  // unique per domain among the group's store keys, e.g. "<group prefix>/shm/<n>".
  std::string key_prefix = "xirang/shm";
  // Bytes per local rank's slot; 0: XIRANG_SHM_BYTES (every local rank checks its own value: one
  // that is not an integer from 4096 to 1 GiB makes create() throw std::invalid_argument on every
  // local rank). Rounded up to whole pages; at least one page and 64 x (local size + 1) bytes.
  // The creator's value wins (peers adopt the header's).
  uint64_t slot_bytes = 0;
  // "" while group rank `peer` may still take part, else why not (the TCP transport's peerGone:
  // its control connection or listener is gone). Optional; called by waits at most every 100 ms,
  // from the waiting thread.
  std::function<std::string(int peer)> peer_gone;
  // The segment name's prefix (a leading '/' and no other '/'). Ranks with different prefixes
  // cannot meet: the tests emulate ranks with separate /dev/shm this way.
  std::string name_prefix = "/xirang-";
};

// The agreement record of one operation (core/algorithms/shm.cc writes and compares them):
// what the TCP frames' headers carry, plus the algorithm's variant.
struct ShmOpRecord {
  FrameHeader header;
  uint64_t variant = 0;
};

class ShmDomain {
 public:
  // Collective over `local_ranks` (the group ranks on this host, each exactly once, any order;
  // `rank` among them): every one of them calls it with the same key_prefix. Throws
  // ShmUnavailable (shared memory cannot serve these ranks: use TCP), TimeoutError (a local rank
  // did not take part before `deadline`; the segment is unlinked all the same) or
  // std::invalid_argument (bad arguments, a bad XIRANG_SHM_BYTES on any local rank).
  static std::unique_ptr<ShmDomain> create(int rank, std::vector<int> local_ranks, Store& store,
                                           const ShmOptions& opts, Deadline deadline);
  ~ShmDomain();  // unmaps; closes the pidfds. Never throws.
  ShmDomain(const ShmDomain&) = delete;
  ShmDomain& operator=(const ShmDomain&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  int index() const { return index_; }          // this rank's local index: its place in ranks()
  const std::vector<int>& ranks() const { return ranks_; }  // group ranks, ascending
  int indexOf(int group_rank) const;            // -1 if not a member
  uint64_t slotBytes() const { return slot_bytes_; }
  uint8_t* slot(int index) const { return data_ + slot_bytes_ * static_cast<uint64_t>(index); }
  // All slots, contiguous: size() x slotBytes() bytes starting at slot(0).
  uint64_t dataBytes() const { return slot_bytes_ * static_cast<uint64_t>(size()); }
  // The segment's name ("/xirang-<token>"; unlinked once create() returned).
  const std::string& name() const { return name_; }

  // Counts the operations run on this domain (every local rank runs the same ones): an
  // algorithm takes one number per operation, and its parity picks the record buffers below.
  uint64_t nextOp() { return ops_++; }
  // The op record of local rank `index`, in the buffer of parity `parity` (0 or 1: an algorithm
  // alternates them by op so that a slow rank still reading op k's records is not disturbed by a
  // fast one writing op k+1's). Plain memory: written by its owner before a publish(), read by
  // the others after waiting for it.
  ShmOpRecord& record(int index, int parity) const;
  // 2 x size() sizes of local rank `index`, in the same buffers.
  uint64_t* sizes(int index, int parity) const;

  // Makes this rank's writes to the segment visible to whoever waits for the returned count, and
  // wakes peers sleeping on it. Returns this rank's new count.
  uint32_t publish();
  // Until local rank `index` has published `count` (acquire): everything it wrote before is
  // visible. Throws TransportError (an abort, an interrupt, a dead peer, the liveness callback;
  // naming the rank) or TimeoutError at `deadline`. `what` names the caller's step for messages.
  void waitFor(int index, uint32_t count, Deadline deadline, const char* what);
  // waitFor every other local rank.
  void waitAll(uint32_t count, Deadline deadline, const char* what);
  // publish() + waitAll(): every local rank has reached this point.
  void barrier(Deadline deadline, const char* what) { waitAll(publish(), deadline, what); }
  // A barrier in two halves: arrive() publishes now without waiting; the next settle() waits
  // until every other local rank has arrived there too (no-op without a pending arrive()). An
  // algorithm whose last step reads the segment after its last barrier arrives when done, and
  // every algorithm settles before its first write: a fast rank's next operation never
  // overwrites what a slow one is still reading, and nobody waits where nobody lags.
  void arrive() { pending_ = publish(); }
  void settle(Deadline deadline, const char* what) {
    if (pending_ == 0) return;
    const uint32_t c = pending_;
    pending_ = 0;
    waitAll(c, deadline, what);
  }

  // Best effort, idempotent, never throws: records `why` as this domain's failure (the first
  // abort wins) and wakes every waiter, in every process; their waits throw TransportError
  // naming this rank. The domain stays unusable.
  void abort(const std::string& why);
  // Any thread: this process's waits on the domain throw TransportError(why) at once (peers are
  // not told: that is abort()).
  void interrupt(const std::string& why);
  // "" or the abort recorded in the segment ("rank R aborted: why").
  std::string abortReason() const;

  // Whether local rank `index`'s process has exited (its pidfd, else kill(pid, 0)).
  bool processGone(int index) const;

 private:
  struct Header;
  struct Ctrl;
  ShmDomain() = default;
  Header& header() const;
  Ctrl& ctrl(int index) const;
  // Throws if the wait must end: abort, interrupt, a dead peer, the liveness callback.
  void checkHealth(int waiting_for, const char* what);
  void wakeAll();

  int rank_ = -1;
  int index_ = -1;
  std::vector<int> ranks_;
  std::string name_;
  uint8_t* base_ = nullptr;  // the mapping
  uint64_t map_bytes_ = 0;
  uint64_t ctrl_off_ = 0, sizes_off_ = 0;
  uint8_t* data_ = nullptr;  // slot 0
  uint64_t slot_bytes_ = 0;
  uint64_t ops_ = 0;
  uint32_t pending_ = 0;  // arrive()'s count not yet settled (0: none)
  std::vector<int> pidfds_;  // per local index; -1: none (self, or no pidfd_open)
  std::function<std::string(int)> peer_gone_;
  std::atomic<bool> interrupted_{false};
  mutable std::mutex mu_;
  std::string interrupt_why_;  // under mu_
};

}  // namespace xirang::transport
