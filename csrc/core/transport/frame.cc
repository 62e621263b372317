#include "core/transport/frame.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "core/env.h"

namespace xirang::transport {

const char* opKindName(OpKind k) {
  switch (k) {
    case OpKind::None: return "none";
    case OpKind::Allreduce: return "allreduce";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::Allgather: return "allgather";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::Alltoall: return "alltoall";
    case OpKind::Reduce: return "reduce";
    case OpKind::Gather: return "gather";
    case OpKind::Scatter: return "scatter";
    case OpKind::Barrier: return "barrier";
    case OpKind::Send: return "send";
    case OpKind::AllreduceEF: return "allreduce_ef";  // any wire: the header's dtype is the wire's
    case OpKind::Ack: return "ack";
    case OpKind::Admit: return "admit_joiners";
  }
  return "unknown";
}

namespace {
template <typename T>
void put(uint8_t*& p, T v) {
  // The wire is little-endian; every supported host (x86-64, aarch64) is too.
  std::memcpy(p, &v, sizeof(T));
  p += sizeof(T);
}
template <typename T>
T take(const uint8_t*& p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  p += sizeof(T);
  return v;
}
}  // namespace

void encodeHeader(const FrameHeader& h, uint8_t* out) {
  uint8_t* p = out;
  put(p, h.magic);
  put(p, h.version);
  put(p, static_cast<uint8_t>(h.kind));
  put(p, static_cast<uint8_t>(h.op));
  put(p, static_cast<uint8_t>(h.dtype));
  put(p, static_cast<uint8_t>(h.reduce));
  put(p, h.reserved);
  put(p, h.tag);
  put(p, h.seq);
  put(p, h.op_numel);
  put(p, h.payload_bytes);
  put(p, h.aux);
  static_assert(4 + 2 + 1 + 1 + 1 + 1 + 2 + 4 + 8 + 8 + 8 + 8 == kHeaderBytes);
}

FrameHeader decodeHeader(const uint8_t* in) {
  const uint8_t* p = in;
  FrameHeader h;
  h.magic = take<uint32_t>(p);
  h.version = take<uint16_t>(p);
  h.kind = static_cast<FrameKind>(take<uint8_t>(p));
  h.op = static_cast<OpKind>(take<uint8_t>(p));
  h.dtype = static_cast<DType>(take<uint8_t>(p));
  h.reduce = static_cast<ReduceOp>(take<uint8_t>(p));
  h.reserved = take<uint16_t>(p);
  h.tag = take<uint32_t>(p);
  h.seq = take<uint64_t>(p);
  h.op_numel = take<uint64_t>(p);
  h.payload_bytes = take<uint64_t>(p);
  h.aux = take<uint64_t>(p);
  return h;
}

std::string compareHeader(const FrameHeader& e, const FrameHeader& g, int peer) {
  const std::string who = "rank " + std::to_string(peer);
  if (g.magic != kMagic) return "bad frame magic from " + who + " (not a xirang peer or a corrupted stream)";
  if (g.version != e.version)
    return "wire version mismatch: this rank " + std::to_string(e.version) + ", " + who + " " +
           std::to_string(g.version);
  std::string out;
  auto add = [&](const std::string& s) {
    if (!out.empty()) out += "; ";
    out += s;
  };
  if (g.seq != e.seq)
    add("collective order mismatch: this rank is at op #" + std::to_string(e.seq) + ", " + who +
        " at op #" + std::to_string(g.seq));
  if (g.op == e.op && e.op == OpKind::Send && g.tag != e.tag)
    add("tag mismatch: this rank expects tag " + std::to_string(e.tag) + ", " + who + " sent tag " +
        std::to_string(g.tag));
  if (g.op != e.op)
    add(std::string("op mismatch: this rank ") + opKindName(e.op) + ", " + who + " " + opKindName(g.op));
  if (g.dtype != e.dtype && g.op == e.op && e.op == OpKind::AllreduceEF)
    add(std::string("wire mismatch: this rank ") + dtypeName(e.dtype) + ", " + who + " " + dtypeName(g.dtype) +
        " (every rank must pass the same wire)");
  else if (g.dtype != e.dtype)
    add(std::string("dtype mismatch: this rank ") + dtypeName(e.dtype) + ", " + who + " " + dtypeName(g.dtype));
  if (g.reduce != e.reduce)
    add(std::string("reduce op mismatch: this rank ") + reduceOpName(e.reduce) + ", " + who + " " +
        reduceOpName(g.reduce));
  if (g.op_numel != e.op_numel)
    add("element count mismatch: this rank " + std::to_string(e.op_numel) + ", " + who + " " +
        std::to_string(g.op_numel));
  if (out.empty() && g.aux != e.aux) {
    // One-directional collectives' agreement frame carries 1 << 40 | root (collectives.cc).
    constexpr uint64_t kCheck = 1ULL << 40;
    if ((g.aux & kCheck) && (e.aux & kCheck))
      add("root mismatch: this rank root " + std::to_string(e.aux & (kCheck - 1)) + ", " + who + " root " +
          std::to_string(g.aux & (kCheck - 1)));
    else
      add("argument mismatch (chunk): this rank " + std::to_string(e.aux) + ", " + who + " " + std::to_string(g.aux));
  }
  if (out.empty() && g.payload_bytes != e.payload_bytes)
    add("frame length mismatch: expected " + std::to_string(e.payload_bytes) + " bytes, " + who +
        " sent " + std::to_string(g.payload_bytes));
  return out;
}

std::pair<int64_t, int> dieAfterSegmentsKnob() {
  const std::string v = env::get("XIRANG_TEST_DIE_AFTER_SEGMENTS");
  const size_t at = v.find('@');
  const std::string k = v.substr(0, at), r = at == std::string::npos ? std::string() : v.substr(at + 1);
  auto digits = [](const std::string& s) {
    return !s.empty() && s.size() <= 9 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (!digits(k) || (at != std::string::npos && !digits(r)))
    throw std::invalid_argument("xirang: XIRANG_TEST_DIE_AFTER_SEGMENTS='" + v.substr(0, 64) +
                                "' must be k or k@r (k data frames, group rank r: integers >= 0)");
  return {std::stoll(k), r.empty() ? -1 : std::stoi(r)};
}

void dieAfterSegmentsHook(int rank, uint64_t payload) {
  static const std::pair<int64_t, int> knob = [] {
    try {
      return dieAfterSegmentsKnob();
    } catch (const std::exception&) {  // group creation refused it; a transport made without one
      return std::make_pair(int64_t{0}, -1);
    }
  }();
  static std::atomic<int64_t> sent{0};
  if (knob.first <= 0 || payload == 0 || (knob.second >= 0 && knob.second != rank)) return;
  if (++sent >= knob.first) ::kill(::getpid(), SIGKILL);
}

}  // namespace xirang::transport
