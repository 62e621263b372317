#include "backend/records.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "core/env.h"

namespace xirang {

std::optional<double> WaitClock::seconds(int64_t now_ns) const {
  if (calls.load(std::memory_order_relaxed) == 0) return std::nullopt;
  int64_t ns = blocked_ns.load();
  const int64_t since = since_ns.load();
  if (since != 0 && now_ns > since) ns += now_ns - since;
  return static_cast<double>(ns) * 1e-9;
}

namespace {

// One JSON object built by appending to a string: std::to_chars for numbers (the shortest text
// that reads back to the same double), no iostreams. An ostringstream with precision(9) made the
// line cost ~10 us, most of a JSON record's cost (benchmarks/stats_overhead.py).
class JsonLine {
 public:
  JsonLine() { s_.reserve(640); }
  // Appends `"k":v` (a comma first unless it opens the object) for a record's field value.
  template <class T>
  void field(const char* k, const T& v) {
    s_ += first_ ? "{\"" : ",\"";
    first_ = false;
    s_ += k;
    s_ += "\":";
    value(v);
  }
  void value(const std::string& v) {
    s_ += '"';
    for (char c : v) {
      if (c == '"' || c == '\\') {
        s_ += '\\';
        s_ += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\u%04x", c);
        s_ += buf;
      } else {
        s_ += c;
      }
    }
    s_ += '"';
  }
  void value(bool v) { s_ += v ? "true" : "false"; }
  template <class T, class = std::enable_if_t<std::is_arithmetic_v<T>>>
  void value(T v) {
    if constexpr (std::is_floating_point_v<T>) {
      if (!std::isfinite(v)) {
        s_ += "null";
        return;
      }
    }
    char buf[32];
    auto res = std::to_chars(buf, buf + sizeof(buf), v);
    s_.append(buf, res.ptr);
  }
  void value(const std::optional<double>& v) {
    if (v) value(*v);
    else s_ += "null";
  }
  void value(const std::vector<PeerRecord>& peers) {
    s_ += '[';
    for (size_t i = 0; i < peers.size(); ++i) {
      if (i) s_ += ',';
      first_ = true;
      forEachField(peers[i], [this](const char* k, const auto& v) { field(k, v); });
      s_ += '}';
    }
    s_ += ']';
  }
  // Ends the object and the line.
  const std::string& end() {
    s_ += "}\n";
    return s_;
  }

 private:
  std::string s_;
  bool first_ = true;
};

}  // namespace

Records::Records(int rank, int size, const XirangConfig& cfg)
    : rank_(rank),
      size_(size),
      cfg_(cfg),
      created_(Clock::now()),
      on_(env::getBool("XIRANG_STATS")),
      capacity_(statsCapacityKnob()) {}

size_t statsCapacityKnob() {
  const int64_t c = env::getInt("XIRANG_STATS_CAPACITY");
  if (c < 1 || c > kMaxStatsCapacity)
    throw std::invalid_argument("xirang: XIRANG_STATS_CAPACITY=" + std::to_string(c) + " must be 1 to " +
                                std::to_string(kMaxStatsCapacity) + " records");
  return static_cast<size_t>(c);
}

Records::~Records() { stop(); }

void Records::start() {
  if (cfg_.stats_dir.empty()) return;
  if (!on_) {
    env::log(env::Level::Warn, rank_, "XIRANG_STATS=0: no records, so nothing is written to XIRANG_STATS_DIR");
    return;
  }
  const std::string path = cfg_.stats_dir + "/rank" + std::to_string(cfg_.global_rank) + ".jsonl";
  file_ = std::fopen(path.c_str(), "a");
  if (!file_) env::log(env::Level::Warn, rank_, "cannot open " + path + " for the stats records");
  else writer_ = std::thread([this] { writerLoop(); });
}

void Records::stop() {
  {
    std::lock_guard<std::mutex> g(q_mu_);
    stop_ = true;
  }
  q_cv_.notify_all();
  if (writer_.joinable() && writer_.get_id() != std::this_thread::get_id()) writer_.join();
  if (file_) {
    std::fclose(file_);
    file_ = nullptr;
  }
}

double Records::since(Clock::time_point t) const { return std::chrono::duration<double>(t - created_).count(); }

void Records::writerLoop() {
  while (true) {
    std::deque<OpRecord> batch;
    {
      std::unique_lock<std::mutex> g(q_mu_);
      q_cv_.wait_for(g, std::chrono::milliseconds(100), [&] { return stop_; });
      if (queue_.empty()) {
        if (stop_) return;  // stopped and drained
        continue;
      }
      batch.swap(queue_);
    }
    for (const auto& r : batch) write(r);
    std::fflush(file_);
  }
}

// One JSON line per operation in XIRANG_STATS_DIR/rank<global rank>.jsonl (the writer thread):
// the group's identity, then the record's fields.
void Records::write(const OpRecord& r) {
  JsonLine j;
  j.field("run_id", cfg_.run_id);
  j.field("pg", cfg_.group_name);
  j.field("group_rank", rank_);
  j.field("global_rank", cfg_.global_rank);
  j.field("world_size", size_);
  forEachField(r, [&j](const char* k, const auto& v) { j.field(k, v); });
  const std::string& line = j.end();
  std::fwrite(line.data(), 1, line.size(), file_);
}

void Records::finish(OpRecord rec, const Phases& ph, bool ok, uint64_t raw_per_wire, Clock::time_point enqueued,
                     Clock::time_point start, uint64_t caller_ns) {
  // From here to the push: the record's cost on this thread (cost()).
  const auto end = Clock::now();
  rec.queued_s = std::chrono::duration<double>(start - enqueued).count();
  rec.total_s = std::chrono::duration<double>(end - start).count();
  rec.pack_s = ph.pack_s;
  rec.encode_s = ph.encode_s;
  rec.scatter_reduce_s = ph.scatter_reduce_s;
  rec.allgather_s = ph.allgather_s;
  rec.decode_s = ph.decode_s;
  // Shared memory carries every dtype as it is (the hook's op over it is fp32: no compression).
  rec.bytes_tcp = ph.bytes_sent;
  rec.bytes_shm = ph.bytes_shm;
  rec.bytes_wire = ph.bytes_sent + ph.bytes_shm;
  rec.bytes_raw = ph.bytes_sent * raw_per_wire + ph.bytes_shm;
  rec.algorithm = ph.algorithm;
  rec.ok = ok;
  for (const auto& [peer, st] : ph.peers) {
    rec.peers.push_back({peer, st.send_s, st.recv_s, st.bytes_sent, st.bytes_recv});
    addCrossBytes(rec, peer, st.bytes_sent);
  }
  keep(std::move(rec), end, caller_ns);
}

void Records::addCrossBytes(OpRecord& rec, int peer, uint64_t bytes) const {
  if (peer >= 0 && peer < static_cast<int>(cfg_.hosts.size()) && cfg_.hosts[peer] != cfg_.hosts[rank_])
    rec.bytes_cross_host += bytes;
  if (peer >= 0 && peer < static_cast<int>(cfg_.racks.size()) && cfg_.racks[peer] != cfg_.racks[rank_])
    rec.bytes_cross_rack += bytes;
}

void Records::keep(OpRecord rec, Clock::time_point end, uint64_t caller_ns) {
  if (file_) {
    // The line carries the exposed wait known now: a caller already blocked has waited since
    // it began (up to `end`, before the wake-up); one that has not begun yet is unknown.
    rec.exposed_wait_s = rec.wait ? rec.wait->seconds(steadyNs(end)) : std::nullopt;
    std::lock_guard<std::mutex> g(q_mu_);
    queue_.push_back(rec);  // no wake-up: the writer comes by every 100 ms
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    records_.push_back(std::move(rec));
    while (records_.size() > capacity_) records_.pop_front();
  }
  ns_.fetch_add(caller_ns + static_cast<uint64_t>(
                                std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - end).count()),
                std::memory_order_relaxed);
  built_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<OpRecord> Records::snapshot() {
  std::vector<OpRecord> out;
  {
    std::lock_guard<std::mutex> g(mu_);
    out.assign(records_.begin(), records_.end());
  }
  const int64_t now = steadyNs(Clock::now());
  for (auto& r : out)
    if (r.wait) r.exposed_wait_s = r.wait->seconds(now);
  return out;
}

void Records::clear() {
  std::lock_guard<std::mutex> g(mu_);
  records_.clear();
}

}  // namespace xirang
