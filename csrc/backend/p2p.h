// Point-to-point operations (send, recv, recv from any source). They do not go through the op
// queue: they are posted straight to the transport's point-to-point engine
// (core/transport/p2p.h), which moves them on connections of their own, all at once and
// independently of the order they were issued in (gloo's semantics): a receive posted before a
// send to the same peer, rings of isend/irecv and batch_isend_irecv of any size complete. Their
// Work completes on the engine's thread.
#pragma once

#include <exception>
#include <string>

#include "backend/config.h"
#include "backend/device_engine.h"
#include "backend/elastic.h"
#include "backend/op_queue.h"
#include "backend/records.h"
#include "backend/work.h"

namespace xirang {

class PointToPoint {
 public:
  PointToPoint(int rank, const XirangConfig& cfg, OpQueue& queue, Membership& membership, Records& records,
               DeviceEngines& engines)
      : rank_(rank), cfg_(cfg), queue_(queue), membership_(membership), records_(records), engines_(engines) {}

  // Posts a send of `t` (is_send) or a receive into it from `peer` (-1: any source); the caller
  // checked the arguments. title: "xirang:send", ... (profiler range, op name).
  c10::intrusive_ptr<WorkXirang> post(bool is_send, int peer, int tag, const at::Tensor& t, c10d::OpType type,
                                      const char* title);

 private:
  // A point-to-point operation failed: in elastic mode, because the membership changed (the old
  // epoch's transport closed under it), it raises MembershipChanged and the group goes on;
  // otherwise the first error poisons the group as a collective's would (fail-fast).
  std::exception_ptr failed(const std::string& desc, std::exception_ptr err, uint64_t epoch);

  const int rank_;
  const XirangConfig& cfg_;
  OpQueue& queue_;
  Membership& membership_;
  Records& records_;
  DeviceEngines& engines_;
};

}  // namespace xirang
