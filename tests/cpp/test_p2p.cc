// Point-to-point engine (csrc/core/transport/p2p.h) between threads of one process over
// loopback: matching by source and tag, the queue of early messages and its bounds, peers that
// leave, and what a hostile (but authenticated) peer can make it do.
#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "core/transport/auth.h"
#include "core/transport/frame.h"
#include "core/transport/tcp.h"
#include "support.h"

namespace {

namespace tp = xirang::transport;
using xirang::DType;
using xirang_test::after;
using xirang_test::Clock;
using xirang_test::Group;
using xirang_test::MemStore;
using xirang_test::p2pPost;
using xirang_test::p2pWait;
using std::chrono::milliseconds;

double secondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

tp::FrameHeader p2pHeader(uint32_t tag, uint64_t numel, DType dt = DType::Bytes) {
  tp::FrameHeader h;
  h.op = tp::OpKind::Send;
  h.dtype = dt;
  h.tag = tag;
  h.op_numel = numel;
  return h;
}

std::string what(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Connects to `address` as group member `me` on the point-to-point channel (the documented
// handshake, auth.h), with the group id and secret from the store. Returns a blocking fd.
int fakeP2PMember(MemStore& store, const std::string& address, int me, int server) {
  const tp::Key128 key = tp::keyFromHex(store.get("xirang/secret", after(milliseconds(2000))));
  const uint64_t group = std::stoull(store.get("xirang/group_id", after(milliseconds(2000))), nullptr, 16);
  int fd = tp::connectTo(address, after(milliseconds(3000)), server);
  tp::Hello h;
  h.version = tp::kWireVersion;
  h.channel = tp::Channel::P2P;
  h.rank = me;
  h.nonce = 0xfeed;
  uint8_t buf[tp::kHelloBytes];
  tp::encodeHello(h, buf);
  if (::send(fd, buf, sizeof(buf), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(buf))) throw std::runtime_error("hello");
  uint64_t reply[2];
  if (::recv(fd, reply, sizeof(reply), MSG_WAITALL) != 16) throw std::runtime_error("no server reply");
  if (reply[1] != tp::serverMac(key, group, tp::Channel::P2P, h.nonce, reply[0], server, me))
    throw std::runtime_error("server MAC");
  uint64_t cmac = tp::clientMac(key, group, tp::Channel::P2P, reply[0], h.nonce, me, server);
  if (::send(fd, &cmac, 8, MSG_NOSIGNAL) != 8) throw std::runtime_error("client MAC");
  return fd;
}

void sendFrame(int fd, tp::FrameHeader h, const void* payload, size_t bytes) {
  uint8_t hb[tp::kHeaderBytes];
  tp::encodeHeader(h, hb);
  if (::send(fd, hb, sizeof(hb), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(hb))) throw std::runtime_error("header");
  if (bytes && ::send(fd, payload, bytes, MSG_NOSIGNAL) != static_cast<ssize_t>(bytes)) throw std::runtime_error("payload");
}

long statusKb(const char* field) {  // from /proc/self/status, e.g. "VmHWM:"
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field, 0) == 0) return std::stol(line.substr(std::strlen(field)));
  return -1;
}

}  // namespace

TEST_CASE("p2p: messages are matched by tag, out of order via the queue", "[p2p]") {
  Group g(2);
  std::vector<uint32_t> got(3, 0);
  std::vector<int> any(2, -1);
  g.run([&](int r) {
    if (r == 1) {
      uint32_t a = 55, b = 66, c = 77;
      auto fa = p2pPost(*g.tcp[1], true, 0, p2pHeader(5, 1), &a, 4, after(milliseconds(5000)));
      auto fb = p2pPost(*g.tcp[1], true, 0, p2pHeader(6, 1), &b, 4, after(milliseconds(5000)));
      auto fc = p2pPost(*g.tcp[1], true, 0, p2pHeader(7, 1), &c, 4, after(milliseconds(5000)));
      fa.get(), fb.get(), fc.get();
      return;
    }
    // Receive tag 6 first: tag 5 arrives ahead of it and is queued.
    p2pWait(*g.tcp[0], false, 1, p2pHeader(6, 1), &got[1], 4, after(milliseconds(5000)));
    any[0] = p2pWait(*g.tcp[0], false, -1, p2pHeader(5, 1), &got[0], 4, after(milliseconds(2000)));  // queued
    any[1] = p2pWait(*g.tcp[0], false, -1, p2pHeader(7, 1), &got[2], 4, after(milliseconds(2000)));
  });
  CHECK(got == std::vector<uint32_t>{55, 66, 77});
  CHECK(any == std::vector<int>{1, 1});
}

TEST_CASE("p2p: a size mismatch on a queued message is reported", "[p2p]") {
  Group g(2);
  std::string msg;
  xirang_test::runRanks(2, [&](int r) {
    uint64_t a = 1, b = 2;
    if (r == 1) {
      auto fa = p2pPost(*g.tcp[1], true, 0, p2pHeader(5, 2), &a, 8, after(milliseconds(5000)));
      auto fb = p2pPost(*g.tcp[1], true, 0, p2pHeader(6, 1), &b, 8, after(milliseconds(5000)));
      fa.get(), fb.get();
      return;
    }
    uint64_t x = 0, y = 0;
    p2pWait(*g.tcp[0], false, 1, p2pHeader(6, 1), &y, 8, after(milliseconds(5000)));
    msg = what([&] { p2pWait(*g.tcp[0], false, 1, p2pHeader(5, 1), &x, 8, after(milliseconds(5000))); });  // sender said 2
  });
  CAPTURE(msg);
  CHECK(msg.find("element count mismatch: this rank 1, rank 1 2") != std::string::npos);
}

TEST_CASE("p2p: a receive from any source finds a tag queued behind another tag's message", "[p2p]") {
  Group g(2);
  int src = -1;
  uint32_t got = 0;
  std::string msg;
  g.run([&](int r) {
    if (r == 1) {
      uint32_t a = 55, b = 66;
      auto fa = p2pPost(*g.tcp[1], true, 0, p2pHeader(5, 1), &a, 4, after(milliseconds(5000)));
      auto fb = p2pPost(*g.tcp[1], true, 0, p2pHeader(6, 1), &b, 4, after(milliseconds(5000)));
      fa.get(), fb.get();
      return;
    }
    std::this_thread::sleep_for(milliseconds(100));  // both messages have arrived
    msg = what([&] { src = p2pWait(*g.tcp[0], false, -1, p2pHeader(6, 1), &got, 4, after(milliseconds(500))); });
  });
  CAPTURE(msg);
  CHECK(src == 1);
  CHECK(got == 66);
}

TEST_CASE("p2p: any source returns the rank whose message is waiting; nothing waiting times out", "[p2p]") {
  Group g(3);
  std::vector<int> sources;
  std::vector<uint32_t> values;
  double idle_timeout_s = -1;
  std::string idle_what;
  g.run([&](int r) {
    if (r == 0) {
      const auto t0 = Clock::now();
      uint32_t v0 = 0;
      idle_what = what([&] { p2pWait(*g.tcp[0], false, -1, p2pHeader(9, 1), &v0, 4, t0 + milliseconds(300)); });
      idle_timeout_s = secondsSince(t0);
      // Rank 2 sends first, then rank 1 (ordered through the store).
      g.store->set("go2", "1");
      for (int k = 0; k < 2; ++k) {
        uint32_t v = 0;
        sources.push_back(p2pWait(*g.tcp[0], false, -1, p2pHeader(9, 1), &v, 4, after(milliseconds(5000))));
        values.push_back(v);
        if (k == 0) g.store->set("go1", "1");
      }
    } else {
      g.store->get(r == 2 ? "go2" : "go1", after(milliseconds(10000)));
      uint32_t v = 100 + static_cast<uint32_t>(r);
      p2pWait(*g.tcp[r], true, 0, p2pHeader(9, 1), &v, 4, after(milliseconds(5000)));
    }
  });
  CAPTURE(idle_what);
  CHECK(idle_what.find("timed out") != std::string::npos);
  CHECK(idle_timeout_s >= 0.3);
  CHECK(idle_timeout_s <= 1.3);
  CHECK(sources == std::vector<int>{2, 1});
  CHECK(values == std::vector<uint32_t>{102, 101});
}

TEST_CASE("p2p: a receive posted before the send, both ways at once, 32 MiB", "[p2p]") {
  Group g(2);
  const size_t n = size_t{32} << 20;
  std::vector<std::vector<uint8_t>> rx(2, std::vector<uint8_t>(n, 0));
  g.run([&](int r) {
    std::vector<uint8_t> tx(n);
    for (size_t i = 0; i < n; ++i) tx[i] = static_cast<uint8_t>(xirang_test::mix(r, i));
    auto fr = p2pPost(*g.tcp[r], false, 1 - r, p2pHeader(0, n), rx[r].data(), n, after(milliseconds(20000)));
    p2pWait(*g.tcp[r], true, 1 - r, p2pHeader(0, n), tx.data(), n, after(milliseconds(20000)));
    fr.get();
  });
  for (int r = 0; r < 2; ++r) {
    bool ok = true;
    for (size_t i = 0; i < n && ok; ++i) ok = rx[r][i] == static_cast<uint8_t>(xirang_test::mix(1 - r, i));
    CHECK(ok);
  }
}

TEST_CASE("p2p: rings of sends and receives at world sizes 1..8 in either order", "[p2p]") {
  const int n = GENERATE(2, 3, 5, 8);
  const bool recv_first = GENERATE(true, false);
  Group g(n);
  std::vector<std::vector<uint32_t>> got(n, std::vector<uint32_t>(1000, 0));
  g.run([&](int r) {
    std::vector<uint32_t> mine(1000);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<uint32_t>(r * 100000 + i);
    const int right = (r + 1) % n, left = (r + n - 1) % n;
    std::future<int> fr, fs;
    auto post_r = [&] { fr = p2pPost(*g.tcp[r], false, left, p2pHeader(3, 1000, DType::Int32), got[r].data(), 4000, after(milliseconds(10000))); };
    auto post_s = [&] { fs = p2pPost(*g.tcp[r], true, right, p2pHeader(3, 1000, DType::Int32), mine.data(), 4000, after(milliseconds(10000))); };
    if (recv_first) post_r(), post_s();
    else post_s(), post_r();
    fs.get();
    if (fr.get() != left) throw std::runtime_error("wrong source");
  });
  for (int r = 0; r < n; ++r) {
    const int left = (r + n - 1) % n;
    CHECK(got[r][0] == static_cast<uint32_t>(left * 100000));
    CHECK(got[r][999] == static_cast<uint32_t>(left * 100000 + 999));
  }
}

TEST_CASE("p2p: a full queue holds the sender back instead of failing, and drains", "[p2p]") {
  tp::TcpOptions o = xirang_test::loopbackOptions();
  o.p2p_limits.max_queued_messages = 4;
  o.p2p_limits.max_queued_bytes = 1 << 20;
  Group g(2, o);
  std::string timeout_what;
  std::vector<uint32_t> got(7, 0);
  g.run([&](int r) {
    if (r == 1) {
      std::vector<uint32_t> v{10, 11, 12, 13, 14, 15};
      std::vector<std::future<int>> fs;
      for (auto& x : v) fs.push_back(p2pPost(*g.tcp[1], true, 0, p2pHeader(1, 1), &x, 4, after(milliseconds(10000))));
      uint32_t last = 99;
      fs.push_back(p2pPost(*g.tcp[1], true, 0, p2pHeader(2, 1), &last, 4, after(milliseconds(10000))));
      for (auto& f : fs) f.get();
      return;
    }
    std::this_thread::sleep_for(milliseconds(200));
    // Four tag-1 messages are queued; the fifth waits on the socket, the tag-2 one behind it.
    timeout_what = what([&] { p2pWait(*g.tcp[0], false, 1, p2pHeader(2, 1), &got[6], 4, after(milliseconds(300))); });
    if (g.tcp[0]->p2p().counters().queued_messages != 4) throw std::runtime_error("queue should hold 4");
    for (int i = 0; i < 6; ++i) p2pWait(*g.tcp[0], false, 1, p2pHeader(1, 1), &got[i], 4, after(milliseconds(3000)));
    p2pWait(*g.tcp[0], false, 1, p2pHeader(2, 1), &got[6], 4, after(milliseconds(3000)));
  });
  CAPTURE(timeout_what);
  CHECK(timeout_what.find("timed out") != std::string::npos);
  CHECK(timeout_what.find("waiting for their receives") != std::string::npos);
  CHECK(got == std::vector<uint32_t>{10, 11, 12, 13, 14, 15, 99});
}

TEST_CASE("p2p: 50,000 queued empty messages ahead of the wanted tag", "[p2p]") {
  Group g(2);
  uint32_t got = 0;
  int src = -1;
  size_t queued = 0;
  g.run([&](int r) {
    const int k = 50000;
    if (r == 0) {
      std::vector<std::future<int>> fs;
      fs.reserve(k + 1);
      for (int i = 0; i < k; ++i) fs.push_back(p2pPost(*g.tcp[0], true, 1, p2pHeader(1, 0), nullptr, 0, after(milliseconds(60000))));
      uint32_t v = 4242;
      fs.push_back(p2pPost(*g.tcp[0], true, 1, p2pHeader(2, 1), &v, 4, after(milliseconds(60000))));
      for (auto& f : fs) f.get();
      return;
    }
    src = p2pWait(*g.tcp[1], false, -1, p2pHeader(2, 1), &got, 4, after(milliseconds(60000)));
    queued = g.tcp[1]->p2p().counters().queued_messages;
    for (int i = 0; i < k; ++i) p2pWait(*g.tcp[1], false, 0, p2pHeader(1, 0), nullptr, 0, after(milliseconds(60000)));
  });
  CHECK(src == 0);
  CHECK(got == 4242);
  CHECK(queued == 50000);
}

TEST_CASE("p2p: a header claiming 1 GiB allocates with the bytes that arrive", "[p2p][security]") {
  auto store = std::make_shared<MemStore>();
  tp::Tcp t0(0, 2, store, xirang_test::loopbackOptions(), after(milliseconds(5000)));
  t0.p2p();
  const long hwm0 = statusKb("VmHWM:");
  int fd = fakeP2PMember(*store, t0.address(), 1, 0);
  tp::FrameHeader h = p2pHeader(9, 1056964608);
  h.kind = tp::FrameKind::Data;
  h.payload_bytes = 1056964608;  // ~1 GiB claimed, nobody waits for tag 9
  uint8_t some[4096] = {1, 2, 3};
  sendFrame(fd, h, some, sizeof(some));
  std::this_thread::sleep_for(milliseconds(300));
  const auto c = t0.p2p().counters();
  const long hwm1 = statusKb("VmHWM:");
  ::close(fd);
  CAPTURE(hwm0, hwm1);
  CHECK(c.queued_messages == 1);  // accounted for...
  CHECK(hwm1 - hwm0 < 64 * 1024);  // ...but not allocated: < 64 MiB more resident at peak
}

TEST_CASE("p2p: a length that would wrap the queue's byte count is refused cleanly", "[p2p][security]") {
  auto store = std::make_shared<MemStore>();
  tp::Tcp t0(0, 2, store, xirang_test::loopbackOptions(), after(milliseconds(5000)));
  t0.p2p();
  int fd = fakeP2PMember(*store, t0.address(), 1, 0);
  tp::FrameHeader one = p2pHeader(1, 1);
  one.kind = tp::FrameKind::Data;
  one.payload_bytes = 1;
  uint8_t b = 7;
  sendFrame(fd, one, &b, 1);  // one byte queued
  tp::FrameHeader huge = p2pHeader(2, 1);
  huge.kind = tp::FrameKind::Data;
  huge.payload_bytes = ~uint64_t{0};  // 2^64 - 1
  sendFrame(fd, huge, nullptr, 0);
  std::this_thread::sleep_for(milliseconds(200));
  uint32_t x = 0;
  std::string msg = what([&] { p2pWait(t0, false, 1, p2pHeader(2, 1), &x, 4, after(milliseconds(2000))); });
  uint8_t y = 0;
  const int src = p2pWait(t0, false, 1, p2pHeader(1, 1), &y, 1, after(milliseconds(2000)));
  ::close(fd);
  CAPTURE(msg);
  CHECK(msg.find("frame length mismatch: expected 4 bytes, rank 1 sent 18446744073709551615") != std::string::npos);
  CHECK(src == 1);
  CHECK(y == 7);
}

TEST_CASE("p2p: a partial header does not make the receive spin", "[p2p][security]") {
  auto store = std::make_shared<MemStore>();
  tp::Tcp t0(0, 2, store, xirang_test::loopbackOptions(), after(milliseconds(5000)));
  t0.p2p();
  int fd = fakeP2PMember(*store, t0.address(), 1, 0);
  uint8_t partial[20] = {0x58, 0x52, 0x4e, 0x47};  // the first 20 of 48 header bytes
  (void)!::send(fd, partial, sizeof(partial), MSG_NOSIGNAL);
  rusage u0{}, u1{};
  getrusage(RUSAGE_SELF, &u0);
  const auto t = Clock::now();
  uint32_t x;
  std::string msg = what([&] { p2pWait(t0, false, -1, p2pHeader(3, 1), &x, 4, after(milliseconds(1500))); });
  const double wall = secondsSince(t);
  getrusage(RUSAGE_SELF, &u1);
  const double cpu = (u1.ru_utime.tv_sec - u0.ru_utime.tv_sec) + (u1.ru_stime.tv_sec - u0.ru_stime.tv_sec) +
                     1e-6 * ((u1.ru_utime.tv_usec - u0.ru_utime.tv_usec) + (u1.ru_stime.tv_usec - u0.ru_stime.tv_usec));
  ::close(fd);
  CAPTURE(msg, wall, cpu);
  CHECK(msg.find("timed out") != std::string::npos);
  CHECK(cpu < 0.2 * wall);
}

TEST_CASE("p2p: a peer that delivered and then left: its message is still received", "[p2p]") {
  Group g(3);
  std::vector<std::pair<int, uint32_t>> got;
  std::string named;
  g.run([&](int r) {
    if (r == 1) {
      uint32_t v = 101;
      p2pWait(*g.tcp[1], true, 0, p2pHeader(0, 1), &v, 4, after(milliseconds(5000)));
      g.tcp[1]->leave();
      g.tcp[1]->close();
      g.store->set("left", "1");
      return;
    }
    if (r == 2) {
      g.store->get("left", after(milliseconds(5000)));
      uint32_t v = 102;
      p2pWait(*g.tcp[2], true, 0, p2pHeader(0, 1), &v, 4, after(milliseconds(5000)));
      return;
    }
    g.store->get("left", after(milliseconds(5000)));
    std::this_thread::sleep_for(milliseconds(200));
    for (int k = 0; k < 2; ++k) {
      uint32_t v = 0;
      int src = p2pWait(*g.tcp[0], false, -1, p2pHeader(0, 1), &v, 4, after(milliseconds(5000)));
      got.push_back({src, v});
    }
    uint32_t v = 0;
    named = what([&] { p2pWait(*g.tcp[0], false, 1, p2pHeader(0, 1), &v, 4, after(milliseconds(5000))); });
  });
  std::sort(got.begin(), got.end());
  CHECK(got == std::vector<std::pair<int, uint32_t>>{{1, 101}, {2, 102}});
  CAPTURE(named);
  CHECK(named.find("rank 1") != std::string::npos);
  CHECK(named.find("timed out") == std::string::npos);
}

TEST_CASE("p2p: receives from a peer that never connects and has left fail fast", "[p2p]") {
  Group g(3);
  g.tcp[1]->leave();
  g.tcp[1]->close();
  g.tcp[2]->close();  // gone without a word: its listener refuses
  const auto t0 = Clock::now();
  uint32_t v;
  std::string m1 = what([&] { p2pWait(*g.tcp[0], false, 1, p2pHeader(0, 1), &v, 4, after(milliseconds(20000))); });
  std::string m2 = what([&] { p2pWait(*g.tcp[0], false, 2, p2pHeader(0, 1), &v, 4, after(milliseconds(20000))); });
  const double el = secondsSince(t0);
  CAPTURE(m1, m2, el);
  CHECK(m1.find("rank 1 left the group") != std::string::npos);
  CHECK(m2.find("refuses connections") != std::string::npos);
  CHECK(el < 5.0);
}
