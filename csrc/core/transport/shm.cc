#include "core/transport/shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "core/env.h"
#include "core/transport/auth.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace xirang::transport {

namespace {

constexpr uint64_t kMagicShm = 0x314d48534e525858ULL;  // "XXRNSHM1"
constexpr uint32_t kShmVersion = 1;
constexpr size_t kAbortBytes = 1024;
constexpr uint64_t kPage = 4096;
// Spin this long before sleeping: a peer that is a few microseconds behind (the usual case in a
// step of an algorithm) is met without a system call, and an idle rank burns no more than that.
constexpr auto kSpin = std::chrono::microseconds(5);
// FUTEX_WAIT slice: between slices the waits check aborts, interrupts and the peers' liveness.
constexpr auto kSlice = std::chrono::milliseconds(100);

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

long futexWait(uint32_t* addr, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Shared (no FUTEX_PRIVATE_FLAG): the word lives in a segment other processes map.
  return syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futexWake(uint32_t* addr) { syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

uint64_t roundUp(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

std::string errnoText(int e) { return std::strerror(e); }

// Field 22 of /proc/<pid>/stat (the start time, clock ticks since boot), and field 3 (the
// state); 0 / '?' when unreadable. Together with the pid it names a process: a pid reused by
// another process, or a pid of another pid namespace, has another start time.
struct ProcStat {
  uint64_t start_time = 0;
  char state = '?';
};
ProcStat procStat(pid_t pid) {
  ProcStat out;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = s.rfind(')');
  if (close == std::string::npos) return out;
  std::istringstream rest(s.substr(close + 1));
  std::string tok;
  for (int field = 3; rest >> tok; ++field) {
    if (field == 3) out.state = tok.empty() ? '?' : tok[0];
    if (field == 22) {
      out.start_time = std::strtoull(tok.c_str(), nullptr, 10);
      break;
    }
  }
  return out;
}

int pidfdOpen(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

// Removes the segment's name when it goes out of scope, unless released: the guarantee that no
// path out of create() leaves the name in /dev/shm (the creator's from its creation, the others'
// from the moment they read it; a name removed twice is ENOENT, harmless).
struct Unlinker {
  std::string name;
  ~Unlinker() {
    if (!name.empty()) shm_unlink(name.c_str());
  }
  void now() {
    if (!name.empty()) shm_unlink(name.c_str());
    name.clear();
  }
};

// XIRANG_SHM_BYTES, checked: an integer (K/M/G suffixes) from one page to 1 GiB. Throws
// std::invalid_argument naming the knob, the value and the range.
uint64_t shmBytesKnob() {
  const int64_t v = env::getInt("XIRANG_SHM_BYTES");  // throws for a non-integer, naming the knob
  constexpr int64_t kMax = int64_t{1} << 30;
  if (v < static_cast<int64_t>(kPage) || v > kMax)
    throw std::invalid_argument("xirang: XIRANG_SHM_BYTES='" + env::get("XIRANG_SHM_BYTES") +
                                "' is out of range: the shared-memory slot per local rank is " + std::to_string(kPage) +
                                " (one page) to " + std::to_string(kMax) + " bytes (1 GiB)");
  return static_cast<uint64_t>(v);
}

// Store values starting with this mark carry an invalid-argument error (a bad knob on that rank)
// rather than a reason why shared memory is unavailable: every local rank throws
// std::invalid_argument instead of falling back to TCP.
constexpr char kInvalidMark = '?';

// Rank `peer`'s set-up key: TransportError(peer) as soon as `gone(peer)` (may be empty) says it
// is gone (a rank that dies during the set-up, e.g. during an elastic rebuild, must not hold its
// local peers until the deadline), TimeoutError(peer) at `deadline`.
std::string getOrTimeout(Store& store, const std::string& key, Deadline deadline, int peer, const char* step,
                         const std::function<std::string(int)>& gone) {
  const std::string late = std::string("xirang: shared memory set-up: rank ") + std::to_string(peer) + " did not " +
                           step + " before the deadline";
  if (gone) {
    const std::string why = pollForKey(store, key, deadline, [&] { return gone(peer); }, late, peer);
    if (!why.empty())
      throw TransportError(std::string("xirang: shared memory set-up: rank ") + std::to_string(peer) +
                               " is gone before it could " + step + ": " + why,
                           peer);
  }
  try {
    return store.get(key, deadline);
  } catch (const std::exception& e) {
    throw TimeoutError(late + " (" + e.what() + ")", peer);
  }
}

// The creator failed before it published the token: remove the segment it meant to create, if
// it said its name (a 32-digit hex token; anything else is left alone). Never throws.
void removeIntended(Store& store, const ShmOptions& opts) {
  try {
    const std::string k = opts.key_prefix + "/name";
    if (!store.check(k)) return;
    const std::string v = store.get(k, Clock::now() + std::chrono::seconds(1));
    if (v.size() == 32 && std::all_of(v.begin(), v.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); }))
      shm_unlink((opts.name_prefix + v).c_str());
  } catch (const std::exception&) {
  }
}

}  // namespace

struct ShmDomain::Header {
  uint64_t magic;
  uint32_t version;
  uint32_t local_size;
  uint64_t slot_bytes;
  uint64_t header_bytes;
  uint64_t total_bytes;
  uint32_t mapped;       // atomic: local ranks that mapped the segment
  uint32_t abort_state;  // atomic: 0 none, 1 being written, 2 recorded
  int32_t abort_rank;
  uint32_t abort_len;
  char abort_msg[kAbortBytes];
};

struct alignas(128) ShmDomain::Ctrl {
  uint32_t seq;       // atomic futex word: phases this rank has published
  uint32_t sleepers;  // atomic: waiters in FUTEX_WAIT on seq (publish wakes only if any)
  int32_t pid;
  uint32_t reserved;
  uint64_t start_time;
  ShmOpRecord records[2];
};

ShmDomain::Header& ShmDomain::header() const { return *reinterpret_cast<Header*>(base_); }
ShmDomain::Ctrl& ShmDomain::ctrl(int index) const {
  return reinterpret_cast<Ctrl*>(base_ + ctrl_off_)[index];
}
ShmOpRecord& ShmDomain::record(int index, int parity) const { return ctrl(index).records[parity & 1]; }
uint64_t* ShmDomain::sizes(int index, int parity) const {
  const uint64_t n = ranks_.size();
  return reinterpret_cast<uint64_t*>(base_ + sizes_off_) + (static_cast<uint64_t>(index) * 2 + (parity & 1)) * 2 * n;
}

int ShmDomain::indexOf(int group_rank) const {
  auto it = std::lower_bound(ranks_.begin(), ranks_.end(), group_rank);
  return it != ranks_.end() && *it == group_rank ? static_cast<int>(it - ranks_.begin()) : -1;
}

std::unique_ptr<ShmDomain> ShmDomain::create(int rank, std::vector<int> local_ranks, Store& store,
                                             const ShmOptions& opts, Deadline deadline) {
  std::sort(local_ranks.begin(), local_ranks.end());
  if (local_ranks.empty() || std::adjacent_find(local_ranks.begin(), local_ranks.end()) != local_ranks.end() ||
      local_ranks.front() < 0)
    throw std::invalid_argument("xirang: shared memory: the local ranks must be distinct group ranks");
  if (opts.name_prefix.empty() || opts.name_prefix[0] != '/' || opts.name_prefix.find('/', 1) != std::string::npos)
    throw std::invalid_argument("xirang: shared memory: bad segment name prefix '" + opts.name_prefix + "'");
  std::unique_ptr<ShmDomain> d(new ShmDomain());
  d->rank_ = rank;
  d->ranks_ = local_ranks;
  d->index_ = d->indexOf(rank);
  if (d->index_ < 0)
    throw std::invalid_argument("xirang: shared memory: rank " + std::to_string(rank) + " is not among its local ranks");
  d->peer_gone_ = opts.peer_gone;
  const int n = d->size();
  const int creator = local_ranks.front();
  const std::string me = "rank " + std::to_string(rank);
  auto key = [&](const std::string& what, int r) { return opts.key_prefix + "/" + what + "/" + std::to_string(r); };

  // The layout, computed by the creator and checked by everyone else against the file.
  auto layout = [&](uint64_t slot) {
    d->ctrl_off_ = roundUp(sizeof(Header), alignof(Ctrl));
    d->sizes_off_ = d->ctrl_off_ + sizeof(Ctrl) * static_cast<uint64_t>(n);
    const uint64_t header_bytes = roundUp(d->sizes_off_ + static_cast<uint64_t>(n) * 2 * 2 * n * sizeof(uint64_t), kPage);
    uint64_t data = 0;
    if (__builtin_mul_overflow(slot, static_cast<uint64_t>(n), &data) || data > (uint64_t{1} << 56))
      throw ShmUnavailable("xirang: shared memory: " + std::to_string(n) + " slots of " + std::to_string(slot) +
                               " bytes do not fit in a segment",
                           rank);
    return std::make_pair(header_bytes, header_bytes + data);
  };
  auto mapFd = [&](int fd, uint64_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    const int e = errno;
    close(fd);
    if (p == MAP_FAILED) return errnoText(e);
    d->base_ = static_cast<uint8_t*>(p);
    d->map_bytes_ = bytes;
    return std::string();
  };
  auto finishSelf = [&](uint64_t slot, uint64_t header_bytes) {
    d->slot_bytes_ = slot;
    d->data_ = d->base_ + header_bytes;
    Ctrl& c = d->ctrl(d->index_);
    c.pid = static_cast<int32_t>(getpid());
    c.start_time = procStat(getpid()).start_time;
    std::atomic_ref<uint32_t>(d->header().mapped).fetch_add(1, std::memory_order_acq_rel);
  };

  // Every rank checks its own XIRANG_SHM_BYTES (the creator's value is the one used): a bad value
  // is an error on every local rank, passed on through the store so that nobody waits for it.
  uint64_t knob = opts.slot_bytes;
  std::string bad_knob;
  if (knob == 0) {
    try {
      knob = shmBytesKnob();
    } catch (const std::invalid_argument& e) {
      bad_knob = e.what();
    }
  }
  auto invalid = [&](int who, const std::string& msg) {
    return std::invalid_argument("xirang: shared memory set-up: rank " + std::to_string(who) + ": " + msg);
  };

  Unlinker unlinker;
  if (rank == creator) {
    if (!bad_knob.empty()) {
      store.set(opts.key_prefix + "/token", kInvalidMark + bad_knob);
      throw invalid(rank, bad_knob);
    }
    const uint64_t slot = roundUp(std::max<uint64_t>({knob, kPage, 64 * static_cast<uint64_t>(n + 1)}), kPage);
    std::string why;
    try {
      const auto [header_bytes, total] = layout(slot);
      const std::string token = keyToHex(randomKey());
      // The name before the file: peers that see this rank gone before it published the token
      // remove the name (a creator killed while it reserved the pages left it in /dev/shm).
      store.set(opts.key_prefix + "/name", token);
      const std::string name = opts.name_prefix + token;
      const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        why = "cannot create the segment " + name + " (" + errnoText(errno) + ")";
      } else {
        unlinker.name = name;
        d->name_ = name;
        // Reserve the pages now: on a full /dev/shm ftruncate would succeed and the first
        // write to a missing page would kill the process with SIGBUS.
        const int e = posix_fallocate(fd, 0, static_cast<off_t>(total));
        if (e != 0) {
          close(fd);
          why = "cannot reserve " + std::to_string(total) + " bytes (" + std::to_string(n) + " local ranks x " +
                std::to_string(slot) + " bytes) in /dev/shm (" + errnoText(e) +
                "): give /dev/shm more room (docker run --shm-size) or lower XIRANG_SHM_BYTES";
        } else {
          why = mapFd(fd, total);
          if (!why.empty()) why = "cannot map the segment (" + why + ")";
        }
      }
      if (why.empty()) {
        Header& h = d->header();
        h.magic = kMagicShm;
        h.version = kShmVersion;
        h.local_size = static_cast<uint32_t>(n);
        h.slot_bytes = slot;
        h.header_bytes = header_bytes;
        h.total_bytes = total;
        finishSelf(slot, header_bytes);
      }
    } catch (const ShmUnavailable& e) {
      why = e.what();
    }
    store.set(opts.key_prefix + "/token", why.empty() ? d->name_.substr(opts.name_prefix.size()) : "!" + why);
    if (!why.empty()) throw ShmUnavailable("xirang: shared memory unavailable: " + me + ": " + why, rank);
  } else {
    if (!bad_knob.empty()) {
      store.set(key("mapped", rank), kInvalidMark + bad_knob);
      throw invalid(rank, bad_knob);
    }
    std::string token;
    try {
      token = getOrTimeout(store, opts.key_prefix + "/token", deadline, creator, "create the segment", opts.peer_gone);
    } catch (...) {
      removeIntended(store, opts);
      throw;
    }
    if (!token.empty() && token[0] == kInvalidMark) throw invalid(creator, token.substr(1));
    if (!token.empty() && token[0] == '!')
      throw ShmUnavailable("xirang: shared memory unavailable: rank " + std::to_string(creator) + ": " + token.substr(1),
                           creator);
    d->name_ = opts.name_prefix + token;
    // Every rank that knows the name removes it on its way out (as the creator does): a creator
    // killed before it removed the name (during the others' set-up) must not leave it behind.
    unlinker.name = d->name_;
    std::string why;
    const int fd = shm_open(d->name_.c_str(), O_RDWR, 0);
    struct stat st {};
    if (fd < 0) {
      why = "cannot open the segment " + d->name_ + " that rank " + std::to_string(creator) + " created (" +
            errnoText(errno) + "): this rank does not share /dev/shm with it (a container of its own?)";
    } else if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(Header))) {
      why = "the segment " + d->name_ + " is too short";
      close(fd);
    } else {
      why = mapFd(fd, static_cast<uint64_t>(st.st_size));
      if (!why.empty()) why = "cannot map the segment (" + why + ")";
    }
    if (why.empty()) {
      const Header& h = d->header();
      if (h.magic != kMagicShm || h.version != kShmVersion || h.local_size != static_cast<uint32_t>(n)) {
        why = "the segment's header does not match (version " + std::to_string(h.version) + ", " +
              std::to_string(h.local_size) + " local ranks; expected version " + std::to_string(kShmVersion) + ", " +
              std::to_string(n) + ")";
      } else {
        try {
          const auto [header_bytes, total] = layout(h.slot_bytes);
          if (h.header_bytes != header_bytes || h.total_bytes != total || total != d->map_bytes_ ||
              h.slot_bytes == 0 || h.slot_bytes % kPage != 0)
            why = "the segment's layout does not match its size";
          else
            finishSelf(h.slot_bytes, header_bytes);
        } catch (const ShmUnavailable& e) {
          why = e.what();
        }
      }
    }
    store.set(key("mapped", rank), why.empty() ? "ok" : why);
  }

  // Every local rank has mapped the segment or said why not: remove its name.
  auto collect = [&](const char* what, const char* step) {
    std::string problems;
    int first_bad = -1;
    for (int r : local_ranks) {
      if (std::string(what) == "mapped" && r == creator) continue;
      const std::string v = getOrTimeout(store, key(what, r), deadline, r, step, opts.peer_gone);
      if (!v.empty() && v[0] == kInvalidMark) throw invalid(r, v.substr(1));
      if (v != "ok") {
        problems += (problems.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + v);
        if (first_bad < 0) first_bad = r;
      }
    }
    if (!problems.empty()) throw ShmUnavailable("xirang: shared memory unavailable: " + problems, first_bad);
  };
  try {
    collect("mapped", "map the segment");
  } catch (...) {
    unlinker.now();
    throw;
  }
  unlinker.now();

  // Do the mappings share memory, and can this rank watch every peer's process?
  std::string why;
  const uint32_t mapped = std::atomic_ref<uint32_t>(d->header().mapped).load(std::memory_order_acquire);
  if (mapped != static_cast<uint32_t>(n))
    why = "the mappings are not shared (" + std::to_string(mapped) + " of " + std::to_string(n) +
          " local ranks seen in this rank's mapping)";
  d->pidfds_.assign(static_cast<size_t>(n), -1);
  const uint64_t own_start = procStat(getpid()).start_time;
  for (int j = 0; j < n && why.empty(); ++j) {
    const Ctrl& c = d->ctrl(j);
    const pid_t pid = c.pid;
    if (j == d->index_ || pid == getpid()) continue;
    const std::string who = "rank " + std::to_string(local_ranks[j]) + "'s process (pid " + std::to_string(pid) + ")";
    const int fd = pid > 0 ? pidfdOpen(pid) : -1;
    if (fd >= 0) {
      d->pidfds_[j] = fd;
    } else if (pid <= 0 || errno == ESRCH || (kill(pid, 0) != 0 && errno == ESRCH)) {
      why = who + " is not visible from here (another pid namespace)";
      break;
    }
    if (own_start != 0 && c.start_time != 0 && procStat(pid).start_time != c.start_time)
      why = who + " is another process here (another pid namespace)";
  }
  store.set(key("checked", rank), why.empty() ? "ok" : why);
  collect("checked", "check its peers");
  return d;
}

ShmDomain::~ShmDomain() {
  for (int fd : pidfds_)
    if (fd >= 0) close(fd);
  if (base_) munmap(base_, map_bytes_);
}

uint32_t ShmDomain::publish() {
  Ctrl& c = ctrl(index_);
  std::atomic_ref<uint32_t> seq(c.seq);
  const uint32_t v = seq.load(std::memory_order_relaxed) + 1;
  // seq_cst store, then seq_cst load of sleepers; a waiter increments sleepers, then loads seq:
  // one of the two sees the other, so a sleeper is never left asleep.
  seq.store(v, std::memory_order_seq_cst);
  if (std::atomic_ref<uint32_t>(c.sleepers).load(std::memory_order_seq_cst) != 0) futexWake(&c.seq);
  return v;
}

bool ShmDomain::processGone(int index) const {
  if (index == index_) return false;
  const pid_t pid = ctrl(index).pid;
  if (pid == getpid()) return false;  // ranks as threads of this process
  const int fd = pidfds_.empty() ? -1 : pidfds_[static_cast<size_t>(index)];
  if (fd >= 0) {
    pollfd p{fd, POLLIN, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR));
  }
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  const ProcStat st = procStat(pid);
  return st.state == 'Z' || st.state == 'X';  // exited, not yet reaped
}

std::string ShmDomain::abortReason() const {
  const Header& h = header();
  std::atomic_ref<uint32_t> state(const_cast<uint32_t&>(h.abort_state));
  uint32_t s = state.load(std::memory_order_acquire);
  if (s == 0) return "";
  for (int i = 0; s == 1 && i < 1000; ++i) {  // the aborting rank is writing the message
    std::this_thread::sleep_for(std::chrono::microseconds(1));
    s = state.load(std::memory_order_acquire);
  }
  if (s != 2) return "a local rank aborted";
  const size_t len = std::min<size_t>(h.abort_len, kAbortBytes);
  return "rank " + std::to_string(h.abort_rank) + " aborted: " + std::string(h.abort_msg, len);
}

void ShmDomain::abort(const std::string& why) {
  if (!base_) return;
  Header& h = header();
  uint32_t expected = 0;
  if (std::atomic_ref<uint32_t>(h.abort_state).compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    h.abort_rank = rank_;
    const size_t len = std::min(why.size(), kAbortBytes);
    std::memcpy(h.abort_msg, why.data(), len);
    h.abort_len = static_cast<uint32_t>(len);
    std::atomic_ref<uint32_t>(h.abort_state).store(2, std::memory_order_release);
  }
  wakeAll();
}

void ShmDomain::interrupt(const std::string& why) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (interrupt_why_.empty()) interrupt_why_ = why.empty() ? "interrupted" : why;
  }
  interrupted_.store(true);
  wakeAll();
}

void ShmDomain::wakeAll() {
  for (int j = 0; j < size(); ++j) futexWake(&ctrl(j).seq);
}

void ShmDomain::checkHealth(int waiting_for, const char* what) {
  const int peer = ranks_[static_cast<size_t>(waiting_for)];
  if (interrupted_.load()) {
    std::lock_guard<std::mutex> g(mu_);
    throw TransportError("xirang: shared memory closed: " + interrupt_why_, -1);
  }
  const std::string aborted = abortReason();
  if (!aborted.empty()) throw TransportError("xirang: shared memory: " + aborted, header().abort_rank);
  for (int j = 0; j < size(); ++j) {
    if (j == index_) continue;
    const int r = ranks_[static_cast<size_t>(j)];
    if (processGone(j))
      throw TransportError("xirang: shared memory: rank " + std::to_string(r) + " (pid " + std::to_string(ctrl(j).pid) +
                               ") exited; rank " + std::to_string(rank_) + " was waiting for rank " +
                               std::to_string(peer) + " in " + what,
                           r);
    if (peer_gone_) {
      const std::string gone = peer_gone_(r);
      if (!gone.empty())
        throw TransportError("xirang: shared memory: rank " + std::to_string(r) + " is gone (" + gone + "); rank " +
                                 std::to_string(rank_) + " was waiting for rank " + std::to_string(peer) + " in " + what,
                             r);
    }
  }
}

void ShmDomain::waitFor(int index, uint32_t count, Deadline deadline, const char* what) {
  Ctrl& c = ctrl(index);
  std::atomic_ref<uint32_t> seq(c.seq);
  auto reached = [count](uint32_t v) { return static_cast<int32_t>(v - count) >= 0; };
  if (reached(seq.load(std::memory_order_acquire))) return;
  const auto spin_end = Clock::now() + kSpin;
  for (int i = 1;; ++i) {
    cpuRelax();
    if (reached(seq.load(std::memory_order_acquire))) return;
    if ((i & 15) == 0 && Clock::now() >= spin_end) break;
  }
  std::atomic_ref<uint32_t> sleepers(c.sleepers);
  // A peer that published the count and then left or died (destroy_process_group right after
  // its last barrier) has written everything this wait is for: what it published counts even
  // if the health check, which looks at every peer, fails meanwhile.
  auto health = [&] {
    try {
      checkHealth(index, what);
    } catch (const TransportError&) {
      if (reached(seq.load(std::memory_order_acquire))) return true;
      throw;
    }
    return false;
  };
  // The peers' processes and the liveness callback (TCP's peerGone: store round trips, 100s of
  // microseconds) are checked once a slice has passed, not before the first sleep: a wait that
  // ends within a slice does not pay for them. An abort or interrupt already recorded is seen now.
  if ((interrupted_.load() || std::atomic_ref<uint32_t>(header().abort_state).load(std::memory_order_acquire) != 0) &&
      health())
    return;
  auto checked = Clock::now();
  for (;;) {
    const auto now = Clock::now();
    if (now >= deadline)
      throw TimeoutError("xirang: shared memory: timed out in " + std::string(what) + "; rank " + std::to_string(rank_) +
                             " was still waiting for rank " + std::to_string(ranks_[static_cast<size_t>(index)]),
                         ranks_[static_cast<size_t>(index)]);
    const auto slice = std::min<std::chrono::nanoseconds>(kSlice, deadline - now);
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t v = seq.load(std::memory_order_seq_cst);
    if (!reached(v)) futexWait(&c.seq, v, slice);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(seq.load(std::memory_order_acquire))) return;
    // An abort or interrupt wakes the waiters: check those at every wake-up, the peers'
    // processes and the liveness callback once a slice.
    if (interrupted_.load() || std::atomic_ref<uint32_t>(header().abort_state).load(std::memory_order_acquire) != 0 ||
        Clock::now() - checked >= kSlice) {
      if (health()) return;
      checked = Clock::now();
    }
  }
}

void ShmDomain::waitAll(uint32_t count, Deadline deadline, const char* what) {
  for (int j = 0; j < size(); ++j)
    if (j != index_) waitFor(j, count, deadline, what);
}

}  // namespace xirang::transport
