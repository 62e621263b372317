// TCP transport (csrc/core/transport/tcp.h) between threads of one process over loopback.
// Rank threads never touch Catch: they record into per-rank slots, the test body asserts.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
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
using xirang_test::mix;
using std::chrono::milliseconds;

double secondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

uint8_t patternByte(int src, int dst, size_t seg, uint64_t k) {
  return static_cast<uint8_t>(((k * 2654435761u) >> 7) ^ (k >> 9) ^ (uint64_t(src) * 37) ^ (uint64_t(dst) * 101) ^
                              (seg * 13));
}
std::vector<uint8_t> pattern(int src, int dst, size_t seg, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  for (size_t k = 0; k < bytes; ++k) v[k] = patternByte(src, dst, seg, k);
  return v;
}

tp::FrameHeader hdr(tp::OpKind op = tp::OpKind::Allgather, uint64_t seq = 1, uint64_t numel = 0,
                    DType dt = DType::Bytes) {
  tp::FrameHeader h;
  h.op = op;
  h.seq = seq;
  h.op_numel = numel;
  h.dtype = dt;
  return h;
}

void connectAll(Group& g) {
  g.run([&](int r) {
    for (int p = 0; p < g.size(); ++p)
      if (p != r) g.tcp[r]->connectPeer(p, after(milliseconds(10000)));
  });
}

// A plain blocking client socket to "127.0.0.1:port" with a receive timeout.
int rawConnect(const std::string& address) {
  const auto colon = address.rfind(':');
  const std::string host = address.substr(0, colon);
  const int port = std::stoi(address.substr(colon + 1));
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket failed");
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    ::close(fd);
    throw std::runtime_error("connect to " + address + " failed");
  }
  timeval tv{3, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// True if the server closed (EOF or reset) the connection within the receive timeout; data the
// server sent before closing is drained first.
bool serverClosed(int fd) {
  uint8_t buf[256];
  while (true) {
    ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
    if (r == 0) return true;
    if (r < 0) return errno == ECONNRESET;  // EAGAIN = timed out, still open
  }
}

std::vector<uint8_t> hello(const char magic[4], uint16_t version, int32_t rank, uint64_t nonce, uint8_t channel = 0) {
  std::vector<uint8_t> h(20, 0);
  std::memcpy(h.data(), magic, 4);
  std::memcpy(h.data() + 4, &version, 2);
  h[6] = channel;
  std::memcpy(h.data() + 8, &rank, 4);
  std::memcpy(h.data() + 12, &nonce, 8);
  return h;
}

}  // namespace

TEST_CASE("transport: size-1 group opens nothing and exchanges nothing", "[transport]") {
  auto store = std::make_shared<MemStore>();
  tp::Tcp t(0, 1, store, xirang_test::loopbackOptions(), after(milliseconds(1000)));
  CHECK(t.address().empty());
  CHECK(t.size() == 1);
  CHECK_FALSE(store->has("xirang/secret"));
  std::vector<tp::SendJob> s;
  std::vector<tp::RecvJob> r;
  CHECK_NOTHROW(t.exchange(s, r, after(milliseconds(100))));
}

TEST_CASE("transport: framed segments flow both directions at once, to several peers", "[transport]") {
  const int n = GENERATE(2, 4);
  Group g(n);
  const std::vector<size_t> seg_sizes = {1000, 1, 65536 + 7, 0, 300000};
  // out[r][p][i]: what rank r sends to peer p as segment i; in[r][p][i]: what r received from p.
  std::vector<std::vector<std::vector<std::vector<uint8_t>>>> in(n, std::vector<std::vector<std::vector<uint8_t>>>(n));
  std::vector<std::vector<std::vector<size_t>>> order(n, std::vector<std::vector<size_t>>(n));
  std::vector<uint64_t> sent(n);
  g.run([&](int r) {
    std::vector<std::vector<std::vector<uint8_t>>> out(n);
    std::vector<tp::SendJob> sends;
    std::vector<tp::RecvJob> recvs;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      tp::SendJob sj{p, hdr(tp::OpKind::Alltoall, 42, 7), {}};
      tp::RecvJob rj{p, hdr(tp::OpKind::Alltoall, 42, 7), {}, nullptr};
      for (size_t i = 0; i < seg_sizes.size(); ++i) {
        out[p].push_back(pattern(r, p, i, seg_sizes[i]));
        in[r][p].push_back(std::vector<uint8_t>(seg_sizes[i], 0xEE));
      }
      for (size_t i = 0; i < seg_sizes.size(); ++i) {
        sj.segs.push_back({out[p][i].data(), out[p][i].size()});
        rj.segs.push_back({in[r][p][i].data(), in[r][p][i].size()});
      }
      rj.on_segment = [&order, r, p](size_t i) { order[r][p].push_back(i); };
      sends.push_back(std::move(sj));
      recvs.push_back(std::move(rj));
    }
    g.tcp[r]->exchange(sends, recvs, after(milliseconds(20000)));
    sent[r] = g.tcp[r]->payloadBytesSent();
  });
  size_t per_peer = 0;
  for (size_t s : seg_sizes) per_peer += s;
  for (int r = 0; r < n; ++r) {
    CHECK(sent[r] == per_peer * static_cast<uint64_t>(n - 1));
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      INFO("rank " << r << " from " << p);
      CHECK(order[r][p] == std::vector<size_t>{0, 1, 2, 3, 4});
      for (size_t i = 0; i < seg_sizes.size(); ++i) CHECK(in[r][p][i] == pattern(p, r, i, seg_sizes[i]));
    }
  }
}

TEST_CASE("transport: 8 MiB payloads both directions at once", "[transport]") {
  Group g(2);
  const size_t big = size_t{8} << 20;
  std::vector<std::vector<uint8_t>> rx(2);
  g.run([&](int r) {
    const int p = 1 - r;
    std::vector<uint8_t> tx = pattern(r, p, 0, big);
    rx[r].assign(big, 0);
    // One frame of 8 MiB plus the same again split in two uneven segments.
    std::vector<tp::SendJob> s{{p, hdr(tp::OpKind::Broadcast, 3, big), {{tx.data(), big}}},
                               {p, hdr(tp::OpKind::Broadcast, 4, big), {{tx.data(), 5}, {tx.data() + 5, big - 5}}}};
    std::vector<uint8_t> rx2(big, 0);
    std::vector<tp::RecvJob> v{{p, hdr(tp::OpKind::Broadcast, 3, big), {{rx[r].data(), big}}, nullptr},
                               {p, hdr(tp::OpKind::Broadcast, 4, big), {{rx2.data(), 5}, {rx2.data() + 5, big - 5}}, nullptr}};
    g.tcp[r]->exchange(s, v, after(milliseconds(20000)));
    if (rx2 != rx[r]) throw std::runtime_error("split receive differs from whole receive");
  });
  CHECK(rx[0] == pattern(1, 0, 0, big));
  CHECK(rx[1] == pattern(0, 1, 0, big));
  CHECK(g.tcp[0]->payloadBytesSent() == 2 * big);
}

TEST_CASE("transport: zero-length jobs and segments", "[transport]") {
  Group g(3);
  std::vector<std::vector<size_t>> calls(3);
  std::vector<uint8_t> after_small(3);
  g.run([&](int r) {
    // Round 1: empty segment lists still send one empty frame each; on_segment is not called.
    std::vector<tp::SendJob> s;
    std::vector<tp::RecvJob> v;
    for (int p = 0; p < 3; ++p) {
      if (p == r) continue;
      s.push_back({p, hdr(tp::OpKind::Gather, 1, 0), {}});
      v.push_back({p, hdr(tp::OpKind::Gather, 1, 0), {}, [&calls, r](size_t i) { calls[r].push_back(100 + i); }});
    }
    g.tcp[r]->exchange(s, v, after(milliseconds(10000)));
    // Round 2: explicit zero-byte segments between real ones; on_segment sees each.
    uint8_t one = static_cast<uint8_t>(r + 10), got = 0;
    const int next = (r + 1) % 3, prev = (r + 2) % 3;
    std::vector<tp::SendJob> s2{{next, hdr(tp::OpKind::Gather, 2, 1), {{nullptr, 0}, {&one, 1}, {nullptr, 0}}}};
    std::vector<tp::RecvJob> v2{{prev, hdr(tp::OpKind::Gather, 2, 1), {{nullptr, 0}, {&got, 1}, {nullptr, 0}},
                                 [&calls, r](size_t i) { calls[r].push_back(i); }}};
    g.tcp[r]->exchange(s2, v2, after(milliseconds(10000)));
    after_small[r] = got;
    // Round 3: no jobs at all.
    std::vector<tp::SendJob> s3;
    std::vector<tp::RecvJob> v3;
    g.tcp[r]->exchange(s3, v3, after(milliseconds(10000)));
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(calls[r] == std::vector<size_t>{0, 1, 2});
    CHECK(after_small[r] == static_cast<uint8_t>((r + 2) % 3 + 10));
  }
}

TEST_CASE("transport: a header mismatch fails the receiver naming both values", "[transport]") {
  struct Case {
    const char* name;
    tp::FrameHeader sent, expected;
    std::vector<std::string> needles;
  };
  std::vector<Case> cases = {
      {"dtype", hdr(tp::OpKind::Allreduce, 5, 10, DType::Float32), hdr(tp::OpKind::Allreduce, 5, 10, DType::Float64),
       {"dtype mismatch", "this rank float64", "rank 0 float32"}},
      {"numel", hdr(tp::OpKind::Allreduce, 5, 12, DType::Float32), hdr(tp::OpKind::Allreduce, 5, 10, DType::Float32),
       {"element count mismatch", "this rank 10", "rank 0 12"}},
      {"order", hdr(tp::OpKind::Allreduce, 6, 10, DType::Float32), hdr(tp::OpKind::Allreduce, 5, 10, DType::Float32),
       {"order mismatch", "#5", "#6"}},
      {"op", hdr(tp::OpKind::Broadcast, 5, 10, DType::Float32), hdr(tp::OpKind::Allreduce, 5, 10, DType::Float32),
       {"op mismatch", "allreduce", "broadcast"}},
  };
  for (auto& c : cases) {
    INFO(c.name);
    Group g(2);
    std::string what;
    int peer = -2;
    bool sender_ok = false;
    std::vector<float> buf(16, 1.0f), rbuf(16);
    xirang_test::runRanks(2, [&](int r) {
      if (r == 0) {
        std::vector<tp::SendJob> s{{1, c.sent, {{buf.data(), 40}}}};
        std::vector<tp::RecvJob> v;
        g.tcp[0]->exchange(s, v, after(milliseconds(5000)));
        sender_ok = true;
      } else {
        std::vector<tp::SendJob> s;
        std::vector<tp::RecvJob> v{{0, c.expected, {{rbuf.data(), 40}}, nullptr}};
        try {
          g.tcp[1]->exchange(s, v, after(milliseconds(5000)));
        } catch (const tp::TimeoutError& e) {
          what = std::string("TIMEOUT: ") + e.what();
        } catch (const tp::TransportError& e) {
          what = e.what();
          peer = e.peer();
        }
      }
    });
    CHECK(sender_ok);
    CAPTURE(what);
    CHECK(peer == 0);
    for (auto& needle : c.needles) CHECK(what.find(needle) != std::string::npos);
  }
}

TEST_CASE("transport: a frame longer or shorter than expected is a clear error", "[transport]") {
  Group g(2);
  std::string what;
  std::vector<uint8_t> a(100, 1), b(100);
  xirang_test::runRanks(2, [&](int r) {
    std::vector<tp::SendJob> s;
    std::vector<tp::RecvJob> v;
    if (r == 0) s.push_back({1, hdr(), {{a.data(), 100}}});
    else v.push_back({0, hdr(), {{b.data(), 60}}, nullptr});
    try {
      g.tcp[r]->exchange(s, v, after(milliseconds(5000)));
    } catch (const tp::TransportError& e) {
      what = e.what();
    }
  });
  CAPTURE(what);
  CHECK(what.find("frame length mismatch: expected 60 bytes, rank 0 sent 100") != std::string::npos);
}

TEST_CASE("transport: abort() makes the peer's pending exchange fail fast with the reason", "[transport]") {
  const std::string reason = "rank 1 watchdog: CUDA error: an illegal memory access";
  SECTION("peer blocked receiving from the aborting rank") {
    Group g(2);
    connectAll(g);
    std::string what;
    int peer = -2;
    double latency = -1;
    std::atomic<int64_t> abort_at_ns{0};
    xirang_test::runRanks(2, [&](int r) {
      if (r == 1) {
        std::this_thread::sleep_for(milliseconds(200));
        abort_at_ns = Clock::now().time_since_epoch().count();
        g.tcp[1]->abort(reason);
        return;
      }
      std::vector<uint8_t> buf(1000);
      std::vector<tp::SendJob> s;
      std::vector<tp::RecvJob> v{{1, hdr(), {{buf.data(), buf.size()}}, nullptr}};
      try {
        g.tcp[0]->exchange(s, v, after(milliseconds(10000)));
      } catch (const tp::TransportError& e) {
        latency = (Clock::now().time_since_epoch().count() - abort_at_ns.load()) * 1e-9;
        what = e.what();
        peer = e.peer();
      }
    });
    CAPTURE(what, latency);
    CHECK(what.find("rank 1 aborted") != std::string::npos);
    CHECK(what.find(reason) != std::string::npos);
    CHECK(peer == 1);
    CHECK(latency >= 0);
    CHECK(latency < 1.0);
  }
  SECTION("peer blocked sending to the aborting rank (abort arrives on the back channel)") {
    Group g(2);
    connectAll(g);
    std::string what;
    double latency = -1;
    std::atomic<int64_t> abort_at_ns{0};
    std::vector<uint8_t> big(size_t{64} << 20, 7);  // far more than the socket buffers hold
    xirang_test::runRanks(2, [&](int r) {
      if (r == 1) {
        std::this_thread::sleep_for(milliseconds(200));
        abort_at_ns = Clock::now().time_since_epoch().count();
        g.tcp[1]->abort(reason);
        return;
      }
      std::vector<tp::SendJob> s{{1, hdr(), {{big.data(), big.size()}}}};
      std::vector<tp::RecvJob> v;
      try {
        g.tcp[0]->exchange(s, v, after(milliseconds(10000)));
      } catch (const tp::TransportError& e) {
        latency = (Clock::now().time_since_epoch().count() - abort_at_ns.load()) * 1e-9;
        what = e.what();
      }
    });
    CAPTURE(what, latency);
    CHECK(what.find("rank 1") != std::string::npos);
    CHECK(what.find(reason) != std::string::npos);
    CHECK(latency >= 0);
    CHECK(latency < 1.0);
  }
  SECTION("after abort() the aborted transport refuses work, naming its own reason") {
    Group g(2);
    g.tcp[0]->abort("first reason");
    g.tcp[0]->abort("second reason");  // idempotent
    uint8_t b = 0;
    std::vector<tp::SendJob> s{{1, hdr(), {{&b, 1}}}};
    std::vector<tp::RecvJob> v;
    CHECK_THROWS_WITH(g.tcp[0]->exchange(s, v, after(milliseconds(1000))), Catch::Contains("first reason"));
  }
}

TEST_CASE("transport: a silent peer makes exchange time out at its deadline", "[transport]") {
  const auto budget = milliseconds(300);
  SECTION("connected but never sends") {
    Group g(2);
    connectAll(g);
    uint8_t b[8];
    std::vector<tp::SendJob> s;
    std::vector<tp::RecvJob> v{{1, hdr(), {{b, 8}}, nullptr}};
    const auto t0 = Clock::now();
    std::string what;
    try {
      g.tcp[0]->exchange(s, v, t0 + budget);
    } catch (const tp::TimeoutError& e) {
      what = e.what();
    }
    const double el = secondsSince(t0);
    CAPTURE(what, el);
    CHECK(what.find("receive from rank 1") != std::string::npos);
    CHECK(el >= 0.3);
    CHECK(el <= 1.3);
  }
  SECTION("never connects") {
    Group g(2);
    uint8_t b[8];
    std::vector<tp::SendJob> s;
    std::vector<tp::RecvJob> v{{1, hdr(), {{b, 8}}, nullptr}};
    const auto t0 = Clock::now();
    std::string what;
    try {
      g.tcp[0]->exchange(s, v, t0 + budget);
    } catch (const tp::TimeoutError& e) {
      what = e.what();
    }
    const double el = secondsSince(t0);
    CAPTURE(what, el);
    CHECK(what.find("rank 1") != std::string::npos);
    CHECK(el >= 0.3);
    CHECK(el <= 1.3);
  }
  SECTION("never reads what we send") {
    Group g(2);
    connectAll(g);
    std::vector<uint8_t> big(size_t{64} << 20, 1);
    std::vector<tp::SendJob> s{{1, hdr(), {{big.data(), big.size()}}}};
    std::vector<tp::RecvJob> v;
    const auto t0 = Clock::now();
    std::string what;
    try {
      g.tcp[0]->exchange(s, v, t0 + budget);
    } catch (const tp::TimeoutError& e) {
      what = e.what();
    }
    const double el = secondsSince(t0);
    CAPTURE(what, el);
    CHECK(what.find("send to rank 1") != std::string::npos);
    CHECK(el >= 0.3);
    CHECK(el <= 1.3);
  }
}

TEST_CASE("transport: strangers on the listener are rejected and do not disturb the group", "[transport]") {
  Group g(2);
  auto attack = [&](int listener) {
    const std::string addr = g.tcp[listener]->address();
    const int other = 1 - listener;
    std::vector<bool> closed;
    // Garbage instead of a hello.
    {
      int fd = rawConnect(addr);
      const char junk[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
      (void)!::send(fd, junk, sizeof(junk) - 1, MSG_NOSIGNAL);
      closed.push_back(serverClosed(fd));
      ::close(fd);
    }
    // A well-formed hello from someone without the group secret: wrong response MAC.
    {
      int fd = rawConnect(addr);
      auto h = hello("XRHS", tp::kWireVersion, other, 12345);
      (void)!::send(fd, h.data(), h.size(), MSG_NOSIGNAL);
      uint64_t reply[2] = {0, 0};
      ssize_t got = ::recv(fd, reply, sizeof(reply), MSG_WAITALL);
      closed.push_back(got == static_cast<ssize_t>(sizeof(reply)));  // the server did answer
      uint64_t wrong = 0x0123456789abcdefULL;
      (void)!::send(fd, &wrong, sizeof(wrong), MSG_NOSIGNAL);
      closed.push_back(serverClosed(fd));
      ::close(fd);
    }
    // Wrong wire version; a rank outside the group; the listener's own rank.
    for (auto h : {hello("XRHS", tp::kWireVersion + 1, other, 1), hello("XRHS", tp::kWireVersion, 7, 1),
                   hello("XRHS", tp::kWireVersion, -1, 1), hello("XRHS", tp::kWireVersion, listener, 1),
                   hello("XRNG", tp::kWireVersion, other, 1)}) {
      int fd = rawConnect(addr);
      (void)!::send(fd, h.data(), h.size(), MSG_NOSIGNAL);
      closed.push_back(serverClosed(fd));
      ::close(fd);
    }
    // Connect and hang up without a word.
    ::close(rawConnect(addr));
    return closed;
  };
  auto roundTrip = [&](uint64_t seq) {
    std::vector<uint64_t> got(2);
    g.run([&](int r) {
      uint64_t mine = 1000 + r, theirs = 0;
      std::vector<tp::SendJob> s{{1 - r, hdr(tp::OpKind::Barrier, seq), {{&mine, 8}}}};
      std::vector<tp::RecvJob> v{{1 - r, hdr(tp::OpKind::Barrier, seq), {{&theirs, 8}}, nullptr}};
      g.tcp[r]->exchange(s, v, after(milliseconds(5000)));
      got[r] = theirs;
    });
    CHECK(got[0] == 1001);
    CHECK(got[1] == 1000);
  };

  // Before the group has connected...
  for (bool c : attack(0)) CHECK(c);
  roundTrip(1);
  // ...and once the real connections exist (a stranger claiming a member's rank must not
  // replace that member's connection).
  for (bool c : attack(0)) CHECK(c);
  for (bool c : attack(1)) CHECK(c);
  roundTrip(2);
  roundTrip(3);
}

TEST_CASE("transport: a listener that cannot prove the group secret is refused", "[transport]") {
  auto store = std::make_shared<MemStore>();
  tp::Tcp t0(0, 2, store, xirang_test::loopbackOptions(), after(milliseconds(5000)));
  // An impostor listens where rank 1 should be and answers the hello with a made-up MAC.
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
  REQUIRE(::listen(lfd, 4) == 0);
  socklen_t len = sizeof(sa);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  store->set("xirang/addr/1", "127.0.0.1:" + std::to_string(ntohs(sa.sin_port)));
  std::thread impostor([&] {
    int fd = ::accept(lfd, nullptr, nullptr);
    if (fd < 0) return;
    uint8_t h[20];
    (void)!::recv(fd, h, sizeof(h), MSG_WAITALL);
    uint64_t reply[2] = {42, 0xbadbadbadbadULL};
    (void)!::send(fd, reply, sizeof(reply), MSG_NOSIGNAL);
    uint8_t rest[64];
    timeval tv{2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    (void)!::recv(fd, rest, sizeof(rest), 0);
    ::close(fd);
  });
  std::string what;
  int peer = -2;
  try {
    t0.connectPeer(1, after(milliseconds(3000)));
  } catch (const tp::TransportError& e) {
    what = e.what();
    peer = e.peer();
  }
  impostor.join();
  ::close(lfd);
  CAPTURE(what);
  CHECK(what.find("authentication") != std::string::npos);
  CHECK(peer == 1);
}

// tcp.h: the constructor "Throws TransportError when no address can be bound or the store times
// out". When the group secret never appears, the store's own exception escapes instead.
TEST_CASE("transport: a store timeout in the constructor is a TransportError", "[transport]") {
  auto store = std::make_shared<MemStore>();  // rank 0 never publishes the secret
  const auto t0 = Clock::now();
  CHECK_THROWS_AS(tp::Tcp(1, 2, store, xirang_test::loopbackOptions(), t0 + milliseconds(200)), tp::TransportError);
  CHECK(secondsSince(t0) < 1.5);
}

namespace {

// A hand-rolled group member: connects to `address`, runs the client side of the handshake as
// auth.h documents it (hello "XRHS" version channel rank nonce -> server nonce + MAC over the
// group id -> client MAC) with the group id and secret from the store, and returns the
// authenticated blocking fd.
int fakeMember(MemStore& store, const std::string& address, int me, int server,
               tp::Channel ch = tp::Channel::Collective, bool verify_server = true) {
  const tp::Key128 key = tp::keyFromHex(store.get("xirang/secret", after(milliseconds(2000))));
  const uint64_t group = std::stoull(store.get("xirang/group_id", after(milliseconds(2000))), nullptr, 16);
  int fd = rawConnect(address);
  const uint64_t cnonce = 0x1234567;
  auto h = hello("XRHS", tp::kWireVersion, me, cnonce, static_cast<uint8_t>(ch));
  if (::send(fd, h.data(), h.size(), MSG_NOSIGNAL) != 20) throw std::runtime_error("hello not sent");
  uint64_t reply[2];
  if (::recv(fd, reply, sizeof(reply), MSG_WAITALL) != 16) throw std::runtime_error("no server reply");
  if (verify_server && reply[1] != tp::serverMac(key, group, ch, cnonce, reply[0], server, me))
    throw std::runtime_error("server MAC wrong");
  uint64_t cmac = tp::clientMac(key, group, ch, reply[0], cnonce, me, server);
  if (::send(fd, &cmac, 8, MSG_NOSIGNAL) != 8) throw std::runtime_error("client MAC not sent");
  return fd;
}

}  // namespace

TEST_CASE("transport: the handshake protocol as documented admits a member holding the secret", "[transport]") {
  auto store = std::make_shared<MemStore>();
  tp::Tcp t0(0, 2, store, xirang_test::loopbackOptions(), after(milliseconds(5000)));
  int fd = fakeMember(*store, t0.address(), 1, 0);
  // Send one frame as rank 1 and receive it through the transport.
  uint32_t v = 0xC0FFEE, got = 0;
  tp::FrameHeader h = hdr(tp::OpKind::Barrier, 3, 1);
  h.payload_bytes = 4;
  uint8_t wire[tp::kHeaderBytes + 4];
  tp::encodeHeader(h, wire);
  std::memcpy(wire + tp::kHeaderBytes, &v, 4);
  REQUIRE(::send(fd, wire, sizeof(wire), MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(wire)));
  std::vector<tp::SendJob> s;
  std::vector<tp::RecvJob> r{{1, hdr(tp::OpKind::Barrier, 3, 1), {{&got, 4}}, nullptr}};
  CHECK_NOTHROW(t0.exchange(s, r, after(milliseconds(3000))));
  CHECK(got == 0xC0FFEE);
  ::close(fd);
}

// A peer that keeps trickling bytes (a congested or malicious link) must not hold the exchange
// past its deadline: every poll round re-checks it.
TEST_CASE("transport: exchange honours its deadline while a peer trickles bytes", "[transport]") {
  auto store = std::make_shared<MemStore>();
  tp::Tcp t0(0, 2, store, xirang_test::loopbackOptions(), after(milliseconds(5000)));
  int fd = fakeMember(*store, t0.address(), 1, 0);
  constexpr int kBytes = 30;  // one byte every 50 ms: 1.5 s in all
  std::thread trickle([&] {
    tp::FrameHeader h = hdr(tp::OpKind::Barrier, 3, kBytes);
    h.payload_bytes = kBytes;
    uint8_t wire[tp::kHeaderBytes];
    tp::encodeHeader(h, wire);
    if (::send(fd, wire, sizeof(wire), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(wire))) return;
    for (int i = 0; i < kBytes; ++i) {
      std::this_thread::sleep_for(milliseconds(50));
      uint8_t b = static_cast<uint8_t>(i);
      if (::send(fd, &b, 1, MSG_NOSIGNAL) != 1) return;
    }
  });
  uint8_t buf[kBytes];
  std::vector<tp::SendJob> s;
  std::vector<tp::RecvJob> r{{1, hdr(tp::OpKind::Barrier, 3, kBytes), {{buf, kBytes}}, nullptr}};
  const auto t_start = Clock::now();
  bool timed_out = false;
  try {
    t0.exchange(s, r, t_start + milliseconds(300));
  } catch (const tp::TimeoutError&) {
    timed_out = true;
  }
  const double el = secondsSince(t_start);
  trickle.join();
  ::close(fd);
  CAPTURE(el);
  CHECK(timed_out);
  CHECK(el <= 1.3);
}

// tcp.cc Tcp::acceptLoop runs each server handshake inline (serverHandshake blocks up to
// handshake_timeout), and does not watch the wake pipe meanwhile. One stranger that connects and
// says nothing therefore (a) stalls every legitimate member's connection for handshake_timeout
// (10 s by default) and (b) blocks close()/abort() - which join the accept thread - just as long.
TEST_CASE("transport: a silent stranger stalls neither the group nor abort()", "[transport]") {
  auto opts = xirang_test::loopbackOptions();
  opts.handshake_timeout = milliseconds(1500);
  Group g(2, opts);
  int stranger = rawConnect(g.tcp[0]->address());  // connects, then never sends a byte
  std::this_thread::sleep_for(milliseconds(50));   // let the accept thread pick it up
  const auto t0 = Clock::now();
  std::string what;
  std::string what0;
  std::thread other([&] {  // connectPeer needs both directions: rank 0 connects to rank 1 too
    try {
      g.tcp[0]->connectPeer(1, t0 + milliseconds(1000));
    } catch (const std::exception& e) {
      what0 = e.what();
    }
  });
  try {
    g.tcp[1]->connectPeer(0, t0 + milliseconds(1000));
  } catch (const std::exception& e) {
    what = e.what();
  }
  other.join();
  what += what0;
  const double connect_s = secondsSince(t0);
  int stranger2 = rawConnect(g.tcp[1]->address());
  std::this_thread::sleep_for(milliseconds(50));
  const auto t1 = Clock::now();
  g.tcp[1]->abort("shutting down");
  const double abort_s = secondsSince(t1);
  ::close(stranger);
  ::close(stranger2);
  CAPTURE(what, connect_s, abort_s);
  CHECK(what.empty());
  CHECK(abort_s < 0.5);
}

// tcp.h: connectTo "Returns a connected blocking fd"; tcp.cc leaves it O_NONBLOCK.
TEST_CASE("transport: connectTo returns a blocking fd", "[transport]") {
  auto store = std::make_shared<MemStore>();
  tp::Tcp t0(0, 2, store, xirang_test::loopbackOptions(), after(milliseconds(5000)));
  int fd = tp::connectTo(t0.address(), after(milliseconds(2000)), 0);
  const int flags = fcntl(fd, F_GETFL, 0);
  ::close(fd);
  CHECK((flags & O_NONBLOCK) == 0);
}

TEST_CASE("transport: connectTo a port nobody listens on times out at its deadline", "[transport]") {
  // Bind a port, then close it so nothing listens there.
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
  socklen_t len = sizeof(sa);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(lfd);
  const auto t0 = Clock::now();
  std::string what;
  int peer = -2;
  try {
    tp::connectTo("127.0.0.1:" + std::to_string(ntohs(sa.sin_port)), t0 + milliseconds(300), 3);
  } catch (const tp::TimeoutError& e) {
    what = e.what();
    peer = e.peer();
  }
  const double el = secondsSince(t0);
  CAPTURE(what, el);
  CHECK(what.find("rank 3") != std::string::npos);
  CHECK(peer == 3);
  CHECK(el >= 0.3);
  CHECK(el <= 1.3);
}


namespace {
int countLines(const char* path) {
  std::ifstream f(path);
  std::string line;
  int n = 0;
  while (std::getline(f, line)) ++n;
  return n;
}
long statusField(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field, 0) == 0) return std::stol(line.substr(std::strlen(field)));
  return -1;
}
// connect() then an immediate reset (SO_LINGER 0): the attack that used to cost a thread each.
bool connectAndReset(const sockaddr_in& sa) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) == 0;
  linger lg{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
  ::close(fd);
  return ok;
}
}  // namespace

TEST_CASE("transport: 100,000 connect+reset strangers leave the group up and its resources flat", "[transport][security]") {
  Group g(2);
  connectAll(g);
  const std::string addr = g.tcp[0]->address();
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1))));
  inet_pton(AF_INET, addr.substr(0, addr.rfind(':')).c_str(), &sa.sin_addr);
  const long threads0 = statusField("Threads:");
  const int maps0 = countLines("/proc/self/maps");
  std::atomic<bool> stop{false};
  std::atomic<int> connected{0};
  std::atomic<int> max_threads{0};
  std::thread flood([&] {
    for (int i = 0; i < 100000 && !stop; ++i) {
      if (connectAndReset(sa)) connected++;
      if (i % 5000 == 0) max_threads = std::max<int>(max_threads, static_cast<int>(statusField("Threads:")));
    }
  });
  // The members keep exchanging meanwhile, with the right values.
  int rounds = 0;
  bool values_ok = true;
  while (connected < 100000 && rounds < 100000) {
    const uint64_t seq = static_cast<uint64_t>(++rounds);
    std::vector<uint64_t> got(2, 0);
    g.run([&](int r) {
      uint64_t mine = seq * 10 + static_cast<uint64_t>(r);
      std::vector<tp::SendJob> s{{1 - r, hdr(tp::OpKind::Allreduce, seq, 1), {{&mine, 8}}}};
      std::vector<tp::RecvJob> v{{1 - r, hdr(tp::OpKind::Allreduce, seq, 1), {{&got[r], 8}}, nullptr}};
      g.tcp[r]->exchange(s, v, after(milliseconds(10000)));
    });
    values_ok = values_ok && got[0] == seq * 10 + 1 && got[1] == seq * 10;
    if (!flood.joinable()) break;
    if (connected >= 100000) break;
    std::this_thread::sleep_for(milliseconds(20));
    if (rounds % 50 == 0 && connected == 0) break;  // the flood cannot connect at all
  }
  stop = true;
  flood.join();
  std::this_thread::sleep_for(milliseconds(300));  // the last handshakes end
  const long threads1 = statusField("Threads:");
  const int maps1 = countLines("/proc/self/maps");
  const uint64_t rejected = g.tcp[0]->rejectedConnections();
  CAPTURE(connected.load(), rounds, threads0, threads1, max_threads.load(), maps0, maps1, rejected);
  CHECK(connected >= 99000);
  CHECK(values_ok);
  CHECK(rounds > 10);
  CHECK(max_threads <= threads0 + 3);  // + the flood thread and the two rank threads of g.run
  CHECK(threads1 <= threads0 + 1);
  CHECK(maps1 <= maps0 + 16);
  CHECK(g.tcp[0]->pendingHandshakes() <= 1);
  CHECK(rejected >= 99000);
}

TEST_CASE("transport: a second connection claiming an authenticated rank is refused, not swapped in", "[transport][security]") {
  Group g(2);
  connectAll(g);
  // Someone who knows the store's secret connects as rank 1 again.
  int fd = fakeMember(*g.store, g.tcp[0]->address(), 1, 0);
  CHECK(serverClosed(fd));
  ::close(fd);
  // The real rank 1's connection still carries the group's traffic.
  std::vector<uint64_t> got(2);
  g.run([&](int r) {
    uint64_t mine = 500 + r;
    std::vector<tp::SendJob> s{{1 - r, hdr(tp::OpKind::Barrier, 9), {{&mine, 8}}}};
    std::vector<tp::RecvJob> v{{1 - r, hdr(tp::OpKind::Barrier, 9), {{&got[r], 8}}, nullptr}};
    g.tcp[r]->exchange(s, v, after(milliseconds(5000)));
  });
  CHECK(got[0] == 501);
  CHECK(got[1] == 500);
  CHECK(g.tcp[0]->rejectedConnections() >= 1);
}

TEST_CASE("transport: with a launcher's key nothing secret is in the store, and the store alone does not let in", "[transport][security]") {
  tp::TcpOptions o = xirang_test::loopbackOptions();
  o.key = tp::keyFromHex("00112233445566778899aabbccddeeff");
  Group g(2, o);
  CHECK_FALSE(g.store->has("xirang/secret"));
  CHECK(g.store->has("xirang/group_id"));
  connectAll(g);  // the members authenticate with the key
  // A stranger with the store (the group id) but not the key: pretend the store's "secret" is a
  // guess of the key; the listener refuses its MAC.
  g.store->set("xirang/secret", "ffeeddccbbaa99887766554433221100");
  const uint64_t before = g.tcp[0]->rejectedConnections();
  int fd = fakeMember(*g.store, g.tcp[0]->address(), 1, 0, tp::Channel::Collective, /*verify_server=*/false);
  CHECK(serverClosed(fd));
  ::close(fd);
  std::this_thread::sleep_for(milliseconds(50));
  CHECK(g.tcp[0]->rejectedConnections() == before + 1);
}

TEST_CASE("transport: a liveness probe is answered without a warning", "[transport]") {
  Group g(2);
  const uint64_t before = g.tcp[0]->rejectedConnections();
  CHECK(g.tcp[1]->peerGone(0).empty());  // probes rank 0's listener
  std::this_thread::sleep_for(milliseconds(100));
  CHECK(g.tcp[0]->rejectedConnections() == before);
  g.tcp[0]->close();
  std::this_thread::sleep_for(milliseconds(600));  // peerGone probes a peer at most every 500 ms
  CHECK(g.tcp[1]->peerGone(0).find("refuses connections") != std::string::npos);
}

TEST_CASE("transport: a peer that exits before it ever connected fails the exchange fast", "[transport]") {
  const bool clean = GENERATE(true, false);
  Group g(2);
  // Rank 1 sends to rank 0 (its connection works), then waits to receive from rank 0, which
  // leaves (cleanly or not) without ever connecting.
  std::string msg;
  const auto t0 = Clock::now();
  std::thread leaver([&] {
    std::this_thread::sleep_for(milliseconds(300));
    if (clean) g.tcp[0]->leave();
    g.tcp[0]->close();
  });
  try {
    uint64_t mine = 1, theirs = 0;
    std::vector<tp::SendJob> s{{0, hdr(tp::OpKind::Allreduce, 1, 1), {{&mine, 8}}}};
    std::vector<tp::RecvJob> v{{0, hdr(tp::OpKind::Allreduce, 1, 1), {{&theirs, 8}}, nullptr}};
    g.tcp[1]->exchange(s, v, after(milliseconds(30000)));
  } catch (const tp::TransportError& e) {
    msg = e.what();
  }
  leaver.join();
  const double el = secondsSince(t0);
  CAPTURE(msg, el);
  CHECK(msg.find("rank 0") != std::string::npos);
  CHECK(el < 3.0);
}
