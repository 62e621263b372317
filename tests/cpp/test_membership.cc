// Elastic membership agreement (csrc/core/membership.h): survivors are threads sharing an
// in-memory store; a dead rank is one that never registers and whose heartbeat never moves.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core/collectives.h"
#include "core/membership.h"
#include "core/transport/auth.h"
#include "support.h"

namespace {

namespace el = xirang::elastic;
namespace tp = xirang::transport;
using std::chrono::milliseconds;
using xirang_test::after;
using xirang_test::Clock;
using xirang_test::MemStore;

// Heartbeats of `ranks` advanced every 20 ms until `stop`.
struct Beater {
  std::atomic<bool> stop{false};
  std::thread t;
  Beater(MemStore& store, std::vector<int> ranks) {
    t = std::thread([&store, ranks, this] {
      while (!stop) {
        for (int r : ranks) store.add(el::heartbeatKey("p", r), 1);
        std::this_thread::sleep_for(milliseconds(20));
      }
    });
  }
  ~Beater() {
    stop = true;
    t.join();
  }
};

// Runs agree() for each rank in `survivors` on its own thread; returns their decisions.
std::vector<el::Decision> agreeAll(MemStore& store, const std::vector<int>& live, const std::vector<int>& survivors,
                                   const std::vector<el::Report>& reports, milliseconds stale = milliseconds(300)) {
  std::vector<el::Decision> out(survivors.size());
  xirang_test::runRanks(static_cast<int>(survivors.size()), [&](int i) {
    el::HeartbeatWatch watch(store, "p", stale);
    out[i] = el::agree(store, "p", 0, live, survivors[i], reports[i], watch, after(milliseconds(10000)));
  });
  return out;
}

}  // namespace

TEST_CASE("membership decision text round-trips and rejects garbage", "[membership]") {
  el::Decision d;
  d.epoch = 3;
  d.live = {0, 2, 5};
  d.done_seq = 41;
  d.fence = 44;
  el::Decision e = el::Decision::decode(d.encode());
  CHECK(e.epoch == 3);
  CHECK(e.live == std::vector<int>{0, 2, 5});
  CHECK(e.done_seq == 41);
  CHECK(e.fence == 44);
  CHECK_THROWS_AS(el::Decision::decode("epoch x"), std::invalid_argument);
  CHECK_THROWS_AS(el::Decision::decode("epoch 1 done 2 fence 3 live 0 zz"), std::invalid_argument);
}

TEST_CASE("survivors agree without the dead rank; done = min, fence = max", "[membership]") {
  MemStore store;
  Beater beat(store, {0, 1, 3});  // rank 2 is dead: no heartbeat, never registers
  auto t0 = Clock::now();
  auto ds = agreeAll(store, {0, 1, 2, 3}, {0, 1, 3}, {{10, 12}, {11, 11}, {10, 13}});
  double took = std::chrono::duration<double>(Clock::now() - t0).count();
  for (const auto& d : ds) {
    CHECK(d.epoch == 1);
    CHECK(d.live == std::vector<int>{0, 1, 3});
    CHECK(d.done_seq == 10);
    CHECK(d.fence == 13);
  }
  CHECK(took >= 0.25);  // waited for rank 2's heartbeat to go stale (300 ms)
  CHECK(took < 5.0);
}

TEST_CASE("two failures at once: both dropped", "[membership]") {
  MemStore store;
  Beater beat(store, {0, 2, 4});
  auto ds = agreeAll(store, {0, 1, 2, 3, 4}, {0, 2, 4}, {{5, 5}, {5, 6}, {4, 6}});
  for (const auto& d : ds) {
    CHECK(d.live == std::vector<int>{0, 2, 4});
    CHECK(d.done_seq == 4);
    CHECK(d.fence == 6);
  }
}

TEST_CASE("nobody died (a timeout): everybody stays, decided without waiting", "[membership]") {
  MemStore store;
  auto t0 = Clock::now();
  auto ds = agreeAll(store, {0, 1, 2}, {0, 1, 2}, {{7, 7}, {7, 7}, {7, 8}}, milliseconds(5000));
  CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 2.0);
  for (const auto& d : ds) CHECK(d.live == std::vector<int>{0, 1, 2});
}

TEST_CASE("a rank that dies during the agreement: survivors converge; a late rank learns it is out",
          "[membership]") {
  MemStore store;
  // Rank 1 registers, then dies (its heartbeat stops with it): it is in this decision or not,
  // but all survivors get the same one.
  store.set("p/e0/alive/1", "3 3");
  {
    Beater beat(store, {0, 2});
    auto ds = agreeAll(store, {0, 1, 2, 3}, {0, 2}, {{3, 3}, {3, 4}});
    REQUIRE(ds[0].encode() == ds[1].encode());
    CHECK(ds[0].live == std::vector<int>{0, 1, 2});  // 3 never registered and went stale
  }
  // Rank 3 comes back late: the decision stands and does not contain it.
  el::HeartbeatWatch watch(store, "p", milliseconds(300));
  el::Decision late = el::agree(store, "p", 0, {0, 1, 2, 3}, 3, {3, 3}, watch, after(milliseconds(2000)));
  CHECK(late.live == std::vector<int>{0, 1, 2});
}

TEST_CASE("the failure report keeps the first reason", "[membership]") {
  MemStore store;
  CHECK(el::reportFailure(store, "p", 4, "rank 2 closed") == "rank 2 closed");
  CHECK(el::reportFailure(store, "p", 4, "timeout") == "rank 2 closed");
  CHECK(store.has(el::failKey("p", 4)));
  CHECK_FALSE(store.has(el::failKey("p", 5)));
}

TEST_CASE("derived epoch keys differ per epoch and from the group key", "[membership]") {
  tp::Key128 k = tp::randomKey();
  auto k1 = tp::deriveKey(k, 1), k2 = tp::deriveKey(k, 2);
  CHECK(k1 == tp::deriveKey(k, 1));
  CHECK(k1 != k2);
  CHECK(k1 != k);
}

TEST_CASE("a later epoch's transport admits only its live members", "[membership]") {
  auto store = std::make_shared<MemStore>();
  tp::TcpOptions o = xirang_test::loopbackOptions();
  o.key = tp::deriveKey(tp::randomKey(), 1);
  o.members = {0, 2};
  o.key_prefix = "e1";
  std::vector<std::unique_ptr<tp::Tcp>> t;
  for (int r = 0; r < 3; ++r) t.push_back(std::make_unique<tp::Tcp>(r, 3, store, o, after(milliseconds(5000))));
  // Members 0 and 2 talk; rank 1 (declared dead, though it knows the key) is refused.
  std::vector<uint8_t> out(64, 7), in0(64, 0), in2(64, 0);
  xirang_test::runRanks(2, [&](int i) {
    const int me = i == 0 ? 0 : 2, peer = i == 0 ? 2 : 0;
    tp::FrameHeader h;
    h.op = tp::OpKind::Allreduce;
    h.seq = 1;
    std::vector<tp::SendJob> s{{peer, h, {{out.data(), out.size()}}}};
    std::vector<tp::RecvJob> rv{{peer, h, {{(i == 0 ? in0 : in2).data(), 64}}, nullptr}};
    t[me]->exchange(s, rv, after(milliseconds(5000)));
  });
  CHECK(in0 == out);
  CHECK(in2 == out);
  CHECK_THROWS_AS(t[1]->connectPeer(0, after(milliseconds(1500))), tp::TransportError);
}

TEST_CASE("a watch that adopts another's observations calls a long-silent rank stale at once", "[membership]") {
  MemStore store;
  store.add(el::heartbeatKey("p", 1), 1);
  el::HeartbeatWatch seen_before(store, "p", milliseconds(200));
  CHECK_FALSE(seen_before.stale(1));  // first observation
  std::this_thread::sleep_for(milliseconds(250));
  el::HeartbeatWatch fresh(store, "p", milliseconds(200));
  CHECK_FALSE(fresh.stale(1));  // a fresh watch has no history: not stale yet
  el::HeartbeatWatch adopted(store, "p", milliseconds(200));
  adopted.adopt(seen_before);
  CHECK(adopted.stale(1));  // silent for 250 ms as the older watch saw it
  store.add(el::heartbeatKey("p", 1), 1);
  CHECK_FALSE(adopted.stale(1));  // it beat again
}
