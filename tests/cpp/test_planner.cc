// The planner (core/planner.h) and the ring loops (core/algorithms/loops.h), on the in-process
// link: rings of 1..16 ranks as threads of this process, values against fp64 references.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/algorithms/loops.h"
#include "core/codec.h"
#include "core/planner.h"
#include "core/reduce.h"
#include "core/ring.h"
#include "support.h"

namespace {

using xirang::AllreducePlan;
using xirang::Comm;
using xirang::DType;
using xirang::OpCtx;
using xirang::ReduceOp;
using xirang_test::after;
using xirang_test::InprocGroup;
using std::chrono::milliseconds;

OpCtx ctxFor(DType dt, ReduceOp op, uint64_t numel, uint64_t seq = 1) {
  OpCtx c;
  c.op = xirang::transport::OpKind::Allreduce;
  c.dtype = dt;
  c.reduce = op;
  c.numel = numel;
  c.seq = seq;
  c.deadline = after(milliseconds(20000));
  return c;
}

float input(int rank, int64_t i) { return static_cast<float>(((rank * 7919 + i * 104729) % 2003) - 1001) / 64.0f; }

}  // namespace

TEST_CASE("planner: AVG and PREMUL_SUM become a scaled SUM; other ops pass through", "[planner]") {
  auto a = xirang::scalingFor(ReduceOp::Avg, 1.0, 4);
  CHECK(a.wire_op == ReduceOp::Sum);
  CHECK(a.factor == 0.25);
  auto p = xirang::scalingFor(ReduceOp::PremulSum, 0.5, 4);
  CHECK(p.wire_op == ReduceOp::Sum);
  CHECK(p.factor == 0.5);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product, ReduceOp::BXor}) {
    auto s = xirang::scalingFor(op, 3.0, 4);
    CHECK(s.wire_op == op);
    CHECK(s.factor == 1.0);
  }
}

TEST_CASE("planner: which path each dtype and topology takes", "[planner]") {
  Comm c;
  c.ring = {0, 1, 2};
  auto f32 = xirang::planAllreduce(c, DType::Float32, ReduceOp::Avg, 1.0);
  CHECK(f32.path == AllreducePlan::Path::Native);
  CHECK(f32.pre_scale == Approx(1.0 / 3));
  auto bf = xirang::planAllreduce(c, DType::BFloat16, ReduceOp::Avg, 1.0);
  CHECK(bf.path == AllreducePlan::Path::Direct16);  // 16 bits on the wire, one rounding
  CHECK(bf.pre_scale == 1.0);
  CHECK(bf.post_scale == Approx(1.0f / 3));
  auto pm = xirang::planAllreduce(c, DType::Float16, ReduceOp::PremulSum, 0.25);
  CHECK(pm.path == AllreducePlan::Path::Direct16);
  CHECK(pm.pre_scale == 0.25);
  CHECK(pm.post_scale == 1.0f);
  c.algo = Comm::Algo::Ring;  // a forced ring keeps the ring: fp32 partial sums
  CHECK(xirang::planAllreduce(c, DType::BFloat16, ReduceOp::Sum, 1.0).path == AllreducePlan::Path::Widened);
  c.algo = Comm::Algo::Auto;
  c.local_group = {0, 1};  // a two-level plan exists: likewise
  auto w = xirang::planAllreduce(c, DType::Float16, ReduceOp::Avg, 1.0);
  CHECK(w.path == AllreducePlan::Path::Widened);
  CHECK(w.pre_scale == Approx(1.0 / 3));
  CHECK(xirang::planAllreduce(c, DType::Int64, ReduceOp::Max, 1.0).path == AllreducePlan::Path::Native);
}

TEST_CASE("planner: allreduceOp at world sizes 1..16 over the in-process link matches fp64", "[planner][inproc]") {
  const int n = GENERATE(1, 2, 3, 5, 8, 13, 16);
  const ReduceOp op = GENERATE(ReduceOp::Sum, ReduceOp::Avg, ReduceOp::PremulSum, ReduceOp::Max);
  const int64_t numel = GENERATE(0, 1, 7, 1000, 70001);
  const double premul = 0.375;
  InprocGroup g(n);
  std::vector<std::vector<float>> out(static_cast<size_t>(n));
  g.run([&](int r) {
    Comm c = g.comm(r);
    c.segment_bytes = 4096;  // several segments per chunk
    std::vector<float> x(static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i) x[static_cast<size_t>(i)] = input(r, i);
    xirang::allreduceOp(c, ctxFor(DType::Float32, op, static_cast<uint64_t>(numel)), x.data(), numel, DType::Float32, op,
                        premul);
    out[static_cast<size_t>(r)] = std::move(x);
  });
  INFO("n " << n << " op " << xirang::reduceOpName(op) << " numel " << numel);
  double worst = 0;
  for (int64_t i = 0; i < numel; ++i) {
    double ref = op == ReduceOp::Max ? -1e300 : 0.0;
    for (int r = 0; r < n; ++r) {
      const double v = input(r, i);
      ref = op == ReduceOp::Max ? std::max(ref, v) : ref + v;
    }
    if (op == ReduceOp::Avg) ref /= n;
    if (op == ReduceOp::PremulSum) ref *= premul;
    worst = std::max(worst, std::abs(out[0][static_cast<size_t>(i)] - ref) / std::max(1.0, std::abs(ref)));
  }
  CHECK(worst < 1e-5);
  for (int r = 1; r < n; ++r) CHECK(std::memcmp(out[0].data(), out[r].data(), out[0].size() * 4) == 0);
}

TEST_CASE("planner: 16-bit allreduce rounds once on every path, identical on all ranks", "[planner][inproc][half]") {
  const int n = GENERATE(2, 3, 7);
  const DType dt = GENERATE(DType::BFloat16, DType::Float16);
  const bool forced_ring = GENERATE(false, true);
  const int64_t numel = 5003;
  InprocGroup g(n);
  std::vector<std::vector<uint16_t>> out(static_cast<size_t>(n));
  auto to16 = [&](float v) { return dt == DType::BFloat16 ? xirang::codec::f32ToBf16(v) : xirang::floatToHalf(v); };
  auto from16 = [&](uint16_t v) { return dt == DType::BFloat16 ? xirang::codec::bf16ToF32(v) : xirang::halfToFloat(v); };
  g.run([&](int r) {
    Comm c = g.comm(r);
    c.segment_bytes = 4096;
    if (forced_ring) c.algo = Comm::Algo::Ring;
    std::vector<uint16_t> x(static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i) x[static_cast<size_t>(i)] = to16(input(r, i));
    xirang::allreduceOp(c, ctxFor(dt, ReduceOp::Avg, static_cast<uint64_t>(numel)), x.data(), numel, dt, ReduceOp::Avg);
    out[static_cast<size_t>(r)] = std::move(x);
  });
  INFO("n " << n << " dtype " << xirang::dtypeName(dt) << (forced_ring ? " ring" : " direct16"));
  // One rounding of an fp32 result: within one 16-bit ulp of the exact mean, plus the fp32
  // accumulation's own error (n roundings of terms up to max|x|: it matters where the terms
  // cancel). A 16-bit rounding at every hop would be n times one 16-bit ulp of the terms.
  int64_t beyond_one_ulp = 0;
  for (int64_t i = 0; i < numel; ++i) {
    double ref = 0, big = 0;
    for (int r = 0; r < n; ++r) {
      ref += from16(to16(input(r, i)));
      big = std::max(big, std::abs(static_cast<double>(from16(to16(input(r, i))))));
    }
    ref /= n;
    const float got = from16(out[0][static_cast<size_t>(i)]);
    const uint16_t near = to16(static_cast<float>(ref));
    const double ulp = std::abs(static_cast<double>(from16(static_cast<uint16_t>(near + 1))) - from16(near));
    if (std::abs(got - ref) > ulp + 2.0 * n * big * 0x1p-24) beyond_one_ulp++;
  }
  CHECK(beyond_one_ulp == 0);
  for (int r = 1; r < n; ++r) CHECK(out[0] == out[r]);
}

TEST_CASE("loops: scatterReduce hands every segment over once and leaves each position its chunk", "[loops][inproc]") {
  const int n = GENERATE(1, 2, 4, 9, 16);
  const int64_t numel = GENERATE(5, 4096, 33333);
  InprocGroup g(n);
  std::vector<std::vector<int64_t>> owned(static_cast<size_t>(n));
  std::vector<int64_t> segments_seen(static_cast<size_t>(n), 0);
  g.run([&](int r) {
    Comm c = g.comm(r);
    c.segment_bytes = 8 * 1000;  // 1000 int64 per segment
    std::vector<int64_t> x(static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i) x[static_cast<size_t>(i)] = (r + 1) * 1000000 + i;
    const auto chunks = xirang::ring::partition(numel, n);
    auto chunk = [&](int k) {
      const auto& rg = chunks[static_cast<size_t>(k)];
      return xirang::transport::RecvSeg{x.data() + rg.offset, static_cast<uint64_t>(rg.count) * 8};
    };
    if (n > 1)
      xirang::algo::scatterReduce(c, ctxFor(DType::Int64, ReduceOp::Sum, static_cast<uint64_t>(numel)), 8, chunk,
                                  [&](int k, uint64_t off, const void* seg, uint64_t bytes) {
                                    segments_seen[static_cast<size_t>(r)]++;
                                    xirang::reduceInto(static_cast<uint8_t*>(chunk(k).data) + off, seg,
                                                       static_cast<int64_t>(bytes / 8), DType::Int64, ReduceOp::Sum);
                                  });
    const auto& mine = chunks[static_cast<size_t>(xirang::ring::ownedChunk(c.position(), n))];
    owned[static_cast<size_t>(r)].assign(x.begin() + mine.offset, x.begin() + mine.offset + mine.count);
  });
  const auto chunks = xirang::ring::partition(numel, n);
  int64_t total_segments = 0;
  for (int r = 0; r < n; ++r) {
    const auto& mine = chunks[static_cast<size_t>(xirang::ring::ownedChunk(r, n))];
    std::vector<int64_t> want;
    for (int64_t i = mine.offset; i < mine.offset + mine.count; ++i) {
      int64_t s = 0;
      for (int q = 0; q < n; ++q) s += (q + 1) * 1000000 + i;
      want.push_back(s);
    }
    CHECK(owned[static_cast<size_t>(r)] == want);
    total_segments += segments_seen[static_cast<size_t>(r)];
  }
  // Each of the n-1 steps delivers every chunk but one, in 1000-element segments.
  int64_t expect = 0;
  for (int s = 0; s < n - 1; ++s)
    for (int p = 0; p < n; ++p)
      expect += xirang::ring::segmentCount(chunks[static_cast<size_t>(xirang::ring::scatterReduceStep(p, n, s).recv_chunk)].count, 1000);
  CHECK(total_segments == expect);
}

TEST_CASE("loops: a rank in the other phase is told, not fed another chunk", "[loops][inproc]") {
  InprocGroup g(2);
  std::string what;
  try {
    g.run([&](int r) {
      Comm c = g.comm(r);
      std::vector<uint8_t> buf(64, static_cast<uint8_t>(r));
      auto chunk = [&](int k) { return xirang::transport::RecvSeg{buf.data() + 32 * k, 32}; };
      auto ctx = ctxFor(DType::UInt8, ReduceOp::Sum, 64);
      if (r == 0)
        xirang::algo::allgather(c, ctx, 1, chunk);
      else
        xirang::algo::scatterReduce(c, ctx, 1, chunk, [](int, uint64_t, const void*, uint64_t) {});
    });
  } catch (const std::exception& e) {
    what = e.what();
  }
  CAPTURE(what);
  CHECK(what.find("argument mismatch (chunk)") != std::string::npos);
}
