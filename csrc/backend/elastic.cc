#include "backend/elastic.h"

#include <c10/util/Exception.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <cstring>
#include <sstream>

#include "backend/tensors.h"
#include "core/env.h"

namespace xirang {

namespace {
// A failure report starting with this fails every rank instead of starting an agreement.
constexpr const char* kFatal = "fatal: ";
}  // namespace

Membership::Membership(int rank, int size, const XirangConfig& cfg, std::shared_ptr<transport::Store> store,
                       std::string key_ns, Comm comm, Callbacks cb)
    : rank_(rank),
      size_(size),
      cfg_(cfg),
      store_(std::move(store)),
      key_ns_(std::move(key_ns)),
      prefix_(key_ns_ + "/elastic"),
      ifname_(env::get("XIRANG_SOCKET_IFNAME")),
      handshake_timeout_(env::getInt("XIRANG_HANDSHAKE_TIMEOUT_MS")),
      cb_(std::move(cb)),
      comm_(std::move(comm)) {
  const std::string key_file = env::get("XIRANG_AUTH_KEY_FILE");
  if (!key_file.empty()) {
    try {
      auth_key_ = transport::loadKeyFile(key_file);
    } catch (const std::exception& e) {
      XR_CHECK(rank_, false, e.what());
    }
  }
  local_mode_ = env::get("XIRANG_TRANSPORT_LOCAL");
  TORCH_CHECK_VALUE(local_mode_ == "auto" || local_mode_ == "shm" || local_mode_ == "tcp", "xirang rank ", rank_,
                    ": XIRANG_TRANSPORT_LOCAL must be auto, shm or tcp, got '", local_mode_, "'");
  try {
    if (!cfg_.join)  // a spare gets the transport of the epoch that admits it (join)
      tcp_ = std::make_shared<transport::Tcp>(rank_, size_, store_, transportOptions(key_ns_),
                                              Clock::now() + cfg_.timeout);
  } catch (const std::exception& e) {
    XR_CHECK(rank_, false, "creating group '", cfg_.group_name, "' failed: ", e.what());
  }
  for (int r = 0; r < size_; ++r) live_.push_back(r);
  if (!cfg_.join) shm_ = makeShm(live_, 0, tcp_);
  comm_.link = tcp_.get();
  comm_.shm = shm_.get();
  comm_.rank = rank_;
  info_.live = live_;
  info_.ring = comm_.ring;
}

Membership::~Membership() { stop(); }

transport::TcpOptions Membership::transportOptions(const std::string& key_prefix) const {
  transport::TcpOptions o;
  o.ifname = ifname_;
  o.handshake_timeout = handshake_timeout_;
  o.key_prefix = key_prefix;
  o.key = auth_key_;
  return o;
}

namespace {
std::string rankList(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? " " : "") + std::to_string(ranks[i]);
  return s + "]";
}
}  // namespace

std::shared_ptr<transport::ShmDomain> Membership::makeShm(const std::vector<int>& members, uint64_t epoch,
                                                          const std::shared_ptr<transport::Tcp>& tcp,
                                                          const std::vector<int>& beating,
                                                          const std::vector<int>& joining) const {
  if (local_mode_ == "tcp" || static_cast<int>(cfg_.hosts.size()) != size_ || !tcp) return nullptr;
  const std::string& host = cfg_.hosts[static_cast<size_t>(rank_)];
  std::vector<int> local;
  for (int r : members)
    if (r >= 0 && r < size_ && cfg_.hosts[static_cast<size_t>(r)] == host) local.push_back(r);
  if (local.size() < 2) return nullptr;  // alone on its host: nothing to share
  const std::string who = "ranks " + rankList(local) + " on host '" + host + "' of group '" + cfg_.group_name + "'";
  transport::ShmOptions o;
  // One domain per host: the lowest local rank names it (hosts set theirs up concurrently).
  o.key_prefix = key_ns_ + "/shm/" + std::to_string(epoch) + "/" + std::to_string(local.front());
  // The TCP control path tells a waiter that a peer left or died (its exit record, its closed
  // connection or listener) where the domain's own process checks cannot (another pid namespace).
  // With XIRANG_AUTH_KEY_FILE the segment's name carries a MAC of the key: a rank holding another
  // key looks for another name, never maps this one, and the group falls back to TCP, whose
  // handshake refuses it (the store, which carries the token, is not the trust root then). The
  // segment's mode 0600 keeps other users out either way.
  if (auth_key_) {
    static constexpr char kWhat[] = "xirang shm segment name";
    char mac[17];
    std::snprintf(mac, sizeof(mac), "%016llx",
                  static_cast<unsigned long long>(transport::siphash24(*auth_key_, kWhat, sizeof(kWhat) - 1)));
    o.name_prefix = std::string("/xirang-") + mac + "-";
  }
  std::weak_ptr<transport::Tcp> weak = tcp;
  // A survivor that dies during a rebuild has no listener of the new epoch to probe yet: its
  // heartbeat says it (the waits call this from the set-up's thread only).
  const auto period = heartbeatPeriod();
  auto hb = std::make_shared<elastic::HeartbeatWatch>(*store_, prefix_, period);
  auto jb = std::make_shared<elastic::HeartbeatWatch>(*store_, prefix_, period, /*spares=*/true);
  // The beats are watched during the set-up only (the domain keeps peer_gone for its waits, and a
  // spare's join beat stops once it is in).
  auto setting_up = std::make_shared<std::atomic<bool>>(true);
  struct SetUpDone {
    std::shared_ptr<std::atomic<bool>> flag;
    ~SetUpDone() { flag->store(false); }
  } set_up_done{setting_up};
  o.peer_gone = [weak, hb, jb, beating, joining, setting_up](int peer) -> std::string {
    auto t = weak.lock();
    if (!t) return "the group's TCP transport is closed";
    std::string why = t->peerGone(peer);
    if (!setting_up->load()) return why;
    auto in = [peer](const std::vector<int>& v) { return std::find(v.begin(), v.end(), peer) != v.end(); };
    if (why.empty() && in(beating) && hb->stale(peer))
      why = "rank " + std::to_string(peer) + " missed its heartbeats for " + std::to_string(hb->silentFor(peer)) + " s";
    if (why.empty() && in(joining) && jb->stale(peer))
      why = "the spare for rank " + std::to_string(peer) + " stopped beating " + std::to_string(jb->silentFor(peer)) +
            " s ago";
    return why;
  };
  std::string unavailable;
  try {
    return std::shared_ptr<transport::ShmDomain>(
        transport::ShmDomain::create(rank_, local, *store_, o, Clock::now() + cfg_.timeout));
  } catch (const transport::ShmUnavailable& e) {
    unavailable = e.what();
  } catch (const std::invalid_argument& e) {  // a local rank's bad XIRANG_SHM_BYTES: ValueError
    TORCH_CHECK_VALUE(false, rankPrefix(rank_), "creating the shared-memory domain of ", who, " failed: ", e.what());
  } catch (const transport::TransportError& e) {
    // Every local rank waits for the gone rank's keys, so all of them end up here alike.
    XR_CHECK(rank_, epoch > 0 && e.peer() >= 0 && !dynamic_cast<const transport::TimeoutError*>(&e),
             "creating the shared-memory domain of ", who, " failed: ", e.what());
    env::log(env::Level::Warn, rank_,
             "epoch " + std::to_string(epoch) + ": " + e.what() + "; this epoch runs over TCP, and its first operation " +
                 "finds the loss");
    return nullptr;
  } catch (const std::exception& e) {
    XR_CHECK(rank_, false, "creating the shared-memory domain of ", who, " failed: ", e.what());
  }
  XR_CHECK(rank_, local_mode_ != "shm", "XIRANG_TRANSPORT_LOCAL=shm, but shared memory cannot serve the ", who, ": ",
           unavailable, " (XIRANG_TRANSPORT_LOCAL=auto falls back to TCP)");
  env::log(env::Level::Info, rank_, "shared memory unavailable for the " + who + " (" + unavailable + "): using TCP");
  return nullptr;
}

std::vector<int> Membership::shmRanks() const {
  std::lock_guard<std::mutex> g(mu_);
  return shm_ ? shm_->ranks() : std::vector<int>{};
}

uint64_t Membership::start() {
  if (!cfg_.elastic) return 0;
  TORCH_CHECK(cfg_.heartbeat_s > 0, "xirang: XIRANG_HEARTBEAT_S must be > 0, got ", cfg_.heartbeat_s);
  if (size_ <= 1) return 0;
  try {
    store_->add(elastic::heartbeatKey(prefix_, rank_), 1);
  } catch (const std::exception& e) {
    XR_CHECK(rank_, false, "elastic mode needs a store with add/compareSet: ", e.what());
  }
  uint64_t seq = 0;
  if (cfg_.join) {
    try {
      seq = join();
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      XR_CHECK(rank_, false, "joining group '", cfg_.group_name, "' failed: ", e.what());
    }
  }
  hb_thread_ = std::thread([this] { heartbeatLoop(); });
  return seq;
}

void Membership::stop() {
  stopHeartbeat();
  hb_cv_.notify_all();
  if (hb_thread_.joinable() && hb_thread_.get_id() != std::this_thread::get_id()) hb_thread_.join();
}

void Membership::stopHeartbeat() {
  std::lock_guard<std::mutex> g(hb_mu_);
  hb_stop_ = true;
}

void Membership::close() {
  std::shared_ptr<transport::Tcp> tcp;
  std::shared_ptr<transport::ShmDomain> shm;
  {
    std::lock_guard<std::mutex> g(mu_);
    tcp = tcp_;
    shm = std::move(shm_);  // the communication thread has stopped: nobody waits on it
    comm_.shm = nullptr;
  }
  if (tcp) {
    // A peer still waiting for this rank's connection fails now, not at its timeout (unless every
    // peer is gone: a same-host peer's exit is seen by the shared-memory domain's process watch).
    tcp->leave([&shm](int r) {
      const int i = shm ? shm->indexOf(r) : -1;
      return i >= 0 && shm->processGone(i);
    });
    tcp->close();
  }
  shm.reset();  // unmaps (the segment was unlinked when it was created)
}

std::string Membership::address() const {
  std::lock_guard<std::mutex> g(mu_);
  return tcp_ ? tcp_->address() : "";
}

std::string Membership::peerGone(int peer) const {
  std::shared_ptr<transport::Tcp> tcp;
  {
    std::lock_guard<std::mutex> g(mu_);
    tcp = tcp_;
  }
  return tcp ? tcp->peerGone(peer) : std::string();
}

// Not under mu_: this may run on the caller's thread (point-to-point) while the transport calls
// back into the group.
void Membership::abort(const std::string& why) {
  std::shared_ptr<transport::Tcp> tcp;
  std::shared_ptr<transport::ShmDomain> shm;
  {
    std::lock_guard<std::mutex> g(mu_);
    tcp = tcp_;
    shm = shm_;
  }
  if (shm) shm->abort(why);
  if (tcp) tcp->abort(why);
}

std::string Membership::text(const elastic::Decision* d) const {
  std::ostringstream o;
  const auto& live = d ? d->live : live_;
  o << "epoch " << (d ? d->epoch : epoch_.load()) << ", live ranks [";
  for (size_t i = 0; i < live.size(); ++i) o << (i ? " " : "") << live[i];
  o << "] of " << size_;
  return o.str();
}

MembershipChanged Membership::unavailable(const std::string& desc) const {
  return MembershipChanged(desc + " is not available after a membership change (" + text() +
                           "): only allreduce, broadcast, barrier and the hook's operation run on the shrunken ring; "
                           "create a new group over the live ranks for the others");
}

bool Membership::live(int rank) const { return std::find(comm_.ring.begin(), comm_.ring.end(), rank) != comm_.ring.end(); }

bool Membership::changedSince(uint64_t epoch) const {
  return cfg_.elastic && (epoch_.load() != epoch || signal_.load());
}

transport::P2P& Membership::p2p(const std::string& desc) {
  std::lock_guard<std::mutex> g(mu_);
  if (cfg_.elastic && static_cast<int>(live_.size()) < size_) throw unavailable(desc);
  return tcp_->p2p();
}

MembershipInfo Membership::info() const {
  std::lock_guard<std::mutex> g(mu_);
  return info_;
}

void Membership::setCallback(std::function<void()> fn) {
  std::lock_guard<std::mutex> g(mu_);
  callback_ = std::move(fn);
}

// ---------------------------------------------------------------- running an operation

void Membership::run(OpCtx& ctx, const OpFn& fn, std::chrono::milliseconds timeout, const SaveFn& save,
                     const std::string& name, const std::string& what) {
  const uint64_t seq = ctx.seq;
  auto desc = [&] { return rankPrefix(rank_) + what; };
  if (signal_.load()) recover("a failure was reported before " + name + " started");
  auto voided = [&] {
    for (const auto& [done, fence] : void_ranges_)
      if (seq > done && seq <= fence) return true;
    return false;
  };
  auto changed = [&](const std::string& why) {
    return MembershipChanged(desc() + " was interrupted by a membership change (" + why + ", now " + text() +
                             "); its result is void on every survivor");
  };
  if (seq != 0 && voided() && !save) throw changed("it was issued before the change");
  if (static_cast<int>(live_.size()) < size_) {
    const bool ok = ctx.op == transport::OpKind::Allreduce || ctx.op == transport::OpKind::AllreduceEF ||
                    ctx.op == transport::OpKind::Broadcast || ctx.op == transport::OpKind::Barrier ||
                    ctx.op == transport::OpKind::Admit;
    if (!ok) throw unavailable(desc());
  }
  std::function<void()> restore = save ? save() : nullptr;
  for (int attempt = 0;; ++attempt) {
    try {
      if (attempt > 0 && restore) restore();
      ctx.deadline = Clock::now() + timeout;
      fn(ctx);
      if (seq == 0) return;  // point-to-point: no completion round
      done_seq_ = seq;       // this rank holds the result
      if (ctx.op != transport::OpKind::Admit) ack(comm_, ctx);  // admission: the store is its agreement
      return;
    } catch (const transport::MismatchError&) {
      throw;  // the program's bug, not a lost rank: fail the group (every rank gets the error)
    } catch (const transport::TransportError& e) {
      std::string why = e.what();
      elastic::Decision d = recover("rank " + std::to_string(rank_) + ", " + what + ": " + why);
      if (seq != 0 && seq <= d.done_seq) return;  // every survivor holds the result
      if (seq == 0 || !save)
        throw changed("epoch " + std::to_string(d.epoch - 1) + " -> " + std::to_string(d.epoch) + ": " +
                      info_.last_failure);
      env::log(env::Level::Info, rank_, "retrying " + what + " on the new ring");
    }
  }
}

void Membership::recoverIdle() {
  try {
    recover("rank " + std::to_string(rank_) + " was idle");
  } catch (const std::exception& e) {
    cb_.poison(rankPrefix(rank_) + e.what());
  }
}

void Membership::failGroup(const std::string& msg) {
  if (!cfg_.elastic) return;
  // The survivors would otherwise drop this rank and go on; a disagreement about the collective
  // is a bug every rank must hear about.
  try {
    elastic::reportFailure(*store_, prefix_, epoch_.load(), std::string(kFatal) + msg);
  } catch (...) {
  }
}

// ---------------------------------------------------------------- epochs

// Switches to the epoch `d` describes: a fresh listener and connections under the epoch's store
// namespace and secret `key`, only d.live admitted; the ring keeps its (topology) order over
// d.live. Runs on the communication thread (or in start() of a joining rank), then calls the
// membership callback.
void Membership::installEpoch(const elastic::Decision& d, const transport::Key128& key, int source,
                              const std::string& reason, double agreement_s, Clock::time_point t0,
                              const std::vector<int>& beating, const std::vector<int>& joining) {
  transport::TcpOptions topts = transportOptions(key_ns_ + "/e" + std::to_string(d.epoch));
  topts.members = d.live;
  topts.key = key;
  // Every member of the epoch can compute its group id (rank 0 may be gone): from its key.
  topts.group_id = transport::siphash24(key, "xirang-epoch-group", 18);
  auto fresh = std::make_shared<transport::Tcp>(rank_, size_, store_, topts, Clock::now() + cfg_.timeout);
  if (d.epoch > 0 && source < 0) {  // a rank lost during the rebuild (tests)
    static const std::string die = env::get("XIRANG_TEST_DIE_IN_REBUILD");
    if (!die.empty() && die == std::to_string(rank_)) ::kill(::getpid(), SIGKILL);
  }
  std::shared_ptr<transport::ShmDomain> fresh_shm = makeShm(d.live, d.epoch, fresh, beating, joining);
  std::vector<int> base = cfg_.ring;
  if (base.empty())
    for (int r = 0; r < size_; ++r) base.push_back(r);
  std::vector<int> ring;
  for (int r : base)
    if (std::find(d.live.begin(), d.live.end(), r) != d.live.end()) ring.push_back(r);
  std::shared_ptr<transport::Tcp> old;
  std::shared_ptr<transport::ShmDomain> old_shm;
  std::function<void()> cb;
  {
    std::lock_guard<std::mutex> g(mu_);
    old = std::move(tcp_);
    tcp_ = std::move(fresh);
    old_shm = std::move(shm_);
    shm_ = std::move(fresh_shm);
    comm_.link = tcp_.get();
    comm_.shm = shm_.get();
    comm_.ring = ring;
    comm_.local_group.clear();  // the two-level plan assumed the old hosts: the ring from now on
    comm_.cross_group.clear();
    live_ = d.live;
    if (d.fence > d.done_seq) void_ranges_.push_back({d.done_seq, d.fence});
    info_.epoch = d.epoch;
    info_.live = d.live;
    info_.ring = ring;
    info_.recoveries++;
    info_.source = source;
    if (source < 0) {  // a failure (a growth keeps the last failure's figures)
      info_.last_failure = reason;
      info_.last_agreement_s = agreement_s;
      info_.last_recovery_s = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    epoch_.store(d.epoch);
    signal_ = false;
    cb = callback_;
  }
  if (old) old->close();
  old_shm.reset();
  if (cb) cb();
}

// The group key of elastic epoch `epoch`: with XIRANG_AUTH_KEY_FILE derived from the file's key
// (so a spare that holds the file can compute it and nothing secret goes to the store), else
// `otherwise` (derived from the previous epoch's key, or a random one the store carries).
transport::Key128 Membership::epochKey(uint64_t epoch, const transport::Key128& otherwise) const {
  return auth_key_ ? transport::deriveKey(*auth_key_, epoch) : otherwise;
}

elastic::Decision Membership::recover(const std::string& why) {
  const auto t0 = Clock::now();
  const uint64_t epoch = epoch_.load();
  std::string reason = elastic::reportFailure(*store_, prefix_, epoch, why);
  if (reason.rfind(kFatal, 0) == 0) {  // a rank failed the group on purpose (failGroup)
    std::string msg = rankPrefix(rank_) + "the group failed: " + reason.substr(std::strlen(kFatal));
    cb_.poison(msg);
    throw transport::TransportError(msg, -1);
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    if (tcp_) tcp_->interrupt("membership change: " + reason);
    if (shm_) shm_->interrupt("membership change: " + reason);
  }
  env::log(env::Level::Warn, rank_, "epoch " + std::to_string(epoch) + " ended (" + reason + "); agreeing on the survivors");
  elastic::Report mine{done_seq_, issued_seq_.load()};
  elastic::HeartbeatWatch watch(*store_, prefix_, heartbeatPeriod());
  {
    std::lock_guard<std::mutex> g(watch_mu_);
    if (hb_watch_) watch.adopt(*hb_watch_);  // a neighbour already silent is stale at once
  }
  elastic::Decision d = elastic::agree(*store_, prefix_, epoch, live_, rank_, mine, watch, Clock::now() + cfg_.timeout);
  const auto t_agreed = Clock::now();
  if (std::find(d.live.begin(), d.live.end(), rank_) == d.live.end()) {
    std::string msg = rankPrefix(rank_) + "declared dead by the survivors of epoch " +
                      std::to_string(epoch) + " (" + text(&d) + "); this process must not take part in the group again";
    cb_.poison(msg);
    throw transport::TransportError(msg, rank_);
  }
  transport::Key128 key;
  {
    std::lock_guard<std::mutex> g(mu_);
    key = epochKey(d.epoch, transport::deriveKey(tcp_->key(), d.epoch));
  }
  // Every rank of the decision registered in the agreement: its heartbeat thread runs.
  installEpoch(d, key, /*source=*/-1, reason, std::chrono::duration<double>(t_agreed - t0).count(), t0, d.live);
  env::log(env::Level::Warn, rank_,
           "rebuilt the ring: " + text(&d) + ", ops up to #" + std::to_string(d.done_seq) + " kept, #" +
               std::to_string(d.done_seq + 1) + "-#" + std::to_string(d.fence) + " void; recovery " +
               std::to_string(info_.last_recovery_s) + " s");
  return d;
}

std::string Membership::waitKey(const std::string& key, transport::Deadline deadline) {
  const std::string fail = elastic::failKey(prefix_, epoch_.load());
  while (!store_->check(key)) {
    if (store_->check(fail))
      throw transport::TransportError("a failure was reported while waiting for " + key + ": " +
                                          store_->get(fail, Clock::now() + std::chrono::seconds(5)),
                                      -1);
    if (Clock::now() >= deadline) throw transport::TimeoutError("timed out waiting for store key " + key, -1);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return store_->get(key, deadline);
}

// ---------------------------------------------------------------- heartbeats

// Advances this rank's heartbeat counter, watches the ring neighbours' counters, and turns a
// failure recorded for the current epoch into an interrupt of the transport (so a running
// exchange ends now) and a wake-up of the communication thread (so an idle rank joins the
// agreement).
std::chrono::milliseconds Membership::heartbeatPeriod() const {
  return std::chrono::milliseconds(static_cast<int64_t>(cfg_.heartbeat_s * 1000));
}

std::chrono::milliseconds Membership::heartbeatTick() const {
  return std::max(std::chrono::milliseconds(20), heartbeatPeriod() / 5);
}

void Membership::heartbeatLoop() {
  const auto hb = heartbeatPeriod();
  const auto tick = heartbeatTick();
  auto watch = std::make_unique<elastic::HeartbeatWatch>(*store_, prefix_, hb);
  {
    std::lock_guard<std::mutex> g(watch_mu_);
    hb_watch_ = watch.get();
  }
  struct Unpublish {
    Membership* self;
    ~Unpublish() {
      std::lock_guard<std::mutex> g(self->watch_mu_);
      self->hb_watch_ = nullptr;
    }
  } unpublish{this};
  uint64_t watched_epoch = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> g(hb_mu_);
      if (hb_cv_.wait_for(g, tick, [&] { return hb_stop_; })) return;
    }
    try {
      store_->add(elastic::heartbeatKey(prefix_, rank_), 1);
      const uint64_t epoch = epoch_.load();
      if (epoch != watched_epoch) {  // new ring: new neighbours, fresh clocks
        std::lock_guard<std::mutex> g(watch_mu_);
        watch = std::make_unique<elastic::HeartbeatWatch>(*store_, prefix_, hb);
        hb_watch_ = watch.get();
        watched_epoch = epoch;
      }
      if (signal_.load()) continue;
      std::vector<int> neighbours;
      {
        std::lock_guard<std::mutex> g(mu_);
        const int n = static_cast<int>(comm_.ring.size());
        for (int i = 0; i < n && n > 1; ++i) {
          if (comm_.ring[i] != rank_) continue;
          neighbours.push_back(comm_.ring[(i + 1) % n]);
          if (n > 2) neighbours.push_back(comm_.ring[(i + n - 1) % n]);
        }
      }
      for (int p : neighbours) {
        bool stale;
        {
          std::lock_guard<std::mutex> g(watch_mu_);
          stale = watch->stale(p);
        }
        if (stale) {
          elastic::reportFailure(*store_, prefix_, epoch,
                                 "rank " + std::to_string(p) + " missed its heartbeats for " +
                                     std::to_string(watch->silentFor(p)) + " s (XIRANG_HEARTBEAT_S=" +
                                     std::to_string(cfg_.heartbeat_s) + ")");
        }
      }
      if (store_->check(elastic::failKey(prefix_, epoch))) {
        {
          std::lock_guard<std::mutex> g(mu_);
          if (epoch_.load() != epoch) continue;
          signal_ = true;
          if (tcp_) tcp_->interrupt("membership change reported in the store");
          if (shm_) shm_->interrupt("membership change reported in the store");
        }
        cb_.wake();
      }
    } catch (const std::exception& e) {
      std::string msg = rankPrefix(rank_) + "elastic heartbeat: the store is unreachable (" +
                        e.what() + "); elastic mode needs a store that outlives every failed node";
      env::log(env::Level::Warn, rank_, msg);
      cb_.poison(msg);
      {
        std::lock_guard<std::mutex> g(mu_);
        if (tcp_) tcp_->interrupt(msg);
        if (shm_) shm_->interrupt(msg);
      }
      cb_.wake();
      return;
    }
  }
}

}  // namespace xirang
