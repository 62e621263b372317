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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
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
#include "core/transport/staged_link.h"
#include "collective_cases.h"
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

// n ranks of the fake device, each with a stream, a device link of type L (made by the derived
// group) and a DeviceReducer on that stream.
template <class L>
struct DeviceRanks {
  dv::FakeDevice dev;  // first member: destroyed last
  int n;
  std::vector<dv::Stream> streams;
  std::vector<std::unique_ptr<L>> links;
  std::vector<std::unique_ptr<xirang::algo::DeviceReducer>> reducers;

  explicit DeviceRanks(int size) : n(size), streams(size), links(size), reducers(size) {}
  ~DeviceRanks() {
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

 protected:
  void makeStream(int r) {
    if (dev.cuda().streamCreate(&streams[r]) != dv::kCudaSuccess) throw std::runtime_error("streamCreate");
    reducers[r] = std::make_unique<xirang::algo::DeviceReducer>(dev.cuda(), dev.kernels(), streams[r]);
  }
};

// n ranks over NcclLinks: communicators from the fake NCCL (unique id through a store,
// non-blocking init).
struct DeviceGroup : DeviceRanks<tp::NcclLink> {
  explicit DeviceGroup(int size) : DeviceRanks(size) {
    MemStore store;
    runRanks(n, [&](int r) {
      makeStream(r);
      const auto id = tp::shareNcclUniqueId(dev.nccl(), store, "xirang/test/0/nccl_uid", r, after(milliseconds(10000)));
      dv::NcclComm c = tp::initNcclComm(dev.nccl(), id, r, n, after(milliseconds(10000)), "test");
      links[r] = std::make_unique<tp::NcclLink>(dev.nccl(), dev.cuda(), c, r, n, streams[r]);
    });
  }
};

using namespace xirang_test::cases;  // ctxFor, Env, fillInput, allCollectives (collective_cases.h)

// n ranks over StagedLinks (pinned staging) on the in-process link: the device code without NCCL
// between the ranks.
struct StagedGroup : DeviceRanks<tp::StagedLink> {
  InprocGroup host;
  explicit StagedGroup(int size) : DeviceRanks(size), host(size) {
    for (int r = 0; r < n; ++r) {
      makeStream(r);
      links[r] = std::make_unique<tp::StagedLink>(dev.cuda(), streams[r], host.hub.link(r));
    }
  }
  // The staged links go first: they refer to the in-process links (the base clears them later).
  ~StagedGroup() { links.clear(); }
};

// Runs `body` on every rank of a device group G (DeviceGroup or StagedGroup) of n ranks, the
// inputs in its fake device memory; results[rank].
using Results = std::vector<std::vector<std::vector<uint8_t>>>;
template <class G>
void runDevice(int n, const std::function<void(Env&)>& body, Results& device) {
  device.assign(n, {});
  G g(n);
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

// Runs `body` on every rank of a host group and of a device group of n ranks; results[engine][rank].
template <class G = DeviceGroup>
void runBoth(int n, const std::function<void(Env&)>& body, Results& host, Results& device) {
  host.assign(n, {});
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
  runDevice<G>(n, body, device);
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

TEST_CASE("device: a stop check (the engine's store abort note) ends a wait on a silent peer at once", "[device]") {
  // Rank 1 joined but never calls: NCCL would keep rank 0 waiting until its deadline. The stop
  // check says a peer failed after ~300 ms; rank 0 ends then, naming it, not as a timeout.
  DeviceGroup g(2);
  std::string what = "(no error)";
  int polls = 0;
  const auto t0 = xirang_test::Clock::now();
  g.links[0]->setStopCheck(
      [&]() -> std::string {
        ++polls;
        return xirang_test::Clock::now() - t0 > milliseconds(300) ? "rank 1 aborted (test note)" : "";
      },
      milliseconds(50));
  void* p = nullptr;
  g.dev.cuda().malloc(&p, 400);
  try {
    Comm c = g.comm(0);
    xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, 100, 1, 10000), p, 100,
                        DType::Float32, ReduceOp::Sum);
    g.links[0]->synchronize(after(milliseconds(10000)));
  } catch (const tp::TimeoutError& e) {
    what = std::string("timeout: ") + e.what();
  } catch (const tp::TransportError& e) {
    what = e.what();
  }
  const auto took = xirang_test::Clock::now() - t0;
  CAPTURE(what, polls);
  CHECK(what.find("a peer failed: rank 1 aborted (test note)") != std::string::npos);
  CHECK(took < milliseconds(3000));
  CHECK(polls >= 3);       // polled while waiting
  CHECK(polls <= 40);      // at most once per 50 ms, not on every spin
  // The link is unusable afterwards: the next call fails at once with the same reason.
  CHECK_THROWS_WITH(g.links[0]->synchronize(after(milliseconds(1000))), Catch::Contains("rank 1 aborted"));
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

// Ring 0 -> 1 -> 2 of group G, rank 1 dying at its third ring step of a 50000-element allreduce:
// what each rank's op ended with ("(no error)" if it did not fail), within 8 s. `failed(r, what)`
// runs on a rank whose op failed (the staged group aborts its link there, as the backend does).
template <class G>
std::vector<std::string> abortMidOp(G& g, const std::function<void(int, const std::string&)>& failed = {}) {
  const int n = 3;
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
      if (failed) failed(r, what[r]);
    }
    // p is not freed: the failed op's copies and kernels may still be queued on the stream (the
    // fake device frees everything at the group's end).
  });
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(8000));
  for (int r = 0; r < n; ++r) {
    CAPTURE(r, what[r]);
    CHECK(what[r] != "(no error)");
    if (r != 1) CHECK(what[r].find("timed out") == std::string::npos);  // told, not timed out
  }
  return what;
}

TEST_CASE("device: a rank aborting mid-op makes the others fail, not hang", "[device]") {
  // Both of rank 1's neighbours exchange with it after it died. (On a larger ring a rank that
  // never exchanges with the dead one finishes: the engine's store-based abort has to tell it.)
  DeviceGroup g(3);
  const auto what = abortMidOp(g);
  // Each survivor is told by a peer that aborted: rank 1 itself, or the survivor rank 1's death
  // reached first (which one a survivor hears of first is a race); the first to fail names rank 1.
  CAPTURE(what[0], what[2]);
  CHECK(what[0].find("aborted") != std::string::npos);
  CHECK(what[2].find("aborted") != std::string::npos);
  CHECK((what[0].find("rank 1 aborted") != std::string::npos || what[2].find("rank 1 aborted") != std::string::npos));
}

// An NcclApi that hands every call to `inner` (the fake's): the tests' wrappers override a few.
struct ForwardNccl : dv::NcclApi {
  explicit ForwardNccl(dv::NcclApi& inner) : in(inner) {}
  const char* name() const override { return "forward"; }
  const char* errorString(int r) override { return in.errorString(r); }
  std::string lastError(dv::NcclComm c) override { return in.lastError(c); }
  int getVersion(int* v) override { return in.getVersion(v); }
  int getUniqueId(dv::NcclUniqueId* id) override { return in.getUniqueId(id); }
  int commInitRankConfig(dv::NcclComm* c, int n, const dv::NcclUniqueId& id, int r,
                         const dv::NcclConfig& cfg) override {
    return in.commInitRankConfig(c, n, id, r, cfg);
  }
  int commAbort(dv::NcclComm c) override { return in.commAbort(c); }
  int commDestroy(dv::NcclComm c) override { return in.commDestroy(c); }
  int commGetAsyncError(dv::NcclComm c, int* e) override { return in.commGetAsyncError(c, e); }
  int groupStart() override { return in.groupStart(); }
  int groupEnd() override { return in.groupEnd(); }
  int send(const void* b, size_t bytes, int peer, dv::NcclComm c, dv::Stream s) override {
    return in.send(b, bytes, peer, c, s);
  }
  int recv(void* b, size_t bytes, int peer, dv::NcclComm c, dv::Stream s) override { return in.recv(b, bytes, peer, c, s); }

  dv::NcclApi& in;
};

// The fake's NCCL with rank 0's sends failing after the first `ok_sends` (a call NCCL rejects,
// e.g. a bad argument or a communicator already in error), watching for a communicator aborted
// while this thread's group is still open: ncclGroupEnd then walks freed memory in real NCCL.
struct FailingSends : ForwardNccl {
  FailingSends(dv::NcclApi& inner, int ok_sends) : ForwardNccl(inner), ok(ok_sends) {}
  const char* name() const override { return "failing-sends"; }
  int commAbort(dv::NcclComm c) override {
    ++aborts;
    if (depth > 0) ++aborts_in_open_group;
    return in.commAbort(c);
  }
  int groupStart() override {
    ++depth;
    return in.groupStart();
  }
  int groupEnd() override {
    --depth;
    return in.groupEnd();
  }
  int send(const void* b, size_t bytes, int peer, dv::NcclComm c, dv::Stream s) override {
    if (sends++ >= ok) return dv::kNcclInvalidArgument;
    return in.send(b, bytes, peer, c, s);
  }

  const int ok;
  int sends = 0, depth = 0;  // rank 0's thread only
  std::atomic<int> aborts{0}, aborts_in_open_group{0};
};

// The fake's NCCL whose ncclCommAbort and ncclCommDestroy block until release(), as real NCCL's
// can for good when a peer is gone (NVIDIA/nccl#992, #1777).
struct BlockingTeardown : ForwardNccl {
  using ForwardNccl::ForwardNccl;
  int commAbort(dv::NcclComm c) override {
    hold();
    return in.commAbort(c);
  }
  int commDestroy(dv::NcclComm c) override {
    hold();
    return in.commDestroy(c);
  }
  void hold() {
    std::unique_lock<std::mutex> lk(mu);
    ++entered;
    cv.wait_for(lk, std::chrono::seconds(30), [&] { return released; });  // bounded: a test bug must not hang
    ++returned;
    cv.notify_all();
  }
  void release() {
    std::lock_guard<std::mutex> g(mu);
    released = true;
    cv.notify_all();
  }
  // Waits (at most `limit`) until `n` held calls have returned; how many have.
  int waitReturned(int n, milliseconds limit) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait_for(lk, limit, [&] { return returned >= n; });
    return returned;
  }

  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  int entered = 0, returned = 0;
};

TEST_CASE("device: a blocked ncclCommAbort or ncclCommDestroy holds its caller at most the teardown limit",
          "[device]") {
  const milliseconds old = tp::teardownLimit();
  tp::setTeardownLimit(milliseconds(200));
  for (bool abort_first : {true, false}) {  // abort(): ncclCommAbort; else the idle link's ncclCommDestroy
    CAPTURE(abort_first);
    dv::FakeDevice dev;
    BlockingTeardown api(dev.nccl());
    MemStore store;
    dv::Stream stream{};
    REQUIRE(dev.cuda().streamCreate(&stream) == dv::kCudaSuccess);
    const auto id = tp::shareNcclUniqueId(api, store, "xirang/test/0/nccl_uid", 0, after(milliseconds(5000)));
    auto link = std::make_unique<tp::NcclLink>(api, dev.cuda(), tp::initNcclComm(api, id, 0, 1, after(milliseconds(5000)), "test"),
                                               0, 1, stream);
    const auto t0 = xirang_test::Clock::now();
    if (abort_first) link->abort("test");
    link.reset();  // after an abort: no second NCCL call
    const auto held = xirang_test::Clock::now() - t0;
    CHECK(held >= milliseconds(150));
    CHECK(held < milliseconds(3000));
    {
      std::lock_guard<std::mutex> g(api.mu);
      CHECK(api.entered == 1);  // the call was made once, and it is still blocked
      CHECK(api.returned == 0);
    }
    api.release();  // the left-behind thread finishes before the fake goes away
    CHECK(api.waitReturned(1, milliseconds(5000)) == 1);
    (void)dev.cuda().streamDestroy(stream);
  }
  tp::setTeardownLimit(old);
}

TEST_CASE("device: an NCCL call failing inside a group aborts the communicator only after the group's end",
          "[device]") {
  for (int ok_sends : {0, 1}) {  // the header round's send, or the first data send
    CAPTURE(ok_sends);
    dv::FakeDevice dev;
    FailingSends failing(dev.nccl(), ok_sends);
    MemStore store;
    const int n = 2;
    std::vector<dv::Stream> streams(n);
    std::vector<std::unique_ptr<xirang::algo::DeviceReducer>> reducers(n);
    std::vector<std::unique_ptr<tp::NcclLink>> links(n);
    std::vector<std::string> what(n);
    runRanks(n, [&](int r) {
      dv::NcclApi& api = r == 0 ? static_cast<dv::NcclApi&>(failing) : dev.nccl();
      if (dev.cuda().streamCreate(&streams[r]) != dv::kCudaSuccess) throw std::runtime_error("streamCreate");
      reducers[r] = std::make_unique<xirang::algo::DeviceReducer>(dev.cuda(), dev.kernels(), streams[r]);
      const auto id = tp::shareNcclUniqueId(api, store, "xirang/test/0/nccl_uid", r, after(milliseconds(10000)));
      links[r] = std::make_unique<tp::NcclLink>(api, dev.cuda(),
                                                tp::initNcclComm(api, id, r, n, after(milliseconds(10000)), "test"),
                                                r, n, streams[r]);
      const int64_t count = 4096;
      void* p = nullptr;
      dev.cuda().malloc(&p, count * 4);
      std::memset(p, 0, count * 4);
      Comm c = xirang_test::commOver(links[r].get(), r, n, {});
      c.reducer = reducers[r].get();
      c.small_bytes = 0;
      try {
        xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, count, 1, 5000), p, count,
                            DType::Float32, ReduceOp::Sum);
        links[r]->synchronize(after(milliseconds(5000)));
        what[r] = "(no error)";
      } catch (const std::exception& e) {
        what[r] = e.what();
      }
    });
    CAPTURE(what[0], what[1]);
    CHECK(what[0].find("ncclSend") != std::string::npos);
    CHECK(what[1] != "(no error)");
    CHECK(failing.aborts.load() >= 1);
    CHECK(failing.aborts_in_open_group.load() == 0);
    links.clear();
    reducers.clear();
    for (auto s : streams) (void)dev.cuda().streamDestroy(s);
  }
}

// Two ranks of group G allreducing 100 and 99 elements: what each op ended with (a MismatchError's
// message, "other: ..." for another error, "(no error)").
template <class G>
std::vector<std::string> disagreeOnNumel(G& g) {
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
  return what;
}

TEST_CASE("device: ranks disagreeing about the operation get a MismatchError naming it", "[device]") {
  DeviceGroup g(2);
  const auto what = disagreeOnNumel(g);
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
      xirang::allreduceEFDirect(c, ctx, x.data(), ra.data(), rb.data(), count, xirang::codec::Wire::BF16);
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

// ---------------------------------------------------------------- the staged link (no NCCL)

TEST_CASE("staged: every collective over StagedLink + DeviceReducer gives the in-process engine's bits, WS 1-6",
          "[device][staged]") {
  const int n = GENERATE(1, 2, 3, 4, 6);
  CAPTURE(n);
  Results host, device;
  runBoth<StagedGroup>(n, allCollectives, host, device);
  REQUIRE(!host[0].empty());
  requireSame(host, device);
}

TEST_CASE("staged: only the wire format crosses to the host: the bf16 error-feedback op moves half the fp32 bytes",
          "[device][staged]") {
  const int n = 3;
  const int64_t count = 30001;
  StagedGroup g(n);
  std::vector<uint64_t> fp32_bytes(n), ef_bytes(n), host_bytes(n);
  g.run([&](int r) {
    std::vector<void*> mem;
    auto alloc = [&](size_t b) {
      void* p = nullptr;
      if (g.dev.cuda().malloc(&p, b) != dv::kCudaSuccess) throw std::runtime_error("fake cudaMalloc");
      std::memset(p, 0, b);
      mem.push_back(p);
      return static_cast<float*>(p);
    };
    float* x = alloc(count * 4);
    float* r_in = alloc(count * 4);
    float* r_out = alloc(count * 4);
    for (int64_t i = 0; i < count; ++i) x[i] = static_cast<float>((i % 101) - 50) * 0.37f * (r + 1);
    Comm c = g.comm(r);
    c.small_bytes = 0;
    c.algo = Comm::Algo::Ring;
    const uint64_t h0 = g.host.hub.link(r).payloadBytesSent(), s0 = g.links[r]->payloadBytesSent();
    xirang::allreduceOp(c, ctxFor(tp::OpKind::Allreduce, DType::Float32, ReduceOp::Sum, count, 1), x, count,
                        DType::Float32, ReduceOp::Sum);
    g.links[r]->synchronize(after(milliseconds(20000)));
    const uint64_t s1 = g.links[r]->payloadBytesSent();
    xirang::collectivesFor(c).allreduceEF(c, ctxFor(tp::OpKind::AllreduceEF, DType::Float32, ReduceOp::Avg, count, 2),
                                          x, r_in, r_out, count, xirang::codec::Wire::BF16);
    g.links[r]->synchronize(after(milliseconds(20000)));
    fp32_bytes[r] = s1 - s0;
    ef_bytes[r] = g.links[r]->payloadBytesSent() - s1;
    host_bytes[r] = g.host.hub.link(r).payloadBytesSent() - h0;
    for (void* p : mem) (void)g.dev.cuda().free(p);
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r, fp32_bytes[r], ef_bytes[r], host_bytes[r]);
    CHECK(host_bytes[r] == fp32_bytes[r] + ef_bytes[r]);  // what crossed is what the algorithm sent
    CHECK(fp32_bytes[r] > 0);
    // Both rings send 2(N-1)/N of the message per rank, chunk by chunk: 4 vs 2 bytes an element.
    CHECK(ef_bytes[r] * 2 == fp32_bytes[r]);
  }
}

TEST_CASE("staged: a rank aborting mid-op makes the others fail, not hang", "[device][staged]") {
  StagedGroup g(3);
  // A rank whose op failed aborts its link, as the backend's poison does.
  const auto what = abortMidOp(g, [&g](int r, const std::string& w) { g.links[r]->abort("rank failed: " + w); });
  CHECK((what[0].find("rank 1") != std::string::npos || what[2].find("rank 1") != std::string::npos));
}

TEST_CASE("staged: ranks disagreeing about the operation get the host link's MismatchError", "[device][staged]") {
  StagedGroup g(2);
  const auto what = disagreeOnNumel(g);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r, what[r]);
    CHECK(what[r].find("element count mismatch") != std::string::npos);
  }
}

TEST_CASE("staged: an interrupt ends a wait for the stream at once", "[device][staged]") {
  StagedGroup g(1);
  std::atomic<bool> release{false};
  g.dev.enqueueHostWork(g.streams[0], [&] {  // a kernel that runs until released
    while (!release.load()) std::this_thread::sleep_for(milliseconds(1));
  });
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(100));
    g.links[0]->interrupt("the group was poisoned");
  });
  const auto t0 = xirang_test::Clock::now();
  std::string what;
  try {
    g.links[0]->synchronize(after(milliseconds(10000)));
  } catch (const tp::TransportError& e) {
    what = e.what();
  }
  t.join();
  release = true;
  CHECK(what == "the group was poisoned");
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(5000));
}

// XIRANG_CUDA_TRANSPORT=auto's NCCL-or-host choice (nccl_link.h: chooseNccl, agreeOnNccl).
TEST_CASE("auto transport: NCCL only when every rank is auto, loaded NCCL and has a GPU of its own", "[device]") {
  using C = tp::NcclCandidate;
  auto gpus = [](std::vector<std::string> ids) {
    std::vector<C> v;
    for (auto& id : ids) v.push_back(C{true, "", id, "", ""});
    return v;
  };
  for (int n = 1; n <= 8; ++n) {
    std::vector<std::string> ids;
    for (int r = 0; r < n; ++r) ids.push_back("GPU-" + std::to_string(r));
    const auto c = tp::chooseNccl(gpus(ids));
    CAPTURE(n, c.why);
    CHECK(c.nccl);
    CHECK(c.why.find(std::to_string(n) + " ranks has a GPU of its own") != std::string::npos);
  }
  // two ranks on one GPU (four ranks on two GPUs: the first pair found, in rank order)
  auto shared = tp::chooseNccl(gpus({"GPU-a", "GPU-b", "GPU-b", "GPU-a"}));
  CHECK_FALSE(shared.nccl);
  CHECK(shared.why == "rank 1 and rank 2 share GPU GPU-b (NCCL refuses two ranks on one GPU)");
  // a rank that set host or mirror
  auto v = gpus({"GPU-a", "GPU-b", "GPU-c"});
  v[2].automatic = false;
  auto host = tp::chooseNccl(v);
  CHECK_FALSE(host.nccl);
  CHECK(host.why == "rank 2 has XIRANG_CUDA_TRANSPORT=host or mirror");
  // a rank without NCCL
  v = gpus({"GPU-a", "GPU-b"});
  v[1].unavailable = "dlopen(libnccl.so.2) failed";
  auto missing = tp::chooseNccl(v);
  CHECK_FALSE(missing.nccl);
  CHECK(missing.why == "rank 1 cannot use NCCL: dlopen(libnccl.so.2) failed");
  // NCCL versions that differ (NCCL refuses them at init)
  v = gpus({"GPU-a", "GPU-b", "GPU-c"});
  for (auto& c : v) c.version = "2.27.3";
  v[2].version = "2.21.5";
  auto versions = tp::chooseNccl(v);
  CHECK_FALSE(versions.nccl);
  CHECK(versions.why == "rank 0 loaded NCCL 2.27.3, rank 2 NCCL 2.21.5 (NCCL refuses ranks of different versions)");
  // two MIG instances of one GPU: UUIDs of their own, one host and PCI bus id (NCCL's duplicate test)
  v = gpus({"MIG-a", "MIG-b"});
  v[0].where = v[1].where = "node7/0000:17:00.0";
  auto mig = tp::chooseNccl(v);
  CHECK_FALSE(mig.nccl);
  CHECK(mig.why == "rank 0 and rank 1 share GPU node7/0000:17:00.0 (NCCL refuses two ranks on one GPU)");
  v[1].where = "node8/0000:17:00.0";  // the same bus id on another host is another GPU
  CHECK(tp::chooseNccl(v).nccl);
  // a rank that named no GPU
  v = gpus({"", "GPU-b"});
  CHECK(tp::chooseNccl(v).why == "rank 0 named no GPU");
  CHECK_FALSE(tp::chooseNccl(v).nccl);
}

TEST_CASE("auto transport: the store round gives every auto rank the same choice, WS 1-6", "[device]") {
  for (int n = 1; n <= 6; ++n) {
    for (int variant = 0; variant < 4; ++variant) {
      // 0: own GPUs; 1: the last two share one; 2: rank 0 set host; 3: the last rank lacks NCCL
      MemStore store;
      std::vector<tp::NcclChoice> got(static_cast<size_t>(n));
      std::vector<tp::NcclCandidate> in;
      for (int r = 0; r < n; ++r) in.push_back(tp::NcclCandidate{true, "", "GPU|" + std::to_string(r), "", ""});
      if (variant == 1 && n > 1) in[static_cast<size_t>(n - 1)].gpu = in[static_cast<size_t>(n - 2)].gpu;
      if (variant == 2) in[0].automatic = false;
      if (variant == 3) in[static_cast<size_t>(n - 1)].unavailable = "too old: 2.17 | needs 2.19";
      runRanks(n, [&](int r) {
        // ranks arrive late in reverse order: the reads wait
        std::this_thread::sleep_for(milliseconds(5 * (n - r)));
        got[static_cast<size_t>(r)] =
            tp::agreeOnNccl(store, "xirang/test/0/cudadev/g", r, n, in[static_cast<size_t>(r)], after(milliseconds(10000)));
      });
      const bool want = variant == 0 || (variant == 1 && n == 1);
      for (int r = 0; r < n; ++r) {
        CAPTURE(n, variant, r, got[static_cast<size_t>(r)].why);
        CHECK(got[static_cast<size_t>(r)].nccl == want);
        if (in[static_cast<size_t>(r)].automatic) CHECK(got[static_cast<size_t>(r)].why == got[static_cast<size_t>(n - 1)].why);
      }
      if (variant == 3)
        CHECK(got[0].why == "rank " + std::to_string(n - 1) + " cannot use NCCL: too old: 2.17 | needs 2.19");
      if (variant == 1 && n > 1)
        CHECK(got[0].why.find("rank " + std::to_string(n - 2) + " and rank " + std::to_string(n - 1) + " share GPU") !=
              std::string::npos);
    }
  }
}

TEST_CASE("auto transport: a rank that never says ends in a TimeoutError naming it; a garbled record means host",
          "[device]") {
  MemStore store;
  const tp::NcclCandidate mine{true, "", "GPU-0", "", ""};
  std::string what;
  const auto t0 = xirang_test::Clock::now();
  try {
    (void)tp::agreeOnNccl(store, "k", 0, 3, mine, after(milliseconds(200)));
  } catch (const tp::TimeoutError& e) {
    what = e.what();
  }
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(5000));
  CHECK(what.find("rank 1 did not say whether it can use NCCL") != std::string::npos);
  CHECK(what.find("XIRANG_CUDA_TRANSPORT=host") != std::string::npos);

  // a peer found gone (the group's TCP transport: closed connection, exit note) ends the wait at once
  {
    MemStore s1;
    s1.set("k/1", "xirang-nccl-candidate 2|1|GPU-1|||");  // rank 1 said; rank 2 died before saying
    std::string gone_what;
    int gone_peer = -1;
    std::vector<int> asked;
    const auto t1 = xirang_test::Clock::now();
    try {
      (void)tp::agreeOnNccl(s1, "k", 0, 3, mine, after(milliseconds(20000)), [&](int peer) {
        asked.push_back(peer);
        return peer == 2 && asked.size() >= 3 ? std::string("rank 2 closed its connection to this rank") : std::string();
      });
    } catch (const tp::TimeoutError&) {
      gone_what = "timeout";
    } catch (const tp::TransportError& e) {
      gone_what = e.what();
      gone_peer = e.peer();
    }
    CHECK(xirang_test::Clock::now() - t1 < milliseconds(5000));
    CHECK(gone_what == "rank 2 closed its connection to this rank (waiting for rank 2 to say whether it can use NCCL)");
    CHECK(gone_peer == 2);
    CHECK(std::find(asked.begin(), asked.end(), 1) == asked.end());  // rank 1's record was there: not asked
  }

  for (const std::string& bad : {std::string(""), std::string("xirang-nccl-candidate 2|"),
                                std::string("xirang-nccl-candidate 2|2|GPU-1|||"), std::string("xirang-nccl-candidate 2|1|GPU-1||"),
                                std::string("xirang-nccl-candidate 1|1|GPU-1|"),  // the record's first version
                                std::string("something else entirely"), std::string(5000, 'x')}) {
    MemStore s2;
    s2.set("k/1", bad);
    const auto c = tp::agreeOnNccl(s2, "k", 0, 2, mine, after(milliseconds(1000)));
    CAPTURE(bad.size());
    CHECK_FALSE(c.nccl);
    CHECK(c.why.find("rank 1 cannot use NCCL: its record (" + std::to_string(bad.size()) + " bytes) did not parse") !=
          std::string::npos);
  }
  // the same record, well formed, is NCCL
  MemStore s3;
  s3.set("k/1", "xirang-nccl-candidate 2|1|GPU-1|||");
  CHECK(tp::agreeOnNccl(s3, "k", 0, 2, mine, after(milliseconds(1000))).nccl);
  // a rank with host or mirror says so at creation (declareNotAuto): an auto rank chooses host at once
  MemStore s4;
  CHECK_FALSE(tp::declareNotAuto(s4, "k", 1).nccl);
  const auto t2 = xirang_test::Clock::now();
  const auto c4 = tp::agreeOnNccl(s4, "k", 0, 2, mine, after(milliseconds(20000)));
  CHECK(xirang_test::Clock::now() - t2 < milliseconds(5000));
  CHECK_FALSE(c4.nccl);
  CHECK(c4.why == "rank 1 has XIRANG_CUDA_TRANSPORT=host or mirror");
}

TEST_CASE("device: a stop check ends the waits for the unique id and for the other ranks' init at once",
          "[device]") {
  dv::FakeDevice dev;
  // the others' init: rank 2 never joins; the stop check (the engine's: interrupted, the group's
  // abort note, a gone ring neighbour) says so after 200 ms, long before the 20 s deadline
  dv::NcclUniqueId id;
  dev.nccl().getUniqueId(&id);
  std::vector<std::string> what(2);
  const auto t0 = xirang_test::Clock::now();
  runRanks(2, [&](int r) {
    const auto start = xirang_test::Clock::now();
    try {
      tp::initNcclComm(dev.nccl(), id, r, 3, after(milliseconds(20000)), "stopped", [&] {
        return xirang_test::Clock::now() - start > milliseconds(200) ? std::string("rank 2 closed its connection")
                                                                      : std::string();
      });
      what[r] = "(no error)";
    } catch (const tp::TimeoutError& e) {
      what[r] = std::string("timeout: ") + e.what();
    } catch (const tp::TransportError& e) {
      what[r] = e.what();
    }
  });
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(5000));
  for (auto& w : what)
    CHECK(w == "rank 2 closed its connection (initialising NCCL communicator 'stopped' (rank " +
                   std::string(&w == &what[0] ? "0" : "1") + " of 3))");
  // the unique id: rank 0 never comes, the stop check ends rank 1's wait
  {
    MemStore store;
    std::string w;
    const auto t1 = xirang_test::Clock::now();
    try {
      tp::shareNcclUniqueId(dev.nccl(), store, "uid", 1, after(milliseconds(20000)),
                            [] { return std::string("the group was aborted: rank 0 failed"); });
    } catch (const tp::TimeoutError&) {
      w = "timeout";
    } catch (const tp::TransportError& e) {
      w = e.what();
    }
    CHECK(xirang_test::Clock::now() - t1 < milliseconds(5000));
    CHECK(w == "the group was aborted: rank 0 failed (waiting for rank 0's NCCL unique id)");
  }
  // rank 0's ncclGetUniqueId fails: it says so under the key, and rank 1 fails with it at once
  {
    struct NoUniqueId : ForwardNccl {
      using ForwardNccl::ForwardNccl;
      int getUniqueId(dv::NcclUniqueId*) override { return dv::kNcclInvalidArgument; }
    } broken(dev.nccl());
    MemStore store;
    std::vector<std::string> w(2);
    const auto t2 = xirang_test::Clock::now();
    runRanks(2, [&](int r) {
      try {
        tp::shareNcclUniqueId(r == 0 ? static_cast<dv::NcclApi&>(broken) : dev.nccl(), store, "uid", r,
                              after(milliseconds(20000)));
      } catch (const tp::TransportError& e) {
        w[static_cast<size_t>(r)] = e.what();
      }
    });
    CHECK(xirang_test::Clock::now() - t2 < milliseconds(5000));
    CHECK(w[0].rfind("ncclGetUniqueId: NCCL error", 0) == 0);
    CHECK(w[1] == "rank 0 could not make the NCCL unique id: " + w[0]);
  }
}

// XIRANG_CUDA_TRANSPORT=auto after it chose NCCL (nccl_link.h: startNcclAgreed): every rank makes
// its communicator, or every rank falls back with the same reason.
namespace {
struct StartOutcome {
  bool comm = false;
  std::string why;  // the fallback's reason, or "threw: <what>"
};

std::vector<StartOutcome> startAll(dv::FakeDevice& dev, int n, const std::function<dv::NcclApi&(int)>& api,
                                   const std::function<std::string(int)>& stop = {}, int deadline_ms = 20000) {
  MemStore store;
  std::vector<StartOutcome> out(static_cast<size_t>(n));
  runRanks(n, [&](int r) {
    try {
      tp::StopCheck s;
      if (stop) s = [&stop, r] { return stop(r); };
      const tp::NcclStart st =
          tp::startNcclAgreed(api(r), store, "xirang/test/0/nccl/g/epoch0", r, n, after(milliseconds(deadline_ms)), "g", s);
      out[static_cast<size_t>(r)] = {st.comm != nullptr, st.why};
      if (st.comm) (void)dev.nccl().commDestroy(st.comm);
    } catch (const std::exception& e) {
      out[static_cast<size_t>(r)] = {false, std::string("threw: ") + e.what()};
    }
  });
  return out;
}
}  // namespace

TEST_CASE("auto transport: every rank makes its NCCL communicator, or every rank falls back with one reason",
          "[device]") {
  dv::FakeDevice dev;
  auto fake = [&dev](int) -> dv::NcclApi& { return dev.nccl(); };
  for (int n = 1; n <= 4; ++n) {
    INFO("WS " << n);
    for (const auto& o : startAll(dev, n, fake)) {
      CHECK(o.comm);
      CHECK(o.why.empty());
    }
  }
  // rank 1's ncclCommInitRankConfig fails (its bootstrap cannot reach the others, say): the
  // others, waiting in their init for rank 1 to join, see its record and stop at once
  struct NoInit : ForwardNccl {
    using ForwardNccl::ForwardNccl;
    int commInitRankConfig(dv::NcclComm*, int, const dv::NcclUniqueId&, int, const dv::NcclConfig&) override {
      return dv::kNcclSystemError;
    }
  } no_init(dev.nccl());
  auto t0 = xirang_test::Clock::now();
  auto o = startAll(dev, 3, [&](int r) -> dv::NcclApi& { return r == 1 ? no_init : dev.nccl(); });
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(5000));  // not the 20 s deadline
  for (const auto& x : o) {
    CHECK(!x.comm);
    CHECK(x.why == o[1].why);
  }
  CHECK(o[1].why.rfind("rank 1 could not make its NCCL communicator: ncclCommInitRankConfig of NCCL communicator "
                       "'g' (rank 1 of 3): NCCL error 2",
                       0) == 0);
  // rank 0's ncclGetUniqueId fails: rank 0's own reason on every rank
  struct NoUniqueId : ForwardNccl {
    using ForwardNccl::ForwardNccl;
    int getUniqueId(dv::NcclUniqueId*) override { return dv::kNcclInternalError; }
  } no_uid(dev.nccl());
  t0 = xirang_test::Clock::now();
  o = startAll(dev, 3, [&](int r) -> dv::NcclApi& { return r == 0 ? no_uid : dev.nccl(); });
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(5000));
  for (const auto& x : o) {
    CHECK(!x.comm);
    CHECK(x.why.rfind("rank 0 could not make its NCCL communicator: ncclGetUniqueId: NCCL error 3", 0) == 0);
  }
  // every rank made its communicator, but rank 2 cannot make its link (prepare: the link's
  // buffers, cudaMallocHost out of memory): every rank falls back; the communicators that were
  // prepared are the callers' to tear down
  {
    MemStore store;
    std::vector<StartOutcome> out(3);
    std::vector<dv::NcclComm> kept(3, nullptr);
    t0 = xirang_test::Clock::now();
    runRanks(3, [&](int r) {
      const tp::NcclStart st = tp::startNcclAgreed(
          dev.nccl(), store, "xirang/test/0/nccl/p/epoch0", r, 3, after(milliseconds(20000)), "p", {},
          [&kept, r](dv::NcclComm c) {
            if (r == 2) throw std::runtime_error("cudaMallocHost: out of memory");
            kept[static_cast<size_t>(r)] = c;
          });
      out[static_cast<size_t>(r)] = {st.comm != nullptr, st.why};
    });
    CHECK(xirang_test::Clock::now() - t0 < milliseconds(5000));
    for (const auto& x : out) {
      CHECK(!x.comm);
      CHECK(x.why == "rank 2 could not make its NCCL communicator: preparing its NCCL link: cudaMallocHost: out of "
                     "memory");
    }
    CHECK(kept[0] != nullptr);
    CHECK(kept[1] != nullptr);
    for (auto c : kept)
      if (c) (void)dev.nccl().commDestroy(c);
  }
  // a group failure is no fallback: rank 2 never comes and the stop check (a gone peer) says so
  // after 300 ms, when both ranks wait in their init
  t0 = xirang_test::Clock::now();
  MemStore store;
  std::vector<std::string> threw(2);
  runRanks(2, [&](int r) {
    try {
      (void)tp::startNcclAgreed(dev.nccl(), store, "k", r, 3, after(milliseconds(20000)), "g", [t0] {
        return xirang_test::Clock::now() - t0 > milliseconds(300) ? std::string("rank 2 is gone") : std::string();
      });
    } catch (const tp::TransportError& e) {
      threw[static_cast<size_t>(r)] = e.what();
    }
  });
  CHECK(xirang_test::Clock::now() - t0 < milliseconds(5000));
  CHECK(threw[0] == "rank 2 is gone (initialising NCCL communicator 'g' (rank 0 of 3))");
  CHECK(threw[1] == "rank 2 is gone (initialising NCCL communicator 'g' (rank 1 of 3))");
}
