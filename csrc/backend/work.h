// WorkXirang: the c10d::Work of one xirang operation, and the Work of a coalesced batch.
#pragma once

#include <exception>
#include <memory>
#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "backend/device_engine.h"
#include "backend/records.h"

namespace xirang {

class WorkXirang : public c10d::Work {
 public:
  // stage: how the op's tensors are held while it runs (device_engine.h): the Work's outputs
  // and its Future's devices are the user's, not the host mirrors a CUDA op runs on.
  WorkXirang(int rank, c10d::OpType type, const char* profilingTitle, std::vector<at::Tensor> outputs,
             const std::optional<std::vector<at::Tensor>>& inputs, std::shared_ptr<OpStage> stage);
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override { return source_rank_; }
  // Work.wait(timeout): bounds only this wait; on expiry raises naming the rank and the op.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // wait() calls this after completion: the caller's current stream waits for a CUDA op's
  // copies back (nothing for host tensors).
  void synchronize() override;
  bool isCompleted() override;
  // Called once, by the thread that ran the operation: completes the Future, then the Work. On
  // that thread when nobody holds the Future (no callback can run there); else on a thread of
  // Completions (completions.h), so a callback never runs on the communication thread.
  void complete(std::exception_ptr error);

  std::string desc_;  // "xirang rank R: <op> (op #seq, ...)" for messages
  int source_rank_ = -1;
  std::shared_ptr<WaitClock> wait_clock_;  // null when the group keeps no records (XIRANG_STATS=0)
  std::chrono::microseconds spin_{0};      // wait() polls this long before it sleeps (XIRANG_SPIN_US)

 private:
  void completeNow(std::exception_ptr error);

  std::vector<at::Tensor> outputs_;
  std::shared_ptr<OpStage> stage_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::mutex future_mu_;
  bool future_handed_ = false;     // getFuture() was called: callbacks may be attached
  std::atomic<bool> done_{false};  // completeNow() is finishing it: wait() may stop spinning
};

// Coalescing (batch_isend_irecv, the coalescing manager): the Works of the operations issued
// between start() and end(), which run as they are issued (point-to-point ones concurrently,
// collectives in order). The batch's Work stands for all of them, on the device too: its
// Future's devices are the members' (their union), and its wait()/synchronize() and Future make
// the caller's current streams wait for every member's copies and kernels, as each member's own
// would (CUDA: events recorded in the members' Future callbacks; nothing for host tensors).
class Coalescing {
 public:
  // Throws c10::Error naming the rank when a batch is already open / none is.
  void start(int rank);
  void add(const c10::intrusive_ptr<WorkXirang>& work) {
    if (open_) works_.push_back(work);
  }
  // The batch's Work: completes once every operation of the batch has, with the first error
  // among them (at once for an empty batch).
  c10::intrusive_ptr<WorkXirang> end(int rank, const std::string& group_name);

 private:
  bool open_ = false;
  std::vector<c10::intrusive_ptr<WorkXirang>> works_;
};

}  // namespace xirang
