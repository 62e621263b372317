// libFuzzer target for everything xirang parses from the network: the frame header (decode +
// compare against what an operation expects), the hello, the listener's server handshake fed
// a stranger's bytes, and the point-to-point engine fed an authenticated peer's bytes.
// Built and run for a bounded time by tests/fuzz/run.sh (not part of every CI run).
//
// The first input byte picks the target; the rest is the data.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <string>

#include "../cpp/support.h"
#include "core/transport/auth.h"
#include "core/transport/frame.h"
#include "core/transport/tcp.h"

namespace tp = xirang::transport;
using std::chrono::milliseconds;
using xirang_test::after;

namespace {

int connectRaw(const std::string& address) {
  return tp::connectTo(address, after(milliseconds(2000)), 0);
}

// A listener shared by every input of target 2 (strangers: nothing authenticates).
tp::Tcp& sharedListener() {
  static auto store = std::make_shared<xirang_test::MemStore>();
  static tp::Tcp t(0, 2, store, [] {
    auto o = xirang_test::loopbackOptions();
    o.handshake_timeout = milliseconds(200);
    return o;
  }(), after(milliseconds(5000)));
  return t;
}

void stranger(const uint8_t* data, size_t size) {
  int fd = connectRaw(sharedListener().address());
  (void)!::send(fd, data, size, MSG_NOSIGNAL);
  ::shutdown(fd, SHUT_WR);
  timeval tv{0, 50000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  uint8_t buf[64];
  while (::recv(fd, buf, sizeof(buf), 0) > 0) {
  }
  ::close(fd);
}

// An authenticated rank 1 sends `data` on its point-to-point connection to a fresh rank 0,
// which posts one receive (tag 1, 16 bytes) and one from any source (tag 2, 8 bytes).
void member(const uint8_t* data, size_t size) {
  auto store = std::make_shared<xirang_test::MemStore>();
  auto o = xirang_test::loopbackOptions();
  o.p2p_limits.max_queued_bytes = 1 << 20;
  o.p2p_limits.max_queued_messages = 64;
  tp::Tcp t0(0, 2, store, o, after(milliseconds(5000)));
  const tp::Key128 key = tp::keyFromHex(store->get("xirang/secret", after(milliseconds(1000))));
  const uint64_t group = std::stoull(store->get("xirang/group_id", after(milliseconds(1000))), nullptr, 16);
  int fd = connectRaw(t0.address());
  tp::Hello h;
  h.version = tp::kWireVersion;
  h.channel = tp::Channel::P2P;
  h.rank = 1;
  h.nonce = 7;
  uint8_t hb[tp::kHelloBytes];
  tp::encodeHello(h, hb);
  uint64_t reply[2] = {0, 0};
  if (::send(fd, hb, sizeof(hb), MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(hb)) &&
      ::recv(fd, reply, sizeof(reply), MSG_WAITALL) == static_cast<ssize_t>(sizeof(reply))) {
    uint64_t cmac = tp::clientMac(key, group, tp::Channel::P2P, reply[0], h.nonce, 1, 0);
    (void)!::send(fd, &cmac, sizeof(cmac), MSG_NOSIGNAL);
    (void)!::send(fd, data, size, MSG_NOSIGNAL);
  }
  uint8_t a[16], b[8];
  tp::FrameHeader e;
  e.op = tp::OpKind::Send;
  e.tag = 1;
  e.op_numel = 16;
  auto f1 = xirang_test::p2pPost(t0, false, 1, e, a, sizeof(a), after(milliseconds(30)));
  e.tag = 2;
  e.op_numel = 8;
  auto f2 = xirang_test::p2pPost(t0, false, -1, e, b, sizeof(b), after(milliseconds(30)));
  try {
    f1.get();
  } catch (const std::exception&) {
  }
  try {
    f2.get();
  } catch (const std::exception&) {
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t which = data[0] % 4;
  ++data;
  --size;
  switch (which) {
    case 0:
      if (size >= tp::kHeaderBytes) {
        tp::FrameHeader got = tp::decodeHeader(data);
        tp::FrameHeader want;
        want.op = tp::OpKind::Allreduce;
        want.seq = 3;
        want.op_numel = 10;
        want.payload_bytes = 40;
        (void)tp::compareHeader(want, got, 1);
        uint8_t again[tp::kHeaderBytes];
        tp::encodeHeader(got, again);
        if (std::memcmp(again, data, tp::kHeaderBytes) != 0 && got.magic == tp::kMagic) {
          // decode(encode(h)) must be the identity on every field it carries
          tp::FrameHeader back = tp::decodeHeader(again);
          if (back.payload_bytes != got.payload_bytes || back.tag != got.tag || back.seq != got.seq) __builtin_trap();
        }
      }
      break;
    case 1:
      if (size >= tp::kHelloBytes) {
        tp::Hello h;
        (void)tp::parseHello(data, tp::kWireVersion, &h);
      }
      break;
    case 2:
      stranger(data, size);
      break;
    case 3:
      member(data, size);
      break;
  }
  return 0;
}
