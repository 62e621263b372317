// The core's collectives in one fixed sequence over any engine (a Comm, memory of the link's kind,
// a wait for results), recording every result's bytes: tests/cpp/test_device.cc runs it over the
// loopback fake and the in-process host engine and compares; tests/gpu/device_checks.cc runs it
// over a one-rank real NCCL communicator with the GPU kernels. Header-only, no Catch.
#pragma once

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "core/codec.h"
#include "core/collectives.h"
#include "core/planner.h"
#include "core/reduce.h"
#include "support.h"

namespace xirang_test {

namespace cases {

namespace tp = xirang::transport;
using xirang::Comm;
using xirang::DType;
using xirang::OpCtx;
using xirang::ReduceOp;

inline OpCtx ctxFor(tp::OpKind op, DType dt, ReduceOp red, uint64_t numel, uint64_t seq, int ms = 20000) {
  OpCtx c;
  c.op = op;
  c.dtype = dt;
  c.reduce = red;
  c.numel = numel;
  c.seq = seq;
  c.deadline = after(milliseconds(ms));
  return c;
}

// What a case needs of the engine it runs on: memory of the link's kind, and a wait for the
// results (a no-op on the host).
struct Env {
  Comm comm;
  int rank = 0, n = 1;
  uint64_t seq = 0;
  std::function<uint8_t*(size_t)> alloc;
  std::function<void()> finish;
  std::vector<std::vector<uint8_t>>* out = nullptr;  // this rank's recorded results
  void record(const void* p, size_t bytes) {
    const auto* b = static_cast<const uint8_t*>(p);
    out->emplace_back(b, b + bytes);
  }
  template <class T>
  T* buf(int64_t count) {
    return reinterpret_cast<T*>(alloc(static_cast<size_t>(count) * sizeof(T) + 16));
  }
};

// Deterministic input bytes of (rank, case, element) for a dtype: values for which every op of
// the dtype is defined and interesting; finite floats (NaNs are checked elsewhere).
inline void fillInput(void* p, int64_t count, DType t, ReduceOp op, int rank, uint64_t salt) {
  auto* b = static_cast<uint8_t*>(p);
  const size_t es = xirang::elementSize(t);
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t h = mix(static_cast<uint64_t>(rank), static_cast<uint64_t>(i), salt, static_cast<uint64_t>(t) * 16 + static_cast<uint64_t>(op));
    const double u = unit(h);
    const double v = op == ReduceOp::Product ? ((h >> 60) & 1 ? -1.0 : 1.0) * (0.5 + u) : (u - 0.5) * 64.0;
    uint8_t* e = b + i * es;
    switch (t) {
      case DType::Float32: { const float f = static_cast<float>(v); std::memcpy(e, &f, 4); break; }
      case DType::Float64: std::memcpy(e, &v, 8); break;
      case DType::Float16: { const uint16_t x = xirang::floatToHalf(static_cast<float>(v)); std::memcpy(e, &x, 2); break; }
      case DType::BFloat16: { const uint16_t x = xirang::codec::f32ToBf16(static_cast<float>(v)); std::memcpy(e, &x, 2); break; }
      case DType::Complex64: {
        const float f[2] = {static_cast<float>(v), static_cast<float>(unit(h ^ 0x55) - 0.5)};
        std::memcpy(e, f, 8);
        break;
      }
      case DType::Complex128: {
        const double d[2] = {v, unit(h ^ 0x55) - 0.5};
        std::memcpy(e, d, 16);
        break;
      }
      case DType::Bool: e[0] = static_cast<uint8_t>((h >> 20) % 3 != 0); break;
      default:
        if (op == ReduceOp::Product) {
          static const int8_t f[6] = {-3, -2, -1, 1, 2, 3};
          std::memset(e, 0, es);
          const int64_t x = f[h % 6];
          std::memcpy(e, &x, es);  // little-endian: the low bytes of x
          if (x < 0) std::memset(e + 1, 0xFF, es - 1);
        } else {
          std::memcpy(e, &h, es);
        }
    }
  }
}

inline const DType kAllDtypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16,
                            DType::Int8,    DType::Int16,   DType::Int32,   DType::Int64,
                            DType::UInt8,   DType::Bool,    DType::Complex64, DType::Complex128};
inline const ReduceOp kAllOps[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max,
                            ReduceOp::PremulSum, ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor};

inline bool is16(DType t) { return t == DType::Float16 || t == DType::BFloat16; }

// Every collective the core has, in one fixed sequence; each records its results.
inline void allCollectives(Env& e) {
  const int n = e.n, r = e.rank;
  // Allreduce: every dtype x op the planner takes, through the direct exchange, the segmented
  // ring (small_bytes / segment_bytes lowered) and, for 16-bit floats, the widened ring too.
  for (DType t : kAllDtypes) {
    for (ReduceOp op : kAllOps) {
      if (!xirang::checkReduceOp(is16(t) ? DType::Float32 : t, op).empty()) continue;
      for (int64_t count : {int64_t{0}, int64_t{5}, int64_t{301}}) {
        for (int variant = 0; variant < (is16(t) ? 2 : 1); ++variant) {
          if (count == 0 && variant) continue;
          Comm c = e.comm;
          c.small_bytes = 64;
          c.segment_bytes = 200;
          if (variant) c.algo = Comm::Algo::Ring;
          const size_t bytes = static_cast<size_t>(count) * xirang::elementSize(t);
          uint8_t* d = e.alloc(bytes + 16);
          fillInput(d, count, t, op, r, e.seq);
          e.finish();  // (host memory written directly: nothing of the link's is pending)
          xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, t, op, static_cast<uint64_t>(count), ++e.seq), d, count,
                              t, op, 0.37);
          e.finish();
          e.record(d, bytes);
        }
      }
    }
  }
  // The error-feedback allreduce, BF16 ring (per-hop EF) and direct (EF at the sender) in BF16,
  // FP16 and INT8 (3003 elements: chunks of several 1024-element scale segments at small WS),
  // three steps with the residual carried (aliased for the ring, ping-pong for the direct form).
  const xirang::codec::Wire direct_wire[] = {xirang::codec::Wire::BF16, xirang::codec::Wire::BF16,
                                             xirang::codec::Wire::FP16, xirang::codec::Wire::INT8};
  for (int form = 0; form < 4; ++form) {
    const int64_t count = form < 2 ? 1003 : 3003;
    float* x = e.buf<float>(count);
    float* ra = e.buf<float>(count);
    float* rb = e.buf<float>(count);
    std::memset(ra, 0, count * 4);
    Comm c = e.comm;
    c.segment_bytes = 256;
    for (int step = 0; step < 3; ++step) {
      for (int64_t i = 0; i < count; ++i)
        x[i] = static_cast<float>((unit(mix(r, step, i, 91)) - 0.5) * std::ldexp(1.0, static_cast<int>(i % 9) - 4));
      e.finish();
      const auto ctx = ctxFor(tp::OpKind::AllreduceEF, DType::Float32, ReduceOp::Avg, count, ++e.seq);
      if (form == 0) {
        xirang::allreduceBF16EF(c, ctx, x, ra, ra, count);
      } else {
        xirang::allreduceEFDirect(c, ctx, x, ra, rb, count, direct_wire[form]);
        std::swap(ra, rb);
      }
      e.finish();
      e.record(x, count * 4);
      e.record(ra, count * 4);
    }
  }
  // Broadcast from every root (and an empty one).
  for (int root = 0; root < n; ++root) {
    for (uint64_t bytes : {uint64_t{0}, uint64_t{1000}}) {
      uint8_t* d = e.alloc(bytes + 1);
      for (uint64_t k = 0; k < bytes; ++k) d[k] = static_cast<uint8_t>(mix(r, root, k, 5));
      Comm c = e.comm;
      c.segment_bytes = 300;
      e.finish();
      xirang::broadcast(c, ctxFor(tp::OpKind::Broadcast, DType::Bytes, ReduceOp::None, bytes, ++e.seq), d, bytes, root);
      e.finish();
      e.record(d, bytes);
    }
  }
  // Uneven blocks: rank q's block is 37*q + 3 bytes (allgather) / floats (reduce-scatter).
  auto blockBytes = [](int q, size_t es) { return static_cast<uint64_t>(37 * q + 3) * es; };
  {
    uint64_t total = 0;
    for (int q = 0; q < n; ++q) total += blockBytes(q, 1);
    uint8_t* d = e.alloc(total);
    std::vector<tp::RecvSeg> blocks;
    uint64_t off = 0;
    for (int q = 0; q < n; ++q) {
      blocks.push_back(tp::RecvSeg{d + off, blockBytes(q, 1)});
      for (uint64_t k = 0; k < blockBytes(q, 1); ++k) d[off + k] = q == r ? static_cast<uint8_t>(mix(q, k, 6)) : 0;
      off += blockBytes(q, 1);
    }
    Comm c = e.comm;
    c.segment_bytes = 50;
    e.finish();
    xirang::allgather(c, ctxFor(tp::OpKind::Allgather, DType::Bytes, ReduceOp::None, total, ++e.seq), blocks);
    e.finish();
    e.record(d, total);
  }
  for (DType t : {DType::Float32, DType::Int32}) {
    const ReduceOp op = t == DType::Float32 ? ReduceOp::Sum : ReduceOp::Max;
    const size_t es = xirang::elementSize(t);
    uint64_t total = 0;
    for (int q = 0; q < n; ++q) total += blockBytes(q, es);
    uint8_t* d = e.alloc(total);
    fillInput(d, static_cast<int64_t>(total / es), t, op, r, e.seq);
    std::vector<tp::RecvSeg> blocks;
    uint64_t off = 0;
    for (int q = 0; q < n; ++q) {
      blocks.push_back(tp::RecvSeg{d + off, blockBytes(q, es)});
      off += blockBytes(q, es);
    }
    Comm c = e.comm;
    c.segment_bytes = 64;
    e.finish();
    xirang::reduceScatter(c, ctxFor(tp::OpKind::ReduceScatter, t, op, total / es, ++e.seq), blocks, t, op);
    e.finish();
    e.record(blocks[r].data, blocks[r].bytes);
  }
  // Alltoall: rank a sends (a + 2b) % 7 * 11 bytes to rank b.
  {
    auto pair = [](int a, int b) { return static_cast<uint64_t>((a + 2 * b) % 7 * 11); };
    std::vector<tp::SendSeg> sends;
    std::vector<tp::RecvSeg> recvs;
    for (int q = 0; q < n; ++q) {
      uint8_t* s = e.alloc(pair(r, q) + 1);
      for (uint64_t k = 0; k < pair(r, q); ++k) s[k] = static_cast<uint8_t>(mix(r, q, k, 8));
      sends.push_back(tp::SendSeg{s, pair(r, q)});
      recvs.push_back(tp::RecvSeg{e.alloc(pair(q, r) + 1), pair(q, r)});
    }
    Comm c = e.comm;
    c.segment_bytes = 16;
    e.finish();
    xirang::alltoall(c, ctxFor(tp::OpKind::Alltoall, DType::Bytes, ReduceOp::None, 0, ++e.seq), sends, recvs);
    e.finish();
    for (auto& rv : recvs) e.record(rv.data, rv.bytes);
  }
  // Gather and scatter to / from every root: 50 + rank bytes per rank.
  for (int root = 0; root < n; ++root) {
    std::vector<tp::RecvSeg> blocks;
    std::vector<tp::SendSeg> sblocks;
    for (int q = 0; q < n; ++q) {
      uint8_t* b = e.alloc(50 + q);
      for (int k = 0; k < 50 + q; ++k) b[k] = r == root ? static_cast<uint8_t>(mix(root, q, k, 9)) : 0;
      blocks.push_back(tp::RecvSeg{b, static_cast<uint64_t>(50 + q)});
      sblocks.push_back(tp::SendSeg{b, static_cast<uint64_t>(50 + q)});
    }
    uint8_t* mine = e.alloc(50 + r);
    for (int k = 0; k < 50 + r; ++k) mine[k] = static_cast<uint8_t>(mix(r, k, 10));
    Comm c = e.comm;
    c.segment_bytes = 20;
    e.finish();
    xirang::gather(c, ctxFor(tp::OpKind::Gather, DType::Bytes, ReduceOp::None, 0, ++e.seq),
                   tp::SendSeg{mine, static_cast<uint64_t>(50 + r)}, blocks, root);
    e.finish();
    if (r == root)
      for (auto& b : blocks) e.record(b.data, b.bytes);
    xirang::scatter(c, ctxFor(tp::OpKind::Scatter, DType::Bytes, ReduceOp::None, 0, ++e.seq), sblocks,
                    tp::RecvSeg{mine, static_cast<uint64_t>(50 + r)}, root);
    e.finish();
    e.record(mine, 50 + r);
  }
  // Barrier: elastic mode's completion round is the core's barrier on any link.
  xirang::ack(e.comm, ctxFor(tp::OpKind::Barrier, DType::Bytes, ReduceOp::None, 0, ++e.seq));
  e.finish();
}

}  // namespace cases

}  // namespace xirang_test
