// The transport's exceptions. Every failure a peer, the network or a deadline causes is a
// TransportError naming the rank involved; the backend turns them into the op's error. And the
// set-up's wait for another rank's store key, which ends in one of them (pollForKey).
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>

#include "core/store.h"

namespace xirang::transport {

using xirang::Clock;
using xirang::Deadline;
using xirang::Store;

// Base of every transport failure. `peer` is the rank involved (-1 if none).
class TransportError : public std::runtime_error {
 public:
  TransportError(const std::string& msg, int peer) : std::runtime_error(msg), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};
class TimeoutError : public TransportError {
 public:
  using TransportError::TransportError;
};
// Ranks disagree about the operation (a frame's header differs from the expected one): a bug in
// the calling program, not a failure of the peer.
class MismatchError : public TransportError {
 public:
  using TransportError::TransportError;
};

// Why a wait for the other ranks should end now ("" while it may go on): this rank's group was
// interrupted or aborted, a peer is gone. Called about every 50 ms of a wait, on the waiting thread.
using StopCheck = std::function<std::string()>;

// Polls `store` for `key` about every 50 ms until it exists (returns ""), or until `stop()` (may
// be empty) says why the wait should end (returns its answer; the key is checked once more
// first, so a peer that wrote it and then went away still counts as having written it);
// TimeoutError(timeout_what, timeout_peer) at `deadline`.
inline std::string pollForKey(Store& store, const std::string& key, Deadline deadline, const StopCheck& stop,
                              const std::string& timeout_what, int timeout_peer) {
  for (;;) {
    if (store.check(key)) return {};
    if (stop) {
      std::string why = stop();
      if (!why.empty()) return store.check(key) ? std::string() : why;
    }
    if (Clock::now() >= deadline) throw TimeoutError(timeout_what, timeout_peer);
    std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(50), deadline - Clock::now()));
  }
}

}  // namespace xirang::transport
