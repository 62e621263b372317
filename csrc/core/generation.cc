#include "core/generation.h"

#include <cctype>
#include <cstdio>
#include <thread>
#include <vector>

#include "core/transport/auth.h"

namespace xirang::generation {

namespace {

constexpr auto kPoll = std::chrono::milliseconds(2);

std::string key(const std::string& what) { return std::string(kPrefix) + "/" + what; }
std::string helloKey(int r) { return key("hello/" + std::to_string(r)); }
std::string answerKey(int r) { return key("answer/" + std::to_string(r)); }
std::string ackKey(const std::string& g, int r) { return key("ack/" + g + "/" + std::to_string(r)); }

std::string fresh() {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(transport::randomU64()));
  return buf;
}

bool valid(const std::string& g) {
  if (g.size() != 16) return false;
  for (char c : g)
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

std::string rankList(const std::vector<int>& ranks) {
  // appended piece by piece: "[" + s + "]" trips GCC 12's -Wrestrict false positive once inlined
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ' ';
    s += std::to_string(ranks[i]);
  }
  s += ']';
  return s;
}

}  // namespace

std::string keyNamespace(const std::string& g) { return "xirang/" + g; }

std::string agree(transport::Store& store, int rank, int size, transport::Deadline deadline) {
  const auto t0 = transport::Clock::now();
  auto waited_ms = [&] {
    return std::to_string(
        std::chrono::duration_cast<std::chrono::milliseconds>(transport::Clock::now() - t0).count());
  };
  if (size <= 1) return fresh();
  if (rank != 0) {
    const std::string nonce = transport::keyToHex(transport::randomKey());
    store.set(helloKey(rank), nonce);
    const std::string answer = answerKey(rank);
    while (true) {
      if (store.check(answer)) {
        const std::string a = store.get(answer, deadline);
        if (a.size() == nonce.size() + 17 && a.compare(0, nonce.size() + 1, nonce + " ") == 0) {
          const std::string g = a.substr(nonce.size() + 1);
          if (valid(g)) {
            store.set(ackKey(g, rank), "1");
            return g;
          }
        }
      }
      if (transport::Clock::now() >= deadline)
        throw transport::TimeoutError("rank " + std::to_string(rank) + ": rank 0 did not answer the group's " +
                                          "generation handshake within " + waited_ms() +
                                          " ms (rank 0 not started, or creating another group)",
                                      0);
      std::this_thread::sleep_for(kPoll);
    }
  }
  const std::string g = fresh();
  std::vector<int> pending;
  std::vector<std::string> answered(size);  // the hello value each rank was last answered for
  for (int r = 1; r < size; ++r) pending.push_back(r);
  while (!pending.empty()) {
    std::vector<int> left;
    for (int r : pending) {
      if (store.check(ackKey(g, r))) continue;
      left.push_back(r);
      // The hello may still be the previous creation's: answer it anyway and again when it
      // changes; only a rank that read our answer to its own nonce writes the ack.
      if (!store.check(helloKey(r))) continue;
      const std::string h = store.get(helloKey(r), deadline);
      if (h != answered[r]) {
        store.set(answerKey(r), h + " " + g);
        answered[r] = h;
      }
    }
    pending.swap(left);
    if (pending.empty()) break;
    if (transport::Clock::now() >= deadline) {
      const std::string msg = "rank 0: ranks " + rankList(pending) + " of " + std::to_string(size) +
                              " did not take part in the group's generation handshake within " + waited_ms() +
                              " ms (not started, or creating another group)";
      try {  // the ranks that did learn the generation wait under it (their labels): tell them
        store.set(keyNamespace(g) + "/failed", msg);
      } catch (const std::exception&) {
      }
      throw transport::TimeoutError(msg, pending.front());
    }
    std::this_thread::sleep_for(kPoll);
  }
  store.set(key("live"), g);
  return g;
}

std::string live(transport::Store& store, transport::Deadline deadline) {
  std::string g;
  try {
    g = store.get(key("live"), deadline);
  } catch (const std::exception& e) {
    throw transport::TimeoutError(std::string("no live group to join: its rank 0 never published the group's ") +
                                      "generation (" + key("live") + "): " + e.what(),
                                  0);
  }
  if (!valid(g)) throw transport::TransportError("malformed generation in the store (" + key("live") + "='" + g + "')", 0);
  return g;
}

}  // namespace xirang::generation
