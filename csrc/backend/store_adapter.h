// The core's store (core/store.h) over torch's c10d::Store, for ProcessGroupXirang.
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/store.h"
#include "core/transport/errors.h"

namespace xirang {

// Adapts torch's c10d::Store (already prefixed per group by torch) to the core's (core/store.h). Its errors reach the core as std::runtime_error
// without the C++ backtrace that c10::Error::what() carries (the core puts what() into the
// messages users see: "the store is unreachable (Broken pipe)", not 25 frames); a network error
// (c10::DistNetworkError: the store's host is gone) marks it unreachable(), and every later call
// fails with that error at once, without a send that torch's client would log again.
class StoreAdapter : public transport::Store {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> s) : s_(std::move(s)) {}
  void set(const std::string& key, const std::string& value) override {
    clean([&] { s_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }
  bool check(const std::string& key) override {
    return clean([&] { return s_->check({key}); });
  }
  int64_t add(const std::string& key, int64_t delta) override {
    return clean([&] { return s_->add(key, delta); });
  }
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override {
    return clean([&] {
      auto v = s_->compareSet(key, std::vector<uint8_t>(expected.begin(), expected.end()),
                              std::vector<uint8_t>(desired.begin(), desired.end()));
      return std::string(v.begin(), v.end());
    });
  }
  std::string get(const std::string& key, transport::Deadline deadline) override {
    return clean([&] {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() < 1) left = std::chrono::milliseconds(1);
      s_->wait({key}, left);
      auto v = s_->get(key);
      return std::string(v.begin(), v.end());
    });
  }

  bool unreachable() const override { return unreachable_.load(); }

 private:
  template <class F>
  auto clean(F&& f) -> decltype(f()) {
    if (unreachable_.load()) {  // torch's client does not reconnect: fail as the first call did
      std::lock_guard<std::mutex> g(mu_);
      throw std::runtime_error(first_error_);
    }
    try {
      return f();
    } catch (const c10::DistNetworkError& e) {
      {
        std::lock_guard<std::mutex> g(mu_);
        if (first_error_.empty()) first_error_ = e.what_without_backtrace();
      }
      unreachable_ = true;
      throw std::runtime_error(e.what_without_backtrace());
    } catch (const c10::Error& e) {
      throw std::runtime_error(e.what_without_backtrace());
    }
  }
  c10::intrusive_ptr<c10d::Store> s_;
  std::atomic<bool> unreachable_{false};
  std::mutex mu_;
  std::string first_error_;  // the network error that made it unreachable
};

// An elastic group's own connection to the store, where the store can clone one: torch's client
// runs one call at a time, so a Python store.wait() of minutes on the group's store (a rank
// waiting for another's checkpoint) would hold this rank's heartbeats, and its peers would take it
// for lost. A store that cannot clone (a Python store) is shared.
inline c10::intrusive_ptr<c10d::Store> ownConnection(const c10::intrusive_ptr<c10d::Store>& s) {
  try {
    if (auto c = s->clone()) return c;
  } catch (const std::exception&) {
  }
  return s;
}

}  // namespace xirang
