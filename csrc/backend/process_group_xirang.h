// ProcessGroupXirang: the c10d::Backend behind torch.distributed's "xirang" backend.
//
// Three phases per collective, like c10d's ProcessGroupGloo: (1) on the caller's thread, check
// the inputs (device, dtype, sizes), prepare contiguous / widened buffers and take the next
// sequence number; (2) on the communication thread, run the algorithm from core/collectives
// under the caller's thread-local state and the op's deadline; (3) copy results back, finish
// the Work (which ends its profiler range "xirang:<op>") and complete its Future.
//
// Failure model (fail-fast): the first error in any operation (peer closed, mismatch, timeout)
// poisons the group; it is sent to every connected peer as an abort frame and every later
// operation raises it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ThreadLocalState.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "core/collectives.h"
#include "core/planner.h"
#include "core/transport/tcp.h"
#include "core/membership.h"
#include "core/transport/tcp.h"
#ifdef XIRANG_WITH_CUDA
#include "cuda/cuda_stage.h"
#endif

namespace xirang {

// How long the caller blocked in Work.wait() on one operation: its exposed wait. Shared by the
// Work and the operation's record, because the record is taken when the operation completes
// while a wait ends later (after the wake-up) or only begins later (an async op waited on after
// other work). Counted: every WorkXirang::wait() call, which is what torch.distributed's
// synchronous collectives (async_op=False) and Work.wait() run. Not counted: waits on the Work's
// Future (fut.wait(), DDP waiting on comm-hook futures at the end of backward), polling
// is_completed(), and on CUDA the caller's stream waiting for the copies back (the CPU does not
// block on it).
struct WaitClock {
  std::atomic<int64_t> blocked_ns{0};  // summed over the Work.wait() calls that returned
  std::atomic<int64_t> since_ns{0};    // steady-clock ns at which a wait in progress began; 0: none
  std::atomic<uint32_t> calls{0};      // Work.wait() calls begun; 0: the exposed wait is unknown
  // Seconds blocked up to steady-clock time `now_ns` (a wait in progress counts up to now_ns);
  // -1 when no Work.wait() has begun. Two threads waiting on one Work at once count twice.
  double seconds(int64_t now_ns) const;
};

// One operation's record for stats / the latency breakdown. Times in seconds, sizes in bytes.
struct OpRecord {
  uint64_t seq = 0;
  std::string op;            // "all_reduce", "allreduce_bf16_ef", ...
  std::string algorithm;     // "ring", "direct", "chain", "ring_bf16_ef"
  int64_t group_id = -1;     // the hook's layer group, -1 otherwise
  std::string dtype;
  uint64_t numel = 0;
  uint64_t bytes_raw = 0;    // payload this rank would send uncompressed (same algorithm)
  uint64_t bytes_wire = 0;   // payload this rank sent (headers excluded)
  double t_enqueue = 0;      // seconds since the group was created
  double queued_s = 0, encode_s = 0, scatter_reduce_s = 0, allgather_s = 0, decode_s = 0, total_s = 0;
  bool ok = true;
  std::string label;               // the hook's layer names for group_id
  uint64_t bytes_cross_host = 0;   // payload sent to ranks on another host / rack
  uint64_t bytes_cross_rack = 0;
  struct Peer {
    int peer;
    double send_s, recv_s;
    uint64_t bytes_sent, bytes_recv;
  };
  std::vector<Peer> peers;         // per peer this rank exchanged with
  // Exposed wait (see WaitClock): seconds the caller blocked in Work.wait(); -1 = unknown (no
  // Work.wait() had begun). records() reads it from `wait` when called; a JSON line carries
  // what was known when the operation completed.
  double exposed_wait_s = -1;
  std::shared_ptr<WaitClock> wait;
};

struct XirangConfig {
  std::string group_name;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  std::string algorithm = "auto";   // auto, ring, direct
  std::vector<int> ring;            // ring order (group ranks); empty = 0..size-1
  std::vector<std::string> hosts;   // host label per group rank (may be empty)
  std::vector<std::string> racks;   // rack label per group rank (may be empty)
  int global_rank = 0;
  std::string stats_dir;            // XIRANG_STATS_DIR ("" = off)
  std::string run_id;
  bool elastic = false;             // XIRANG_ELASTIC / Options(elastic=True)
  double heartbeat_s = 1.0;         // XIRANG_HEARTBEAT_S
  bool join = false;                // XIRANG_JOIN: a spare taking a dead rank's place
  // This creation's generation (core/generation.h): every store key of the group lives under
  // generation::keyNamespace(generation). Empty: the constructor runs the handshake itself.
  std::string generation;
};

// Raised (Python: xirang.MembershipChanged, a RuntimeError) by every operation that was in
// flight when an elastic group lost a rank: its result is void on every survivor.
class MembershipChanged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What an elastic group's membership is now (see ProcessGroupXirang::membership()).
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

class WorkXirang : public c10d::Work {
 public:
  WorkXirang(int rank, c10d::OpType type, const char* profilingTitle, std::vector<at::Tensor> outputs,
             const std::optional<std::vector<at::Tensor>>& inputs);
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override { return source_rank_; }
  // Work.wait(timeout): bounds only this wait; on expiry raises naming the rank and the op.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  std::string desc_;  // "xirang rank R: <op> (op #seq, ...)" for messages
  // Called once by the communication thread.
  void complete(std::exception_ptr error);
#ifdef XIRANG_WITH_CUDA
  // A host-staged op on CUDA tensors (caller's thread, before the op is queued): the outputs
  // become the user's CUDA tensors and the Future is made with their device.
  void setCudaStage(std::shared_ptr<cudastage::Stage> stage);
  // wait() calls this after completion: the caller's current stream waits for the copies back.
  void synchronize() override;
  bool isCompleted() override;
#endif

  int source_rank_ = -1;
  std::shared_ptr<WaitClock> wait_clock_;  // null when the group keeps no records (XIRANG_STATS=0)

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
#ifdef XIRANG_WITH_CUDA
  std::shared_ptr<cudastage::Stage> cuda_stage_;
#endif
};

class ProcessGroupXirang : public c10d::Backend {
 public:
  // Connects nothing yet: the listener is opened and its address published to `store`;
  // connections to peers are made by the first operation that needs them.
  // Throws c10::Error if the store times out or no address can be bound.
  ProcessGroupXirang(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, XirangConfig cfg);
  ~ProcessGroupXirang() override;

  // The generation of a group being created (core/generation.h), to pass as cfg.generation:
  // the handshake of generation::agree (every rank of the creation calls it), or with `join` the
  // live group's (generation::live). Waits at most `timeout`; throws c10::Error naming the rank,
  // the group and the ranks that never answered.
  static std::string agreeGeneration(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                     std::chrono::milliseconds timeout, bool join, const std::string& group_name);

  const std::string getBackendName() const override { return "xirang"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Sequence numbers, as c10d's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) reads them
  // before every collective to fingerprint it across ranks. Like gloo's: every group starts at
  // 0 (so set* has nothing to agree on) and each collective advances it by one on every rank;
  // point-to-point ops do not. get* is the number of collectives issued so far (caller's thread).
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // Coalescing (batch_isend_irecv, the coalescing manager): ops issued between start and end
  // run as they are issued (point-to-point ones concurrently); endCoalescing returns a Work that
  // completes when all have, with the first error among them.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  void abort() override;
  void shutdown() override;
  void setTimeout(std::chrono::milliseconds timeout) override { cfg_.timeout = timeout; }

  // The hook's operation for one layer group: BF16 error-feedback ring allreduce (average) of a
  // flat fp32 buffer, then a plain average of each `plain` tensor in its own dtype, as one op.
  // buffer, residual, staged: 1-D contiguous float32 CPU tensors of equal numel; residual is
  // read, the new residual is written to staged (must not share storage with residual).
  // Future value: [buffer, *plain]. Errors: c10::Error for bad arguments.
  c10::intrusive_ptr<c10d::Work> allreduceBF16EF(at::Tensor buffer, at::Tensor residual, at::Tensor staged,
                                                 int64_t group_id, std::string label = "",
                                                 std::vector<at::Tensor> plain = {});

  // This rank's operation records (bounded ring buffer, oldest first) and clearing them.
  std::vector<OpRecord> records();
  void clearRecords();
  // What keeping the records has cost this group so far: records built and the nanoseconds
  // spent building and storing them (the caller's share in enqueue, the communication thread's
  // after the operation ran, the JSON line when XIRANG_STATS_DIR is set). Not included: the
  // clock reads bracketing the operation and the per-peer timings taken inside the algorithms
  // (compare a group made with XIRANG_STATS=0 for those).
  struct RecordCost {
    uint64_t records = 0;
    uint64_t ns = 0;
  };
  RecordCost recordCost() const { return {records_built_.load(), record_ns_.load()}; }
  bool recordsOn() const { return records_on_; }
  std::vector<int> ringOrder() { return membership().ring; }
  std::string address() const { return tcp_ ? tcp_->address() : ""; }
  uint64_t sequenceNumber() const { return seq_; }

  // Elastic mode (#8). membership(): the current epoch, live ranks and last recovery.
  MembershipInfo membership();
  // A collective over the live ranks, at a step boundary: admits the spares (XIRANG_JOIN=1)
  // waiting to take dead ranks' places, if at least `expect` are waiting (the lowest live rank
  // waits up to wait_s seconds for them; fewer: none is admitted this time, so a DDP rebuild,
  // which needs every rank, can wait for a full group). The ring grows back (a new epoch) if any joined; membership()
  // then names the source rank of the training state. Errors: MembershipChanged if a rank
  // fails meanwhile; c10::Error without elastic mode.
  c10::intrusive_ptr<c10d::Work> admitJoiners(int64_t expect, double wait_s);
  // fn runs on the communication thread after every rebuild (before the next op runs).
  void setMembershipCallback(std::function<void()> fn);
  bool elastic() const { return cfg_.elastic; }
  const std::string& generation() const { return cfg_.generation; }

 private:
  using Fn = std::function<void(OpCtx&)>;
  struct Op {
    c10::intrusive_ptr<WorkXirang> work;
    Fn fn;
    OpCtx ctx;
    std::chrono::milliseconds timeout;
    at::ThreadLocalState tls;
    OpRecord rec;
    std::chrono::steady_clock::time_point enqueued;
    uint64_t rec_ns = 0;  // the caller's share of building the record (see recordCost())
    // Elastic mode: save() snapshots the inputs and returns their restore; an op that has one
    // is retried on the new ring instead of raising MembershipChanged (the hook's op).
    std::function<std::function<void()>()> save;
  };

  // allreduce of one sparse COO CPU tensor (ReduceOp.SUM only, as gloo); see the .cc.
  c10::intrusive_ptr<c10d::Work> allreduceSparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);

  // Prepares an Op and queues it; returns its Work.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title, transport::OpKind kind,
                                         std::vector<at::Tensor> outputs, const std::vector<at::Tensor>& inputs,
                                         DType dtype, ReduceOp reduce, uint64_t numel, std::chrono::milliseconds timeout,
                                         Fn fn, int64_t group_id = -1, std::string label = "",
                                         std::function<std::function<void()>()> save = nullptr);
  void writeRecord(const OpRecord& r);
  void keepRecord(OpRecord rec, std::chrono::steady_clock::time_point end, uint64_t caller_ns);
  void addCrossBytes(OpRecord& rec, int peer, uint64_t bytes) const;
  // Point-to-point: posts a send (is_send) or a receive from `peer` (-1: any source) to the
  // transport's point-to-point engine; the Work completes on the engine's thread.
  c10::intrusive_ptr<c10d::Work> postP2P(bool is_send, int peer, int tag, const at::Tensor& t, c10d::OpType type,
                                         const char* title);
  std::exception_ptr p2pFailed(const std::string& desc, std::exception_ptr err, uint64_t epoch);
  void runLoop();
  void checkPoisoned();
  void poison(const std::string& msg);
  std::string describe(const Op& op) const;
  // Runs op.fn; in elastic mode also the ack round, recovery, retry and the void-range rule.
  void runOp(Op& op);
  // Elastic: agrees with the survivors on the next epoch and rebuilds the transport and ring.
  // Throws TransportError if this rank was declared dead or the store is unreachable.
  elastic::Decision recover(const std::string& why);
  void installEpoch(const elastic::Decision& d, const transport::Key128& key, int source, const std::string& reason,
                    double agreement_s, std::chrono::steady_clock::time_point t0);
  // XIRANG_JOIN: announces this spare and blocks until the live ranks admit it (group timeout).
  void joinGroup();
  // Polls `key` until it exists (returns its value); throws TransportError if a failure is
  // reported for the current epoch meanwhile, TimeoutError after `deadline`.
  std::string waitKey(const std::string& key, transport::Deadline deadline);
  void heartbeatLoop();
  transport::Key128 epochKey(uint64_t epoch, const transport::Key128& otherwise) const;
  std::string membershipText(const elastic::Decision* d) const;

  XirangConfig cfg_;
  std::shared_ptr<transport::Store> store_;
  std::string key_ns_;          // generation::keyNamespace(cfg_.generation): the transport's keys
  std::string elastic_prefix_;  // key_ns_ + "/elastic": heartbeats, agreements (core/membership.h)
  std::shared_ptr<transport::Tcp> tcp_;  // replaced per elastic epoch (under mem_mu_)
  std::optional<transport::Key128> auth_key_;  // XIRANG_AUTH_KEY_FILE's key, if set
  Comm comm_;
  uint64_t seq_ = 0;  // caller's thread(s) only

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool stop_ = false;
  std::string poison_;
  std::thread thread_;

  std::mutex rec_mu_;
  std::deque<OpRecord> records_;
  size_t record_capacity_ = 65536;
  bool records_on_ = true;  // XIRANG_STATS
  std::atomic<uint64_t> records_built_{0};
  std::atomic<uint64_t> record_ns_{0};
  std::chrono::steady_clock::time_point created_;
  FILE* stats_file_ = nullptr;
  // XIRANG_STATS_DIR: the communication thread queues a copy of each record; this thread comes
  // by every 100 ms (and at shutdown) to format, write and flush the JSON lines, so a line costs
  // the communication thread a copy, not a format, a write or a wake-up. A SIGKILLed rank loses
  // at most the last 100 ms of lines.
  std::thread stats_thread_;
  std::mutex stats_mu_;
  std::condition_variable stats_cv_;
  std::deque<OpRecord> stats_q_;
  bool stats_stop_ = false;
  void statsWriterLoop();

  // Elastic state. live_/comm_.ring/tcp_ change on the communication thread only, under mem_mu_
  // (the heartbeat thread interrupts tcp_ and reads the ring under it).
  std::mutex mem_mu_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<uint64_t> issued_seq_{0};
  std::atomic<bool> membership_signal_{false};
  std::vector<int> live_;
  uint64_t done_seq_ = 0;                                   // communication thread
  std::vector<std::pair<uint64_t, uint64_t>> void_ranges_;  // (done_seq, fence] per decision
  MembershipInfo info_;
  std::function<void()> membership_cb_;
  std::thread hb_thread_;
  bool hb_stop_ = false;  // under mu_
  std::mutex watch_mu_;   // guards hb_watch_ (the heartbeat thread's view of its neighbours)
  elastic::HeartbeatWatch* hb_watch_ = nullptr;
  std::condition_variable hb_cv_;

  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;

#ifdef XIRANG_WITH_CUDA
  // Side streams for host-staged CUDA ops (made on the first CUDA tensor; no CUDA call before).
  cudastage::Streams cuda_streams_;
#endif
};

}  // namespace xirang
