// The NCCL link: see nccl_link.h.
#include "core/transport/nccl_link.h"

#include "core/device/backoff.h"
#include "core/env.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <utility>

namespace xirang::transport {

namespace dv = xirang::device;

namespace {

using dv::Backoff;

std::string ncclWhat(dv::NcclApi& nccl, dv::NcclComm comm, int result) {
  std::string s = std::string("NCCL error ") + std::to_string(result) + " (" + nccl.errorString(result) + ")";
  const std::string last = nccl.lastError(comm);
  if (!last.empty()) s += ": " + last;
  return s;
}

void putU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t getU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

template <class Seg>
uint64_t totalBytes(const std::vector<Seg>& segs) {
  uint64_t t = 0;
  for (const auto& s : segs) t += s.bytes;
  return t;
}

// The 64-byte agreement record of one job: its header with payload_bytes = the job's bytes, then
// the segment count and the first segment's size.
template <class Seg>
void encodeRecord(const FrameHeader& h, const std::vector<Seg>& segs, uint8_t* out) {
  FrameHeader x = h;
  x.payload_bytes = totalBytes(segs);
  encodeHeader(x, out);
  putU64(out + kHeaderBytes, segs.size());
  putU64(out + kHeaderBytes + 8, segs.empty() ? 0 : segs[0].bytes);
}

}  // namespace

dv::NcclUniqueId shareNcclUniqueId(dv::NcclApi& nccl, Store& store, const std::string& key, int rank,
                                   Deadline deadline, const StopCheck& stop) {
  dv::NcclUniqueId id;
  static const std::string kError = "error: ";
  if (rank == 0) {
    const int r = nccl.getUniqueId(&id);
    if (r != dv::kNcclSuccess) {
      const std::string why = "ncclGetUniqueId: " + ncclWhat(nccl, nullptr, r);
      try {
        store.set(key, kError + why);  // the others fail now, not at their deadline
      } catch (const std::exception&) {
      }
      throw TransportError(why, -1);
    }
    store.set(key, std::string(id.internal, sizeof id.internal));
    return id;
  }
  const std::string why =
      pollForKey(store, key, deadline, stop, "timed out waiting for rank 0's NCCL unique id under store key '" + key + "'", 0);
  if (!why.empty()) throw TransportError(why + " (waiting for rank 0's NCCL unique id)", -1);
  const std::string v = store.get(key, deadline);
  if (v.size() != sizeof id.internal && v.compare(0, kError.size(), kError) == 0)
    throw TransportError("rank 0 could not make the NCCL unique id: " + v.substr(kError.size(), 1024), 0);
  if (v.size() != sizeof id.internal)
    throw TransportError("NCCL unique id under store key '" + key + "' has " + std::to_string(v.size()) +
                             " bytes, expected " + std::to_string(sizeof id.internal),
                         0);
  std::memcpy(id.internal, v.data(), sizeof id.internal);
  return id;
}

NcclChoice chooseNccl(const std::vector<NcclCandidate>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    const NcclCandidate& c = ranks[r];
    const std::string who = "rank " + std::to_string(r);
    if (!c.automatic) return {false, who + " has XIRANG_CUDA_TRANSPORT=host or mirror"};
    if (!c.unavailable.empty()) return {false, who + " cannot use NCCL: " + c.unavailable};
    if (c.gpu.empty()) return {false, who + " named no GPU"};
    if (c.version != ranks[0].version)
      return {false, "rank 0 loaded NCCL " + ranks[0].version + ", " + who + " NCCL " + c.version +
                         " (NCCL refuses ranks of different versions)"};
    for (size_t s = 0; s < r; ++s) {
      const bool same_uuid = ranks[s].gpu == c.gpu;
      if (same_uuid || (!c.where.empty() && ranks[s].where == c.where))
        return {false, "rank " + std::to_string(s) + " and " + who + " share GPU " +
                           (same_uuid ? c.gpu : c.where) + " (NCCL refuses two ranks on one GPU)"};
    }
  }
  return {true, "NCCL " + (ranks.empty() ? std::string() : ranks[0].version) + " loaded on every rank and each of the " +
                    std::to_string(ranks.size()) + " ranks has a GPU of its own"};
}

namespace {
constexpr size_t kCandidateMaxBytes = 4096;
// "xirang-nccl-candidate 2|<automatic 0/1>|<gpu>|<where>|<version>|<unavailable...>"; the first
// four fields hold no '|'.
constexpr const char* kCandidateTag = "xirang-nccl-candidate 2|";

std::string field(std::string v) {
  std::replace(v.begin(), v.end(), '|', '_');
  return v;
}

std::string encodeCandidate(const NcclCandidate& c) {
  std::string s = std::string(kCandidateTag) + (c.automatic ? "1" : "0") + "|" + field(c.gpu) + "|" +
                  field(c.where) + "|" + field(c.version) + "|" + c.unavailable;
  if (s.size() > kCandidateMaxBytes) s.resize(kCandidateMaxBytes);
  return s;
}

NcclCandidate decodeCandidate(const std::string& v, int rank) {
  NcclCandidate c;
  const size_t a = std::strlen(kCandidateTag);
  std::vector<std::string> f;  // automatic, gpu, where, version
  size_t at = a;
  const bool tagged = v.size() <= kCandidateMaxBytes && v.compare(0, a, kCandidateTag) == 0;
  while (tagged && f.size() < 4) {
    const size_t e = v.find('|', at);
    if (e == std::string::npos) break;
    f.push_back(v.substr(at, e - at));
    at = e + 1;
  }
  if (f.size() < 4 || (f[0] != "0" && f[0] != "1")) {
    c.unavailable = "its record (" + std::to_string(v.size()) + " bytes) did not parse (rank " + std::to_string(rank) +
                    " runs another xirang version?)";
    return c;
  }
  c.automatic = f[0] == "1";
  c.gpu = f[1];
  c.where = f[2];
  c.version = f[3];
  c.unavailable = v.substr(at);
  return c;
}
}  // namespace

NcclChoice declareNotAuto(Store& store, const std::string& key, int rank) {
  NcclCandidate c;
  c.automatic = false;
  store.set(key + "/" + std::to_string(rank), encodeCandidate(c));
  return {false, "this rank has XIRANG_CUDA_TRANSPORT=host or mirror"};
}

NcclChoice agreeOnNccl(Store& store, const std::string& key, int rank, int size, const NcclCandidate& mine,
                       Deadline deadline, const std::function<std::string(int)>& gone) {
  if (!mine.automatic) return declareNotAuto(store, key, rank);
  store.set(key + "/" + std::to_string(rank), encodeCandidate(mine));
  std::vector<NcclCandidate> all(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    if (r == rank) {
      all[static_cast<size_t>(r)] = decodeCandidate(encodeCandidate(mine), r);  // as the others read it
      continue;
    }
    const std::string k = key + "/" + std::to_string(r);
    const std::string who = "rank " + std::to_string(r);
    const std::string why = pollForKey(
        store, k, deadline, gone ? StopCheck([&gone, r] { return gone(r); }) : StopCheck(),
        who + " did not say whether it can use NCCL by the group's timeout (XIRANG_CUDA_TRANSPORT=auto decides at "
              "the first CUDA collective, which every rank must run on CUDA tensors; set XIRANG_CUDA_TRANSPORT=host "
              "where ranks mix CPU and CUDA)",
        -1);
    if (!why.empty()) throw TransportError(why + " (waiting for " + who + " to say whether it can use NCCL)", r);
    all[static_cast<size_t>(r)] = decodeCandidate(store.get(k, deadline), r);
  }
  return chooseNccl(all);
}

namespace {
std::atomic<int64_t> g_teardown_limit_ms{10000};

void abortInit(dv::NcclApi& nccl, dv::NcclComm comm, int rank) {
  dv::NcclApi* api = &nccl;
  (void)boundedTeardown([api, comm] { return api->commAbort(comm); }, "ncclCommAbort (a communicator being made)",
                        rank);
}
}  // namespace

std::chrono::milliseconds teardownLimit() { return std::chrono::milliseconds(g_teardown_limit_ms.load()); }
void setTeardownLimit(std::chrono::milliseconds limit) { g_teardown_limit_ms = limit.count(); }

int boundedTeardown(std::function<int()> call, const std::string& what, int rank) {
  struct Result {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    int r = dv::kNcclInProgress;
  };
  auto res = std::make_shared<Result>();
  const auto limit = teardownLimit();
  std::thread t;
  try {
    t = std::thread([res, call = std::move(call)] {
      const int r = call();
      std::lock_guard<std::mutex> g(res->mu);
      res->r = r;
      res->done = true;
      res->cv.notify_all();
    });
  } catch (const std::exception& e) {  // no thread to be had: nothing to bound it with
    env::log(env::Level::Warn, rank, what + ": no thread to run it on (" + e.what() + "): the communicator is left to the process");
    return dv::kNcclInProgress;
  }
  std::unique_lock<std::mutex> lk(res->mu);
  if (res->cv.wait_for(lk, limit, [&] { return res->done; })) {
    lk.unlock();
    t.join();
    return res->r;
  }
  lk.unlock();
  t.detach();
  env::log(env::Level::Warn, rank,
           what + " did not return within " + std::to_string(limit.count()) + " ms (NCCL can block there for good when "
           "a peer is gone: NVIDIA/nccl#992); it is left running on a thread of its own and the communicator is leaked");
  return dv::kNcclInProgress;
}

dv::NcclComm initNcclComm(dv::NcclApi& nccl, const dv::NcclUniqueId& id, int rank, int size, Deadline deadline,
                          const std::string& name, const StopCheck& stop) {
  dv::NcclConfig cfg;
  cfg.blocking = false;
  cfg.comm_name = name;
  dv::NcclComm comm = nullptr;
  const std::string what = "NCCL communicator" + (name.empty() ? std::string() : " '" + name + "'") + " (rank " +
                           std::to_string(rank) + " of " + std::to_string(size) + ")";
  int r = nccl.commInitRankConfig(&comm, size, id, rank, cfg);
  if (r != dv::kNcclSuccess && r != dv::kNcclInProgress) {
    std::string msg = "ncclCommInitRankConfig of " + what + ": " + ncclWhat(nccl, comm, r);
    if (comm) abortInit(nccl, comm, rank);
    throw TransportError(msg, -1);
  }
  Backoff b;
  auto next_stop = Clock::now() + std::chrono::milliseconds(50);
  for (;;) {
    int async = dv::kNcclInProgress;
    r = nccl.commGetAsyncError(comm, &async);
    if (r == dv::kNcclSuccess && async == dv::kNcclSuccess) return comm;
    if (stop && Clock::now() >= next_stop) {
      next_stop = Clock::now() + std::chrono::milliseconds(50);
      const std::string why = stop();
      if (!why.empty()) {
        abortInit(nccl, comm, rank);
        throw TransportError(why + " (initialising " + what + ")", -1);
      }
    }
    if (r != dv::kNcclSuccess || async != dv::kNcclInProgress) {
      const std::string msg = "initialising " + what + ": " + ncclWhat(nccl, comm, r != dv::kNcclSuccess ? r : async);
      abortInit(nccl, comm, rank);
      throw TransportError(msg, -1);
    }
    if (Clock::now() >= deadline) {
      abortInit(nccl, comm, rank);
      throw TimeoutError("timed out initialising " + what + ": not every rank joined (a rank that never calls it?)",
                         -1);
    }
    b.pause();
  }
}

NcclStart startNcclAgreed(dv::NcclApi& nccl, Store& store, const std::string& key, int rank, int size,
                          Deadline deadline, const std::string& name, const StopCheck& stop,
                          const std::function<void(device::NcclComm)>& prepare) {
  static const std::string kOk = "ok", kFailed = "failed: ";
  const auto started = Clock::now();
  auto made = [&key](int r) { return key + "/made/" + std::to_string(r); };
  auto failure = [](const std::string& v) { return v.compare(0, kFailed.size(), kFailed) == 0; };
  // A failing rank also sets one shared key, which the others' waits poll (one key, at most every
  // 200 ms: the store sees O(ranks) requests, not O(ranks^2)); "" while there is none.
  const std::string any_failed = key + "/failed";
  Clock::time_point next_poll{};
  auto peer_failed = [&]() -> std::string {
    if (Clock::now() < next_poll || !store.check(any_failed)) return {};
    next_poll = Clock::now() + std::chrono::milliseconds(200);
    return store.get(any_failed, Clock::now() + std::chrono::seconds(5)).substr(0, 4096);
  };
  std::string group_failed;  // what `stop` said last: an attempt ended by it is thrown, not a fallback
  std::string peer_why;      // what another rank's failure said last: this rank records that one
  const StopCheck watch = [&]() -> std::string {
    if (stop) {
      std::string w = stop();
      if (!w.empty()) return group_failed = w;
    }
    std::string w = peer_failed();
    if (!w.empty()) peer_why = w;
    return w;
  };
  auto starts = [](const std::string& s, const std::string& head) { return !head.empty() && s.rfind(head, 0) == 0; };
  dv::NcclComm comm = nullptr;
  bool prepared = false;  // prepare() returned: the communicator is the caller's from now on
  std::string record = kOk;
  try {
    const dv::NcclUniqueId id = shareNcclUniqueId(nccl, store, key + "/uid", rank, deadline, watch);
    comm = initNcclComm(nccl, id, rank, size, deadline, name, watch);
    if (prepare) {
      try {
        prepare(comm);
        prepared = true;
      } catch (const std::exception& e) {
        throw TransportError(std::string("preparing its NCCL link: ") + e.what(), -1);
      }
    }
  } catch (const TransportError& e) {
    const std::string what = e.what();
    if (starts(what, group_failed)) throw;  // the group failed (what the waits' messages start with)
    if (comm && !prepared) abortInit(nccl, comm, rank);
    comm = nullptr;
    record = kFailed + (starts(what, peer_why) ? peer_why
                                               : "rank " + std::to_string(rank) + " could not make its NCCL communicator: " +
                                                     what.substr(0, 2048));
    try {
      store.set(any_failed, record.substr(kFailed.size()));
    } catch (const std::exception&) {  // the records below still carry it
    }
  }
  auto drop = [&] {
    if (comm && !prepared) abortInit(nccl, comm, rank);
  };
  try {
    store.set(made(rank), record);
    // Every rank's outcome: the attempts end by `deadline` (or soon after the first failure, a
    // failed init's abort taking up to teardownLimit()), so a record still missing well after
    // that is a rank that is gone or stuck.
    const Deadline late = std::max(deadline, Clock::now()) +
                          std::min<Clock::duration>(Clock::now() - started, std::chrono::seconds(60)) + teardownLimit() +
                          std::chrono::seconds(5);
    std::string why;
    for (int r = 0; r < size && why.empty(); ++r) {
      std::string v = record;
      if (r != rank) {
        const std::string who = "rank " + std::to_string(r);
        const std::string w =
            pollForKey(store, made(r), late, stop, who + " did not say whether it made its NCCL communicator", r);
        if (!w.empty()) throw TransportError(w + " (waiting for " + who + "'s NCCL communicator)", r);
        v = store.get(made(r), late);
      }
      if (v != kOk) why = failure(v) ? v.substr(kFailed.size(), 4096) : "rank " + std::to_string(r) + "'s record did not parse";
    }
    if (why.empty()) return {comm, {}};
    drop();
    return {nullptr, why};
  } catch (...) {
    drop();
    throw;
  }
}

NcclLink::NcclLink(dv::NcclApi& nccl, dv::CudaApi& cuda, dv::NcclComm comm, int rank, int size, dv::Stream stream)
    : nccl_(nccl), cuda_(cuda), comm_(comm), rank_(rank), size_(size), stream_(stream) {
  if (!comm) throw std::invalid_argument("xirang: NcclLink needs a communicator");
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("xirang: NcclLink: rank " + std::to_string(rank) + " of " + std::to_string(size));
  sent_hdr_.assign(static_cast<size_t>(size), 0);
  recv_hdr_.assign(static_cast<size_t>(size), 0);
  const size_t bytes = 2 * static_cast<size_t>(size) * kRecordBytes;
  void* d = nullptr;
  void* h = nullptr;
  callCuda(cuda_.eventCreate(&done_), "cudaEventCreate");
  callCuda(cuda_.eventCreate(&ready_), "cudaEventCreate");
  callCuda(cuda_.malloc(&d, bytes), "cudaMalloc (NCCL link header buffer)");
  hdr_dev_ = static_cast<uint8_t*>(d);
  callCuda(cuda_.mallocHost(&h, bytes), "cudaMallocHost (NCCL link header buffer)");
  hdr_host_ = static_cast<uint8_t*>(h);
}

namespace {
std::atomic<bool> g_leak_at_exit{false};
}  // namespace

void NcclLink::leakAtExit() { g_leak_at_exit = true; }

NcclLink::~NcclLink() {
  if (g_leak_at_exit.load()) return;
  // Idle (nothing pending on the stream): destroy the communicator and free the buffers. Else
  // abort it, and leave the small header buffers to the process (work still queued on the
  // stream may write them).
  bool idle = false;
  bool was_aborted;
  {
    std::lock_guard<std::mutex> g(mu_);
    was_aborted = aborted_;
  }
  if (done_ && cuda_.eventRecord(done_, stream_) == dv::kCudaSuccess) {
    const auto until = Clock::now() + std::chrono::milliseconds(was_aborted ? 20 : 200);
    Backoff b;
    for (;;) {
      const int q = cuda_.eventQuery(done_);
      if (q == dv::kCudaSuccess) {
        idle = true;
        break;
      }
      if (q != dv::kCudaErrorNotReady || Clock::now() >= until) break;
      b.pause();
    }
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!aborted_) {
      dv::NcclApi* api = &nccl_;
      dv::NcclComm c = comm_;
      if (idle) (void)boundedTeardown([api, c] { return api->commDestroy(c); }, "ncclCommDestroy", rank_);
      else (void)boundedTeardown([api, c] { return api->commAbort(c); }, "ncclCommAbort", rank_);
      aborted_ = true;
    }
  }
  if (idle) {
    if (hdr_dev_) (void)cuda_.free(hdr_dev_);
    if (hdr_host_) (void)cuda_.freeHost(hdr_host_);
  }
  if (done_) (void)cuda_.eventDestroy(done_);
  if (ready_) (void)cuda_.eventDestroy(ready_);
}

void NcclLink::check() {
  std::lock_guard<std::mutex> g(mu_);
  if (!stop_why_.empty()) throw TransportError("NCCL link closed: " + stop_why_, -1);
}

void NcclLink::fail(const std::string& what, bool timeout, int peer) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_why_.empty()) stop_why_ = what;
    // An open group holds the communicator: grouped() aborts it after the group's end.
    if (in_group_) abort_after_group_ = true;
    else abortLocked();
  }
  if (timeout) throw TimeoutError(what, peer);
  throw TransportError(what, peer);
}

void NcclLink::callCuda(int result, const char* call) {
  if (result == dv::kCudaSuccess) return;
  const std::string msg = std::string(call) + ": CUDA error " + std::to_string(result) + " (" +
                          cuda_.errorString(result) + ")";
  if (comm_ && hdr_host_) fail(msg, false);  // constructed: the link is done
  throw TransportError(msg, -1);
}

void NcclLink::callNccl(int result, const char* call, Deadline deadline) {
  if (result == dv::kNcclSuccess) return;
  if (result != dv::kNcclInProgress) fail(std::string(call) + ": " + ncclWhat(nccl_, comm_, result), false);
  // Non-blocking communicator: the calls are still being enqueued.
  Backoff b;
  for (;;) {
    check();
    pollStop();
    int async = dv::kNcclInProgress;
    const int r = nccl_.commGetAsyncError(comm_, &async);
    if (r != dv::kNcclSuccess) fail(std::string("ncclCommGetAsyncError: ") + ncclWhat(nccl_, comm_, r), false);
    if (async == dv::kNcclSuccess) return;
    if (async != dv::kNcclInProgress) fail(std::string(call) + ": " + ncclWhat(nccl_, comm_, async), false);
    if (Clock::now() >= deadline) fail(std::string("timed out enqueuing ") + call, true);
    b.pause();
  }
}

void NcclLink::grouped(Deadline deadline, const std::function<void()>& calls) {
  callNccl(nccl_.groupStart(), "ncclGroupStart", deadline);
  {
    std::lock_guard<std::mutex> g(mu_);
    in_group_ = true;
  }
  try {
    calls();
  } catch (...) {
    // Close this thread's group whatever failed inside it, and only then abort the communicator
    // a failed call gave up (fail()): ncclGroupEnd still walks the group's communicators, and an
    // aborted one is freed memory.
    (void)nccl_.groupEnd();
    std::lock_guard<std::mutex> g(mu_);
    in_group_ = false;
    if (std::exchange(abort_after_group_, false)) abortLocked();
    throw;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    in_group_ = false;
  }
  callNccl(nccl_.groupEnd(), "ncclGroupEnd", deadline);
}

void NcclLink::setStopCheck(std::function<std::string()> check, std::chrono::milliseconds every) {
  stop_check_ = std::move(check);
  stop_every_ = every;
}

void NcclLink::pollStop() {
  if (!stop_check_) return;
  const auto now = Clock::now();
  if (now < next_stop_check_) return;
  next_stop_check_ = now + stop_every_;
  const std::string why = stop_check_();
  if (!why.empty()) fail("a peer failed: " + why, false);
}

void NcclLink::waitIdle(Deadline deadline, const std::string& what) {
  callCuda(cuda_.eventRecord(done_, stream_), "cudaEventRecord");
  Backoff b;
  for (;;) {
    check();
    pollStop();
    const int q = cuda_.eventQuery(done_);
    if (q != dv::kCudaSuccess && q != dv::kCudaErrorNotReady) callCuda(q, "cudaEventQuery");
    // The communicator's error also when the stream has drained: a call that failed (a peer
    // aborted) leaves the stream running on, so "idle" alone is no success.
    int async = dv::kNcclSuccess;
    const int r = nccl_.commGetAsyncError(comm_, &async);
    if (r != dv::kNcclSuccess) fail("ncclCommGetAsyncError: " + ncclWhat(nccl_, comm_, r), false);
    if (async != dv::kNcclSuccess && async != dv::kNcclInProgress)
      fail(ncclWhat(nccl_, comm_, async) + " while waiting for " + what, false);
    if (q == dv::kCudaSuccess) return;
    if (Clock::now() >= deadline) fail("timed out waiting for " + what + " (rank " + std::to_string(rank_) + ")", true);
    b.pause();
  }
}

void NcclLink::waitStream(dv::Stream producer) {
  check();
  if (producer == stream_) return;
  callCuda(cuda_.eventRecord(ready_, producer), "cudaEventRecord (caller's stream)");
  callCuda(cuda_.streamWaitEvent(stream_, ready_), "cudaStreamWaitEvent");
}

void NcclLink::synchronize(Deadline deadline) {
  check();
  waitIdle(deadline, "the NCCL link's stream");
}

void NcclLink::headerRound(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline) {
  uint8_t* hs = hdr_host_;
  uint8_t* hr = hdr_host_ + static_cast<size_t>(size_) * kRecordBytes;
  uint8_t* ds = hdr_dev_;
  uint8_t* dr = hdr_dev_ + static_cast<size_t>(size_) * kRecordBytes;
  std::vector<size_t> out, in;  // indices of the jobs that carry a record this time
  for (size_t i = 0; i < sends.size(); ++i)
    if (!sent_hdr_[static_cast<size_t>(sends[i].peer)]) out.push_back(i);
  for (size_t i = 0; i < recvs.size(); ++i)
    if (!recv_hdr_[static_cast<size_t>(recvs[i].peer)]) in.push_back(i);
  if (out.empty() && in.empty()) return;
  if (out.size() > static_cast<size_t>(size_) || in.size() > static_cast<size_t>(size_))
    throw std::logic_error("xirang: NcclLink: more jobs than peers in one exchange");
  for (size_t j = 0; j < out.size(); ++j) encodeRecord(sends[out[j]].header, sends[out[j]].segs, hs + j * kRecordBytes);
  if (!out.empty()) callCuda(cuda_.memcpyAsync(ds, hs, out.size() * kRecordBytes, stream_), "cudaMemcpyAsync");
  grouped(deadline, [&] {
    for (size_t j = 0; j < out.size(); ++j)
      callNccl(nccl_.send(ds + j * kRecordBytes, kRecordBytes, sends[out[j]].peer, comm_, stream_), "ncclSend",
               deadline);
    for (size_t j = 0; j < in.size(); ++j)
      callNccl(nccl_.recv(dr + j * kRecordBytes, kRecordBytes, recvs[in[j]].peer, comm_, stream_), "ncclRecv",
               deadline);
  });
  if (!in.empty()) callCuda(cuda_.memcpyAsync(hr, dr, in.size() * kRecordBytes, stream_), "cudaMemcpyAsync");
  std::string peers;
  for (size_t j : in) peers += (peers.empty() ? "" : ", ") + std::to_string(recvs[j].peer);
  for (size_t j : out) peers += (peers.empty() ? "" : ", ") + std::to_string(sends[j].peer);
  const FrameHeader& any = !out.empty() ? sends[out[0]].header : recvs[in[0]].expect;
  waitIdle(deadline, std::string("the agreement headers of ") + opKindName(any.op) + " #" + std::to_string(any.seq) +
                         " with rank(s) " + peers);
  for (size_t j : out) sent_hdr_[static_cast<size_t>(sends[j].peer)] = 1;
  for (size_t j = 0; j < in.size(); ++j) {
    RecvJob& job = recvs[in[j]];
    const uint8_t* rec = hr + j * kRecordBytes;
    uint8_t want[kRecordBytes];
    encodeRecord(job.expect, job.segs, want);
    const FrameHeader got = decodeHeader(rec);
    std::string diff = compareHeader(decodeHeader(want), got, job.peer);
    if (diff.empty() && std::memcmp(want + kHeaderBytes, rec + kHeaderBytes, 16) != 0)
      diff = "segment layout mismatch: this rank expects " + std::to_string(getU64(want + kHeaderBytes)) +
             " segments of " + std::to_string(getU64(want + kHeaderBytes + 8)) + " bytes, rank " +
             std::to_string(job.peer) + " sends " + std::to_string(getU64(rec + kHeaderBytes)) + " of " +
             std::to_string(getU64(rec + kHeaderBytes + 8)) + " (XIRANG_SEGMENT_BYTES differs?)";
    if (!diff.empty()) {
      {
        std::lock_guard<std::mutex> g(mu_);
        if (stop_why_.empty()) stop_why_ = diff;
      }
      throw MismatchError(diff, job.peer);
    }
    recv_hdr_[static_cast<size_t>(job.peer)] = 1;
  }
}

void NcclLink::exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                        std::vector<PeerTiming>* timings) {
  check();
  for (const auto& j : sends)
    if (j.peer < 0 || j.peer >= size_ || j.peer == rank_)
      throw std::invalid_argument("xirang: NcclLink: send to rank " + std::to_string(j.peer));
  for (const auto& j : recvs)
    if (j.peer < 0 || j.peer >= size_ || j.peer == rank_)
      throw std::invalid_argument("xirang: NcclLink: receive from rank " + std::to_string(j.peer));
  // A new operation: its headers are checked again with every peer.
  const FrameHeader* h = !sends.empty() ? &sends[0].header : (!recvs.empty() ? &recvs[0].expect : nullptr);
  if (h && (!have_op_ || h->op != cur_op_ || h->seq != cur_seq_)) {
    have_op_ = true;
    cur_op_ = h->op;
    cur_seq_ = h->seq;
    std::fill(sent_hdr_.begin(), sent_hdr_.end(), 0);
    std::fill(recv_hdr_.begin(), recv_hdr_.end(), 0);
  }
  headerRound(sends, recvs, deadline);

  size_t groups = 0;
  for (const auto& j : sends) groups = std::max(groups, j.segs.size());
  for (const auto& j : recvs) groups = std::max(groups, j.segs.size());
  for (size_t g = 0; g < groups; ++g) {
    check();
    grouped(deadline, [&] {
      for (const auto& j : sends)
        if (g < j.segs.size() && j.segs[g].bytes)
          callNccl(nccl_.send(j.segs[g].data, j.segs[g].bytes, j.peer, comm_, stream_), "ncclSend", deadline);
      for (const auto& j : recvs)
        if (g < j.segs.size() && j.segs[g].bytes)
          callNccl(nccl_.recv(j.segs[g].data, j.segs[g].bytes, j.peer, comm_, stream_), "ncclRecv", deadline);
    });
    for (auto& j : recvs)
      if (g < j.segs.size() && j.on_segment) j.on_segment(g);
  }
  for (const auto& j : sends) {
    const uint64_t b = totalBytes(j.segs);
    sent_ += b;
    if (timings) timings->push_back({j.peer, true, 0.0, b});
  }
  if (timings)
    for (const auto& j : recvs) timings->push_back({j.peer, false, 0.0, totalBytes(j.segs)});
}

void NcclLink::abort(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  if (stop_why_.empty()) stop_why_ = "aborted: " + why;
  abortLocked();
}

void NcclLink::abortLocked() {
  if (aborted_) return;
  dv::NcclApi* api = &nccl_;
  dv::NcclComm c = comm_;
  (void)boundedTeardown([api, c] { return api->commAbort(c); }, "ncclCommAbort", rank_);
  aborted_ = true;
}

void NcclLink::interrupt(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  if (stop_why_.empty()) stop_why_ = why.empty() ? "interrupted" : why;
}

}  // namespace xirang::transport
