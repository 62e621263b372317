#include "backend/process_group_xirang.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "backend/completions.h"
#include "backend/host_engine.h"
#include "backend/store_adapter.h"
#include "backend/tensors.h"
#include "core/codec.h"
#include "core/env.h"
#include "core/generation.h"
#include "core/transport/nccl_link.h"

namespace xirang {

using transport::OpKind;

namespace {

// Profiler range names must outlive the RecordFunction that points at them: intern them.
const char* groupTitle(int64_t group_id) {
  if (group_id < 0) return "xirang:allreduce_ef";
  static std::mutex mu;
  static std::set<std::string> names;
  std::lock_guard<std::mutex> g(mu);
  return names.insert("xirang:group" + std::to_string(group_id)).first->c_str();
}

std::vector<at::Tensor> concat(std::vector<at::Tensor> a, const std::vector<at::Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

// ---------------------------------------------------------------- construction

namespace {
// The live groups, for shutdownAllForExit (leaked: groups may be destroyed during static teardown).
std::mutex& liveMu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::set<ProcessGroupXirang*>& liveGroups() {
  static auto* groups = new std::set<ProcessGroupXirang*>();
  return *groups;
}
}  // namespace

ProcessGroupXirang::ProcessGroupXirang(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       XirangConfig cfg)
    : Backend(rank, size), cfg_(std::move(cfg)) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "xirang: invalid rank ", rank, " for world size ", size);
  try {
    env::parseLogLevel();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  store_ = std::make_shared<StoreAdapter>(cfg_.elastic ? ownConnection(store) : store);
  if (cfg_.generation.empty())
    cfg_.generation = agreeGeneration(store, rank, size, cfg_.timeout, cfg_.join, cfg_.group_name);
  // Before anything starts a thread: a CUDA transport that cannot work fails the creation here.
  engines_.configure({.store = store_, .key_ns = generation::keyNamespace(cfg_.generation), .group_name = cfg_.group_name,
                      .rank = rank, .size = size, .elastic = cfg_.elastic, .timeout = cfg_.timeout,
                      .host_shm = [this] { return membership_ && membership_->shmRanks().size() > 1; },
                      .peer_gone = [this](int peer) { return membership_ ? membership_->peerGone(peer) : std::string(); }});
  std::string algo;
  Comm comm = configure(rank, size, cfg_, algo);
  records_ = std::make_unique<Records>(rank, size, cfg_);
  XR_CHECK(rank, !cfg_.join || cfg_.elastic,
           "XIRANG_JOIN=1 (a spare taking a dead rank's place) needs elastic mode (XIRANG_ELASTIC=1)");
  // Every key of this creation lives under its generation: a store shared with an earlier
  // creation (torchrun's restarts) still holds that one's abort, secret and addresses.
  membership_ = std::make_unique<Membership>(rank, size, cfg_, store_, generation::keyNamespace(cfg_.generation),
                                             std::move(comm),
                                             Membership::Callbacks{[this](const std::string& msg) { queue_->poison(msg); },
                                                                   [this] { queue_->wake(); }});
  std::ostringstream ring, shm;
  for (int r : membership_->info().ring) ring << r << " ";
  for (int r : membership_->shmRanks()) shm << r << " ";
  env::log(env::Level::Info, rank,
           "group '" + cfg_.group_name + "' size " + std::to_string(size) + " address " + address() + " algorithm " +
               algo + " ring [ " + ring.str() + "] shared memory [ " + shm.str() + "] codec " +
               codec::pathName(codec::activePath()));
  records_->start();
  queue_ = std::make_unique<OpQueue>(rank, cfg_, *membership_, *records_);
  queue_->onPoison([this](const std::string& msg) { engines_.abort(msg); });  // an NCCL wait fails at once
  p2p_ = std::make_unique<PointToPoint>(rank, cfg_, *queue_, *membership_, *records_, engines_);
  queue_->setSeq(membership_->start());
  queue_->start();
  std::lock_guard<std::mutex> g(liveMu());
  liveGroups().insert(this);
}

ProcessGroupXirang::~ProcessGroupXirang() {
  {
    std::lock_guard<std::mutex> g(liveMu());
    liveGroups().erase(this);
  }
  shutdown();
}

void ProcessGroupXirang::shutdownAllForExit(std::chrono::milliseconds drain) {
  transport::NcclLink::leakAtExit();  // groups freed after this make no NCCL or CUDA call
  {
    std::lock_guard<std::mutex> g(liveMu());
    for (ProcessGroupXirang* pg : liveGroups()) {
      // Queued operations would otherwise run at the group's destruction, each up to its timeout.
      // (Elastic groups: a rank that leaves is a lost rank the others rebuild without; no abort.)
      if (pg->queue_ && !pg->cfg_.elastic && !pg->queue_->idle())
        pg->abortWith(rankPrefix(pg->rank_) + "the process exited with operations of group '" + pg->cfg_.group_name +
                      "' pending");
      else
        pg->shutdown();
    }
  }
  Completions::instance().drain(Clock::now() + drain);
}

std::string ProcessGroupXirang::agreeGeneration(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout, bool join,
                                                const std::string& group_name) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "xirang: invalid rank ", rank, " for world size ", size);
  StoreAdapter adapter(store);
  const auto deadline = Clock::now() + timeout;
  try {
    return join ? generation::live(adapter, deadline) : generation::agree(adapter, rank, size, deadline);
  } catch (const std::exception& e) {
    XR_CHECK(rank, false, "creating group '", group_name, "' failed: ", e.what());
  }
}

void ProcessGroupXirang::shutdown() {
  if (membership_) membership_->stop();
  if (queue_) queue_->stop();
  if (membership_) membership_->close();
  if (records_) records_->stop();
}

void ProcessGroupXirang::abort() { abortWith(rankPrefix(rank_) + "process group aborted"); }

void ProcessGroupXirang::abortWith(const std::string& why) {
  if (queue_) {
    queue_->poison(why);
    membership_->abort(queue_->error());
  }
  shutdown();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::enqueue(OpSpec spec, std::shared_ptr<OpStage> stage, OpFn fn) {
  auto work = queue_->enqueue(std::move(spec), std::move(stage), std::move(fn));
  coalescing_.add(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::postP2P(bool is_send, int peer, int tag, const at::Tensor& t,
                                                           c10d::OpType type, const char* title) {
  auto work = p2p_->post(is_send, peer, tag, t, type, title);
  coalescing_.add(work);
  return work;
}

void ProcessGroupXirang::startCoalescing() { coalescing_.start(rank_); }

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::endCoalescing() { return coalescing_.end(rank_, cfg_.group_name); }

void ProcessGroupXirang::setSequenceNumberForGroup() {}  // every rank starts at 0: nothing to agree on

uint64_t ProcessGroupXirang::getSequenceNumberForGroup() { return queue_->seq(); }

// ---------------------------------------------------------------- collectives
//
// Every entry point: the stage of its tensors' engine (stageFor, or hostStage() for ops with a
// host path only), the tensors bound through it, the checks on the bound tensors, the op queued
// with its body from host_engine.h.

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse)
    return allreduceSparse(tensors, opts);
  auto stage = engines_.stageFor(tensors);
  std::vector<at::Tensor> ts = stage->bind(tensors, true, true);
  XR_CHECK(rank_, ts.size() == 1, "allreduce takes exactly one tensor per process, got ", ts.size());
  checkTensors(rank_, "allreduce", ts, stage->bindsDevice());
  at::Tensor t = ts[0];
  const ReduceOp op = toReduceOp(opts.reduceOp);
  checkReduce(rank_, "allreduce", t.scalar_type(), op);
  const double premul = scaleOf(opts.reduceOp, op);
  return enqueue({.type = c10d::OpType::ALLREDUCE, .title = "xirang:all_reduce", .kind = OpKind::Allreduce,
                  .outputs = ts, .inputs = ts, .dtype = toDType(t.scalar_type()), .reduce = op,
                  .numel = static_cast<uint64_t>(t.numel()), .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, t, op, premul](OpCtx& ctx) { host::allreduce(stage->comm(comm(), ctx), ctx, t, op, premul); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  auto stage = engines_.stageFor(tensors);
  std::vector<at::Tensor> ts = stage->bind(tensors, true, true);
  XR_CHECK(rank_, !ts.empty(), "allreduce_coalesced: no tensors");
  checkTensors(rank_, "allreduce_coalesced", ts, stage->bindsDevice());
  uint64_t total = 0;
  for (auto& t : ts) {
    checkSameType(rank_, "allreduce_coalesced", ts[0], t);
    total += static_cast<uint64_t>(t.numel());
  }
  const ReduceOp op = toReduceOp(opts.reduceOp);
  checkReduce(rank_, "allreduce_coalesced", ts[0].scalar_type(), op);
  const double premul = scaleOf(opts.reduceOp, op);
  return enqueue({.type = c10d::OpType::ALLREDUCE_COALESCED, .title = "xirang:all_reduce_coalesced",
                  .kind = OpKind::Allreduce, .outputs = ts, .inputs = ts, .dtype = toDType(ts[0].scalar_type()),
                  .reduce = op, .numel = total, .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, ts, op, premul](OpCtx& ctx) { host::allreduceCoalesced(stage->comm(comm(), ctx), ctx, ts, op, premul); });
}

// One sparse COO CPU tensor, ReduceOp.SUM (host::allreduceSparse). The Work's result() and
// Future hold the input tensor, whose indices and values the sum replaces: DDP's sparse gradient
// buckets read it from the Future.
c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allreduceSparse(std::vector<at::Tensor>& tensors,
                                                                   const c10d::AllreduceOptions& opts) {
  at::Tensor t = tensors[0];
  XR_CHECK(rank_, t.device().is_cpu(), "allreduce: sparse tensors must be on the CPU, got ", t.device(),
           " (move the tensor to the CPU, or use 'cuda:nccl' for sparse CUDA tensors)");
  XR_CHECK(rank_, opts.reduceOp == c10d::ReduceOp::SUM,
           "allreduce: sparse tensors support only ReduceOp.SUM (as gloo), got ", reduceOpName(toReduceOp(opts.reduceOp)));
  XR_CHECK(rank_, t.dim() <= host::kSparseMaxDims, "allreduce: sparse tensors of at most ", host::kSparseMaxDims,
           " dimensions, got ", t.dim());
  return enqueue({.type = c10d::OpType::_ALLREDUCE_SPARSE, .title = "xirang:sparse_all_reduce",
                  .kind = OpKind::Allgather, .outputs = tensors, .inputs = tensors, .dtype = toDType(t.scalar_type()),
                  .reduce = ReduceOp::Sum, .numel = static_cast<uint64_t>(t.numel()), .timeout = opts.timeout, .sync = !opts.asyncOp},
                 hostStage(), [this, t](OpCtx& ctx) { host::allreduceSparse(comm(), ctx, t, size_); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allreduceEF(at::Tensor buffer, at::Tensor residual,
                                                               at::Tensor staged, int64_t group_id, std::string label,
                                                               std::vector<at::Tensor> plain, std::string wire_name,
                                                               std::vector<at::Tensor> pack_into,
                                                               std::vector<at::Tensor> pack_from) {
  codec::Wire wire = codec::Wire::BF16;
  try {
    wire = codec::wireFromName(wire_name);
  } catch (const std::invalid_argument& e) {
    XR_CHECK(rank_, false, "allreduce_ef: ", e.what());
  }
  const std::string op = efOpName(wire);
  // Before binding: the host mirrors of CUDA tensors never alias.
  XR_CHECK(rank_, !(staged.defined() && residual.defined() && staged.is_alias_of(residual)),
           op, ": staged must not share storage with residual");
  auto stage = engines_.stageFor(concat({buffer, residual, staged}, plain));
  buffer = stage->bind(buffer, true, true);
  residual = stage->bind(residual, true, false);
  staged = stage->bind(staged, false, true);
  plain = stage->bind(plain, true, true);
  checkTensors(rank_, op.c_str(), {buffer, residual, staged}, stage->bindsDevice());
  checkTensors(rank_, op.c_str(), plain, stage->bindsDevice());
  for (const auto& t : plain)
    XR_CHECK(rank_, t.is_floating_point(), op, ": plain tensors must be floating, got ", t.scalar_type());
  for (const auto* t : {&buffer, &residual, &staged}) {
    XR_CHECK(rank_, t->scalar_type() == at::kFloat && t->dim() == 1 && t->is_contiguous(),
             op, ": buffer, residual and staged must be 1-D contiguous float32, got ", t->scalar_type(),
             " of shape ", t->sizes());
  }
  XR_CHECK(rank_, residual.numel() == buffer.numel() && staged.numel() == buffer.numel(), op, ": residual (",
           residual.numel(), ") and staged (", staged.numel(), ") must have the buffer's ", buffer.numel(), " elements");
  uint64_t numel = static_cast<uint64_t>(buffer.numel());
  for (const auto& t : plain) numel += static_cast<uint64_t>(t.numel());
  std::vector<at::Tensor> outs = concat({buffer}, plain);
  XR_CHECK(rank_, pack_into.size() == pack_from.size(), op, ": pack_into has ", pack_into.size(),
           " tensors, pack_from ", pack_from.size());
  for (size_t i = 0; i < pack_into.size(); ++i) {
    const at::Tensor& d = pack_into[i];
    const at::Tensor& s = pack_from[i];
    XR_CHECK(rank_, d.defined() && s.defined() && d.is_cpu() && s.is_cpu() && buffer.is_cpu(), op, ": pack ", i,
             ": packing is for CPU tensors (the caller packs CUDA gradients on their device)");
    XR_CHECK(rank_, d.scalar_type() == s.scalar_type() && d.numel() == s.numel() && d.is_contiguous(), op, ": pack ",
             i, ": pack_into (", d.scalar_type(), ", ", d.numel(), " elements", d.is_contiguous() ? "" : ", strided",
             ") and pack_from (", s.scalar_type(), ", ", s.numel(), " elements) must match, pack_into contiguous");
    XR_CHECK(rank_, std::any_of(outs.begin(), outs.end(), [&](const at::Tensor& o) { return d.is_alias_of(o); }),
             op, ": pack ", i, ": pack_into must be a view of buffer or of a plain tensor");
  }
  // Elastic mode: the hook's op is retried on the rebuilt ring from a copy of its inputs (the
  // residual is only read; the new one is rewritten into staged), averaged over the live ranks.
  SaveFn save;
  if (cfg_.elastic)
    save = [outs]() -> std::function<void()> {
      std::vector<at::Tensor> copies;
      for (const auto& t : outs) copies.push_back(t.clone());
      return [outs, copies] {
        for (size_t i = 0; i < outs.size(); ++i) outs[i].copy_(copies[i]);
      };
    };
  return enqueue({.type = c10d::OpType::ALLREDUCE, .title = groupTitle(group_id), .kind = OpKind::AllreduceEF,
                  .outputs = outs, .inputs = outs, .dtype = DType::Float32, .reduce = ReduceOp::Avg, .numel = numel,
                  .group_id = group_id, .label = std::move(label), .save = std::move(save), .wire = wire},
                 stage, [this, stage, buffer, residual, staged, plain, wire, pack_into, pack_from](OpCtx& ctx) {
                   host::allreduceEF(stage->comm(comm(), ctx), ctx, buffer, residual, staged, plain, wire, pack_into,
                                     pack_from);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  auto stage = engines_.stageFor(tensors);
  const bool is_root = opts.rootRank == rank_;
  std::vector<at::Tensor> ts = stage->bind(tensors, /*copy_in=*/is_root, /*copy_out=*/!is_root);
  XR_CHECK(rank_, ts.size() == 1, "broadcast takes exactly one tensor per process, got ", ts.size());
  checkTensors(rank_, "broadcast", ts, stage->bindsDevice());
  XR_CHECK(rank_, opts.rootRank >= 0 && opts.rootRank < size_, "broadcast: invalid root ", opts.rootRank);
  at::Tensor t = ts[0];
  const int root = static_cast<int>(opts.rootRank);
  return enqueue({.type = c10d::OpType::BROADCAST, .title = "xirang:broadcast", .kind = OpKind::Broadcast,
                  .outputs = ts, .inputs = ts, .dtype = toDType(t.scalar_type()),
                  .numel = static_cast<uint64_t>(t.numel()), .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, t, root](OpCtx& ctx) {
                   if (!membership_->live(root))
                     throw MembershipChanged(rankPrefix(rank_) + "broadcast: root rank " +
                                             std::to_string(root) + " is not live (" + membership_->text() + ")");
                   host::broadcast(stage->comm(comm(), ctx), ctx, t, root);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  auto stage = engines_.stageFor(tensors);
  std::vector<at::Tensor> ts = stage->bind(tensors, true, /*copy_out=*/opts.rootRank == rank_);
  XR_CHECK(rank_, ts.size() == 1, "reduce takes exactly one tensor per process");
  checkTensors(rank_, "reduce", ts, stage->bindsDevice());
  XR_CHECK(rank_, opts.rootRank >= 0 && opts.rootRank < size_, "reduce: invalid root ", opts.rootRank);
  at::Tensor t = ts[0];
  const ReduceOp op = toReduceOp(opts.reduceOp);
  checkReduce(rank_, "reduce", t.scalar_type(), op);
  const double premul = scaleOf(opts.reduceOp, op);
  const int root = static_cast<int>(opts.rootRank);
  return enqueue({.type = c10d::OpType::REDUCE, .title = "xirang:reduce", .kind = OpKind::Reduce, .outputs = ts,
                  .inputs = ts, .dtype = toDType(t.scalar_type()), .reduce = op,
                  .numel = static_cast<uint64_t>(t.numel()), .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, t, op, premul, root](OpCtx& ctx) { host::reduce(stage->comm(comm(), ctx), ctx, t, op, premul, root); });
}

namespace {
// The stage of an op from one input tensor into one output tensor (the *_base ops), and the two
// bound to it (input copied in, output copied out), checked for `name`: dense, one dtype.
std::shared_ptr<OpStage> bindPair(DeviceEngines& engines, int rank, const char* name, at::Tensor& output_,
                                  at::Tensor& input_, at::Tensor& output, at::Tensor& input) {
  auto stage = engines.stageFor({output_, input_});
  output = stage->bind(output_, false, true);
  input = stage->bind(input_, true, false);
  checkTensors(rank, name, {output, input}, stage->bindsDevice());
  checkSameType(rank, name, output, input);
  return stage;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::_allgather_base(at::Tensor& output_, at::Tensor& input_,
                                                                   const c10d::AllgatherOptions& opts) {
  at::Tensor output, input;
  auto stage = bindPair(engines_, rank_, "allgather_into_tensor", output_, input_, output, input);
  XR_CHECK(rank_, output.numel() == input.numel() * size_, "allgather_into_tensor: output has ", output.numel(),
           " elements, expected world size ", size_, " x input ", input.numel());
  return enqueue({.type = c10d::OpType::_ALLGATHER_BASE, .title = "xirang:all_gather_into_tensor",
                  .kind = OpKind::Allgather, .outputs = {output}, .inputs = {input},
                  .dtype = toDType(input.scalar_type()), .numel = static_cast<uint64_t>(input.numel()),
                  .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, output, input](OpCtx& ctx) { host::allgatherBase(stage->comm(comm(), ctx), ctx, output, input, size_); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allgather(std::vector<std::vector<at::Tensor>>& outputs_,
                                                             std::vector<at::Tensor>& inputs_,
                                                             const c10d::AllgatherOptions& opts) {
  auto stage = engines_.stageFor(outputs_.empty() ? inputs_ : concat(inputs_, outputs_[0]));
  std::vector<std::vector<at::Tensor>> outputs;
  for (const auto& l : outputs_) outputs.push_back(stage->bind(l, false, true));
  std::vector<at::Tensor> inputs = stage->bind(inputs_, true, false);
  XR_CHECK(rank_, inputs.size() == 1 && outputs.size() == 1,
           "allgather takes one input tensor and one output list per process");
  XR_CHECK(rank_, static_cast<int>(outputs[0].size()) == size_, "allgather: output list has ", outputs[0].size(),
           " tensors, expected world size ", size_);
  at::Tensor in = inputs[0];
  checkTensors(rank_, "allgather", inputs, stage->bindsDevice());
  checkTensors(rank_, "allgather", outputs[0], stage->bindsDevice());
  for (auto& o : outputs[0]) {
    checkSameType(rank_, "allgather", in, o);
    XR_CHECK(rank_, o.numel() == in.numel(), "allgather: output tensor has ", o.numel(), " elements, input ",
             in.numel());
  }
  auto outs = outputs[0];
  return enqueue({.type = c10d::OpType::ALLGATHER, .title = "xirang:all_gather", .kind = OpKind::Allgather,
                  .outputs = outs, .inputs = inputs, .dtype = toDType(in.scalar_type()),
                  .numel = static_cast<uint64_t>(in.numel()), .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, outs, in](OpCtx& ctx) { host::allgather(stage->comm(comm(), ctx), ctx, outs, in, size_); });
}

// all_gather_coalesced: outputs[r][i] receives rank r's inputs[i] (torch's documented layout and
// gloo's: one list per rank, each of len(inputs) tensors), as one operation
// (host::allgatherCoalesced). As torch documents, shapes are not compared across ranks; the
// ranks' total element counts and bytes are. Future value: every output, outputs[0][0] first
// (rank-major).
c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs_,
                                                                       std::vector<at::Tensor>& inputs_,
                                                                       const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> all = inputs_;
  for (const auto& l : outputs_) all = concat(std::move(all), l);
  auto stage = engines_.stageFor(all);
  std::vector<std::vector<at::Tensor>> outputs;
  for (const auto& l : outputs_) outputs.push_back(stage->bind(l, false, true));
  std::vector<at::Tensor> inputs = stage->bind(inputs_, true, false);
  XR_CHECK(rank_, static_cast<int>(outputs.size()) == size_, "allgather_coalesced: got ", outputs.size(),
           " output lists, expected one per rank (world size ", size_,
           "): output_tensor_lists[r][i] receives rank r's input i");
  checkTensors(rank_, "allgather_coalesced", inputs, stage->bindsDevice());
  uint64_t bytes = 0, numel = 0;
  bool one_dtype = true;
  for (const auto& in : inputs) {
    bytes += nbytes(in);
    numel += static_cast<uint64_t>(in.numel());
    one_dtype = one_dtype && in.scalar_type() == inputs[0].scalar_type();
  }
  std::vector<at::Tensor> flat_outs;
  for (int r = 0; r < size_; ++r) {
    XR_CHECK(rank_, outputs[r].size() == inputs.size(), "allgather_coalesced: output list ", r, " has ",
             outputs[r].size(), " tensors for ", inputs.size(), " inputs");
    checkTensors(rank_, "allgather_coalesced", outputs[r], stage->bindsDevice());
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& o = outputs[r][i];
      checkSameType(rank_, "allgather_coalesced", inputs[i], o);
      XR_CHECK(rank_, o.numel() == inputs[i].numel(), "allgather_coalesced: output [", r, "][", i, "] has ", o.numel(),
               " elements, input ", i, " has ", inputs[i].numel());
      flat_outs.push_back(o);
    }
  }
  const DType dtype = inputs.empty() ? DType::Bytes : one_dtype ? toDType(inputs[0].scalar_type()) : DType::Bytes;
  return enqueue({.type = c10d::OpType::ALLGATHER_COALESCED, .title = "xirang:all_gather_coalesced",
                  .kind = OpKind::Allgather, .outputs = flat_outs, .inputs = inputs, .dtype = dtype, .numel = numel,
                  .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, inputs, outputs, bytes](OpCtx& ctx) {
                   host::allgatherCoalesced(stage->comm(comm(), ctx), ctx, inputs, outputs, bytes, size_);
                 });
}

namespace {
// The *_tensor_coalesced ops: one op per (output, input) pair, through `one`. Ops complete in
// queue order, so the last Work completes after all of them.
template <class One>
c10::intrusive_ptr<c10d::Work> eachPair(int rank, const char* name, std::vector<at::Tensor>& outputs,
                                        std::vector<at::Tensor>& inputs, One&& one) {
  XR_CHECK(rank, outputs.size() == inputs.size() && !inputs.empty(), name, ": ", outputs.size(), " outputs for ",
           inputs.size(), " inputs");
  c10::intrusive_ptr<c10d::Work> last;
  for (size_t i = 0; i < inputs.size(); ++i) last = one(outputs[i], inputs[i]);
  return last;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                   std::vector<at::Tensor>& inputs,
                                                                                   const c10d::AllgatherOptions& opts) {
  return eachPair(rank_, "allgather_into_tensor_coalesced", outputs, inputs,
                  [&](at::Tensor& o, at::Tensor& i) { return _allgather_base(o, i, opts); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  XR_CHECK(rank_, input.numel() == output.numel() * size_, "reduce_scatter_tensor: input has ", input.numel(),
           " elements, expected world size ", size_, " x output ", output.numel());
  return reduceScatterBlocks(output, input, std::vector<int64_t>(static_cast<size_t>(size_), output.numel()), opts,
                             "reduce_scatter_tensor");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::reduceScatterBlocks(at::Tensor& output_, at::Tensor& input_,
                                                                       const std::vector<int64_t>& counts,
                                                                       const c10d::ReduceScatterOptions& opts,
                                                                       const char* name) {
  at::Tensor output, input;
  auto stage = bindPair(engines_, rank_, name, output_, input_, output, input);
  const ReduceOp op = toReduceOp(opts.reduceOp);
  checkReduce(rank_, name, input.scalar_type(), op);
  const double premul = scaleOf(opts.reduceOp, op);
  return enqueue({.type = c10d::OpType::_REDUCE_SCATTER_BASE, .title = "xirang:reduce_scatter_tensor",
                  .kind = OpKind::ReduceScatter, .outputs = {output}, .inputs = {input},
                  .dtype = toDType(input.scalar_type()), .reduce = op, .numel = static_cast<uint64_t>(input.numel()),
                  .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, output, input, counts, op, premul](OpCtx& ctx) {
                   host::reduceScatterBase(stage->comm(comm(), ctx), ctx, output, input, counts, op, premul, size_);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  XR_CHECK(rank_, outputs.size() == 1 && inputs.size() == 1,
           "reduce_scatter takes one output tensor and one input list per process");
  XR_CHECK(rank_, static_cast<int>(inputs[0].size()) == size_, "reduce_scatter: input list has ", inputs[0].size(),
           " tensors, expected world size ", size_);
  // CUDA tensors pass: the concatenated input and the output go through _reduce_scatter_base's stage.
  checkTensors(rank_, "reduce_scatter", outputs, /*cuda_ok=*/true);
  checkTensors(rank_, "reduce_scatter", inputs[0], /*cuda_ok=*/true);
  // Chunks may differ in size, as gloo allows (chunk r of every rank has the same size, and
  // rank r's output has it): the blocks of the reduce-scatter are the chunks.
  std::vector<int64_t> counts;
  std::vector<at::Tensor> flat;
  for (auto& t : inputs[0]) {
    checkSameType(rank_, "reduce_scatter", outputs[0], t);
    counts.push_back(t.numel());
    flat.push_back(t.reshape(-1));
  }
  XR_CHECK(rank_, outputs[0].numel() == counts[static_cast<size_t>(rank_)], "reduce_scatter: this rank's input tensor ",
           rank_, " has ", counts[static_cast<size_t>(rank_)], " elements, the output ", outputs[0].numel());
  at::Tensor input = at::cat(flat);
  at::Tensor output = outputs[0];
  return reduceScatterBlocks(output, input, counts, opts, "reduce_scatter");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                   std::vector<at::Tensor>& inputs,
                                                                                   const c10d::ReduceScatterOptions& opts) {
  return eachPair(rank_, "reduce_scatter_tensor_coalesced", outputs, inputs,
                  [&](at::Tensor& o, at::Tensor& i) { return _reduce_scatter_base(o, i, opts); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::alltoall_base(at::Tensor& output_, at::Tensor& input_,
                                                                 std::vector<int64_t>& outputSplits,
                                                                 std::vector<int64_t>& inputSplits,
                                                                 const c10d::AllToAllOptions& opts) {
  at::Tensor output, input;
  auto stage = bindPair(engines_, rank_, "alltoall_base", output_, input_, output, input);
  auto in_rows = alltoallRows(rank_, size_, input, inputSplits, "input");
  auto out_rows = alltoallRows(rank_, size_, output, outputSplits, "output");
  return enqueue({.type = c10d::OpType::ALLTOALL_BASE, .title = "xirang:all_to_all", .kind = OpKind::Alltoall,
                  .outputs = {output}, .inputs = {input}, .dtype = toDType(input.scalar_type()),
                  .numel = static_cast<uint64_t>(input.numel()), .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, output, input, in_rows, out_rows](OpCtx& ctx) {
                   host::alltoallBase(stage->comm(comm(), ctx), ctx, output, input, in_rows, out_rows, size_);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::alltoall(std::vector<at::Tensor>& outputs_,
                                                            std::vector<at::Tensor>& inputs_,
                                                            const c10d::AllToAllOptions& opts) {
  auto stage = engines_.stageFor(concat(inputs_, outputs_));
  std::vector<at::Tensor> inputs = stage->bind(inputs_, true, false);
  std::vector<at::Tensor> outputs = stage->bind(outputs_, false, true);
  XR_CHECK(rank_, static_cast<int>(outputs.size()) == size_ && static_cast<int>(inputs.size()) == size_,
           "alltoall: expected ", size_, " input and output tensors, got ", inputs.size(), " and ", outputs.size());
  checkTensors(rank_, "alltoall", inputs, stage->bindsDevice());
  checkTensors(rank_, "alltoall", outputs, stage->bindsDevice());
  for (auto& t : inputs) checkSameType(rank_, "alltoall", inputs[0], t);
  for (auto& t : outputs) checkSameType(rank_, "alltoall", inputs[0], t);
  uint64_t total = 0;
  for (auto& t : inputs) total += static_cast<uint64_t>(t.numel());
  return enqueue({.type = c10d::OpType::ALLTOALL, .title = "xirang:all_to_all", .kind = OpKind::Alltoall,
                  .outputs = outputs, .inputs = inputs, .dtype = toDType(inputs[0].scalar_type()), .numel = total,
                  .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage,
                 [this, stage, outs = outputs, ins = inputs](OpCtx& ctx) { host::alltoall(stage->comm(comm(), ctx), ctx, outs, ins, size_); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::gather(std::vector<std::vector<at::Tensor>>& outputs_,
                                                          std::vector<at::Tensor>& inputs_,
                                                          const c10d::GatherOptions& opts) {
  auto stage = engines_.stageFor(outputs_.empty() ? inputs_ : concat(inputs_, outputs_[0]));
  std::vector<std::vector<at::Tensor>> outputs;
  for (const auto& l : outputs_) outputs.push_back(stage->bind(l, false, true));
  std::vector<at::Tensor> inputs = stage->bind(inputs_, true, false);
  XR_CHECK(rank_, inputs.size() == 1, "gather takes exactly one input tensor");
  checkTensors(rank_, "gather", inputs, stage->bindsDevice());
  const int root = static_cast<int>(opts.rootRank);
  XR_CHECK(rank_, root >= 0 && root < size_, "gather: invalid root ", root);
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = rootList(rank_, size_, root, "gather", in, outputs, "output", "input", stage->bindsDevice());
  return enqueue({.type = c10d::OpType::GATHER, .title = "xirang:gather", .kind = OpKind::Gather, .outputs = outs,
                  .inputs = inputs, .dtype = toDType(in.scalar_type()), .numel = static_cast<uint64_t>(in.numel()),
                  .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, in, outs, root](OpCtx& ctx) { host::gather(stage->comm(comm(), ctx), ctx, in, outs, root); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::scatter(std::vector<at::Tensor>& outputs_,
                                                           std::vector<std::vector<at::Tensor>>& inputs_,
                                                           const c10d::ScatterOptions& opts) {
  auto stage = engines_.stageFor(inputs_.empty() ? outputs_ : concat(outputs_, inputs_[0]));
  std::vector<std::vector<at::Tensor>> inputs;
  for (const auto& l : inputs_) inputs.push_back(stage->bind(l, true, false));
  std::vector<at::Tensor> outputs = stage->bind(outputs_, false, true);
  XR_CHECK(rank_, outputs.size() == 1, "scatter takes exactly one output tensor");
  checkTensors(rank_, "scatter", outputs, stage->bindsDevice());
  const int root = static_cast<int>(opts.rootRank);
  XR_CHECK(rank_, root >= 0 && root < size_, "scatter: invalid root ", root);
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins = rootList(rank_, size_, root, "scatter", out, inputs, "input", "output", stage->bindsDevice());
  return enqueue({.type = c10d::OpType::SCATTER, .title = "xirang:scatter", .kind = OpKind::Scatter,
                  .outputs = outputs, .inputs = ins, .dtype = toDType(out.scalar_type()),
                  .numel = static_cast<uint64_t>(out.numel()), .timeout = opts.timeout, .sync = !opts.asyncOp},
                 stage, [this, stage, out, ins, root](OpCtx& ctx) { host::scatter(stage->comm(comm(), ctx), ctx, out, ins, root); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::barrier(const c10d::BarrierOptions& opts) {
  return enqueue({.type = c10d::OpType::BARRIER, .title = "xirang:barrier", .kind = OpKind::Barrier,
                  .dtype = DType::UInt8, .reduce = ReduceOp::Max, .numel = 1, .timeout = opts.timeout, .sync = !opts.asyncOp},
                 hostStage(), [this](OpCtx& ctx) { host::barrier(comm(), ctx); });
}

// ---------------------------------------------------------------- elastic mode

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::admitJoiners(int64_t expect, double wait_s) {
  XR_CHECK(rank_, cfg_.elastic,
           "admit_joiners needs elastic mode (xirang.Options(elastic=True) or XIRANG_ELASTIC=1)");
  XR_CHECK(rank_, expect >= 0 && wait_s >= 0, "admit_joiners: expect (", expect, ") and wait_s (", wait_s,
           ") must be >= 0");
  return enqueue({.type = c10d::OpType::BARRIER, .title = "xirang:admit_joiners", .kind = OpKind::Admit,
                  .dtype = DType::UInt8},
                 hostStage(), [this, expect, wait_s](OpCtx& ctx) { membership_->admit(ctx, expect, wait_s); });
}

// ---------------------------------------------------------------- point to point (p2p.h)

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  XR_CHECK(rank_, tensors.size() == 1, "send takes exactly one tensor");
  checkTensors(rank_, "send", tensors, /*cuda_ok=*/true);
  XR_CHECK(rank_, dstRank >= 0 && dstRank < size_ && dstRank != rank_, "send: invalid peer ", dstRank);
  return postP2P(true, dstRank, tag, tensors[0], c10d::OpType::SEND, "xirang:send");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  XR_CHECK(rank_, tensors.size() == 1, "recv takes exactly one tensor");
  checkTensors(rank_, "recv", tensors, /*cuda_ok=*/true);
  XR_CHECK(rank_, srcRank >= 0 && srcRank < size_ && srcRank != rank_, "recv: invalid peer ", srcRank);
  return postP2P(false, srcRank, tag, tensors[0], c10d::OpType::RECV, "xirang:recv");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  XR_CHECK(rank_, tensors.size() == 1, "recv takes exactly one tensor");
  checkTensors(rank_, "recv", tensors, /*cuda_ok=*/true);
  return postP2P(false, -1, tag, tensors[0], c10d::OpType::RECVANYSOURCE, "xirang:recv_anysource");
}

}  // namespace xirang
