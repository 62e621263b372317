// Operation records: what every operation of a group did (sizes, phases, per-peer times), kept
// in a bounded ring buffer for xirang.stats() and, with XIRANG_STATS_DIR, written as one JSON
// line per operation. The record is one field table (XIRANG_OP_RECORD_FIELDS): the C++ struct,
// the JSON line and the Python dict (bindings.cpp) are all produced from it, so a field is added
// in one place.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend/config.h"
#include "core/collectives.h"
#include "core/store.h"

namespace xirang {

inline int64_t steadyNs(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// How long the caller blocked in Work.wait() on one operation: its exposed wait. Shared by the Work
// and the operation's record, because the record is taken when the operation completes while a wait
// ends later (after the wake-up) or only begins later (an async op waited on after other work).
// Counted: every WorkXirang::wait() call, which is what torch.distributed's synchronous collectives
// (async_op=False) and Work.wait() run, and the whole of a synchronous operation the caller ran on
// its own thread (OpQueue::enqueue's inline path). Not counted: waits on the Work's Future
// (fut.wait(), DDP waiting on comm-hook futures at the end of backward), polling is_completed(),
// and on CUDA the caller's stream waiting for the copies back (the CPU does not block on it).
struct WaitClock {
  std::atomic<int64_t> blocked_ns{0};  // summed over the Work.wait() calls that returned
  std::atomic<int64_t> since_ns{0};    // steady-clock ns at which a wait in progress began; 0: none
  std::atomic<uint32_t> calls{0};      // Work.wait() calls begun; 0: the exposed wait is unknown
  // Seconds blocked up to steady-clock time `now_ns` (a wait in progress counts up to now_ns);
  // unset when no Work.wait() has begun. Two threads waiting on one Work at once count twice.
  std::optional<double> seconds(int64_t now_ns) const;

  // Times one wait (a Work.wait() call, or an operation the caller runs itself: OpQueue's inline
  // path) into `c` (null: nothing), including a wait that raises.
  class Timer {
   public:
    explicit Timer(WaitClock* c) : c_(c) {
      if (!c_) return;
      c_->calls.fetch_add(1, std::memory_order_relaxed);
      t0_ = steadyNs(Clock::now());
      int64_t none = 0;
      owner_ = c_->since_ns.compare_exchange_strong(none, t0_);
    }
    ~Timer() {
      if (!c_) return;
      const int64_t t1 = steadyNs(Clock::now());
      if (owner_) c_->since_ns.store(0);
      c_->blocked_ns.fetch_add(t1 - t0_);
    }
    Timer(const Timer&) = delete;
    Timer& operator=(const Timer&) = delete;

   private:
    WaitClock* c_;
    int64_t t0_ = 0;
    bool owner_ = false;
  };
};

// The hook's error-feedback op as its records and its argument errors name it:
// "allreduce_<wire>_ef" (allreduce_bf16_ef, allreduce_fp16_ef, allreduce_int8_ef).
inline std::string efOpName(codec::Wire w) { return std::string("allreduce_") + codec::wireName(w) + "_ef"; }

// The field tables: X(type, name, initial value), in the order of the JSON line and the dict.
// Times in seconds, sizes in bytes.
#define XIRANG_PEER_RECORD_FIELDS(X) \
  X(int, peer, -1)                   \
  X(double, send_s, 0)               \
  X(double, recv_s, 0)               \
  X(uint64_t, bytes_sent, 0)         \
  X(uint64_t, bytes_recv, 0)

#define XIRANG_OP_RECORD_FIELDS(X)                                                                    \
  X(uint64_t, seq, 0)                         /* the op's sequence number; 0: point-to-point */       \
  X(std::string, op, )                        /* "all_reduce", "allreduce_bf16_ef" (_fp16_, _int8_), "send", ... */ \
  X(std::string, algorithm, )                 /* "ring", "direct", "chain", "ring_bf16_ef", "p2p" */  \
  X(int64_t, group_id, -1)                    /* the hook's layer group, -1 otherwise */              \
  X(std::string, label, )                     /* the hook's layer names for group_id */               \
  X(std::string, dtype, )                                                                             \
  X(uint64_t, numel, 0)                                                                               \
  X(uint64_t, bytes_raw, 0)                   /* payload this rank would send uncompressed */         \
  X(uint64_t, bytes_wire, 0)                  /* payload this rank sent (headers excluded) */         \
  X(uint64_t, bytes_tcp, 0)                   /* of it, over TCP sockets */                           \
  X(uint64_t, bytes_shm, 0)                   /* of it, written into shared memory (same host) */     \
  X(uint64_t, bytes_cross_host, 0)            /* of it, to ranks on another host */                   \
  X(uint64_t, bytes_cross_rack, 0)            /* of it, to ranks on another rack */                   \
  X(double, t_enqueue, 0)                     /* since the group was created */                       \
  X(double, queued_s, 0)                                                                              \
  X(double, pack_s, 0)                        /* the hook's op: its gradients copied into its buffers */ \
  X(double, encode_s, 0)                                                                              \
  X(double, scatter_reduce_s, 0)                                                                      \
  X(double, allgather_s, 0)                                                                           \
  X(double, decode_s, 0)                                                                              \
  X(double, total_s, 0)                                                                               \
  X(bool, ok, true)                                                                                   \
  X(bool, on_caller, false)                   /* ran on the caller's thread (OpQueue::enqueue) */      \
  X(std::string, engine, )                    /* "host"; CUDA: "mirror", "staged", "nccl" (OpStage) */ \
  X(std::optional<double>, exposed_wait_s, )  /* WaitClock: unset (null, None) = unknown */           \
  X(std::vector<PeerRecord>, peers, )         /* per peer this rank exchanged with */

#define XIRANG_RECORD_MEMBER(type, name, init) type name{init};
#define XIRANG_RECORD_VISIT(type, name, init) f(#name, r.name);

struct PeerRecord {
  XIRANG_PEER_RECORD_FIELDS(XIRANG_RECORD_MEMBER)
};

// One operation's record for stats / the latency breakdown.
struct OpRecord {
  XIRANG_OP_RECORD_FIELDS(XIRANG_RECORD_MEMBER)
  // The exposed wait's clock: records() reads exposed_wait_s from it when called; a JSON line
  // carries what was known when the operation completed. Null without records.
  std::shared_ptr<WaitClock> wait;
};

// f(name, value) for every field, in table order.
template <class F>
void forEachField(const PeerRecord& r, F&& f) {
  XIRANG_PEER_RECORD_FIELDS(XIRANG_RECORD_VISIT)
}
template <class F>
void forEachField(const OpRecord& r, F&& f) {
  XIRANG_OP_RECORD_FIELDS(XIRANG_RECORD_VISIT)
}

#undef XIRANG_RECORD_MEMBER
#undef XIRANG_RECORD_VISIT

// XIRANG_STATS_CAPACITY: records kept per group, 1 to kMaxStatsCapacity (std::invalid_argument
// otherwise; 2^24 records are a few GiB).
constexpr int64_t kMaxStatsCapacity = int64_t{1} << 24;
size_t statsCapacityKnob();

// One group's records: the ring buffer, the JSON lines' writer and what keeping them costs.
class Records {
 public:
  // Reads XIRANG_STATS and XIRANG_STATS_CAPACITY (std::invalid_argument for a bad value).
  Records(int rank, int size, const XirangConfig& cfg);
  ~Records();
  Records(const Records&) = delete;
  Records& operator=(const Records&) = delete;

  // With XIRANG_STATS_DIR: opens <dir>/rank<global rank>.jsonl and starts the writer thread
  // (logs a warning instead when the file cannot be opened or records are off).
  void start();
  // Writes the lines still queued and closes the file.
  void stop();

  bool on() const { return on_; }  // XIRANG_STATS
  double since(Clock::time_point t) const;  // seconds from the group's creation to t

  // A collective's record, completed from what the algorithm measured: `ph`'s phases and peers;
  // queued_s from enqueued to start, total_s from start to now. raw_per_wire: bytes_raw per
  // byte sent (2 for the BF16 ring). caller_ns: what building the record cost the caller's
  // thread (cost()).
  void finish(OpRecord rec, const Phases& ph, bool ok, uint64_t raw_per_wire, Clock::time_point enqueued,
              Clock::time_point start, uint64_t caller_ns);
  // Counts `bytes` sent to `peer` in rec's cross-host / cross-rack bytes.
  void addCrossBytes(OpRecord& rec, int peer, uint64_t bytes) const;
  // Stores a finished operation's record and queues its JSON line. `end`: when the operation
  // finished.
  void keep(OpRecord rec, Clock::time_point end, uint64_t caller_ns);

  // The records, oldest first, with the exposed waits as of now.
  std::vector<OpRecord> snapshot();
  void clear();

  // What keeping the records has cost this group so far: records built and the nanoseconds
  // spent building and storing them (the caller's share in enqueue, the communication thread's
  // after the operation ran, the JSON line when XIRANG_STATS_DIR is set). Not included: the
  // clock reads bracketing the operation and the per-peer timings taken inside the algorithms
  // (compare a group made with XIRANG_STATS=0 for those).
  struct Cost {
    uint64_t records = 0;
    uint64_t ns = 0;
  };
  Cost cost() const { return {built_.load(), ns_.load()}; }

 private:
  void writerLoop();
  void write(const OpRecord& r);

  const int rank_, size_;
  const XirangConfig& cfg_;
  const Clock::time_point created_;
  const bool on_;
  const size_t capacity_;

  std::mutex mu_;
  std::deque<OpRecord> records_;
  std::atomic<uint64_t> built_{0};
  std::atomic<uint64_t> ns_{0};

  // XIRANG_STATS_DIR: the communication thread queues a copy of each record; the writer thread
  // comes by every 100 ms (and at stop) to format, write and flush the JSON lines, so a line
  // costs the communication thread a copy, not a format, a write or a wake-up. A SIGKILLed rank
  // loses at most the last 100 ms of lines.
  FILE* file_ = nullptr;
  std::thread writer_;
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<OpRecord> queue_;
  bool stop_ = false;
};

}  // namespace xirang
