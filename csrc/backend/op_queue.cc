#include "backend/op_queue.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <sstream>
#include <stdexcept>

#include "backend/tensors.h"
#include "core/env.h"

namespace xirang {

using transport::OpKind;

OpQueue::OpQueue(int rank, const XirangConfig& cfg, Membership& membership, Records& records)
    : rank_(rank), cfg_(cfg), membership_(membership), records_(records) {
  try {
    spin_ = spinKnob();
    inline_max_bytes_ = static_cast<uint64_t>(std::max<int64_t>(0, env::getInt("XIRANG_SMALL_BYTES")));
  } catch (const std::invalid_argument& e) {
    XR_CHECK(rank, false, e.what());
  }
}

OpQueue::~OpQueue() { stop(); }

void OpQueue::start() {
  thread_ = std::thread([this] { runLoop(); });
}

void OpQueue::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

bool OpQueue::poison(const std::string& msg) {
  bool first;
  {
    std::lock_guard<std::mutex> g(mu_);
    first = poison_.empty() && !stop_;
    if (poison_.empty()) poison_ = msg;
  }
  membership_.stopHeartbeat();
  if (first && on_poison_) on_poison_(msg);
  return first;
}

void OpQueue::checkPoisoned() {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(poison_.empty(), poison_);
  XR_CHECK(rank_, !stop_, "process group '", cfg_.group_name, "' was shut down");
}

std::string OpQueue::error() {
  std::lock_guard<std::mutex> g(mu_);
  return poison_;
}

bool OpQueue::idle() {
  std::lock_guard<std::mutex> g(mu_);
  return queue_.empty() && !busy_;
}

c10::intrusive_ptr<WorkXirang> OpQueue::enqueue(OpSpec spec, std::shared_ptr<OpStage> stage, OpFn fn) {
  checkPoisoned();
  auto work = c10::make_intrusive<WorkXirang>(rank_, spec.type, spec.title, std::move(spec.outputs),
                                              std::optional<std::vector<at::Tensor>>(spec.inputs), stage);
  if (stage->copies()) {
    stage->queued();
    fn = [stage, inner = std::move(fn)](OpCtx& ctx) { stage->run(ctx.deadline, [&] { inner(ctx); }); };
  }
  Op op;
  op.work = work;
  op.fn = std::move(fn);
  op.ctx.op = spec.kind;
  op.ctx.dtype = spec.dtype;
  op.ctx.reduce = spec.reduce;
  op.ctx.numel = spec.numel;
  op.ctx.seq = ++seq_;
  membership_.issued(op.ctx.seq);
  op.save = std::move(spec.save);
  op.timeout = spec.timeout.count() < 0 ? cfg_.timeout : spec.timeout;
  op.tls = at::ThreadLocalState();
  if (spec.kind == OpKind::AllreduceEF) {
    // fp32 over codes of 2 (bf16, fp16) or 1 byte (int8); the scales (0.4%) are not discounted.
    op.rec.op = efOpName(spec.wire);
    op.raw_per_wire = spec.wire == codec::Wire::INT8 ? 4 : 2;
  } else {
    op.rec.op = std::string(spec.title).substr(std::strlen("xirang:"));
  }
  if (records_.on()) {
    op.enqueued = Clock::now();
    op.rec.seq = op.ctx.seq;
    op.rec.group_id = spec.group_id;
    op.rec.engine = stage->engine();
    op.rec.label = std::move(spec.label);
    op.rec.dtype = dtypeName(spec.dtype);
    op.rec.numel = spec.numel;
    op.rec.t_enqueue = records_.since(op.enqueued);
    op.rec.wait = std::make_shared<WaitClock>();
    work->wait_clock_ = op.rec.wait;
    op.rec_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - op.enqueued).count());
  }
  op.what = describe(op);
  work->desc_ = rankPrefix(rank_) + op.what;
  work->spin_ = spin_;
  // After describe() (which names the buffers' float32): the frames of the hook's op carry the
  // wire's code type, so a rank passing another wire is a "wire mismatch" on every rank.
  if (spec.kind == OpKind::AllreduceEF) op.ctx.dtype = codec::wireDType(spec.wire);
  if (env::logLevel() >= env::Level::Trace) env::log(env::Level::Trace, rank_, "enqueue " + op.what);
  bool may_inline = spec.sync && !stage->copies() && !cfg_.elastic &&
                          spec.numel * elementSize(spec.dtype) <= inline_max_bytes_;
  std::string first_error;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!(may_inline && queue_.empty() && !busy_ && !stop_)) {
      queue_.push_back(std::move(op));
      pending_.fetch_add(1, std::memory_order_release);
      may_inline = false;
    } else {
      busy_ = true;  // the communication thread waits for it
      first_error = poison_;
    }
  }
  if (!may_inline) {
    cv_.notify_one();
    return work;
  }
  op.rec.on_caller = true;
  {
    WaitClock::Timer timer(work->wait_clock_.get());  // the caller blocks in the op itself: its exposed wait
    op.work->complete(execute(op, first_error));
  }
  bool queued;
  {
    std::lock_guard<std::mutex> g(mu_);
    busy_ = false;
    queued = !queue_.empty();
  }
  if (queued) cv_.notify_all();  // ops queued meanwhile wait for the communication thread (no wake-up otherwise)
  return work;
}

std::string OpQueue::describe(const Op& op) const {
  std::ostringstream s;
  s << op.rec.op << " (op #" << op.ctx.seq << ", " << dtypeName(op.ctx.dtype) << ", " << op.ctx.numel << " elements";
  if (op.ctx.reduce != ReduceOp::None) s << ", " << reduceOpName(op.ctx.reduce);
  s << ", group '" << cfg_.group_name << "')";
  return s.str();
}

std::exception_ptr OpQueue::run(Op& op, Phases* ph) {
  try {
    at::ThreadLocalStateGuard guard(op.tls);
    op.ctx.phases = ph;
    static const int64_t delay_ms = env::getInt("XIRANG_TEST_DELAY_MS");
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    if (membership_.active()) {
      membership_.run(op.ctx, op.fn, op.timeout, op.save, op.rec.op, op.what);
    } else {
      op.ctx.deadline = Clock::now() + op.timeout;
      op.fn(op.ctx);
    }
    return nullptr;
  } catch (const MembershipChanged& e) {
    env::log(env::Level::Warn, rank_, e.what());
    return std::current_exception();  // the group goes on: not a poison
  } catch (const std::exception& e) {
    std::string what = e.what();
    // c10::Error's what() carries a C++ backtrace; keep the message.
    if (auto* ce = dynamic_cast<const c10::Error*>(&e)) what = ce->msg();
    std::string msg = rankPrefix(rank_) + op.what + " failed: " + what;
    if (dynamic_cast<const transport::TimeoutError*>(&e)) msg += " (timeout " + std::to_string(op.timeout.count()) + " ms)";
    if (dynamic_cast<const transport::MismatchError*>(&e)) membership_.failGroup(msg);
    poison(msg);
    env::log(env::Level::Warn, rank_, msg);
    membership_.abort(msg);
    return std::make_exception_ptr(std::runtime_error(msg));
  }
}

std::exception_ptr OpQueue::execute(Op& op, const std::string& first_error) {
  Clock::time_point start;
  if (records_.on()) start = Clock::now();
  Phases ph;
  std::exception_ptr error = first_error.empty() ? run(op, records_.on() ? &ph : nullptr)
                                                 : std::make_exception_ptr(std::runtime_error(first_error));
  if (records_.on())
    records_.finish(std::move(op.rec), ph, error == nullptr, op.raw_per_wire, op.enqueued, start, op.rec_ns);
  return error;
}

void OpQueue::runLoop() {
  while (true) {
    Op op;
    std::string first_error;
    // Operations come in bursts (a step's buckets, a loop of small ones): polling a little before
    // sleeping saves the wake-up (tens of microseconds) of an operation queued soon after.
    if (spin_.count() > 0 && pending_.load(std::memory_order_acquire) == 0) {
      const auto end = Clock::now() + spin_;
      while (pending_.load(std::memory_order_acquire) == 0 && Clock::now() < end) std::this_thread::yield();
    }
    {
      std::unique_lock<std::mutex> g(mu_);
      // Not while an operation runs on a caller's thread (enqueue): the next one waits its turn.
      cv_.wait(g, [&] { return !busy_ && (stop_ || !queue_.empty() || membership_.signalled()); });
      if (!queue_.empty()) {
        op = std::move(queue_.front());
        queue_.pop_front();
        pending_.fetch_sub(1, std::memory_order_relaxed);
      } else if (stop_) {
        return;  // stopped and drained
      } else if (!poison_.empty()) {
        membership_.clearSignal();  // a poisoned rank takes no part in agreements
        continue;
      }
      first_error = poison_;
      busy_ = true;
    }
    std::exception_ptr error;
    if (op.work) error = execute(op, first_error);
    else membership_.recoverIdle();
    {
      std::lock_guard<std::mutex> g(mu_);
      busy_ = false;
    }
    // Idle before the caller wakes: its next small synchronous op may then run on its own thread.
    if (op.work) op.work->complete(error);
  }
}

}  // namespace xirang
