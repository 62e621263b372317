// What torch.distributed's creator of a xirang group (python/xirang/_backend.py) hands to
// ProcessGroupXirang: the group's identity, labels and modes. The knobs the group reads itself
// (segment sizes, records, the transport's) come from core/env when it is created.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "core/collectives.h"

namespace xirang {

struct XirangConfig {
  std::string group_name;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // torch's default group timeout
  std::string algorithm = "auto";   // auto (XIRANG_ALGO decides), ring, direct, two_level
  std::vector<int> ring;            // ring order (group ranks); empty = 0..size-1
  std::vector<std::string> hosts;   // host label per group rank (may be empty)
  std::vector<std::string> racks;   // rack label per group rank (may be empty)
  int global_rank = 0;
  std::string stats_dir;            // XIRANG_STATS_DIR ("" = off)
  std::string run_id;
  bool elastic = false;             // XIRANG_ELASTIC / Options(elastic=True)
  double heartbeat_s = 0;           // XIRANG_HEARTBEAT_S / Options(heartbeat_s); elastic mode: must be > 0
  bool join = false;                // XIRANG_JOIN: a spare taking a dead rank's place
  // This creation's generation (core/generation.h): every store key of the group lives under
  // generation::keyNamespace(generation). Empty: the constructor runs the handshake itself.
  std::string generation;
};

// The algorithms' configuration from the knobs (XIRANG_SEGMENT_BYTES, XIRANG_SMALL_BYTES,
// XIRANG_ALGO unless cfg.algorithm chooses) and the labels: ring order and the two-level plan
// (the link is the caller's to set). `algo`: the algorithm's name, for the log. Throws c10::Error
// for a bad knob value or a ring order of the wrong size.
Comm configure(int rank, int size, const XirangConfig& cfg, std::string& algo);

// Every knob a group reads on this rank alone, parsed and range-checked as the group and its
// operations will read it: the algorithms' (configure() with `algorithm`, Options.algorithm),
// XIRANG_STATS / _STATS_CAPACITY, XIRANG_CODEC (once per process), XIRANG_SPIN_US,
// XIRANG_HANDSHAKE_TIMEOUT_MS (> 0), XIRANG_SEND_THREAD_BYTES (>= 0), XIRANG_AUTH_KEY_FILE (read) and XIRANG_SOCKET_IFNAME (an
// address on it can be bound). python/xirang/_backend.py calls it before the label exchange, so a
// bad value on one rank fails every rank at once (its peers learn it from the exchange) instead
// of failing that rank inside the constructor while its peers wait for it until the timeout.
// Throws std::invalid_argument naming the knob and the value.
void checkSettings(const std::string& algorithm);

// XIRANG_SPIN_US, checked: how long the communication thread polls for the next operation and
// Work.wait() for its operation's end before they sleep (0 to 10000 us). Throws
// std::invalid_argument naming the knob otherwise.
std::chrono::microseconds spinKnob();

}  // namespace xirang
