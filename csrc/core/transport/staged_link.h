// A device transport::Link over a host Link (the group's TCP link): the algorithms' segments are
// device memory, and bytes cross to the host only as the algorithm sends them, in the wire format
// it sends (bf16 codes for the hook's error-feedback op, not fp32 mirrors of whole tensors), while
// every reduction, codec step and copy runs on the device (the algorithm's reducer:
// algorithms/device_reducer.h, on this link's stream). It is how GPUs without NCCL between them
// (ranks on different hosts; ranks sharing one GPU with XIRANG_TRANSPORT_LOCAL=tcp) run the same
// device code as the NCCL engine.
//
// One exchange:
//   1. every send segment is copied device-to-host into a pinned staging buffer on the stream,
//      then the host waits for the stream (under the deadline): the copies have run, so has what
//      the previous exchange's on_segment enqueued (this exchange's sends may be its results), and
//      the previous exchange's host-to-device copies are done with the receive staging buffer;
//   2. the host link's exchange runs between the pinned buffers (its frames, header checks and
//      errors: a rank that disagrees about the operation gets the same MismatchError as on TCP);
//   3. as the host link hands over received segment i, its host-to-device copy into the
//      algorithm's buffer is enqueued on the stream, then on_segment(i) runs: the work it enqueues
//      runs after the bytes landed and before segment i+1's copy, so segments may share one
//      device buffer (RecvJob's contract). Every receive segment has staging bytes of its own, so
//      the host link may receive segment i+1 while segment i's copy is pending.
// The stream semantics are then NcclLink's (transport.h: "done" means ordered on the stream, and
// completion is synchronize()).
//
// Memory: two pinned buffers, of the largest exchange's send and receive bytes, grown on demand
// (geometrically, after the stream is idle) and kept for the link's life. Failures: a CUDA call
// that fails throws TransportError naming it; the deadline while waiting for the stream,
// TimeoutError. interrupt() (any thread) ends a wait for the stream at once and fails every later
// call; it leaves the host link alone (its owner aborts it, abort frames first: a running host
// exchange ends then). abort() interrupts and aborts the host link. Per-peer timings and byte
// counts are the host link's.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "core/device/api.h"
#include "core/transport/transport.h"

namespace xirang::transport {

class StagedLink : public Link {
 public:
  // Orders its copies on `stream` (not owned) and exchanges over `host` (not owned, outlives it).
  StagedLink(device::CudaApi& cuda, device::Stream stream, Link& host);
  // Frees the pinned buffers once the stream is idle (waiting up to 10 s; left allocated else).
  ~StagedLink() override;
  StagedLink(const StagedLink&) = delete;
  StagedLink& operator=(const StagedLink&) = delete;

  const Link& host() const { return *host_; }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  Memory memory() const override { return Memory::Device; }
  device::Stream stream() const { return stream_; }

  void exchange(std::vector<SendJob>& sends, std::vector<RecvJob>& recvs, Deadline deadline,
                std::vector<PeerTiming>* timings = nullptr) override;
  void abort(const std::string& why) override;
  void interrupt(const std::string& why) override;
  uint64_t payloadBytesSent() const override { return sent_.load(); }

  // Blocks until everything enqueued on the stream so far has run (TimeoutError at `deadline`).
  void synchronize(Deadline deadline);

 private:
  struct Pinned {
    uint8_t* ptr = nullptr;
    uint64_t cap = 0;
  };
  void check();
  void callCuda(int result, const char* call);
  void waitIdle(Deadline deadline, const char* what);
  uint8_t* reserve(Pinned& p, uint64_t bytes, Deadline deadline);

  device::CudaApi& cuda_;
  device::Stream stream_;
  Link* const host_;
  device::Event idle_ = nullptr;
  Pinned send_, recv_;
  std::atomic<uint64_t> sent_{0};
  std::mutex mu_;
  std::string stop_why_;  // interrupted: every later call throws it
};

}  // namespace xirang::transport
