// The transport's exceptions. Every failure a peer, the network or a deadline causes is a
// TransportError naming the rank involved; the backend turns them into the op's error.
#pragma once

#include <stdexcept>
#include <string>

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

}  // namespace xirang::transport
