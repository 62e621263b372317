// Group generations (csrc/core/generation.h): ranks are threads sharing an in-memory store that
// outlives one creation of the group, as torchrun's agent store outlives its restarts.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/collectives.h"
#include "core/generation.h"
#include "support.h"

namespace {

namespace gen = xirang::generation;
namespace tp = xirang::transport;
using std::chrono::milliseconds;
using xirang_test::after;
using xirang_test::Clock;
using xirang_test::MemStore;

// agree() on one thread per rank; rank r starts after delays[r] (if given). Returns each rank's
// generation; rethrows the first failure.
std::vector<std::string> agreeAll(MemStore& store, int n, std::vector<milliseconds> delays = {},
                                  milliseconds timeout = milliseconds(10000)) {
  std::vector<std::string> out(static_cast<size_t>(n));
  xirang_test::runRanks(n, [&](int r) {
    if (!delays.empty()) std::this_thread::sleep_for(delays[static_cast<size_t>(r)]);
    out[static_cast<size_t>(r)] = gen::agree(store, r, n, after(timeout));
  });
  return out;
}

bool isGeneration(const std::string& g) {
  if (g.size() != 16) return false;
  for (char c : g)
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

void requireAgreed(const std::vector<std::string>& gs) {
  REQUIRE(isGeneration(gs[0]));
  for (size_t r = 1; r < gs.size(); ++r) {
    INFO("rank " << r);
    CHECK(gs[r] == gs[0]);
  }
}

std::string key(const std::string& what) { return std::string(gen::kPrefix) + "/" + what; }

}  // namespace

TEST_CASE("generation: every rank of one creation learns the same fresh generation", "[generation]") {
  MemStore store;
  for (int n : {2, 3, 8}) {
    auto gs = agreeAll(store, n);
    requireAgreed(gs);
    CHECK(store.get(key("live"), after(milliseconds(100))) == gs[0]);
  }
  // Order of arrival does not matter: rank 0 last, rank 0 first.
  requireAgreed(agreeAll(store, 4, {milliseconds(50), milliseconds(0), milliseconds(10), milliseconds(0)}));
  requireAgreed(agreeAll(store, 4, {milliseconds(0), milliseconds(60), milliseconds(30), milliseconds(60)}));
}

TEST_CASE("generation: world size 1 needs no store", "[generation]") {
  MemStore store;
  const std::string a = gen::agree(store, 0, 1, after(milliseconds(100)));
  const std::string b = gen::agree(store, 0, 1, after(milliseconds(100)));
  CHECK(isGeneration(a));
  CHECK(a != b);
  CHECK_FALSE(store.has(key("live")));
  CHECK(gen::keyNamespace(a) == "xirang/" + a);
}

TEST_CASE("generation: a restart on the same store never proceeds with the previous generation", "[generation]") {
  // The previous attempt's hellos, answers and acks are all in the store; the new attempt's ranks
  // arrive in either order. Repeated: the interleavings differ from run to run.
  MemStore store;
  std::set<std::string> seen;
  std::string prev = agreeAll(store, 4)[0];
  seen.insert(prev);
  for (int attempt = 0; attempt < 6; ++attempt) {
    // Even attempts: rank 0 late (every other rank first reads its stale answer). Odd: rank 0
    // early (it first answers the stale hellos of ranks that have not started yet).
    std::vector<milliseconds> d = attempt % 2 == 0
        ? std::vector<milliseconds>{milliseconds(40), milliseconds(0), milliseconds(0), milliseconds(5)}
        : std::vector<milliseconds>{milliseconds(0), milliseconds(30), milliseconds(15), milliseconds(40)};
    auto gs = agreeAll(store, 4, d);
    requireAgreed(gs);
    CHECK(seen.count(gs[0]) == 0);  // a fresh generation every time
    seen.insert(gs[0]);
    CHECK(store.get(key("live"), after(milliseconds(100))) == gs[0]);
  }
}

TEST_CASE("generation: a partial previous attempt is ignored", "[generation]") {
  MemStore store;
  // Attempt 0 died part-way: rank 0 answered rank 1 (not rank 2) and no rank acknowledged;
  // rank 3 never said hello; rank 2's hello was never answered.
  const std::string old_g = "00000000deadbeef";
  store.set(key("hello/1"), std::string(32, 'a'));
  store.set(key("answer/1"), std::string(32, 'a') + " " + old_g);
  store.set(key("hello/2"), std::string(32, 'b'));
  store.set(key("live"), old_g);
  auto gs = agreeAll(store, 4, {milliseconds(30), milliseconds(0), milliseconds(0), milliseconds(0)});
  requireAgreed(gs);
  CHECK(gs[0] != old_g);
  CHECK(store.get(key("live"), after(milliseconds(100))) == gs[0]);
}

TEST_CASE("generation: a missing rank is a timeout naming it, on rank 0 and on the others", "[generation]") {
  SECTION("rank 0 names the ranks that never took part") {
    MemStore store;
    store.set(key("hello/2"), std::string(32, 'c'));  // a stale hello of rank 2: not taking part
    std::string what0, what1;
    std::thread r1([&] {  // answered, then done
      try {
        gen::agree(store, 1, 4, after(milliseconds(2000)));
      } catch (const std::exception& e) {
        what1 = e.what();
      }
    });
    try {
      gen::agree(store, 0, 4, after(milliseconds(300)));
    } catch (const tp::TimeoutError& e) {
      what0 = e.what();
    }
    r1.join();
    CAPTURE(what0, what1);
    CHECK(what1.empty());
    CHECK(what0.find("rank 0: ranks [2 3] of 4 did not take part") != std::string::npos);
    CHECK_FALSE(store.has(key("live")));
  }
  SECTION("a rank whose rank 0 never answers") {
    MemStore store;
    store.set(key("answer/1"), std::string(32, 'd') + " 00000000deadbeef");  // stale
    std::string what;
    const auto t0 = Clock::now();
    try {
      gen::agree(store, 1, 2, after(milliseconds(200)));
    } catch (const tp::TimeoutError& e) {
      what = e.what();
    }
    CAPTURE(what);
    CHECK(what.find("rank 1: rank 0 did not answer") != std::string::npos);
    CHECK(Clock::now() - t0 < milliseconds(2000));
  }
}

TEST_CASE("generation: a spare finds the live group's generation", "[generation]") {
  MemStore store;
  CHECK_THROWS_AS(gen::live(store, after(milliseconds(50))), tp::TimeoutError);
  auto gs = agreeAll(store, 3);
  CHECK(gen::live(store, after(milliseconds(50))) == gs[0]);
  store.set(key("live"), "garbage");
  CHECK_THROWS_AS(gen::live(store, after(milliseconds(50))), tp::TransportError);
}

TEST_CASE("generation: a restarted group's transport ignores the aborted attempt's keys", "[generation]") {
  // What torchrun's restarts do to the store: attempt 0 builds its transports, one rank aborts
  // (its abort, secret and addresses stay in the store); attempt 1's ranks must connect to each
  // other and reduce right, not read attempt 0's abort or connect to its dead addresses.
  auto store = std::make_shared<MemStore>();
  constexpr int n = 3;
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto gs = agreeAll(*store, n);
    requireAgreed(gs);
    std::vector<std::unique_ptr<tp::Tcp>> tcp(n);
    std::vector<double> sums(n, 0.0);
    xirang_test::runRanks(n, [&](int r) {
      auto opts = xirang_test::loopbackOptions();
      opts.key_prefix = gen::keyNamespace(gs[static_cast<size_t>(r)]);
      tcp[static_cast<size_t>(r)] = std::make_unique<tp::Tcp>(r, n, store, opts, after(milliseconds(10000)));
      xirang::Comm c;
      c.link = tcp[static_cast<size_t>(r)].get();
      c.rank = r;
      c.ring = {0, 1, 2};
      xirang::OpCtx ctx;
      ctx.op = tp::OpKind::Allreduce;
      ctx.dtype = xirang::DType::Float64;
      ctx.reduce = xirang::ReduceOp::Sum;
      ctx.numel = 1;
      ctx.seq = 1;
      ctx.deadline = after(milliseconds(10000));
      double v = r + 1;
      xirang::allreduce(c, ctx, &v, 1, xirang::DType::Float64, xirang::ReduceOp::Sum);
      sums[static_cast<size_t>(r)] = v;
    });
    for (int r = 0; r < n; ++r) CHECK(sums[static_cast<size_t>(r)] == 6.0);
    tcp[1]->abort("attempt " + std::to_string(attempt) + " failed");  // stays in the store
    for (auto& t : tcp) t->close();
  }
}
