// The device data path over the loopback fake (core/device/fake.h): the core's algorithms over
// transport::NcclLink with an algo::DeviceReducer (kernels = the grid emulator running the real
// kernel bodies), checked bit for bit against the same algorithms over the in-process link with
// the host reducer (support.h: InprocGroup) on the same inputs, plus values from fp64 references
// and the failure cases (deadlocking order, abort mid-op, a rank that never joins, timeouts,
// disagreeing ranks) ending in errors within bounded time.
//
// The fake's "device" memory is host memory: the test fills and reads it directly while the
// rank's stream is idle (after NcclLink::synchronize). Rank threads never call Catch.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/algorithms/device_reducer.h"
#include "core/codec.h"
#include "core/collectives.h"
#include "core/device/fake.h"
#include "core/planner.h"
#include "core/reduce.h"
#include "core/transport/nccl_link.h"
#include "support.h"

namespace {

namespace dv = xirang::device;
namespace tp = xirang::transport;
using xirang::Comm;
using xirang::DType;
using xirang::OpCtx;
using xirang::ReduceOp;
using xirang_test::after;
using xirang_test::InprocGroup;
using xirang_test::MemStore;
using xirang_test::mix;
using xirang_test::runRanks;
using xirang_test::unit;
using std::chrono::milliseconds;

// n ranks, each with a stream, a communicator from the fake NCCL (unique id through a store,
// non-blocking init), an NcclLink and a DeviceReducer on that stream.
struct DeviceGroup {
  dv::FakeDevice dev;  // first member: destroyed last
  int n;
  std::vector<dv::Stream> streams;
  std::vector<std::unique_ptr<tp::NcclLink>> links;
  std::vector<std::unique_ptr<xirang::algo::DeviceReducer>> reducers;

  explicit DeviceGroup(int size) : n(size), streams(size), links(size), reducers(size) {
    MemStore store;
    runRanks(n, [&](int r) {
      if (dev.cuda().streamCreate(&streams[r]) != dv::kCudaSuccess) throw std::runtime_error("streamCreate");
      const auto id = tp::shareNcclUniqueId(dev.nccl(), store, "xirang/test/0/nccl_uid", r, after(milliseconds(10000)));
      dv::NcclComm c = tp::initNcclComm(dev.nccl(), id, r, n, after(milliseconds(10000)), "test");
      links[r] = std::make_unique<tp::NcclLink>(dev.nccl(), dev.cuda(), c, r, n, streams[r]);
      reducers[r] = std::make_unique<xirang::algo::DeviceReducer>(dev.cuda(), dev.kernels(), streams[r]);
    });
  }
  ~DeviceGroup() {
    links.clear();
    reducers.clear();
    for (auto s : streams) (void)dev.cuda().streamDestroy(s);
  }
  Comm comm(int r, std::vector<int> ring = {}) {
    Comm c = xirang_test::commOver(links[r].get(), r, n, std::move(ring));
    c.reducer = reducers[r].get();
    return c;
  }
  void run(const std::function<void(int)>& fn) {
    xirang_test::runAborting(n, [&](int r) -> tp::Link& { return *links[r]; }, fn);
  }
};

OpCtx ctxFor(tp::OpKind op, DType dt, ReduceOp red, uint64_t numel, uint64_t seq, int ms = 20000) {
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
void fillInput(void* p, int64_t count, DType t, ReduceOp op, int rank, uint64_t salt) {
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

const DType kAllDtypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16,
                            DType::Int8,    DType::Int16,   DType::Int32,   DType::Int64,
                            DType::UInt8,   DType::Bool,    DType::Complex64, DType::Complex128};
const ReduceOp kAllOps[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max,
                            ReduceOp::PremulSum, ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor};

bool is16(DType t) { return t == DType::Float16 || t == DType::BFloat16; }

// Every collective the core has, in one fixed sequence; each records its results.
void allCollectives(Env& e) {
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
  // The BF16 error-feedback allreduce, ring (per-hop EF) and direct (EF at the sender), three
  // steps with the residual carried (aliased for the ring, ping-pong for the direct form).
  for (int form = 0; form < 2; ++form) {
    const int64_t count = 1003;
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
        xirang::allreduceBF16EFDirect(c, ctx, x, ra, rb, count);
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

// Runs `body` on every rank of a host group and of a device group of n ranks; results[engine][rank].
using Results = std::vector<std::vector<std::vector<uint8_t>>>;
void runBoth(int n, const std::function<void(Env&)>& body, Results& host, Results& device) {
  host.assign(n, {});
  device.assign(n, {});
  {
    InprocGroup g(n);
    std::vector<std::vector<std::unique_ptr<uint8_t[]>>> mem(n);
    g.run([&](int r) {
      Env e;
      e.comm = g.comm(r);
      e.rank = r;
      e.n = n;
      e.out = &host[r];
      e.alloc = [&mem, r](size_t b) {
        mem[r].emplace_back(new uint8_t[b + 1]());
        return mem[r].back().get();
      };
      e.finish = [] {};
      body(e);
    });
  }
  DeviceGroup g(n);
  std::vector<std::vector<void*>> mem(n);
  g.run([&](int r) {
    Env e;
    e.comm = g.comm(r);
    e.rank = r;
    e.n = n;
    e.out = &device[r];
    e.alloc = [&g, &mem, r](size_t b) {
      void* p = nullptr;
      if (g.dev.cuda().malloc(&p, b + 1) != dv::kCudaSuccess) throw std::runtime_error("fake cudaMalloc");
      std::memset(p, 0, b + 1);
      mem[r].push_back(p);
      return static_cast<uint8_t*>(p);
    };
    e.finish = [&g, r] { g.links[r]->synchronize(after(milliseconds(20000))); };
    body(e);
    e.finish();
  });
  for (auto& v : mem)
    for (void* p : v) (void)g.dev.cuda().free(p);
}

void requireSame(const Results& host, const Results& device) {
  REQUIRE(host.size() == device.size());
  for (size_t r = 0; r < host.size(); ++r) {
    CAPTURE(r);
    REQUIRE(host[r].size() == device[r].size());
    size_t bad = 0, first = 0;
    for (size_t k = 0; k < host[r].size(); ++k)
      if (host[r][k] != device[r][k] && bad++ == 0) first = k;
    INFO(bad << " of " << host[r].size() << " results differ, the first is result #" << first);
    CHECK(bad == 0);
  }
}

}  // namespace

TEST_CASE("device: every collective over NcclLink + DeviceReducer gives the in-process engine's bits, WS 1-8",
          "[device]") {
  const int n = GENERATE(1, 2, 3, 4, 5, 6, 7, 8);
  CAPTURE(n);
  Results host, device;
  runBoth(n, allCollectives, host, device);
  REQUIRE(!host[0].empty());
  requireSame(host, device);
  // Replicated results agree across ranks (allreduce: the first recorded results).
  for (int r = 1; r < n; ++r) CHECK(host[r][10] == host[0][10]);
}

TEST_CASE("device: PREMUL_SUM of full((8,), rank+1) at WS=2 is 3*factor in every float dtype (pytorch#190745)",
          "[device]") {
  const DType dts[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
  const double factors[] = {0.5, 0.25, 1.0 / 3.0};
  Results host, device;
  runBoth(2, [&](Env& e) {
    for (DType t : dts) {
      for (double f : factors) {
        const size_t es = xirang::elementSize(t);
        uint8_t* d = e.alloc(8 * es);
        for (int i = 0; i < 8; ++i) {
          const double v = e.rank + 1;
          if (t == DType::Float32) { const float x = static_cast<float>(v); std::memcpy(d + 4 * i, &x, 4); }
          if (t == DType::Float64) std::memcpy(d + 8 * i, &v, 8);
          if (t == DType::Float16) { const uint16_t x = xirang::floatToHalf(static_cast<float>(v)); std::memcpy(d + 2 * i, &x, 2); }
          if (t == DType::BFloat16) { const uint16_t x = xirang::codec::f32ToBf16(static_cast<float>(v)); std::memcpy(d + 2 * i, &x, 2); }
        }
        xirang::allreduceOp(e.comm, ctxFor(tp::OpKind::Allreduce, t, ReduceOp::PremulSum, 8, ++e.seq), d, 8, t,
                            ReduceOp::PremulSum, f);
        e.finish();
        e.record(d, 8 * es);
      }
    }
  }, host, device);
  requireSame(host, device);
  for (int r = 0; r < 2; ++r) {
    size_t k = 0;
    for (DType t : dts) {
      for (double f : factors) {
        const auto& b = device[r][k++];
        for (int i = 0; i < 8; ++i) {
          double got = 0, ulp = 0;
          if (t == DType::Float32) { float x; std::memcpy(&x, &b[4 * i], 4); got = x; ulp = 0x1p-23; }
          if (t == DType::Float64) { std::memcpy(&got, &b[8 * i], 8); ulp = 0x1p-52; }
          if (t == DType::Float16) { uint16_t x; std::memcpy(&x, &b[2 * i], 2); got = xirang::halfToFloat(x); ulp = 0x1p-10; }
          if (t == DType::BFloat16) { uint16_t x; std::memcpy(&x, &b[2 * i], 2); got = xirang::codec::bf16ToF32(x); ulp = 0x1p-7; }
          CAPTURE(r, xirang::dtypeName(t), f, i, got);
          if (f != 1.0 / 3.0) CHECK(got == 3.0 * f);  // 1.5 and 0.75: exact in every dtype
          else CHECK(std::fabs(got - 1.0) <= 2 * ulp);
        }
      }
    }
  }
}

TEST_CASE("device: AVG at sizes 0..64 and 1024, WS 2 and 3, is SUM / WS, divided once (torch-xpu-ops#3020)",
          "[device]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  const DType dts[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
  std::vector<int64_t> sizes;
  for (int64_t s = 0; s <= 64; ++s) sizes.push_back(s);
  sizes.push_back(1024);
  auto value = [](int rank, int64_t i) { return static_cast<double>((i % 13) + 1) * (rank + 1); };
  Results host, device;
  runBoth(n, [&](Env& e) {
    for (DType t : dts) {
      for (int64_t count : sizes) {
        const size_t es = xirang::elementSize(t);
        uint8_t* d = e.alloc(count * es + 1);
        for (int64_t i = 0; i < count; ++i) {
          const double v = value(e.rank, i);
          if (t == DType::Float32) { const float x = static_cast<float>(v); std::memcpy(d + 4 * i, &x, 4); }
          if (t == DType::Float64) std::memcpy(d + 8 * i, &v, 8);
          if (t == DType::Float16) { const uint16_t x = xirang::floatToHalf(static_cast<float>(v)); std::memcpy(d + 2 * i, &x, 2); }
          if (t == DType::BFloat16) { const uint16_t x = xirang::codec::f32ToBf16(static_cast<float>(v)); std::memcpy(d + 2 * i, &x, 2); }
        }
        Comm c = e.comm;
        c.small_bytes = 256;  // the larger sizes take the ring
        xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, t, ReduceOp::Avg, count, ++e.seq), d, count, t,
                            ReduceOp::Avg);
        e.finish();
        e.record(d, count * es);
      }
    }
  }, host, device);
  requireSame(host, device);
  const int r = n - 1;
  size_t k = 0;
  int64_t checked = 0;
  for (DType t : dts) {
    const double rel = t == DType::Float32 ? 0x1p-21 : t == DType::Float64 ? 0x1p-50 : t == DType::Float16 ? 0x1p-9 : 0x1p-6;
    for (int64_t count : sizes) {
      const auto& b = device[r][k++];
      for (int64_t i = 0; i < count; ++i) {
        double got = 0;
        if (t == DType::Float32) { float x; std::memcpy(&x, &b[4 * i], 4); got = x; }
        if (t == DType::Float64) std::memcpy(&got, &b[8 * i], 8);
        if (t == DType::Float16) { uint16_t x; std::memcpy(&x, &b[2 * i], 2); got = xirang::halfToFloat(x); }
        if (t == DType::BFloat16) { uint16_t x; std::memcpy(&x, &b[2 * i], 2); got = xirang::codec::bf16ToF32(x); }
        double sum = 0;
        for (int q = 0; q < n; ++q) sum += value(q, i);
        const double want = sum / n;
        if (!(std::fabs(got - want) <= rel * want)) {
          CAPTURE(xirang::dtypeName(t), count, i, got, want);
          REQUIRE(std::fabs(got - want) <= rel * want);
        }
        ++checked;
      }
    }
  }
  CHECK(checked == 4 * (64 * 65 / 2 + 1024));
}

TEST_CASE("device: an input still being written on the caller's stream is read once finished", "[device]") {
  DeviceGroup g(2);
  std::vector<dv::Stream> caller(2);
  for (auto& s : caller) REQUIRE(g.dev.cuda().streamCreate(&s) == dv::kCudaSuccess);
  const int64_t count = 4096;
  std::vector<float*> data(2);
  for (int r = 0; r < 2; ++r) {
    void* p = nullptr;
    REQUIRE(g.dev.cuda().malloc(&p, count * 4) == dv::kCudaSuccess);
    data[r] = static_cast<float*>(p);
    std::fill(data[r], data[r] + count, -1.0f);  // stale values
  }
  g.run([&](int r) {
    // The "producer kernel" on the caller's stream: finishes 100 ms later, writing the input.
    g.dev.enqueueHostWork(caller[r], [&, r] {
      std::this_thread::sleep_for(milliseconds(100));
      for (int64_t i = 0; i < count; ++i) data[r][i] = static_cast<float>(i % 17) * (r + 1);
    });
    g.links[r]->waitStream(caller[r]);  // at enqueue, in the caller's thread
    Comm c = g.comm(r);
    xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, count, 1), data[r], count,
                        DType::Float32, ReduceOp::Sum);
    g.links[r]->synchronize(after(milliseconds(20000)));
  });
  for (int r = 0; r < 2; ++r)
    for (int64_t i = 0; i < count; ++i) {
      if (data[r][i] != static_cast<float>(i % 17) * 3) {
        CAPTURE(r, i, data[r][i]);
        REQUIRE(data[r][i] == static_cast<float>(i % 17) * 3);
      }
    }
  for (int r = 0; r < 2; ++r) {
    (void)g.dev.cuda().free(data[r]);
    (void)g.dev.cuda().streamDestroy(caller[r]);
  }
}

TEST_CASE("device: the fake's streams are FIFO, events complete in stream order, freeAsync is stream-ordered",
          "[device][fake]") {
  dv::FakeDevice dev;
  auto& cu = dev.cuda();
  dv::Stream a, b;
  REQUIRE(cu.streamCreate(&a) == dv::kCudaSuccess);
  REQUIRE(cu.streamCreate(&b) == dv::kCudaSuccess);
  dv::Event ev;
  REQUIRE(cu.eventCreate(&ev) == dv::kCudaSuccess);
  CHECK(cu.eventQuery(ev) == dv::kCudaSuccess);  // never recorded: complete
  std::atomic<bool> release{false};
  std::vector<int> order;
  std::mutex mu;
  dev.enqueueHostWork(a, [&] {
    while (!release) std::this_thread::sleep_for(milliseconds(1));
    std::lock_guard<std::mutex> l(mu);
    order.push_back(1);
  });
  REQUIRE(cu.eventRecord(ev, a) == dv::kCudaSuccess);
  CHECK(cu.eventQuery(ev) == dv::kCudaErrorNotReady);
  REQUIRE(cu.streamWaitEvent(b, ev) == dv::kCudaSuccess);
  dev.enqueueHostWork(b, [&] {
    std::lock_guard<std::mutex> l(mu);
    order.push_back(2);
  });
  void* p = nullptr;
  REQUIRE(cu.malloc(&p, 64) == dv::kCudaSuccess);
  REQUIRE(cu.freeAsync(p, b) == dv::kCudaSuccess);
  std::this_thread::sleep_for(milliseconds(20));
  CHECK(dev.liveAllocations() == 1);  // b waits for a: the free has not run
  {
    std::lock_guard<std::mutex> l(mu);
    CHECK(order.empty());
  }
  release = true;
  REQUIRE(cu.streamSynchronize(b) == dv::kCudaSuccess);
  CHECK(cu.eventQuery(ev) == dv::kCudaSuccess);
  CHECK(order == std::vector<int>{1, 2});
  CHECK(dev.liveAllocations() == 0);
  CHECK(cu.free(p) == dv::kCudaErrorInvalidValue);  // already freed
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  uint16_t y[8] = {};
  REQUIRE(dev.kernels().launch(dv::Kernel::encode(x, y, 8), a) == dv::kCudaSuccess);
  CHECK(dev.kernels().launch(dv::Kernel::encode(x, y, -1), a) == dv::kCudaErrorInvalidValue);
  REQUIRE(cu.streamSynchronize(a) == dv::kCudaSuccess);
  for (int i = 0; i < 8; ++i) CHECK(y[i] == xirang::codec::f32ToBf16(x[i]));
  CHECK(dev.kernelsLaunched() == 1);
  (void)cu.streamDestroy(a);
  (void)cu.streamDestroy(b);
}

namespace {

// Two ranks of the fake NCCL, each with its own stream, for the tests of the matching rule.
struct PairComms {
  dv::FakeDevice dev;
  dv::Stream s[2];
  dv::NcclComm c[2];
  dv::Event ev[2];
  PairComms() {
    dv::NcclUniqueId id;
    dev.nccl().getUniqueId(&id);
    runRanks(2, [&](int r) {
      dev.cuda().streamCreate(&s[r]);
      dev.cuda().eventCreate(&ev[r]);
      c[r] = tp::initNcclComm(dev.nccl(), id, r, 2, after(milliseconds(5000)));
    });
  }
  // Whether rank r's stream finishes within `ms`.
  bool finishes(int r, int ms) {
    dev.cuda().eventRecord(ev[r], s[r]);
    const auto until = after(milliseconds(ms));
    while (xirang_test::Clock::now() < until) {
      if (dev.cuda().eventQuery(ev[r]) == dv::kCudaSuccess) return true;
      std::this_thread::sleep_for(milliseconds(1));
    }
    return false;
  }
};

}  // namespace

TEST_CASE("device: the fake NCCL enforces the matching rule: ungrouped send-then-recv both ways deadlocks",
          "[device][fake]") {
  std::vector<float> buf[2] = {std::vector<float>(64, 1.0f), std::vector<float>(64, 2.0f)};
  std::vector<float> got[2] = {std::vector<float>(64, 0.0f), std::vector<float>(64, 0.0f)};
  SECTION("grouped: completes") {
    PairComms p;
    for (int r = 0; r < 2; ++r) {
      auto& nc = p.dev.nccl();
      REQUIRE(nc.groupStart() == dv::kNcclSuccess);
      REQUIRE(nc.send(buf[r].data(), 256, 1 - r, p.c[r], p.s[r]) == dv::kNcclSuccess);
      REQUIRE(nc.recv(got[r].data(), 256, 1 - r, p.c[r], p.s[r]) == dv::kNcclSuccess);
      REQUIRE(nc.groupEnd() == dv::kNcclSuccess);
    }
    CHECK(p.finishes(0, 5000));
    CHECK(p.finishes(1, 5000));
    CHECK(got[0] == buf[1]);
    CHECK(got[1] == buf[0]);
    for (int r = 0; r < 2; ++r) (void)p.dev.nccl().commDestroy(p.c[r]);
  }
  SECTION("ungrouped: deadlocks, seen as a timeout, ended by abort") {
    PairComms p;
    for (int r = 0; r < 2; ++r) {
      REQUIRE(p.dev.nccl().send(buf[r].data(), 256, 1 - r, p.c[r], p.s[r]) == dv::kNcclSuccess);
      REQUIRE(p.dev.nccl().recv(got[r].data(), 256, 1 - r, p.c[r], p.s[r]) == dv::kNcclSuccess);
    }
    CHECK(!p.finishes(0, 300));
    CHECK(!p.finishes(1, 50));
    REQUIRE(p.dev.nccl().commAbort(p.c[0]) == dv::kNcclSuccess);
    CHECK(p.finishes(0, 5000));  // the aborted calls end
    CHECK(p.finishes(1, 5000));  // and the peer's fail with a remote error
    int async = 0;
    REQUIRE(p.dev.nccl().commGetAsyncError(p.c[1], &async) == dv::kNcclSuccess);
    CHECK(async == dv::kNcclRemoteError);
    CHECK(p.dev.nccl().lastError(p.c[1]).find("rank 0") != std::string::npos);
    (void)p.dev.nccl().commAbort(p.c[1]);
  }
  SECTION("different sizes: an InvalidUsage async error on both") {
    PairComms p;
    REQUIRE(p.dev.nccl().send(buf[0].data(), 256, 1, p.c[0], p.s[0]) == dv::kNcclSuccess);
    REQUIRE(p.dev.nccl().recv(got[1].data(), 128, 0, p.c[1], p.s[1]) == dv::kNcclSuccess);
    CHECK(p.finishes(0, 5000));
    CHECK(p.finishes(1, 5000));
    for (int r = 0; r < 2; ++r) {
      int async = 0;
      REQUIRE(p.dev.nccl().commGetAsyncError(p.c[r], &async) == dv::kNcclSuccess);
      CHECK(async == dv::kNcclInvalidUsage);
      (void)p.dev.nccl().commAbort(p.c[r]);
    }
  }
}

TEST_CASE("device: a rank that never joins the communicator ends in a timeout on the others", "[device]") {
  dv::FakeDevice dev;
  dv::NcclUniqueId id;
  dev.nccl().getUniqueId(&id);
  std::vector<std::string> what(2);
  const auto t0 = xirang_test::Clock::now();
  runRanks(2, [&](int r) {  // ranks 0 and 1 of 3; rank 2 never calls
    try {
      tp::initNcclComm(dev.nccl(), id, r, 3, after(milliseconds(300)), "lonely");
      what[r] = "(no error)";
    } catch (const tp::TimeoutError& e) {
      what[r] = e.what();
    }
  });
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(5000));
  for (auto& w : what) {
    CAPTURE(w);
    CHECK(w.find("timed out initialising NCCL communicator 'lonely'") != std::string::npos);
  }
}

TEST_CASE("device: a rank that never calls the collective: the others time out with an error", "[device]") {
  DeviceGroup g(3);
  std::vector<std::string> what(3);
  const auto t0 = xirang_test::Clock::now();
  runRanks(3, [&](int r) {
    if (r == 2) return;  // joined, but never calls
    void* p = nullptr;
    g.dev.cuda().malloc(&p, 400);
    try {
      Comm c = g.comm(r);
      xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, 100, 1, 300), p, 100,
                          DType::Float32, ReduceOp::Sum);
      g.links[r]->synchronize(after(milliseconds(300)));
      what[r] = "(no error)";
    } catch (const tp::TimeoutError& e) {
      what[r] = e.what();
    }
  });
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(5000));
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r, what[r]);
    CHECK(what[r].find("timed out") != std::string::npos);
    CHECK(what[r].find("allreduce") != std::string::npos);
  }
}

namespace {

// A link that aborts itself (and throws) at its k-th exchange: a rank failing mid-operation.
class AbortAt : public tp::Link {
 public:
  AbortAt(tp::Link& inner, int k) : inner_(inner), k_(k) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  tp::Memory memory() const override { return inner_.memory(); }
  void exchange(std::vector<tp::SendJob>& s, std::vector<tp::RecvJob>& r, tp::Deadline d,
                std::vector<tp::PeerTiming>* t) override {
    if (++calls_ == k_) {
      inner_.abort("rank dies mid-op (test)");
      throw tp::TransportError("test: aborted at exchange " + std::to_string(k_), -1);
    }
    inner_.exchange(s, r, d, t);
  }
  void abort(const std::string& why) override { inner_.abort(why); }
  void interrupt(const std::string& why) override { inner_.interrupt(why); }
  uint64_t payloadBytesSent() const override { return inner_.payloadBytesSent(); }

 private:
  tp::Link& inner_;
  int k_, calls_ = 0;
};

}  // namespace

TEST_CASE("device: a rank aborting mid-op makes the others fail, not hang", "[device]") {
  // Ring 0 -> 1 -> 2: both of rank 1's neighbours exchange with it after it died. (On a larger
  // ring a rank that never exchanges with the dead one finishes: the engine's store-based abort
  // has to tell it.)
  const int n = 3;
  DeviceGroup g(n);
  std::vector<std::string> what(n);
  const auto t0 = xirang_test::Clock::now();
  runRanks(n, [&](int r) {
    const int64_t count = 50000;
    void* p = nullptr;
    g.dev.cuda().malloc(&p, count * 4);
    std::memset(p, 0, count * 4);
    AbortAt link(*g.links[r], r == 1 ? 3 : -1);  // rank 1 dies at its third ring step
    Comm c = xirang_test::commOver(&link, r, n, {});
    c.reducer = g.reducers[r].get();
    c.small_bytes = 0;
    c.segment_bytes = 4096;
    try {
      xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, count, 1), p, count,
                          DType::Float32, ReduceOp::Sum);
      g.links[r]->synchronize(after(milliseconds(10000)));
      what[r] = "(no error)";
    } catch (const std::exception& e) {
      what[r] = e.what();
    }
  });
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(8000));
  for (int r = 0; r < n; ++r) {
    CAPTURE(r, what[r]);
    CHECK(what[r] != "(no error)");
    if (r != 1) CHECK(what[r].find("timed out") == std::string::npos);  // told, not timed out
  }
  CHECK(what[0].find("rank 1 aborted") != std::string::npos);
  CHECK(what[2].find("rank 1 aborted") != std::string::npos);
}

TEST_CASE("device: ranks disagreeing about the operation get a MismatchError naming it", "[device]") {
  DeviceGroup g(2);
  std::vector<std::string> what(2);
  runRanks(2, [&](int r) {
    void* p = nullptr;
    g.dev.cuda().malloc(&p, 4000);
    try {
      Comm c = g.comm(r);
      const int64_t count = r == 0 ? 100 : 99;
      xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, count, 1, 5000), p, count,
                          DType::Float32, ReduceOp::Sum);
      g.links[r]->synchronize(after(milliseconds(5000)));
      what[r] = "(no error)";
    } catch (const tp::MismatchError& e) {
      what[r] = e.what();
    } catch (const std::exception& e) {
      what[r] = std::string("other: ") + e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r, what[r]);
    CHECK(what[r].find("element count mismatch") != std::string::npos);
    CHECK(what[r].find("100") != std::string::npos);
    CHECK(what[r].find("99") != std::string::npos);
  }
}

TEST_CASE("device: segment layouts that differ are a MismatchError, not a hang", "[device]") {
  DeviceGroup g(2);
  std::vector<std::string> what(2);
  runRanks(2, [&](int r) {
    void* p = nullptr;
    g.dev.cuda().malloc(&p, 40000);
    try {
      Comm c = g.comm(r);
      c.small_bytes = 0;
      c.segment_bytes = r == 0 ? 1024 : 2048;  // XIRANG_SEGMENT_BYTES differs between the ranks
      xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, 10000, 1, 5000), p, 10000,
                          DType::Float32, ReduceOp::Sum);
      g.links[r]->synchronize(after(milliseconds(5000)));
      what[r] = "(no error)";
    } catch (const tp::MismatchError& e) {
      what[r] = e.what();
    } catch (const std::exception& e) {
      what[r] = std::string("other: ") + e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r, what[r]);
    CHECK(what[r].find("segment layout mismatch") != std::string::npos);
  }
}

TEST_CASE("device: the direct BF16 error-feedback allreduce conserves the sum and keeps replicas identical",
          "[device][collectives]") {
  const int n = GENERATE(1, 2, 3, 5);
  CAPTURE(n);
  InprocGroup g(n);
  constexpr int T = 12;
  const int64_t count = 777;
  std::vector<std::vector<float>> res(n);
  std::vector<std::vector<double>> ysum(n, std::vector<double>(count, 0.0));
  std::vector<uint64_t> bytes(n);
  auto input = [](int r, int t, int64_t i) {
    return static_cast<float>((unit(mix(r, t, i, 3)) - 0.5) * std::ldexp(2.0, static_cast<int>(i % 7) - 3));
  };
  std::vector<std::vector<std::vector<float>>> outs(n);
  g.run([&](int r) {
    Comm c = g.comm(r);
    c.segment_bytes = 100;
    std::vector<float> x(count), ra(count, 0.0f), rb(count);
    for (int t = 0; t < T; ++t) {
      for (int64_t i = 0; i < count; ++i) x[i] = input(r, t, i);
      xirang::Phases ph;
      OpCtx ctx = ctxFor(tp::OpKind::AllreduceEF, DType::Float32, ReduceOp::Avg, count, t + 1);
      ctx.phases = &ph;
      xirang::allreduceBF16EFDirect(c, ctx, x.data(), ra.data(), rb.data(), count);
      std::swap(ra, rb);
      for (int64_t i = 0; i < count; ++i) ysum[r][i] += x[i];
      outs[r].push_back(x);
      bytes[r] = ph.bytes_sent;
    }
    res[r] = ra;
  });
  for (int r = 1; r < n; ++r) CHECK(outs[r] == outs[0]);
  // The bf16 outputs, and sum_t y_t + sum_i r_i == sum_t sum_i x_i,t / N.
  int64_t bad = 0, nonzero = 0;
  for (int64_t i = 0; i < count; ++i) {
    double want = 0, mag = 0, have = ysum[0][i];
    for (int t = 0; t < T; ++t)
      for (int q = 0; q < n; ++q) {
        want += static_cast<double>(input(q, t, i)) / n;
        mag += std::fabs(static_cast<double>(input(q, t, i))) / n;
      }
    for (int q = 0; q < n; ++q) {
      have += res[q][i];
      nonzero += res[q][i] != 0.0f;
    }
    bad += !(std::fabs(have - want) <= 1e-6 * mag);
  }
  CHECK(bad == 0);
  if (n > 1) CHECK(nonzero > 0);
  for (auto& o : outs[0])
    for (float v : o) {
      uint32_t b;
      std::memcpy(&b, &v, 4);
      REQUIRE((b & 0xFFFFu) == 0u);  // bf16 values
    }
  // Wire bytes: every rank sends all but its own chunk, then the allgather forwards every chunk
  // N-1 times: 2 (N-1) x 2n bytes in all, as the ring.
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  CHECK(total == static_cast<uint64_t>(2 * (n - 1) * count * 2));
}
