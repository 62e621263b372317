// The op queue: every collective of a group runs on one communication thread, in the order the
// caller issued them (every rank issues collectives in the same order, so the sequence number
// matches them across ranks); a small synchronous one that finds the group idle runs in its turn
// on the caller's thread instead (enqueue()).
//
// Three phases per collective, like c10d's ProcessGroupGloo: (1) on the caller's thread the entry
// point checks the inputs and enqueue() takes the next sequence number, builds the Work and the
// record; (2) on the communication thread (or inline on the caller's) the op's body runs under the
// caller's thread-local state and the op's deadline (Membership::run); (3) the Work completes (its
// profiler range "xirang:<op>" ends) and the record is kept.
//
// Failure model (fail-fast): the first error in any operation (peer closed, mismatch, timeout)
// poisons the group; it is sent to every connected peer as an abort frame and every later
// operation raises it. Elastic mode's MembershipChanged does not poison: the group goes on.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ThreadLocalState.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "backend/config.h"
#include "core/codec.h"
#include "backend/elastic.h"
#include "backend/records.h"
#include "backend/work.h"

namespace xirang {

// What an entry point hands to enqueue() besides the op's body.
struct OpSpec {
  c10d::OpType type{};
  const char* title = nullptr;  // profiler range "xirang:<op>"; <op> is the op's name in messages and records
  transport::OpKind kind{};
  std::vector<at::Tensor> outputs{};  // the Work's result() and Future value
  std::vector<at::Tensor> inputs{};
  DType dtype = DType::Bytes;
  ReduceOp reduce = ReduceOp::None;
  uint64_t numel = 0;
  std::chrono::milliseconds timeout = c10d::kUnsetTimeout;  // unset: the group's
  int64_t group_id = -1;  // the hook's layer group
  std::string label{};    // its layer names
  SaveFn save{};          // elastic mode: retried on the new ring (Membership::run)
  codec::Wire wire = codec::Wire::BF16;  // AllreduceEF's wire format: its records' op name and raw bytes
  // The caller waits for it at once (the options' asyncOp false: torch.distributed's
  // async_op=False), so a small one may run on the caller's thread (OpQueue::enqueue).
  bool sync = false;
};

struct Op {
  c10::intrusive_ptr<WorkXirang> work;
  OpFn fn;
  OpCtx ctx;
  std::chrono::milliseconds timeout;
  at::ThreadLocalState tls;
  OpRecord rec;      // rec.op: the op's name, with or without records
  std::string what;  // describe(): "<op> (op #seq, dtype, N elements[, reduce], group 'g')"
  Clock::time_point enqueued;
  uint64_t rec_ns = 0;  // the caller's share of building the record (Records::cost())
  SaveFn save;
  uint64_t raw_per_wire = 1;  // what fp32 / the own dtype would send per byte sent (records' bytes_raw)
};

class OpQueue {
 public:
  OpQueue(int rank, const XirangConfig& cfg, Membership& membership, Records& records);
  ~OpQueue();
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  void start();  // the communication thread
  // Stops taking operations, runs those queued and joins the thread.
  void stop();
  void wake() { cv_.notify_all(); }

  // Queues an operation (caller's thread): its stage binds the tensors of spec (the bound
  // ones), fn runs on the communication thread. Throws c10::Error once the group is poisoned or
  // shut down.
  //
  // A small synchronous operation (spec.sync, at most XIRANG_SMALL_BYTES, host tensors, not
  // elastic) that finds the queue empty and the communication thread idle runs at once on the
  // caller's thread instead, in its turn all the same (the communication thread takes the next
  // operation only after it): the caller waits for it anyway, and the two thread hand-overs
  // (queue -> communication thread -> Work.wait()) cost more than such an operation itself on
  // a loaded machine. The Work is complete when enqueue returns.
  c10::intrusive_ptr<WorkXirang> enqueue(OpSpec spec, std::shared_ptr<OpStage> stage, OpFn fn);

  // Records the group's first error (every later op raises it), stops this rank's heartbeat and,
  // the first time, calls the onPoison callback (the device engines' abort). Returns whether it
  // was the first one of a running group.
  bool poison(const std::string& msg);
  // Set once, before start().
  void onPoison(std::function<void(const std::string&)> fn) { on_poison_ = std::move(fn); }
  // Throws c10::Error once the group is poisoned or shut down.
  void checkPoisoned();
  // The group's first error ("" while there is none).
  std::string error();
  // Whether no operation is queued or running.
  bool idle();

  // Collectives issued so far (caller's thread); a spare starts after its admission op.
  uint64_t seq() const { return seq_; }
  void setSeq(uint64_t seq) { seq_ = seq; }

 private:
  std::string describe(const Op& op) const;
  void runLoop();
  // Runs `op` and returns its error (null: success).
  std::exception_ptr run(Op& op, Phases* ph);
  // run() with its record; returns the error the caller completes op.work with (the
  // communication thread does so once it is idle again). `first_error`: the group's poison when
  // the op was taken (the op fails with it instead of running).
  std::exception_ptr execute(Op& op, const std::string& first_error);

  const int rank_;
  const XirangConfig& cfg_;
  Membership& membership_;
  Records& records_;
  uint64_t seq_ = 0;  // caller's thread(s) only

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::atomic<uint64_t> pending_{0};  // queue_.size(), read without mu_ by the spin
  bool busy_ = false;  // an operation is running (on the communication thread or inline)
  uint64_t inline_max_bytes_ = 0;  // XIRANG_SMALL_BYTES: the largest op run inline
  std::chrono::microseconds spin_{0};  // XIRANG_SPIN_US
  bool stop_ = false;
  std::string poison_;
  std::thread thread_;
  std::function<void(const std::string&)> on_poison_;
};

}  // namespace xirang
