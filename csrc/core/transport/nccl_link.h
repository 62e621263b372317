// A transport::Link over NCCL point-to-point calls between GPUs (device/api.h's NcclApi and
// CudaApi: the real libraries in a CUDA build, the loopback fake in the Catch2 tests). The core's
// algorithms run over it unchanged, with a device reducer (algorithms/device_reducer.h) on the
// same stream.
//
// Stream semantics. Segments are device memory (memory() == Device). Every NCCL call, copy and
// kernel of the link is enqueued on one stream (stream(), not owned); exchange() returns once its
// jobs are *enqueued*, in stream order: work enqueued on the stream afterwards sees the received
// bytes, and may overwrite the sent ones. Completion is observed with synchronize() (or an event
// the caller records on the stream). on_segment(i) runs on the calling thread right after
// segment i's receive is enqueued, so the work it enqueues on the stream runs after the data
// landed and before segment i+1 is received: segments may share one buffer (RecvJob's contract).
//
// Schedule. One exchange is a sequence of NCCL groups; group g holds segment g of every job (a
// send per send job, a receive per receive job: ncclUint8, one call per segment), then
// on_segment(g) of the receive jobs. Both sides cut a message into the same segments, so the
// k-th send from src to dst always meets the k-th receive at dst in the same group index on both
// ranks: no schedule can deadlock NCCL's rule that matched calls progress together. Empty
// segments make no call.
//
// Agreement check. NCCL frames carry no headers, and calls of different sizes would hang or
// corrupt memory, so before the first data of an operation ((op, seq) of the headers) with a
// peer in a direction, the link exchanges a 64-byte record with that peer: the 48-byte frame
// header (transport/frame.h; payload_bytes = the job's total bytes) plus the job's segment count
// and first segment size. The records travel in one NCCL group, are copied to pinned host
// memory and compared on the host (compareHeader) before any data call is made: a rank that
// disagrees about op, dtype, reduce op, element count, order (seq), root or sizes gets a
// MismatchError naming the field, the peer and both values, as on TCP. Cost per operation: one
// extra round trip (a group of 64-byte calls), 64 bytes per peer and direction, and one host
// wait for the link's stream (the op's inputs must be ready by then); later exchanges of the same
// operation add nothing. What it does not see: per-step sizes after the first, which are
// functions of the agreed fields and the group's configuration (segment size, algorithm, ring),
// so the engine must agree on that configuration at group creation.
//
// Failures. Every wait (header round, synchronize, a non-blocking NCCL enqueue) polls the
// stream's event and ncclCommGetAsyncError until the deadline; an NCCL error or the deadline
// aborts the communicator (ncclCommAbort, as every teardown here through boundedTeardown: it
// holds the caller at most teardownLimit()) and throws TransportError / TimeoutError; afterwards
// the link is unusable. interrupt() (any thread) makes a running or later wait fail at once;
// abort() (any thread) aborts the communicator. Per-peer timings report bytes, with seconds = 0
// (a device link sees no transfer times without timing events).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "core/device/api.h"
#include "core/store.h"
#include "core/transport/transport.h"

namespace xirang::transport {

// StopCheck: transport/errors.h.

// Rank 0 creates the communicator's unique id and sets it under `key`; the other ranks read it,
// polling the store until `deadline` (TimeoutError) or a non-empty `stop()` (TransportError
// carrying it). `key` must name the group and the ring epoch (never a per-process counter: a
// counter that diverges across restarts reads a stale id, pytorch#135712). When rank 0's
// ncclGetUniqueId fails it sets "error: <why>" there instead, and the others fail with it at once.
device::NcclUniqueId shareNcclUniqueId(device::NcclApi& nccl, Store& store, const std::string& key, int rank,
                                       Deadline deadline, const StopCheck& stop = {});

// This rank's communicator of `size` ranks: ncclCommInitRankConfig non-blocking, polled until
// every rank has joined. An error, `deadline` (a rank that never joins) or a non-empty `stop()`
// aborts the half-made communicator and throws TransportError / TimeoutError naming `name`.
device::NcclComm initNcclComm(device::NcclApi& nccl, const device::NcclUniqueId& id, int rank, int size,
                              Deadline deadline, const std::string& name = "", const StopCheck& stop = {});

// Runs `call` (an ncclCommAbort or ncclCommDestroy) on a thread of its own and waits at most
// teardownLimit() for it. Both can block for good: a proxy thread stuck in poll(), a same-host
// peer that is gone (NVIDIA/nccl#863, #992, #1777); torch's NCCL backend bounds its abort the
// same way. Returns the call's result, or device::kNcclInProgress when it had not returned by
// then: the thread is left to finish on its own (it and the communicator are leaked, and the
// NcclApi must outlive it: the process's library, or a test's fake kept alive), and a WARNING
// names `what` and `rank`. Never throws.
int boundedTeardown(std::function<int()> call, const std::string& what, int rank);
// The bound: 10 s unless set (the Catch2 tests shorten it). Any thread.
std::chrono::milliseconds teardownLimit();
void setTeardownLimit(std::chrono::milliseconds limit);

// XIRANG_CUDA_TRANSPORT=auto's choice between the NCCL engine and the host-staged ones, made once
// per group at its first CUDA collective (#12: NCCL when it loaded and every rank has a GPU of its
// own; NCCL refuses two ranks on one GPU). What one rank says of itself:
struct NcclCandidate {
  bool automatic = true;    // its setting is auto (host / mirror: never NCCL, and it does not wait)
  std::string unavailable;  // empty: this rank loaded NCCL; else why not (shown in the reason)
  std::string gpu;          // its op's GPU, as a text that names one GPU across processes (the UUID)
  std::string where;        // the same GPU as NCCL tells GPUs apart: "<host>/<PCI bus id>" ("": unknown)
  std::string version;      // the NCCL version it loaded ("2.27.3")
};
struct NcclChoice {
  bool nccl = false;
  std::string why;  // one line: why NCCL, or the first reason (in rank order) why not
};

// The choice from every rank's candidate (index = rank): NCCL iff every rank is automatic, loaded
// NCCL of rank 0's version (NCCL refuses mixed versions at init) and names a GPU (non-empty) that
// no other rank names, by UUID or by host and PCI bus id (NCCL's own duplicate test: MIG instances
// of one GPU have UUIDs of their own and one bus id). Pure: equal inputs, equal outputs.
NcclChoice chooseNccl(const std::vector<NcclCandidate>& ranks);

// What a rank whose setting is host or mirror says (agreeOnNccl's record with automatic=false),
// once at group creation: its auto peers then choose host without waiting for it.
NcclChoice declareNotAuto(Store& store, const std::string& key, int rank);

// The store round of that choice. Every rank sets its candidate under `key`/<rank>. An automatic
// rank then reads every rank's (in rank order, waiting until `deadline`) and returns
// chooseNccl() of them, the same on every automatic rank; a non-automatic rank returns
// {false, its setting} at once (the automatic ones see it and choose host too). A record is at
// most 4 KiB and parsed defensively: one that does not parse counts as that rank's reason not to
// use NCCL. While it waits for rank r's record it polls the store (about every 50 ms) and
// `gone(r)` (may be empty), whose non-empty answer ends the wait with a TransportError (peer r)
// carrying it: a peer that died before its first CUDA collective fails the others within a poll,
// not at the timeout. TimeoutError (peer -1) naming the first rank whose record did not come by
// `deadline` (a rank that never runs a CUDA collective on this group: set
// XIRANG_CUDA_TRANSPORT=host there).
NcclChoice agreeOnNccl(Store& store, const std::string& key, int rank, int size, const NcclCandidate& mine,
                       Deadline deadline, const std::function<std::string(int)>& gone = {});

// XIRANG_CUDA_TRANSPORT=auto once agreeOnNccl chose NCCL: make this rank's communicator
// (shareNcclUniqueId under `key` + "/uid", initNcclComm named `name`) and agree with every rank
// on the outcome, so that all ranks fall back to the host-staged engines together when one cannot
// make it: NCCL's bootstrap cannot reach a peer, a wrong socket interface or IB set-up, device
// memory exhausted; what auto cannot see before trying. Each rank sets its outcome under `key` +
// "/made/<rank>" ("ok", or "failed: <why>"); a rank whose own attempt fails also sets `key` +
// "/failed", the one key the others' waits (for the unique id, for the init) poll: they end at
// the first failure. Returns {comm, ""} when every rank made one, else {nullptr, why} with `why` the first
// failure in rank order ("rank r could not make its NCCL communicator: ..."), the same text on
// every rank, this rank's communicator aborted (boundedTeardown). `prepare` (optional) runs once
// this rank's communicator is made, before its outcome is set: what else the rank needs to use it
// (the link's buffers); its exception is this rank's failure (the communicator aborted), and
// once it returned the communicator is the caller's, to tear down on a fallback too (the
// function then returns {nullptr, why} and aborts nothing). A failure of the group is no
// fallback and is thrown: a non-empty `stop()` (a peer gone, the group aborted:
// TransportError carrying it) or a rank whose outcome is not set by `deadline` + the time the
// attempt took at most again (capped at 60 s) + teardownLimit() + 5 s (TimeoutError naming it);
// `deadline` itself bounds each rank's attempt (a timed-out init is a failure to make the
// communicator). The keys under `key` serve one attempt: a caller that tries again must use
// another `key`.
struct NcclStart {
  device::NcclComm comm = nullptr;
  std::string why;  // empty: comm is this rank's communicator; else why every rank falls back
};
NcclStart startNcclAgreed(device::NcclApi& nccl, Store& store, const std::string& key, int rank, int size,
                          Deadline deadline, const std::string& name, const StopCheck& stop = {},
                          const std::function<void(device::NcclComm)>& prepare = {});

class NcclLink : public Link {
 public:
  // Owns `comm` (rank `rank` of `size`); orders everything on `stream` (not owned). Allocates
  // its header buffers (device and pinned host memory) here.
  NcclLink(device::NcclApi& nccl, device::CudaApi& cuda, device::NcclComm comm, int rank, int size,
           device::Stream stream);
  // Destroys the communicator when the stream is idle, else aborts it; after leakAtExit(), neither
  // (no NCCL or CUDA call at all).
  ~NcclLink() override;
  // Any thread, once the process is exiting (the backend's exit handler): links destroyed from now
  // on leave their communicator and buffers to the process's end, as torch's NCCL backend does at
  // teardown: ncclCommDestroy / ncclCommAbort may wait for same-host peers that are gone, and the
  // CUDA driver may already be shutting down.
  static void leakAtExit();
  NcclLink(const NcclLink&) = delete;
  NcclLink& operator=(const NcclLink&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Memory memory() const override { return Memory::Device; }
  device::Stream stream() const { return stream_; }

  void exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                std::vector<PeerTiming>* timings = nullptr) override;
  void abort(const std::string& why) override;
  void interrupt(const std::string& why) override;
  uint64_t payloadBytesSent() const override { return sent_.load(); }

  // The link's stream waits (on the device, no host wait) for the work enqueued on `producer` so
  // far: call it in the caller's thread at enqueue, with the caller's current stream.
  void waitStream(device::Stream producer);
  // Blocks until everything enqueued on the link's stream so far has completed (see Failures).
  void synchronize(Deadline deadline);
  // Optional, set before the first exchange: every wait (see Failures) also calls `check` on
  // the waiting thread, at most once per `every`; a non-empty result ends the wait as a peer's
  // failure (TransportError naming it; the communicator aborted). It is how a peer's abort
  // reaches a rank blocked in NCCL that exchanges nothing with it (the engine polls the store's
  // abort note): NCCL tells only the ranks a failed call connected.
  void setStopCheck(std::function<std::string()> check, std::chrono::milliseconds every);

 private:
  static constexpr size_t kRecordBytes = 64;
  void check();  // throws if interrupted / aborted / broken
  [[noreturn]] void fail(const std::string& what, bool timeout, int peer = -1);
  void abortLocked();  // under mu_: ncclCommAbort once
  void callNccl(int result, const char* call, Deadline deadline);
  void callCuda(int result, const char* call);
  void waitIdle(Deadline deadline, const std::string& what);
  // ncclGroupStart, calls(), ncclGroupEnd (also when calls() throws).
  void grouped(Deadline deadline, const std::function<void()>& calls);
  void headerRound(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline);

  device::NcclApi& nccl_;
  device::CudaApi& cuda_;
  device::NcclComm comm_;
  const int rank_, size_;
  device::Stream stream_;
  device::Event done_ = nullptr, ready_ = nullptr;
  uint8_t* hdr_dev_ = nullptr;   // [send records: size][receive records: size], kRecordBytes each
  uint8_t* hdr_host_ = nullptr;  // pinned, same layout

  // The operation whose headers were checked, and with whom.
  OpKind cur_op_ = OpKind::None;
  uint64_t cur_seq_ = ~0ull;
  bool have_op_ = false;
  std::vector<uint8_t> sent_hdr_, recv_hdr_;

  std::function<std::string()> stop_check_;
  std::chrono::milliseconds stop_every_{0};
  Clock::time_point next_stop_check_{};
  void pollStop();  // calls stop_check_ when due; fails on a message

  std::atomic<uint64_t> sent_{0};
  std::mutex mu_;          // guards the fields below and the abort call
  std::string stop_why_;   // interrupt / abort / a failure: every later call throws
  bool aborted_ = false;
  bool in_group_ = false;           // between grouped()'s ncclGroupStart and ncclGroupEnd
  bool abort_after_group_ = false;  // fail() inside the group: abort once it is closed
};

}  // namespace xirang::transport
