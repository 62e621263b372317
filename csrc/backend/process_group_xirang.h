// ProcessGroupXirang: the c10d::Backend behind torch.distributed's "xirang" backend.
//
// This class is the c10d overrides: each validates its arguments, builds the op and hands it on.
// The parts it is made of, each in its own file:
//   device_engine.h  which engine runs an op on tensors of a device (host; host-staged CUDA)
//   host_engine.h    the ops' bodies on host tensors (the core's algorithms)
//   op_queue.h       the communication thread: ordering, deadlines, poisoning, completion
//   elastic.h        membership: the transport and ring per epoch, elastic recovery, spares
//                    (elastic.cc; the spares' joining in elastic_spares.cc)
//   p2p.h            point-to-point, posted to the transport's own engine
//   work.h           the Work of an op and of a coalesced batch
//   completions.h    the threads that complete Works whose Future is held (callbacks off the comm thread)
//   records.h        operation records and their JSON lines
//   tensors.h        dtype / reduce-op mapping and input checks
//   config.h         what the group is created with, and the algorithms' configuration from it
//   store_adapter.h  torch's c10d::Store as the core's store
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "backend/config.h"
#include "backend/device_engine.h"
#include "backend/elastic.h"
#include "backend/op_queue.h"
#include "backend/p2p.h"
#include "backend/records.h"
#include "backend/work.h"

namespace xirang {

class ProcessGroupXirang : public c10d::Backend {
 public:
  // Connects nothing yet: the listener is opened and its address published to `store`;
  // connections to peers are made by the first operation that needs them.
  // Same-host ranks also get a shared-memory domain (XIRANG_TRANSPORT_LOCAL, elastic.h).
  // Throws c10::Error if the store times out or no address can be bound, or (shm) shared memory
  // cannot serve this rank's same-host ranks (naming them and why), std::invalid_argument
  // (Python ValueError) for a bad knob value.
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
  // At interpreter exit (an atexit handler; the GIL released): every live group is shut down, its
  // threads joined, as destroy_process_group would (aborted first, peers told, where operations
  // are still queued or running, outside elastic mode), then the completion threads are drained
  // for at most `drain`.
  // After it no xirang thread drops the last reference to a tensor: one that did while Python
  // finalizes would wait for the GIL and be ended by Python through a C++ destructor
  // (std::terminate, "terminate called without an active exception").
  static void shutdownAllForExit(std::chrono::milliseconds drain);
  void setTimeout(std::chrono::milliseconds timeout) override { cfg_.timeout = timeout; }

  // The hook's operation for one layer group: error-feedback allreduce (average) of a flat fp32
  // buffer with `wire` ("bf16": the compressed ring; "fp16", "int8": the direct form with one
  // fp32 scale per 1024 elements, codec.h: Wire), then a plain average of each `plain` tensor in
  // its own dtype, as one op. buffer, residual, staged: 1-D contiguous float32 CPU tensors of
  // equal numel; residual is read, the new residual is written to staged (must not share storage
  // with residual). pack_into / pack_from (CPU only, equal lengths): first, on the communication
  // thread, pack_into[i].copy_(pack_from[i]), each pack_into[i] a contiguous view of buffer or of
  // a plain tensor, pack_from[i] of its dtype and numel (the hook's packing of a layer group's
  // gradients, off the autograd thread; the sources are kept alive until the op ends). Future
  // value: [buffer, *plain]. Errors: c10::Error for bad arguments (an unknown wire name
  // included); every rank of the group must pass the same wire (a mismatch fails the op on every
  // rank, naming the frames that disagree).
  c10::intrusive_ptr<c10d::Work> allreduceEF(at::Tensor buffer, at::Tensor residual, at::Tensor staged,
                                             int64_t group_id, std::string label = "",
                                             std::vector<at::Tensor> plain = {}, std::string wire = "bf16",
                                             std::vector<at::Tensor> pack_into = {},
                                             std::vector<at::Tensor> pack_from = {});

  // This rank's operation records (bounded ring buffer, oldest first) and clearing them.
  std::vector<OpRecord> records() { return records_->snapshot(); }
  void clearRecords() { records_->clear(); }
  Records::Cost recordCost() const { return records_->cost(); }
  bool recordsOn() const { return records_->on(); }
  std::vector<int> ringOrder() { return membership().ring; }
  std::string address() const { return membership_->address(); }
  // The ranks of this rank's shared-memory domain (ascending; empty: every byte over TCP).
  std::vector<int> shmRanks() const { return membership_->shmRanks(); }
  uint64_t sequenceNumber() const { return queue_->seq(); }

  // Elastic mode. membership(): the current epoch, live ranks and last recovery.
  MembershipInfo membership() { return membership_->info(); }
  // A collective over the live ranks, at a step boundary: admits the spares (XIRANG_JOIN=1)
  // waiting to take dead ranks' places, if at least `expect` are waiting (the lowest live rank
  // waits up to wait_s seconds for them; fewer: none is admitted this time, so a DDP rebuild,
  // which needs every rank, can wait for a full group). The ring grows back (a new epoch) if
  // any joined; membership() then names the source rank of the training state. It starts with a
  // barrier over the live ranks. Errors: MembershipChanged if a rank fails meanwhile; a
  // mismatch error on every rank when a rank issued another collective instead; c10::Error
  // without elastic mode.
  c10::intrusive_ptr<c10d::Work> admitJoiners(int64_t expect, double wait_s);
  // fn runs on the communication thread after every rebuild (before the next op runs).
  void setMembershipCallback(std::function<void()> fn) { membership_->setCallback(std::move(fn)); }
  bool elastic() const { return cfg_.elastic; }
  const std::string& generation() const { return cfg_.generation; }

 private:
  // abort() with `why` as the group's error (poisons the queue, tells the peers), then shutdown().
  void abortWith(const std::string& why);
  // allreduce of one sparse COO CPU tensor (ReduceOp.SUM only, as gloo); see the .cc.
  c10::intrusive_ptr<c10d::Work> allreduceSparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  // reduce-scatter of `input`, cut into blocks of counts[r] elements for rank r (in rank order;
  // the same counts on every rank: a rank that disagrees gets the engine's size mismatch), into
  // `output` (counts[rank] elements; the callers check the sizes against the tensors). `name`
  // names the caller's op in errors.
  c10::intrusive_ptr<c10d::Work> reduceScatterBlocks(at::Tensor& output, at::Tensor& input,
                                                     const std::vector<int64_t>& counts,
                                                     const c10d::ReduceScatterOptions& opts, const char* name);
  // Queues a collective (op_queue.h) and adds its Work to an open coalescing batch.
  c10::intrusive_ptr<c10d::Work> enqueue(OpSpec spec, std::shared_ptr<OpStage> stage, OpFn fn);
  // A point-to-point operation (p2p.h), likewise.
  c10::intrusive_ptr<c10d::Work> postP2P(bool is_send, int peer, int tag, const at::Tensor& t, c10d::OpType type,
                                         const char* title);
  Comm& comm() { return membership_->comm(); }

  XirangConfig cfg_;  // first: the parts below hold references to it
  std::shared_ptr<transport::Store> store_;
  DeviceEngines engines_;
  std::unique_ptr<Records> records_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<OpQueue> queue_;
  std::unique_ptr<PointToPoint> p2p_;
  Coalescing coalescing_;
};

}  // namespace xirang
