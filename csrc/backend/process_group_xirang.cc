#include "backend/process_group_xirang.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "core/codec.h"
#include "core/env.h"
#include "core/generation.h"
#include "core/membership.h"
#include "core/reduce.h"
#include "core/topology.h"

namespace xirang {

using transport::OpKind;
using transport::RecvSeg;
using transport::SendSeg;
using Clock = std::chrono::steady_clock;

namespace {

// A failure report starting with this fails every rank instead of starting an agreement.
constexpr const char* kFatal = "fatal: ";

// Adapts torch's c10d::Store (already prefixed per group by torch) to the transport's Store.
class StoreAdapter : public transport::Store {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> s) : s_(std::move(s)) {}
  void set(const std::string& key, const std::string& value) override {
    s_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  bool check(const std::string& key) override { return s_->check({key}); }
  int64_t add(const std::string& key, int64_t delta) override { return s_->add(key, delta); }
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override {
    auto v = s_->compareSet(key, std::vector<uint8_t>(expected.begin(), expected.end()),
                            std::vector<uint8_t>(desired.begin(), desired.end()));
    return std::string(v.begin(), v.end());
  }
  std::string get(const std::string& key, transport::Deadline deadline) override {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() < 1) left = std::chrono::milliseconds(1);
    s_->wait({key}, left);
    auto v = s_->get(key);
    return std::string(v.begin(), v.end());
  }

 private:
  c10::intrusive_ptr<c10d::Store> s_;
};

DType toDType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kChar: return DType::Int8;
    case at::kShort: return DType::Int16;
    case at::kInt: return DType::Int32;
    case at::kLong: return DType::Int64;
    case at::kByte: return DType::UInt8;
    case at::kBool: return DType::Bool;
    case at::kComplexFloat: return DType::Complex64;
    case at::kComplexDouble: return DType::Complex128;
    case at::kComplexHalf: return DType::Complex32;
    default: return DType::Bytes;
  }
}

ReduceOp toReduceOp(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::Sum;
    case c10d::ReduceOp::AVG: return ReduceOp::Avg;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::Product;
    case c10d::ReduceOp::MIN: return ReduceOp::Min;
    case c10d::ReduceOp::MAX: return ReduceOp::Max;
    case c10d::ReduceOp::BAND: return ReduceOp::BAnd;
    case c10d::ReduceOp::BOR: return ReduceOp::BOr;
    case c10d::ReduceOp::BXOR: return ReduceOp::BXor;
    case c10d::ReduceOp::PREMUL_SUM: return ReduceOp::PremulSum;
    default: TORCH_CHECK(false, "xirang: unsupported reduce op ", static_cast<int>(op.op_));
  }
}

// Profiler range names must outlive the RecordFunction that points at them: intern them.
const char* groupTitle(int64_t group_id) {
  if (group_id < 0) return "xirang:allreduce_bf16_ef";
  static std::mutex mu;
  static std::set<std::string> names;
  std::lock_guard<std::mutex> g(mu);
  return names.insert("xirang:group" + std::to_string(group_id)).first->c_str();
}

bool is16BitFloat(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// A buffer the algorithms can work in: the tensor itself when it is contiguous, else a
// contiguous copy that is written back after.
struct Staged {
  at::Tensor user;
  at::Tensor buf;
  bool copy_back = false;
  void finish() {
    if (copy_back) user.copy_(buf);
  }
};

Staged stage(const at::Tensor& t) {
  Staged s{t, t, false};
  if (!t.is_contiguous()) {
    s.buf = t.contiguous();
    s.copy_back = true;
  }
  return s;
}

DType wireDType(const at::Tensor& buf) { return toDType(buf.scalar_type()); }

uint64_t nbytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

double premulFactor(const c10d::ReduceOp& op) {
  auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(sup != nullptr, "xirang: PREMUL_SUM without a factor");
  if (sup->tensor_factor.defined()) return sup->tensor_factor.item<double>();
  return sup->double_factor;
}

}  // namespace

// ---------------------------------------------------------------- WorkXirang

WorkXirang::WorkXirang(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                       const std::optional<std::vector<at::Tensor>>& inputs)
    : Work(rank, type, title, inputs),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

c10::intrusive_ptr<c10::ivalue::Future> WorkXirang::getFuture() { return future_; }

namespace {
int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Times one Work.wait() call into its WaitClock, including a wait that raises.
class WaitTimer {
 public:
  explicit WaitTimer(WaitClock* c) : c_(c) {
    if (!c_) return;
    c_->calls.fetch_add(1, std::memory_order_relaxed);
    t0_ = nowNs();
    int64_t none = 0;
    owner_ = c_->since_ns.compare_exchange_strong(none, t0_);
  }
  ~WaitTimer() {
    if (!c_) return;
    const int64_t t1 = nowNs();
    if (owner_) c_->since_ns.store(0);
    c_->blocked_ns.fetch_add(t1 - t0_);
  }
  WaitTimer(const WaitTimer&) = delete;
  WaitTimer& operator=(const WaitTimer&) = delete;

 private:
  WaitClock* c_;
  int64_t t0_ = 0;
  bool owner_ = false;
};
}  // namespace

double WaitClock::seconds(int64_t now_ns) const {
  if (calls.load(std::memory_order_relaxed) == 0) return -1.0;
  int64_t ns = blocked_ns.load();
  const int64_t since = since_ns.load();
  if (since != 0 && now_ns > since) ns += now_ns - since;
  return static_cast<double>(ns) * 1e-9;
}

bool WorkXirang::wait(std::chrono::milliseconds timeout) {
  WaitTimer timer(wait_clock_.get());
  if (timeout != kNoTimeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
      TORCH_CHECK(false, desc_, ": Work.wait(timeout=", timeout.count(),
                  " ms) expired while the operation is still in progress (its own op timeout still applies)");
    }
  }
  return Work::wait(kNoTimeout);
}

std::vector<at::Tensor> WorkXirang::result() { return outputs_; }

// The Future first, then the Work (as gloo's finishWorkGloo): a caller woken by Work.wait() reads
// get_future().value() at once (DDP's sparse buckets do), so the Future must be done by then.
// A callback that throws (torch's own wrappers catch) must not leave the Work unfinished.
void WorkXirang::complete(std::exception_ptr error) {
  try {
    if (error) {
      future_->setError(error);
    } else {
#ifdef XIRANG_WITH_CUDA
      if (cuda_stage_) {
        cuda_stage_->completeFuture(future_, c10::IValue(outputs_));  // with the side stream current
      } else
#endif
      {
        future_->markCompleted(c10::IValue(outputs_));
      }
    }
  } catch (const std::exception& e) {
    env::log(env::Level::Warn, rank_, std::string(desc_) + ": a Future callback raised: " + e.what());
  }
  finish(error);
}

#ifdef XIRANG_WITH_CUDA
void WorkXirang::setCudaStage(std::shared_ptr<cudastage::Stage> stage) {
  for (auto& o : outputs_) o = stage->userTensor(o);
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                     std::vector<c10::Device>{stage->device()});
  cuda_stage_ = std::move(stage);
}

void WorkXirang::synchronize() {
  if (cuda_stage_) cuda_stage_->block();
}

bool WorkXirang::isCompleted() { return c10d::Work::isCompleted() && (!cuda_stage_ || cuda_stage_->query()); }

namespace {
// The stage of the op the caller's thread is about to queue: set by a CUDA entry point around
// its call of the same operation on the host mirrors, taken by enqueue().
thread_local std::shared_ptr<cudastage::Stage> t_pending_stage;

struct PendingStage {
  explicit PendingStage(std::shared_ptr<cudastage::Stage> s) { t_pending_stage = std::move(s); }
  ~PendingStage() { t_pending_stage.reset(); }
  PendingStage(const PendingStage&) = delete;
  PendingStage& operator=(const PendingStage&) = delete;
};

std::shared_ptr<cudastage::Stage> newStage(cudastage::Streams& streams) {
  cudastage::checkTransport();
  return std::make_shared<cudastage::Stage>(streams);
}

bool anyCuda(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (t.defined() && t.is_cuda()) return true;
  return false;
}
}  // namespace
#endif

// ---------------------------------------------------------------- construction

ProcessGroupXirang::ProcessGroupXirang(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       XirangConfig cfg)
    : Backend(rank, size), cfg_(std::move(cfg)), created_(Clock::now()) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "xirang: invalid rank ", rank, " for world size ", size);
  try {
    env::parseLogLevel();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  store_ = std::make_shared<StoreAdapter>(store);
  if (cfg_.generation.empty())
    cfg_.generation = agreeGeneration(store, rank, size, cfg_.timeout, cfg_.join, cfg_.group_name);
  // Every key of this creation lives under its generation: a store shared with an earlier
  // creation (torchrun's restarts) still holds that one's abort, secret and addresses.
  key_ns_ = generation::keyNamespace(cfg_.generation);
  elastic_prefix_ = key_ns_ + "/elastic";
  transport::TcpOptions topts;
  topts.key_prefix = key_ns_;
  topts.ifname = env::get("XIRANG_SOCKET_IFNAME");
  topts.handshake_timeout = std::chrono::milliseconds(env::getInt("XIRANG_HANDSHAKE_TIMEOUT_MS"));
  const std::string key_file = env::get("XIRANG_AUTH_KEY_FILE");
  if (!key_file.empty()) {
    try {
      auth_key_ = transport::loadKeyFile(key_file);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "xirang rank ", rank, ": ", e.what());
    }
    topts.key = auth_key_;
  }
  record_capacity_ = static_cast<size_t>(std::max<int64_t>(1, env::getInt("XIRANG_STATS_CAPACITY")));
  records_on_ = env::getBool("XIRANG_STATS");
  TORCH_CHECK(!cfg_.join || cfg_.elastic, "xirang rank ", rank,
              ": XIRANG_JOIN=1 (a spare taking a dead rank's place) needs elastic mode (XIRANG_ELASTIC=1)");
  try {
    if (!cfg_.join)  // a spare gets the transport of the epoch that admits it (joinGroup)
      tcp_ = std::make_shared<transport::Tcp>(rank, size, store_, topts, Clock::now() + cfg_.timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "xirang rank ", rank, ": creating group '", cfg_.group_name, "' failed: ", e.what());
  }
  comm_.link = tcp_.get();
  comm_.rank = rank;
  if (cfg_.ring.empty()) {
    for (int r = 0; r < size; ++r) comm_.ring.push_back(r);
  } else {
    TORCH_CHECK(static_cast<int>(cfg_.ring.size()) == size, "xirang: ring order has ", cfg_.ring.size(),
                " entries for world size ", size);
    comm_.ring = cfg_.ring;
  }
  comm_.segment_bytes = env::getInt("XIRANG_SEGMENT_BYTES");
  comm_.small_bytes = env::getInt("XIRANG_SMALL_BYTES");
  TORCH_CHECK(comm_.segment_bytes >= 4096, "xirang: XIRANG_SEGMENT_BYTES=", comm_.segment_bytes,
              " is too small (at least 4096 bytes; default 1048576)");
  TORCH_CHECK(comm_.small_bytes >= 0, "xirang: XIRANG_SMALL_BYTES=", comm_.small_bytes, " must be >= 0");
  std::string algo = cfg_.algorithm == "auto" ? env::get("XIRANG_ALGO") : cfg_.algorithm;
  if (algo == "ring") comm_.algo = Comm::Algo::Ring;
  else if (algo == "direct") comm_.algo = Comm::Algo::Direct;
  else if (algo == "two_level") comm_.algo = Comm::Algo::TwoLevel;
  else if (algo == "auto") comm_.algo = Comm::Algo::Auto;
  else TORCH_CHECK(false, "xirang: XIRANG_ALGO/algorithm must be auto, ring, direct or two_level, got '", algo, "'");
  if (static_cast<int>(cfg_.hosts.size()) == size && size > 1) {
    std::vector<topology::RankLabel> labels;
    for (int r = 0; r < size; ++r)
      labels.push_back({r, cfg_.hosts[r], r < static_cast<int>(cfg_.racks.size()) ? cfg_.racks[r] : "", 0});
    topology::assignLocalRanks(labels);
    auto plan = topology::twoLevelPlan(labels, /*by_rack=*/false);
    if (plan.valid && plan.local_groups.size() > 1 && plan.local_groups[0].size() > 1) {
      for (auto& lg : plan.local_groups)
        if (std::find(lg.begin(), lg.end(), rank) != lg.end()) comm_.local_group = lg;
      for (auto& cg : plan.cross_groups)
        if (std::find(cg.begin(), cg.end(), rank) != cg.end()) comm_.cross_group = cg;
    } else if (algo == "two_level" || algo == "auto") {
      env::log(env::Level::Info, rank,
               "two-level allreduce unavailable (" + (plan.valid ? std::string("one host or one rank per host") : plan.reason) +
                   "): using the ring");
    }
  }
  std::ostringstream ring;
  for (int r : comm_.ring) ring << r << " ";
  env::log(env::Level::Info, rank,
           "group '" + cfg_.group_name + "' size " + std::to_string(size) + " address " + address() +
               " algorithm " + algo + " ring [ " + ring.str() + "] codec " + codec::pathName(codec::activePath()));
  if (!cfg_.stats_dir.empty() && !records_on_) {
    env::log(env::Level::Warn, rank, "XIRANG_STATS=0: no records, so nothing is written to XIRANG_STATS_DIR");
  } else if (!cfg_.stats_dir.empty()) {
    std::string path = cfg_.stats_dir + "/rank" + std::to_string(cfg_.global_rank) + ".jsonl";
    stats_file_ = std::fopen(path.c_str(), "a");
    if (!stats_file_) env::log(env::Level::Warn, rank, "cannot open " + path + " for the stats records");
    else stats_thread_ = std::thread([this] { statsWriterLoop(); });
  }
  for (int r = 0; r < size; ++r) live_.push_back(r);
  info_.live = live_;
  info_.ring = comm_.ring;
  if (cfg_.elastic) {
    TORCH_CHECK(cfg_.heartbeat_s > 0, "xirang: XIRANG_HEARTBEAT_S must be > 0, got ", cfg_.heartbeat_s);
    if (size > 1) {
      try {
        store_->add(elastic::heartbeatKey(elastic_prefix_, rank), 1);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "xirang rank ", rank, ": elastic mode needs a store with add/compareSet: ", e.what());
      }
      if (cfg_.join) {
        try {
          joinGroup();
        } catch (const c10::Error&) {
          throw;
        } catch (const std::exception& e) {
          TORCH_CHECK(false, "xirang rank ", rank, ": joining group '", cfg_.group_name, "' failed: ", e.what());
        }
      }
      hb_thread_ = std::thread([this] { heartbeatLoop(); });
    }
  }
  thread_ = std::thread([this] { runLoop(); });
}

ProcessGroupXirang::~ProcessGroupXirang() { shutdown(); }

std::string ProcessGroupXirang::agreeGeneration(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout, bool join,
                                                const std::string& group_name) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "xirang: invalid rank ", rank, " for world size ", size);
  StoreAdapter adapter(store);
  const auto deadline = Clock::now() + timeout;
  try {
    return join ? generation::live(adapter, deadline) : generation::agree(adapter, rank, size, deadline);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "xirang rank ", rank, ": creating group '", group_name, "' failed: ", e.what());
  }
}

void ProcessGroupXirang::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
    hb_stop_ = true;
  }
  cv_.notify_all();
  hb_cv_.notify_all();
  if (hb_thread_.joinable() && hb_thread_.get_id() != std::this_thread::get_id()) hb_thread_.join();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  if (tcp_) {
    tcp_->leave();  // a peer still waiting for this rank's connection fails now, not at its timeout
    tcp_->close();
  }
  {
    std::lock_guard<std::mutex> g(stats_mu_);
    stats_stop_ = true;
  }
  stats_cv_.notify_all();
  if (stats_thread_.joinable() && stats_thread_.get_id() != std::this_thread::get_id()) stats_thread_.join();
  if (stats_file_) {
    std::fclose(stats_file_);
    stats_file_ = nullptr;
  }
}

void ProcessGroupXirang::statsWriterLoop() {
  while (true) {
    std::deque<OpRecord> batch;
    {
      std::unique_lock<std::mutex> g(stats_mu_);
      stats_cv_.wait_for(g, std::chrono::milliseconds(100), [&] { return stats_stop_; });
      if (stats_q_.empty()) {
        if (stats_stop_) return;  // stopped and drained
        continue;
      }
      batch.swap(stats_q_);
    }
    for (const auto& r : batch) writeRecord(r);
    std::fflush(stats_file_);
  }
}

void ProcessGroupXirang::abort() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (poison_.empty()) poison_ = "xirang rank " + std::to_string(rank_) + ": process group aborted";
  }
  if (tcp_) tcp_->abort(poison_);
  shutdown();
}

// Records the group's first error (every later op raises it) and stops this rank's heartbeat, so
// that an elastic group's survivors drop it.
void ProcessGroupXirang::poison(const std::string& msg) {
  std::lock_guard<std::mutex> g(mu_);
  if (poison_.empty()) poison_ = msg;
  hb_stop_ = true;
}

void ProcessGroupXirang::checkPoisoned() {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(poison_.empty(), poison_);
  TORCH_CHECK(!stop_, "xirang rank ", rank_, ": process group '", cfg_.group_name, "' was shut down");
}

// ---------------------------------------------------------------- the queue

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::enqueue(c10d::OpType type, const char* title, OpKind kind,
                                                           std::vector<at::Tensor> outputs,
                                                           const std::vector<at::Tensor>& inputs, DType dtype,
                                                           ReduceOp reduce, uint64_t numel,
                                                           std::chrono::milliseconds timeout, Fn fn, int64_t group_id,
                                                           std::string label,
                                                           std::function<std::function<void()>()> save) {
  checkPoisoned();
  auto work = c10::make_intrusive<WorkXirang>(rank_, type, title, std::move(outputs),
                                              std::optional<std::vector<at::Tensor>>(inputs));
#ifdef XIRANG_WITH_CUDA
  if (auto st = std::exchange(t_pending_stage, nullptr)) {
    st->inputsReady();  // event on the caller's current stream
    work->setCudaStage(st);
    fn = [st, inner = std::move(fn)](OpCtx& ctx) {
      st->copyIn();
      inner(ctx);
      st->copyOut();
    };
  }
#endif
  Op op;
  op.work = work;
  op.fn = std::move(fn);
  op.ctx.op = kind;
  op.ctx.dtype = dtype;
  op.ctx.reduce = reduce;
  op.ctx.numel = numel;
  op.ctx.seq = (kind == OpKind::Send) ? 0 : ++seq_;
  if (op.ctx.seq) issued_seq_.store(op.ctx.seq);
  op.save = std::move(save);
  op.timeout = timeout.count() < 0 ? cfg_.timeout : timeout;
  op.tls = at::ThreadLocalState();
  // The op's name is needed for messages with or without records.
  op.rec.op = kind == OpKind::AllreduceEF ? "allreduce_bf16_ef"
              : title                      ? std::string(title).substr(std::strlen("xirang:"))
                                           : transport::opKindName(kind);
  if (records_on_) {
    op.enqueued = Clock::now();
    op.rec.seq = op.ctx.seq;
    op.rec.group_id = group_id;
    op.rec.label = std::move(label);
    op.rec.dtype = dtypeName(dtype);
    op.rec.numel = numel;
    op.rec.t_enqueue = std::chrono::duration<double>(op.enqueued - created_).count();
    op.rec.wait = std::make_shared<WaitClock>();
    work->wait_clock_ = op.rec.wait;
    op.rec_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - op.enqueued).count());
  }
  work->desc_ = "xirang rank " + std::to_string(rank_) + ": " + describe(op);
  if (env::logLevel() >= env::Level::Trace)
    env::log(env::Level::Trace, rank_, "enqueue " + describe(op));
  {
    std::lock_guard<std::mutex> g(mu_);
    queue_.push_back(std::move(op));
  }
  cv_.notify_one();
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

std::string ProcessGroupXirang::describe(const Op& op) const {
  std::ostringstream s;
  s << op.rec.op << " (op #" << op.ctx.seq << ", " << dtypeName(op.ctx.dtype) << ", " << op.ctx.numel
    << " elements";
  if (op.ctx.reduce != ReduceOp::None) s << ", " << reduceOpName(op.ctx.reduce);
  s << ", group '" << cfg_.group_name << "')";
  return s.str();
}

void ProcessGroupXirang::runLoop() {
  while (true) {
    Op op;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return stop_ || !queue_.empty() || membership_signal_.load(); });
      if (!queue_.empty()) {
        op = std::move(queue_.front());
        queue_.pop_front();
      } else if (stop_) {
        return;  // stopped and drained
      } else if (!poison_.empty()) {
        membership_signal_ = false;  // a poisoned rank takes no part in agreements
        continue;
      }
    }
    if (!op.work) {
      // A failure elsewhere while this rank has nothing queued: join the agreement now, so the
      // survivors do not wait for this rank's next operation.
      try {
        recover("rank " + std::to_string(rank_) + " was idle");
      } catch (const std::exception& e) {
        poison("xirang rank " + std::to_string(rank_) + ": " + e.what());
      }
      continue;
    }
    std::exception_ptr error;
    std::string first_error;
    {
      std::lock_guard<std::mutex> g(mu_);
      first_error = poison_;
    }
    Clock::time_point start;
    if (records_on_) start = Clock::now();
    Phases ph;
    if (!first_error.empty()) {
      error = std::make_exception_ptr(std::runtime_error(first_error));
    } else {
      try {
        at::ThreadLocalStateGuard guard(op.tls);
        op.ctx.phases = records_on_ ? &ph : nullptr;
        runOp(op);
      } catch (const MembershipChanged& e) {
        env::log(env::Level::Warn, rank_, e.what());
        error = std::current_exception();  // the group goes on: not a poison
      } catch (const std::exception& e) {
        std::string what = e.what();
        // c10::Error's what() carries a C++ backtrace; keep the message.
        if (auto* ce = dynamic_cast<const c10::Error*>(&e)) what = ce->msg();
        std::string msg = "xirang rank " + std::to_string(rank_) + ": " + describe(op) + " failed: " + what;
        bool is_timeout = dynamic_cast<const transport::TimeoutError*>(&e) != nullptr;
        if (is_timeout) msg += " (timeout " + std::to_string(op.timeout.count()) + " ms)";
        if (cfg_.elastic && dynamic_cast<const transport::MismatchError*>(&e)) {
          // Elastic: the survivors would otherwise drop this rank and go on; a disagreement
          // about the collective is a bug every rank must hear about.
          try {
            elastic::reportFailure(*store_, elastic_prefix_, epoch_.load(), std::string(kFatal) + msg);
          } catch (...) {
          }
        }
        poison(msg);
        env::log(env::Level::Warn, rank_, msg);
        {
          std::lock_guard<std::mutex> g(mem_mu_);
          if (tcp_) tcp_->abort(msg);
        }
        error = std::make_exception_ptr(std::runtime_error(msg));
      }
    }
    if (!records_on_) {
      op.work->complete(error);
      continue;
    }
    // From here to the push: the record's cost on this thread (recordCost()).
    const auto end = Clock::now();
    op.rec.queued_s = std::chrono::duration<double>(start - op.enqueued).count();
    op.rec.total_s = std::chrono::duration<double>(end - start).count();
    op.rec.encode_s = ph.encode_s;
    op.rec.scatter_reduce_s = ph.scatter_reduce_s;
    op.rec.allgather_s = ph.allgather_s;
    op.rec.decode_s = ph.decode_s;
    op.rec.bytes_wire = ph.bytes_sent;
    op.rec.bytes_raw = op.ctx.op == OpKind::AllreduceEF ? ph.bytes_sent * 2 : ph.bytes_sent;
    op.rec.algorithm = ph.algorithm;
    op.rec.ok = error == nullptr;
    for (const auto& [peer, st] : ph.peers) {
      op.rec.peers.push_back({peer, st.send_s, st.recv_s, st.bytes_sent, st.bytes_recv});
      addCrossBytes(op.rec, peer, st.bytes_sent);
    }
    keepRecord(std::move(op.rec), end, op.rec_ns);
    op.work->complete(error);
  }
}

void ProcessGroupXirang::addCrossBytes(OpRecord& rec, int peer, uint64_t bytes) const {
  if (peer >= 0 && peer < static_cast<int>(cfg_.hosts.size()) && cfg_.hosts[peer] != cfg_.hosts[rank_])
    rec.bytes_cross_host += bytes;
  if (peer >= 0 && peer < static_cast<int>(cfg_.racks.size()) && cfg_.racks[peer] != cfg_.racks[rank_])
    rec.bytes_cross_rack += bytes;
}

// Stores a finished operation's record (and queues its JSON line). `end`: when the operation
// finished; caller_ns: what building the record cost the caller's thread (recordCost()).
void ProcessGroupXirang::keepRecord(OpRecord rec, Clock::time_point end, uint64_t caller_ns) {
  if (stats_file_) {
    // The line carries the exposed wait known now: a caller already blocked has waited since
    // it began (up to `end`, before the wake-up); one that has not begun yet is unknown.
    rec.exposed_wait_s =
        rec.wait ? rec.wait->seconds(std::chrono::duration_cast<std::chrono::nanoseconds>(end.time_since_epoch()).count())
                 : -1;
    std::lock_guard<std::mutex> g(stats_mu_);
    stats_q_.push_back(rec);  // no wake-up: the writer comes by every 100 ms
  }
  {
    std::lock_guard<std::mutex> g(rec_mu_);
    records_.push_back(std::move(rec));
    while (records_.size() > record_capacity_) records_.pop_front();
  }
  record_ns_.fetch_add(caller_ns + static_cast<uint64_t>(
                                       std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - end).count()),
                       std::memory_order_relaxed);
  records_built_.fetch_add(1, std::memory_order_relaxed);
}

// ---------------------------------------------------------------- elastic mode (#8)

void ProcessGroupXirang::runOp(Op& op) {
  static const int64_t delay_ms = env::getInt("XIRANG_TEST_DELAY_MS");
  if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  const uint64_t seq = op.ctx.seq;
  if (!cfg_.elastic || size_ <= 1) {
    op.ctx.deadline = Clock::now() + op.timeout;
    op.fn(op.ctx);
    return;
  }
  if (membership_signal_.load()) recover("a failure was reported before " + op.rec.op + " started");
  auto voided = [&] {
    for (const auto& [done, fence] : void_ranges_)
      if (seq > done && seq <= fence) return true;
    return false;
  };
  auto changed = [&](const std::string& why) {
    return MembershipChanged("xirang rank " + std::to_string(rank_) + ": " + describe(op) +
                             " was interrupted by a membership change (" + why + ", now " + membershipText(nullptr) +
                             "); its result is void on every survivor");
  };
  if (seq != 0 && voided() && !op.save) throw changed("it was issued before the change");
  if (static_cast<int>(live_.size()) < size_) {
    const bool ok = op.ctx.op == OpKind::Allreduce || op.ctx.op == OpKind::AllreduceEF ||
                    op.ctx.op == OpKind::Broadcast || op.ctx.op == OpKind::Barrier || op.ctx.op == OpKind::Admit;
    if (!ok)
      throw MembershipChanged("xirang rank " + std::to_string(rank_) + ": " + describe(op) +
                              " is not available after a membership change (" + membershipText(nullptr) +
                              "): only allreduce, broadcast, barrier and the hook's operation run on the "
                              "shrunken ring; create a new group over the live ranks for the others");
  }
  std::function<void()> restore = op.save ? op.save() : nullptr;
  for (int attempt = 0;; ++attempt) {
    try {
      if (attempt > 0 && restore) restore();
      op.ctx.deadline = Clock::now() + op.timeout;
      op.fn(op.ctx);
      if (seq == 0) return;  // point-to-point: no completion round
      done_seq_ = seq;       // this rank holds the result
      if (op.ctx.op != OpKind::Admit) ack(comm_, op.ctx);  // admission: the store is its agreement
      return;
    } catch (const transport::MismatchError&) {
      throw;  // the program's bug, not a lost rank: fail the group (every rank gets the error)
    } catch (const transport::TransportError& e) {
      std::string why = e.what();
      elastic::Decision d = recover("rank " + std::to_string(rank_) + ", " + describe(op) + ": " + why);
      if (seq != 0 && seq <= d.done_seq) return;  // every survivor holds the result
      if (seq == 0 || !op.save)
        throw changed("epoch " + std::to_string(d.epoch - 1) + " -> " + std::to_string(d.epoch) + ": " +
                      info_.last_failure);
      env::log(env::Level::Info, rank_, "retrying " + describe(op) + " on the new ring");
    }
  }
}

std::string ProcessGroupXirang::membershipText(const elastic::Decision* d) const {
  std::ostringstream o;
  const auto& live = d ? d->live : live_;
  o << "epoch " << (d ? d->epoch : epoch_.load()) << ", live ranks [";
  for (size_t i = 0; i < live.size(); ++i) o << (i ? " " : "") << live[i];
  o << "] of " << size_;
  return o.str();
}

// Switches to the epoch `d` describes: a fresh listener and connections under the epoch's store
// namespace and secret `key`, only d.live admitted; the ring keeps its (topology) order over
// d.live. Runs on the communication thread (or in the constructor of a joining rank), then
// calls the membership callback.
void ProcessGroupXirang::installEpoch(const elastic::Decision& d, const transport::Key128& key, int source,
                                      const std::string& reason, double agreement_s, Clock::time_point t0) {
  transport::TcpOptions topts;
  topts.ifname = env::get("XIRANG_SOCKET_IFNAME");
  topts.handshake_timeout = std::chrono::milliseconds(env::getInt("XIRANG_HANDSHAKE_TIMEOUT_MS"));
  topts.key_prefix = key_ns_ + "/e" + std::to_string(d.epoch);
  topts.members = d.live;
  topts.key = key;
  // Every member of the epoch can compute its group id (rank 0 may be gone): from its key.
  topts.group_id = transport::siphash24(key, "xirang-epoch-group", 18);
  auto fresh = std::make_shared<transport::Tcp>(rank_, size_, store_, topts, Clock::now() + cfg_.timeout);
  std::vector<int> base = cfg_.ring;
  if (base.empty())
    for (int r = 0; r < size_; ++r) base.push_back(r);
  std::vector<int> ring;
  for (int r : base)
    if (std::find(d.live.begin(), d.live.end(), r) != d.live.end()) ring.push_back(r);
  std::shared_ptr<transport::Tcp> old;
  {
    std::lock_guard<std::mutex> g(mem_mu_);
    old = std::move(tcp_);
    tcp_ = std::move(fresh);
    comm_.link = tcp_.get();
    comm_.ring = ring;
    comm_.local_group.clear();  // the two-level plan assumed the old hosts: the ring from now on
    comm_.cross_group.clear();
    live_ = d.live;
    if (d.fence > d.done_seq) void_ranges_.push_back({d.done_seq, d.fence});
    info_.epoch = d.epoch;
    info_.live = d.live;
    info_.ring = ring;
    info_.recoveries++;
    info_.source = source;
    if (source < 0) {  // a failure (a growth keeps the last failure's figures)
      info_.last_failure = reason;
      info_.last_agreement_s = agreement_s;
      info_.last_recovery_s = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    epoch_.store(d.epoch);
    membership_signal_ = false;
  }
  if (old) old->close();
  std::function<void()> cb;
  {
    std::lock_guard<std::mutex> g(mem_mu_);
    cb = membership_cb_;
  }
  if (cb) cb();
}

// The group key of elastic epoch `epoch`: with XIRANG_AUTH_KEY_FILE derived from the file's key
// (so a spare that holds the file can compute it and nothing secret goes to the store), else
// `otherwise` (derived from the previous epoch's key, or a random one the store carries).
transport::Key128 ProcessGroupXirang::epochKey(uint64_t epoch, const transport::Key128& otherwise) const {
  return auth_key_ ? transport::deriveKey(*auth_key_, epoch) : otherwise;
}

elastic::Decision ProcessGroupXirang::recover(const std::string& why) {
  const auto t0 = Clock::now();
  const uint64_t epoch = epoch_.load();
  std::string reason = elastic::reportFailure(*store_, elastic_prefix_, epoch, why);
  if (reason.rfind(kFatal, 0) == 0) {  // a rank failed the group on purpose (see runLoop)
    std::string msg = "xirang rank " + std::to_string(rank_) + ": the group failed: " + reason.substr(std::strlen(kFatal));
    poison(msg);
    throw transport::TransportError(msg, -1);
  }
  {
    std::lock_guard<std::mutex> g(mem_mu_);
    if (tcp_) tcp_->interrupt("membership change: " + reason);
  }
  env::log(env::Level::Warn, rank_, "epoch " + std::to_string(epoch) + " ended (" + reason + "); agreeing on the survivors");
  elastic::Report mine{done_seq_, issued_seq_.load()};
  elastic::HeartbeatWatch watch(*store_, elastic_prefix_,
                                std::chrono::milliseconds(static_cast<int64_t>(cfg_.heartbeat_s * 1000)));
  {
    std::lock_guard<std::mutex> g(watch_mu_);
    if (hb_watch_) watch.adopt(*hb_watch_);  // a neighbour already silent is stale at once
  }
  elastic::Decision d =
      elastic::agree(*store_, elastic_prefix_, epoch, live_, rank_, mine, watch, Clock::now() + cfg_.timeout);
  const auto t_agreed = Clock::now();
  if (std::find(d.live.begin(), d.live.end(), rank_) == d.live.end()) {
    std::string msg = "xirang rank " + std::to_string(rank_) + ": declared dead by the survivors of epoch " +
                      std::to_string(epoch) + " (" + membershipText(&d) +
                      "); this process must not take part in the group again";
    poison(msg);
    throw transport::TransportError(msg, rank_);
  }
  transport::Key128 key;
  {
    std::lock_guard<std::mutex> g(mem_mu_);
    key = epochKey(d.epoch, transport::deriveKey(tcp_->key(), d.epoch));
  }
  installEpoch(d, key, /*source=*/-1, reason, std::chrono::duration<double>(t_agreed - t0).count(), t0);
  env::log(env::Level::Warn, rank_,
           "rebuilt the ring: " + membershipText(&d) + ", ops up to #" + std::to_string(d.done_seq) +
               " kept, #" + std::to_string(d.done_seq + 1) + "-#" + std::to_string(d.fence) + " void; recovery " +
               std::to_string(info_.last_recovery_s) + " s");
  return d;
}

std::string ProcessGroupXirang::waitKey(const std::string& key, transport::Deadline deadline) {
  const std::string fail = elastic::failKey(elastic_prefix_, epoch_.load());
  while (!store_->check(key)) {
    if (store_->check(fail))
      throw transport::TransportError("a failure was reported while waiting for " + key + ": " +
                                          store_->get(fail, Clock::now() + std::chrono::seconds(5)),
                                      -1);
    if (Clock::now() >= deadline) throw transport::TimeoutError("timed out waiting for store key " + key, -1);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return store_->get(key, deadline);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::admitJoiners(int64_t expect, double wait_s) {
  TORCH_CHECK(cfg_.elastic, "xirang rank ", rank_,
              ": admit_joiners needs elastic mode (xirang.Options(elastic=True) or XIRANG_ELASTIC=1)");
  TORCH_CHECK(expect >= 0 && wait_s >= 0, "xirang rank ", rank_, ": admit_joiners: expect (", expect,
              ") and wait_s (", wait_s, ") must be >= 0");
  auto fn = [this, expect, wait_s](OpCtx& ctx) {
    if (size_ <= 1) return;
    const int lowest = live_.front();
    const std::string key = elastic::admitKey(elastic_prefix_, ctx.seq);
    if (rank_ == lowest) {
      const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
      std::vector<std::pair<int, std::string>> joiners;  // (rank, nonce)
      while (true) {
        joiners.clear();
        for (int r = 0; r < size_; ++r) {
          const std::string jk = elastic::joinKey(elastic_prefix_, r);
          if (std::find(live_.begin(), live_.end(), r) != live_.end() || !store_->check(jk)) continue;
          std::string nonce = store_->get(jk, ctx.deadline);
          if (nonce != "taken") joiners.push_back({r, nonce});
        }
        if (static_cast<int64_t>(joiners.size()) >= expect) break;
        if (Clock::now() >= until) {
          joiners.clear();  // fewer than `expect` waiting: admit none this time
          break;
        }
        if (store_->check(elastic::failKey(elastic_prefix_, epoch_.load())))
          throw transport::TransportError("a failure was reported during the admission", -1);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      elastic::Decision d;
      d.epoch = joiners.empty() ? epoch_.load() : epoch_.load() + 1;
      d.live = live_;
      for (const auto& j : joiners) d.live.push_back(j.first);
      std::sort(d.live.begin(), d.live.end());
      d.done_seq = d.fence = ctx.seq;
      if (!joiners.empty() && !auth_key_)  // with XIRANG_AUTH_KEY_FILE the key is derived, not stored
        store_->set(elastic::secretKey(elastic_prefix_, d.epoch), transport::keyToHex(transport::randomKey()));
      store_->compareSet(key, "", d.encode());
      for (const auto& [r, nonce] : joiners) {
        store_->set(elastic::joinedKey(elastic_prefix_, r), nonce + " " + std::to_string(rank_) + " " + d.encode());
        store_->compareSet(elastic::joinKey(elastic_prefix_, r), nonce, "taken");
      }
    }
    elastic::Decision d = elastic::Decision::decode(waitKey(key, ctx.deadline));
    if (d.epoch == epoch_.load()) return;  // nobody joined
    transport::Key128 k =
        auth_key_ ? epochKey(d.epoch, {})
                  : transport::keyFromHex(waitKey(elastic::secretKey(elastic_prefix_, d.epoch), ctx.deadline));
    std::ostringstream why;
    why << "spares joined (" << membershipText(&d) << ")";
    installEpoch(d, k, lowest, why.str(), 0.0, Clock::now());
    env::log(env::Level::Warn, rank_, "the ring grew back: " + membershipText(&d) + "; training state source: rank " +
                                          std::to_string(lowest));
  };
  return enqueue(c10d::OpType::BARRIER, "xirang:admit_joiners", OpKind::Admit, {}, {}, DType::UInt8, ReduceOp::None,
                 0, c10d::kUnsetTimeout, fn);
}

void ProcessGroupXirang::joinGroup() {
  const auto t0 = Clock::now();
  const auto deadline = t0 + cfg_.timeout;
  const std::string nonce = transport::keyToHex(transport::randomKey()).substr(0, 16);
  store_->set(elastic::joinKey(elastic_prefix_, rank_), nonce);
  env::log(env::Level::Warn, rank_,
           "spare waiting to take rank " + std::to_string(rank_) + "'s place (admitted at a step boundary)");
  const std::string jk = elastic::joinedKey(elastic_prefix_, rank_);
  std::string text;
  while (true) {
    if (store_->check(jk)) {
      text = store_->get(jk, deadline);
      if (text.compare(0, nonce.size() + 1, nonce + " ") == 0) break;
    }
    TORCH_CHECK(Clock::now() < deadline, "xirang rank ", rank_, ": the spare was not admitted within the group timeout (",
                cfg_.timeout.count(), " ms): the live ranks admit spares at step boundaries with "
                "xirang.admit_joiners()");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::istringstream in(text.substr(nonce.size() + 1));
  int source = -1;
  in >> source;
  std::string rest;
  std::getline(in, rest);
  elastic::Decision d = elastic::Decision::decode(rest.substr(rest.find_first_not_of(' ')));
  transport::Key128 key = auth_key_ ? epochKey(d.epoch, {})
                                    : transport::keyFromHex(store_->get(elastic::secretKey(elastic_prefix_, d.epoch), deadline));
  seq_ = d.fence;  // the survivors' admission op was #fence: this rank's next op is the next one
  issued_seq_.store(seq_);
  done_seq_ = seq_;
  store_->add(elastic::heartbeatKey(elastic_prefix_, rank_), 1);
  installEpoch(d, key, source, "joined as a spare", 0.0, t0);
  env::log(env::Level::Warn, rank_, "joined: " + membershipText(&d) + "; training state source: rank " +
                                        std::to_string(source));
}

// Elastic: advances this rank's heartbeat counter, watches the ring neighbours' counters, and
// turns a failure recorded for the current epoch into an interrupt of the transport (so a
// running exchange ends now) and a wake-up of the communication thread (so an idle rank joins
// the agreement).
void ProcessGroupXirang::heartbeatLoop() {
  const auto hb = std::chrono::milliseconds(static_cast<int64_t>(cfg_.heartbeat_s * 1000));
  const auto tick = std::max(std::chrono::milliseconds(20), hb / 5);
  auto watch = std::make_unique<elastic::HeartbeatWatch>(*store_, elastic_prefix_, hb);
  {
    std::lock_guard<std::mutex> g(watch_mu_);
    hb_watch_ = watch.get();
  }
  struct Unpublish {
    ProcessGroupXirang* self;
    ~Unpublish() {
      std::lock_guard<std::mutex> g(self->watch_mu_);
      self->hb_watch_ = nullptr;
    }
  } unpublish{this};
  uint64_t watched_epoch = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> g(mu_);
      if (hb_cv_.wait_for(g, tick, [&] { return hb_stop_; })) return;
    }
    try {
      store_->add(elastic::heartbeatKey(elastic_prefix_, rank_), 1);
      const uint64_t epoch = epoch_.load();
      if (epoch != watched_epoch) {  // new ring: new neighbours, fresh clocks
        std::lock_guard<std::mutex> g(watch_mu_);
        watch = std::make_unique<elastic::HeartbeatWatch>(*store_, elastic_prefix_, hb);
        hb_watch_ = watch.get();
        watched_epoch = epoch;
      }
      if (membership_signal_.load()) continue;
      std::vector<int> neighbours;
      {
        std::lock_guard<std::mutex> g(mem_mu_);
        const int n = static_cast<int>(comm_.ring.size());
        for (int i = 0; i < n && n > 1; ++i) {
          if (comm_.ring[i] != rank_) continue;
          neighbours.push_back(comm_.ring[(i + 1) % n]);
          if (n > 2) neighbours.push_back(comm_.ring[(i + n - 1) % n]);
        }
      }
      for (int p : neighbours) {
        bool stale;
        {
          std::lock_guard<std::mutex> g(watch_mu_);
          stale = watch->stale(p);
        }
        if (stale) {
          elastic::reportFailure(*store_, elastic_prefix_, epoch,
                                 "rank " + std::to_string(p) + " missed its heartbeats for " +
                                     std::to_string(watch->silentFor(p)) + " s (XIRANG_HEARTBEAT_S=" +
                                     std::to_string(cfg_.heartbeat_s) + ")");
        }
      }
      if (store_->check(elastic::failKey(elastic_prefix_, epoch))) {
        {
          std::lock_guard<std::mutex> g(mem_mu_);
          if (epoch_.load() != epoch) continue;
          membership_signal_ = true;
          if (tcp_) tcp_->interrupt("membership change reported in the store");
        }
        cv_.notify_all();
      }
    } catch (const std::exception& e) {
      std::string msg = "xirang rank " + std::to_string(rank_) + ": elastic heartbeat: the store is unreachable (" +
                        e.what() + "); elastic mode needs a store that outlives every failed node";
      env::log(env::Level::Warn, rank_, msg);
      poison(msg);
      {
        std::lock_guard<std::mutex> g(mem_mu_);
        if (tcp_) tcp_->interrupt(msg);
      }
      cv_.notify_all();
      return;
    }
  }
}

MembershipInfo ProcessGroupXirang::membership() {
  std::lock_guard<std::mutex> g(mem_mu_);
  return info_;
}

void ProcessGroupXirang::setMembershipCallback(std::function<void()> fn) {
  std::lock_guard<std::mutex> g(mem_mu_);
  membership_cb_ = std::move(fn);
}

namespace {
// One JSON object built by appending to a string: std::to_chars for numbers (the shortest text
// that reads back to the same double), no iostreams. An ostringstream with precision(9) made the
// line cost ~10 us, most of a JSON record's cost (benchmarks/stats_overhead.py).
class JsonLine {
 public:
  JsonLine() { s_.reserve(640); }
  JsonLine& key(const char* k) {
    s_ += first_ ? "{\"" : ",\"";
    first_ = false;
    s_ += k;
    s_ += "\":";
    return *this;
  }
  JsonLine& str(const std::string& v) {
    s_ += '"';
    for (char c : v) {
      if (c == '"' || c == '\\') {
        s_ += '\\';
        s_ += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\u%04x", c);
        s_ += buf;
      } else {
        s_ += c;
      }
    }
    s_ += '"';
    return *this;
  }
  template <typename T>
  JsonLine& num(T v) {
    if constexpr (std::is_floating_point_v<T>) {
      if (!std::isfinite(v)) return raw("null");
    }
    char buf[32];
    auto res = std::to_chars(buf, buf + sizeof(buf), v);
    s_.append(buf, res.ptr);
    return *this;
  }
  JsonLine& raw(const char* v) {
    s_ += v;
    return *this;
  }
  JsonLine& open() {  // the next key() opens a new object (one inside an array)
    first_ = true;
    return *this;
  }
  JsonLine& close(char c) {
    s_ += c;
    return *this;
  }
  std::string& text() { return s_; }

 private:
  std::string s_;
  bool first_ = true;
};
}  // namespace

// One JSON line per operation in XIRANG_STATS_DIR/rank<global rank>.jsonl (the stats writer thread).
void ProcessGroupXirang::writeRecord(const OpRecord& r) {
  JsonLine j;
  j.key("run_id").str(cfg_.run_id).key("pg").str(cfg_.group_name);
  j.key("group_rank").num(rank_).key("global_rank").num(cfg_.global_rank).key("world_size").num(size_);
  j.key("seq").num(r.seq).key("op").str(r.op).key("algorithm").str(r.algorithm);
  j.key("group_id").num(r.group_id).key("label").str(r.label).key("dtype").str(r.dtype);
  j.key("numel").num(r.numel).key("bytes_raw").num(r.bytes_raw).key("bytes_wire").num(r.bytes_wire);
  j.key("bytes_cross_host").num(r.bytes_cross_host).key("bytes_cross_rack").num(r.bytes_cross_rack);
  j.key("t_enqueue").num(r.t_enqueue).key("queued_s").num(r.queued_s).key("encode_s").num(r.encode_s);
  j.key("scatter_reduce_s").num(r.scatter_reduce_s).key("allgather_s").num(r.allgather_s);
  j.key("decode_s").num(r.decode_s).key("total_s").num(r.total_s).key("ok").raw(r.ok ? "true" : "false");
  j.key("exposed_wait_s");
  if (r.exposed_wait_s < 0) j.raw("null");
  else j.num(r.exposed_wait_s);
  j.key("peers").raw("[");
  for (size_t i = 0; i < r.peers.size(); ++i) {
    const auto& p = r.peers[i];
    if (i) j.raw(",");
    j.open().key("peer").num(p.peer).key("send_s").num(p.send_s).key("recv_s").num(p.recv_s);
    j.key("bytes_sent").num(p.bytes_sent).key("bytes_recv").num(p.bytes_recv).close('}');
  }
  j.raw("]}\n");
  const std::string& line = j.text();
  std::fwrite(line.data(), 1, line.size(), stats_file_);
}

std::vector<OpRecord> ProcessGroupXirang::records() {
  std::vector<OpRecord> out;
  {
    std::lock_guard<std::mutex> g(rec_mu_);
    out.assign(records_.begin(), records_.end());
  }
  const int64_t now = nowNs();
  for (auto& r : out)
    if (r.wait) r.exposed_wait_s = r.wait->seconds(now);
  return out;
}

void ProcessGroupXirang::clearRecords() {
  std::lock_guard<std::mutex> g(rec_mu_);
  records_.clear();
}

// ---------------------------------------------------------------- input checks

namespace {

// cuda_ok: the caller handles CUDA tensors itself (point-to-point stages them; a build with the
// CUDA path only).
void checkTensors(int rank, const char* op, const std::vector<at::Tensor>& ts, bool cuda_ok = false) {
  for (const auto& t : ts) {
    TORCH_CHECK(t.defined(), "xirang rank ", rank, ": ", op, ": undefined tensor");
    if (t.is_cuda()) {
#ifndef XIRANG_WITH_CUDA
      (void)cuda_ok;
      TORCH_CHECK(false, "xirang rank ", rank, ": ", op,
                  ": got a CUDA tensor, but the CUDA path is not built in this xirang "
                  "(build_info()['cuda'] is None); use CPU tensors or 'cpu:xirang,cuda:nccl'");
#else
      if (cuda_ok) {
        TORCH_CHECK(t.layout() == at::kStrided, "xirang rank ", rank, ": ", op, ": sparse tensors are not supported");
        continue;
      }
      TORCH_CHECK(false, "xirang rank ", rank, ": ", op,
                  ": CUDA tensors are not supported by this operation yet (the host-staged CUDA path covers "
                  "all_reduce, all_reduce_coalesced, broadcast, reduce, all_gather, all_gather_coalesced, "
                  "all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, send, recv and allreduce_ef); "
                  "use CPU tensors or 'cpu:xirang,cuda:nccl'");
#endif
    }
    TORCH_CHECK(t.device().is_cpu(), "xirang rank ", rank, ": ", op, ": tensors must be on the CPU, got ", t.device());
    TORCH_CHECK(t.layout() == at::kStrided, "xirang rank ", rank, ": ", op,
                ": tensors must be dense (strided), got layout ", t.layout(),
                "; of the sparse layouts only sparse COO in allreduce (ReduceOp.SUM) is supported");
  }
}

void checkSameType(int rank, const char* op, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "xirang rank ", rank, ": ", op, ": dtype mismatch between tensors: ",
              a.scalar_type(), " vs ", b.scalar_type());
}

void checkReduce(int rank, const char* op, at::ScalarType t, ReduceOp r) {
  DType d = toDType(t);
  if (d == DType::Float16 || d == DType::BFloat16) d = DType::Float32;
  std::string err = checkReduceOp(d, r);
  if (!err.empty()) {
    err = std::string(reduceOpName(r)) + " is not defined on " + c10::toString(t);
    TORCH_CHECK(false, "xirang rank ", rank, ": ", op, ": ", err);
  }
}

}  // namespace

// Runs the reduce `op` of the user's dtype on an fp32-or-native buffer, with AVG/PREMUL scaling.
static void reduceAll(const Comm& comm, const OpCtx& ctx, at::Tensor& buf, ReduceOp op, double premul) {
  allreduceOp(comm, ctx, buf.data_ptr(), buf.numel(), wireDType(buf), op, premul);  // core/planner.h
}

// ---------------------------------------------------------------- collectives

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse)
    return allreduceSparse(tensors, opts);
#ifdef XIRANG_WITH_CUDA
  if (anyCuda(tensors)) {
    auto st = newStage(cuda_streams_);
    std::vector<at::Tensor> host;
    for (auto& t : tensors) host.push_back(st->add(t, true, true));
    PendingStage pending(st);
    return allreduce(host, opts);
  }
#endif
  TORCH_CHECK(tensors.size() == 1, "xirang rank ", rank_, ": allreduce takes exactly one tensor per process, got ",
              tensors.size());
  checkTensors(rank_, "allreduce", tensors);
  at::Tensor t = tensors[0];
  ReduceOp op = toReduceOp(opts.reduceOp);
  checkReduce(rank_, "allreduce", t.scalar_type(), op);
  double premul = op == ReduceOp::PremulSum ? premulFactor(opts.reduceOp) : 1.0;
  auto fn = [this, t, op, premul](OpCtx& ctx) {
    Staged s = stage(t);
    reduceAll(comm_, ctx, s.buf, op, premul);
    s.finish();
  };
  return enqueue(c10d::OpType::ALLREDUCE, "xirang:all_reduce", OpKind::Allreduce, tensors, tensors,
                 toDType(t.scalar_type()), op, static_cast<uint64_t>(t.numel()), opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
#ifdef XIRANG_WITH_CUDA
  if (anyCuda(tensors)) {
    auto st = newStage(cuda_streams_);
    std::vector<at::Tensor> host;
    for (auto& t : tensors) host.push_back(st->add(t, true, true));
    PendingStage pending(st);
    return allreduce_coalesced(host, opts);
  }
#endif
  TORCH_CHECK(!tensors.empty(), "xirang rank ", rank_, ": allreduce_coalesced: no tensors");
  checkTensors(rank_, "allreduce_coalesced", tensors);
  uint64_t total = 0;
  for (auto& t : tensors) {
    checkSameType(rank_, "allreduce_coalesced", tensors[0], t);
    total += static_cast<uint64_t>(t.numel());
  }
  ReduceOp op = toReduceOp(opts.reduceOp);
  checkReduce(rank_, "allreduce_coalesced", tensors[0].scalar_type(), op);
  double premul = op == ReduceOp::PremulSum ? premulFactor(opts.reduceOp) : 1.0;
  auto ts = tensors;
  auto fn = [this, ts, op, premul](OpCtx& ctx) {
    std::vector<at::Tensor> flat;
    for (auto& t : ts) flat.push_back(t.reshape(-1));
    at::Tensor buf = at::cat(flat);
    reduceAll(comm_, ctx, buf, op, premul);
    int64_t off = 0;
    for (auto& t : ts) {
      t.copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  };
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "xirang:all_reduce_coalesced", OpKind::Allreduce, tensors,
                 tensors, toDType(tensors[0].scalar_type()), op, total, opts.timeout, fn);
}

namespace {
// Sparse allreduce's metadata: one fixed-size int64 record per rank, allgathered first:
// [0] sparse_dim, [1] dense_dim, [2] nnz, [3] dim, [4, 4 + dim) sizes.
constexpr int64_t kSparseMaxDims = 64;
constexpr int64_t kSparseMeta = 4 + kSparseMaxDims;

std::string sparseShapeText(const int64_t* meta) {
  std::ostringstream o;
  const int64_t dim = std::clamp<int64_t>(meta[3], 0, kSparseMaxDims);
  o << "[";
  for (int64_t d = 0; d < dim; ++d) o << (d ? ", " : "") << meta[4 + d];
  o << "] (sparse_dim " << meta[0] << ", dense_dim " << meta[1] << ")";
  return o.str();
}

// a * b for byte / element counts a peer's metadata feeds; throws instead of wrapping.
uint64_t mulChecked(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r) || r > static_cast<uint64_t>(INT64_MAX))
    throw std::overflow_error(std::string("xirang: sparse allreduce: ") + what + " overflows int64");
  return r;
}
}  // namespace

// allreduce of one sparse COO CPU tensor, ReduceOp.SUM (the only op gloo reduces sparse tensors
// with), by gloo's algorithm: every rank coalesces its input; one allgather of a fixed-size
// metadata record per rank (sparse_dim, dense_dim, nnz, sizes), which every rank checks against
// its own, so a shape mismatch fails every rank naming both shapes; then an allgather of the
// indices and one of the values (block r holds rank r's nnz rows, so ranks may differ in nnz,
// zero included). Every rank builds the sum from the same bytes in rank order (one coalesce):
// the result is bitwise identical on every rank. It replaces the input tensor's indices and
// values (coalesced; its nnz is the number of distinct rows over the ranks), and the Work's
// result() and Future hold that tensor: DDP's sparse gradient buckets read it from the Future.
c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allreduceSparse(std::vector<at::Tensor>& tensors,
                                                                   const c10d::AllreduceOptions& opts) {
  at::Tensor t = tensors[0];
  TORCH_CHECK(t.device().is_cpu(), "xirang rank ", rank_, ": allreduce: sparse tensors must be on the CPU, got ",
              t.device(), " (move the tensor to the CPU, or use 'cuda:nccl' for sparse CUDA tensors)");
  TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, "xirang rank ", rank_,
              ": allreduce: sparse tensors support only ReduceOp.SUM (as gloo), got ",
              reduceOpName(toReduceOp(opts.reduceOp)));
  TORCH_CHECK(t.dim() <= kSparseMaxDims, "xirang rank ", rank_, ": allreduce: sparse tensors of at most ",
              kSparseMaxDims, " dimensions, got ", t.dim());
  auto fn = [this, t](OpCtx& ctx) {
    // The result replaces t's data, as the dense path writes its memory: not an autograd op.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor in = t.coalesce();
    const int64_t sd = in.sparse_dim(), dim = in.dim();
    at::Tensor meta = at::zeros({size_, kSparseMeta}, at::TensorOptions().dtype(at::kLong));
    int64_t* m = meta.data_ptr<int64_t>();
    int64_t* mine = m + rank_ * kSparseMeta;
    mine[0] = sd;
    mine[1] = in.dense_dim();
    mine[2] = in._nnz();
    mine[3] = dim;
    for (int64_t d = 0; d < dim; ++d) mine[4 + d] = in.size(d);
    std::vector<RecvSeg> blocks;
    for (int r = 0; r < size_; ++r) blocks.push_back(RecvSeg{m + r * kSparseMeta, kSparseMeta * sizeof(int64_t)});
    xirang::allgather(comm_, ctx, blocks);

    // Rows a coalesced tensor can have at most (saturating): bounds the nnz a peer claims.
    uint64_t max_rows = 1;
    for (int64_t d = 0; d < sd; ++d)
      if (__builtin_mul_overflow(max_rows, static_cast<uint64_t>(in.size(d)), &max_rows)) max_rows = UINT64_MAX;
    std::vector<uint64_t> nnz(size_, 0);  // 0 for ranks outside the ring
    uint64_t total = 0;
    for (int r : comm_.ring) {
      const int64_t* theirs = m + r * kSparseMeta;
      // Everything but the nnz (index 2) must agree.
      const bool same = theirs[0] == mine[0] && theirs[1] == mine[1] && theirs[3] == mine[3] &&
                        std::equal(mine + 4, mine + 4 + dim, theirs + 4);
      if (!same)
        throw transport::MismatchError("sparse allreduce: rank " + std::to_string(r) + " has a sparse tensor of size " +
                                           sparseShapeText(theirs) + ", this rank " + sparseShapeText(mine),
                                       r);
      if (theirs[2] < 0 || static_cast<uint64_t>(theirs[2]) > max_rows)
        throw transport::TransportError("sparse allreduce: rank " + std::to_string(r) + " sent nnz " +
                                            std::to_string(theirs[2]) + " for a sparse tensor of size " +
                                            sparseShapeText(mine),
                                        r);
      nnz[r] = static_cast<uint64_t>(theirs[2]);
      if (__builtin_add_overflow(total, nnz[r], &total))
        throw std::overflow_error("xirang: sparse allreduce: total nnz overflows");
    }
    uint64_t row_numel = 1;  // elements of one value row (the dense dimensions)
    for (int64_t d = sd; d < dim; ++d)
      row_numel = mulChecked(row_numel, static_cast<uint64_t>(in.size(d)), "a value row");
    const uint64_t row_bytes = mulChecked(row_numel, in._values().element_size(), "a value row's bytes");
    const uint64_t idx_row_bytes = static_cast<uint64_t>(sd) * sizeof(int64_t);
    mulChecked(total, std::max(row_bytes, idx_row_bytes), "the gathered rows' bytes");

    // Rows of every rank back to back, in group-rank order: indices as [total, sparse_dim]
    // (rank r's indices transposed), values as [total, dense sizes...].
    std::vector<int64_t> val_sizes{static_cast<int64_t>(total)};
    for (int64_t d = sd; d < dim; ++d) val_sizes.push_back(in.size(d));
    at::Tensor idx = at::empty({static_cast<int64_t>(total), sd}, at::TensorOptions().dtype(at::kLong));
    at::Tensor val = at::empty(val_sizes, in._values().options().memory_format(at::MemoryFormat::Contiguous));
    std::vector<RecvSeg> iblocks, vblocks;
    uint64_t row = 0, my_row = 0;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) my_row = row;
      iblocks.push_back(RecvSeg{static_cast<uint8_t*>(idx.data_ptr()) + row * idx_row_bytes, nnz[r] * idx_row_bytes});
      vblocks.push_back(RecvSeg{static_cast<uint8_t*>(val.data_ptr()) + row * row_bytes, nnz[r] * row_bytes});
      row += nnz[r];
    }
    const int64_t my_nnz = static_cast<int64_t>(nnz[rank_]);
    if (my_nnz > 0) {
      idx.narrow(0, static_cast<int64_t>(my_row), my_nnz).copy_(in._indices().t());
      val.narrow(0, static_cast<int64_t>(my_row), my_nnz).copy_(in._values());
    }
    xirang::allgather(comm_, ctx, iblocks);
    xirang::allgather(comm_, ctx, vblocks);

    // Indices a peer sent must lie inside the shape (coalesce trusts them).
    if (total > 0 && sd > 0) {
      at::Tensor limit = at::empty({sd}, at::TensorOptions().dtype(at::kLong));
      for (int64_t d = 0; d < sd; ++d) limit.data_ptr<int64_t>()[d] = in.size(d);
      at::Tensor bad = (idx < 0).logical_or_(idx >= limit).any(1);
      if (bad.any().item<bool>()) {
        const int64_t first = bad.nonzero()[0][0].item<int64_t>();
        int owner = 0;
        for (uint64_t acc = 0; owner < size_; ++owner) {
          acc += nnz[owner];
          if (static_cast<uint64_t>(first) < acc) break;
        }
        throw transport::TransportError("sparse allreduce: rank " + std::to_string(owner) +
                                            " sent an index outside the size " + sparseShapeText(mine),
                                        owner);
      }
    }
    at::Tensor sum = at::sparse_coo_tensor(idx.t().contiguous(), val, in.sizes(), in.options()).coalesce();
    t.copy_(sum);
  };
  return enqueue(c10d::OpType::_ALLREDUCE_SPARSE, "xirang:sparse_all_reduce", OpKind::Allgather, tensors, tensors,
                 toDType(t.scalar_type()), ReduceOp::Sum, static_cast<uint64_t>(t.numel()), opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allreduceBF16EF(at::Tensor buffer, at::Tensor residual,
                                                                   at::Tensor staged, int64_t group_id,
                                                                   std::string label,
                                                                   std::vector<at::Tensor> plain) {
#ifdef XIRANG_WITH_CUDA
  std::vector<at::Tensor> all_in{buffer, residual, staged};
  all_in.insert(all_in.end(), plain.begin(), plain.end());
  if (anyCuda(all_in)) {
    TORCH_CHECK(!(staged.defined() && residual.defined() && staged.is_alias_of(residual)), "xirang rank ", rank_,
                ": allreduce_bf16_ef: staged must not share storage with residual");
    auto st = newStage(cuda_streams_);
    at::Tensor b = st->add(buffer, true, true), r = st->add(residual, true, false), sd = st->add(staged, false, true);
    std::vector<at::Tensor> pl;
    for (const auto& t : plain) pl.push_back(st->add(t, true, true));
    PendingStage pending(st);
    return allreduceBF16EF(b, r, sd, group_id, std::move(label), std::move(pl));
  }
#endif
  checkTensors(rank_, "allreduce_bf16_ef", {buffer, residual, staged});
  checkTensors(rank_, "allreduce_bf16_ef", plain);
  for (const auto& t : plain)
    TORCH_CHECK(t.is_floating_point(), "xirang rank ", rank_, ": allreduce_bf16_ef: plain tensors must be floating, got ",
                t.scalar_type());
  for (const auto* t : {&buffer, &residual, &staged}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->is_contiguous(), "xirang rank ", rank_,
                ": allreduce_bf16_ef: buffer, residual and staged must be 1-D contiguous float32, got ",
                t->scalar_type(), " of shape ", t->sizes());
  }
  TORCH_CHECK(residual.numel() == buffer.numel() && staged.numel() == buffer.numel(), "xirang rank ", rank_,
              ": allreduce_bf16_ef: residual (", residual.numel(), ") and staged (", staged.numel(),
              ") must have the buffer's ", buffer.numel(), " elements");
  TORCH_CHECK(!staged.is_alias_of(residual), "xirang rank ", rank_,
              ": allreduce_bf16_ef: staged must not share storage with residual");
  auto fn = [this, buffer, residual, staged, plain](OpCtx& ctx) {
    xirang::allreduceBF16EF(comm_, ctx, buffer.data_ptr<float>(), residual.data_ptr<float>(), staged.data_ptr<float>(),
                    buffer.numel());
    // The group's other tensors (biases, norms, 16-bit or fp64 gradients): averaged in their own
    // dtype within the same operation, so a layer group costs one launch.
    for (const auto& t : plain) {
      Staged st = stage(t);
      reduceAll(comm_, ctx, st.buf, ReduceOp::Avg, 1.0);
      st.finish();
    }
  };
  uint64_t numel = static_cast<uint64_t>(buffer.numel());
  for (const auto& t : plain) numel += static_cast<uint64_t>(t.numel());
  std::vector<at::Tensor> outs{buffer};
  outs.insert(outs.end(), plain.begin(), plain.end());
  // Elastic mode: the hook's op is retried on the rebuilt ring from a copy of its inputs (the
  // residual is only read; the new one is rewritten into staged), averaged over the live ranks.
  std::function<std::function<void()>()> save;
  if (cfg_.elastic)
    save = [outs]() -> std::function<void()> {
      std::vector<at::Tensor> copies;
      for (const auto& t : outs) copies.push_back(t.clone());
      return [outs, copies] {
        for (size_t i = 0; i < outs.size(); ++i) outs[i].copy_(copies[i]);
      };
    };
  return enqueue(c10d::OpType::ALLREDUCE, groupTitle(group_id), OpKind::AllreduceEF, outs, outs, DType::Float32,
                 ReduceOp::Avg, numel, c10d::kUnsetTimeout, fn, group_id, std::move(label), std::move(save));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
#ifdef XIRANG_WITH_CUDA
  if (anyCuda(tensors)) {
    auto st = newStage(cuda_streams_);
    const bool root = opts.rootRank == rank_;
    std::vector<at::Tensor> host;
    for (auto& t : tensors) host.push_back(st->add(t, /*copy_in=*/root, /*copy_out=*/!root));
    PendingStage pending(st);
    return broadcast(host, opts);
  }
#endif
  TORCH_CHECK(tensors.size() == 1, "xirang rank ", rank_, ": broadcast takes exactly one tensor per process, got ",
              tensors.size());
  checkTensors(rank_, "broadcast", tensors);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "xirang rank ", rank_, ": broadcast: invalid root ",
              opts.rootRank);
  at::Tensor t = tensors[0];
  int root = static_cast<int>(opts.rootRank);
  auto fn = [this, t, root](OpCtx& ctx) {
    if (std::find(comm_.ring.begin(), comm_.ring.end(), root) == comm_.ring.end())
      throw MembershipChanged("xirang rank " + std::to_string(rank_) + ": broadcast: root rank " +
                              std::to_string(root) + " is not live (" + membershipText(nullptr) + ")");
    Staged s = stage(t);
    xirang::broadcast(comm_, ctx, s.buf.data_ptr(), nbytes(s.buf), root);
    if (rank_ != root) s.finish();
  };
  return enqueue(c10d::OpType::BROADCAST, "xirang:broadcast", OpKind::Broadcast, tensors, tensors,
                 toDType(t.scalar_type()), ReduceOp::None, static_cast<uint64_t>(t.numel()), opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
#ifdef XIRANG_WITH_CUDA
  if (anyCuda(tensors)) {
    auto st = newStage(cuda_streams_);
    std::vector<at::Tensor> host;
    for (auto& t : tensors) host.push_back(st->add(t, true, /*copy_out=*/opts.rootRank == rank_));
    PendingStage pending(st);
    return reduce(host, opts);
  }
#endif
  TORCH_CHECK(tensors.size() == 1, "xirang rank ", rank_, ": reduce takes exactly one tensor per process");
  checkTensors(rank_, "reduce", tensors);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "xirang rank ", rank_, ": reduce: invalid root ",
              opts.rootRank);
  at::Tensor t = tensors[0];
  ReduceOp op = toReduceOp(opts.reduceOp);
  checkReduce(rank_, "reduce", t.scalar_type(), op);
  double premul = op == ReduceOp::PremulSum ? premulFactor(opts.reduceOp) : 1.0;
  int root = static_cast<int>(opts.rootRank);
  auto fn = [this, t, op, premul, root](OpCtx& ctx) {
    // Reduce = allreduce into a private buffer; only the root writes the result.
    at::Tensor buf = t.clone(at::MemoryFormat::Contiguous);
    reduceAll(comm_, ctx, buf, op, premul);
    if (rank_ == root) t.copy_(buf);
  };
  return enqueue(c10d::OpType::REDUCE, "xirang:reduce", OpKind::Reduce, tensors, tensors, toDType(t.scalar_type()),
                 op, static_cast<uint64_t>(t.numel()), opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
#ifdef XIRANG_WITH_CUDA
  if (anyCuda({output, input})) {
    auto st = newStage(cuda_streams_);
    at::Tensor o = st->add(output, false, true), i = st->add(input, true, false);
    PendingStage pending(st);
    return _allgather_base(o, i, opts);
  }
#endif
  checkTensors(rank_, "allgather_into_tensor", {output, input});
  checkSameType(rank_, "allgather_into_tensor", output, input);
  TORCH_CHECK(output.numel() == input.numel() * size_, "xirang rank ", rank_,
              ": allgather_into_tensor: output has ", output.numel(), " elements, expected world size ", size_,
              " x input ", input.numel());
  auto fn = [this, output, input](OpCtx& ctx) {
    Staged s = stage(output);
    uint64_t b = nbytes(input);
    std::vector<RecvSeg> blocks;
    for (int r = 0; r < size_; ++r) blocks.push_back(RecvSeg{static_cast<uint8_t*>(s.buf.data_ptr()) + b * r, b});
    s.buf.narrow(0, 0, s.buf.size(0)).reshape(-1).narrow(0, input.numel() * rank_, input.numel()).copy_(input.reshape(-1));
    xirang::allgather(comm_, ctx, blocks);
    s.finish();
  };
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "xirang:all_gather_into_tensor", OpKind::Allgather, {output},
                 {input}, toDType(input.scalar_type()), ReduceOp::None, static_cast<uint64_t>(input.numel()),
                 opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
#ifdef XIRANG_WITH_CUDA
  if (anyCuda(inputs) || (!outputs.empty() && anyCuda(outputs[0]))) {
    auto st = newStage(cuda_streams_);
    std::vector<std::vector<at::Tensor>> o(outputs.size());
    std::vector<at::Tensor> i;
    for (size_t k = 0; k < outputs.size(); ++k)
      for (auto& t : outputs[k]) o[k].push_back(st->add(t, false, true));
    for (auto& t : inputs) i.push_back(st->add(t, true, false));
    PendingStage pending(st);
    return allgather(o, i, opts);
  }
#endif
  TORCH_CHECK(inputs.size() == 1 && outputs.size() == 1, "xirang rank ", rank_,
              ": allgather takes one input tensor and one output list per process");
  TORCH_CHECK(static_cast<int>(outputs[0].size()) == size_, "xirang rank ", rank_, ": allgather: output list has ",
              outputs[0].size(), " tensors, expected world size ", size_);
  at::Tensor in = inputs[0];
  checkTensors(rank_, "allgather", inputs);
  checkTensors(rank_, "allgather", outputs[0]);
  for (auto& o : outputs[0]) {
    checkSameType(rank_, "allgather", in, o);
    TORCH_CHECK(o.numel() == in.numel(), "xirang rank ", rank_, ": allgather: output tensor has ", o.numel(),
                " elements, input ", in.numel());
  }
  auto outs = outputs[0];
  auto fn = [this, outs, in](OpCtx& ctx) {
    at::Tensor flat = at::empty({static_cast<int64_t>(size_) * in.numel()}, in.options().memory_format(at::MemoryFormat::Contiguous));
    uint64_t b = nbytes(in);
    std::vector<RecvSeg> blocks;
    for (int r = 0; r < size_; ++r) blocks.push_back(RecvSeg{static_cast<uint8_t*>(flat.data_ptr()) + b * r, b});
    flat.narrow(0, in.numel() * rank_, in.numel()).copy_(in.reshape(-1));
    xirang::allgather(comm_, ctx, blocks);
    for (int r = 0; r < size_; ++r) outs[r].copy_(flat.narrow(0, in.numel() * r, in.numel()).view(outs[r].sizes()));
  };
  return enqueue(c10d::OpType::ALLGATHER, "xirang:all_gather", OpKind::Allgather, outputs[0], inputs,
                 toDType(in.scalar_type()), ReduceOp::None, static_cast<uint64_t>(in.numel()), opts.timeout, fn);
}

// all_gather_coalesced: outputs[r][i] receives rank r's inputs[i] (torch's documented layout and
// gloo's: one list per rank, each of len(inputs) tensors). One operation: this rank's inputs are
// packed, back to back, into one byte block (they may differ in shape, and in dtype too, as
// torch's complex-as-real rule allows), one ring allgather moves every rank's block, and block r
// is unpacked into outputs[r]. As torch documents, shapes are not compared across ranks; the
// ranks' total element counts and bytes are. Future value: every output, outputs[0][0] first
// (rank-major).
c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                       std::vector<at::Tensor>& inputs,
                                                                       const c10d::AllgatherOptions& opts) {
#ifdef XIRANG_WITH_CUDA
  bool cuda = anyCuda(inputs);
  for (const auto& l : outputs) cuda = cuda || anyCuda(l);
  if (cuda) {
    auto st = newStage(cuda_streams_);
    std::vector<std::vector<at::Tensor>> o(outputs.size());
    std::vector<at::Tensor> i;
    for (size_t k = 0; k < outputs.size(); ++k)
      for (auto& t : outputs[k]) o[k].push_back(st->add(t, false, true));
    for (auto& t : inputs) i.push_back(st->add(t, true, false));
    PendingStage pending(st);
    return allgather_coalesced(o, i, opts);
  }
#endif
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_, "xirang rank ", rank_, ": allgather_coalesced: got ",
              outputs.size(), " output lists, expected one per rank (world size ", size_,
              "): output_tensor_lists[r][i] receives rank r's input i");
  checkTensors(rank_, "allgather_coalesced", inputs);
  uint64_t bytes = 0, numel = 0;
  bool one_dtype = true;
  for (const auto& in : inputs) {
    bytes += nbytes(in);
    numel += static_cast<uint64_t>(in.numel());
    one_dtype = one_dtype && in.scalar_type() == inputs[0].scalar_type();
  }
  std::vector<at::Tensor> flat_outs;
  for (int r = 0; r < size_; ++r) {
    TORCH_CHECK(outputs[r].size() == inputs.size(), "xirang rank ", rank_, ": allgather_coalesced: output list ", r,
                " has ", outputs[r].size(), " tensors for ", inputs.size(), " inputs");
    checkTensors(rank_, "allgather_coalesced", outputs[r]);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& o = outputs[r][i];
      checkSameType(rank_, "allgather_coalesced", inputs[i], o);
      TORCH_CHECK(o.numel() == inputs[i].numel(), "xirang rank ", rank_, ": allgather_coalesced: output [", r, "][", i,
                  "] has ", o.numel(), " elements, input ", i, " has ", inputs[i].numel());
      flat_outs.push_back(o);
    }
  }
  auto fn = [this, ins = inputs, outs = outputs, bytes](OpCtx& ctx) {
    at::Tensor flat = at::empty({static_cast<int64_t>(bytes) * size_}, at::TensorOptions().dtype(at::kByte));
    uint8_t* base = flat.data_ptr<uint8_t>();
    uint64_t off = 0;
    for (const auto& in : ins) {
      const uint64_t b = nbytes(in);
      if (b) std::memcpy(base + bytes * rank_ + off, in.contiguous().data_ptr(), b);
      off += b;
    }
    std::vector<RecvSeg> blocks;
    for (int r = 0; r < size_; ++r) blocks.push_back(RecvSeg{base + bytes * r, bytes});
    xirang::allgather(comm_, ctx, blocks);
    for (int r = 0; r < size_; ++r) {
      off = 0;
      for (const auto& o : outs[r]) {
        const uint64_t b = nbytes(o);
        if (b) {
          at::Tensor dst = o.is_contiguous() ? o : at::empty_like(o, at::MemoryFormat::Contiguous);
          std::memcpy(dst.data_ptr(), base + bytes * r + off, b);
          if (!dst.is_same(o)) o.copy_(dst);
        }
        off += b;
      }
    }
  };
  const DType dtype = inputs.empty() ? DType::Bytes : one_dtype ? toDType(inputs[0].scalar_type()) : DType::Bytes;
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "xirang:all_gather_coalesced", OpKind::Allgather, flat_outs,
                 inputs, dtype, ReduceOp::None, numel, opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                   std::vector<at::Tensor>& inputs,
                                                                                   const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(), "xirang rank ", rank_,
              ": allgather_into_tensor_coalesced: ", outputs.size(), " outputs for ", inputs.size(), " inputs");
  // Ops complete in queue order, so the last Work completes after all of them.
  c10::intrusive_ptr<c10d::Work> last;
  for (size_t i = 0; i < inputs.size(); ++i) last = _allgather_base(outputs[i], inputs[i], opts);
  return last;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
#ifdef XIRANG_WITH_CUDA
  if (anyCuda({output, input})) {
    auto st = newStage(cuda_streams_);
    at::Tensor o = st->add(output, false, true), i = st->add(input, true, false);
    PendingStage pending(st);
    return _reduce_scatter_base(o, i, opts);
  }
#endif
  checkTensors(rank_, "reduce_scatter_tensor", {output, input});
  checkSameType(rank_, "reduce_scatter_tensor", output, input);
  TORCH_CHECK(input.numel() == output.numel() * size_, "xirang rank ", rank_, ": reduce_scatter_tensor: input has ",
              input.numel(), " elements, expected world size ", size_, " x output ", output.numel());
  ReduceOp op = toReduceOp(opts.reduceOp);
  checkReduce(rank_, "reduce_scatter_tensor", input.scalar_type(), op);
  double premul = op == ReduceOp::PremulSum ? premulFactor(opts.reduceOp) : 1.0;
  auto fn = [this, output, input, op, premul](OpCtx& ctx) {
    at::Tensor buf = is16BitFloat(input.scalar_type()) ? input.to(at::kFloat).reshape(-1)
                                                       : input.reshape(-1).clone(at::MemoryFormat::Contiguous);
    DType wire = wireDType(buf);
    const Scaling sc = scalingFor(op, premul, size_);  // AVG divides before the sum: no overflow
    if (sc.factor != 1.0) scale(buf.data_ptr(), buf.numel(), wire, sc.factor);
    uint64_t b = static_cast<uint64_t>(output.numel()) * buf.element_size();
    std::vector<RecvSeg> blocks;
    for (int r = 0; r < size_; ++r) blocks.push_back(RecvSeg{static_cast<uint8_t*>(buf.data_ptr()) + b * r, b});
    xirang::reduceScatter(comm_, ctx, blocks, wire, sc.wire_op);
    at::Tensor mine = buf.narrow(0, output.numel() * rank_, output.numel());
    output.copy_(mine.view(output.sizes()));
  };
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "xirang:reduce_scatter_tensor", OpKind::ReduceScatter, {output},
                 {input}, toDType(input.scalar_type()), op, static_cast<uint64_t>(input.numel()), opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1, "xirang rank ", rank_,
              ": reduce_scatter takes one output tensor and one input list per process");
  TORCH_CHECK(static_cast<int>(inputs[0].size()) == size_, "xirang rank ", rank_, ": reduce_scatter: input list has ",
              inputs[0].size(), " tensors, expected world size ", size_);
  checkTensors(rank_, "reduce_scatter", outputs);
  checkTensors(rank_, "reduce_scatter", inputs[0]);
  for (auto& t : inputs[0]) {
    checkSameType(rank_, "reduce_scatter", outputs[0], t);
    TORCH_CHECK(t.numel() == outputs[0].numel(), "xirang rank ", rank_, ": reduce_scatter: input tensor has ",
                t.numel(), " elements, output ", outputs[0].numel());
  }
  std::vector<at::Tensor> flat;
  for (auto& t : inputs[0]) flat.push_back(t.reshape(-1));
  at::Tensor input = at::cat(flat);
  at::Tensor output = outputs[0];
  auto w = _reduce_scatter_base(output, input, opts);
  return w;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                   std::vector<at::Tensor>& inputs,
                                                                                   const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(), "xirang rank ", rank_,
              ": reduce_scatter_tensor_coalesced: ", outputs.size(), " outputs for ", inputs.size(), " inputs");
  c10::intrusive_ptr<c10d::Work> last;
  for (size_t i = 0; i < inputs.size(); ++i) last = _reduce_scatter_base(outputs[i], inputs[i], opts);
  return last;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                 std::vector<int64_t>& outputSplits,
                                                                 std::vector<int64_t>& inputSplits,
                                                                 const c10d::AllToAllOptions& opts) {
#ifdef XIRANG_WITH_CUDA
  if (anyCuda({output, input})) {
    auto st = newStage(cuda_streams_);
    at::Tensor o = st->add(output, false, true), i = st->add(input, true, false);
    PendingStage pending(st);
    return alltoall_base(o, i, outputSplits, inputSplits, opts);
  }
#endif
  checkTensors(rank_, "alltoall_base", {output, input});
  checkSameType(rank_, "alltoall_base", output, input);
  auto splitsOf = [&](const at::Tensor& t, const std::vector<int64_t>& sp, const char* which) {
    std::vector<int64_t> rows;
    int64_t dim0 = t.dim() == 0 ? 1 : t.size(0);
    if (sp.empty()) {
      TORCH_CHECK(dim0 % size_ == 0, "xirang rank ", rank_, ": alltoall_base: ", which, " dim 0 (", dim0,
                  ") is not divisible by world size ", size_);
      rows.assign(size_, dim0 / size_);
    } else {
      TORCH_CHECK(static_cast<int>(sp.size()) == size_, "xirang rank ", rank_, ": alltoall_base: ", which,
                  " splits have ", sp.size(), " entries, expected ", size_);
      int64_t sum = 0;
      for (auto v : sp) sum += v;
      TORCH_CHECK(sum == dim0, "xirang rank ", rank_, ": alltoall_base: ", which, " splits sum to ", sum,
                  ", dim 0 is ", dim0);
      rows = sp;
    }
    return rows;
  };
  auto in_rows = splitsOf(input, inputSplits, "input");
  auto out_rows = splitsOf(output, outputSplits, "output");
  auto fn = [this, output, input, in_rows, out_rows](OpCtx& ctx) {
    Staged so = stage(output);
    at::Tensor in = input.contiguous();
    int64_t in_row = input.dim() == 0 ? 1 : (input.size(0) ? input.numel() / input.size(0) : 0);
    int64_t out_row = output.dim() == 0 ? 1 : (output.size(0) ? output.numel() / output.size(0) : 0);
    uint64_t es = input.element_size();
    std::vector<SendSeg> sends;
    std::vector<RecvSeg> recvs;
    uint64_t ioff = 0, ooff = 0;
    for (int r = 0; r < size_; ++r) {
      uint64_t ib = static_cast<uint64_t>(in_rows[r] * in_row) * es, ob = static_cast<uint64_t>(out_rows[r] * out_row) * es;
      sends.push_back(SendSeg{static_cast<const uint8_t*>(in.data_ptr()) + ioff, ib});
      recvs.push_back(RecvSeg{static_cast<uint8_t*>(so.buf.data_ptr()) + ooff, ob});
      ioff += ib;
      ooff += ob;
    }
    xirang::alltoall(comm_, ctx, sends, recvs);
    so.finish();
  };
  return enqueue(c10d::OpType::ALLTOALL_BASE, "xirang:all_to_all", OpKind::Alltoall, {output}, {input},
                 toDType(input.scalar_type()), ReduceOp::None, static_cast<uint64_t>(input.numel()), opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_ && static_cast<int>(inputs.size()) == size_, "xirang rank ",
              rank_, ": alltoall: expected ", size_, " input and output tensors, got ", inputs.size(), " and ",
              outputs.size());
  checkTensors(rank_, "alltoall", inputs);
  checkTensors(rank_, "alltoall", outputs);
  for (auto& t : inputs) checkSameType(rank_, "alltoall", inputs[0], t);
  for (auto& t : outputs) checkSameType(rank_, "alltoall", inputs[0], t);
  auto outs = outputs;
  auto ins = inputs;
  auto fn = [this, outs, ins](OpCtx& ctx) {
    std::vector<at::Tensor> in_c, out_c;
    std::vector<SendSeg> sends;
    std::vector<RecvSeg> recvs;
    for (int r = 0; r < size_; ++r) {
      in_c.push_back(ins[r].contiguous());
      out_c.push_back(outs[r].is_contiguous() ? outs[r] : at::empty_like(outs[r], at::MemoryFormat::Contiguous));
      sends.push_back(SendSeg{in_c[r].data_ptr(), nbytes(in_c[r])});
      recvs.push_back(RecvSeg{out_c[r].data_ptr(), nbytes(out_c[r])});
    }
    xirang::alltoall(comm_, ctx, sends, recvs);
    for (int r = 0; r < size_; ++r)
      if (!out_c[r].is_same(outs[r])) outs[r].copy_(out_c[r]);
  };
  uint64_t total = 0;
  for (auto& t : inputs) total += static_cast<uint64_t>(t.numel());
  return enqueue(c10d::OpType::ALLTOALL, "xirang:all_to_all", OpKind::Alltoall, outputs, inputs,
                 toDType(inputs[0].scalar_type()), ReduceOp::None, total, opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::GatherOptions& opts) {
  TORCH_CHECK(inputs.size() == 1, "xirang rank ", rank_, ": gather takes exactly one input tensor");
  checkTensors(rank_, "gather", inputs);
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "xirang rank ", rank_, ": gather: invalid root ", root);
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, "xirang rank ", rank_,
                ": gather: the root needs a list of ", size_, " output tensors");
    outs = outputs[0];
    checkTensors(rank_, "gather", outs);
    for (auto& o : outs) {
      checkSameType(rank_, "gather", in, o);
      TORCH_CHECK(o.numel() == in.numel(), "xirang rank ", rank_, ": gather: output has ", o.numel(),
                  " elements, input ", in.numel());
    }
  } else {
    TORCH_CHECK(outputs.empty() || outputs[0].empty(), "xirang rank ", rank_,
                ": gather: only the root passes output tensors");
  }
  auto fn = [this, in, outs, root](OpCtx& ctx) {
    at::Tensor ic = in.contiguous();
    std::vector<at::Tensor> oc;
    std::vector<RecvSeg> blocks;
    for (auto& o : outs) {
      oc.push_back(o.is_contiguous() ? o : at::empty_like(o, at::MemoryFormat::Contiguous));
      blocks.push_back(RecvSeg{oc.back().data_ptr(), nbytes(oc.back())});
    }
    xirang::gather(comm_, ctx, SendSeg{ic.data_ptr(), nbytes(ic)}, blocks, root);
    for (size_t r = 0; r < outs.size(); ++r)
      if (!oc[r].is_same(outs[r])) outs[r].copy_(oc[r]);
  };
  return enqueue(c10d::OpType::GATHER, "xirang:gather", OpKind::Gather, outs, inputs, toDType(in.scalar_type()),
                 ReduceOp::None, static_cast<uint64_t>(in.numel()), opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == 1, "xirang rank ", rank_, ": scatter takes exactly one output tensor");
  checkTensors(rank_, "scatter", outputs);
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "xirang rank ", rank_, ": scatter: invalid root ", root);
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, "xirang rank ", rank_,
                ": scatter: the root needs a list of ", size_, " input tensors");
    ins = inputs[0];
    checkTensors(rank_, "scatter", ins);
    for (auto& t : ins) {
      checkSameType(rank_, "scatter", out, t);
      TORCH_CHECK(t.numel() == out.numel(), "xirang rank ", rank_, ": scatter: input has ", t.numel(),
                  " elements, output ", out.numel());
    }
  } else {
    TORCH_CHECK(inputs.empty() || inputs[0].empty(), "xirang rank ", rank_,
                ": scatter: only the root passes input tensors");
  }
  auto fn = [this, out, ins, root](OpCtx& ctx) {
    std::vector<at::Tensor> ic;
    std::vector<SendSeg> blocks;
    for (auto& t : ins) {
      ic.push_back(t.contiguous());
      blocks.push_back(SendSeg{ic.back().data_ptr(), nbytes(ic.back())});
    }
    Staged so = stage(out);
    xirang::scatter(comm_, ctx, blocks, RecvSeg{so.buf.data_ptr(), nbytes(so.buf)}, root);
    so.finish();
  };
  return enqueue(c10d::OpType::SCATTER, "xirang:scatter", OpKind::Scatter, outputs, ins, toDType(out.scalar_type()),
                 ReduceOp::None, static_cast<uint64_t>(out.numel()), opts.timeout, fn);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::barrier(const c10d::BarrierOptions& opts) {
  auto fn = [this](OpCtx& ctx) {
    uint8_t one = 1;
    xirang::allreduce(comm_, ctx, &one, 1, DType::UInt8, ReduceOp::Max);
  };
  return enqueue(c10d::OpType::BARRIER, "xirang:barrier", OpKind::Barrier, {}, {}, DType::UInt8, ReduceOp::Max, 1,
                 opts.timeout, fn);
}

void ProcessGroupXirang::setSequenceNumberForGroup() {}  // every rank starts at 0: nothing to agree on

uint64_t ProcessGroupXirang::getSequenceNumberForGroup() { return seq_; }

// ---------------------------------------------------------------- point to point

// Point-to-point operations do not go through the op queue: they are posted straight to the
// transport's point-to-point engine (core/transport/p2p.h), which moves them on connections of
// their own, all at once and independently of the order they were issued in (gloo's semantics):
// a receive posted before a send to the same peer, rings of isend/irecv and batch_isend_irecv
// of any size complete. Their Work completes on the engine's thread.
namespace {
transport::FrameHeader p2pHeader(const at::Tensor& t, int tag) {
  transport::FrameHeader h;
  h.kind = transport::FrameKind::Data;
  h.op = OpKind::Send;
  h.dtype = toDType(t.scalar_type());
  h.tag = static_cast<uint32_t>(tag);
  h.op_numel = static_cast<uint64_t>(t.numel());
  return h;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::postP2P(bool is_send, int peer, int tag, const at::Tensor& t,
                                                           c10d::OpType type, const char* title) {
  checkPoisoned();
  const std::string opname = std::string(title).substr(std::strlen("xirang:"));
  auto work = c10::make_intrusive<WorkXirang>(rank_, type, title, std::vector<at::Tensor>{t},
                                              std::optional<std::vector<at::Tensor>>(std::vector<at::Tensor>{t}));
  std::ostringstream d;
  d << "xirang rank " << rank_ << ": " << opname << " (" << dtypeName(toDType(t.scalar_type())) << ", " << t.numel()
    << " elements, tag " << tag << (is_send ? ", to rank " : ", from ")
    << (peer < 0 ? std::string("any rank") : (is_send ? "" : "rank ") + std::to_string(peer)) << ", group '"
    << cfg_.group_name << "')";
  work->desc_ = d.str();
  at::Tensor user = t, buf;
#ifdef XIRANG_WITH_CUDA
  std::shared_ptr<cudastage::Stage> stage;
  if (t.is_cuda()) {
    stage = newStage(cuda_streams_);
    buf = stage->add(t, /*copy_in=*/is_send, /*copy_out=*/!is_send);
    stage->inputsReady();
    work->setCudaStage(stage);
    if (is_send) stage->copyIn();  // the send reads the host mirror: it must hold the finished values
  }
#endif
  if (!buf.defined()) buf = is_send ? t.contiguous() : (t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous));
  const uint64_t bytes = nbytes(buf);
  const auto t0 = Clock::now();
  OpRecord rec;
  if (records_on_) {
    rec.op = opname;
    rec.algorithm = "p2p";
    rec.dtype = dtypeName(toDType(t.scalar_type()));
    rec.numel = static_cast<uint64_t>(t.numel());
    rec.t_enqueue = std::chrono::duration<double>(t0 - created_).count();
    rec.wait = std::make_shared<WaitClock>();
    work->wait_clock_ = rec.wait;
  }
  const uint64_t epoch = epoch_.load();
  auto done = [this, work, buf, user, is_send, bytes, t0, epoch, rec = std::move(rec)
#ifdef XIRANG_WITH_CUDA
               , stage
#endif
  ](std::exception_ptr err, int src) mutable {
    if (!err && !is_send) {
      try {
#ifdef XIRANG_WITH_CUDA
        if (stage) stage->copyOut();
        else
#endif
        if (!buf.is_same(user)) user.copy_(buf);
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (!err) work->source_rank_ = src;
    if (err) err = p2pFailed(work->desc_, err, epoch);
    if (records_on_) {
      const auto end = Clock::now();
      rec.total_s = std::chrono::duration<double>(end - t0).count();
      rec.ok = err == nullptr;
      if (is_send) rec.bytes_raw = rec.bytes_wire = err ? 0 : bytes;
      if (!err) rec.peers.push_back({src, is_send ? rec.total_s : 0.0, is_send ? 0.0 : rec.total_s, is_send ? bytes : 0,
                                     is_send ? 0 : bytes});
      if (!err && is_send) addCrossBytes(rec, src, bytes);
      keepRecord(std::move(rec), end, 0);
    }
    work->complete(err);
  };
  {
    std::unique_lock<std::mutex> g(mem_mu_);
    if (cfg_.elastic && static_cast<int>(live_.size()) < size_) {
      g.unlock();
      done(std::make_exception_ptr(MembershipChanged(
               work->desc_ + " is not available after a membership change (" + membershipText(nullptr) +
               "): only allreduce, broadcast, barrier and the hook's operation run on the shrunken ring; create a "
               "new group over the live ranks for the others")),
           peer);
    } else {
      transport::P2P* engine = nullptr;
      try {
        engine = &tcp_->p2p();
      } catch (...) {
        g.unlock();
        done(std::current_exception(), peer);
      }
      if (engine) {
        const auto deadline = t0 + cfg_.timeout;
        auto h = p2pHeader(buf, tag);
        // The engine may call `done` on this thread (when it has already failed): without mem_mu_.
        g.unlock();
        if (is_send) engine->send(peer, h, buf.data_ptr(), bytes, deadline, std::move(done));
        else engine->recv(peer, h, buf.data_ptr(), bytes, deadline, std::move(done));
      }
    }
  }
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

// A point-to-point operation failed: in elastic mode, because the membership changed (the old
// epoch's transport closed under it), it raises MembershipChanged and the group goes on;
// otherwise the first error poisons the group as a collective's would (fail-fast).
std::exception_ptr ProcessGroupXirang::p2pFailed(const std::string& desc, std::exception_ptr err, uint64_t epoch) {
  std::string what;
  try {
    std::rethrow_exception(err);
  } catch (const MembershipChanged&) {
    return err;
  } catch (const c10::Error& e) {
    what = e.msg();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "unknown error";
  }
  if (cfg_.elastic && (epoch_.load() != epoch || membership_signal_.load()))
    return std::make_exception_ptr(MembershipChanged(desc + " was interrupted by a membership change (" + what +
                                                     "); its result is void"));
  std::string msg = desc + " failed: " + what;
  bool first;
  {
    std::lock_guard<std::mutex> g(mu_);
    first = poison_.empty() && !stop_;
  }
  poison(msg);
  if (first) {
    env::log(env::Level::Warn, rank_, msg);
    // Tell the peers (abort frames, the store's abort note), as a failed collective does. Not
    // under mem_mu_: this may run on the caller's thread inside postP2P.
    std::shared_ptr<transport::Tcp> tcp;
    {
      std::lock_guard<std::mutex> g(mem_mu_);
      tcp = tcp_;
    }
    if (tcp) tcp->abort(msg);
  }
  return std::make_exception_ptr(std::runtime_error(msg));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  TORCH_CHECK(tensors.size() == 1, "xirang rank ", rank_, ": send takes exactly one tensor");
  checkTensors(rank_, "send", tensors, /*cuda_ok=*/true);
  TORCH_CHECK(dstRank >= 0 && dstRank < size_ && dstRank != rank_, "xirang rank ", rank_, ": send: invalid peer ",
              dstRank);
  return postP2P(true, dstRank, tag, tensors[0], c10d::OpType::SEND, "xirang:send");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  TORCH_CHECK(tensors.size() == 1, "xirang rank ", rank_, ": recv takes exactly one tensor");
  checkTensors(rank_, "recv", tensors, /*cuda_ok=*/true);
  TORCH_CHECK(srcRank >= 0 && srcRank < size_ && srcRank != rank_, "xirang rank ", rank_, ": recv: invalid peer ",
              srcRank);
  return postP2P(false, srcRank, tag, tensors[0], c10d::OpType::RECV, "xirang:recv");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  TORCH_CHECK(tensors.size() == 1, "xirang rank ", rank_, ": recv takes exactly one tensor");
  checkTensors(rank_, "recv", tensors, /*cuda_ok=*/true);
  return postP2P(false, -1, tag, tensors[0], c10d::OpType::RECVANYSOURCE, "xirang:recv_anysource");
}

void ProcessGroupXirang::startCoalescing() {
  TORCH_CHECK(!coalescing_, "xirang rank ", rank_, ": startCoalescing called twice");
  coalescing_ = true;
  coalesced_.clear();
}

// The Work of a batch (batch_isend_irecv, the coalescing manager): completes once every
// operation issued since startCoalescing has, with the first error among them. The operations
// themselves already run concurrently (point-to-point) or in order (collectives).
c10::intrusive_ptr<c10d::Work> ProcessGroupXirang::endCoalescing() {
  TORCH_CHECK(coalescing_, "xirang rank ", rank_, ": endCoalescing without startCoalescing");
  coalescing_ = false;
  auto works = std::move(coalesced_);
  coalesced_.clear();
  auto batch = c10::make_intrusive<WorkXirang>(rank_, c10d::OpType::COALESCED, "xirang:coalesced",
                                               std::vector<at::Tensor>{}, std::nullopt);
  batch->desc_ = "xirang rank " + std::to_string(rank_) + ": coalesced batch of " + std::to_string(works.size()) +
                 " operations (group '" + cfg_.group_name + "')";
  if (works.empty()) {
    batch->complete(nullptr);
    return batch;
  }
  struct Left {
    std::atomic<size_t> n;
    std::mutex mu;
    std::exception_ptr first;
  };
  auto left = std::make_shared<Left>();
  left->n = works.size();
  for (auto& w : works) {
    w->getFuture()->addCallback([left, batch](c10::ivalue::Future& f) {
      if (f.hasError()) {
        std::lock_guard<std::mutex> g(left->mu);
        if (!left->first) left->first = f.exception_ptr();
      }
      if (--left->n == 0) batch->complete(left->first);
    });
  }
  return batch;
}

}  // namespace xirang
