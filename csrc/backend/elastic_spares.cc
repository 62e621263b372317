// Spares (XIRANG_JOIN): a spare announces itself and waits (Membership::join); the live ranks
// let it in at a step boundary (Membership::admit, from admit_joiners). See elastic.h.
#include "backend/elastic.h"

#include <algorithm>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/host_engine.h"
#include "backend/tensors.h"
#include "core/env.h"

namespace xirang {

namespace {
// A spare's join key once the spare is in, or once the lowest live rank found it gone.
constexpr const char* kTaken = "taken";
constexpr const char* kGone = "gone";
}  // namespace

void Membership::admit(OpCtx& ctx, int64_t expect, double wait_s) {
  if (size_ <= 1) return;
  // First a barrier over the live ranks, whose headers carry this op (admit_joiners): a rank
  // that issued another collective here gets a MismatchError now, on every rank, instead of
  // the next op's sequence mismatch (or an op timeout read as a lost rank).
  host::barrier(comm_, ctx);
  const int lowest = live_.front();
  const std::string key = elastic::admitKey(prefix_, ctx.seq);
  if (rank_ == lowest) {
    const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
    // A spare is admitted once its join beat is seen to advance; one whose beat stays still for
    // XIRANG_HEARTBEAT_S (it died while it waited: its join key outlives it) is marked gone and
    // never admitted (a live one that was only slow announces itself again).
    elastic::HeartbeatWatch beats(*store_, prefix_, heartbeatPeriod(), /*spares=*/true);
    std::map<int, int64_t> first_beat;
    std::vector<std::pair<int, std::string>> joiners;  // (rank, nonce)
    while (true) {
      joiners.clear();
      bool pending = false;
      for (int r = 0; r < size_; ++r) {
        const std::string jk = elastic::joinKey(prefix_, r);
        if (std::find(live_.begin(), live_.end(), r) != live_.end() || !store_->check(jk)) continue;
        std::string nonce = store_->get(jk, ctx.deadline);
        if (nonce == kTaken || nonce == kGone) continue;
        const int64_t b = store_->add(elastic::joinBeatKey(prefix_, r), 0);
        const int64_t b0 = first_beat.try_emplace(r, b).first->second;
        if (b != b0) {
          joiners.push_back({r, nonce});
        } else if (beats.stale(r)) {
          store_->compareSet(jk, nonce, kGone);
          env::log(env::Level::Warn, rank_,
                   "the spare for rank " + std::to_string(r) + " is not admitted: its join beat stood still for " +
                       std::to_string(beats.silentFor(r)) + " s (it exited while it waited?)");
        } else {
          pending = true;  // not yet seen to beat: at most XIRANG_HEARTBEAT_S more
        }
      }
      if (!pending && static_cast<int64_t>(joiners.size()) >= expect) break;
      if (!pending && Clock::now() >= until) {
        joiners.clear();  // fewer than `expect` waiting: admit none this time
        break;
      }
      if (store_->check(elastic::failKey(prefix_, epoch_.load())))
        throw transport::TransportError("a failure was reported during the admission", -1);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    elastic::Decision d;
    d.epoch = joiners.empty() ? epoch_.load() : epoch_.load() + 1;
    d.live = live_;
    for (const auto& j : joiners) d.live.push_back(j.first);
    std::sort(d.live.begin(), d.live.end());
    d.done_seq = d.fence = ctx.seq;
    if (!joiners.empty() && !auth_key_)  // with XIRANG_AUTH_KEY_FILE the key is derived, not stored
      store_->set(elastic::secretKey(prefix_, d.epoch), transport::keyToHex(transport::randomKey()));
    store_->compareSet(key, "", d.encode());
    for (const auto& [r, nonce] : joiners) {
      store_->set(elastic::joinedKey(prefix_, r), nonce + " " + std::to_string(rank_) + " " + d.encode());
      store_->compareSet(elastic::joinKey(prefix_, r), nonce, kTaken);
    }
  }
  elastic::Decision d = elastic::Decision::decode(waitKey(key, ctx.deadline));
  if (d.epoch == epoch_.load()) return;  // nobody joined
  transport::Key128 k = auth_key_ ? epochKey(d.epoch, {})
                                  : transport::keyFromHex(waitKey(elastic::secretKey(prefix_, d.epoch), ctx.deadline));
  // The spares' heartbeat threads start only once they are in: watch the ranks that were live.
  std::vector<int> joining;
  for (int r : d.live)
    if (std::find(live_.begin(), live_.end(), r) == live_.end()) joining.push_back(r);
  installEpoch(d, k, lowest, "spares joined (" + text(&d) + ")", 0.0, Clock::now(), std::vector<int>(live_), joining);
  env::log(env::Level::Warn, rank_,
           "the ring grew back: " + text(&d) + "; training state source: rank " + std::to_string(lowest));
}

// XIRANG_JOIN: announces this spare and blocks until the live ranks admit it (group timeout).
uint64_t Membership::join() {
  const auto t0 = Clock::now();
  const auto deadline = t0 + cfg_.timeout;
  const std::string nonce = transport::keyToHex(transport::randomKey()).substr(0, 16);
  store_->set(elastic::joinKey(prefix_, rank_), nonce);
  env::log(env::Level::Warn, rank_,
           "spare waiting to take rank " + std::to_string(rank_) + "'s place (admitted at a step boundary)");
  const std::string jk = elastic::joinedKey(prefix_, rank_);
  // A live rank holding this rank's number (its heartbeat counter advances) is never replaced:
  // say so at once, and in the timeout's error, rather than waiting in silence.
  const std::string hk = elastic::heartbeatKey(prefix_, rank_);
  const int64_t beat0 = store_->add(hk, 0);
  auto next_look = t0 + 2 * heartbeatPeriod();
  // The join beat: advanced every heartbeat tick until this function returns (admitted and
  // set up), so the lowest live rank admits only a spare that is still there, and the
  // survivors' shared-memory set-up learns of one that dies while it joins.
  struct Beat {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
    std::thread t;
    ~Beat() {
      {
        std::lock_guard<std::mutex> g(mu);
        stop = true;
      }
      cv.notify_all();
      if (t.joinable()) t.join();
    }
  } beat;
  const auto tick = heartbeatTick();
  beat.t = std::thread([this, tick, &beat] {
    std::unique_lock<std::mutex> g(beat.mu);
    while (!beat.stop) {
      g.unlock();
      try {
        store_->add(elastic::joinBeatKey(prefix_, rank_), 1);
      } catch (const std::exception&) {  // the store is gone: the wait below fails on its own
        return;
      }
      g.lock();
      beat.cv.wait_for(g, tick, [&] { return beat.stop; });
    }
  });
  bool alive = false;
  std::string joined;
  auto next_announce = t0 + std::chrono::milliseconds(500);
  while (true) {
    if (store_->check(jk)) {
      joined = store_->get(jk, deadline);
      if (joined.compare(0, nonce.size() + 1, nonce + " ") == 0) break;
    }
    if (Clock::now() >= next_announce) {  // found gone while it was only slow: announce again
      next_announce = Clock::now() + std::chrono::milliseconds(500);
      if (store_->get(elastic::joinKey(prefix_, rank_), deadline) == kGone) {
        env::log(env::Level::Warn, rank_, "the live ranks found this spare gone (its join beat stood still): announcing it again");
        store_->set(elastic::joinKey(prefix_, rank_), nonce);
      }
    }
    if (!alive && Clock::now() >= next_look) {
      next_look = Clock::now() + std::chrono::milliseconds(500);
      alive = store_->add(hk, 0) >= beat0 + 2;
      if (alive)
        env::log(env::Level::Warn, rank_,
                 "rank " + std::to_string(rank_) + " is alive (its heartbeat advances): a spare takes a lost rank's " +
                     "place, so this one is admitted only after rank " + std::to_string(rank_) + " is lost");
    }
    XR_CHECK(rank_, Clock::now() < deadline, "the spare was not admitted within the group timeout (",
             cfg_.timeout.count(), " ms): ",
             alive ? "rank " + std::to_string(rank_) + " is alive (its heartbeat advanced while this spare waited); start "
                                                       "a spare with the RANK of a rank that was lost"
                   : std::string("the live ranks admit spares at step boundaries with xirang.admit_joiners()"));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::istringstream in(joined.substr(nonce.size() + 1));
  int source = -1;
  in >> source;
  std::string rest;
  std::getline(in, rest);
  elastic::Decision d = elastic::Decision::decode(rest.substr(rest.find_first_not_of(' ')));
  transport::Key128 key = auth_key_ ? epochKey(d.epoch, {})
                                    : transport::keyFromHex(store_->get(elastic::secretKey(prefix_, d.epoch), deadline));
  // The survivors' admission op was #fence: this rank's next op is the next one.
  issued_seq_.store(d.fence);
  done_seq_ = d.fence;
  store_->add(elastic::heartbeatKey(prefix_, rank_), 1);
  installEpoch(d, key, source, "joined as a spare", 0.0, t0, {});
  env::log(env::Level::Warn, rank_, "joined: " + text(&d) + "; training state source: rank " + std::to_string(source));
  return d.fence;
}

}  // namespace xirang
