#include "core/membership.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace xirang::elastic {

using Clock = std::chrono::steady_clock;
using transport::TransportError;

std::string Decision::encode() const {
  std::ostringstream o;
  o << "epoch " << epoch << " done " << done_seq << " fence " << fence << " live";
  for (int r : live) o << ' ' << r;
  return o.str();
}

Decision Decision::decode(const std::string& text) {
  std::istringstream in(text);
  std::string w1, w2, w3, w4;
  Decision d;
  if (!(in >> w1 >> d.epoch >> w2 >> d.done_seq >> w3 >> d.fence >> w4) || w1 != "epoch" || w2 != "done" ||
      w3 != "fence" || w4 != "live")
    throw std::invalid_argument("malformed membership decision: '" + text + "'");
  int r;
  while (in >> r) d.live.push_back(r);
  if (!in.eof()) throw std::invalid_argument("malformed membership decision: '" + text + "'");
  return d;
}

std::string heartbeatKey(const std::string& prefix, int rank) { return prefix + "/hb/" + std::to_string(rank); }
std::string joinBeatKey(const std::string& prefix, int rank) { return prefix + "/joinbeat/" + std::to_string(rank); }
std::string joinKey(const std::string& prefix, int rank) { return prefix + "/join/" + std::to_string(rank); }
std::string joinedKey(const std::string& prefix, int rank) { return prefix + "/joined/" + std::to_string(rank); }
std::string admitKey(const std::string& prefix, uint64_t seq) { return prefix + "/admit/" + std::to_string(seq); }
std::string secretKey(const std::string& prefix, uint64_t epoch) {
  return prefix + "/e" + std::to_string(epoch) + "/secret";
}
std::string failKey(const std::string& prefix, uint64_t epoch) {
  return prefix + "/e" + std::to_string(epoch) + "/fail";
}

namespace {
std::string epochKey(const std::string& prefix, uint64_t epoch, const std::string& what) {
  return prefix + "/e" + std::to_string(epoch) + "/" + what;
}

template <typename F>
auto storeCall(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const TransportError&) {
    throw;
  } catch (const std::exception& e) {
    throw TransportError(std::string("the store is unreachable (") + e.what() +
                             "); elastic mode needs a store that outlives every failed node",
                         -1);
  }
}
}  // namespace

std::string reportFailure(transport::Store& store, const std::string& prefix, uint64_t epoch,
                          const std::string& why) {
  return storeCall([&] { return store.compareSet(failKey(prefix, epoch), "", why.empty() ? "failure" : why); });
}

HeartbeatWatch::HeartbeatWatch(transport::Store& store, std::string prefix, std::chrono::milliseconds stale_after,
                               bool spares)
    : store_(store), prefix_(std::move(prefix)), stale_after_(stale_after), spares_(spares) {}

bool HeartbeatWatch::stale(int r) {
  int64_t v = storeCall([&] { return store_.add(spares_ ? joinBeatKey(prefix_, r) : heartbeatKey(prefix_, r), 0); });
  auto now = Clock::now();
  auto it = seen_.find(r);
  if (it == seen_.end() || it->second.value != v) {
    seen_[r] = {v, now};
    return false;
  }
  return now - it->second.changed >= stale_after_;
}

double HeartbeatWatch::silentFor(int r) const {
  auto it = seen_.find(r);
  return it == seen_.end() ? 0.0 : std::chrono::duration<double>(Clock::now() - it->second.changed).count();
}

void HeartbeatWatch::adopt(const HeartbeatWatch& other) {
  for (const auto& [r, seen] : other.seen_) seen_.insert({r, seen});
}

Decision agree(transport::Store& store, const std::string& prefix, uint64_t epoch, const std::vector<int>& live,
               int rank, const Report& mine, HeartbeatWatch& watch, transport::Deadline deadline) {
  const std::string decision_key = epochKey(prefix, epoch, "decision");
  storeCall([&] {
    store.set(epochKey(prefix, epoch, "alive/" + std::to_string(rank)),
              std::to_string(mine.done_seq) + " " + std::to_string(mine.issued_seq));
    return 0;
  });
  while (true) {
    if (storeCall([&] { return store.check(decision_key); }))
      return Decision::decode(storeCall([&] { return store.get(decision_key, Clock::now() + std::chrono::seconds(10)); }));
    std::vector<int> registered;
    bool waiting = false;
    for (int r : live) {
      const std::string k = epochKey(prefix, epoch, "alive/" + std::to_string(r));
      if (storeCall([&] { return store.check(k); }))
        registered.push_back(r);
      else if (!watch.stale(r))
        waiting = true;
    }
    if (!waiting || Clock::now() >= deadline) {
      Decision d;
      d.epoch = epoch + 1;
      d.done_seq = std::numeric_limits<uint64_t>::max();
      for (int r : registered) {
        std::string v = storeCall([&] {
          return store.get(epochKey(prefix, epoch, "alive/" + std::to_string(r)), Clock::now() + std::chrono::seconds(10));
        });
        std::istringstream in(v);
        uint64_t done = 0, issued = 0;
        in >> done >> issued;
        d.live.push_back(r);
        d.done_seq = std::min(d.done_seq, done);
        d.fence = std::max(d.fence, issued);
      }
      std::sort(d.live.begin(), d.live.end());
      if (d.live.empty()) d.done_seq = 0;
      return Decision::decode(storeCall([&] { return store.compareSet(decision_key, "", d.encode()); }));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace xirang::elastic
