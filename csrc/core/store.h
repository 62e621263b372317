// The slice of torch's c10d::Store that the torch-free core uses: rendezvous (addresses, group
// id, secret), membership records (elastic mode) and abort / exit notes. The backend adapts
// torch's store to it; the Catch2 tests use an in-memory one (tests/cpp/support.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace xirang {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` exists, at most until `deadline`; throws std::runtime_error after it.
  virtual std::string get(const std::string& key, Deadline deadline) = 0;
  // Whether `key` exists now (no waiting). Throws if the store cannot be reached.
  virtual bool check(const std::string& key) { (void)key; return false; }
  // Whether a call has failed because the store could not be reached (its host is gone). Notes
  // written on the way out (Tcp::leave) are then skipped: they would only fail again.
  virtual bool unreachable() const { return false; }
  // Atomically adds `delta` to the integer at `key` (missing: 0) and returns the new value.
  // Elastic mode only (heartbeats); the default throws.
  virtual int64_t add(const std::string& key, int64_t delta) {
    (void)key, (void)delta;
    throw std::runtime_error("this store does not support add");
  }
  // c10d's compareSet: sets `key` to `desired` if its value is `expected` ("" = missing) and
  // returns the value the key holds afterwards. Elastic mode only (the epoch decision).
  virtual std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) {
    (void)key, (void)expected, (void)desired;
    throw std::runtime_error("this store does not support compareSet");
  }
};

}  // namespace xirang
