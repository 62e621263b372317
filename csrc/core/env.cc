#include "core/env.h"

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace xirang::env {

const std::vector<Knob>& knobs() {
  using T = Type;
  using R = Read;
  static const std::vector<Knob> table = {
      {"XIRANG_DEBUG", "WARN", "log level: WARN, INFO (ring order, algorithm, addresses), TRACE (every op)", T::String, R::Process},
      {"XIRANG_SOCKET_IFNAME", "", "network interface to listen and connect on (like GLOO_SOCKET_IFNAME); default: the address the hostname resolves to, else loopback", T::String, R::Group},
      {"XIRANG_SEGMENT_BYTES", "1048576", "ring segment size in bytes, 4096 to 268435456 (256 MiB): encode, send, receive and reduce of different segments overlap; every rank of a group must agree (checked at its creation)", T::Int, R::Group},
      {"XIRANG_SMALL_BYTES", "65536", "messages up to this many bytes take the latency-optimal direct exchange instead of the ring, and a synchronous one (async_op=False) on host tensors, outside elastic mode, runs on the caller's thread when the group's queue is idle (no hand-over to the communication thread); with XIRANG_ALGO=auto every rank of a group must agree (checked at its creation)", T::Int, R::Group},
      {"XIRANG_SEND_THREAD_BYTES", "1048576", "a ring step that sends at least this many bytes to one peer while receiving pumps the send on a helper thread (0: never)", T::Int, R::Process},
      {"XIRANG_SPIN_US", "50", "microseconds, 0 to 10000: a waiting thread polls this long (yielding its core) before it sleeps: the communication thread for the next operation, Work.wait() for its operation's end; saves the two thread wake-ups of a small operation that goes through the communication thread (an async one, or one queued behind others; before small synchronous ones ran on the caller's thread: a 4 KiB allreduce over shared memory in about a quarter of the time on the 2-core test machine), costs at most this much CPU per operation; 0: sleep at once", T::Int, R::Group},
      {"XIRANG_SHM_BYTES", "4194304", "shared-memory slot per same-host rank, bytes, 4096 to 1073741824 (the segment holds one per local rank): collectives move messages through it in pieces of about this size; 4 MiB keeps 8 ranks within Docker's default 64 MiB /dev/shm, and at 4 MiB a piece's copies cost far more than its two barriers; the ranks of a host use the value of the one that creates their segment", T::Int, R::Group},
      {"XIRANG_TRANSPORT_LOCAL", "auto", "ranks of a group on the same host (same XIRANG_HOST label): auto (shared memory when every one of them can map one segment, else TCP, with an INFO line saying why), shm (shared memory or a creation error naming the rank and why), tcp (sockets); every rank of a group must agree (checked at its creation)", T::String, R::Group},
      {"XIRANG_CODEC", "auto", "codec path: auto, avx512bf16, avx2, scalar", T::String, R::Process},
      {"XIRANG_NCCL_LIBRARY", "", "the NCCL library to dlopen (a path or file name) instead of searching: the copy already loaded by torch, torch's nvidia-nccl wheel, then the loader's path", T::String, R::Process},
      {"XIRANG_CUDA_TRANSPORT", "auto", "CUDA tensors: auto (the NCCL engine when every rank loads the same NCCL version and no two ranks use one GPU, else as host; decided at the group's first CUDA collective, which waits up to the group's timeout for every rank to reach its own, and said once at INFO with the reason; when a rank then cannot make its NCCL communicator, every rank falls back to host with a WARNING naming that rank and NCCL's error; never NCCL in elastic mode), host (host-staged: kernels on the GPU, only the bytes sent staged through pinned host memory over TCP; whole-tensor pinned mirrors and the CPU engine where this rank has same-host peers in shared memory, in elastic mode, for point-to-point and for ops mixing devices), mirror (always the mirrors) or nccl (the NCCL engine, or an error at group creation saying why not); point-to-point is host-staged in every case; none of these has run on a GPU yet; every rank of a group must agree on nccl or not (checked at its creation; a rank with host or mirror makes auto choose host at once)", T::String, R::Group},
      {"XIRANG_ALGO", "auto", "allreduce algorithm: auto, ring, direct, two_level; every rank of a group must agree (checked at its creation)", T::String, R::Group},
      {"XIRANG_RING_ORDER", "topology", "ring order: topology (rack, host, rank) or rank; every rank of a group must agree (checked at its creation)", T::String, R::Group},
      {"XIRANG_HOST", "", "host label of this rank (default: hostname); printable (no tabs or newlines)", T::String, R::Group},
      {"XIRANG_RACK", "", "rack label of this rank (default: XIRANG_TOPOLOGY_FILE's entry for the host, else 'rack0'); printable (no tabs or newlines)", T::String, R::Group},
      {"XIRANG_TOPOLOGY_FILE", "", "file of 'hostname rack' lines mapping hosts to racks", T::String, R::Group},
      {"XIRANG_STATS_DIR", "", "directory where every rank appends its operation records as rank<N>.jsonl", T::String, R::Group},
      {"XIRANG_STATS", "1", "0: a process group created now keeps no operation records (xirang.stats() empty, no JSON lines, Work.wait not timed); for measuring what they cost", T::Bool, R::Group},
      {"XIRANG_STATS_CAPACITY", "65536", "operation records kept in memory per process group (ring buffer), 1 to 16777216", T::Int, R::Group},
      {"XIRANG_AUTH_KEY_FILE", "", "file holding a 128-bit group key as 32 hex digits (a secret the launcher distributes): peers must prove they hold it, and no secret is written to the c10d store (README: Security model)", T::String, R::Group},
      {"XIRANG_HANDSHAKE_TIMEOUT_MS", "10000", "bound on one connection's authentication handshake, milliseconds (> 0)", T::Int, R::Group},
      {"XIRANG_PROMETHEUS_PORT", "", "xirang.exporters.start_prometheus(): serve metrics on this port + LOCAL_RANK", T::Int, R::Call},
      {"XIRANG_RUN_ID", "", "run id written into every stats record (default: TORCHELASTIC_RUN_ID)", T::String, R::Group},
      {"XIRANG_ELASTIC", "0", "1: elastic mode: a lost rank is dropped, the survivors agree on a new ring and keep going; in-flight ops raise xirang.MembershipChanged; every rank of a group must agree (checked at its creation)", T::Bool, R::Group},
      {"XIRANG_JOIN", "0", "elastic mode: 1 makes this process a spare that takes its RANK's place once the live ranks call xirang.admit_joiners()", T::Bool, R::Group},
      {"XIRANG_HEARTBEAT_S", "1.0", "elastic mode: a rank whose store heartbeat has not advanced for this many seconds is declared failed; every rank of a group must agree (checked at its creation)", T::Float, R::Group},
      {"XIRANG_TEST_DIE_AFTER_SEGMENTS", "0", "test only: k or k@r: this process (with @r only if its group rank is r) kills itself (SIGKILL) after sending k data frames", T::String, R::Process},
      {"XIRANG_TEST_DELAY_MS", "0", "test only: sleep this long before each collective on this rank (to make a slow rank)", T::Int, R::Process},
      {"XIRANG_TEST_DIE_IN_REBUILD", "", "test only: r: in elastic mode, group rank r kills itself (SIGKILL) as it installs a rebuilt epoch, after the survivors agreed on it and before its shared-memory set-up", T::String, R::Process},
  };
  return table;
}

const char* typeName(Type t) {
  switch (t) {
    case Type::String: return "string";
    case Type::Int: return "int";
    case Type::Float: return "float";
    case Type::Bool: return "bool";
  }
  return "?";
}

const char* readName(Read r) {
  switch (r) {
    case Read::Process: return "process";
    case Read::Group: return "group";
    case Read::Op: return "op";
    case Read::Call: return "call";
  }
  return "?";
}

const Knob& knob(const char* name) {
  for (const auto& k : knobs()) {
    if (std::strcmp(k.name, name) == 0) return k;
  }
  throw std::invalid_argument(std::string("xirang: unknown environment knob ") + name);
}

// The knob's value as get() returns it, after checking that it is declared with type `t`.
static std::string getAs(const char* name, Type t) {
  const Knob& k = knob(name);
  if (k.type != t)
    throw std::invalid_argument(std::string("xirang: environment knob ") + name + " is declared as " +
                                typeName(k.type) + ", not " + typeName(t));
  return get(name);
}

std::string get(const char* name) {
  const Knob& k = knob(name);
  const char* v = std::getenv(name);
  if (v != nullptr && v[0] != '\0') return v;
  return k.default_value;
}

int64_t getInt(const char* name) {
  std::string v = getAs(name, Type::Int);
  if (v.empty()) return 0;
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v.c_str(), &end, 10);
  int64_t mult = 1;
  if (end && *end) {
    switch (*end) {
      case 'k': case 'K': mult = 1024; break;
      case 'm': case 'M': mult = 1024 * 1024; break;
      case 'g': case 'G': mult = 1024LL * 1024 * 1024; break;
      default: end = nullptr;
    }
    if (end && end[1] != '\0') end = nullptr;
  }
  if (end == nullptr || errno != 0 || end == v.c_str()) {
    throw std::invalid_argument(std::string("xirang: ") + name + "='" + v + "' is not an integer");
  }
  return static_cast<int64_t>(x) * mult;
}

double getDouble(const char* name) {
  std::string v = getAs(name, Type::Float);
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || end == v.c_str() || *end != '\0') {
    throw std::invalid_argument(std::string("xirang: ") + name + "='" + v + "' is not a number");
  }
  return x;
}

bool getBool(const char* name) {
  const std::string raw = getAs(name, Type::Bool);
  std::string v = raw;
  for (auto& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v.empty() || v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw std::invalid_argument(std::string("xirang: ") + name + "='" + raw +
                              "' is not a boolean: accepted values are 1, true, yes, on and 0, false, no, off "
                              "(case-insensitive)");
}

Level parseLogLevel() {
  const std::string raw = get("XIRANG_DEBUG");
  std::string v = raw;
  for (auto& c : v) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (v == "TRACE") return Level::Trace;
  if (v == "INFO") return Level::Info;
  if (v == "WARN") return Level::Warn;
  throw std::invalid_argument("xirang: XIRANG_DEBUG='" + raw +
                              "' is not a log level: accepted values are WARN, INFO, TRACE (case-insensitive)");
}

Level logLevel() {
  static const Level level = [] {
    try {
      return parseLogLevel();
    } catch (const std::invalid_argument&) {
      return Level::Warn;  // group creation reports the bad value (parseLogLevel)
    }
  }();
  return level;
}

void log(Level level, int rank, const std::string& msg) {
  if (static_cast<int>(level) > static_cast<int>(logLevel())) return;
  static std::mutex mu;
  static const char* names[] = {"WARN", "INFO", "TRACE"};
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::lock_guard<std::mutex> g(mu);
  std::fprintf(stderr, "xirang %s:%d [%d] %s %s\n", host, static_cast<int>(getpid()), rank,
               names[static_cast<int>(level)], msg.c_str());
}

}  // namespace xirang::env
