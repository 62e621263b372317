// Collective algorithms (csrc/core/collectives.h), Gloo style: one thread per rank over
// loopback TCP, world sizes 1-6, element counts 0, 1, 4, 100, 1000, 10000 and a case cut into many
// segments (comm.segment_bytes = 64), identity and permuted ring orders. Every rank regenerates
// every other rank's input from a deterministic hash and checks its result against a
// single-process fp64 / exact reference; results must also be bitwise identical across ranks.
//
// Rank threads never call Catch (not thread-safe): they collect error strings and result hashes,
// the test body asserts after they join.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "core/codec.h"
#include "core/collectives.h"
#include "core/reduce.h"
#include "core/ring.h"
#include "support.h"

namespace {

namespace tp = xirang::transport;
using xirang::Comm;
using xirang::DType;
using xirang::OpCtx;
using xirang::ReduceOp;
using xirang_test::after;
using xirang_test::fnv1a;
using xirang_test::Group;
using xirang_test::mix;
using xirang_test::unit;
using std::chrono::milliseconds;

// (count, segment_bytes): the required counts with the default segment size, plus a case that
// the ring cuts into many segments.
struct Size {
  int64_t count;
  int64_t segment_bytes;
};
const std::vector<Size> kSizes = {{0, 1 << 20},    {1, 1 << 20},    {4, 1 << 20}, {100, 1 << 20},
                                  {1000, 1 << 20}, {10000, 1 << 20}, {1000, 64}};

std::vector<int> ringFor(int n, bool permuted) {
  std::vector<int> ring(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ring[i] = i;
  if (!permuted) return ring;
  switch (n) {
    case 2: return {1, 0};
    case 3: return {2, 0, 1};
    case 4: return {2, 0, 3, 1};
    case 5: return {3, 1, 4, 0, 2};
    case 6: return {5, 2, 0, 4, 1, 3};
    default: return ring;
  }
}

// Per-rank error log (bounded) and result hashes.
struct Log {
  std::vector<std::string> errors;
  std::vector<uint64_t> hashes;
  void error(const std::string& s) {
    if (errors.size() < 12) errors.push_back(s);
  }
};

void expectClean(const std::vector<Log>& logs) {
  for (size_t r = 0; r < logs.size(); ++r) {
    std::ostringstream os;
    for (auto& e : logs[r].errors) os << "\n  " << e;
    INFO("rank " << r << " errors:" << os.str());
    CHECK(logs[r].errors.empty());
  }
  for (size_t r = 1; r < logs.size(); ++r) {
    INFO("rank " << r << " vs rank 0: results must be bitwise identical");
    REQUIRE(logs[r].hashes.size() == logs[0].hashes.size());
    size_t diff = 0;
    for (size_t k = 0; k < logs[r].hashes.size(); ++k) diff += logs[r].hashes[k] != logs[0].hashes[k];
    CHECK(diff == 0);
  }
}

OpCtx ctxFor(tp::OpKind op, DType dt, ReduceOp red, uint64_t numel, uint64_t seq, xirang::Phases* ph = nullptr) {
  OpCtx c;
  c.op = op;
  c.dtype = dt;
  c.reduce = red;
  c.numel = numel;
  c.seq = seq;
  c.deadline = after(milliseconds(20000));
  c.phases = ph;
  return c;
}

// ------------------------------------------------------------------------------------------
// Inputs and references for allreduce.

template <typename T>
T input(DType dt, ReduceOp op, int rank, int64_t i, uint64_t salt) {
  const uint64_t h = mix(static_cast<uint64_t>(rank), static_cast<uint64_t>(i), salt,
                         static_cast<uint64_t>(dt) * 16 + static_cast<uint64_t>(op));
  if (dt == DType::Bool) {
    // OR-like ops: mostly false; AND-like ops: mostly true (so results are not constant).
    const bool orlike = op == ReduceOp::Sum || op == ReduceOp::Max;
    return static_cast<T>(orlike ? (h % 5 == 0) : (h % 7 != 0));
  }
  if constexpr (std::is_floating_point_v<T>) {
    const double u = unit(h);
    switch (op) {
      case ReduceOp::Sum: return static_cast<T>((u - 0.5) * std::ldexp(2.0, static_cast<int>(h % 9) - 4));
      case ReduceOp::Product: return static_cast<T>(((h >> 60) & 1 ? -1.0 : 1.0) * (0.5 + 1.5 * u));
      default: return static_cast<T>((u - 0.5) * 200.0);
    }
  } else {
    if (dt == DType::UInt8) return static_cast<T>(h);  // sums/products wrap mod 256
    switch (op) {
      case ReduceOp::Sum:
        return std::is_same_v<T, int64_t> ? static_cast<T>(static_cast<int64_t>(h % (uint64_t{1} << 50)) - (int64_t{1} << 49))
                                          : static_cast<T>(static_cast<int64_t>(h % 2000001) - 1000000);
      case ReduceOp::Product: {
        static const int f[6] = {-3, -2, -1, 1, 2, 3};
        return static_cast<T>(f[h % 6]);
      }
      default: return static_cast<T>(h);  // full range
    }
  }
}

// Exact reference for everything but float Sum/Product (returned as a long double instead).
template <typename T>
T exactRef(const std::vector<T>& v, DType dt, ReduceOp op) {
  if (dt == DType::Bool) {
    bool acc = op == ReduceOp::Product || op == ReduceOp::Min;
    for (T x : v) acc = (op == ReduceOp::Product || op == ReduceOp::Min) ? (acc && x) : (acc || x);
    return static_cast<T>(acc);
  }
  T acc = v[0];
  for (size_t k = 1; k < v.size(); ++k) {
    const T x = v[k];
    switch (op) {
      case ReduceOp::Min: acc = x < acc ? x : acc; break;
      case ReduceOp::Max: acc = x > acc ? x : acc; break;
      case ReduceOp::Sum:
        if constexpr (std::is_integral_v<T>)
          acc = static_cast<T>(static_cast<std::make_unsigned_t<T>>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(x)));
        break;
      case ReduceOp::Product:
        if constexpr (std::is_integral_v<T>)
          acc = static_cast<T>(static_cast<std::make_unsigned_t<T>>(static_cast<uint64_t>(acc) * static_cast<uint64_t>(x)));
        break;
      default: break;
    }
  }
  return acc;
}

template <typename T>
void allreduceCase(const Comm& comm, int n, DType dt, ReduceOp op, int64_t count, uint64_t seq, uint64_t salt,
                   Log& log, const std::string& label) {
  const int rank = comm.rank;
  std::vector<T> buf(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) buf[i] = input<T>(dt, op, rank, i, salt);
  xirang::Phases ph;
  xirang::allreduce(comm, ctxFor(tp::OpKind::Allreduce, dt, op, static_cast<uint64_t>(count), seq, &ph), buf.data(),
                    count, dt, op);
  log.hashes.push_back(fnv1a(buf.data(), buf.size() * sizeof(T)));

  // Bytes on the wire: the ring is bandwidth-optimal, the direct exchange sends everything to all.
  if (n > 1 && count > 0) {
    uint64_t want = comm.algo == Comm::Algo::Ring
                        ? static_cast<uint64_t>(xirang::ring::allreduceElementsSent(count, n, comm.position())) * sizeof(T)
                        : static_cast<uint64_t>(n - 1) * count * sizeof(T);
    if (comm.algo != Comm::Algo::Auto && ph.bytes_sent != want)
      log.error(label + ": bytes_sent " + std::to_string(ph.bytes_sent) + ", expected " + std::to_string(want));
    // Per-peer statistics account for the same bytes; the ring talks to its two neighbours only.
    uint64_t per_peer = 0, recv = 0;
    for (const auto& [peer, st] : ph.peers) {
      per_peer += st.bytes_sent;
      recv += st.bytes_recv;
      if (st.send_s < 0 || st.recv_s < 0) log.error(label + ": negative peer time");
    }
    if (per_peer != ph.bytes_sent)
      log.error(label + ": per-peer bytes " + std::to_string(per_peer) + " != bytes_sent " + std::to_string(ph.bytes_sent));
    if (comm.algo == Comm::Algo::Direct && recv != want)
      log.error(label + ": per-peer bytes received " + std::to_string(recv) + ", expected " + std::to_string(want));
    if (comm.algo == Comm::Algo::Ring && n > 2 && ph.peers.size() != 2)
      log.error(label + ": ring exchanged with " + std::to_string(ph.peers.size()) + " peers");
  }

  std::vector<T> vals(static_cast<size_t>(n));
  int bad = 0;
  for (int64_t i = 0; i < count && bad < 3; ++i) {
    for (int q = 0; q < n; ++q) vals[q] = input<T>(dt, op, q, i, salt);
    const T got = buf[i];
    if constexpr (std::is_floating_point_v<T>) {
      if (op == ReduceOp::Sum || op == ReduceOp::Product) {
        long double ref = op == ReduceOp::Sum ? 0.0L : 1.0L, mag = 0;
        for (T x : vals) {
          ref = op == ReduceOp::Sum ? ref + x : ref * x;
          mag += std::fabs(static_cast<long double>(x));
        }
        const long double eps = std::numeric_limits<T>::epsilon();
        const long double tol =
            op == ReduceOp::Sum ? (n - 1) * eps * mag : (n - 1) * eps * std::fabs(ref) * 1.0001L;
        if (!(std::fabs(static_cast<long double>(got) - ref) <= tol)) {
          std::ostringstream os;
          os.precision(17);
          os << label << " [" << i << "]: got " << got << ", reference " << static_cast<double>(ref) << " (tol "
             << static_cast<double>(tol) << ")";
          log.error(os.str());
          ++bad;
        }
        continue;
      }
    }
    const T want = exactRef(vals, dt, op);
    if (std::memcmp(&got, &want, sizeof(T)) != 0) {
      std::ostringstream os;
      os.precision(17);
      os << label << " [" << i << "]: got " << +got << ", reference " << +want;
      log.error(os.str());
      ++bad;
    }
  }
}

const char* algoName(Comm::Algo a) {
  return a == Comm::Algo::Ring ? "ring" : a == Comm::Algo::Direct ? "direct" : "auto";
}

}  // namespace

TEST_CASE("collectives: allreduce over dtypes x ops x sizes x algorithms matches the reference", "[collectives]") {
  const int n = GENERATE(1, 2, 3, 4, 5, 6);
  const bool permuted = GENERATE(false, true);
  if (permuted && n < 2) return;
  const std::vector<int> ring = ringFor(n, permuted);
  CAPTURE(n, ring);
  Group g(n);
  std::vector<Log> logs(static_cast<size_t>(n));
  const DType dtypes[] = {DType::Float32, DType::Float64, DType::Int32, DType::Int64, DType::UInt8, DType::Bool};
  const ReduceOp ops[] = {ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Product};
  const Comm::Algo algos[] = {Comm::Algo::Direct, Comm::Algo::Ring, Comm::Algo::Auto};
  g.run([&](int r) {
    uint64_t seq = 0;
    for (Comm::Algo algo : algos) {
      for (DType dt : dtypes) {
        for (ReduceOp op : ops) {
          for (const Size& sz : kSizes) {
            // Auto only at the sizes where it switches between the two. The direct exchange
            // reduces in rank order whatever the ring, so a permuted ring only re-runs the ring.
            if (algo == Comm::Algo::Auto && sz.count != 4 && sz.count != 10000) continue;
            if (permuted && algo != Comm::Algo::Ring) continue;
            Comm comm = g.comm(r, ring);
            comm.algo = algo;
            comm.segment_bytes = sz.segment_bytes;
            comm.small_bytes = 16 << 10;
            ++seq;
            std::ostringstream label;
            label << algoName(algo) << " " << xirang::dtypeName(dt) << " " << xirang::reduceOpName(op) << " x"
                  << sz.count << " seg" << sz.segment_bytes;
            switch (dt) {
              case DType::Float32: allreduceCase<float>(comm, n, dt, op, sz.count, seq, seq, logs[r], label.str()); break;
              case DType::Float64: allreduceCase<double>(comm, n, dt, op, sz.count, seq, seq, logs[r], label.str()); break;
              case DType::Int32: allreduceCase<int32_t>(comm, n, dt, op, sz.count, seq, seq, logs[r], label.str()); break;
              case DType::Int64: allreduceCase<int64_t>(comm, n, dt, op, sz.count, seq, seq, logs[r], label.str()); break;
              default: allreduceCase<uint8_t>(comm, n, dt, op, sz.count, seq, seq, logs[r], label.str()); break;
            }
          }
        }
      }
    }
  });
  expectClean(logs);
}

TEST_CASE("collectives: allreduce with a rank disagreeing on the element count fails everywhere", "[collectives]") {
  const Comm::Algo algo = GENERATE(Comm::Algo::Direct, Comm::Algo::Ring);
  Group g(3);
  std::vector<std::string> what(3);
  xirang_test::runRanks(3, [&](int r) {
    Comm comm = g.comm(r);
    comm.algo = algo;
    const int64_t numel = r == 2 ? 99 : 100;
    std::vector<float> buf(100, 1.0f);
    try {
      xirang::allreduce(comm, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, numel, 1), buf.data(),
                        numel, DType::Float32, ReduceOp::Sum);
      what[r] = "(no error)";
    } catch (const tp::TransportError& e) {
      what[r] = e.what();
      g.tcp[r]->abort(what[r]);  // what the backend does: peers blocked on us fail too
    }
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r, what[r]);
    CHECK(what[r] != "(no error)");
  }
  // Whoever received rank 2's frame names both counts.
  bool named = false;
  for (auto& w : what)
    named |= w.find("element count mismatch") != std::string::npos && w.find("100") != std::string::npos &&
             w.find("99") != std::string::npos;
  CHECK(named);
}

// ------------------------------------------------------------------------------------------
// BF16 error-feedback allreduce.

namespace {

float efInput(int rank, int step, int64_t i) {
  const uint64_t h = mix(static_cast<uint64_t>(rank), static_cast<uint64_t>(step), static_cast<uint64_t>(i), 77);
  return static_cast<float>((unit(h) - 0.5) * std::ldexp(2.0, static_cast<int>(h % 7) - 3));
}

// The error-feedback invariant after T steps of efInput on n ranks, per size case k of kSizes:
// sum_t y_t + sum_i r_i,T == sum_t sum_i x_i,t / N within `tol` relative to sum_t sum_i |x_i,t| / N
// (ysum[k][0]: rank 0's sum_t y_t in fp64; residual[k][q]: rank q's last residual); and the
// residual, which carries the roundings, is non-zero somewhere for counts >= 100.
void checkEFInvariant(const std::vector<std::vector<std::vector<double>>>& ysum,
                      const std::vector<std::vector<std::vector<float>>>& residual, int n, int T, double tol) {
  for (size_t k = 0; k < kSizes.size(); ++k) {
    const int64_t count = kSizes[k].count;
    CAPTURE(count, kSizes[k].segment_bytes);
    int64_t bad = 0, first = -1;
    double worst = 0;
    for (int64_t i = 0; i < count; ++i) {
      double want = 0, mag = 0;
      for (int t = 0; t < T; ++t)
        for (int q = 0; q < n; ++q) {
          want += static_cast<double>(efInput(q, t, i)) / n;
          mag += std::fabs(static_cast<double>(efInput(q, t, i))) / n;
        }
      double have = ysum[k][0][i];
      for (int q = 0; q < n; ++q) have += residual[k][q][i];
      const double rel = std::fabs(have - want) / mag;
      worst = std::max(worst, rel);
      if (!(rel <= tol)) {
        if (first < 0) first = i;
        ++bad;
      }
    }
    CAPTURE(first, worst);
    CHECK(bad == 0);
    if (count >= 100) {
      bool any = false;
      for (int q = 0; q < n; ++q)
        for (float v : residual[k][q]) any |= v != 0.0f;
      CHECK(any);
    }
  }
}

}  // namespace

TEST_CASE("collectives: BF16 error-feedback allreduce keeps replicas identical and conserves the sum", "[collectives]") {
  const int n = GENERATE(1, 2, 3, 4, 5, 6);
  const bool permuted = GENERATE(false, true);
  if (permuted && n < 3) return;
  const std::vector<int> ring = ringFor(n, permuted);
  constexpr int T = 20;
  CAPTURE(n, ring);
  Group g(n);
  std::vector<Log> logs(static_cast<size_t>(n));
  // Per size case: every rank's final residual and sum_t y_t (fp64).
  std::vector<std::vector<std::vector<float>>> residual(kSizes.size(), std::vector<std::vector<float>>(n));
  std::vector<std::vector<std::vector<double>>> ysum(kSizes.size(), std::vector<std::vector<double>>(n));
  g.run([&](int r) {
    uint64_t seq = 0;
    for (size_t k = 0; k < kSizes.size(); ++k) {
      const int64_t count = kSizes[k].count;
      Comm comm = g.comm(r, ring);
      comm.segment_bytes = kSizes[k].segment_bytes;
      const bool alias = k % 2 == 0;  // r_out aliasing r_in, or ping-pong buffers
      std::vector<float> ra(count, 0.0f), rb(count, 0.0f), x(count);
      std::vector<double> ys(count, 0.0);
      for (int t = 0; t < T; ++t) {
        for (int64_t i = 0; i < count; ++i) x[i] = efInput(r, t, i);
        xirang::Phases ph;
        float* r_out = alias ? ra.data() : rb.data();
        xirang::allreduceBF16EF(comm, ctxFor(tp::OpKind::AllreduceEF, DType::Float32, ReduceOp::Avg, count, ++seq, &ph),
                                x.data(), ra.data(), r_out, count);
        if (!alias) std::swap(ra, rb);
        logs[r].hashes.push_back(fnv1a(x.data(), x.size() * 4));
        for (int64_t i = 0; i < count; ++i) {
          ys[i] += x[i];
          // The output is bf16: the low 16 bits are zero.
          uint32_t bits;
          std::memcpy(&bits, &x[i], 4);
          if ((bits & 0xFFFFu) != 0) {
            logs[r].error("output is not a bf16 value at " + std::to_string(i));
            break;
          }
        }
        if (n > 1 && count > 0) {
          const uint64_t want = static_cast<uint64_t>(xirang::ring::allreduceElementsSent(count, n, comm.position())) * 2;
          if (ph.bytes_sent != want)
            logs[r].error("x" + std::to_string(count) + ": bytes_sent " + std::to_string(ph.bytes_sent) +
                          ", expected " + std::to_string(want));
        }
      }
      residual[k][r] = ra;
      ysum[k][r] = ys;
    }
  });
  expectClean(logs);
  checkEFInvariant(ysum, residual, n, T, 1e-6);
}

TEST_CASE("collectives: BF16 error-feedback allreduce turns non-finite input into non-finite output", "[collectives]") {
  const int n = GENERATE(1, 2, 3, 4, 5, 6);
  const bool permuted = GENERATE(false, true);
  if (permuted && n < 3) return;
  Group g(n);
  constexpr int64_t count = 40;
  std::vector<std::vector<float>> out(n);
  g.run([&](int r) {
    Comm comm = g.comm(r, ringFor(n, permuted));
    std::vector<float> x(count), res(count, 0.0f);
    for (int64_t i = 0; i < count; ++i) x[i] = efInput(r, 0, i);
    if (r == 1 % n) x[3] = std::numeric_limits<float>::quiet_NaN();
    if (r == 0) x[5] = std::numeric_limits<float>::infinity();
    if (r == n - 1) x[7] = -std::numeric_limits<float>::infinity();
    if (r == 0) x[9] = std::numeric_limits<float>::infinity();
    if (r == n - 1) x[9] = -std::numeric_limits<float>::infinity();  // inf - inf (or -inf alone if n == 1)
    xirang::allreduceBF16EF(comm, ctxFor(tp::OpKind::AllreduceEF, DType::Float32, ReduceOp::Avg, count, 1), x.data(),
                            res.data(), res.data(), count);
    out[r] = x;
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(std::memcmp(out[r].data(), out[0].data(), count * 4) == 0);
    CHECK(std::isnan(out[r][3]));
    CHECK(!std::isfinite(out[r][5]));
    CHECK(!std::isfinite(out[r][7]));
    CHECK(!std::isfinite(out[r][9]));
    for (int64_t i = 0; i < count; ++i)
      if (i != 3 && i != 5 && i != 7 && i != 9) CHECK(std::isfinite(out[r][i]));
  }
}

TEST_CASE("collectives: fp16 and int8 error-feedback allreduce (direct form): replicas, bytes, the EF invariant",
          "[collectives][wire]") {
  const auto w = GENERATE(xirang::codec::Wire::FP16, xirang::codec::Wire::INT8);
  const int n = GENERATE(1, 2, 3, 4, 5, 6);
  const bool permuted = GENERATE(false, true);
  if (permuted && n < 3) return;
  const std::vector<int> ring = ringFor(n, permuted);
  constexpr int T = 20;
  CAPTURE(xirang::codec::wireName(w), n, ring);
  Group g(n);
  std::vector<Log> logs(static_cast<size_t>(n));
  std::vector<std::vector<std::vector<float>>> residual(kSizes.size(), std::vector<std::vector<float>>(n));
  std::vector<std::vector<std::vector<double>>> ysum(kSizes.size(), std::vector<std::vector<double>>(n));
  std::vector<std::vector<uint64_t>> sent(kSizes.size(), std::vector<uint64_t>(n, 0));
  g.run([&](int r) {
    uint64_t seq = 0;
    for (size_t k = 0; k < kSizes.size(); ++k) {
      const int64_t count = kSizes[k].count;
      Comm comm = g.comm(r, ring);
      comm.segment_bytes = kSizes[k].segment_bytes;
      const bool alias = k % 2 == 0;
      std::vector<float> ra(count, 0.0f), rb(count, 0.0f), x(count);
      std::vector<double> ys(count, 0.0);
      for (int t = 0; t < T; ++t) {
        for (int64_t i = 0; i < count; ++i) x[i] = efInput(r, t, i);
        xirang::Phases ph;
        float* r_out = alias ? ra.data() : rb.data();
        xirang::allreduceEFDirect(comm, ctxFor(tp::OpKind::AllreduceEF, DType::Float32, ReduceOp::Avg, count, ++seq, &ph),
                                  x.data(), ra.data(), r_out, count, w);
        if (!alias) std::swap(ra, rb);
        logs[r].hashes.push_back(fnv1a(x.data(), x.size() * 4));
        for (int64_t i = 0; i < count; ++i) ys[i] += x[i];
        sent[k][r] += ph.bytes_sent;
        const std::string want_algo = w == xirang::codec::Wire::INT8 ? "direct_int8_ef" : "direct_fp16_ef";
        if (want_algo != ph.algorithm) logs[r].error("algorithm " + std::string(ph.algorithm));
      }
      residual[k][r] = ra;
      ysum[k][r] = ys;
    }
  });
  expectClean(logs);  // also: every rank's outputs hash alike (bitwise equal replicas)
  for (size_t k = 0; k < kSizes.size(); ++k) {
    const int64_t count = kSizes[k].count;
    CAPTURE(count, kSizes[k].segment_bytes);
    // Bytes: each rank sends its blocks for the other owners, and the ring allgather moves every
    // block n-1 hops: 2(n-1) x the wire buffer over all ranks.
    uint64_t wire = 0;
    for (const auto& c : xirang::ring::partition(count, n)) wire += xirang::codec::blockBytes(w, c.count);
    uint64_t total = 0;
    for (int q = 0; q < n; ++q) total += sent[k][q];
    CHECK(total == 2 * static_cast<uint64_t>(n - 1) * wire * T);
  }
  checkEFInvariant(ysum, residual, n, T, 1e-5);  // the 1e-5 relative
}

TEST_CASE("collectives: fp16 and int8 error-feedback allreduce: non-finite elements stay where they are",
          "[collectives][wire]") {
  const auto w = GENERATE(xirang::codec::Wire::FP16, xirang::codec::Wire::INT8);
  const int n = GENERATE(1, 2, 3, 4);
  Group g(n);
  constexpr int64_t count = 5000;
  std::vector<std::vector<float>> out(n);
  g.run([&](int r) {
    Comm comm = g.comm(r, ringFor(n, n >= 3));
    std::vector<float> x(count), res(count, 0.0f);
    for (int64_t i = 0; i < count; ++i) x[i] = efInput(r, 0, i);
    if (r == 1 % n) x[3] = std::numeric_limits<float>::quiet_NaN();
    if (r == 0) x[5] = std::numeric_limits<float>::infinity();
    if (r == n - 1) x[4000] = -std::numeric_limits<float>::infinity();
    xirang::allreduceEFDirect(comm, ctxFor(tp::OpKind::AllreduceEF, DType::Float32, ReduceOp::Avg, count, 1), x.data(),
                              res.data(), res.data(), count, w);
    out[r] = x;
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(xirang::codec::wireName(w), n, r);
    CHECK(std::memcmp(out[r].data(), out[0].data(), count * 4) == 0);
    CHECK(std::isnan(out[r][3]));
    CHECK(!std::isfinite(out[r][5]));
    CHECK(!std::isfinite(out[r][4000]));
    int64_t finite = 0;
    for (int64_t i = 0; i < count; ++i) finite += std::isfinite(out[r][i]) ? 1 : 0;
    CHECK(finite == count - 3);
  }
}

TEST_CASE("collectives: ranks on different wire formats fail, not mix", "[collectives][wire]") {
  Group g(2);
  std::vector<std::string> err(2);
  g.run([&](int r) {
    Comm comm = g.comm(r, {0, 1});
    std::vector<float> x(4096, 1.0f), res(4096, 0.0f);
    try {
      xirang::allreduceEFDirect(comm, ctxFor(tp::OpKind::AllreduceEF, DType::Float32, ReduceOp::Avg, 4096, 1), x.data(),
                                res.data(), res.data(), 4096,
                                r == 0 ? xirang::codec::Wire::FP16 : xirang::codec::Wire::INT8);
    } catch (const std::exception& e) {
      err[r] = e.what();
    }
  });
  CHECK(!err[0].empty());
  CHECK(!err[1].empty());
}

// ------------------------------------------------------------------------------------------
// Data movement collectives.

namespace {

uint8_t pat(int a, int b, uint64_t k) { return static_cast<uint8_t>(mix(static_cast<uint64_t>(a), static_cast<uint64_t>(b), k) >> 32); }

void checkBytes(Log& log, const std::string& label, const uint8_t* got, int a, int b, uint64_t bytes) {
  for (uint64_t k = 0; k < bytes; ++k) {
    if (got[k] != pat(a, b, k)) {
      log.error(label + ": byte " + std::to_string(k) + " of " + std::to_string(bytes) + " wrong");
      return;
    }
  }
}

}  // namespace

TEST_CASE("collectives: broadcast from every root", "[collectives]") {
  const int n = GENERATE(1, 2, 3, 4, 5, 6);
  const bool permuted = GENERATE(false, true);
  if (permuted && n < 2) return;
  Group g(n);
  std::vector<Log> logs(n);
  g.run([&](int r) {
    uint64_t seq = 0;
    for (int root = 0; root < n; ++root) {
      for (const Size& sz : kSizes) {
        Comm comm = g.comm(r, ringFor(n, permuted));
        comm.segment_bytes = sz.segment_bytes;
        const uint64_t bytes = static_cast<uint64_t>(sz.count) * 4;  // int32 elements
        std::vector<uint8_t> buf(bytes, 0xCD);
        if (r == root)
          for (uint64_t k = 0; k < bytes; ++k) buf[k] = pat(root, 0, k);
        auto ctx = ctxFor(tp::OpKind::Broadcast, DType::Int32, ReduceOp::None, sz.count, ++seq);
        xirang::broadcast(comm, ctx, buf.data(), bytes, root);
        checkBytes(logs[r], "root " + std::to_string(root) + " x" + std::to_string(sz.count) + " seg" +
                                std::to_string(sz.segment_bytes),
                   buf.data(), root, 0, bytes);
        logs[r].hashes.push_back(fnv1a(buf.data(), bytes));
      }
    }
  });
  expectClean(logs);
}

TEST_CASE("collectives: allgather", "[collectives]") {
  const int n = GENERATE(1, 2, 3, 4, 5, 6);
  const bool permuted = GENERATE(false, true);
  if (permuted && n < 2) return;
  Group g(n);
  std::vector<Log> logs(n);
  g.run([&](int r) {
    uint64_t seq = 0;
    for (const Size& sz : kSizes) {
      Comm comm = g.comm(r, ringFor(n, permuted));
      comm.segment_bytes = sz.segment_bytes;
      const uint64_t bytes = static_cast<uint64_t>(sz.count) * 8;  // float64 elements per rank
      std::vector<std::vector<uint8_t>> store(n, std::vector<uint8_t>(bytes, 0xCD));
      for (uint64_t k = 0; k < bytes; ++k) store[r][k] = pat(r, 1, k);
      std::vector<tp::RecvSeg> blocks;
      for (int q = 0; q < n; ++q) blocks.push_back({store[q].data(), bytes});
      xirang::allgather(comm, ctxFor(tp::OpKind::Allgather, DType::Float64, ReduceOp::None, sz.count, ++seq), blocks);
      for (int q = 0; q < n; ++q) {
        checkBytes(logs[r], "block " + std::to_string(q) + " x" + std::to_string(sz.count), store[q].data(), q, 1, bytes);
        logs[r].hashes.push_back(fnv1a(store[q].data(), bytes));
      }
    }
  });
  expectClean(logs);
}

namespace {

template <typename T>
void reduceScatterCase(const Comm& comm, int n, DType dt, ReduceOp op, const std::vector<int64_t>& counts,
                       uint64_t seq, Log& log, const std::string& label) {
  const int r = comm.rank;
  std::vector<std::vector<T>> data(n);
  std::vector<tp::RecvSeg> blocks;
  int64_t total = 0;
  for (int b = 0; b < n; ++b) {
    data[b].resize(counts[b]);
    for (int64_t j = 0; j < counts[b]; ++j) data[b][j] = input<T>(dt, op, r, j, seq * 64 + b);
    blocks.push_back({data[b].data(), static_cast<uint64_t>(counts[b]) * sizeof(T)});
    total += counts[b];
  }
  xirang::reduceScatter(comm, ctxFor(tp::OpKind::ReduceScatter, dt, op, total, seq), blocks, dt, op);
  const std::vector<T>& mine = data[r];
  log.hashes.push_back(0);  // the results differ by rank; identity is checked against the reference
  std::vector<T> vals(n);
  for (int64_t j = 0; j < counts[r]; ++j) {
    for (int q = 0; q < n; ++q) vals[q] = input<T>(dt, op, q, j, seq * 64 + r);
    if constexpr (std::is_floating_point_v<T>) {
      if (op == ReduceOp::Sum) {
        long double ref = 0, mag = 0;
        for (T x : vals) {
          ref += x;
          mag += std::fabs(static_cast<long double>(x));
        }
        if (!(std::fabs(mine[j] - ref) <= (n - 1) * std::numeric_limits<T>::epsilon() * mag)) {
          log.error(label + " [" + std::to_string(j) + "] off");
          return;
        }
        continue;
      }
    }
    const T want = exactRef(vals, dt, op);
    if (std::memcmp(&mine[j], &want, sizeof(T)) != 0) {
      log.error(label + " [" + std::to_string(j) + "]: got " + std::to_string(+mine[j]) + ", reference " +
                std::to_string(+want));
      return;
    }
  }
}

}  // namespace

TEST_CASE("collectives: reduceScatter, even and uneven blocks", "[collectives]") {
  const int n = GENERATE(1, 2, 3, 4, 5, 6);
  const bool permuted = GENERATE(false, true);
  if (permuted && n < 2) return;
  Group g(n);
  std::vector<Log> logs(n);
  g.run([&](int r) {
    uint64_t seq = 0;
    for (const Size& sz : kSizes) {
      for (bool uneven : {false, true}) {
        Comm comm = g.comm(r, ringFor(n, permuted));
        comm.segment_bytes = sz.segment_bytes;
        std::vector<int64_t> counts(n, sz.count);
        if (uneven)
          for (int b = 0; b < n; ++b) counts[b] = sz.count + (b * 3) % 5;
        // Appended, not `"x" + std::to_string(...)`: GCC 12 (C++20) reports a false -Wrestrict there.
        std::string label = "x";
        label += std::to_string(sz.count);
        label += uneven ? " uneven seg" : " seg";
        label += std::to_string(sz.segment_bytes);
        reduceScatterCase<float>(comm, n, DType::Float32, ReduceOp::Sum, counts, ++seq, logs[r], "f32 sum " + label);
        reduceScatterCase<int64_t>(comm, n, DType::Int64, ReduceOp::Sum, counts, ++seq, logs[r], "i64 sum " + label);
        reduceScatterCase<int32_t>(comm, n, DType::Int32, ReduceOp::Max, counts, ++seq, logs[r], "i32 max " + label);
        reduceScatterCase<double>(comm, n, DType::Float64, ReduceOp::Min, counts, ++seq, logs[r], "f64 min " + label);
        reduceScatterCase<uint8_t>(comm, n, DType::UInt8, ReduceOp::Product, counts, ++seq, logs[r], "u8 prod " + label);
        reduceScatterCase<uint8_t>(comm, n, DType::Bool, ReduceOp::Sum, counts, ++seq, logs[r], "bool sum " + label);
      }
    }
  });
  expectClean(logs);
}

TEST_CASE("collectives: alltoall with uneven sizes", "[collectives]") {
  const int n = GENERATE(1, 2, 3, 4, 5, 6);
  const bool permuted = GENERATE(false, true);
  if (permuted && n < 2) return;
  Group g(n);
  std::vector<Log> logs(n);
  // Bytes rank `src` sends to rank `dst`: zero for some pairs, up to 4 * base + 3.
  auto bytesOf = [](int src, int dst, int64_t base) -> uint64_t {
    const int f = (src * 7 + dst * 3) % 5;
    return f == 0 ? 0 : static_cast<uint64_t>(f * base + src);
  };
  g.run([&](int r) {
    uint64_t seq = 0;
    for (const Size& sz : kSizes) {
      Comm comm = g.comm(r, ringFor(n, permuted));
      comm.segment_bytes = sz.segment_bytes;
      std::vector<std::vector<uint8_t>> out(n), in(n);
      std::vector<tp::SendSeg> sends;
      std::vector<tp::RecvSeg> recvs;
      uint64_t total = 0;
      for (int q = 0; q < n; ++q) {
        out[q].resize(bytesOf(r, q, sz.count));
        for (uint64_t k = 0; k < out[q].size(); ++k) out[q][k] = pat(r, 100 + q, k);
        in[q].assign(bytesOf(q, r, sz.count), 0xCD);
        sends.push_back({out[q].data(), out[q].size()});
        recvs.push_back({in[q].data(), in[q].size()});
        total += out[q].size();
      }
      xirang::alltoall(comm, ctxFor(tp::OpKind::Alltoall, DType::Bytes, ReduceOp::None, total, ++seq), sends, recvs);
      for (int q = 0; q < n; ++q)
        checkBytes(logs[r], "from " + std::to_string(q) + " base " + std::to_string(sz.count), in[q].data(), q,
                   100 + r, in[q].size());
    }
  });
  expectClean(logs);
}

TEST_CASE("collectives: gather and scatter to / from every root", "[collectives]") {
  const int n = GENERATE(1, 2, 3, 4, 5, 6);
  const bool permuted = GENERATE(false, true);
  if (permuted && n < 2) return;
  Group g(n);
  std::vector<Log> logs(n);
  auto bytesOf = [](int rank, int64_t base) { return static_cast<uint64_t>(base + (base ? 3 * rank : 0)); };
  g.run([&](int r) {
    uint64_t seq = 0;
    for (int root = 0; root < n; ++root) {
      for (const Size& sz : kSizes) {
        Comm comm = g.comm(r, ringFor(n, permuted));
        comm.segment_bytes = sz.segment_bytes;
        const std::string label = "root " + std::to_string(root) + " base " + std::to_string(sz.count);
        // Gather: rank q contributes pat(q, 200 + root).
        {
          std::vector<uint8_t> mine(bytesOf(r, sz.count));
          for (uint64_t k = 0; k < mine.size(); ++k) mine[k] = pat(r, 200 + root, k);
          std::vector<std::vector<uint8_t>> got(n);
          std::vector<tp::RecvSeg> blocks;
          for (int q = 0; q < n; ++q) {
            got[q].assign(r == root ? bytesOf(q, sz.count) : 0, 0xCD);
            blocks.push_back({got[q].data(), got[q].size()});
          }
          xirang::gather(comm, ctxFor(tp::OpKind::Gather, DType::Bytes, ReduceOp::None, 0, ++seq),
                         {mine.data(), mine.size()}, blocks, root);
          if (r == root)
            for (int q = 0; q < n; ++q) checkBytes(logs[r], "gather " + label, got[q].data(), q, 200 + root, got[q].size());
        }
        // Scatter: root sends pat(root, 300 + q) to rank q.
        {
          std::vector<std::vector<uint8_t>> src(n);
          std::vector<tp::SendSeg> blocks;
          for (int q = 0; q < n; ++q) {
            if (r == root) {
              src[q].resize(bytesOf(q, sz.count));
              for (uint64_t k = 0; k < src[q].size(); ++k) src[q][k] = pat(root, 300 + q, k);
            }
            blocks.push_back({src[q].data(), src[q].size()});
          }
          std::vector<uint8_t> mine(bytesOf(r, sz.count), 0xCD);
          xirang::scatter(comm, ctxFor(tp::OpKind::Scatter, DType::Bytes, ReduceOp::None, 0, ++seq), blocks,
                          {mine.data(), mine.size()}, root);
          checkBytes(logs[r], "scatter " + label, mine.data(), root, 300 + r, mine.size());
        }
      }
    }
  });
  expectClean(logs);
}

TEST_CASE("collectives: ring order {2,0,3,1} gives the identity ring's results", "[collectives]") {
  // Integer sums are exact whatever the order; float results are compared bitwise between the
  // two ring orders for the direct path (rank-order reduction, independent of the ring) and
  // against the reference for the ring path.
  Group g(4);
  std::vector<std::vector<std::vector<uint8_t>>> res(2, std::vector<std::vector<uint8_t>>(4));
  g.run([&](int r) {
    uint64_t seq = 0;
    for (int which = 0; which < 2; ++which) {
      Comm comm = g.comm(r, which ? std::vector<int>{2, 0, 3, 1} : std::vector<int>{0, 1, 2, 3});
      std::vector<int64_t> a(1001), d(1001);
      for (int64_t i = 0; i < 1001; ++i) a[i] = d[i] = input<int64_t>(DType::Int64, ReduceOp::Sum, r, i, 5);
      comm.algo = Comm::Algo::Ring;
      comm.segment_bytes = 64;
      xirang::allreduce(comm, ctxFor(tp::OpKind::Allreduce, DType::Int64, ReduceOp::Sum, 1001, ++seq), a.data(), 1001,
                        DType::Int64, ReduceOp::Sum);
      std::vector<float> f(333);
      for (int64_t i = 0; i < 333; ++i) f[i] = input<float>(DType::Float32, ReduceOp::Sum, r, i, 6);
      comm.algo = Comm::Algo::Direct;
      xirang::allreduce(comm, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, 333, ++seq), f.data(), 333,
                        DType::Float32, ReduceOp::Sum);
      std::vector<uint8_t> b(777);
      if (r == 3)
        for (size_t k = 0; k < b.size(); ++k) b[k] = pat(3, 9, k);
      xirang::broadcast(comm, ctxFor(tp::OpKind::Broadcast, DType::Bytes, ReduceOp::None, 777, ++seq), b.data(), b.size(), 3);
      auto& out = res[which][r];
      out.insert(out.end(), reinterpret_cast<uint8_t*>(a.data()), reinterpret_cast<uint8_t*>(a.data() + a.size()));
      out.insert(out.end(), reinterpret_cast<uint8_t*>(f.data()), reinterpret_cast<uint8_t*>(f.data() + f.size()));
      out.insert(out.end(), b.begin(), b.end());
    }
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(res[1][r] == res[0][r]);
    CHECK(res[0][r] == res[0][0]);
  }
}

// 16-bit floats: the owner accumulates in fp32 in rank order and rounds once. Reference: the
// same fp32 arithmetic in one process, then one rounding.
TEST_CASE("collectives: allreduce16 rounds the fp32 result once (float16, bfloat16)", "[collectives][half]") {
  const int n = GENERATE(1, 2, 3, 4);
  const bool permuted = GENERATE(false, true);
  const DType dt = GENERATE(DType::Float16, DType::BFloat16);
  if (permuted && n < 2) return;
  const bool half = dt == DType::Float16;
  auto toF = [&](uint16_t v) { return half ? xirang::halfToFloat(v) : xirang::codec::bf16ToF32(v); };
  auto fromF = [&](float v) { return half ? xirang::floatToHalf(v) : xirang::codec::f32ToBf16(v); };
  auto in = [&](int r, int64_t i) { return fromF(static_cast<float>((unit(mix(r, i, 16, 0)) - 0.5) * 8.0)); };
  struct Case {
    ReduceOp op;
    float pre, post;
  };
  const std::vector<Case> cases = {{ReduceOp::Sum, 1.0f, 1.0f},
                                   {ReduceOp::Sum, 1.0f, 1.0f / static_cast<float>(n)},  // AVG
                                   {ReduceOp::Sum, 0.5f, 1.0f},                          // PREMUL_SUM
                                   {ReduceOp::Max, 1.0f, 1.0f},
                                   {ReduceOp::Min, 1.0f, 1.0f},
                                   {ReduceOp::Product, 1.0f, 1.0f}};
  Group g(n);
  std::vector<Log> logs(n);
  g.run([&](int r) {
    uint64_t seq = 0;
    for (const Case& c : cases) {
      for (const Size& sz : kSizes) {
        Comm comm = g.comm(r, ringFor(n, permuted));
        comm.segment_bytes = sz.segment_bytes;
        std::vector<uint16_t> buf(static_cast<size_t>(sz.count));
        for (int64_t i = 0; i < sz.count; ++i) buf[i] = in(r, i);
        auto ctx = ctxFor(tp::OpKind::Allreduce, dt, c.op, sz.count, ++seq);
        xirang::allreduce16(comm, ctx, buf.data(), sz.count, dt, c.op, c.pre, c.post);
        for (int64_t i = 0; i < sz.count; ++i) {
          float acc = toF(in(0, i)) * c.pre;
          for (int k = 1; k < n; ++k) {
            float v = toF(in(k, i)) * c.pre;
            switch (c.op) {
              case ReduceOp::Sum: acc = acc + v; break;
              case ReduceOp::Product: acc = acc * v; break;
              case ReduceOp::Max: acc = v > acc ? v : acc; break;
              default: acc = v < acc ? v : acc; break;
            }
          }
          uint16_t want = fromF(acc * c.post);
          if (buf[i] != want) {
            logs[r].error(std::string(xirang::reduceOpName(c.op)) + " x" + std::to_string(sz.count) + " i" +
                          std::to_string(i) + ": got " + std::to_string(buf[i]) + " want " + std::to_string(want));
            break;
          }
        }
        logs[r].hashes.push_back(fnv1a(buf.data(), buf.size() * 2));
      }
    }
  });
  expectClean(logs);
}
