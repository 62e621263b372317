#include "backend/p2p.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <sstream>

#include "backend/tensors.h"
#include "core/env.h"

namespace xirang {

namespace {
transport::FrameHeader p2pHeader(const at::Tensor& t, int tag) {
  transport::FrameHeader h;
  h.kind = transport::FrameKind::Data;
  h.op = transport::OpKind::Send;
  h.dtype = toDType(t.scalar_type());
  h.tag = static_cast<uint32_t>(tag);
  h.op_numel = static_cast<uint64_t>(t.numel());
  return h;
}
}  // namespace

c10::intrusive_ptr<WorkXirang> PointToPoint::post(bool is_send, int peer, int tag, const at::Tensor& t,
                                                  c10d::OpType type, const char* title) {
  queue_.checkPoisoned();
  const std::string opname = std::string(title).substr(std::strlen("xirang:"));
  auto stage = engines_.stageFor({t}, /*device_link=*/false);  // point to point: TCP (host-staged for CUDA)
  at::Tensor buf = stage->bind(t, /*copy_in=*/is_send, /*copy_out=*/!is_send);
  auto work = c10::make_intrusive<WorkXirang>(rank_, type, title, std::vector<at::Tensor>{t},
                                              std::optional<std::vector<at::Tensor>>(std::vector<at::Tensor>{t}), stage);
  std::ostringstream d;
  d << rankPrefix(rank_) << opname << " (" << dtypeName(toDType(t.scalar_type())) << ", " << t.numel()
    << " elements, tag " << tag << (is_send ? ", to rank " : ", from ")
    << (peer < 0 ? std::string("any rank") : (is_send ? "" : "rank ") + std::to_string(peer)) << ", group '"
    << cfg_.group_name << "')";
  work->desc_ = d.str();
  if (stage->copies()) {
    stage->queued();
    if (is_send) stage->copyIn(Clock::now() + cfg_.timeout);  // the send reads the host mirror: the finished values
  } else {
    buf = is_send ? t.contiguous() : (t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous));
  }
  const uint64_t bytes = nbytes(buf);
  const auto t0 = Clock::now();
  OpRecord rec;
  if (records_.on()) {
    rec.op = opname;
    rec.algorithm = "p2p";
    rec.engine = stage->engine();
    rec.dtype = dtypeName(toDType(t.scalar_type()));
    rec.numel = static_cast<uint64_t>(t.numel());
    rec.t_enqueue = records_.since(t0);
    rec.wait = std::make_shared<WaitClock>();
    work->wait_clock_ = rec.wait;
  }
  const uint64_t epoch = membership_.epoch();
  auto done = [this, work, buf, user = t, stage, is_send, bytes, t0, epoch, rec = std::move(rec)](
                  std::exception_ptr err, int src) mutable {
    if (!err && !is_send) {
      try {
        if (stage->copies()) stage->copyOut();
        else if (!buf.is_same(user)) user.copy_(buf);
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (!err) work->source_rank_ = src;
    if (err) err = failed(work->desc_, err, epoch);
    if (records_.on()) {
      const auto end = Clock::now();
      rec.total_s = std::chrono::duration<double>(end - t0).count();
      rec.ok = err == nullptr;
      if (is_send) rec.bytes_raw = rec.bytes_wire = rec.bytes_tcp = err ? 0 : bytes;  // p2p: always TCP
      if (!err)
        rec.peers.push_back({src, is_send ? rec.total_s : 0.0, is_send ? 0.0 : rec.total_s, is_send ? bytes : 0,
                             is_send ? 0 : bytes});
      if (!err && is_send) records_.addCrossBytes(rec, src, bytes);
      records_.keep(std::move(rec), end, 0);
    }
    work->complete(err);
  };
  transport::P2P* engine = nullptr;
  try {
    engine = &membership_.p2p(work->desc_);
  } catch (...) {
    done(std::current_exception(), peer);
  }
  if (engine) {
    // The engine may call `done` on this thread (when it has already failed).
    const auto deadline = t0 + cfg_.timeout;
    auto h = p2pHeader(buf, tag);
    if (is_send) engine->send(peer, h, buf.data_ptr(), bytes, deadline, std::move(done));
    else engine->recv(peer, h, buf.data_ptr(), bytes, deadline, std::move(done));
  }
  return work;
}

std::exception_ptr PointToPoint::failed(const std::string& desc, std::exception_ptr err, uint64_t epoch) {
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
  if (membership_.changedSince(epoch))
    return std::make_exception_ptr(
        MembershipChanged(desc + " was interrupted by a membership change (" + what + "); its result is void"));
  std::string msg = desc + " failed: " + what;
  if (queue_.poison(msg)) {
    env::log(env::Level::Warn, rank_, msg);
    membership_.abort(msg);  // tell the peers (abort frames, the store's abort note), as a failed collective does
  }
  return std::make_exception_ptr(std::runtime_error(msg));
}

}  // namespace xirang
