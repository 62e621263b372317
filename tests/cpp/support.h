// Shared helpers for the transport / collective tests (Gloo style: ranks are threads in one
// process talking over loopback).
//
// Catch2 v2 assertions are not thread-safe, so nothing here (and no rank thread) calls
// REQUIRE/CHECK: rank threads record what they saw into per-rank slots or throw, and the test
// body asserts on the main thread after the ranks have joined.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/collectives.h"
#include "core/transport/inproc.h"
#include "core/transport/tcp.h"

namespace xirang_test {

namespace tp = xirang::transport;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// In-memory, thread-safe stand-in for the c10d store.
class MemStore : public tp::Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> g(mu_);
      kv_[key] = value;
    }
    cv_.notify_all();
  }
  std::string get(const std::string& key, tp::Deadline deadline) override {
    std::unique_lock<std::mutex> g(mu_);
    if (!cv_.wait_until(g, deadline, [&] { return kv_.count(key) != 0; }))
      throw std::runtime_error("MemStore: timed out waiting for key " + key);
    return kv_.at(key);
  }
  bool check(const std::string& key) override { return has(key); }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> g(mu_);
    int64_t v = kv_.count(key) ? std::stoll(kv_[key]) : 0;
    kv_[key] = std::to_string(v + delta);
    return v + delta;
  }
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override {
    std::string out;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = kv_.find(key);
      if ((it == kv_.end() && expected.empty()) || (it != kv_.end() && it->second == expected)) kv_[key] = desired;
      out = kv_[key];
    }
    cv_.notify_all();
    return out;
  }
  bool has(const std::string& key) {
    std::lock_guard<std::mutex> g(mu_);
    return kv_.count(key) != 0;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

inline tp::Deadline after(milliseconds ms) { return Clock::now() + ms; }

// Loopback only: the tests must not depend on the host's name resolving to something bindable.
inline tp::TcpOptions loopbackOptions() {
  tp::TcpOptions o;
  o.ifname = "lo";
  o.handshake_timeout = milliseconds(5000);
  return o;
}

// Runs fn(rank) for rank in [0, n) on n threads, joins them all, and rethrows the first failure
// (the first one to be caught, which is normally the root cause).
inline void runRanks(int n, const std::function<void(int)>& fn) {
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        std::lock_guard<std::mutex> g(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// A Comm of `rank` over `link` (ring: 0..size-1 unless given).
inline xirang::Comm commOver(tp::Link* link, int rank, int size, std::vector<int> ring) {
  xirang::Comm c;
  c.link = link;
  c.rank = rank;
  if (ring.empty())
    for (int r = 0; r < size; ++r) ring.push_back(r);
  c.ring = std::move(ring);
  return c;
}

// Runs fn(rank) on one thread per rank. A rank whose fn throws aborts its own link (as the
// backend does), so peers blocked on it fail fast instead of waiting for their deadline; the
// first failure is rethrown.
inline void runAborting(int n, const std::function<tp::Link&(int)>& link, const std::function<void(int)>& fn) {
  runRanks(n, [&](int r) {
    try {
      fn(r);
    } catch (const std::exception& e) {
      link(r).abort(std::string("test rank failed: ") + e.what());
      throw;
    } catch (...) {
      link(r).abort("test rank failed");
      throw;
    }
  });
}

// n transports sharing one in-memory store. Construction is sequential (rank 0 publishes the
// group secret before the others read it), so it never blocks.
struct Group {
  std::shared_ptr<MemStore> store = std::make_shared<MemStore>();
  std::vector<std::unique_ptr<tp::Tcp>> tcp;

  explicit Group(int n, tp::TcpOptions opts = loopbackOptions()) {
    for (int r = 0; r < n; ++r)
      tcp.push_back(std::make_unique<tp::Tcp>(r, n, store, opts, after(milliseconds(10000))));
  }
  int size() const { return static_cast<int>(tcp.size()); }

  xirang::Comm comm(int rank, std::vector<int> ring = {}) const {
    return commOver(tcp[static_cast<size_t>(rank)].get(), rank, size(), std::move(ring));
  }
  void run(const std::function<void(int)>& fn) {
    runAborting(size(), [&](int r) -> tp::Link& { return *tcp[static_cast<size_t>(r)]; }, fn);
  }
};

// n ranks as threads over the in-process link (core/transport/inproc.h): no sockets, so rings of
// 1..16 ranks run in one test process.
struct InprocGroup {
  explicit InprocGroup(int n) : hub(n) {}
  int size() const { return hub.size(); }
  xirang::Comm comm(int rank, std::vector<int> ring = {}) { return commOver(&hub.link(rank), rank, size(), std::move(ring)); }
  void run(const std::function<void(int)>& fn) {
    runAborting(size(), [&](int r) -> tp::Link& { return hub.link(r); }, fn);
  }
  tp::InprocHub hub;
};

// Posts one point-to-point operation to t.p2p(); the future yields the source rank (the peer for
// a send) or rethrows what the operation failed with.
inline std::future<int> p2pPost(tp::Tcp& t, bool send, int peer, const tp::FrameHeader& h, void* data, uint64_t bytes,
                                tp::Deadline deadline) {
  auto pr = std::make_shared<std::promise<int>>();
  auto f = pr->get_future();
  auto done = [pr](std::exception_ptr e, int src) {
    if (e) pr->set_exception(e);
    else pr->set_value(src);
  };
  if (send) t.p2p().send(peer, h, data, bytes, deadline, done);
  else t.p2p().recv(peer, h, data, bytes, deadline, done);
  return f;
}
inline int p2pWait(tp::Tcp& t, bool send, int peer, const tp::FrameHeader& h, void* data, uint64_t bytes,
                   tp::Deadline deadline) {
  return p2pPost(t, send, peer, h, data, bytes, deadline).get();
}

// Deterministic per-(a, b, c) pseudo-random 64 bits (splitmix64 of a mix), so every rank can
// regenerate every other rank's input for the reference.
inline uint64_t mix(uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0) {
  uint64_t z = a * 0x9E3779B97F4A7C15ULL ^ (b + 0x632BE59BD9B4E019ULL) * 0xBF58476D1CE4E5B9ULL ^
               (c + 0x8CB92BA72F3D8DD7ULL) * 0x94D049BB133111EBULL ^ (d + 0x2545F4914F6CDD1DULL);
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
// Uniform in [0, 1).
inline double unit(uint64_t h) { return static_cast<double>(h >> 11) * 0x1p-53; }

inline uint64_t fnv1a(const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}

}  // namespace xirang_test
